// The CUDA kernel of sym_eig and sym_eig_top for D <= 128, torch-free (CUDA and core/sym_eig.h
// only): included by the ops' launcher (sym_eig.cu) and by the standalone benchmark
// benchmarks/sym_eig_stages.cu.
//
// Per-stage timing: compiled with -DADAATTN_SYM_EIG_STAGES, the kernel takes one more argument,
// long long* stages ([N, kSymEigStageCount] or nullptr), and thread 0 of CTA b writes clock64()
// to stages[b * kSymEigStageCount + s] right after the barrier that ends stage s (s =
// kStageBegin: the kernel's start). Without the macro the probes compile to nothing.
//
// CUDA kernel of sym_eig and sym_eig_top for D <= 128: the algorithm of core/sym_eig.h
// (tridiagonalisation, multisection, rank, inverse iteration, cluster Gram-Schmidt,
// back-transformation, Newton-Schulz), one CTA of 1024 threads per matrix, A in registers during
// the tridiagonalisation, everything else in shared memory (3 buffers of 128 x 129 floats: A and
// the reflectors, Z, scratch; ~200 KB).
//
// Why not Jacobi: parallel Jacobi needs 127 rounds x 6-13 sweeps, each round a barrier, and was
// latency-bound at 1.2-1.65 ms for 64 matrices of 128. Here the sequential depth is ~126
// Householder steps (2 barriers each), 8 multisection steps, the cluster members one after
// another, and 126 reflector applications (no barrier: each thread keeps its rows of Z in
// registers).
//
// Measured per stage on the H100 (benchmarks/sym_eig_stages.cu, 64 matrices of 128, cycles per
// CTA, median over CTAs):
//                          random, sym_eig     planted, sym_eig    planted, sym_eig_top (r = 32)
//   scale/load                   11k                 11k                  11k
//   tridiagonalisation          297k                297k                 297k
//   split                         1k                  1k                   1k
//   multisection                111k                111k                 111k
//   order/rank                    4k                  4k                   5k
//   inverse iteration            60k                 60k                   0k
//   cluster Gram-Schmidt        650k                845k                 127k
//   back-transformation         191k                191k                  80k
//   Newton-Schulz                83k                 83k                  44k
//   sign/store                    6k                  6k                   5k
//   kernel                     0.741 ms            0.909 ms             0.366 ms
// (Kernel times from a run whose Newton-Schulz also skipped the loads of column tiles past r:
// 93k / 46k cycles, so that skip was dropped; the Newton-Schulz row is without it.)
// Back-transformation of r = 32 columns with 16 or 8 lanes per column instead of 32: 96k, 146k.
// The clusters are large: a Gram matrix of 8192 Gaussian rows has gaps ~32 < kSymEigCluster
// ||A||_F ~ 93 (~125 clustered gaps per matrix); the planted one has a 96-member noise cluster
// with ~19 degenerate members. The cluster stage runs its members one after another, which
// keeps it the largest cost of sym_eig; sym_eig_top skips the noise cluster (its vectors are not
// among the first r). The estimates (issue and shared-memory counts) were 2-6x low; ncu on the
// tridiagonalisation alone showed it issue-bound (0.70 instructions per scheduler per cycle).
// Notes:
// * cluster Gram-Schmidt: both halves of a pass (h = Z_c^T z_j, z_j -= Z_c h) on all 1024
//   threads, 8 lanes per column / row with 16 terms each and a 3-shuffle reduction, 4-interleaved
//   so that a warp's loads hit 32 banks; 32-column blocks past the cluster are skipped.
// * tridiagonalisation: A in registers (16 entries per thread), full-length v and p in shared
//   memory so that finished rows and columns need no branches, a fixed reduce-scatter for the
//   matvec; 2 barriers per step (the owner warp of row k + 1 forms the next reflector right after
//   its own update). Skipping finished 32-blocks per slot did not pay (more instructions).
// * split and the cluster/need bookkeeping: ballot scans instead of one-thread loops.
// * multisection: the Sturm recurrence on packed (d_i, e2_{i-1}) pairs, unrolled by 4.
// * scale/load: A read once into registers; signs by 8 threads per column; stores without
//   integer division.
// * back-transformation and Newton-Schulz on the first r output columns only (in output order);
//   rows where the reflector is 0 skipped. The runtime bounds that let sym_eig_top skip column
//   tiles cost the full Newton-Schulz 9k cycles (74k -> 83k).
//
// D > 128 (A, Z and the scratch would not fit in shared memory): the launcher (sym_eig.cu) uses
// float64 at::linalg_eigh, then the same order and sign convention (and sym_eig_rank).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../core/sym_eig.h"

