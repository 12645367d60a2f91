// The exact CUDA attention core in fp32/fp64 (scalar arithmetic; the validation and gradcheck
// path), each kernel written once over a Variant (variants/variant.h: score modifier Mod and
// probability transform) and the mask policy (core/mask.h, core/block_sparse.h).
//
// One warp owns one output row: a query row (forward, backward dq) or a key row (backward
// dk/dv); keys (or query rows) are visited 32 at a time so that each lane evaluates one
// exponential per chunk. Register slices hold max(D, Dv) elements per row.
//   Forward, normalised transform: one online-softmax pass. Otherwise: an lse pass, then the
//   weights; a chunk of 32 keys whose weights are all zero skips its A V update (and is counted
//   in p.stats when the transform counts zeros).
//   Backward, per query row: the row statistics (lse recomputed in T; Delta = dO.o for a
//   normalised transform, else summed directly with G) and dq; per key row: dk/dv, summed over
//   the GQA group in a fixed order. Parameter gradients are reduced by one warp per output
//   element in a fixed order (deterministic, no atomics).
// Building blocks: exact_common.cuh.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <cstdint>

#include "../attention_api.h"
#include "../core/block_sparse.h"
#include "../core/mask.h"
#include "../core/seq.h"
#include "exact_common.cuh"

