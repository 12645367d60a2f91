// Pieces of the tensor-core backward shared by the SM80 and Hopper kernels: the row term of a
// normalised transform (Delta = dO . O, which also zeroes the atomic dQ accumulator), the last
// step of atomic dQ, and the fixed-order reductions of the variants' parameter gradients.
#pragma once

#include <cmath>

#include "../../core/params.h"
#include "../../core/seq.h"
#include "mma.h"

namespace adaattn {
namespace tc {

// A query row of the row kernels, in lse order: dense (b, h, i); packed (h, t) with b = 0
// (batch strides are 0). valid == false past the last row.
struct QueryRow {
  int64_t row;
  int b, h, i;
  bool valid;
};

__device__ __forceinline__ QueryRow query_row(const AttnParams& p, int64_t row) {
  const int64_t bh = row / p.len_q;
  return {row, static_cast<int>(bh / p.heads_q), static_cast<int>(bh % p.heads_q),
          static_cast<int>(row % p.len_q), row < row_items<false>(p)};
}

// Column at which the Hopper backward stores column `col` of dQ-accumulator row `row`: groups
// of 8 floats XOR-ed with row % 4, so that its staging stores (four rows per 16 lanes) hit
// distinct banks while a step's rows stay one contiguous block for its bulk reduction.
__device__ __forceinline__ int dq_swizzle(int64_t row, int col) {
  return col ^ ((static_cast<int>(row) & 3) << 3);
}

// Lanes per row of bwd_delta_kernel: one 16-byte chunk of an O / dO row each (a power of two,
// so that several narrow rows share a warp and their loads stay 16 bytes wide).
template <int DV>
constexpr int delta_lanes_per_row() {
  int lanes = 1;
  while (lanes < DV / 8 && lanes < 32) lanes *= 2;
  return lanes;
}

// DK: the width of the atomic dQ accumulator's rows (the kernel's D). Columns of O and dO past
// p.head_dim_v (a caller's Dv below the kernel's) are not read.
template <typename T, int DK, int DV>
__global__ void bwd_delta_kernel(const AttnParams p) {
  static_assert(DV % 8 == 0, "rows of whole 16-byte chunks");
  constexpr int kLanes = delta_lanes_per_row<DV>();
  constexpr int kChunks = DV / 8;
  const int lane = threadIdx.x % kLanes;
  const QueryRow r = query_row(
      p, (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanes);
  const T* o = static_cast<const T*>(p.out) + r.b * p.o_batch_stride + r.h * p.o_head_stride +
               static_cast<int64_t>(r.i) * p.o_row_stride;
  const T* d = static_cast<const T*>(p.dout) + r.b * p.do_batch_stride + r.h * p.do_head_stride +
               static_cast<int64_t>(r.i) * p.do_row_stride;
  float acc = 0.f;
  if (r.valid) {
    if (p.dq_accum != nullptr) {
      // The atomic backward's float32 dQ row starts at zero (no separate fill pass).
      float4* const zero = reinterpret_cast<float4*>(p.dq_accum + r.row * DK);
      for (int c = lane; c < DK / 4; c += kLanes) zero[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    const int chunks = p.head_dim_v / 8;
#pragma unroll
    for (int c = lane; c < kChunks; c += kLanes) {
      if (c >= chunks) break;
      const uint4 ov = reinterpret_cast<const uint4*>(o)[c];
      const uint4 dv = reinterpret_cast<const uint4*>(d)[c];
      const T* ot = reinterpret_cast<const T*>(&ov);
      const T* dt = reinterpret_cast<const T*>(&dv);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc += to_float(ot[e]) * to_float(dt[e]);
    }
  }
  // Every lane takes part (rows past the last add zeros): the groups reduce within kLanes.
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, off);
  if (r.valid && lane == 0) p.delta[r.row] = acc;
}

// Atomic dQ, last step: dq = scale * dq_accum in T (rows in lse order), columns below
// p.head_dim (the caller's D, up to the kernel's DK). kSwizzled: the accumulator rows are
// stored permuted by dq_swizzle (the Hopper backward).
template <typename T, int DK, bool kSwizzled>
__global__ void bwd_dq_convert_kernel(const AttnParams p) {
  // One thread per 8 columns of a row (two 16-byte loads, one 16-byte store), so that narrow
  // rows keep every lane busy: a warp per row left half the lanes idle at DK = 32 (low-rank
  // scores), where this kernel took 52 us for 42 MB on the H100.
  static_assert(DK % 32 == 0, "8-column chunks, and dq_swizzle's XOR stays inside the row");
  constexpr int kChunks = DK / 8;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = item / kChunks;
  if (row >= row_items<false>(p)) return;
  const int col = static_cast<int>(item % kChunks) * 8;
  if (col >= p.head_dim) return;
  const int64_t bh = row / p.len_q;
  const int b = static_cast<int>(bh / p.heads_q), h = static_cast<int>(bh % p.heads_q);
  T* dq = static_cast<T*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride +
          (row % p.len_q) * p.dq_row_stride + col;
  const float* acc = p.dq_accum + row * DK + (kSwizzled ? dq_swizzle(row, col) : col);
  const float scale = static_cast<float>(p.scale);
  const float4 lo = *reinterpret_cast<const float4*>(acc);
  const float4 hi = *reinterpret_cast<const float4*>(acc + 4);
  *reinterpret_cast<uint4*>(dq) = make_uint4(
      MmaOp<T>::pack(lo.x * scale, lo.y * scale), MmaOp<T>::pack(lo.z * scale, lo.w * scale),
      MmaOp<T>::pack(hi.x * scale, hi.y * scale), MmaOp<T>::pack(hi.z * scale, hi.w * scale));
}


// The fixed-order reduction of a per-head parameter gradient of the transform (over the row
// pass's terms): one CTA of kThreads per query head.
template <typename Transform, int kThreads>
__global__ void __launch_bounds__(kThreads) reduce_row_param_grad_kernel(const AttnParams p) {
  __shared__ float partial[kThreads];
  Transform::template reduce_param_grad<kThreads>(p, partial);
}

// The fixed-order reduction of a per-head parameter gradient of the transform over each row's
// finished lse and Delta (Transform::lse_param_term): one CTA of kThreads per query head, rows
// strided over the threads, then a tree. Padding rows (o = 0, Delta = 0) add nothing.
template <typename Transform, int kThreads>
__global__ void __launch_bounds__(kThreads) reduce_lse_param_grad_kernel(const AttnParams p) {
  __shared__ float partial[kThreads];
  const int h = blockIdx.x;
  float acc = 0.f;
  for (int b = 0; b < p.batch; ++b) {
    const SeqLens lens = seq_lens(p, b);
    const int64_t off = row_stat_offset(p, lens, b, h);
    for (int r = threadIdx.x; r < lens.q; r += kThreads) {
      acc += Transform::lse_param_term(p, h, p.lse[off + r], p.delta[off + r]);
    }
  }
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int width = kThreads / 2; width > 0; width >>= 1) {
    if (static_cast<int>(threadIdx.x) < width) partial[threadIdx.x] += partial[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) Transform::lse_param_grad_out(p)[h] = partial[0];
}

// The fixed-order reduction of the score modifier's table gradient over the dK/dV CTAs'
// partials (`slots` key tiles).
template <typename Mod, int kThreads>
__global__ void __launch_bounds__(kThreads) reduce_table_param_grad_kernel(const AttnParams p,
                                                                           int64_t slots) {
  Mod::template reduce_param_grad<kThreads>(p, slots);
}

}  // namespace tc
}  // namespace adaattn
