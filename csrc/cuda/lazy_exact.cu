// Exact CUDA lazy attention in fp32/fp64 (scalar arithmetic; validation and gradcheck path).
//
// Same scheme as flash_exact.cu: one warp per output row, keys (or query rows) 32 at a time.
// Forward: pass 1 computes the row's log-sum-exp, pass 2 the elastic weights; a chunk of 32 keys
// whose weights are all zero skips its P.V update. Backward: per query row, pass 1 recomputes
// lse in T, pass 2 accumulates G and Delta, pass 3 dq; per key row dk/dv; dbias and dtau are
// reduced by one warp per output element in a fixed order (deterministic, no atomics).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <cstdint>
#include <limits>

#include "../core/lazy.h"
#include "../lazy_api.h"
#include "exact_common.cuh"

namespace adaattn {
namespace {

using namespace exact;

// Per query row of the backward: lse recomputed in T, Delta and G.
constexpr int kRowStats = 3;

// Lane t's score of key n0 + t (t < count), -inf elsewhere; all lanes take part.
template <typename T, int kSlots>
__device__ __forceinline__ T chunk_score(const AttnParams& p, const T (&q_reg)[kSlots],
                                         const T* k_head, int h, int pos, int n0, int count,
                                         int lane) {
  T mine = -std::numeric_limits<T>::infinity();
  for (int t = 0; t < count; ++t) {
    const T s = warp_sum(slice_dot(q_reg, k_head + (n0 + t) * p.k_row_stride, p.head_dim, lane));
    if (lane == t) mine = s * static_cast<T>(p.scale) + static_cast<T>(lazy_bias(p, h, pos, n0 + t));
  }
  return mine;
}

// Log-sum-exp (in T) of the biased scores of a query row over its key range.
template <typename T, int kSlots>
__device__ T row_logsumexp(const AttnParams& p, const T (&q_reg)[kSlots], const T* k_head, int h,
                           int pos, KeyRange range, int lane) {
  T row_max = -std::numeric_limits<T>::infinity();
  T row_sum = 0;
  for (int n0 = range.lo; n0 < range.hi; n0 += kWarp) {
    const int count = min(kWarp, range.hi - n0);
    const T s = chunk_score(p, q_reg, k_head, h, pos, n0, count, lane);
    const T chunk_max = warp_max(s);
    const T new_max = chunk_max > row_max ? chunk_max : row_max;
    row_sum = row_sum * exact_exp(row_max - new_max) +
              warp_sum(lane < count ? exact_exp(s - new_max) : T(0));
    row_max = new_max;
  }
  return row_sum > T(0) ? static_cast<T>(row_lse(row_max, row_sum))
                        : -std::numeric_limits<T>::infinity();
}

__device__ __forceinline__ void add_count(int64_t* counter, int64_t n) {
  atomicAdd(reinterpret_cast<unsigned long long*>(counter), static_cast<unsigned long long>(n));
}

template <typename T, int kSlots>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarp) lazy_fwd_exact_kernel(const AttnParams p) {
  const int lane = threadIdx.x % kWarp;
  const int group = p.heads_q / p.heads_kv;
  const int dim = p.head_dim;
  const int64_t rows_total = row_items<false>(p);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
       row < rows_total; row += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const WorkItem ix = row_item<false>(p, row);  // lse index == row
    if (!ix.valid) continue;
    const SeqLens lens = seq_lens(p, ix.b);
    const int64_t r = lens.q_start + ix.index;  // row in the tensors
    const KeyRange range = key_range(p, lens, ix.index);
    const int pos = lazy_position(lens, ix.index);
    T q_reg[kSlots];
    load_slice(row_ptr<T>(p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride, ix.b, ix.h, r),
               dim, lane, q_reg);
    const T* k_head = row_ptr<T>(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, ix.b,
                                 ix.h / group, lens.k_start);
    const T* v_head = row_ptr<T>(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, ix.b,
                                 ix.h / group, lens.k_start);

    const T lse = row_logsumexp(p, q_reg, k_head, ix.h, pos, range, lane);
    const T shift = lazy_shift<T>(p, ix.h, pos);
    T acc[kSlots] = {};
    int64_t zeros = 0, chunks = 0, skipped = 0;
    for (int n0 = range.lo; n0 < range.hi; n0 += kWarp) {
      const int count = min(kWarp, range.hi - n0);
      const T s = chunk_score(p, q_reg, k_head, ix.h, pos, n0, count, lane);
      T weight = 0;
      if (lane < count) {
        weight = exact_exp(s - lse) + shift;
        weight = weight > T(0) ? weight : T(0);
      }
      zeros += __popc(__ballot_sync(kFullMask, lane < count && weight == T(0)));
      ++chunks;
      if (!__any_sync(kFullMask, weight > T(0))) {
        ++skipped;
        continue;
      }
      for (int t = 0; t < count; ++t) {
        slice_axpy(__shfl_sync(kFullMask, weight, t), v_head + (n0 + t) * p.v_row_stride, dim,
                   lane, acc);
      }
    }
    store_slice(acc, row_ptr<T>(p.out, p.o_batch_stride, p.o_head_stride, p.o_row_stride, ix.b,
                                ix.h, r),
                dim, lane);
    if (lane == 0) {
      p.lse[row] = static_cast<float>(lse);
      if (p.stats != nullptr && chunks > 0) {
        add_count(p.stats + 0, zeros);
        add_count(p.stats + 1, range.hi - range.lo);
        add_count(p.stats + 2, skipped);
        add_count(p.stats + 3, chunks);
      }
    }
  }
}