namespace adaattn {
namespace {

using namespace exact;

// Row statistics the backward keeps per query row, in T: lse, Delta and, for a transform with a
// per-head parameter, G.
template <typename V>
constexpr int kRowStats = V::Transform::kRowParamGrad ? 3 : 2;

// The modified score s = Mod(x) of (row position i, key j) and, when Mod's derivative is not 1,
// ds/dx in `ds_dx`. Modifiers are evaluated in double: --use_fast_math would make tanhf an
// approximation, and ds/dx = f(s) can lose digits to cancellation in fp32.
template <typename Mod, typename T>
__device__ __forceinline__ T modified_score(const AttnParams& p, int b, int h, int i, int j,
                                            T x, T& ds_dx) {
  if constexpr (Mod::kIdentity) {
    return x;
  } else {
    const double xd = static_cast<double>(x);
    const double s = Mod::template apply<double>(p, b, h, i, j, xd);
    if constexpr (!Mod::kUnitGrad) ds_dx = static_cast<T>(Mod::template grad<double>(p, xd, s));
    return static_cast<T>(s);
  }
}

// modified_score on a chunk: lane t < count holds x of key n0 + t; the other lanes keep x.
template <typename Mod, typename T>
__device__ __forceinline__ T chunk_scores(const AttnParams& p, int b, int h, int i, int n0,
                                          int count, int lane, T x, T& ds_dx) {
  if constexpr (Mod::kIdentity) {
    return x;
  } else {
    return lane < count ? modified_score<Mod>(p, b, h, i, n0 + lane, x, ds_dx) : x;
  }
}

// Log-sum-exp (in T) of a query row's scores over the keys it visits; -inf when it sees none.
// scores(n0, count) gives lane t the score of key n0 + t (-inf for t >= count).
template <typename T, typename Scores>
__device__ T row_logsumexp(const AttnParams& p, int b, int h, int row, KeyRange range, int lane,
                           Scores&& scores) {
  T row_max = kNegInf<T>;
  T row_sum = 0;
  for_each_key_span(p, b, h, row, range, [&](int lo, int hi) {
    for (int n0 = lo; n0 < hi; n0 += kWarp) {
      const int count = min(kWarp, hi - n0);
      const T s = scores(n0, count);
      const T chunk_max = warp_max(s);
      const T new_max = chunk_max > row_max ? chunk_max : row_max;
      const T base = softmax_base(new_max);
      row_sum = row_sum * exact_exp(row_max - base) +
                warp_sum(lane < count ? exact_exp(s - base) : T(0));
      row_max = new_max;
    }
  });
  return row_saw_keys(row_sum) ? static_cast<T>(row_lse(row_max, row_sum)) : kNegInf<T>;
}

// Whether key j lies in a key block listed for query row `row` (always without block lists).
__device__ __forceinline__ bool key_listed(const AttnParams& p, int b, int h, int row, int j) {
  if (p.block_kv_num == nullptr) return true;
  const BlockList list = kv_blocks(p, b, h, row / p.block_m);
  const int nb = j / p.block_n;
  for (int e = 0; e < list.count; ++e) {
    if (list.at(e) == nb) return true;
  }
  return false;
}

// Forward, one warp per query row: out and lse (and the zero-weight statistics).
template <typename V, typename T, int kSlots>
__global__ void __launch_bounds__(kThreads) attention_fwd_exact_kernel(const AttnParams p) {
  using Mod = typename V::Mod;
  using Transform = typename V::Transform;
  const int lane = threadIdx.x % kWarp;
  const int group = p.heads_q / p.heads_kv;
  const T scale = static_cast<T>(p.scale);
  for_each_warp_item(row_items<false>(p), [&](int64_t row) {
    const WorkItem item = row_item<false>(p, row);  // lse index == row
    if (!item.valid) return;
    const int b = item.b, h = item.h, r = item.index;
    const SeqLens lens = seq_lens(p, b);
    const KeyRange range = key_range(p, lens, r);
    const int pos = row_position(lens, r);
    T q_reg[kSlots];
    load_slice(q_rows<T>(p, lens, b, h, r), p.head_dim, lane, q_reg);
    const Rows<T> keys{k_rows<T>(p, lens, b, h / group, 0), p.k_row_stride, p.head_dim};
    const Rows<T> values{v_rows<T>(p, lens, b, h / group, 0), p.v_row_stride, p.head_dim_v};
    // Lane t: the score of key n0 + t (-inf for t >= count).
    auto scores = [&](int n0, int count) {
      T x = kNegInf<T>, unused;
      chunk_dot(q_reg, keys, scale, n0, count, lane, x);
      return chunk_scores<Mod>(p, b, h, pos, n0, count, lane, x, unused);
    };

    T acc[kSlots] = {};
    T lse;
    if constexpr (V::kNormalized) {
      T row_max, row_sum;
      Transform::row_init(p, h, row_max, row_sum);
      for_each_key_span(p, b, h, r, range, [&](int lo, int hi) {
        for (int n0 = lo; n0 < hi; n0 += kWarp) {
          const int count = min(kWarp, hi - n0);
          const T my_score = scores(n0, count);
          const T chunk_max = warp_max(my_score);
          const T new_max = chunk_max > row_max ? chunk_max : row_max;
          const T base = softmax_base(new_max);
          const T rescale = exact_exp(row_max - base);  // 0 on the first chunk
          const T my_weight = lane < count ? exact_exp(my_score - base) : T(0);
          row_sum = row_sum * rescale + warp_sum(my_weight);
          slice_scale(rescale, acc);
          for (int t = 0; t < count; ++t) {
            slice_axpy(__shfl_sync(kFullMask, my_weight, t), values[n0 + t], values.dim, lane,
                       acc);
          }
          row_max = new_max;
        }
      });
      // A row without a finite score keeps its sum of 0 * v_j: 0, or NaN where a value is
      // non-finite (as the reference's P V).
      const bool seen = row_saw_keys(row_sum);
#pragma unroll
      for (int s = 0; s < kSlots; ++s) acc[s] = seen ? acc[s] / row_sum : acc[s];
      lse = seen ? static_cast<T>(row_lse(row_max, row_sum)) : kNegInf<T>;
    } else {
      lse = p.lse_pass == LsePass::kGiven ? static_cast<T>(p.lse[row])
                                           : row_logsumexp<T>(p, b, h, r, range, lane, scores);
      if (p.lse_pass == LsePass::kOnly) {
        if (lane == 0) p.lse[row] = static_cast<float>(lse);
        return;
      }
      const T c = Transform::template row_term<T>(p, h, query_position(lens, r));
      int64_t attended = 0, zeros = 0, tiles = 0, skipped = 0;
      for_each_key_span(p, b, h, r, range, [&](int lo, int hi) {
        attended += hi - lo;
        for (int n0 = lo; n0 < hi; n0 += kWarp) {
          const int count = min(kWarp, hi - n0);
          const T s = scores(n0, count);
          const T weight = lane < count ? Transform::weight(prob_from_lse(s, lse), c) : T(0);
          if constexpr (Transform::kCountsZeros) {
            zeros += __popc(__ballot_sync(kFullMask, lane < count && weight == T(0)));
            ++tiles;
          }
          // A zero weight drops its key: skipping it (and the chunk's A V when all are zero)
          // is exact, and a non-finite value that no row weighs reaches no row.
          if (!__any_sync(kFullMask, weight != T(0))) {
            ++skipped;
            continue;
          }
          for (int t = 0; t < count; ++t) {
            const T w = __shfl_sync(kFullMask, weight, t);
            if (w != T(0)) slice_axpy(w, values[n0 + t], values.dim, lane, acc);
          }
        }
      });
      if constexpr (Transform::kCountsZeros) {
        if (lane == 0 && p.stats != nullptr && tiles > 0) {
          add_count(p.stats + 0, zeros);
          add_count(p.stats + 1, attended);
          add_count(p.stats + 2, skipped);
          add_count(p.stats + 3, tiles);
        }
      }
    }
    store_slice(acc, out_rows<T>(p, lens, b, h, r), p.head_dim_v, lane);
    if (lane == 0 && p.lse_pass != LsePass::kGiven) p.lse[row] = static_cast<float>(lse);
  });
}

// Backward, one warp per query row: the row statistics (lse recomputed in T: the op's float32
// lse is too coarse for fp64 gradients; Delta; G) and dq.
//   Normalised transform: Delta = dO.o, and one pass accumulates dq unnormalised and rescaled
//   like the forward accumulator. Otherwise: lse (pass 1), Delta = sum_j M p dA and G (pass 2),
//   dq (pass 3).
template <typename V, typename T, int kSlots>
__global__ void __launch_bounds__(kThreads)
    attention_bwd_dq_exact_kernel(const AttnParams p, T* row_stats) {
  using Mod = typename V::Mod;
  using Transform = typename V::Transform;
  const int lane = threadIdx.x % kWarp;
  const int group = p.heads_q / p.heads_kv;
  const T scale = static_cast<T>(p.scale);
  for_each_warp_item(row_items<false>(p), [&](int64_t row) {
    const WorkItem item = row_item<false>(p, row);  // lse index == row
    if (!item.valid) return;
    const int b = item.b, h = item.h, r = item.index;
    const SeqLens lens = seq_lens(p, b);
    const KeyRange range = key_range(p, lens, r);
    const int pos = row_position(lens, r);
    T q_reg[kSlots], dout_reg[kSlots];
    load_slice(q_rows<T>(p, lens, b, h, r), p.head_dim, lane, q_reg);
    load_slice(dout_rows<T>(p, lens, b, h, r), p.head_dim_v, lane, dout_reg);
    const Rows<T> keys{k_rows<T>(p, lens, b, h / group, 0), p.k_row_stride, p.head_dim};
    const Rows<T> values{v_rows<T>(p, lens, b, h / group, 0), p.v_row_stride, p.head_dim_v};
    // Lane t: the score s, dA and ds/dx of key n0 + t (s = -inf, dA = 0 for t >= count).
    auto chunk = [&](int n0, int count, T& s, T& d_weight, T& ds_dx) {
      T x = kNegInf<T>;
      d_weight = 0;
      ds_dx = 1;
      chunk_dot2(q_reg, keys, scale, dout_reg, values, n0, count, lane, x, d_weight);
      s = chunk_scores<Mod>(p, b, h, pos, n0, count, lane, x, ds_dx);
    };

    T dq_acc[kSlots] = {};
    T lse, delta, row_g = 0;
    if constexpr (V::kNormalized) {
      static_assert(!Transform::kRowParamGrad, "a normalised transform has no row parameter");
      T out_reg[kSlots];
      load_slice(out_rows<T>(p, lens, b, h, r), p.head_dim_v, lane, out_reg);
      T delta_part = 0;
#pragma unroll
      for (int s = 0; s < kSlots; ++s) delta_part += dout_reg[s] * out_reg[s];
      delta = warp_sum(delta_part);
      T row_max, row_sum;
      Transform::row_init(p, h, row_max, row_sum);
      for_each_key_span(p, b, h, r, range, [&](int lo, int hi) {
        for (int n0 = lo; n0 < hi; n0 += kWarp) {
          const int count = min(kWarp, hi - n0);
          T my_score, my_dweight, my_ds_dx;
          chunk(n0, count, my_score, my_dweight, my_ds_dx);
          const T chunk_max = warp_max(my_score);
          const T new_max = chunk_max > row_max ? chunk_max : row_max;
          const T base = softmax_base(new_max);
          const T rescale = exact_exp(row_max - base);
          const T my_weight = lane < count ? exact_exp(my_score - base) : T(0);
          T my_dscore = my_weight * (my_dweight - delta);
          if constexpr (!Mod::kUnitGrad) my_dscore *= my_ds_dx;
          row_sum = row_sum * rescale + warp_sum(my_weight);
          slice_scale(rescale, dq_acc);
          for (int t = 0; t < count; ++t) {
            slice_axpy(__shfl_sync(kFullMask, my_dscore, t), keys[n0 + t], keys.dim, lane,
                       dq_acc);
          }
          row_max = new_max;
        }
      });
      // Unseen: the sum of 0 * k_j, as in the forward.
      const bool seen = row_saw_keys(row_sum);
#pragma unroll
      for (int s = 0; s < kSlots; ++s) dq_acc[s] = (seen ? dq_acc[s] / row_sum : dq_acc[s]) * scale;
      lse = seen ? static_cast<T>(row_lse(row_max, row_sum)) : kNegInf<T>;
    } else {
      // A block of a sharded row (LsePass::kOnly / kGiven) takes the whole row's lse.
      lse = p.row_pass != LsePass::kCompute
                ? static_cast<T>(p.lse[row])
                : row_logsumexp<T>(p, b, h, r, range, lane, [&](int n0, int count) {
                    T x = kNegInf<T>, unused;
                    chunk_dot(q_reg, keys, scale, n0, count, lane, x);
                    return chunk_scores<Mod>(p, b, h, pos, n0, count, lane, x, unused);
                  });
      const int i_pos = query_position(lens, r);
      const T c = Transform::template row_term<T>(p, h, i_pos);
      if (p.row_pass == LsePass::kGiven) {
        delta = static_cast<T>(p.delta[row]);
      } else {
        T g_part = 0, delta_part = 0;
        for_each_key_span(p, b, h, r, range, [&](int lo, int hi) {
          for (int n0 = lo; n0 < hi; n0 += kWarp) {
            const int count = min(kWarp, hi - n0);
            T s, d_weight, ds_dx;
            chunk(n0, count, s, d_weight, ds_dx);
            const T prob = prob_from_lse(s, lse);
            if (lane < count && Transform::live(prob, c)) {
              if constexpr (Transform::kRowParamGrad) g_part += d_weight;
              delta_part += prob * d_weight;
            }
          }
        });
        delta = warp_sum(delta_part);
        if constexpr (Transform::kRowParamGrad) row_g = warp_sum(g_part);
      }
      if (p.row_pass == LsePass::kOnly) {
        if (lane == 0) {
          p.delta[row] = static_cast<float>(delta);
          p.row_g[row] = static_cast<float>(
              row_g * Transform::template row_term_grad<T>(p, i_pos));
        }
        return;
      }
      for_each_key_span(p, b, h, r, range, [&](int lo, int hi) {
        for (int n0 = lo; n0 < hi; n0 += kWarp) {
          const int count = min(kWarp, hi - n0);
          T s, d_weight, ds_dx;
          chunk(n0, count, s, d_weight, ds_dx);
          T d_score = 0;
          if (lane < count) {
            const T prob = prob_from_lse(s, lse);
            d_score = prob * ((Transform::live(prob, c) ? d_weight : T(0)) - delta);
            if constexpr (!Mod::kUnitGrad) d_score *= ds_dx;
          }
          for (int t = 0; t < count; ++t) {
            slice_axpy(__shfl_sync(kFullMask, d_score, t), keys[n0 + t], keys.dim, lane, dq_acc);
          }
        }
      });
      slice_scale(scale, dq_acc);
    }
    store_slice(dq_acc, dq_rows<T>(p, lens, b, h, r), p.head_dim, lane);
    if (lane == 0) {
      T* stats = row_stats + kRowStats<V> * row;
      stats[0] = lse;
      stats[1] = delta;
      if constexpr (Transform::kRowParamGrad) stats[2] = row_g;
    }
  });
}

// Backward, one warp per key row of a kv head: sums over the group's query heads and the query
// rows that see the key, so dk/dv are written once each, in a fixed order.
template <typename V, typename T, int kSlots>
__global__ void __launch_bounds__(kThreads)
    attention_bwd_dkdv_exact_kernel(const AttnParams p, const T* row_stats) {
  using Mod = typename V::Mod;
  using Transform = typename V::Transform;
  const int lane = threadIdx.x % kWarp;
  const int group = p.heads_q / p.heads_kv;
  const T scale = static_cast<T>(p.scale);
  for_each_warp_item(row_items<true>(p), [&](int64_t key) {
    const WorkItem item = row_item<true>(p, key);
    if (!item.valid) return;
    const int b = item.b, g = item.h, j = item.index;
    const SeqLens lens = seq_lens(p, b);
    T dk_acc[kSlots] = {};
    T dv_acc[kSlots] = {};
    // Padding keys (j >= lens.k) are seen by no row and keep zero gradients.
    if (j < lens.k) {
      T k_reg[kSlots], v_reg[kSlots];
      load_slice(k_rows<T>(p, lens, b, g, j), p.head_dim, lane, k_reg);
      load_slice(v_rows<T>(p, lens, b, g, j), p.head_dim_v, lane, v_reg);
      const RowSpan span = rows_meeting_keys(p, lens, j, j + 1);
      for (int h = g * group; h < (g + 1) * group; ++h) {
        const Rows<T> queries{q_rows<T>(p, lens, b, h, 0), p.q_row_stride, p.head_dim};
        const Rows<T> douts{dout_rows<T>(p, lens, b, h, 0), p.do_row_stride, p.head_dim_v};
        const T* head_stats = row_stats + kRowStats<V> * row_stat_offset(p, lens, b, h);
        for_each_row_span(p, b, h, j, span, [&](int first, int last) {
          for (int i0 = first; i0 < last; i0 += kWarp) {
            const int count = min(kWarp, last - i0);
            T my_x = 0, my_dweight = 0;  // lane t: query row i0 + t
            chunk_dot2(k_reg, queries, scale, v_reg, douts, i0, count, lane, my_x, my_dweight);
            T my_weight = 0, my_dscore = 0;
            if (lane < count) {
              const int i = i0 + lane;
              const KeyRange range = key_range(p, lens, i);
              if (range.lo <= j && j < range.hi) {
                const int pos = row_position(lens, i);
                T ds_dx = 1;
                const T s = modified_score<Mod>(p, b, h, pos, j, my_x, ds_dx);
                const T* stats = head_stats + kRowStats<V> * i;
                const T prob = prob_from_lse(s, stats[0]);
                const T c = Transform::template row_term<T>(p, h, query_position(lens, i));
                my_weight = Transform::weight(prob, c);
                my_dscore = prob * ((Transform::live(prob, c) ? my_dweight : T(0)) - stats[1]);
                if constexpr (!Mod::kUnitGrad) my_dscore *= ds_dx;
              }
            }
            for (int t = 0; t < count; ++t) {
              slice_axpy(__shfl_sync(kFullMask, my_dscore, t), queries[i0 + t], queries.dim, lane,
                         dk_acc);
              slice_axpy(__shfl_sync(kFullMask, my_weight, t), douts[i0 + t], douts.dim, lane,
                         dv_acc);
            }
          }
        });
      }
    }
    slice_scale(scale, dk_acc);
    store_slice(dk_acc, dk_rows<T>(p, lens, b, g, j), p.head_dim, lane);
    store_slice(dv_acc, dv_rows<T>(p, lens, b, g, j), p.head_dim_v, lane);
  });
}

// The score modifier's table gradient: entry (h, slot) sums dS (the gradient of the score the
// table is added to) over b and the visited (row, key) pairs that read it. One warp per entry,
// lane l taking rows l, l + 32, ... (each lane computes its own dot products; this is the
// validation path).
template <typename V, typename T>
__global__ void __launch_bounds__(kThreads)
    attention_bwd_table_grad_exact_kernel(const AttnParams p, const T* row_stats) {
  using Mod = typename V::Mod;
  using Transform = typename V::Transform;
  const int lane = threadIdx.x % kWarp;
  const int group = p.heads_q / p.heads_kv;
  const T scale = static_cast<T>(p.scale);
  const int entries = Mod::param_count(p);
  float* grad = Mod::param_grad_out(p);
  for_each_warp_item(static_cast<int64_t>(p.heads_q) * entries, [&](int64_t item) {
    const int h = static_cast<int>(item / entries);
    const int slot = static_cast<int>(item % entries);
    T acc = 0;
    for (int b = 0; b < p.batch; ++b) {
      const SeqLens lens = seq_lens(p, b);
      const T* head_stats = row_stats + kRowStats<V> * row_stat_offset(p, lens, b, h);
      for (int r = lane; r < lens.q; r += kWarp) {
        const int pos = row_position(lens, r);
        const int j = Mod::param_key(p, pos, slot);
        const KeyRange range = key_range(p, lens, r);
        if (j < range.lo || j >= range.hi || !key_listed(p, b, h, r, j)) continue;
        const T* q = q_rows<T>(p, lens, b, h, r);
        const T* dout = dout_rows<T>(p, lens, b, h, r);
        const T* k = k_rows<T>(p, lens, b, h / group, j);
        const T* v = v_rows<T>(p, lens, b, h / group, j);
        T dot = 0, d_weight = 0;
        for (int c = 0; c < p.head_dim; ++c) dot += q[c] * k[c];
        for (int c = 0; c < p.head_dim_v; ++c) d_weight += dout[c] * v[c];
        T unused;
        const T s = modified_score<Mod>(p, b, h, pos, j, dot * scale, unused);
        const T* stats = head_stats + kRowStats<V> * r;
        const T prob = prob_from_lse(s, stats[0]);
        const T c = Transform::template row_term<T>(p, h, query_position(lens, r));
        acc += prob * ((Transform::live(prob, c) ? d_weight : T(0)) - stats[1]);
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) grad[item] = static_cast<float>(acc);
  });
}

// The transform's per-head parameter gradient: sum over b and rows of G_i * row_term_grad(i).
// One warp per head.
template <typename V, typename T>
__global__ void attention_bwd_row_grad_exact_kernel(const AttnParams p, const T* row_stats) {
  using Transform = typename V::Transform;
  const int lane = threadIdx.x % kWarp;
  const int h = blockIdx.x;
  T acc = 0;
  for (int b = 0; b < p.batch; ++b) {
    const SeqLens lens = seq_lens(p, b);
    const T* head_stats = row_stats + kRowStats<V> * row_stat_offset(p, lens, b, h);
    for (int r = lane; r < lens.q; r += kWarp) {
      acc += head_stats[kRowStats<V> * r + 2] *
             Transform::template row_term_grad<T>(p, query_position(lens, r));
    }
  }
  acc = warp_sum(acc);
  if (lane == 0) Transform::param_grad_out(p)[h] = static_cast<float>(acc);
}

// The transform's per-head parameter gradient from each row's finished lse and Delta:
// the sum over b and rows of lse_param_term. One warp per head, fixed order.
template <typename V, typename T>
__global__ void attention_bwd_lse_grad_exact_kernel(const AttnParams p, const T* row_stats) {
  using Transform = typename V::Transform;
  const int lane = threadIdx.x % kWarp;
  const int h = blockIdx.x;
  T acc = 0;
  for (int b = 0; b < p.batch; ++b) {
    const SeqLens lens = seq_lens(p, b);
    const T* head_stats = row_stats + kRowStats<V> * row_stat_offset(p, lens, b, h);
    // Padding rows (o = 0, Delta = 0) add nothing.
    for (int r = lane; r < lens.q; r += kWarp) {
      const T* stats = head_stats + kRowStats<V> * r;
      acc += Transform::lse_param_term(p, h, stats[0], stats[1]);
    }
  }
  acc = warp_sum(acc);
  if (lane == 0) Transform::lse_param_grad_out(p)[h] = static_cast<float>(acc);
}

template <typename V, typename T>
void launch_fwd(const AttnParams& p) {
  const int64_t rows_total = row_items<false>(p);
  if (rows_total == 0) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_slots(std::max(p.head_dim, p.head_dim_v), [&](auto slots) {
    attention_fwd_exact_kernel<V, T, decltype(slots)::value>
        <<<grid_for(rows_total), kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename V, typename T>
void launch_bwd(const AttnParams& p) {
  using Mod = typename V::Mod;
  using Transform = typename V::Transform;
  const bool table_grad = Mod::kParamGrad && Mod::wants_param_grad(p);
  const bool row_grad = Transform::kRowParamGrad && Transform::wants_param_grad(p) &&
                        p.row_pass == LsePass::kCompute;
  bool lse_grad = false;
  if constexpr (Transform::kLseParamGrad) lse_grad = Transform::wants_lse_param_grad(p);
  const int64_t rows_total = row_items<false>(p);
  const int64_t keys_total = row_items<true>(p);
  if (rows_total == 0 && keys_total == 0 && !table_grad && !row_grad && !lse_grad) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Freed when this function returns; the stream-ordered caching allocator keeps it alive for
  // the kernels queued on this stream.
  const at::Tensor stats_buf =
      at::empty({rows_total * kRowStats<V>}, at::TensorOptions()
                                                 .dtype(c10::CppTypeToScalarType<T>::value)
                                                 .device(at::kCUDA, c10::cuda::current_device()));
  T* row_stats = static_cast<T*>(stats_buf.data_ptr());
  dispatch_slots(std::max(p.head_dim, p.head_dim_v), [&](auto slots) {
    constexpr int kSlots = decltype(slots)::value;
    if (rows_total > 0) {
      attention_bwd_dq_exact_kernel<V, T, kSlots>
          <<<grid_for(rows_total), kThreads, 0, stream>>>(p, row_stats);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (keys_total > 0 && p.row_pass != LsePass::kOnly) {
      attention_bwd_dkdv_exact_kernel<V, T, kSlots>
          <<<grid_for(keys_total), kThreads, 0, stream>>>(p, row_stats);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  if (p.row_pass == LsePass::kOnly) return;
  if constexpr (Mod::kParamGrad) {
    const int64_t entries = static_cast<int64_t>(p.heads_q) * Mod::param_count(p);
    if (table_grad && entries > 0) {
      attention_bwd_table_grad_exact_kernel<V, T>
          <<<grid_for(entries), kThreads, 0, stream>>>(p, row_stats);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  if constexpr (Transform::kRowParamGrad) {
    if (row_grad && p.heads_q > 0) {
      attention_bwd_row_grad_exact_kernel<V, T><<<p.heads_q, kWarp, 0, stream>>>(p, row_stats);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  if constexpr (Transform::kLseParamGrad) {
    if (lse_grad && p.heads_q > 0) {
      attention_bwd_lse_grad_exact_kernel<V, T><<<p.heads_q, kWarp, 0, stream>>>(p, row_stats);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
}

}  // namespace

void attention_fwd_exact_cuda(VariantId variant, const AttnParams& p, c10::ScalarType dtype) {
  with_variant(variant, [&](auto v) {
    dispatch_exact_dtype(dtype, [&](auto t) { launch_fwd<decltype(v), decltype(t)>(p); });
  });
}

void attention_bwd_exact_cuda(VariantId variant, const AttnParams& p, c10::ScalarType dtype) {
  with_variant(variant, [&](auto v) {
    dispatch_exact_dtype(dtype, [&](auto t) { launch_bwd<decltype(v), decltype(t)>(p); });
  });
}

}  // namespace adaattn
