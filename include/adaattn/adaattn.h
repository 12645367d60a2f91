// adaattn's C++ API for LibTorch programs: typed wrappers of the dispatcher ops.
//
//   find_package(adaattn REQUIRED)                      # CMake; finds Torch as well
//   target_link_libraries(app PRIVATE adaattn::adaattn)
//
//   #include <adaattn/adaattn.h>
//   adaattn::FlashOptions opts;
//   opts.causal = true;
//   at::Tensor out = adaattn::flash_attn(q, k, v, opts);
//
// Each wrapper calls the op `adaattn::<name>` through the dispatcher, exactly as
// torch.ops.adaattn.<name> in Python: the device kernel is picked from the inputs, and the ops'
// Autograd registrations record the backward (q, k, v, and tau/bias of lazy attention, get
// gradients when they require them). Arguments, shapes, semantics and errors are those of the
// Python functions of the same names (docs/ops.md); each options struct holds their keyword
// arguments with the same defaults. Errors are c10::TypeError / c10::ValueError / c10::Error
// (std::exception) with messages starting "adaattn.<op>: ".
//
// Dense tensors are [B, H, L, D] with any strides whose last dim is contiguous; packed (varlen)
// tensors are [T, H, D] with int32 cu_seqlens [N + 1].
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

namespace adaattn {

// The library's version, e.g. "0.1.0" (adaattn.__version__ of the same source).
const char* version();

// How the library was built: "key: value" lines (cuda, archs, head dims), as
// adaattn.build_info() in Python.
std::string build_info();

namespace detail {

// The dispatcher handle of adaattn::<name>. Defined in libadaattn, so that every program calling
// a wrapper references the library: it is then linked even under -Wl,--as-needed, and its
// TORCH_LIBRARY registrations have run by the time this looks the op up.
c10::OperatorHandle find_op(const char* name);

template <class Signature>
c10::TypedOperatorHandle<Signature> typed_op(const char* name) {
  return find_op(name).typed<Signature>();
}

using OptTensor = std::optional<at::Tensor>;

}  // namespace detail

// ---- flash attention ------------------------------------------------------------------------

// Options of flash_attn / flash_attn_varlen (Python: the keyword arguments).
struct FlashOptions {
  // Query row r sees key c iff c <= r + (Lk - Lq) (bottom-right aligned).
  bool causal = false;
  // Multiplies q @ k^T; default D^-0.5.
  std::optional<double> softmax_scale = std::nullopt;
  // Sliding window (left, right) around that diagonal; -1 = unbounded.
  int64_t window_left = -1;
  int64_t window_right = -1;
  // int32 [B]: right-padded batches, rows and keys at or past seqlens[b] are padding (dense only).
  std::optional<at::Tensor> seqlens = std::nullopt;
  // Backward without order-dependent accumulation (bit-reproducible).
  bool deterministic = false;
  // s <- softcap * tanh(s / softcap) on the scaled scores; 0 = off.
  double softcap = 0.0;
  // float32 [Hq] or [B, Hq]: s -= slope * |i - j| (bottom-right aligned positions).
  std::optional<at::Tensor> alibi_slopes = std::nullopt;
  // float32 [Hq], learnable: a logit in every row's softmax denominator that attends nothing.
  std::optional<at::Tensor> sinks = std::nullopt;
  // float32 [Hq, W], learnable: s += rel_bias[h, i - j] for 0 <= i - j < W.
  std::optional<at::Tensor> rel_bias = std::nullopt;
};

// Exact softmax attention. q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] with
// Hq % Hkv == 0. Returns (out [B, Hq, Lq, Dv], lse float32 [B, Hq, Lq]).
inline std::tuple<at::Tensor, at::Tensor> flash_attn_with_lse(const at::Tensor& q,
                                                              const at::Tensor& k,
                                                              const at::Tensor& v,
                                                              const FlashOptions& opts = {}) {
  using Sig = std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const detail::OptTensor&,
      std::optional<double>, bool, int64_t, int64_t, bool, const detail::OptTensor&,
      const detail::OptTensor&, double, const detail::OptTensor&, const detail::OptTensor&,
      const detail::OptTensor&);
  static const auto op = detail::typed_op<Sig>("flash_attn");
  return op.call(q, k, v, opts.seqlens, opts.softmax_scale, opts.causal, opts.window_left,
                 opts.window_right, opts.deterministic, std::nullopt, std::nullopt, opts.softcap,
                 opts.alibi_slopes, opts.sinks, opts.rel_bias);
}

// flash_attn_with_lse's out [B, Hq, Lq, Dv].
inline at::Tensor flash_attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const FlashOptions& opts = {}) {
  return std::get<0>(flash_attn_with_lse(q, k, v, opts));
}

