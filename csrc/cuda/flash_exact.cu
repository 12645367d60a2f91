// Exact CUDA flash attention in fp32/fp64 (scalar arithmetic; validation and gradcheck path).
//
// One warp owns one output row: a query row (forward, backward dq) or a key row (backward
// dk/dv); keys (or query rows) are visited 32 at a time so that each lane evaluates one
// exponential per chunk. Register slices hold max(D, Dv) elements per row. Building blocks:
// exact_common.cuh.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../core/block_sparse.h"
#include "../core/mask.h"
#include "../flash_api.h"
#include "exact_common.cuh"

namespace adaattn {
namespace {

using namespace exact;

// One warp per query row: online softmax over the row's key range.
template <typename T, int kSlots>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarp)
    flash_fwd_exact_kernel(const AttnParams p) {
  const int lane = threadIdx.x % kWarp;
  const int group = p.heads_q / p.heads_kv;
  const int dim = p.head_dim;
  const int dim_v = p.head_dim_v;
  const T scale = static_cast<T>(p.scale);
  const int64_t rows_total = row_items<false>(p);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
       row < rows_total; row += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const WorkItem item = row_item<false>(p, row);  // lse index == row
    if (!item.valid) continue;
    const int b = item.b, h = item.h;
    const int g = h / group;
    const SeqLens lens = seq_lens(p, b);
    const int64_t i = lens.q_start + item.index;  // row in the tensors
    const KeyRange range = key_range(p, lens, item.index);

    T q_reg[kSlots];
    load_slice(row_ptr<T>(p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride, b, h, i), dim,
               lane, q_reg);
    const T* k_head =
        row_ptr<T>(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, b, g, lens.k_start);
    const T* v_head =
        row_ptr<T>(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, b, g, lens.k_start);

    T acc[kSlots] = {};
    T row_max = -std::numeric_limits<T>::infinity();
    T row_sum = 0;
    for_each_key_span(p, b, h, item.index, range, [&](int lo, int hi) {
      for (int n0 = lo; n0 < hi; n0 += kWarp) {
        const int count = min(kWarp, hi - n0);
        T my_score = -std::numeric_limits<T>::infinity();  // lane t: score of key n0 + t
        for (int t = 0; t < count; ++t) {
          const T s = warp_sum(slice_dot(q_reg, k_head + (n0 + t) * p.k_row_stride, dim, lane));
          if (lane == t) my_score = s * scale;
        }
        const T chunk_max = warp_max(my_score);
        const T new_max = chunk_max > row_max ? chunk_max : row_max;
        const T rescale = exact_exp(row_max - new_max);  // 0 on the first chunk (row_max = -inf)
        const T my_weight = lane < count ? exact_exp(my_score - new_max) : T(0);
        row_sum = row_sum * rescale + warp_sum(my_weight);
        slice_scale(rescale, acc);
        for (int t = 0; t < count; ++t) {
          const T weight = __shfl_sync(kFullMask, my_weight, t);
          slice_axpy(weight, v_head + (n0 + t) * p.v_row_stride, dim_v, lane, acc);
        }
        row_max = new_max;
      }
    });

    const bool seen = row_sum > T(0);
    T* out_row = row_ptr<T>(p.out, p.o_batch_stride, p.o_head_stride, p.o_row_stride, b, h, i);
#pragma unroll
    for (int s = 0; s < kSlots; ++s) acc[s] = seen ? acc[s] / row_sum : T(0);
    store_slice(acc, out_row, dim_v, lane);
    if (lane == 0) {
      p.lse[row] = seen ? static_cast<float>(row_lse(row_max, row_sum))
                        : -std::numeric_limits<float>::infinity();
    }
  }
}

