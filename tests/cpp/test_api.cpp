// Tests of the public C++ API (include/adaattn/adaattn.h): each typed wrapper passes its options
// to the right schema argument (non-default options, checked in float64 against naive math or
// against another op whose equivalence is exact) and records the backward through the op's
// Autograd registration.
#include <adaattn/adaattn.h>
#include <torch/torch.h>

// c10's glog shim defines a CHECK(cond) that aborts; Catch's CHECK must win.
#undef CHECK
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

const auto kF64 = torch::dtype(torch::kDouble);
constexpr double kInf = std::numeric_limits<double>::infinity();

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).norm().item<double>() /
         b.to(torch::kDouble).norm().item<double>();
}

// Naive attention over [B, H, Lq, Lk] scores with `allowed` (broadcastable), no GQA.
at::Tensor naive(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& allowed, double scale, double softcap = 0.0) {
  at::Tensor s = torch::matmul(q, k.transpose(-2, -1)) * scale;
  if (softcap > 0) s = torch::tanh(s / softcap) * softcap;
  return torch::matmul(torch::softmax(s.masked_fill(allowed.logical_not(), -kInf), -1), v);
}

// key c visible from row r: window (left, right) around the bottom-right aligned diagonal.
at::Tensor band(int64_t lq, int64_t lk, int64_t left, int64_t right) {
  const at::Tensor diag = torch::arange(lq, torch::kLong).unsqueeze(1) + (lk - lq);
  const at::Tensor col = torch::arange(lk, torch::kLong).unsqueeze(0);
  return (col >= diag - left).logical_and(col <= diag + right);
}

std::vector<int64_t> ints(const at::Tensor& t) {
  const at::Tensor flat = t.flatten().to(torch::kLong).contiguous();
  return {flat.data_ptr<int64_t>(), flat.data_ptr<int64_t>() + flat.numel()};
}

at::Tensor randn(at::IntArrayRef shape, bool grad = false) {
  return torch::randn(shape, kF64).requires_grad_(grad);
}

}  // namespace

TEST_CASE("api: version and build_info", "[api]") {
  CHECK(std::string(adaattn::version()).find('.') != std::string::npos);
  CHECK(adaattn::build_info().rfind("cuda: ", 0) == 0);
}

TEST_CASE("api: flash_attn options reach the op; backward through autograd", "[api][flash]") {
  torch::manual_seed(0);
  const at::Tensor q = randn({2, 3, 20, 8}, true), k = randn({2, 3, 24, 8}, true),
                   v = randn({2, 3, 24, 8}, true);
  adaattn::FlashOptions opts;
  opts.causal = true;
  opts.window_left = 5;
  opts.softmax_scale = 0.7;
  opts.softcap = 2.0;
  auto [out, lse] = adaattn::flash_attn_with_lse(q, k, v, opts);
  const at::Tensor ref = naive(q, k, v, band(20, 24, 5, 0), 0.7, 2.0);
  CHECK(rel_err(out, ref) < 1e-12);
  CHECK(lse.sizes() == at::IntArrayRef({2, 3, 20}));

  const at::Tensor grads = torch::autograd::grad({out.sum()}, {q, k, v})[1];
  const at::Tensor ref_grads = torch::autograd::grad({ref.sum()}, {q, k, v})[1];
  CHECK(rel_err(grads, ref_grads) < 1e-10);

  // window_right alone (non-causal): catches swapped window arguments.
  adaattn::FlashOptions right;
  right.window_left = 0;
  right.window_right = 3;
  CHECK(rel_err(adaattn::flash_attn(q, k, v, right), naive(q, k, v, band(20, 24, 0, 3),
                                                            1.0 / std::sqrt(8.0))) < 1e-12);
}