#ifdef ADAATTN_SYM_EIG_STAGES
#define ADAATTN_SYM_EIG_STAGE_PARAM , long long* __restrict__ stages
#define ADAATTN_SYM_EIG_STAGE_ARG(s) , (s)
#define ADAATTN_SYM_EIG_STAGE(s)                                                               \
  do {                                                                                         \
    if (threadIdx.x == 0 && stages != nullptr) stages[mat * kSymEigStageCount + (s)] = clock64(); \
  } while (0)
#else
#define ADAATTN_SYM_EIG_STAGE_PARAM
#define ADAATTN_SYM_EIG_STAGE_ARG(s)
#define ADAATTN_SYM_EIG_STAGE(s) \
  do {                           \
  } while (0)
#endif

namespace adaattn {
namespace {

// Stage probes (ADAATTN_SYM_EIG_STAGES): stage s ends at stages[s]; its cost is
// stages[s] - stages[s - 1].
enum SymEigStage {
  kStageBegin = 0,
  kStageScale,         // 1. scale, load A, ||A||_F
  kStageTridiag,       // 2. Householder tridiagonalisation
  kStageSplit,         // 3. split
  kStageMultisection,  // 4. eigenvalues
  kStageRank,          // 4b. order, rank, the columns to compute
  kStageInverse,       // 5. inverse iteration
  kStageCluster,       // 6. cluster Gram-Schmidt
  kStageBack,          // 7. back-transformation
  kStageNewtonSchulz,  // 8. Newton-Schulz
  kStageStore,         // 9. signs, stores
  kSymEigStageCount
};

constexpr int kMaxSmemDim = 128;
constexpr int kT = 1024;  // threads: 8 per eigenvalue (multisection), 8 per column of Z
constexpr int kWarps = kT / 32;
constexpr int kS = kMaxSmemDim + 1;  // row stride: columns are conflict-free too
constexpr int kBuf = kMaxSmemDim * kS;
static_assert(kT == 8 * kMaxSmemDim, "step 1 maps 8 rows x 128 columns onto the threads");
// Shared memory, in 4-byte words.
constexpr int kOffA = 0, kOffZ = kBuf, kOffR = 2 * kBuf;
// d, e, tau, p, lam, h, sgn; start, bsz, c0, inv, pos, need, the rank (ints); 2 v's
constexpr int kOffVec = 3 * kBuf;
constexpr int kOffRed = kOffVec + 16 * kMaxSmemDim;  // kWarps doubles
constexpr int kSmemBytes = (kOffRed + 2 * kWarps) * 4;
static_assert(kSmemBytes <= 227 * 1024, "shared memory per CTA");

// Sum of v over the CTA in a fixed order (every thread gets the same value). Synchronises.
__device__ __forceinline__ double block_sum(double v, double* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  double s = 0;
#pragma unroll 1
  for (int w = 0; w < kWarps; ++w) s += red[w];
  return s;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// sym_eig_sturm on the pairs de[i] = (d_i, e2_{i-1}) (one 8-byte load per term): the same
// arithmetic, so the same counts.
__device__ __forceinline__ int sturm_packed(const float2* de, int b, int m, float x) {
  float q = de[b].x - x;
  if (fabsf(q) < kSymEigPivMin) q = -kSymEigPivMin;
  int count = q < 0.f;
#pragma unroll 4
  for (int i = b + 1; i < b + m; ++i) {
    const float2 t = de[i];
    q = (t.x - x) - t.y / q;
    if (fabsf(q) < kSymEigPivMin) q = -kSymEigPivMin;
    count += q < 0.f;
  }
  return count;
}

// Segmented scans over n <= 128 flags, one per thread tid < n (warps 0-3), by ballots:
// flag_scan returns the warp's flag bits and leaves each warp's first and last flagged index
// (-1: none) in first[0..3], last[0..3] (shared memory; all threads call it; it synchronises).
__device__ __forceinline__ unsigned flag_scan(bool f, int* first, int* last) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned bits = __ballot_sync(0xffffffffu, f);
  if (warp < 4 && lane == 0) {
    first[warp] = bits ? 32 * warp + __ffs(bits) - 1 : -1;
    last[warp] = bits ? 32 * warp + 31 - __clz(bits) : -1;
  }
  __syncthreads();
  return bits;
}

// The last flagged index <= tid (-1: none).
__device__ __forceinline__ int flag_last_upto(unsigned bits, const int* last) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned m = bits & (0xffffffffu >> (31 - lane));
  if (m) return 32 * warp + 31 - __clz(m);
  for (int w = warp - 1; w >= 0; --w) {
    if (last[w] >= 0) return last[w];
  }
  return -1;
}

// The first flagged index >= tid + skip (skip 0 or 1; `none`: none).
__device__ __forceinline__ int flag_first_from(unsigned bits, const int* first, int skip,
                                               int none) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, from = lane + skip;
  const unsigned m = from > 31 ? 0u : bits & (0xffffffffu << from);
  if (m) return 32 * warp + __ffs(m) - 1;
  for (int w = warp + 1; w < 4; ++w) {
    if (first[w] >= 0) return first[w];
  }
  return none;
}