// Flash attention over packed sequences: q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv],
// cu_seqlens_q / cu_seqlens_k int32 [N + 1]; sequence n attends only its own keys, causal and
// window limits aligned per sequence. opts.seqlens must be empty. Returns (out [Tq, Hq, Dv],
// lse float32 [Hq, Tq]).
inline std::tuple<at::Tensor, at::Tensor> flash_attn_varlen_with_lse(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    const FlashOptions& opts = {}) {
  using Sig = std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const detail::OptTensor&,
      std::optional<double>, bool, int64_t, int64_t, bool, const detail::OptTensor&,
      const detail::OptTensor&, double, const detail::OptTensor&, const detail::OptTensor&,
      const detail::OptTensor&);
  static const auto op = detail::typed_op<Sig>("flash_attn");
  return op.call(q, k, v, opts.seqlens, opts.softmax_scale, opts.causal, opts.window_left,
                 opts.window_right, opts.deterministic, cu_seqlens_q, cu_seqlens_k, opts.softcap,
                 opts.alibi_slopes, opts.sinks, opts.rel_bias);
}

// flash_attn_varlen_with_lse's out [Tq, Hq, Dv].
inline at::Tensor flash_attn_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& cu_seqlens_q,
                                    const at::Tensor& cu_seqlens_k,
                                    const FlashOptions& opts = {}) {
  return std::get<0>(flash_attn_varlen_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, opts));
}

// ---- lazy attention -------------------------------------------------------------------------

// Options of lazy_attn / lazy_attn_varlen.
struct LazyOptions {
  // Multiplies q @ k^T; default D^-0.5.
  std::optional<double> softmax_scale = std::nullopt;
  // int32 [B]: right-padded batches (dense only).
  std::optional<at::Tensor> seqlens = std::nullopt;
};

// Lazy attention (always causal): for the query at position i and keys j <= i,
// s_ij = scale * q_i.k_j + bias[h, i - j] (no bias for i - j >= W),
// a_ij = max(0, softmax_j(s_ij) + tau[h] / (i + 1)), out_i = sum_j a_ij v_j.
// q [B, Hq, Lq, D], k and v [B, Hkv, Lk, D] (Lq <= Lk), tau float32 [Hq], bias float32 [Hq, W]
// (contiguous, on q's device). Gradients flow to q, k, v, tau and bias (float32).
// Returns (out [B, Hq, Lq, D], lse float32 [B, Hq, Lq]).
inline std::tuple<at::Tensor, at::Tensor> lazy_attn_with_lse(const at::Tensor& q,
                                                             const at::Tensor& k,
                                                             const at::Tensor& v,
                                                             const at::Tensor& tau,
                                                             const at::Tensor& bias,
                                                             const LazyOptions& opts = {}) {
  using Sig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const detail::OptTensor&, std::optional<double>, bool,
      const detail::OptTensor&);
  static const auto op = detail::typed_op<Sig>("lazy_attn");
  auto [out, lse, stats] = op.call(q, k, v, tau, bias, opts.seqlens, opts.softmax_scale,
                                   /*return_stats=*/false, std::nullopt);
  return {std::move(out), std::move(lse)};
}

// lazy_attn_with_lse's out [B, Hq, Lq, D].
inline at::Tensor lazy_attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& tau, const at::Tensor& bias,
                            const LazyOptions& opts = {}) {
  return std::get<0>(lazy_attn_with_lse(q, k, v, tau, bias, opts));
}

// Lazy attention over packed sequences: q [T, Hq, D], k and v [T, Hkv, D], cu_seqlens int32
// [N + 1] (positions, distances and the tau / (i + 1) shift are per sequence). opts.seqlens must
// be empty. Returns out [T, Hq, D].
inline at::Tensor lazy_attn_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& cu_seqlens, const at::Tensor& tau,
                                   const at::Tensor& bias, const LazyOptions& opts = {}) {
  using Sig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const detail::OptTensor&, std::optional<double>, bool,
      const detail::OptTensor&);
  static const auto op = detail::typed_op<Sig>("lazy_attn");
  return std::get<0>(op.call(q, k, v, tau, bias, opts.seqlens, opts.softmax_scale,
                             /*return_stats=*/false, cu_seqlens));
}

// ---- block-sparse attention -----------------------------------------------------------------

// A block layout in BCSR form (Python: adaattn.BlockSparseMask): element (i, j) is attended iff
// block (i / block_m, j / block_n) is listed. Batch dim B or 1, head dim Hq or 1.
struct BlockSparseMask {
  at::Tensor kv_num_blocks;  // int32 [B|1, H|1, nQ]: listed key blocks per query block
  at::Tensor kv_indices;     // int32 [B|1, H|1, nQ, nKV]: those key blocks first, ascending
  at::Tensor q_num_blocks;   // int32 [B|1, H|1, nKV]: the transposed lists (for the backward)
  at::Tensor q_indices;      // int32 [B|1, H|1, nKV, nQ]
  int64_t block_m = 128;     // 64 or 128
  int64_t block_n = 128;     // 64 or 128
  double keys_per_row = 0;   // mean listed keys per query row (bwd_mode "auto")