// Backward, one warp per query row: lse (pass 1), G and Delta = sum_j M p dA (pass 2), dq (pass 3).
template <typename T, int kSlots>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarp)
    lazy_bwd_dq_exact_kernel(const AttnParams p, T* row_stats) {
  const int lane = threadIdx.x % kWarp;
  const int group = p.heads_q / p.heads_kv;
  const int dim = p.head_dim;
  const T scale = static_cast<T>(p.scale);
  const int64_t rows_total = row_items<false>(p);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
       row < rows_total; row += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const WorkItem ix = row_item<false>(p, row);  // lse index == row
    if (!ix.valid) continue;
    const SeqLens lens = seq_lens(p, ix.b);
    const int64_t r = lens.q_start + ix.index;  // row in the tensors
    const KeyRange range = key_range(p, lens, ix.index);
    const int pos = lazy_position(lens, ix.index);
    T q_reg[kSlots], dout_reg[kSlots];
    load_slice(row_ptr<T>(p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride, ix.b, ix.h, r),
               dim, lane, q_reg);
    load_slice(row_ptr<T>(p.dout, p.do_batch_stride, p.do_head_stride, p.do_row_stride, ix.b,
                          ix.h, r),
               dim, lane, dout_reg);
    const T* k_head = row_ptr<T>(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, ix.b,
                                 ix.h / group, lens.k_start);
    const T* v_head = row_ptr<T>(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, ix.b,
                                 ix.h / group, lens.k_start);

    const T lse = row_logsumexp(p, q_reg, k_head, ix.h, pos, range, lane);
    const T shift = lazy_shift<T>(p, ix.h, pos);
    // Lane t: p, dA and M of key n0 + t.
    auto chunk = [&](int n0, int count_keys, T& prob, T& d_weight, bool& live) {
      const T s = chunk_score(p, q_reg, k_head, ix.h, pos, n0, count_keys, lane);
      d_weight = 0;
      for (int t = 0; t < count_keys; ++t) {
        const T dp = warp_sum(slice_dot(dout_reg, v_head + (n0 + t) * p.v_row_stride, dim, lane));
        if (lane == t) d_weight = dp;
      }
      prob = lane < count_keys ? exact_exp(s - lse) : T(0);
      live = lane < count_keys && prob + shift > T(0);
    };
    T g_part = 0, delta_part = 0;
    for (int n0 = range.lo; n0 < range.hi; n0 += kWarp) {
      T prob, d_weight;
      bool live;
      chunk(n0, min(kWarp, range.hi - n0), prob, d_weight, live);
      if (live) {
        g_part += d_weight;
        delta_part += prob * d_weight;
      }
    }
    const T row_g = warp_sum(g_part);
    const T delta = warp_sum(delta_part);
    T dq_acc[kSlots] = {};
    for (int n0 = range.lo; n0 < range.hi; n0 += kWarp) {
      const int count_keys = min(kWarp, range.hi - n0);
      T prob, d_weight;
      bool live;
      chunk(n0, count_keys, prob, d_weight, live);
      const T d_score = prob * ((live ? d_weight : T(0)) - delta);
      for (int t = 0; t < count_keys; ++t) {
        slice_axpy(__shfl_sync(kFullMask, d_score, t), k_head + (n0 + t) * p.k_row_stride, dim,
                   lane, dq_acc);
      }
    }
    slice_scale(scale, dq_acc);
    store_slice(dq_acc, row_ptr<T>(p.dq, p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride,
                                   ix.b, ix.h, r),
                dim, lane);
    if (lane == 0) {
      row_stats[kRowStats * row] = lse;
      row_stats[kRowStats * row + 1] = delta;
      row_stats[kRowStats * row + 2] = row_g;
    }
  }
}

// dS and the weight of (query row r at position pos, key j) from the row statistics; the key must
// be in the row's range.
template <typename T>
struct Grads {
  T d_score;
  T weight;
};