// Entry c of a thread's 4 register slots at a warp-uniform runtime index (selects, no local
// memory).
__device__ __forceinline__ float pick(const float (&x)[4], int c) {
  return c == 0 ? x[0] : c == 1 ? x[1] : c == 2 ? x[2] : x[3];
}

// The owner warp of row k (k % 32; the row is in register slot k / 32, lane l holding columns
// l + 32 c): the Householder reflector of step k from x = row k of A (its trailing part is
// column k). v goes to row k of A in shared memory, entries k+2..n-1 (v_{k+1} = 1 implicit),
// and in full (0 outside k+1..n-1) to vk; d[k] = x[k], e[k] = beta, tau[k] (0 when x[k+2..n) is
// exactly 0; then nothing reads v).
__device__ __forceinline__ void tridiag_reflector(const float (&a)[4][4], float* A, float* vk,
                                                  int k, int n, int lane, float* d, float* e,
                                                  float* tau) {
  const int slot = k >> 5;
  float x[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float col[4] = {a[0][c], a[1][c], a[2][c], a[3][c]};
    x[c] = pick(col, slot);
  }
  float sig = 0.f;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int j = lane + 32 * c;
    if (j >= k + 2 && j < n) sig += x[c] * x[c];
  }
  sig = warp_sum(sig);
  const float alpha = __shfl_sync(0xffffffffu, pick(x, (k + 1) >> 5), (k + 1) & 31);
  const float diag = __shfl_sync(0xffffffffu, pick(x, k >> 5), k & 31);
  float t = 0.f, beta = alpha;
  if (sig != 0.f) {
    const float mu = sqrtf(alpha * alpha + sig);
    beta = alpha <= 0.f ? mu : -mu;
    t = (beta - alpha) / beta;
    const float sc = 1.f / (alpha - beta);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int j = lane + 32 * c;
      const float v = j == k + 1 ? 1.f : j >= k + 2 && j < n ? x[c] * sc : 0.f;
      if (j >= k + 2) A[k * kS + j] = v;
      vk[j] = v;
    }
  }
  if (lane == 0) {
    d[k] = diag;
    e[k] = beta;
    tau[k] = t;
  }
}