// Backward pass 1, one warp per query row: recomputes the row's log-sum-exp in T (the op's
// float32 lse is too coarse for fp64 gradients) while accumulating dq unnormalised and rescaled
// like the forward accumulator; stores (lse, Delta) for pass 2.
template <typename T, int kSlots>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarp)
    flash_bwd_dq_exact_kernel(const AttnParams p, T* row_stats) {
  const int lane = threadIdx.x % kWarp;
  const int group = p.heads_q / p.heads_kv;
  const int dim = p.head_dim;
  const int dim_v = p.head_dim_v;
  const T scale = static_cast<T>(p.scale);
  const int64_t rows_total = row_items<false>(p);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
       row < rows_total; row += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const WorkItem item = row_item<false>(p, row);  // lse index == row
    if (!item.valid) continue;
    const int b = item.b, h = item.h;
    const int g = h / group;
    const SeqLens lens = seq_lens(p, b);
    const int64_t i = lens.q_start + item.index;  // row in the tensors
    const KeyRange range = key_range(p, lens, item.index);

    T q_reg[kSlots], dout_reg[kSlots], out_reg[kSlots];
    load_slice(row_ptr<T>(p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride, b, h, i), dim,
               lane, q_reg);
    load_slice(row_ptr<T>(p.dout, p.do_batch_stride, p.do_head_stride, p.do_row_stride, b, h, i),
               dim_v, lane, dout_reg);
    load_slice(row_ptr<T>(p.out, p.o_batch_stride, p.o_head_stride, p.o_row_stride, b, h, i),
               dim_v, lane, out_reg);
    T delta_part = 0;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) delta_part += dout_reg[s] * out_reg[s];
    const T delta = warp_sum(delta_part);
    const T* k_head =
        row_ptr<T>(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, b, g, lens.k_start);
    const T* v_head =
        row_ptr<T>(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, b, g, lens.k_start);

    T dq_acc[kSlots] = {};
    T row_max = -std::numeric_limits<T>::infinity();
    T row_sum = 0;
    for_each_key_span(p, b, h, item.index, range, [&](int lo, int hi) {
      for (int n0 = lo; n0 < hi; n0 += kWarp) {
        const int count = min(kWarp, hi - n0);
        T my_score = -std::numeric_limits<T>::infinity();
        T my_dprob = 0;
        for (int t = 0; t < count; ++t) {
          const T s = warp_sum(slice_dot(q_reg, k_head + (n0 + t) * p.k_row_stride, dim, lane));
          const T dp =
              warp_sum(slice_dot(dout_reg, v_head + (n0 + t) * p.v_row_stride, dim_v, lane));
          if (lane == t) {
            my_score = s * scale;
            my_dprob = dp;
          }
        }
        const T chunk_max = warp_max(my_score);
        const T new_max = chunk_max > row_max ? chunk_max : row_max;
        const T rescale = exact_exp(row_max - new_max);
        const T my_weight = lane < count ? exact_exp(my_score - new_max) : T(0);
        const T my_dscore = my_weight * (my_dprob - delta);
        row_sum = row_sum * rescale + warp_sum(my_weight);
        slice_scale(rescale, dq_acc);
        for (int t = 0; t < count; ++t) {
          const T dscore = __shfl_sync(kFullMask, my_dscore, t);
          slice_axpy(dscore, k_head + (n0 + t) * p.k_row_stride, dim, lane, dq_acc);
        }
        row_max = new_max;
      }
    });

    const bool seen = row_sum > T(0);
#pragma unroll
    for (int s = 0; s < kSlots; ++s) dq_acc[s] = seen ? dq_acc[s] / row_sum * scale : T(0);
    store_slice(dq_acc, row_ptr<T>(p.dq, p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride, b,
                                   h, i),
                dim, lane);
    if (lane == 0) {
      row_stats[2 * row] =
          seen ? static_cast<T>(row_lse(row_max, row_sum)) : -std::numeric_limits<T>::infinity();
      row_stats[2 * row + 1] = delta;
    }
  }
}

