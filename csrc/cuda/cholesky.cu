// The CUDA kernel of shifted_cholesky_info (cholesky.cpp has the algorithm). D <= 128: one CTA
// of 512 threads per matrix, the matrix in shared memory, factorised right-looking in panels of
// 32 columns: one warp factorises the panel's diagonal block with shuffles, one thread per row
// below it solves that row against the block, then the CTA applies the panel's rank-32 update to
// the trailing lower triangle in 4x4 register tiles. That is 3 CTA barriers a panel (11 for
// D = 128) where the previous kernel took 2 a column (256). Every element still receives its
// updates one column at a time in column order, as in the unblocked algorithm, so only the
// trace's summation order and rsqrtf differ from it. D > 128 uses at::linalg_cholesky_ex on the
// shifted matrices (and reports cuSOLVER's info). H100, 64 matrices of 128, do_bench: the
// previous kernel (1024 threads, one column a step) took 0.086 ms, against 0.146 ms for
// cuSOLVER's batched factorisation alone; this blocked kernel is not yet measured on a GPU.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../ops/linalg/cholesky_checks.h"

namespace adaattn {
namespace {

constexpr int kMaxDim = 128;
constexpr int kPanel = 32;  // one warp: lane i holds row i of a diagonal block
// Rows stay 16-byte aligned, and 8 lanes reading float4s from 8 consecutive rows hit 32 banks.
constexpr int kStride = kMaxDim + 4;
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 4;  // trailing update: 4x4 elements a thread, 16 rows x 32 columns a warp
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kSmemBytes =
    (kMaxDim * kStride + kPanel * kMaxDim) * static_cast<int>(sizeof(float));

// v[q] = src[q] for q < kPanel; src 16-byte aligned.
__device__ __forceinline__ void load_row(const float* src, float (&v)[kPanel]) {
#pragma unroll
  for (int q = 0; q < kPanel; q += 4) {
    const float4 t = *reinterpret_cast<const float4*>(src + q);
    v[q] = t.x;
    v[q + 1] = t.y;
    v[q + 2] = t.z;
    v[q + 3] = t.w;
  }
}

// One warp: the diagonal block of the panel at column j0 (lane i holds row j0 + i). Writes the
// block to p with 1/sqrt(pivot) on its diagonal and, on the first pivot below n that is not
// positive, its 1-based column to *info.
__device__ __forceinline__ void factor_diagonal_block(const float* m, float* p, int n, int j0,
                                                      int lane, int* info) {
  float a[kPanel];
  load_row(m + (j0 + lane) * kStride + j0, a);
  float d = __shfl_sync(kFullMask, a[0], 0);
  int fail = 0;
  // No branch: the steps after a failure (and on the padding) run on values that are never used,
  // and the compiler may overlap one step's shuffles with the next step's pivot.
#pragma unroll
  for (int j = 0; j < kPanel; ++j) {
    if (fail == 0 && j0 + j < n && !(d > 0.f)) fail = j0 + j + 1;
    const float inv = rsqrtf(d);
    a[j] = lane == j ? inv : a[j] * inv;
    // The next pivot straight from lane j + 1's own values (the update below gives it the same
    // value), so the chain from pivot to pivot waits on one shuffle.
    if (j + 1 < kPanel) d = __shfl_sync(kFullMask, fmaf(-a[j], a[j], a[j + 1]), j + 1);
#pragma unroll
    for (int k = j + 1; k < kPanel; ++k) {
      a[k] = fmaf(-a[j], __shfl_sync(kFullMask, a[j], k), a[k]);
    }
  }
#pragma unroll
  for (int j = 0; j < kPanel; ++j) p[j * kMaxDim + j0 + lane] = a[j];
  if (fail != 0 && lane == 0) *info = fail;
}

__global__ void __launch_bounds__(kThreads, 1)
    shifted_cholesky_kernel(const float* __restrict__ a_all, int n, float rel_shift,
                            int* __restrict__ info_all) {
  extern __shared__ float4 smem[];
  // m[i * kStride + k]: the matrix being factorised (its lower triangle; the rest is scratch).
  // p[j * kMaxDim + i]: column j0 + j of the current panel, for rows i >= j0.
  float* m = reinterpret_cast<float*>(smem);
  float* p = m + kMaxDim * kStride;
  __shared__ int info;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // Padded to whole panels with the identity, which never feeds an element of A.
  const int np = (n + kPanel - 1) / kPanel * kPanel;
  const float* a = a_all + static_cast<int64_t>(blockIdx.x) * n * n;
  if (tid == 0) info = 0;
  {
    // Rows warp + kWarps r, columns lane + 32 c: every global load issued before the first
    // store, each warp load one coalesced row segment; only the lower triangle is read (the
    // upper one is zero).
    constexpr int kRows = kMaxDim / kWarps, kCols = kMaxDim / 32;
    float v[kRows][kCols];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int i = warp + kWarps * r, k = lane + 32 * c;
        v[r][c] = i < n ? (k <= i ? a[i * n + k] : 0.f) : (k == i ? 1.f : 0.f);
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int i = warp + kWarps * r, k = lane + 32 * c;
        if (i < np && k < np) m[i * kStride + k] = v[r][c];
      }
    }
  }
  __syncthreads();
  if (warp == 0) {
    float trace = 0.f;
#pragma unroll
    for (int c = 0; c < kMaxDim / 32; ++c) {
      const int i = lane + 32 * c;
      if (i < n) trace += m[i * (kStride + 1)];
    }
    // A butterfly adds the same pairs in every lane (addition commutes): one sum, deterministic.
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) trace += __shfl_xor_sync(kFullMask, trace, off);
    const float shift = rel_shift * trace;
#pragma unroll
    for (int c = 0; c < kMaxDim / 32; ++c) {
      const int i = lane + 32 * c;
      if (i < n) m[i * (kStride + 1)] -= shift;
    }
    __syncwarp();
  }
  for (int j0 = 0;; j0 += kPanel) {
    if (warp == 0) factor_diagonal_block(m, p, n, j0, lane, &info);
    __syncthreads();
    if (info != 0 || j0 + kPanel >= n) break;  // the same values in every thread
    // Row i below the block: the columns of the panel, in order, against the block.
    const int t0 = j0 + kPanel;
    if (tid < np - t0) {
      const int i = t0 + tid;
      float x[kPanel];
      load_row(m + i * kStride + j0, x);
#pragma unroll
      for (int j = 0; j < kPanel; ++j) {
        float col[kPanel];  // column j of the block: the same address in every lane
        load_row(p + j * kMaxDim + j0, col);
        x[j] *= col[j];
#pragma unroll
        for (int k = j + 1; k < kPanel; ++k) x[k] = fmaf(-x[j], col[k], x[k]);
      }
#pragma unroll
      for (int j = 0; j < kPanel; ++j) p[j * kMaxDim + i] = x[j];
    }
    __syncthreads();
    // The trailing lower triangle, rows and columns t0 .. np - 1, in kPanel x kPanel blocks
    // (bi, bk), bk <= bi, each split into two units of 16 rows, one unit a warp. A lane's 4
    // rows come from one float4 that its group of 8 lanes shares, its 4 columns from a float4
    // next to the group's others; the accumulation runs over the panel's columns in order.
    const int blocks = (np - t0) / kPanel;
    for (int u = warp; u < blocks * (blocks + 1); u += kWarps) {
      int bk = u >> 1, bi = 0;
      while (bk > bi) bk -= ++bi;
      const int r0 = t0 + bi * kPanel + (u & 1) * (kPanel / 2) + (lane >> 3) * kTile;
      const int c0 = t0 + bk * kPanel + (lane & 7) * kTile;
      float acc[kTile][kTile];
#pragma unroll
      for (int q = 0; q < kTile; ++q) {
        const float4 t = *reinterpret_cast<const float4*>(m + (r0 + q) * kStride + c0);
        acc[q][0] = t.x;
        acc[q][1] = t.y;
        acc[q][2] = t.z;
        acc[q][3] = t.w;
      }
#pragma unroll 8
      for (int j = 0; j < kPanel; ++j) {
        const float4 li = *reinterpret_cast<const float4*>(p + j * kMaxDim + r0);
        const float4 lk = *reinterpret_cast<const float4*>(p + j * kMaxDim + c0);
        const float ri[kTile] = {li.x, li.y, li.z, li.w}, rk[kTile] = {lk.x, lk.y, lk.z, lk.w};
#pragma unroll
        for (int q = 0; q < kTile; ++q) {
#pragma unroll
          for (int w = 0; w < kTile; ++w) acc[q][w] = fmaf(-ri[q], rk[w], acc[q][w]);
        }
      }
#pragma unroll
      for (int q = 0; q < kTile; ++q) {
        *reinterpret_cast<float4*>(m + (r0 + q) * kStride + c0) =
            make_float4(acc[q][0], acc[q][1], acc[q][2], acc[q][3]);
      }
    }
    __syncthreads();
  }
  if (tid == 0) info_all[blockIdx.x] = info;
}