// Back-transformation of the first r output columns: output column g < r is Z's column inv[g]
// (tridiagonal order), written to Z's column g. P consecutive lanes per column, lane `part`
// keeping rows part + P q in registers; warps whose columns are all >= r idle.
template <int P>
__device__ __forceinline__ void back_transform(float* Z, const float* A, const float* tau,
                                               const int* inv, int n, int r) {
  constexpr int kRows = kMaxSmemDim / P;
  const int g = threadIdx.x / P, part = threadIdx.x % P;
  const bool active = (threadIdx.x >> 5) * 32 / P < r;  // warp-uniform
  const int src = g < r ? inv[g] : g;
  float z[kRows];
#pragma unroll
  for (int q = 0; q < kRows; ++q) z[q] = active ? Z[(part + P * q) * kS + src] : 0.f;
  __syncthreads();  // every source column is read before column g is overwritten
  if (!active) return;
#pragma unroll 1
  for (int k = n - 3; k >= 0; --k) {
    const float t = tau[k];
    if (t == 0.f) continue;
    const float* x = A + k * kS;
    // v is 0 in rows <= k: q with P q + P - 1 <= k (all P parts' rows) is skipped (uniform
    // over the column's lanes), about half of the q's over the n - 2 steps.
    float vq[kRows], s = 0.f;
#pragma unroll
    for (int q = 0; q < kRows; ++q) {
      if (P * q + P - 1 > k) {
        const int y = part + P * q;
        vq[q] = y == k + 1 ? 1.f : y > k + 1 ? x[y] : 0.f;
        s += vq[q] * z[q];
      }
    }
#pragma unroll
    for (int o = P / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    s *= t;
#pragma unroll
    for (int q = 0; q < kRows; ++q) {
      if (P * q + P - 1 > k) z[q] -= s * vq[q];
    }
  }
  if (g < r) {
#pragma unroll
    for (int q = 0; q < kRows; ++q) Z[(part + P * q) * kS + g] = z[q];
  }
}

// ranks == nullptr: sym_eig (all n columns; energy is ignored). Otherwise sym_eig_top: the rank r
// of sym_eig_rank goes to ranks[mat], and only the first r columns of the output are computed,
// the others are 0.
__global__ void __launch_bounds__(kT, 1)
    sym_eig_kernel(const float* __restrict__ a_all, float* __restrict__ w_all,
                   float* __restrict__ v_all, int n, double energy, int min_rank, int multiple,
                   int* __restrict__ ranks ADAATTN_SYM_EIG_STAGE_PARAM) {
  extern __shared__ __align__(16) float sm[];
  float* A = sm + kOffA;
  float* Z = sm + kOffZ;
  float* R = sm + kOffR;
  float* d = sm + kOffVec;
  float* e = d + kMaxSmemDim;
  float* tau = e + kMaxSmemDim;
  float* p = tau + kMaxSmemDim;
  float* lam = p + kMaxSmemDim;
  float* h = lam + kMaxSmemDim;
  float* sgn = h + kMaxSmemDim;
  int* start = reinterpret_cast<int*>(sgn + kMaxSmemDim);
  int* bsz = start + kMaxSmemDim;
  int* c0 = bsz + kMaxSmemDim;
  int* inv = c0 + kMaxSmemDim;
  int* pos = inv + kMaxSmemDim;
  int* need = pos + kMaxSmemDim;
  int* rank_out = need + kMaxSmemDim;
  float* vbuf = reinterpret_cast<float*>(rank_out + kMaxSmemDim);  // 2 x 128: v of steps k, k + 1
  int* scan = reinterpret_cast<int*>(p);  // flag_scan's summaries, once p is no longer used
  float2* de = reinterpret_cast<float2*>(vbuf);  // (d_i, e2_{i-1}) for step 4, after step 2
  double* red = reinterpret_cast<double*>(sm + kOffRed);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t mat = blockIdx.x;
  const float* a = a_all + mat * n * n;
  ADAATTN_SYM_EIG_STAGE(kStageBegin);

  // 1. Scale: max |a_ij| (max is order-independent), then A (zero-padded to 128) and ||A||_F.
  // Thread tid reads the lower-triangle entries (y, x) = (tid / 128 + 8 i, tid % 128), i < 16,
  // once, into registers.
  const int x0 = tid & (kMaxSmemDim - 1), y0 = tid / kMaxSmemDim;
  float av[kMaxSmemDim * kMaxSmemDim / kT];
  float mx = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxSmemDim * kMaxSmemDim / kT; ++i) {
    const int y = y0 + 8 * i;
    av[i] = x0 <= y && y < n ? a[y * n + x0] : 0.f;
    mx = fmaxf(mx, fabsf(av[i]));
  }
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (lane == 0) h[warp] = mx;
  __syncthreads();
  mx = 0.f;
  for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, h[w]);
  const int ex = sym_eig_exponent(mx);
  double norm2 = 0;