// Backward pass 2, one warp per key row of a kv head: sums over the group's query heads and the
// query rows that see the key, so dk/dv are written once each, in a fixed order.
template <typename T, int kSlots>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarp)
    flash_bwd_dkdv_exact_kernel(const AttnParams p, const T* row_stats) {
  const int lane = threadIdx.x % kWarp;
  const int group = p.heads_q / p.heads_kv;
  const int dim = p.head_dim;
  const int dim_v = p.head_dim_v;
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
    // Padding keys (j >= lens.k) are seen by no row and keep zero gradients.
    if (j < lens.k) {
      T k_reg[kSlots], v_reg[kSlots];
      load_slice(row_ptr<T>(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, b, g, jt),
                 dim, lane, k_reg);
      load_slice(row_ptr<T>(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, b, g, jt),
                 dim_v, lane, v_reg);
      const RowSpan span = rows_meeting_keys(p, lens, j, j + 1);
      for (int h = g * group; h < (g + 1) * group; ++h) {
        const T* q_head = row_ptr<T>(p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride, b,
                                     h, lens.q_start);
        const T* dout_head = row_ptr<T>(p.dout, p.do_batch_stride, p.do_head_stride,
                                        p.do_row_stride, b, h, lens.q_start);
        const T* head_stats = row_stats + 2 * row_stat_offset(p, lens, b, h);
        for_each_row_span(p, b, h, j, span, [&](int first, int last) {
          for (int i0 = first; i0 < last; i0 += kWarp) {
            const int count = min(kWarp, last - i0);
            T my_score = 0, my_dprob = 0;  // lane t: query row i0 + t
            for (int t = 0; t < count; ++t) {
              const T s =
                  warp_sum(slice_dot(k_reg, q_head + (i0 + t) * p.q_row_stride, dim, lane));
              const T dp =
                  warp_sum(slice_dot(v_reg, dout_head + (i0 + t) * p.do_row_stride, dim_v, lane));
              if (lane == t) {
                my_score = s * scale;
                my_dprob = dp;
              }
            }
            T my_prob = 0, my_dscore = 0;
            if (lane < count) {
              const int i = i0 + lane;
              const KeyRange range = key_range(p, lens, i);
              if (range.lo <= j && j < range.hi) {
                my_prob = exact_exp(my_score - head_stats[2 * i]);
                my_dscore = my_prob * (my_dprob - head_stats[2 * i + 1]);
              }
            }
            for (int t = 0; t < count; ++t) {
              const T prob = __shfl_sync(kFullMask, my_prob, t);
              const T dscore = __shfl_sync(kFullMask, my_dscore, t);
              slice_axpy(dscore, q_head + (i0 + t) * p.q_row_stride, dim, lane, dk_acc);
              slice_axpy(prob, dout_head + (i0 + t) * p.do_row_stride, dim_v, lane, dv_acc);
            }
          }
        });
      }
    }
    slice_scale(scale, dk_acc);
    store_slice(dk_acc, row_ptr<T>(p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride, b,
                                   g, jt),
                dim, lane);
    store_slice(dv_acc, row_ptr<T>(p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride, b,
                                   g, jt),
                dim_v, lane);
  }
}

template <typename T>
void launch_fwd(const AttnParams& p) {
  const int64_t rows_total = row_items<false>(p);
  if (rows_total == 0) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_slots(std::max(p.head_dim, p.head_dim_v), [&](auto slots) {
    flash_fwd_exact_kernel<T, decltype(slots)::value>
        <<<grid_for(rows_total), kWarpsPerBlock * kWarp, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename T>
void launch_bwd(const AttnParams& p) {
  const int64_t rows_total = row_items<false>(p);
  const int64_t keys_total = row_items<true>(p);
  if (rows_total == 0 && keys_total == 0) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Freed when this function returns; the stream-ordered caching allocator keeps it alive for
  // the kernels queued on this stream.
  const at::Tensor row_stats =
      at::empty({rows_total * 2}, at::TensorOptions()
                                      .dtype(c10::CppTypeToScalarType<T>::value)
                                      .device(at::kCUDA, c10::cuda::current_device()));
  T* stats = static_cast<T*>(row_stats.data_ptr());
  dispatch_slots(std::max(p.head_dim, p.head_dim_v), [&](auto slots) {
    constexpr int kSlots = decltype(slots)::value;
    if (rows_total > 0) {
      flash_bwd_dq_exact_kernel<T, kSlots>
          <<<grid_for(rows_total), kWarpsPerBlock * kWarp, 0, stream>>>(p, stats);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (keys_total > 0) {
      flash_bwd_dkdv_exact_kernel<T, kSlots>
          <<<grid_for(keys_total), kWarpsPerBlock * kWarp, 0, stream>>>(p, stats);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

}  // namespace

void flash_fwd_exact_cuda(const AttnParams& p, c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
      launch_fwd<float>(p);
      break;
    case c10::kDouble:
      launch_fwd<double>(p);
      break;
    default:
      TORCH_CHECK(false, "adaattn: the exact CUDA flash kernel takes float32 or float64, got ",
                  dtype);
  }
}

void flash_bwd_exact_cuda(const AttnParams& p, c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
      launch_bwd<float>(p);
      break;
    case c10::kDouble:
      launch_bwd<double>(p);
      break;
    default:
      TORCH_CHECK(false, "adaattn: the exact CUDA flash kernel takes float32 or float64, got ",
                  dtype);
  }
}

}  // namespace adaattn