TEST_CASE("api: flash_attn seqlens and flash_attn_varlen", "[api][flash]") {
  torch::manual_seed(1);
  const at::Tensor q = randn({2, 2, 16, 8}), k = randn({2, 2, 16, 8}), v = randn({2, 2, 16, 8});
  adaattn::FlashOptions causal;
  causal.causal = true;
  // Packed: sequence 0 = batch 0's first 10 rows, sequence 1 = batch 1's 16 rows.
  const auto pack = [](const at::Tensor& t) {
    return torch::cat({t[0].slice(1, 0, 10), t[1]}, 1).transpose(0, 1).contiguous();
  };
  const at::Tensor cu = torch::tensor({0, 10, 26}, torch::kInt);
  const at::Tensor packed = adaattn::flash_attn_varlen(pack(q), pack(k), pack(v), cu, cu, causal);
  causal.seqlens = torch::tensor({10, 16}, torch::kInt);
  const at::Tensor padded = adaattn::flash_attn(q, k, v, causal);
  CHECK(rel_err(packed, pack(padded)) < 1e-12);
  const at::Tensor first = adaattn::flash_attn(q.slice(0, 0, 1).slice(2, 0, 10),
                                               k.slice(0, 0, 1).slice(2, 0, 10),
                                               v.slice(0, 0, 1).slice(2, 0, 10),
                                               adaattn::FlashOptions{true});
  CHECK(rel_err(padded.slice(0, 0, 1).slice(2, 0, 10), first) < 1e-12);
}

TEST_CASE("api: lazy_attn and lazy_attn_varlen; tau and bias get gradients", "[api][lazy]") {
  torch::manual_seed(2);
  const at::Tensor q = randn({1, 2, 12, 8}, true), k = randn({1, 2, 12, 8}, true),
                   v = randn({1, 2, 12, 8}, true);
  const at::Tensor tau = torch::full({2}, -0.5, torch::kFloat).requires_grad_();
  const at::Tensor bias = (0.3 * torch::randn({2, 4}, torch::kFloat)).requires_grad_();
  adaattn::LazyOptions opts;
  opts.softmax_scale = 0.5;
  const at::Tensor out = adaattn::lazy_attn(q, k, v, tau, bias, opts);

  // Naive lazy attention (causal, Lq == Lk): bias[h, i - j] for i - j < W.
  const at::Tensor dist = torch::arange(12).unsqueeze(1) - torch::arange(12).unsqueeze(0);
  const at::Tensor in_table = (dist >= 0).logical_and(dist < 4);
  const at::Tensor bias_ij =
      bias.to(torch::kDouble).index_select(1, dist.clamp(0, 3).flatten()).view({1, 2, 12, 12}) *
      in_table;
  const at::Tensor s = (torch::matmul(q, k.transpose(-2, -1)) * 0.5 + bias_ij)
                           .masked_fill(dist < 0, -kInf);
  const at::Tensor shift = tau.to(torch::kDouble).view({1, -1, 1, 1}) /
                           (torch::arange(12) + 1).to(torch::kDouble).view({1, 1, -1, 1});
  const at::Tensor ref = torch::matmul(
      torch::clamp_min(torch::softmax(s, -1) + shift, 0.0).masked_fill(dist < 0, 0.0), v);
  CHECK(rel_err(out, ref) < 1e-12);

  const auto grads = torch::autograd::grad({out.sum()}, {tau, bias});
  const auto ref_grads = torch::autograd::grad({ref.sum()}, {tau, bias});
  CHECK(rel_err(grads[0], ref_grads[0]) < 1e-5);
  CHECK(rel_err(grads[1], ref_grads[1]) < 1e-5);

  const at::Tensor cu = torch::tensor({0, 12}, torch::kInt);
  const at::Tensor packed = adaattn::lazy_attn_varlen(
      q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, tau, bias, opts);
  CHECK(rel_err(packed, out[0].transpose(0, 1)) < 1e-12);
}