#pragma unroll
  for (int i = 0; i < kMaxSmemDim * kMaxSmemDim / kT; ++i) {
    const int y = y0 + 8 * i;
    Z[y * kS + x0] = 0.f;
    if (x0 > y) continue;
    const float v = ldexpf(av[i], -ex);
    A[y * kS + x0] = A[x0 * kS + y] = v;
    norm2 += (x0 == y ? 1.0 : 2.0) * v * v;
  }
  const float anorm = static_cast<float>(sqrt(block_sum(norm2, red)));
  ADAATTN_SYM_EIG_STAGE(kStageScale);

  // 2. Tridiagonalisation with A in registers: warp w holds rows w + 32 r, lane l columns
  // l + 32 c (r, c < 4), so the matvec and the rank-2 update touch no shared memory for A. v
  // (vbuf, 0 outside k+1..n-1) and p (0 outside k+1..n-1) are full-length, so the finished rows
  // and columns need no branches: their updates are exact zeros (the stage is issue-bound: ncu
  // showed 0.70 instructions per scheduler per cycle; skipping them per slot cost more
  // instructions than it saved). Two barriers per step: p, then the next reflector (formed by
  // the owner warp of row k + 1 right after its own update).
  {
    float a[4][4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
#pragma unroll
      for (int c = 0; c < 4; ++c) a[r][c] = A[(warp + 32 * r) * kS + lane + 32 * c];
    }
    if (warp == 0 && n > 2) tridiag_reflector(a, A, vbuf, 0, n, lane, d, e, tau);
    __syncthreads();
#pragma unroll 1
    for (int k = 0; k + 2 < n; ++k) {
      const float t = tau[k];
      if (t != 0.f) {  // uniform; tau = 0: A' is unchanged
        const float* vk = vbuf + (k & 1) * kMaxSmemDim;
        float vc[4], vr[4], s[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) vc[c] = vk[lane + 32 * c];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          vr[r] = vk[warp + 32 * r];
          s[r] = 0.f;
#pragma unroll
          for (int c = 0; c < 4; ++c) s[r] += a[r][c] * vc[c];
        }
        // p_i = tau (A' v)_i: a fixed reduce-scatter over the 32 lanes (xor 16 and 8 split the
        // 4 rows, then xor 4, 2, 1), so lane l ends with row slot 2 (l >> 4 & 1) + (l >> 3 & 1).
        const bool hi = lane & 16, mid = lane & 8;
        const float t0 = (hi ? s[2] : s[0]) + __shfl_xor_sync(0xffffffffu, hi ? s[0] : s[2], 16);
        const float t1 = (hi ? s[3] : s[1]) + __shfl_xor_sync(0xffffffffu, hi ? s[1] : s[3], 16);
        float u = (mid ? t1 : t0) + __shfl_xor_sync(0xffffffffu, mid ? t0 : t1, 8);
        u += __shfl_xor_sync(0xffffffffu, u, 4);
        u += __shfl_xor_sync(0xffffffffu, u, 2);
        u += __shfl_xor_sync(0xffffffffu, u, 1);
        const int pi = warp + 32 * ((hi ? 2 : 0) + (mid ? 1 : 0));
        if ((lane & 7) == 0) p[pi] = pi > k && pi < n ? t * u : 0.f;
        __syncthreads();
        // Every warp forms p . v itself (same order, same value); w = p - (tau / 2)(p . v) v.
        float pc[4], pv = 0.f;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          pc[c] = p[lane + 32 * c];
          pv += pc[c] * vc[c];
        }
        const float kk = 0.5f * t * warp_sum(pv);
#pragma unroll
        for (int c = 0; c < 4; ++c) pc[c] -= kk * vc[c];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float wr = p[warp + 32 * r] - kk * vr[r];
#pragma unroll
          for (int c = 0; c < 4; ++c) a[r][c] -= vr[r] * pc[c] + wr * vc[c];
        }
      }
      if (warp == ((k + 1) & 31) && k + 3 < n) {
        tridiag_reflector(a, A, vbuf + ((k + 1) & 1) * kMaxSmemDim, k + 1, n, lane, d, e, tau);
      }
      __syncthreads();
    }
    // The last 2 x 2 block back to shared memory, for step 3.
