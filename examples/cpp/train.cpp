// Trains a one-layer LibTorch model whose attention is adaattn::lazy_attn, with the lazy
// attention parameters (tau [H], the distance-bias table [H, W]) as torch::nn parameters, and
// checks that the loss falls.
//
// Task: predict the previous token of a random sequence. The model has no position embedding,
// so only the bias table can tell the attention where the previous token is: the loss falls
// from ln(V) only if gradients reach it through the op's autograd.
//
// Usage: train [steps]  (default 80). Exits 1 when the final loss is not below a third of the
// first, or when tau or bias got no gradient.
#include <adaattn/adaattn.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>

namespace {

// Causal lazy self-attention over [B, L, C]: q/k/v/output projections, H heads of C / H dims,
// tau initialised to tau_init and the bias table [H, W] to zeros.
struct LazyAttentionImpl : torch::nn::Module {
  LazyAttentionImpl(int64_t channels, int64_t heads, int64_t window, double tau_init)
      : heads(heads),
        qkv(register_module("qkv", torch::nn::Linear(channels, 3 * channels))),
        proj(register_module("proj", torch::nn::Linear(channels, channels))),
        tau(register_parameter("tau", torch::full({heads}, tau_init))),
        bias(register_parameter("bias", torch::zeros({heads, window}))) {}

  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t b = x.size(0), l = x.size(1), c = x.size(2);
    // [B, L, 3, H, Dh] -> three [B, H, L, Dh] views (last dim contiguous: no copy needed).
    const auto parts = qkv(x).view({b, l, 3, heads, c / heads}).unbind(2);
    const torch::Tensor out = adaattn::lazy_attn(parts[0].transpose(1, 2),
                                                 parts[1].transpose(1, 2),
                                                 parts[2].transpose(1, 2), tau, bias);
    return proj(out.transpose(1, 2).reshape({b, l, c}));
  }

  int64_t heads;
  torch::nn::Linear qkv, proj;
  torch::Tensor tau, bias;
};
TORCH_MODULE(LazyAttention);

struct ModelImpl : torch::nn::Module {
  ModelImpl(int64_t vocab, int64_t channels, int64_t heads, int64_t window)
      : embed(register_module("embed", torch::nn::Embedding(vocab, channels))),
        attn(register_module("attn", LazyAttention(channels, heads, window, -1.0))),
        head(register_module("head", torch::nn::Linear(channels, vocab))) {}

  torch::Tensor forward(const torch::Tensor& tokens) {
    const torch::Tensor x = embed(tokens);
    return head(x + attn(x));
  }

  torch::nn::Embedding embed;
  LazyAttention attn;
  torch::nn::Linear head;
};
TORCH_MODULE(Model);

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::stoi(argv[1]) : 80;
  const int64_t vocab = 16, batch = 16, length = 64, channels = 32, heads = 2, window = 8;
  torch::manual_seed(0);
  const torch::Device device = torch::cuda::is_available() ? torch::kCUDA : torch::kCPU;
  std::printf("adaattn %s on %s\n%s", adaattn::version(), device.str().c_str(),
              adaattn::build_info().c_str());

  Model model(vocab, channels, heads, window);
  model->to(device);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));

  double first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    const torch::Tensor tokens = torch::randint(vocab, {batch, length + 1}, torch::kLong).to(device);
    const torch::Tensor inputs = tokens.slice(1, 1), targets = tokens.slice(1, 0, length);
    const torch::Tensor logits = model->forward(inputs);
    // Position 0 has no previous token in the input: it is left out of the loss.
    const torch::Tensor loss = torch::nn::functional::cross_entropy(
        logits.slice(1, 1).reshape({-1, vocab}), targets.slice(1, 1).reshape(-1));
    optimizer.zero_grad();
    loss.backward();
    if (step == 0) {
      const torch::Tensor tau_grad = model->attn->tau.grad(), bias_grad = model->attn->bias.grad();
      if (!tau_grad.defined() || !bias_grad.defined() || bias_grad.abs().sum().item<double>() == 0) {
        std::fprintf(stderr, "FAILED: tau or bias received no gradient\n");
        return 1;
      }
    }
    optimizer.step();
    last = loss.item<double>();
    if (step == 0) first = last;
    if (step % 10 == 0 || step == steps - 1) std::printf("step %3d  loss %.4f\n", step, last);
  }
  std::ostringstream tau;
  tau << model->attn->tau.detach().cpu().view(-1);
  std::printf("loss %.4f -> %.4f (ln V = %.4f); tau:\n%s\n", first, last,
              std::log(static_cast<double>(vocab)), tau.str().c_str());
  if (!(last < first / 3)) {
    std::fprintf(stderr, "FAILED: the loss did not fall below a third of its first value\n");
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
