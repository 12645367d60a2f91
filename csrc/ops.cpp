// Op schemas (the single TORCH_LIBRARY of adaattn), argument validation, the CPU kernels'
// registration and the C++ autograd functions registered at the Autograd key, for the flash and
// lazy families. The linear family's implementations live in linear.cpp.
#include <torch/autograd.h>
#include <torch/library.h>

#include <limits>

#include "flash_api.h"
#include "flash_ops.h"
#include "lazy_api.h"
#include "lazy_ops.h"

namespace adaattn {

namespace {

void check_qkv_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, "adaattn: ", name, " must have 4 dims [B, H, L, D], got ", t.dim(),
              " dims (shape ", t.sizes(), ")");
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), "adaattn: ", name,
              " must be a floating tensor (float16, bfloat16, float32, float64), got ",
              t.scalar_type());
  TORCH_CHECK(t.size(-1) == 0 || t.stride(-1) == 1, "adaattn: ", name,
              " must have a contiguous last dim (stride(-1) == 1), got strides ", t.strides(),
              "; call .contiguous() on it");
}

}  // namespace

void check_flash_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& seqlens) {
  check_qkv_tensor(q, "q");
  check_qkv_tensor(k, "k");
  check_qkv_tensor(v, "v");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "adaattn: q, k and v must have the same dtype, got q ", q.scalar_type(), ", k ",
              k.scalar_type(), ", v ", v.scalar_type());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(),
              "adaattn: q, k and v must be on the same device, got q on ", q.device(), ", k on ",
              k.device(), ", v on ", v.device());
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0),
              "adaattn: batch size mismatch: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(v.size(1) == k.size(1) && v.size(2) == k.size(2),
              "adaattn: k and v must have the same heads and length, got k ", k.sizes(), ", v ",
              v.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "adaattn: the number of query heads (q.size(1) = ", q.size(1),
              ") must be a multiple of the number of kv heads (k.size(1) = ", k.size(1), ")");
  TORCH_CHECK(k.size(3) == q.size(3), "adaattn: head dim mismatch: q has D = ", q.size(3),
              ", k has D = ", k.size(3));
  TORCH_CHECK(v.size(3) == q.size(3), "adaattn: v must have the same head dim as q (Dv == D), got ",
              v.size(3), " and ", q.size(3));
  TORCH_CHECK(q.size(3) > 0 && q.size(3) <= 256, "adaattn: head dim D must be in [1, 256], got ",
              q.size(3));
  const int64_t int_max = std::numeric_limits<int>::max();
  TORCH_CHECK(q.size(2) <= int_max && k.size(2) <= int_max && q.size(0) <= int_max,
              "adaattn: sequence lengths and batch must fit in int32");
  if (seqlens.has_value()) {
    const at::Tensor& s = *seqlens;
    TORCH_CHECK(s.scalar_type() == at::kInt, "adaattn: seqlens must be int32, got ",
                s.scalar_type());
    TORCH_CHECK(s.dim() == 1 && s.size(0) == q.size(0), "adaattn: seqlens must have shape [B] = [",
                q.size(0), "], got ", s.sizes());
    TORCH_CHECK(s.device() == q.device(), "adaattn: seqlens must be on ", q.device(), ", got ",
                s.device());
  }
}

void check_flash_bwd_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out,
                            const at::Tensor& lse) {
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(),
              "adaattn: grad_out and out must have q's shape ", q.sizes(), ", got ", dout.sizes(),
              " and ", out.sizes());
  TORCH_CHECK(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "adaattn: grad_out and out must have q's dtype ", q.scalar_type());
  TORCH_CHECK(dout.size(-1) == 0 || dout.stride(-1) == 1,
              "adaattn: grad_out must have a contiguous last dim");
  TORCH_CHECK(out.size(-1) == 0 || out.stride(-1) == 1,
              "adaattn: out must have a contiguous last dim");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 3 && lse.size(0) == q.size(0) &&
                  lse.size(1) == q.size(1) && lse.size(2) == q.size(2),
              "adaattn: lse must be float32 [B, Hq, Lq]");
  TORCH_CHECK(lse.is_contiguous(), "adaattn: lse must be contiguous");
  TORCH_CHECK(dout.device() == q.device() && out.device() == q.device() &&
                  lse.device() == q.device(),
              "adaattn: grad_out, out and lse must be on q's device ", q.device());
}