  // The mask of a boolean layout [B|1, H|1, nQ, nKV], on the layout's device. Reads one scalar
  // back (the mean listed keys per row), so build masks outside the hot loop.
  static BlockSparseMask from_dense(const at::Tensor& layout, int64_t block_m = 128,
                                    int64_t block_n = 128);
};

// Options of block_sparse_attn.
struct BlockSparseOptions {
  // Bottom-right aligned causal rule, combined elementwise with the layout.
  bool causal = false;
  // Multiplies q @ k^T; default D^-0.5.
  std::optional<double> softmax_scale = std::nullopt;
  // Bit-reproducible backward: "auto" then takes "two_pass" ("atomic" is rejected).
  bool deterministic = false;
  // How the CUDA fp16/bf16 backward forms dq: "two_pass" (a dq pass, no atomics), "atomic"
  // (float32 atomics in the dK/dV kernel), or "auto": two_pass when deterministic or when rows
  // list at most 768 keys on average (mask.keys_per_row), else atomic; as in Python.
  std::string bwd_mode = "auto";
  // s <- softcap * tanh(s / softcap) on the scaled scores; 0 = off.
  double softcap = 0.0;
  // float32 [Hq] or [B, Hq]: s -= slope * |i - j| (bottom-right aligned positions).
  std::optional<at::Tensor> alibi_slopes = std::nullopt;
  // float32 [Hq], learnable: a logit in every row's softmax denominator that attends nothing.
  std::optional<at::Tensor> sinks = std::nullopt;
  // float32 [Hq, W], learnable: s += rel_bias[h, i - j] for 0 <= i - j < W.
  std::optional<at::Tensor> rel_bias = std::nullopt;
};

// Softmax attention over the blocks of `mask`. q [B, Hq, Lq, D], k and v [B, Hkv, Lk, D].
// Returns (out [B, Hq, Lq, D], lse float32 [B, Hq, Lq]).
std::tuple<at::Tensor, at::Tensor> block_sparse_attn_with_lse(const at::Tensor& q,
                                                              const at::Tensor& k,
                                                              const at::Tensor& v,
                                                              const BlockSparseMask& mask,
                                                              const BlockSparseOptions& opts = {});

// block_sparse_attn_with_lse's out [B, Hq, Lq, D].
inline at::Tensor block_sparse_attn(const at::Tensor& q, const at::Tensor& k,
                                    const at::Tensor& v, const BlockSparseMask& mask,
                                    const BlockSparseOptions& opts = {}) {
  return std::get<0>(block_sparse_attn_with_lse(q, k, v, mask, opts));
}

// ---- low-rank attention ---------------------------------------------------------------------

// Options of low_rank_attn.
struct LowRankOptions {
  bool causal = false;
  // Default D^-0.5 of the full head dim D.
  std::optional<double> softmax_scale = std::nullopt;
};

// Exact softmax attention on s = scale * (q U)(k U)^T, v at full width. q [B, Hq, Lq, D],
// k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv], basis U [B, Hkv, D, R] (float32 or q's dtype; e.g. from
// Python's adaattn.rank_plan). Differentiable in q, k, v and basis. Returns out [B, Hq, Lq, Dv].
inline at::Tensor low_rank_attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& basis, const LowRankOptions& opts = {}) {
  using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, const at::Tensor&, bool,
                                                 std::optional<double>);
  static const auto op = detail::typed_op<Sig>("low_rank_attn");
  return std::get<0>(op.call(q, k, v, basis, opts.causal, opts.softmax_scale));
}

// ---- linear attention -----------------------------------------------------------------------

// Options of linear_attn.
struct LinearOptions {
  // "elu" (elu(x) + 1), "relu" or "identity".
  std::string feature_map = "elu";
  bool causal = true;
  // Divide by phi(q_t) . z_t.
  bool normalize = true;
  // int32 [N + 1]: packed sequences (q, k [T, H, D], v [T, H, Dv]).
  std::optional<at::Tensor> cu_seqlens = std::nullopt;
  // [N, H, D, Dv + normalize], float32 (float64 for float64 inputs); zeros when empty.
  std::optional<at::Tensor> initial_state = std::nullopt;
};

