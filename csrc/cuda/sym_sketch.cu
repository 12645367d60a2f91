// The CUDA kernel of sym_sketch_top (ops/linalg/sym_sketch.cpp states the algorithm; the CPU
// kernel there takes the same steps in the same precisions). One CTA of 512 threads per matrix,
// everything in shared memory: A (D padded to 128 with zeros), Q (D x P, float32; P padded to 64
// with zero columns, which never reach the first P: Cholesky QR is nested and a zero column's
// pivot is the shift), the products (D x P, float32 sums stored as float64) and the P x P
// float64 Gram / Cholesky block.
//   products (A + s I) X: 4 x 4 outputs a thread, A's row k read as its column (A symmetric);
//   Y^T Y: in the float64 passes on the float64 tensor cores (mma m8n8k4, the 36 lower 8 x 8
//     tiles); in the float32 pass the 136 lower 4 x 4 tiles, two threads each over half the rows;
//   Cholesky: two panels of 32 columns; one warp factorises a diagonal block with shuffles (no
//     barrier a column) and solves the rows below it, then the CTA updates the trailing block;
//   Y L^-T: four lanes a row, lane c owning the columns j = c mod 4, the solved q_j passed by
//     shuffle, so the 64-step substitution needs no barrier.
// No eigensolve: the rank comes from the Rayleigh quotients of nested columns (sym_sketch.cpp).
// Each CTA runs the program once, fetching its code from HBM when the Gram step has just swept
// the L2 cache, so code size is time: the product, orth and the diagonal-block factorisation are
// called, not inlined, one copy each (docs/lab/rank-planner.md has the measurements).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "../ops/linalg/sym_sketch_checks.h"