#pragma unroll
    for (int r = 0; r < 4; ++r) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int i = warp + 32 * r, j = lane + 32 * c;
        if (i >= n - 2 && j >= n - 2) A[i * kS + j] = a[r][c];
      }
    }
    __syncthreads();
  }
  ADAATTN_SYM_EIG_STAGE(kStageTridiag);

  // 3. Split: e_i = 0 where small, de for step 4, block starts (start[i] = the last i' <= i with
  // e_{i'-1} = 0, or 0) and sizes (to the next start), by flag scans.
  if (tid == 0) {
    if (n >= 2) {
      d[n - 2] = A[(n - 2) * kS + n - 2];
      e[n - 2] = A[(n - 1) * kS + n - 2];
    }
    d[n - 1] = A[(n - 1) * kS + n - 1];
  }
  __syncthreads();
  {
    bool first = false;
    if (tid < n) {
      first = tid == 0;
      float e2i = 0.f;
      if (tid > 0) {
        float ei = e[tid - 1];
        if (fabsf(ei) <= kSymEigSplit * anorm) ei = 0.f;
        e[tid - 1] = ei;
        e2i = ei * ei;
        first = ei == 0.f;
      }
      de[tid] = make_float2(d[tid], e2i);
    }
    const unsigned bits = flag_scan(first, scan, scan + 4);
    if (tid < n) {
      start[tid] = flag_last_upto(bits, scan + 4);
      if (first) bsz[tid] = flag_first_from(bits, scan, 1, n) - tid;
    }
  }
  __syncthreads();
  ADAATTN_SYM_EIG_STAGE(kStageSplit);

  // 4. Eigenvalues: 8 consecutive lanes per eigenvalue, one Sturm count each per step.
  {
    const int j = tid >> 3, t = tid & 7, gshift = lane & ~7;
    const int b = j < n ? start[j] : 0, m = j < n ? bsz[b] : 1, jj = j - b;
    float lo = 0.f, hi = 0.f;
    if (m > 1) sym_eig_gerschgorin(d, e, b, m, lo, hi);
#pragma unroll 1
    for (int step = 0; step < kSymEigSections; ++step) {
      const float xt = sym_eig_point(lo, hi, t);
      const bool below = m > 1 && sturm_packed(de, b, m, xt) <= jj;
      const unsigned g = (__ballot_sync(0xffffffffu, below) >> gshift) & 0xffu;
      // CPU twin: lo = the last point with count <= jj, hi = the first with count > jj.
      const float nlo = __shfl_sync(0xffffffffu, xt, gshift + (g ? 31 - __clz(g) : 0));
      const unsigned above = ~g & 0xffu;
      const float nhi = __shfl_sync(0xffffffffu, xt, gshift + (above ? __ffs(above) - 1 : 0));
      if (g) lo = nlo;
      if (above) hi = nhi;
    }
    if (j < n && t == 0) lam[j] = m == 1 ? d[b] : 0.5f * (lo + hi);
  }
  __syncthreads();
  ADAATTN_SYM_EIG_STAGE(kStageMultisection);

  // 4b. Output order (descending, sym_eig_precedes; 8 threads per eigenvalue): inv[position] =
  // index, pos[index] = position; each eigenvalue's cluster start c0 (flag scan of the cluster
  // starts); the rank r (warp 0: sym_eig_rank's scan); need[j]: j's vector is needed, i.e. the
  // first eigenvalue >= j among the first r lies in j's cluster (step 6 orthogonalises a member
  // against the lower ones).
  const float tiny = kSymEigPivot * anorm, ctol = kSymEigCluster * anorm;
  {
    const int j = tid >> 3, part = tid & 7;
    int rk = 0;
    if (j < n) {
      const float l = lam[j];
      for (int y = part; y < n; y += 8) rk += sym_eig_precedes(lam[y], y, l, j);
    }
    rk += __shfl_xor_sync(0xffffffffu, rk, 4);
    rk += __shfl_xor_sync(0xffffffffu, rk, 2);
    rk += __shfl_xor_sync(0xffffffffu, rk, 1);
    if (j < n && part == 0) {
      inv[rk] = j;
      pos[j] = rk;
    }
  }
  const bool cfirst = tid < n && !(tid > start[tid] && lam[tid] - lam[tid - 1] <= ctol);
  const unsigned cbits = flag_scan(cfirst, scan + 8, scan + 12);
  if (tid < n) c0[tid] = flag_last_upto(cbits, scan + 12);
  if (warp == 0) {
    int r = n;
    if (ranks != nullptr && energy < 1.0) {
      double local[kSymEigRankChunk], s = 0.0;
#pragma unroll
      for (int i = 0; i < kSymEigRankChunk; ++i) {
        const int o = kSymEigRankChunk * lane + i;
        s += o < n ? sym_eig_clamped(lam[inv[o]]) : 0.0;
        local[i] = s;
      }
#pragma unroll
      for (int stride = 1; stride < 32; stride *= 2) {
        const double up = __shfl_up_sync(0xffffffffu, s, stride);
        if (lane >= stride) s += up;
      }
      const double target = energy * __shfl_sync(0xffffffffu, s, 31);
      const double before = __shfl_up_sync(0xffffffffu, s, 1);
      int first = kSymEigRankChunk;  // the lane's first entry that reaches the target
#pragma unroll
      for (int i = kSymEigRankChunk - 1; i >= 0; --i) {
        const int o = kSymEigRankChunk * lane + i;
        if (o < n && (lane > 0 ? before + local[i] : local[i]) >= target) first = i;
      }
      const unsigned hit = __ballot_sync(0xffffffffu, first < kSymEigRankChunk);
      const int src = hit ? __ffs(hit) - 1 : 0;
      const int o = kSymEigRankChunk * src + __shfl_sync(0xffffffffu, first, src);
      if (hit) r = sym_eig_round_rank(o + 1, n, min_rank, multiple);
    }
    if (lane == 0) {
      *rank_out = r;
      if (ranks != nullptr) ranks[mat] = r;
    }
  }
  __syncthreads();
  const int r = *rank_out;
  const unsigned nbits = flag_scan(tid < n && pos[tid] < r, scan + 16, scan + 20);
  if (tid < n) {
    need[tid] = flag_first_from(nbits, scan + 16, 0, n) < flag_first_from(cbits, scan + 8, 1, n);
  }
  __syncthreads();
  ADAATTN_SYM_EIG_STAGE(kStageRank);

  // 5. Inverse iteration, one thread per needed eigenvalue (Z was zeroed in step 1); R column j
  // keeps the factors of T - lam_j I for step 6. Vectors outside clusters are normalised here.
  if (tid < n && need[tid]) {
    const int j = tid, b = start[j], m = bsz[b], c = c0[j];
    if (m == 1) {
      Z[b * kS + j] = 1.f;
    } else {
      const bool degenerate = j > b && lam[j] - lam[j - 1] <= kSymEigDegenerate * anorm;
      sym_eig_factor(d, e, b, m, lam[j], tiny, R + j, kS);
      for (int y = b; y < b + m; ++y) Z[y * kS + j] = sym_eig_start(y, j);
      for (int it = 0; it < (degenerate ? 1 : kSymEigInverseIts); ++it) {
        sym_eig_solve(e, b, m, R + j, kS, Z + j, kS);
      }
      if (c == j) {
        float s = 0.f;
        for (int y = b; y < b + m; ++y) s += Z[y * kS + j] * Z[y * kS + j];
        const float iv = 1.f / sqrtf(s);
        for (int y = b; y < b + m; ++y) Z[y * kS + j] *= iv;
      }
    }
  }
  __syncthreads();
  ADAATTN_SYM_EIG_STAGE(kStageInverse);

  // 6. Clusters: classical Gram-Schmidt twice against the cluster's earlier vectors, members in
  // ascending order (the CPU twin's order); degenerate members get a second solve and round.
