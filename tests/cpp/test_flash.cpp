// LibTorch-only tests of adaattn::flash_attn: the op is reached through the dispatcher (no Python),
// trained through its C++ autograd Function, and checked in float64 against naive attention.
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

// c10's glog shim defines a CHECK(cond) that aborts; Catch's CHECK must win.
#undef CHECK
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using FlashAttnSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    std::optional<double>, bool, int64_t, int64_t, bool, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, double, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);

c10::TypedOperatorHandle<FlashAttnSig> flash_attn_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("adaattn::flash_attn", "")
      .typed<FlashAttnSig>();
}

// Naive softmax attention: GQA by repeating kv heads, causal bottom-right aligned, scores
// soft-capped when softcap > 0.
std::tuple<at::Tensor, at::Tensor> naive_attention(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, bool causal, double scale,
                                                   double softcap) {
  const int64_t group = q.size(1) / k.size(1), lq = q.size(2), lk = k.size(2);
  const at::Tensor ke = k.repeat_interleave(group, 1), ve = v.repeat_interleave(group, 1);
  at::Tensor s = torch::matmul(q, ke.transpose(-2, -1)) * scale;
  if (softcap > 0) s = torch::tanh(s / softcap) * softcap;
  if (causal) {
    const at::Tensor row = torch::arange(lq, torch::kLong).unsqueeze(1);
    const at::Tensor col = torch::arange(lk, torch::kLong).unsqueeze(0);
    s = s.masked_fill(col > row + (lk - lq), -std::numeric_limits<double>::infinity());
  }
  return {torch::matmul(torch::softmax(s, -1), ve), torch::logsumexp(s, -1)};
}

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).norm().item<double>() /
         b.to(torch::kDouble).norm().item<double>();
}

void check_against_naive(int64_t lq, int64_t lk, bool causal, double softcap = 0.0) {
  // Fresh CPU allocations are NaN-filled, so an output element the kernel forgets fails.
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
  at::globalContext().setDeterministicFillUninitializedMemory(true);
  torch::manual_seed(0);
  const int64_t b = 2, hq = 4, hkv = 2, d = 16;
  const auto opts = torch::dtype(torch::kDouble);
  const at::Tensor q = torch::randn({b, hq, lq, d}, opts).requires_grad_();
  const at::Tensor k = torch::randn({b, hkv, lk, d}, opts).requires_grad_();
  const at::Tensor v = torch::randn({b, hkv, lk, d}, opts).requires_grad_();
  const at::Tensor dout = torch::randn({b, hq, lq, d}, opts);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));

  auto [out, lse] = flash_attn_op().call(q, k, v, std::nullopt, std::nullopt, causal, -1, -1,
                                         false, std::nullopt, std::nullopt, softcap, std::nullopt,
                                         std::nullopt, std::nullopt);
  torch::autograd::backward({out}, {dout});

  const at::Tensor qr = q.detach().clone().requires_grad_();
  const at::Tensor kr = k.detach().clone().requires_grad_();
  const at::Tensor vr = v.detach().clone().requires_grad_();
  auto [out_ref, lse_ref] = naive_attention(qr, kr, vr, causal, scale, softcap);
  torch::autograd::backward({out_ref}, {dout});

  REQUIRE(out.sizes() == q.sizes());
  REQUIRE(out.scalar_type() == torch::kDouble);
  REQUIRE(lse.scalar_type() == torch::kFloat);
  CHECK(rel_err(out, out_ref) < 1e-10);
  CHECK(rel_err(lse, lse_ref) < 1e-6);  // lse is float32
  REQUIRE(q.grad().defined());
  REQUIRE(k.grad().sizes() == k.sizes());  // GQA: dk/dv at Hkv heads
  CHECK(rel_err(q.grad(), qr.grad()) < 1e-10);
  CHECK(rel_err(k.grad(), kr.grad()) < 1e-10);
  CHECK(rel_err(v.grad(), vr.grad()) < 1e-10);
}

}  // namespace

TEST_CASE("flash_attn float64 forward+backward, non-causal, GQA, Lq != Lk", "[flash]") {
  check_against_naive(/*lq=*/13, /*lk=*/37, /*causal=*/false);
  check_against_naive(/*lq=*/40, /*lk=*/9, /*causal=*/false);
}

TEST_CASE("flash_attn float64 forward+backward, causal, GQA, Lq < Lk", "[flash]") {
  check_against_naive(/*lq=*/13, /*lk=*/37, /*causal=*/true);
}