// Linear attention o_t = phi(q_t) S_t / (phi(q_t) . z_t). q and k [B, H, T, D], v [B, H, T, Dv]
// (or packed, see LinearOptions). Returns (out: v's shape, final state [N, H, D, Dv + normalize]);
// gradients flow from both to q, k, v and initial_state.
inline std::tuple<at::Tensor, at::Tensor> linear_attn_with_state(const at::Tensor& q,
                                                                 const at::Tensor& k,
                                                                 const at::Tensor& v,
                                                                 const LinearOptions& opts = {}) {
  using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, const detail::OptTensor&,
                                                 const detail::OptTensor&, c10::string_view,
                                                 bool, bool);
  static const auto op = detail::typed_op<Sig>("linear_attn");
  return op.call(q, k, v, opts.initial_state, opts.cu_seqlens, opts.feature_map, opts.causal,
                 opts.normalize);
}

// linear_attn_with_state's out.
inline at::Tensor linear_attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const LinearOptions& opts = {}) {
  return std::get<0>(linear_attn_with_state(q, k, v, opts));
}

// ---- KV-cache decode (inference, no gradients) ----------------------------------------------

// Options of flash_attn_with_kvcache / lazy_attn_with_kvcache.
struct KVCacheOptions {
  // int32 [B, max_pages]: a paged cache [num_pages, Hkv, page_size, D]; empty: [B, Hkv, Lmax, D].
  std::optional<at::Tensor> block_table = std::nullopt;
  // Multiplies q @ k^T; default D^-0.5.
  std::optional<double> softmax_scale = std::nullopt;
  // Flash only (lazy attention is always causal, unwindowed, uncapped).
  bool causal = true;
  int64_t window_left = -1;
  int64_t window_right = -1;
  double softcap = 0.0;
  // Key splits per (sequence, kv head) of the CUDA decode kernel; 0 chooses.
  int64_t num_splits = 0;
  // Flash only: float32 [num_pages, Hkv] scales of an 8-bit (float8_e4m3fn) paged cache, whose
  // values are cached value * scale of their page and kv head; new k/v are not appended to one.
  std::optional<at::Tensor> k_scale = std::nullopt;
  std::optional<at::Tensor> v_scale = std::nullopt;
  // Flash only, as FlashOptions' (positions: each row's in the cache): float32 [Hq] or [B, Hq]
  // ALiBi slopes, [Hq] attention sinks, [Hq, W] relative-bias table.
  std::optional<at::Tensor> alibi_slopes = std::nullopt;
  std::optional<at::Tensor> sinks = std::nullopt;
  std::optional<at::Tensor> rel_bias = std::nullopt;
  // Flash only: a low-rank key cache's basis U [B, Hkv, D, R] (float32 or q's dtype): q and the
  // scale's default stay at full width D, k_cache (and new k) hold projected keys k U [.., R],
  // and the rows attended are q U.
  std::optional<at::Tensor> q_basis = std::nullopt;
};

// Softmax attention of new query rows q [B, Hq, Lq, D] against a KV cache. With k [B, Hkv, Lq, D]
// and v [B, Hkv, Lq, Dv] given, they are first written in place into the cache at positions
// cache_seqlens[b] (int32 [B], tokens cached before this call) onwards. Returns out
// [B, Hq, Lq, Dv].
inline at::Tensor flash_attn_with_kvcache(const at::Tensor& q, at::Tensor k_cache,
                                          at::Tensor v_cache, const detail::OptTensor& k,
                                          const detail::OptTensor& v,
                                          const at::Tensor& cache_seqlens,
                                          const KVCacheOptions& opts = {}) {
  using Sig = std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, at::Tensor&, at::Tensor&, const detail::OptTensor&,
      const detail::OptTensor&, const at::Tensor&, const detail::OptTensor&,
      std::optional<double>, bool, int64_t, int64_t, double, int64_t, const detail::OptTensor&,
      const detail::OptTensor&, const detail::OptTensor&, const detail::OptTensor&,
      const detail::OptTensor&, const detail::OptTensor&);
  static const auto op = detail::typed_op<Sig>("flash_attn_with_kvcache");
  return std::get<0>(op.call(q, k_cache, v_cache, k, v, cache_seqlens, opts.block_table,
                             opts.softmax_scale, opts.causal, opts.window_left,
                             opts.window_right, opts.softcap, opts.num_splits, opts.k_scale,
                             opts.v_scale, opts.alibi_slopes, opts.sinks, opts.rel_bias,
                             opts.q_basis));
}

// Lazy attention (see lazy_attn) of new query rows against a KV cache, as
// flash_attn_with_kvcache; tau float32 [Hq], bias float32 [Hq, W]. opts.causal, window and
// softcap must keep their defaults. Returns out [B, Hq, Lq, D].
at::Tensor lazy_attn_with_kvcache(const at::Tensor& q, at::Tensor k_cache, at::Tensor v_cache,
                                  const detail::OptTensor& k, const detail::OptTensor& v,
                                  const at::Tensor& tau, const at::Tensor& bias,
                                  const at::Tensor& cache_seqlens,
                                  const KVCacheOptions& opts = {});

}  // namespace adaattn