#pragma unroll 1
  for (int j = 1; j < n; ++j) {
    const int c = c0[j];
    if (c == j || !need[j]) continue;  // uniform
    const int b = start[j], m = bsz[b];
    const bool degenerate = lam[j] - lam[j - 1] <= kSymEigDegenerate * anorm;
#pragma unroll 1
    for (int round = 0; round < (degenerate ? 2 : 1); ++round) {
      if (round == 1) {
        if (tid == 0) sym_eig_solve(e, b, m, R + j, kS, Z + j, kS);
        __syncthreads();
      }
#pragma unroll 1
      for (int pass = 0; pass < 2; ++pass) {
        // h_i = z_i . z_j, i in [c, j): 8 consecutive lanes per column i, lane `part` summing
        // rows b + 4 part + r + 32 s (r, s < 4): the 32 lanes of a warp (4 columns x 8 parts)
        // hit 32 different banks (row stride 129).
        {
          const int i = c + (tid >> 3), part = tid & 7;
          float s = 0.f;
          if (i < j) {
#pragma unroll
            for (int q = 0; q < 16; ++q) {
              if (32 * (q >> 2) >= m) break;  // uniform
              const int y = b + 4 * part + (q & 3) + 32 * (q >> 2);
              if (y < b + m) s += Z[y * kS + i] * Z[y * kS + j];
            }
          }
          s += __shfl_xor_sync(0xffffffffu, s, 4);
          s += __shfl_xor_sync(0xffffffffu, s, 2);
          s += __shfl_xor_sync(0xffffffffu, s, 1);
          if (i < j && part == 0) h[i] = s;
        }
        __syncthreads();
        // z_j -= sum_i h_i z_i: 8 consecutive lanes per row y, lane `part` summing the columns
        // c + 4 part + r + 32 s (conflict-free likewise); only column j is written.
        {
          const int y = b + (tid >> 3), part = tid & 7;
          float s = 0.f;
          if (y < b + m) {
#pragma unroll
            for (int q = 0; q < 16; ++q) {
              if (c + 32 * (q >> 2) >= j) break;  // uniform: the cluster's earlier members
              const int i = c + 4 * part + (q & 3) + 32 * (q >> 2);
              if (i < j) s += h[i] * Z[y * kS + i];
            }
          }
          s += __shfl_xor_sync(0xffffffffu, s, 4);
          s += __shfl_xor_sync(0xffffffffu, s, 2);
          s += __shfl_xor_sync(0xffffffffu, s, 1);
          if (y < b + m && part == 0) Z[y * kS + j] -= s;
        }
        __syncthreads();
      }
    }
    if (warp == 0) {
      float s = 0.f;
      for (int y = b + lane; y < b + m; y += 32) s += Z[y * kS + j] * Z[y * kS + j];
      s = warp_sum(s);
      const float iv = 1.f / sqrtf(s);
      for (int y = b + lane; y < b + m; y += 32) Z[y * kS + j] *= iv;
    }
    __syncthreads();
  }
  ADAATTN_SYM_EIG_STAGE(kStageCluster);

  // 7. Back-transformation of the first r output columns, into Z's columns 0..r-1.
  if (r <= 32) {
    back_transform<32>(Z, A, tau, inv, n, r);
  } else if (r <= 64) {
    back_transform<16>(Z, A, tau, inv, n, r);
  } else {
    back_transform<8>(Z, A, tau, inv, n, r);
  }
  __syncthreads();
  ADAATTN_SYM_EIG_STAGE(kStageBack);

  // 8. Newton-Schulz on U = Z's columns 0..r-1: R = U^T U - I, then U <- U - U R / 2. Thread
  // tile: rows/columns a0 + 32 i, b0 + 32 j (a0 is warp-uniform: broadcast loads; b0 = lane:
  // conflict-free); column tiles past r are skipped (uniform).
  {
    const int a0 = warp, b0 = lane, tiles = (r + 31) / 32;
    float acc[4][4] = {};
#pragma unroll 2
    for (int y = 0; y < n; ++y) {
      float xa[4], yb[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        xa[i] = Z[y * kS + a0 + 32 * i];
        yb[i] = Z[y * kS + b0 + 32 * i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int jx = 0; jx < 4; ++jx) {
          if (i < tiles && jx < tiles) acc[i][jx] += xa[i] * yb[jx];
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int jx = 0; jx < 4; ++jx) {
        const int x = a0 + 32 * i, y = b0 + 32 * jx;
        if (i < tiles && jx < tiles) {
          R[x * kS + y] = x < r && y < r ? acc[i][jx] - (x == y ? 1.f : 0.f) : 0.f;
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int jx = 0; jx < 4; ++jx) acc[i][jx] = 0.f;
    }
#pragma unroll 2
    for (int k = 0; k < r; ++k) {
      float ua[4], rb[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        ua[i] = Z[(a0 + 32 * i) * kS + k];
        rb[i] = R[k * kS + b0 + 32 * i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int jx = 0; jx < 4; ++jx) {
          if (jx < tiles) acc[i][jx] += ua[i] * rb[jx];
        }
      }
    }
    float out[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int jx = 0; jx < 4; ++jx) {
        out[i][jx] = Z[(a0 + 32 * i) * kS + b0 + 32 * jx] - 0.5f * acc[i][jx];
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int jx = 0; jx < 4; ++jx) {
        if (jx < tiles) Z[(a0 + 32 * i) * kS + b0 + 32 * jx] = out[i][jx];
      }
    }
  }
  __syncthreads();
  ADAATTN_SYM_EIG_STAGE(kStageNewtonSchulz);

  // 9. Sign of each output column (its entry of largest magnitude positive: 8 threads per column
  // g < r, then a shuffle tree; sym_eig_larger_entry is a total order, so any tree finds the
  // entry a scan would), stores (columns r.. are 0).
  {
    const int g = tid >> 3, part = tid & 7;
    float bv = NAN;  // key -1: every entry beats it
    int big = kMaxSmemDim;
    if (g < r) {
      for (int y = part; y < n; y += 8) {
        const float v = Z[y * kS + g];
        if (sym_eig_larger_entry(v, y, bv, big)) {
          big = y;
          bv = v;
        }
      }
    }
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, big, o);
      if (sym_eig_larger_entry(ov, oi, bv, big)) {
        big = oi;
        bv = ov;
      }
    }
    if (g < r && part == 0) sgn[g] = bv < 0.f ? -1.f : 1.f;
  }
  __syncthreads();
  float* w = w_all + mat * n;
  float* v = v_all + mat * n * n;
  if (tid < n) w[tid] = ldexpf(lam[inv[tid]], ex);
  if (x0 < n) {
    for (int y = y0; y < n; y += kT / kMaxSmemDim) {
      v[y * n + x0] = x0 < r ? sgn[x0] * Z[y * kS + x0] : 0.f;
    }
  }