FlashOptions resolve_flash_options(const at::Tensor& q, std::optional<double> softmax_scale,
                                   bool causal, int64_t window_left, int64_t window_right,
                                   bool deterministic) {
  TORCH_CHECK(window_left >= -1 && window_right >= -1,
              "adaattn: window must be (left, right) with each >= 0 or -1 (unbounded), got (",
              window_left, ", ", window_right, ")");
  const int64_t int_max = std::numeric_limits<int>::max();
  TORCH_CHECK(window_left <= int_max && window_right <= int_max,
              "adaattn: window entries must fit in int32");
  const double scale =
      softmax_scale.has_value() ? *softmax_scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  TORCH_CHECK(std::isfinite(scale), "adaattn: softmax_scale must be finite, got ", scale);
  return {scale, static_cast<int>(window_left), causal ? 0 : static_cast<int>(window_right),
          deterministic};
}

AttnParams make_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& seqlens, const FlashOptions& opt) {
  AttnParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_batch_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.q_row_stride = q.stride(2);
  p.k_batch_stride = k.stride(0);
  p.k_head_stride = k.stride(1);
  p.k_row_stride = k.stride(2);
  p.v_batch_stride = v.stride(0);
  p.v_head_stride = v.stride(1);
  p.v_row_stride = v.stride(2);
  p.batch = static_cast<int>(q.size(0));
  p.heads_q = static_cast<int>(q.size(1));
  p.heads_kv = static_cast<int>(k.size(1));
  p.len_q = static_cast<int>(q.size(2));
  p.len_k = static_cast<int>(k.size(2));
  p.head_dim = static_cast<int>(q.size(3));
  p.seqlens = seqlens.has_value() ? seqlens->data_ptr<int>() : nullptr;
  p.window_left = opt.window_left;
  p.window_right = opt.window_right;
  p.scale = opt.scale;
  p.scale_log2 = static_cast<float>(opt.scale * M_LOG2E);
  p.deterministic = opt.deterministic;
  return p;
}

void set_fwd_outputs(AttnParams& p, at::Tensor& out, at::Tensor& lse) {
  p.out = out.data_ptr();
  p.o_batch_stride = out.stride(0);
  p.o_head_stride = out.stride(1);
  p.o_row_stride = out.stride(2);
  p.lse = lse.data_ptr<float>();
}

void set_bwd_tensors(AttnParams& p, const at::Tensor& dout, const at::Tensor& out,
                     const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                     at::Tensor& delta) {
  p.out = const_cast<void*>(out.data_ptr());
  p.o_batch_stride = out.stride(0);
  p.o_head_stride = out.stride(1);
  p.o_row_stride = out.stride(2);
  p.lse = const_cast<float*>(lse.data_ptr<float>());
  p.dout = dout.data_ptr();
  p.do_batch_stride = dout.stride(0);
  p.do_head_stride = dout.stride(1);
  p.do_row_stride = dout.stride(2);
  p.dq = dq.data_ptr();
  p.dq_batch_stride = dq.stride(0);
  p.dq_head_stride = dq.stride(1);
  p.dq_row_stride = dq.stride(2);
  p.dk = dk.data_ptr();
  p.dk_batch_stride = dk.stride(0);
  p.dk_head_stride = dk.stride(1);
  p.dk_row_stride = dk.stride(2);
  p.dv = dv.data_ptr();
  p.dv_batch_stride = dv.stride(0);
  p.dv_head_stride = dv.stride(1);
  p.dv_row_stride = dv.stride(2);
  p.delta = delta.data_ptr<float>();
}