TEST_CASE("flash_attn float64 forward+backward with softcap, causal, GQA", "[flash][softcap]") {
  // Scores of scale q.k with D = 16 reach a few units: a cap of 0.5 bends every one of them.
  check_against_naive(/*lq=*/13, /*lk=*/37, /*causal=*/true, /*softcap=*/0.5);
  check_against_naive(/*lq=*/40, /*lk=*/9, /*causal=*/false, /*softcap=*/2.0);
}

TEST_CASE("flash_attn rejects a rank-3 q with an error naming q", "[flash][errors]") {
  const at::Tensor q = torch::randn({2, 5, 16}, torch::kDouble);
  const at::Tensor k = torch::randn({2, 2, 5, 16}, torch::kDouble);
  bool thrown = false;
  try {
    flash_attn_op().call(q, k, k, std::nullopt, std::nullopt, false, -1, -1, false, std::nullopt,
                         std::nullopt, 0.0, std::nullopt, std::nullopt, std::nullopt);
  } catch (const c10::ValueError& e) {
    thrown = true;
    CHECK_THAT(e.msg(), Catch::StartsWith("adaattn.flash_attn: q must have 4 dims"));
  }
  CHECK(thrown);
}

TEST_CASE("flash_attn packed (cu_seqlens) equals one dense call per sequence", "[flash][varlen]") {
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
  at::globalContext().setDeterministicFillUninitializedMemory(true);
  torch::manual_seed(0);
  const int64_t hq = 4, hkv = 2, d = 16;
  const std::vector<int> lens_q = {5, 0, 17, 1}, lens_k = {9, 3, 17, 4};
  std::vector<int> cu_q = {0}, cu_k = {0};
  for (size_t n = 0; n < lens_q.size(); ++n) {
    cu_q.push_back(cu_q.back() + lens_q[n]);
    cu_k.push_back(cu_k.back() + lens_k[n]);
  }
  const auto opts = torch::dtype(torch::kDouble);
  const at::Tensor q = torch::randn({cu_q.back(), hq, d}, opts).requires_grad_();
  const at::Tensor k = torch::randn({cu_k.back(), hkv, d}, opts).requires_grad_();
  const at::Tensor v = torch::randn({cu_k.back(), hkv, d}, opts).requires_grad_();
  const at::Tensor dout = torch::randn({cu_q.back(), hq, d}, opts);
  const at::Tensor cu_q_t = torch::tensor(cu_q, torch::kInt);
  const at::Tensor cu_k_t = torch::tensor(cu_k, torch::kInt);

  auto [out, lse] = flash_attn_op().call(q, k, v, std::nullopt, std::nullopt, /*causal=*/true,
                                         -1, -1, false, cu_q_t, cu_k_t, 0.0, std::nullopt, std::nullopt, std::nullopt);
  torch::autograd::backward({out}, {dout});
  REQUIRE(lse.sizes() == at::IntArrayRef({hq, cu_q.back()}));

  for (size_t n = 0; n < lens_q.size(); ++n) {
    if (lens_q[n] == 0) continue;
    auto dense = [](const at::Tensor& t, int a, int b) {
      return t.slice(0, a, b).transpose(0, 1).unsqueeze(0);
    };
    const at::Tensor qn = dense(q.detach(), cu_q[n], cu_q[n + 1]).requires_grad_();
    const at::Tensor kn = dense(k.detach(), cu_k[n], cu_k[n + 1]).requires_grad_();
    const at::Tensor vn = dense(v.detach(), cu_k[n], cu_k[n + 1]).requires_grad_();
    auto [out_n, lse_n] = flash_attn_op().call(qn, kn, vn, std::nullopt, std::nullopt, true, -1,
                                               -1, false, std::nullopt, std::nullopt, 0.0,
                                               std::nullopt, std::nullopt, std::nullopt);
    torch::autograd::backward({out_n}, {dense(dout, cu_q[n], cu_q[n + 1])});
    CHECK(rel_err(dense(out.detach(), cu_q[n], cu_q[n + 1]), out_n) < 1e-12);
    CHECK(rel_err(lse.slice(1, cu_q[n], cu_q[n + 1]).unsqueeze(0), lse_n) < 1e-6);
    CHECK(rel_err(dense(q.grad(), cu_q[n], cu_q[n + 1]), qn.grad()) < 1e-12);
    CHECK(rel_err(dense(k.grad(), cu_k[n], cu_k[n + 1]), kn.grad()) < 1e-12);
    CHECK(rel_err(dense(v.grad(), cu_k[n], cu_k[n + 1]), vn.grad()) < 1e-12);
  }
}