#ifdef ADAATTN_SYM_EIG_STAGES
  __syncthreads();
#endif
  ADAATTN_SYM_EIG_STAGE(kStageStore);
}

// Launches the kernel on a [batch, n, n] (n <= kMaxSmemDim) on `stream`: sym_eig when ranks is
// nullptr, else sym_eig_top (min_rank and multiple clamped to [1, n] here, which gives the same
// ranks); `stages` is written only when compiled with ADAATTN_SYM_EIG_STAGES.
inline cudaError_t sym_eig_launch(const float* a, float* w, float* v, int batch, int n,
                                  cudaStream_t stream, double energy = 1.0, int64_t min_rank = 1,
                                  int64_t multiple = 1, int* ranks = nullptr,
                                  long long* stages = nullptr) {
  (void)stages;
  const cudaError_t err = cudaFuncSetAttribute(
      sym_eig_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  const int mr = static_cast<int>(min_rank < 1 ? 1 : min_rank > n ? n : min_rank);
  const int mu = static_cast<int>(multiple < 1 ? 1 : multiple > n ? n : multiple);
  sym_eig_kernel<<<static_cast<unsigned>(batch), kT, kSmemBytes, stream>>>(
      a, w, v, n, energy, mr, mu, ranks ADAATTN_SYM_EIG_STAGE_ARG(stages));
  return cudaGetLastError();
}

}  // namespace
}  // namespace adaattn