TEST_CASE("api: BlockSparseMask::from_dense and block_sparse_attn", "[api][block_sparse]") {
  torch::manual_seed(3);
  const int64_t l = 256, bs = 64, n = l / bs;
  const at::Tensor q = randn({1, 2, l, 16}, true), k = randn({1, 2, l, 16}, true),
                   v = randn({1, 2, l, 16}, true);
  // Block row r lists key blocks r - 1 and r, plus block 0.
  const at::Tensor idx = torch::arange(n);
  const at::Tensor layout = ((idx.unsqueeze(1) - idx.unsqueeze(0)).abs() <= 1)
                                .logical_and(idx.unsqueeze(0) <= idx.unsqueeze(1))
                                .logical_or(idx.unsqueeze(0) == 0)
                                .view({1, 1, n, n});
  const adaattn::BlockSparseMask mask = adaattn::BlockSparseMask::from_dense(layout, bs, bs);
  CHECK(ints(mask.kv_num_blocks) == std::vector<int64_t>{1, 2, 3, 3});
  CHECK(ints(mask.kv_indices[0][0][2].slice(0, 0, 3)) == std::vector<int64_t>{0, 1, 2});
  CHECK(ints(mask.q_num_blocks) == std::vector<int64_t>{4, 2, 2, 1});
  CHECK(mask.keys_per_row == Approx(9.0 * bs / 4));

  adaattn::BlockSparseOptions opts;
  opts.causal = true;
  opts.softmax_scale = 0.4;
  const at::Tensor out = adaattn::block_sparse_attn(q, k, v, mask, opts);
  const at::Tensor allowed = layout.repeat_interleave(bs, 2).repeat_interleave(bs, 3)
                                 .logical_and(band(l, l, l, 0));  // and causal
  const at::Tensor ref = naive(q, k, v, allowed, 0.4);
  CHECK(rel_err(out, ref) < 1e-12);
  const at::Tensor dq = torch::autograd::grad({out.sum()}, {q})[0];
  CHECK(rel_err(dq, torch::autograd::grad({ref.sum()}, {q})[0]) < 1e-10);

  opts.bwd_mode = "atomic";
  opts.deterministic = true;
  CHECK_THROWS_WITH(adaattn::block_sparse_attn(q, k, v, mask, opts),
                    Catch::Contains("deterministic=true contradicts bwd_mode='atomic'"));
}

TEST_CASE("api: low_rank_attn with a full identity basis is flash_attn", "[api][low_rank]") {
  torch::manual_seed(4);
  const at::Tensor q = randn({1, 2, 10, 8}), k = randn({1, 2, 10, 8}), v = randn({1, 2, 10, 8});
  const at::Tensor basis = torch::eye(8, kF64).expand({1, 2, 8, 8}).contiguous();
  adaattn::LowRankOptions opts;
  opts.causal = true;
  opts.softmax_scale = 0.9;
  adaattn::FlashOptions flash;
  flash.causal = true;
  flash.softmax_scale = 0.9;
  CHECK(rel_err(adaattn::low_rank_attn(q, k, v, basis, opts),
                adaattn::flash_attn(q, k, v, flash)) < 1e-12);
}

TEST_CASE("api: linear_attn options and state", "[api][linear]") {
  torch::manual_seed(5);
  const at::Tensor q = randn({1, 2, 9, 4}, true), k = randn({1, 2, 9, 4}), v = randn({1, 2, 9, 3});
  adaattn::LinearOptions opts;
  opts.feature_map = "identity";
  opts.causal = false;
  opts.normalize = false;
  auto [out, state] = adaattn::linear_attn_with_state(q, k, v, opts);
  const at::Tensor kv = torch::matmul(k.transpose(-2, -1), v);  // [1, 2, 4, 3]
  CHECK(rel_err(out, torch::matmul(q, kv)) < 1e-12);
  CHECK(rel_err(state, kv) < 1e-12);
  const at::Tensor dq = torch::autograd::grad({out.sum()}, {q})[0];
  CHECK(rel_err(dq, torch::matmul(torch::ones_like(out), kv.transpose(-2, -1))) < 1e-12);
  // Default options: causal, normalised elu + 1 features; the last row sees every key.
  const at::Tensor causal = adaattn::linear_attn(q, k, v);
  const at::Tensor phi_q = torch::elu(q) + 1, phi_k = torch::elu(k) + 1;
  const at::Tensor last = torch::matmul(phi_q.slice(2, 8), torch::matmul(phi_k.transpose(-2, -1), v)) /
                          torch::matmul(phi_q.slice(2, 8), phi_k.sum(2).unsqueeze(-1));
  CHECK(rel_err(causal.slice(2, 8), last) < 1e-12);
}