template <typename T>
__device__ __forceinline__ Grads<T> element_grads(T score, T d_weight, const T* stats, T shift) {
  const T prob = exact_exp(score - stats[0]);
  const bool live = prob + shift > T(0);
  return {prob * ((live ? d_weight : T(0)) - stats[1]), live ? prob + shift : T(0)};
}

// Backward, one warp per key row of a kv head, summing over the GQA group in a fixed order.
template <typename T, int kSlots>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarp)
    lazy_bwd_dkdv_exact_kernel(const AttnParams p, const T* row_stats) {
  const int lane = threadIdx.x % kWarp;
  const int group = p.heads_q / p.heads_kv;
  const int dim = p.head_dim;
  const T scale = static_cast<T>(p.scale);
  const int64_t keys_total = row_items<true>(p);
  for (int64_t key = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
       key < keys_total; key += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const WorkItem item = row_item<true>(p, key);
    if (!item.valid) continue;
    const int b = item.b, g = item.h, j = item.index;
    const SeqLens lens = seq_lens(p, b);
    const int64_t jt = lens.k_start + j;  // row in the tensors
    T dk_acc[kSlots] = {};
    T dv_acc[kSlots] = {};
    if (j < lens.k) {
      T k_reg[kSlots], v_reg[kSlots];
      load_slice(row_ptr<T>(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, b, g, jt),
                 dim, lane, k_reg);
      load_slice(row_ptr<T>(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, b, g, jt),
                 dim, lane, v_reg);
      const RowSpan span = rows_meeting_keys(p, lens, j, j + 1);
      for (int h = g * group; h < (g + 1) * group; ++h) {
        const T* q_head = row_ptr<T>(p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride, b,
                                     h, lens.q_start);
        const T* dout_head = row_ptr<T>(p.dout, p.do_batch_stride, p.do_head_stride,
                                        p.do_row_stride, b, h, lens.q_start);
        const T* head_stats = row_stats + kRowStats * row_stat_offset(p, lens, b, h);
        for (int r0 = span.first; r0 < span.last; r0 += kWarp) {
          const int count_rows = min(kWarp, span.last - r0);
          T my_score = 0, my_dweight = 0;  // lane t: query row r0 + t
          for (int t = 0; t < count_rows; ++t) {
            const T s = warp_sum(slice_dot(k_reg, q_head + (r0 + t) * p.q_row_stride, dim, lane));
            const T dp =
                warp_sum(slice_dot(v_reg, dout_head + (r0 + t) * p.do_row_stride, dim, lane));
            if (lane == t) {
              my_score = s;
              my_dweight = dp;
            }
          }
          Grads<T> mine{T(0), T(0)};
          if (lane < count_rows) {
            const int r = r0 + lane;
            const KeyRange range = key_range(p, lens, r);
            if (range.lo <= j && j < range.hi) {
              const int pos = lazy_position(lens, r);
              const T score = my_score * scale + static_cast<T>(lazy_bias(p, h, pos, j));
              mine = element_grads(score, my_dweight, head_stats + kRowStats * r,
                                   lazy_shift<T>(p, h, pos));
            }
          }
          for (int t = 0; t < count_rows; ++t) {
            slice_axpy(__shfl_sync(kFullMask, mine.d_score, t), q_head + (r0 + t) * p.q_row_stride,
                       dim, lane, dk_acc);
            slice_axpy(__shfl_sync(kFullMask, mine.weight, t),
                       dout_head + (r0 + t) * p.do_row_stride, dim, lane, dv_acc);
          }
        }
      }
    }
    slice_scale(scale, dk_acc);
    store_slice(dk_acc, row_ptr<T>(p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride, b,
                                   g, jt),
                dim, lane);
    store_slice(dv_acc, row_ptr<T>(p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride, b,
                                   g, jt),
                dim, lane);
  }
}