namespace adaattn {
namespace {

constexpr int kD = kSketchMaxDim;
constexpr int kP = kSketchMaxWidth;
constexpr int kThreads = 512;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kAStride = kD + 4;  // floats; rows 16-byte aligned
constexpr int kXStride = kP + 4;  // floats
constexpr int kYStride = kP + 2;  // doubles; rows 16-byte aligned
constexpr int kWStride = kP + 1;  // doubles
constexpr int kPanel = 32;        // Cholesky panel: one warp, lane i holding row i
constexpr int kSmemBytes =
    (kD * kAStride + kD * kXStride) * 4 + (kD * kYStride + kP * kWStride + kP) * 8;
static_assert(kD == 128 && kP == 2 * kPanel && kThreads == 512, "the thread mappings below");
static_assert(kSmemBytes <= 227 * 1024, "shared memory per CTA");

// acc[i][j] += r[i] c[j]: a 4 x 4 register tile of an outer-product sum (fma is fmaf for float).
template <typename T>
__device__ __forceinline__ void accumulate_outer(T (&acc)[4][4], const T (&r)[4],
                                                 const T (&c)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = fma(r[i], c[j], acc[i][j]);
  }
}

// y = (A + shift I) x over all kD rows and kP columns, summed in float32 and stored as float64
// (exactly: the Gram step below then reads y without a conversion per use); thread t: rows
// 4 (t / 16) + 0..3, columns 4 (t % 16) + 0..3. Synchronises after the stores.
__device__ __noinline__ void shifted_product(const float* a, const float* x, double* y,
                                             float shift, int tid) {
  const int r0 = 4 * (tid >> 4), c0 = 4 * (tid & 15);
  float acc[4][4] = {};
#pragma unroll 8
  for (int k = 0; k < kD; ++k) {
    const float4 av = *reinterpret_cast<const float4*>(a + k * kAStride + r0);
    const float4 xv = *reinterpret_cast<const float4*>(x + k * kXStride + c0);
    const float ar[4] = {av.x, av.y, av.z, av.w}, xr[4] = {xv.x, xv.y, xv.z, xv.w};
    accumulate_outer(acc, ar, xr);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 xv = *reinterpret_cast<const float4*>(x + (r0 + i) * kXStride + c0);
    double2* out = reinterpret_cast<double2*>(y + (r0 + i) * kYStride + c0);
    out[0] = make_double2(fmaf(shift, xv.x, acc[i][0]), fmaf(shift, xv.y, acc[i][1]));
    out[1] = make_double2(fmaf(shift, xv.z, acc[i][2]), fmaf(shift, xv.w, acc[i][3]));
  }
  __syncthreads();
}

// 1 / sqrt(d) in T's precision.
template <typename T>
__device__ __forceinline__ T rsqrt_of(T d) {
  if constexpr (std::is_same_v<T, float>) {
    return rsqrtf(d);
  } else {
    return rsqrt(d);
  }
}

// One warp: the Cholesky factor of the kPanel x kPanel diagonal block of w at (k0, k0), lane i
// holding row k0 + i: L below the diagonal back to w, 1 / L_ii to inv_sqrt[k0 + i]. A pivot <= 0
// gives a zero column (sym_sketch.cpp). No branch on the lane: the entries above the diagonal
// are carried along and never stored.
template <typename T>
__device__ __noinline__ void factor_diagonal_block(T* w, T* inv_sqrt, int k0, int lane) {
  T a[kPanel];
#pragma unroll
  for (int t = 0; t < kPanel; ++t) a[t] = w[(k0 + lane) * kWStride + k0 + t];
  T d = __shfl_sync(kFullMask, a[0], 0);
#pragma unroll
  for (int j = 0; j < kPanel; ++j) {
    const T inv = d > T(0) ? rsqrt_of(d) : T(0);
    a[j] = lane == j ? inv : a[j] * inv;
    // The next pivot straight from lane j + 1's own values (the update below gives it the same
    // value), so that the chain from pivot to pivot waits on one shuffle.
    if (j + 1 < kPanel) d = __shfl_sync(kFullMask, fma(-a[j], a[j], a[j + 1]), j + 1);
#pragma unroll
    for (int t = j + 1; t < kPanel; ++t) {
      a[t] = fma(-a[j], __shfl_sync(kFullMask, a[j], t), a[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < kPanel; ++t) {
    if (t < lane) w[(k0 + lane) * kWStride + k0 + t] = a[t];
    if (t == lane) inv_sqrt[k0 + lane] = a[t];
  }
}

// One warp: rows kPanel + i (lane i) of the first panel, L[r][j] = (w[r][j] - sum_{t<j}
// L[r][t] L[j][t]) / L_jj, after factor_diagonal_block(w, inv_sqrt, 0, .).
template <typename T>
__device__ __forceinline__ void solve_below_block(T* w, const T* inv_sqrt, int lane) {
  T x[kPanel];
  T* row = w + (kPanel + lane) * kWStride;
#pragma unroll
  for (int t = 0; t < kPanel; ++t) x[t] = row[t];
#pragma unroll
  for (int j = 0; j < kPanel; ++j) {
    x[j] *= inv_sqrt[j];
#pragma unroll
    for (int t = j + 1; t < kPanel; ++t) x[t] = fma(-x[j], w[t * kWStride + j], x[t]);
  }
#pragma unroll
  for (int t = 0; t < kPanel; ++t) row[t] = x[t];
}

// The second panel's lower triangle minus the first panel's contribution: thread t updates
// (32 + t / 32, 32 + t % 32) and (48 + t / 32, 32 + t % 32) where on or below the diagonal.
template <typename T>
__device__ __forceinline__ void update_trailing_block(T* w, int tid) {
  const int c = kPanel + (tid & 31), r = kPanel + (tid >> 5), r2 = r + kPanel / 2;
  T acc = w[r * kWStride + c], acc2 = w[r2 * kWStride + c];
#pragma unroll 8
  for (int j = 0; j < kPanel; ++j) {
    const T lc = w[c * kWStride + j];
    acc = fma(-w[r * kWStride + j], lc, acc);
    acc2 = fma(-w[r2 * kWStride + j], lc, acc2);
  }
  if (c <= r) w[r * kWStride + c] = acc;
  if (c <= r2) w[r2 * kWStride + c] = acc2;
}

// Four consecutive entries of a row of the float32 Q.
__device__ __forceinline__ void load4(const float* src, float (&v)[4]) {
  const float4 a = *reinterpret_cast<const float4*>(src);
  v[0] = a.x;
  v[1] = a.y;
  v[2] = a.z;
  v[3] = a.w;
}

// w = y^T y (lower kP x kP, float64) on the float64 tensor cores: mma m8n8k4, one 8 x 8 tile of
// the 36 lower ones per warp and pass (16 warps), the 128 rows in 32 k-steps over two
// accumulator pairs (even and odd steps) to halve the dependent chain. Thread (g, t) = (lane / 4,
// lane % 4) holds A = y^T's (g, t) and B = y's (t, g) of a k-step, and C's row g, columns 2 t
// and 2 t + 1.
__device__ __forceinline__ void gram_fp64_tensor_cores(const double* y, int stride, double* w,
                                                       int tid) {
  const int lane = tid & 31, g = lane >> 2, t = lane & 3;
  for (int tile = tid >> 5; tile < kP / 8 * (kP / 8 + 1) / 2; tile += kThreads / 32) {
    int tr = 0;
    while ((tr + 1) * (tr + 2) / 2 <= tile) ++tr;
    const int tc = tile - tr * (tr + 1) / 2;
    double c[2][2] = {};
#pragma unroll 4
    for (int k0 = 0; k0 < kD; k0 += 8) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const double* row = y + (k0 + 4 * h + t) * stride;
        asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
            : "+d"(c[h][0]), "+d"(c[h][1])
            : "d"(row[8 * tr + g]), "d"(row[8 * tc + g]));
      }
    }
    double* out = w + (8 * tr + g) * kWStride + 8 * tc + 2 * t;
    out[0] = c[0][0] + c[1][0];
    out[1] = c[0][1] + c[1][1];
  }
}

// q = y L^-T, L L^T = y^T y + c I (sym_sketch.cpp, step 2), the Gram matrix and the factor in
// T: float64 with the shift c (n and p the real D and P give its size) on the products, float32
// without it on a Q that one float64 pass left orthonormal to ~1e-3 (y may then be x: each lane
// rewrites only the entries it read); the substitution in float32. y: rows of `stride` T; q to
// x as float32. w: the Gram / Cholesky block, inv_sqrt: kP entries, both T. Synchronises at
// the end.
template <typename T>
__device__ __noinline__ void orth(const T* y, int stride, float* x, T* w, T* inv_sqrt, int n,
                                  int p, int tid) {
  constexpr bool kShifted = std::is_same_v<T, double>;
  const int lane = tid & 31;
  if constexpr (kShifted) {
    gram_fp64_tensor_cores(y, stride, w, tid);
  } else {
    // Lower 4 x 4 tile `slot` of the 16 x 16 tile grid (136 tiles), rows h * 64 .. h * 64 + 63.
    const int slot = tid >> 1, half = tid & 1;
    int tr = 0;
    while ((tr + 1) * (tr + 2) / 2 <= slot) ++tr;
    const int tc = slot - tr * (tr + 1) / 2;
    T acc[4][4] = {};
    if (slot < 136) {
      for (int i = half * (kD / 2); i < (half + 1) * (kD / 2); ++i) {
        T r[4], c[4];
        load4(y + i * stride + 4 * tr, r);
        load4(y + i * stride + 4 * tc, c);
        accumulate_outer(acc, r, c);
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        // half 0 + half 1 in both lanes of the pair: one value.
        const T other = __shfl_xor_sync(kFullMask, acc[u][v], 1);
        acc[u][v] = half == 0 ? acc[u][v] + other : other + acc[u][v];
      }
    }
    if (slot < 136 && half == 0) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int v = 0; v < 4; ++v) w[(4 * tr + u) * kWStride + 4 * tc + v] = acc[u][v];
      }
    }
  }
  __syncthreads();
  if constexpr (kShifted) {
    if (tid < 32) {
      double trace = w[lane * (kWStride + 1)] + w[(lane + 32) * (kWStride + 1)];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) trace += __shfl_xor_sync(kFullMask, trace, off);
      const double shift =
          11.0 * (static_cast<double>(n) * p + p * (p + 1.0)) * DBL_EPSILON * trace;
      w[lane * (kWStride + 1)] += shift;
      w[(lane + 32) * (kWStride + 1)] += shift;
    }
    __syncthreads();
  }
  // Cholesky in two panels of 32 columns: L below the diagonal in w, 1 / L_jj in inv_sqrt.
  if (tid < 32) {
    factor_diagonal_block(w, inv_sqrt, 0, lane);
    __syncwarp();
    solve_below_block(w, inv_sqrt, lane);
  }
  __syncthreads();
  update_trailing_block(w, tid);
  __syncthreads();
  if (tid < 32) factor_diagonal_block(w, inv_sqrt, kPanel, lane);
  __syncthreads();
  // The substitution runs in float32 (sym_sketch.cpp, step 2): a float64 factor is rounded in
  // place, w and inv_sqrt then holding floats at the same strides.
  float* l32 = reinterpret_cast<float*>(w);
  float* inv32 = reinterpret_cast<float*>(inv_sqrt);
  if constexpr (!std::is_same_v<T, float>) {
    constexpr int kPerThread = (kP * kWStride + kThreads - 1) / kThreads;
    float rounded[kPerThread];
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const int e = tid + u * kThreads;
      rounded[u] = e < kP * kWStride ? static_cast<float>(w[e]) : 0.f;
    }
    const float inv = tid < kP ? static_cast<float>(inv_sqrt[tid]) : 0.f;
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const int e = tid + u * kThreads;
      if (e < kP * kWStride) l32[e] = rounded[u];
    }
    if (tid < kP) inv32[tid] = inv;
    __syncthreads();
  }
  {
    // Row i = t / 4; lane c = t % 4 holds y[i][4 m + c].
    const int i = tid >> 2, c = tid & 3;
    float v[kP / 4];
#pragma unroll
    for (int m = 0; m < kP / 4; ++m) v[m] = static_cast<float>(y[i * stride + 4 * m + c]);
#pragma unroll
    for (int j = 0; j < kP; ++j) {
      const int owner = j & 3, mj = j >> 2;
      const float q = __shfl_sync(kFullMask, v[mj] * inv32[j], (lane & ~3) | owner);
      if (c == owner) v[mj] = q;
#pragma unroll
      for (int m = mj; m < kP / 4; ++m) {
        if (4 * m + c > j) v[m] -= l32[(4 * m + c) * kWStride + j] * q;
      }
    }
#pragma unroll
    for (int m = 0; m < kP / 4; ++m) x[i * kXStride + 4 * m + c] = v[m];
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads, 1)
    sym_sketch_kernel(const float* __restrict__ a_all, const float* __restrict__ omega, int n,
                      int p, double energy, double rel_shift, int min_rank, int multiple,
                      int power_iters, int oversample, float* __restrict__ values_all,
                      float* __restrict__ basis_all, int* __restrict__ ranks,
                      bool* __restrict__ decided, int* __restrict__ summary) {
  extern __shared__ double smem_d[];
  double* y = smem_d;  // products, float64
  double* w = y + kD * kYStride;
  double* inv_sqrt = w + kP * kWStride;
  float* a = reinterpret_cast<float*>(inv_sqrt + kP);
  float* x = a + kD * kAStride;  // Omega, then the orthonormal Q, float32
  __shared__ double col_values[kP];
  __shared__ double trace_s;
  __shared__ int rank_s;
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t mat = blockIdx.x;
  const float* src = a_all + mat * n * n;
  for (int e = tid; e < kD * kAStride; e += kThreads) a[e] = 0.f;
  for (int e = tid; e < kD * kXStride; e += kThreads) {
    const int i = e / kXStride, j = e - i * kXStride;
    x[e] = i < n && j < p ? omega[i * p + j] : 0.f;
  }
  __syncthreads();
  // The lower triangle, mirrored.
  for (int e = tid; e < n * n; e += kThreads) {
    const int i = e / n, k = e - i * n;
    if (k <= i) {
      const float v = src[e];
      a[i * kAStride + k] = v;
      a[k * kAStride + i] = v;
    }
  }
  __syncthreads();
  if (tid < 32) {
    double t = 0.0;
    for (int i = lane; i < kD; i += 32) t += a[i * (kAStride + 1)];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) t += __shfl_xor_sync(kFullMask, t, off);
    if (lane == 0) trace_s = t;
  }
  __syncthreads();
  const double trace = trace_s;
  const float shift = static_cast<float>(rel_shift * trace / n);
  shifted_product(a, x, y, shift, tid);
  for (int it = 0; it < power_iters; ++it) {
    orth(y, kYStride, x, w, inv_sqrt, n, p, tid);
    shifted_product(a, x, y, shift, tid);
  }
  orth(y, kYStride, x, w, inv_sqrt, n, p, tid);
  orth(static_cast<const float*>(x), kXStride, x, reinterpret_cast<float*>(w),
       reinterpret_cast<float*>(inv_sqrt), n, p, tid);
  shifted_product(a, x, y, 0.f, tid);  // y = A Q
  {
    // Column j = t / 8, eight lanes over rows part + 8 m.
    const int j = tid >> 3, part = tid & 7;
    double dot = 0.0;
#pragma unroll
    for (int m = 0; m < kD / 8; ++m) {
      const int i = part + 8 * m;
      dot = fma(static_cast<double>(x[i * kXStride + j]), y[i * kYStride + j], dot);
    }
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) dot += __shfl_xor_sync(kFullMask, dot, off);
    if (part == 0) col_values[j] = dot > 0.0 ? dot : 0.0;
  }
  __syncthreads();
  float* values = values_all + mat * n;
  if (tid == 0) {
    const double target = energy * trace;
    double cum = 0.0;
    int reached = 0;
    for (int j = 0; j < p; ++j) {
      cum += col_values[j];
      reached += cum >= target;
    }
    const int first = max(p + 1 - reached, min_rank);
    const int r = (first + multiple - 1) / multiple * multiple;
    const bool is_decided = r + oversample <= p && trace > 0.0;
    decided[mat] = is_decided;
    rank_s = min(r, p);
    ranks[mat] = rank_s;
    // Order-independent reductions: the summary is deterministic.
    atomicMax(summary, rank_s);
    if (!is_decided) atomicAdd(summary + 1, 1);
    if (!isfinite(trace)) atomicAdd(summary + 2, 1);
    const float rest = n > p ? static_cast<float>(fmax(trace - cum, 0.0) / (n - p)) : 0.f;
    for (int j = p; j < n; ++j) values[j] = rest;
  }
  __syncthreads();
  if (tid < p) values[tid] = static_cast<float>(col_values[tid]);
  const int rank = rank_s;
  float* basis = basis_all + mat * n * p;
  for (int e = tid; e < n * p; e += kThreads) {
    const int i = e / p, j = e - i * p;
    basis[e] = j < rank ? x[i * kXStride + j] : 0.f;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sym_sketch_top_cuda(
    const at::Tensor& a, const at::Tensor& omega, double energy, int64_t min_rank,
    int64_t multiple, int64_t power_iters, int64_t oversample, double rel_shift) {
  check_sym_sketch_args(a, omega, energy, min_rank, multiple, power_iters, oversample, rel_shift);
  const c10::cuda::CUDAGuard guard(a.device());
  auto outputs = sym_sketch_outputs(a, omega);
  if (a.size(0) == 0) return outputs;
  auto& [values, basis, ranks, decided, summary] = outputs;
  const int n = static_cast<int>(a.size(1));
  C10_CUDA_CHECK(cudaFuncSetAttribute(sym_sketch_kernel,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  sym_sketch_kernel<<<static_cast<unsigned>(a.size(0)), kThreads, kSmemBytes,
                      at::cuda::getCurrentCUDAStream()>>>(
      a.data_ptr<float>(), omega.data_ptr<float>(), n, static_cast<int>(omega.size(1)), energy,
      rel_shift, static_cast<int>(std::min<int64_t>(min_rank, n + 1)),
      static_cast<int>(std::min<int64_t>(multiple, n + 1)), static_cast<int>(power_iters),
      static_cast<int>(std::min<int64_t>(oversample, n + 1)), values.data_ptr<float>(),
      basis.data_ptr<float>(), ranks.data_ptr<int>(), decided.data_ptr<bool>(),
      summary.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return outputs;
}

}  // namespace

TORCH_LIBRARY_IMPL(adaattn, CUDA, m) {
  m.impl("sym_sketch_top", &sym_sketch_top_cuda);
}

}  // namespace adaattn
