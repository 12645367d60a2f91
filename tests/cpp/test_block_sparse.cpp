// LibTorch-only tests of adaattn::block_sparse_attn: the op is reached through the dispatcher (no
// Python), trained through its C++ autograd Function, and checked in float64 against naive
// attention under the equivalent element mask. CATCH_CONFIG_MAIN lives in test_flash.cpp.
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

using BlockSparseAttnSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, int64_t, int64_t, std::optional<double>, bool,
    c10::string_view, double, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&);

c10::TypedOperatorHandle<BlockSparseAttnSig> block_sparse_attn_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("adaattn::block_sparse_attn", "")
      .typed<BlockSparseAttnSig>();
}

// BCSR lists of a bool layout [Bm, Hm, R, C]: counts [Bm, Hm, R] and indices [Bm, Hm, R, C], the
// listed columns first (what adaattn.BlockSparseMask builds in Python).
std::tuple<at::Tensor, at::Tensor> to_lists(const at::Tensor& layout) {
  const at::Tensor counts = layout.sum(-1).to(torch::kInt);
  // std::optional<bool> spelled out: a plain `true` would pick sort(self, dim, descending).
  const at::Tensor order = std::get<1>(torch::sort(layout.logical_not().to(torch::kUInt8),
                                                   std::optional<bool>(true), /*dim=*/-1));
  return {counts, order.to(torch::kInt)};
}

// Naive attention under the element mask of `layout` (blocks bm x bn), causal bottom-right
// aligned; rows that see no key give 0.
at::Tensor naive_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& layout, int64_t bm, int64_t bn, bool causal,
                           double scale) {
  const int64_t group = q.size(1) / k.size(1), lq = q.size(2), lk = k.size(2);
  const at::Tensor ke = k.repeat_interleave(group, 1), ve = v.repeat_interleave(group, 1);
  at::Tensor allowed = layout.repeat_interleave(bm, 2)
                           .slice(2, 0, lq)
                           .repeat_interleave(bn, 3)
                           .slice(3, 0, lk);
  if (causal) {
    const at::Tensor row = torch::arange(lq, torch::kLong).unsqueeze(1);
    const at::Tensor col = torch::arange(lk, torch::kLong).unsqueeze(0);
    allowed = allowed.logical_and(col <= row + (lk - lq));
  }
  at::Tensor s = torch::matmul(q, ke.transpose(-2, -1)) * scale;
  s = s.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  // Rows without keys (lse = -inf) must give 0 and zero gradients, not softmax's NaN.
  const at::Tensor lse = torch::logsumexp(s, -1, /*keepdim=*/true);
  const at::Tensor p = torch::exp(s - torch::where(torch::isfinite(lse), lse, torch::zeros_like(lse)))
                           .masked_fill(allowed.logical_not(), 0.0);
  return torch::matmul(p, ve);
}

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).norm().item<double>() /
         b.to(torch::kDouble).norm().item<double>();
}

// Per-head layout (Hm = Hq) at density 1/2, GQA 2, blocks 64 x 128.
void check_against_naive(int64_t lq, int64_t lk, bool causal) {
  // Fresh CPU allocations are NaN-filled, so an output element the kernel forgets fails.
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
  at::globalContext().setDeterministicFillUninitializedMemory(true);
  torch::manual_seed(0);
  const int64_t b = 2, hq = 4, hkv = 2, d = 16, bm = 64, bn = 128;
  const auto opts = torch::dtype(torch::kDouble);
  const at::Tensor q = torch::randn({b, hq, lq, d}, opts).requires_grad_();
  const at::Tensor k = torch::randn({b, hkv, lk, d}, opts).requires_grad_();
  const at::Tensor v = torch::randn({b, hkv, lk, d}, opts).requires_grad_();
  const at::Tensor dout = torch::randn({b, hq, lq, d}, opts);
  const at::Tensor layout = torch::rand({1, hq, (lq + bm - 1) / bm, (lk + bn - 1) / bn}) < 0.5;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  auto [kv_num, kv_idx] = to_lists(layout);
  auto [q_num, q_idx] = to_lists(layout.transpose(-1, -2));

  auto [out, lse] = block_sparse_attn_op().call(q, k, v, kv_num, kv_idx, q_num, q_idx, bm, bn,
                                                std::nullopt, causal, /*bwd_mode=*/"two_pass",
                                                /*softcap=*/0.0, std::nullopt, std::nullopt, std::nullopt);
  torch::autograd::backward({out}, {dout});

  const at::Tensor qr = q.detach().clone().requires_grad_();
  const at::Tensor kr = k.detach().clone().requires_grad_();
  const at::Tensor vr = v.detach().clone().requires_grad_();
  const at::Tensor out_ref = naive_attention(qr, kr, vr, layout, bm, bn, causal, scale);
  torch::autograd::backward({out_ref}, {dout});

  REQUIRE(out.sizes() == q.sizes());
  REQUIRE(lse.scalar_type() == torch::kFloat);
  REQUIRE(torch::isfinite(out).all().item<bool>());
  CHECK(rel_err(out, out_ref) < 1e-10);
  REQUIRE(k.grad().sizes() == k.sizes());  // GQA: dk/dv at Hkv heads
  CHECK(rel_err(q.grad(), qr.grad()) < 1e-10);
  CHECK(rel_err(k.grad(), kr.grad()) < 1e-10);
  CHECK(rel_err(v.grad(), vr.grad()) < 1e-10);
}

}  // namespace

TEST_CASE("block_sparse_attn float64 forward+backward, per-head layout, GQA, Lq != Lk",
          "[block_sparse]") {
  check_against_naive(/*lq=*/130, /*lk=*/300, /*causal=*/false);
  check_against_naive(/*lq=*/300, /*lk=*/130, /*causal=*/true);
}

TEST_CASE("block_sparse_attn names kv_indices when its shape does not fit Lk",
          "[block_sparse][errors]") {
  const at::Tensor q = torch::randn({1, 2, 100, 16}, torch::kDouble);
  const at::Tensor k = torch::randn({1, 2, 200, 16}, torch::kDouble);
  // 2 query blocks of 64, but 3 key blocks where ceil(200 / 64) = 4 are needed.
  auto [kv_num, kv_idx] = to_lists(torch::ones({1, 1, 2, 3}, torch::kBool));
  auto [q_num, q_idx] = to_lists(torch::ones({1, 1, 3, 2}, torch::kBool));
  bool thrown = false;
  try {
    block_sparse_attn_op().call(q, k, k, kv_num, kv_idx, q_num, q_idx, 64, 64, std::nullopt,
                                false, "atomic", 0.0, std::nullopt, std::nullopt, std::nullopt);
  } catch (const c10::ValueError& e) {
    thrown = true;
    CHECK_THAT(e.msg(), Catch::StartsWith("adaattn.block_sparse_attn: kv_indices must have shape"));
  }
  CHECK(thrown);
}