// dbias[h, d] = sum over b and rows of dS at distance d: one warp per (h, d), lane l taking
// rows l, l + 32, ... (each lane computes its own dot products; this is the validation path).
template <typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarp)
    lazy_bwd_dbias_exact_kernel(const AttnParams p, const T* row_stats) {
  const int lane = threadIdx.x % kWarp;
  const int group = p.heads_q / p.heads_kv;
  const T scale = static_cast<T>(p.scale);
  const int64_t total = static_cast<int64_t>(p.heads_q) * p.bias_window;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
       item < total; item += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const int h = static_cast<int>(item / p.bias_window);
    const int d = static_cast<int>(item % p.bias_window);
    T acc = 0;
    for (int b = 0; b < p.batch; ++b) {
      const SeqLens lens = seq_lens(p, b);
      const T* head_stats = row_stats + kRowStats * row_stat_offset(p, lens, b, h);
      for (int r = lane; r < lens.q; r += kWarp) {
        const int pos = lazy_position(lens, r);
        const int j = pos - d;
        const KeyRange range = key_range(p, lens, r);
        if (j < range.lo || j >= range.hi) continue;
        const int64_t rt = lens.q_start + r, jt = lens.k_start + j;  // rows in the tensors
        const T* q = row_ptr<T>(p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride, b, h, rt);
        const T* dout =
            row_ptr<T>(p.dout, p.do_batch_stride, p.do_head_stride, p.do_row_stride, b, h, rt);
        const T* k = row_ptr<T>(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, b,
                                h / group, jt);
        const T* v = row_ptr<T>(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, b,
                                h / group, jt);
        T s = 0, dp = 0;
        for (int c = 0; c < p.head_dim; ++c) {
          s += q[c] * k[c];
          dp += dout[c] * v[c];
        }
        const T score = s * scale + static_cast<T>(lazy_bias(p, h, pos, j));
        acc += element_grads(score, dp, head_stats + kRowStats * r, lazy_shift<T>(p, h, pos))
                   .d_score;
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) p.dbias[item] = static_cast<float>(acc);
  }
}

// dtau[h] = sum over b and rows of G_i / (i + 1): one warp per head.
template <typename T>
__global__ void lazy_bwd_dtau_exact_kernel(const AttnParams p, const T* row_stats) {
  const int lane = threadIdx.x % kWarp;
  const int h = blockIdx.x;
  T acc = 0;
  for (int b = 0; b < p.batch; ++b) {
    const SeqLens lens = seq_lens(p, b);
    const T* head_stats = row_stats + kRowStats * row_stat_offset(p, lens, b, h);
    for (int r = lane; r < lens.rows_q; r += kWarp) {
      acc += head_stats[kRowStats * r + 2] / static_cast<T>(lazy_position(lens, r) + 1);
    }
  }
  acc = warp_sum(acc);
  if (lane == 0) p.dtau[h] = static_cast<float>(acc);
}

template <typename T>
void launch_fwd(const AttnParams& p) {
  const int64_t rows_total = row_items<false>(p);
  if (rows_total == 0) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_slots(p.head_dim, [&](auto slots) {
    lazy_fwd_exact_kernel<T, decltype(slots)::value>
        <<<grid_for(rows_total), kWarpsPerBlock * kWarp, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename T>
void launch_bwd(const AttnParams& p) {
  const int64_t rows_total = row_items<false>(p);
  const int64_t keys_total = row_items<true>(p);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Stream-ordered caching allocator: freed on return, alive for the kernels queued here.
  const at::Tensor stats_buf = at::empty(
      {rows_total * kRowStats}, at::TensorOptions()
                                    .dtype(c10::CppTypeToScalarType<T>::value)
                                    .device(at::kCUDA, c10::cuda::current_device()));
  T* row_stats = static_cast<T*>(stats_buf.data_ptr());
  dispatch_slots(p.head_dim, [&](auto slots) {
    constexpr int kSlots = decltype(slots)::value;
    if (rows_total > 0) {
      lazy_bwd_dq_exact_kernel<T, kSlots>
          <<<grid_for(rows_total), kWarpsPerBlock * kWarp, 0, stream>>>(p, row_stats);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (keys_total > 0) {
      lazy_bwd_dkdv_exact_kernel<T, kSlots>
          <<<grid_for(keys_total), kWarpsPerBlock * kWarp, 0, stream>>>(p, row_stats);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  if (p.dtau == nullptr) return;
  const int64_t bias_items = static_cast<int64_t>(p.heads_q) * p.bias_window;
  lazy_bwd_dbias_exact_kernel<T>
      <<<grid_for(bias_items), kWarpsPerBlock * kWarp, 0, stream>>>(p, row_stats);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  lazy_bwd_dtau_exact_kernel<T><<<p.heads_q, kWarp, 0, stream>>>(p, row_stats);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Fn>
void dispatch_exact_dtype(c10::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case c10::kFloat:
      fn(float{});
      break;
    case c10::kDouble:
      fn(double{});
      break;
    default:
      TORCH_CHECK(false, "adaattn: the exact CUDA lazy kernel takes float32 or float64, got ",
                  dtype);
  }
}

}  // namespace

void lazy_fwd_exact_cuda(const AttnParams& p, c10::ScalarType dtype) {
  dispatch_exact_dtype(dtype, [&](auto t) { launch_fwd<decltype(t)>(p); });
}

void lazy_bwd_exact_cuda(const AttnParams& p, c10::ScalarType dtype) {
  dispatch_exact_dtype(dtype, [&](auto t) { launch_bwd<decltype(t)>(p); });
}

}  // namespace adaattn
