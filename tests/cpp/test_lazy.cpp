// LibTorch-only tests of adaattn::lazy_attn: the op is reached through the dispatcher, trained
// through its C++ autograd Function (q, k, v, tau and bias all get gradients), and checked in
// float64 against a naive materialised implementation differentiated by autograd.
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

// c10's glog shim defines a CHECK(cond) that aborts; Catch's CHECK must win.
#undef CHECK
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

namespace {

using LazyAttnSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const std::optional<at::Tensor>&, std::optional<double>, bool,
    const std::optional<at::Tensor>&);

c10::TypedOperatorHandle<LazyAttnSig> lazy_attn_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("adaattn::lazy_attn", "")
      .typed<LazyAttnSig>();
}

// Naive lazy attention (spec 3.2) in float64: causal bottom-right aligned, GQA by repeating kv
// heads, bias[h, i - j] for i - j < W, weights max(0, softmax + tau / (i + 1)).
at::Tensor naive_lazy(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& tau, const at::Tensor& bias, double scale) {
  const int64_t group = q.size(1) / k.size(1), lq = q.size(2), lk = k.size(2), w = bias.size(1);
  const at::Tensor ke = k.repeat_interleave(group, 1), ve = v.repeat_interleave(group, 1);
  const at::Tensor pos = torch::arange(lq, torch::kLong).unsqueeze(1) + (lk - lq);
  const at::Tensor dist = pos - torch::arange(lk, torch::kLong).unsqueeze(0);
  const at::Tensor in_table = (dist >= 0).logical_and(dist < w);
  const at::Tensor bias_ij =
      bias.to(torch::kDouble).index_select(1, dist.clamp(0, w - 1).flatten()).view({-1, lq, lk}) *
      in_table;
  at::Tensor s = torch::matmul(q, ke.transpose(-2, -1)) * scale + bias_ij;
  s = s.masked_fill(dist < 0, -std::numeric_limits<double>::infinity());
  const at::Tensor shift = tau.to(torch::kDouble).view({1, -1, 1, 1}) /
                           (pos + 1).to(torch::kDouble).view({1, 1, -1, 1});
  const at::Tensor a =
      torch::clamp_min(torch::softmax(s, -1) + shift, 0.0).masked_fill(dist < 0, 0.0);
  return torch::matmul(a, ve);
}

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).norm().item<double>() /
         b.to(torch::kDouble).norm().item<double>();
}

}  // namespace

TEST_CASE("lazy_attn float64 forward+backward of q, k, v, tau, bias; GQA, Lq < Lk", "[lazy]") {
  // Fresh CPU allocations are NaN-filled, so an output element the kernel forgets fails.
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
  at::globalContext().setDeterministicFillUninitializedMemory(true);
  torch::manual_seed(0);
  const int64_t b = 2, hq = 4, hkv = 2, lq = 70, lk = 90, d = 16, w = 20;
  const auto opts = torch::dtype(torch::kDouble);
  const at::Tensor q = torch::randn({b, hq, lq, d}, opts).requires_grad_();
  const at::Tensor k = torch::randn({b, hkv, lk, d}, opts).requires_grad_();
  const at::Tensor v = torch::randn({b, hkv, lk, d}, opts).requires_grad_();
  // tau < 0 clips some weights (stats[0] > 0 below).
  const at::Tensor tau = torch::full({hq}, -0.3, torch::kFloat).requires_grad_();
  const at::Tensor bias = (0.5 * torch::randn({hq, w}, torch::kFloat)).requires_grad_();
  const at::Tensor dout = torch::randn({b, hq, lq, d}, opts);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));

  auto [out, lse, stats] = lazy_attn_op().call(q, k, v, tau, bias, std::nullopt, std::nullopt,
                                               /*return_stats=*/true, std::nullopt);
  torch::autograd::backward({out}, {dout});

  const at::Tensor qr = q.detach().clone().requires_grad_();
  const at::Tensor kr = k.detach().clone().requires_grad_();
  const at::Tensor vr = v.detach().clone().requires_grad_();
  const at::Tensor taur = tau.detach().clone().requires_grad_();
  const at::Tensor biasr = bias.detach().clone().requires_grad_();
  torch::autograd::backward({naive_lazy(qr, kr, vr, taur, biasr, scale)}, {dout});

  REQUIRE(out.sizes() == q.sizes());
  REQUIRE(lse.scalar_type() == torch::kFloat);
  REQUIRE(stats.scalar_type() == torch::kLong);
  REQUIRE(stats.numel() == 4);
  const int64_t attended = b * hq * ((lk - lq) * lq + lq * (lq + 1) / 2);
  CHECK(stats[1].item<int64_t>() == attended);
  CHECK(stats[0].item<int64_t>() > 0);  // tau < 0 clipped some weights
  CHECK(rel_err(out, naive_lazy(q.detach(), k.detach(), v.detach(), tau, bias, scale)) < 1e-12);
  REQUIRE(k.grad().sizes() == k.sizes());  // GQA: dk/dv at Hkv heads
  REQUIRE(tau.grad().scalar_type() == torch::kFloat);
  CHECK(rel_err(q.grad(), qr.grad()) < 1e-10);
  CHECK(rel_err(k.grad(), kr.grad()) < 1e-10);
  CHECK(rel_err(v.grad(), vr.grad()) < 1e-10);
  CHECK(rel_err(tau.grad(), taur.grad()) < 1e-6);  // float32 parameter gradients
  CHECK(rel_err(bias.grad(), biasr.grad()) < 1e-6);
}

TEST_CASE("lazy_attn rejects a tau of the wrong shape with an error naming tau", "[lazy][errors]") {
  const at::Tensor q = torch::randn({1, 2, 5, 16}, torch::kDouble);
  const at::Tensor bias = torch::zeros({2, 4}, torch::kFloat);
  bool thrown = false;
  try {
    lazy_attn_op().call(q, q, q, torch::zeros({3}, torch::kFloat), bias, std::nullopt,
                        std::nullopt, false, std::nullopt);
  } catch (const c10::ValueError& e) {
    thrown = true;
    CHECK_THAT(e.msg(), Catch::StartsWith("adaattn.lazy_attn: tau must have shape [Hq] = [2]"));
  }
  CHECK(thrown);
}