void check_lazy_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& tau, const at::Tensor& bias,
                       const std::optional<at::Tensor>& seqlens) {
  check_flash_inputs(q, k, v, seqlens);
  TORCH_CHECK(q.size(2) <= k.size(2),
              "adaattn: lazy attention needs Lq <= Lk (query row r sits at position r + Lk - Lq), "
              "got Lq = q.size(2) = ", q.size(2), " > Lk = k.size(2) = ", k.size(2));
  const int64_t heads = q.size(1);
  TORCH_CHECK(tau.scalar_type() == at::kFloat && tau.dim() == 1 && tau.size(0) == heads,
              "adaattn: tau must be a float32 tensor of shape [Hq] = [", heads, "], got ",
              tau.scalar_type(), " ", tau.sizes());
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.dim() == 2 && bias.size(0) == heads &&
                  bias.size(1) >= 1,
              "adaattn: bias must be a float32 tensor of shape [Hq, W] = [", heads,
              ", W] with W >= 1, got ", bias.scalar_type(), " ", bias.sizes());
  TORCH_CHECK(bias.size(1) <= std::numeric_limits<int>::max(),
              "adaattn: the bias window W = bias.size(1) must fit in int32, got ", bias.size(1));
  TORCH_CHECK(tau.is_contiguous(), "adaattn: tau must be contiguous; call .contiguous() on it");
  TORCH_CHECK(bias.is_contiguous(), "adaattn: bias must be contiguous; call .contiguous() on it");
  TORCH_CHECK(tau.device() == q.device(), "adaattn: tau must be on q's device ", q.device(),
              ", got ", tau.device());
  TORCH_CHECK(bias.device() == q.device(), "adaattn: bias must be on q's device ", q.device(),
              ", got ", bias.device());
}

AttnParams make_lazy_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& tau, const at::Tensor& bias,
                            const std::optional<at::Tensor>& seqlens,
                            std::optional<double> softmax_scale) {
  // Causal, bottom-right aligned: window (-1, 0). The kernels are deterministic by construction.
  const FlashOptions opt = resolve_flash_options(q, softmax_scale, /*causal=*/true,
                                                 /*window_left=*/-1, /*window_right=*/0,
                                                 /*deterministic=*/true);
  AttnParams p = make_params(q, k, v, seqlens, opt);
  p.tau = tau.data_ptr<float>();
  p.bias = bias.data_ptr<float>();
  p.bias_window = static_cast<int>(bias.size(1));
  return p;
}