TEST_CASE("api: KV-cache decode wrappers append in place and match the full ops", "[api][decode]") {
  torch::manual_seed(6);
  const int64_t cached = 11, lmax = 16;
  const at::Tensor q = randn({1, 2, 1, 8}), k_new = randn({1, 2, 1, 8}),
                   v_new = randn({1, 2, 1, 8});
  const at::Tensor k_all = torch::cat({randn({1, 2, cached, 8}), k_new}, 2);
  const at::Tensor v_all = torch::cat({randn({1, 2, cached, 8}), v_new}, 2);
  const auto cache_of = [&](const at::Tensor& all) {
    at::Tensor cache = torch::zeros({1, 2, lmax, 8}, kF64);
    cache.slice(2, 0, cached).copy_(all.slice(2, 0, cached));
    return cache;
  };
  const at::Tensor lens = torch::tensor({static_cast<int>(cached)}, torch::kInt);
  at::Tensor k_cache = cache_of(k_all), v_cache = cache_of(v_all);
  adaattn::KVCacheOptions opts;
  opts.window_left = 4;
  const at::Tensor out =
      adaattn::flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, lens, opts);
  CHECK(torch::equal(k_cache.slice(2, 0, cached + 1), k_all));  // appended in place
  adaattn::FlashOptions flash;
  flash.causal = true;
  flash.window_left = 4;
  CHECK(rel_err(out, adaattn::flash_attn(q, k_all, v_all, flash)) < 1e-12);
  // ALiBi and sinks reach the op: the rows of the dense op with them.
  adaattn::KVCacheOptions scored = opts;
  scored.alibi_slopes = torch::tensor({0.5f, 0.25f});
  scored.sinks = torch::tensor({1.0f, -0.5f});
  const at::Tensor with_scores = adaattn::flash_attn_with_kvcache(
      q, k_cache, v_cache, std::nullopt, std::nullopt, lens + 1, scored);
  flash.alibi_slopes = scored.alibi_slopes;
  flash.sinks = scored.sinks;
  CHECK(rel_err(with_scores, adaattn::flash_attn(q, k_all, v_all, flash)) < 1e-12);
  CHECK(rel_err(with_scores, out) > 1e-3);
  // A low-rank key cache: keys stored as k U, q at full width with q_basis U [B, Hkv, D, R].
  const at::Tensor basis = randn({1, 2, 8, 3});
  at::Tensor k_low = torch::matmul(k_cache, basis);
  adaattn::KVCacheOptions low = opts;
  low.q_basis = basis;
  const at::Tensor low_rank = adaattn::flash_attn_with_kvcache(
      q, k_low, v_cache, std::nullopt, std::nullopt, lens + 1, low);
  adaattn::KVCacheOptions full_scale = opts;
  full_scale.softmax_scale = 1.0 / std::sqrt(8.0);  // the full head dim's, as with q_basis
  const at::Tensor projected = adaattn::flash_attn_with_kvcache(
      torch::matmul(q, basis), k_low, v_cache, std::nullopt, std::nullopt, lens + 1, full_scale);
  CHECK(rel_err(low_rank, projected) < 1e-12);

  const at::Tensor tau = torch::full({2}, -0.2, torch::kFloat);
  const at::Tensor bias = torch::randn({2, 5}, torch::kFloat);
  // The cache already holds the new token: no k/v, cache_seqlens counts it.
  const at::Tensor lazy = adaattn::lazy_attn_with_kvcache(q, k_cache, v_cache, std::nullopt,
                                                          std::nullopt, tau, bias, lens + 1);
  CHECK(rel_err(lazy, adaattn::lazy_attn(q, k_all, v_all, tau, bias)) < 1e-12);
  CHECK_THROWS_WITH(adaattn::lazy_attn_with_kvcache(q, k_cache, v_cache, std::nullopt,
                                                    std::nullopt, tau, bias, lens + 1, opts),
                    Catch::StartsWith("adaattn.lazy_attn_with_kvcache: opts.causal"));
}