at::Tensor shifted_cholesky_info_cuda(const at::Tensor& a, double rel_shift) {
  check_shifted_cholesky_input(a, rel_shift);
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t batch = a.size(0), n = a.size(1);
  if (n > kMaxDim) {
    const at::Tensor trace = a.diagonal(0, -2, -1).sum(-1);
    const at::Tensor eye = at::eye(n, a.options());
    const at::Tensor shifted = a - (rel_shift * trace).unsqueeze(-1).unsqueeze(-1) * eye;
    return std::get<1>(at::linalg_cholesky_ex(shifted)).to(at::kInt);
  }
  at::Tensor info = at::empty({batch}, a.options().dtype(at::kInt));
  if (batch == 0) return info;
  C10_CUDA_CHECK(cudaFuncSetAttribute(shifted_cholesky_kernel,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  shifted_cholesky_kernel<<<static_cast<unsigned>(batch), kThreads, kSmemBytes,
                            at::cuda::getCurrentCUDAStream()>>>(
      a.data_ptr<float>(), static_cast<int>(n), static_cast<float>(rel_shift),
      info.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return info;
}

}  // namespace

TORCH_LIBRARY_IMPL(adaattn, CUDA, m) {
  m.impl("shifted_cholesky_info", &shifted_cholesky_info_cuda);
}

}  // namespace adaattn