namespace {

bool is_low_precision(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// CPU kernels run in fp32/fp64; fp16/bf16 inputs are computed in fp32 and cast back.
at::Tensor cpu_compute(const at::Tensor& t) {
  return is_low_precision(t.scalar_type()) ? t.to(at::kFloat) : t;
}

std::tuple<at::Tensor, at::Tensor> flash_fwd_cpu_op(const at::Tensor& q_in, const at::Tensor& k_in,
                                                    const at::Tensor& v_in,
                                                    const std::optional<at::Tensor>& seqlens,
                                                    std::optional<double> softmax_scale, bool causal,
                                                    int64_t window_left, int64_t window_right) {
  check_flash_inputs(q_in, k_in, v_in, seqlens);
  const FlashOptions opt =
      resolve_flash_options(q_in, softmax_scale, causal, window_left, window_right, false);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (q.numel() > 0) {
    AttnParams p = make_params(q, k, v, seqlens, opt);
    set_fwd_outputs(p, out, lse);
    flash_fwd_cpu(p, q.scalar_type());
  }
  return {out.to(q_in.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_bwd_cpu_op(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse,
    const std::optional<at::Tensor>& seqlens, std::optional<double> softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, bool deterministic) {
  check_flash_inputs(q_in, k_in, v_in, seqlens);
  check_flash_bwd_inputs(dout_in, q_in, out_in, lse);
  const FlashOptions opt = resolve_flash_options(q_in, softmax_scale, causal, window_left,
                                                 window_right, deterministic);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  const at::Tensor out = cpu_compute(out_in), dout = cpu_compute(dout_in);
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  at::Tensor delta = at::empty(lse.sizes(), lse.options());
  if (q.numel() > 0 && k.numel() > 0) {
    AttnParams p = make_params(q, k, v, seqlens, opt);
    set_bwd_tensors(p, dout, out, lse, dq, dk, dv, delta);
    flash_bwd_cpu(p, q.scalar_type());
  } else {
    dq.zero_();
    dk.zero_();
    dv.zero_();
  }
  const auto t = q_in.scalar_type();
  return {dq.to(t), dk.to(t), dv.to(t)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lazy_fwd_cpu_op(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& tau,
    const at::Tensor& bias, const std::optional<at::Tensor>& seqlens,
    std::optional<double> softmax_scale, bool return_stats) {
  check_lazy_inputs(q_in, k_in, v_in, tau, bias, seqlens);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  at::Tensor stats = at::zeros({return_stats ? 4 : 0}, q.options().dtype(at::kLong));
  if (q.numel() > 0) {
    AttnParams p = make_lazy_params(q, k, v, tau, bias, seqlens, softmax_scale);
    set_fwd_outputs(p, out, lse);
    p.stats = return_stats ? stats.data_ptr<int64_t>() : nullptr;
    lazy_fwd_cpu(p, q.scalar_type());
  }
  return {out.to(q_in.scalar_type()), lse, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lazy_bwd_cpu_op(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& tau, const at::Tensor& bias,
    const at::Tensor& out_in, const at::Tensor& lse, const std::optional<at::Tensor>& seqlens,
    std::optional<double> softmax_scale, bool param_grads) {
  check_lazy_inputs(q_in, k_in, v_in, tau, bias, seqlens);
  check_flash_bwd_inputs(dout_in, q_in, out_in, lse);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  const at::Tensor out = cpu_compute(out_in), dout = cpu_compute(dout_in);
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  const bool run = q.numel() > 0 && k.numel() > 0;
  // Without param_grads the kernel skips that work and the op returns zeros (fast path).
  at::Tensor dtau = run && param_grads ? at::empty_like(tau) : at::zeros_like(tau);
  at::Tensor dbias = run && param_grads ? at::empty_like(bias) : at::zeros_like(bias);
  if (run) {
    AttnParams p = make_lazy_params(q, k, v, tau, bias, seqlens, softmax_scale);
    // The CPU kernel keeps its row scratch in T (float32 is too coarse for fp64 gradients) and
    // reads neither p.delta nor p.row_g: an empty tensor stands in for the delta scratch.
    at::Tensor no_scratch = at::empty({0}, lse.options());
    set_bwd_tensors(p, dout, out, lse, dq, dk, dv, no_scratch);
    if (param_grads) {
      p.dtau = dtau.data_ptr<float>();
      p.dbias = dbias.data_ptr<float>();
    }
    lazy_bwd_cpu(p, q.scalar_type());
  } else {
    dq.zero_();
    dk.zero_();
    dv.zero_();
  }
  const auto t = q_in.scalar_type();
  return {dq.to(t), dk.to(t), dv.to(t), dtau, dbias};
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Forward: flash_fwd below autograd; backward: flash_bwd. lse is returned but not differentiable.
class FlashAttnFunction : public torch::autograd::Function<FlashAttnFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const std::optional<at::Tensor>& seqlens,
                               std::optional<double> softmax_scale, bool causal,
                               int64_t window_left, int64_t window_right, bool deterministic) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("adaattn::flash_fwd", "")
                          .typed<std::tuple<at::Tensor, at::Tensor>(
                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&, std::optional<double>, bool,
                              int64_t, int64_t)>();
    auto [out, lse] = fwd.call(q, k, v, seqlens, softmax_scale, causal, window_left, window_right);
    ctx->save_for_backward({q, k, v, out, lse, seqlens.value_or(at::Tensor())});
    ctx->saved_data["has_scale"] = softmax_scale.has_value();
    ctx->saved_data["scale"] = softmax_scale.value_or(0.0);
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["window_right"] = window_right;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& q = saved[0];
    const at::Tensor& k = saved[1];
    const at::Tensor& v = saved[2];
    const at::Tensor& out = saved[3];
    const at::Tensor& lse = saved[4];
    const std::optional<at::Tensor> seqlens =
        saved[5].defined() ? std::optional<at::Tensor>(saved[5]) : std::nullopt;
    const std::optional<double> scale =
        ctx->saved_data["has_scale"].toBool()
            ? std::optional<double>(ctx->saved_data["scale"].toDouble())
            : std::nullopt;
    at::Tensor dout = grads[0];
    if (!dout.defined()) dout = at::zeros_like(out);
    if (dout.size(-1) > 0 && dout.stride(-1) != 1) dout = dout.contiguous();
    static auto bwd = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("adaattn::flash_bwd", "")
                          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&, std::optional<double>, bool,
                              int64_t, int64_t, bool)>();
    auto [dq, dk, dv] =
        bwd.call(dout, q, k, v, out, lse, seqlens, scale, ctx->saved_data["causal"].toBool(),
                 ctx->saved_data["window_left"].toInt(), ctx->saved_data["window_right"].toInt(),
                 ctx->saved_data["deterministic"].toBool());
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> flash_attn_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& seqlens, std::optional<double> softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, bool deterministic) {
  auto res = FlashAttnFunction::apply(q, k, v, seqlens, softmax_scale, causal, window_left,
                                      window_right, deterministic);
  return {res[0], res[1]};
}

// Below autograd (inference mode, or backends reached past the Autograd key).
std::tuple<at::Tensor, at::Tensor> flash_attn_no_grad(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& seqlens, std::optional<double> softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, bool /*deterministic*/) {
  static auto fwd = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("adaattn::flash_fwd", "")
                        .typed<std::tuple<at::Tensor, at::Tensor>(
                            const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, std::optional<double>, bool, int64_t,
                            int64_t)>();
  return fwd.call(q, k, v, seqlens, softmax_scale, causal, window_left, window_right);
}

using LazyFwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const std::optional<at::Tensor>&, std::optional<double>, bool);
using LazyBwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    std::optional<double>, bool);

c10::TypedOperatorHandle<LazyFwdSig> lazy_fwd_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("adaattn::lazy_fwd", "")
                       .typed<LazyFwdSig>();
  return op;
}

// Forward: lazy_fwd below autograd; backward: lazy_bwd, which computes the tau/bias gradients
// only when one of them is needed. lse and stats are returned but not differentiable.
class LazyAttnFunction : public torch::autograd::Function<LazyAttnFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& tau, const at::Tensor& bias,
                               const std::optional<at::Tensor>& seqlens,
                               std::optional<double> softmax_scale, bool return_stats) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse, stats] =
        lazy_fwd_op().call(q, k, v, tau, bias, seqlens, softmax_scale, return_stats);
    ctx->save_for_backward({q, k, v, tau, bias, out, lse, seqlens.value_or(at::Tensor())});
    ctx->saved_data["has_scale"] = softmax_scale.has_value();
    ctx->saved_data["scale"] = softmax_scale.value_or(0.0);
    ctx->mark_non_differentiable({lse, stats});
    return {out, lse, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& out = saved[5];
    const std::optional<at::Tensor> seqlens =
        saved[7].defined() ? std::optional<at::Tensor>(saved[7]) : std::nullopt;
    const std::optional<double> scale =
        ctx->saved_data["has_scale"].toBool()
            ? std::optional<double>(ctx->saved_data["scale"].toDouble())
            : std::nullopt;
    at::Tensor dout = grads[0];
    if (!dout.defined()) dout = at::zeros_like(out);
    if (dout.size(-1) > 0 && dout.stride(-1) != 1) dout = dout.contiguous();
    const bool need_tau = ctx->needs_input_grad(3), need_bias = ctx->needs_input_grad(4);
    static auto bwd = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("adaattn::lazy_bwd", "")
                          .typed<LazyBwdSig>();
    auto [dq, dk, dv, dtau, dbias] = bwd.call(dout, saved[0], saved[1], saved[2], saved[3],
                                              saved[4], out, saved[6], seqlens, scale,
                                              need_tau || need_bias);
    return {dq, dk, dv, need_tau ? dtau : at::Tensor(), need_bias ? dbias : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> lazy_attn_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tau,
    const at::Tensor& bias, const std::optional<at::Tensor>& seqlens,
    std::optional<double> softmax_scale, bool return_stats) {
  auto res = LazyAttnFunction::apply(q, k, v, tau, bias, seqlens, softmax_scale, return_stats);
  return {res[0], res[1], res[2]};
}

// Below autograd (inference mode, or backends reached past the Autograd key).
std::tuple<at::Tensor, at::Tensor, at::Tensor> lazy_attn_no_grad(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tau,
    const at::Tensor& bias, const std::optional<at::Tensor>& seqlens,
    std::optional<double> softmax_scale, bool return_stats) {
  return lazy_fwd_op().call(q, k, v, tau, bias, seqlens, softmax_scale, return_stats);
}

}  // namespace

TORCH_LIBRARY(adaattn, m) {
  m.def(
      "flash_attn(Tensor q, Tensor k, Tensor v, Tensor? seqlens=None, float? softmax_scale=None, "
      "bool causal=False, int window_left=-1, int window_right=-1, bool deterministic=False) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "flash_fwd(Tensor q, Tensor k, Tensor v, Tensor? seqlens, float? softmax_scale, bool causal, "
      "int window_left, int window_right) -> (Tensor out, Tensor lse)");
  m.def(
      "flash_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? seqlens, float? softmax_scale, bool causal, int window_left, int window_right, "
      "bool deterministic) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  m.def(
      "lazy_attn(Tensor q, Tensor k, Tensor v, Tensor tau, Tensor bias, Tensor? seqlens=None, "
      "float? softmax_scale=None, bool return_stats=False) -> (Tensor out, Tensor lse, "
      "Tensor stats)");
  m.def(
      "lazy_fwd(Tensor q, Tensor k, Tensor v, Tensor tau, Tensor bias, Tensor? seqlens, "
      "float? softmax_scale, bool return_stats) -> (Tensor out, Tensor lse, Tensor stats)");
  m.def(
      "lazy_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor tau, Tensor bias, "
      "Tensor out, Tensor lse, Tensor? seqlens, float? softmax_scale, bool param_grads) -> "
      "(Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_tau, Tensor grad_bias)");
  m.def(
      "linear_attn(Tensor q, Tensor k, Tensor v, Tensor? initial_state=None, "
      "Tensor? cu_seqlens=None, str feature_map=\"elu\", bool causal=True, bool normalize=True) "
      "-> (Tensor out, Tensor state)");
  m.def(
      "linear_fwd(Tensor q, Tensor k, Tensor v, Tensor? initial_state, Tensor? cu_seqlens, "
      "str feature_map, bool causal, bool normalize) -> (Tensor out, Tensor state)");
  m.def(
      "linear_bwd(Tensor grad_out, Tensor? grad_state, Tensor q, Tensor k, Tensor v, "
      "Tensor? initial_state, Tensor? cu_seqlens, str feature_map, bool causal, bool normalize) "
      "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_initial_state)");
  m.def(
      "block_sparse_attn(Tensor q, Tensor k, Tensor v, Tensor kv_num_blocks, Tensor kv_indices, "
      "Tensor q_num_blocks, Tensor q_indices, int block_m=128, int block_n=128, "
      "float? softmax_scale=None, bool causal=False) -> (Tensor out, Tensor lse)");
  m.def(
      "block_sparse_fwd(Tensor q, Tensor k, Tensor v, Tensor kv_num_blocks, Tensor kv_indices, "
      "int block_m, int block_n, float? softmax_scale, bool causal) -> (Tensor out, Tensor lse)");
  m.def(
      "block_sparse_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor kv_num_blocks, Tensor kv_indices, Tensor q_num_blocks, Tensor q_indices, "
      "int block_m, int block_n, float? softmax_scale, bool causal) -> (Tensor grad_q, "
      "Tensor grad_k, Tensor grad_v)");
}

TORCH_LIBRARY_IMPL(adaattn, CPU, m) {
  m.impl("flash_fwd", &flash_fwd_cpu_op);
  m.impl("flash_bwd", &flash_bwd_cpu_op);
  m.impl("lazy_fwd", &lazy_fwd_cpu_op);
  m.impl("lazy_bwd", &lazy_bwd_cpu_op);
}

TORCH_LIBRARY_IMPL(adaattn, Autograd, m) {
  m.impl("flash_attn", &flash_attn_autograd);
  m.impl("lazy_attn", &lazy_attn_autograd);
}

TORCH_LIBRARY_IMPL(adaattn, CompositeExplicitAutograd, m) {
  m.impl("flash_attn", &flash_attn_no_grad);
  m.impl("lazy_attn", &lazy_attn_no_grad);
}

}  // namespace adaattn
