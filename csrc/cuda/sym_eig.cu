// CUDA kernel of sym_eig: the parallel cyclic Jacobi eigensolver of core/jacobi.h, one CTA per
// matrix, for D <= 128 (n = jacobi_padded_dim(D), 16..128, is a template parameter).
//
// Shared memory holds A's strict upper triangle in position order (position x holds the index
// that sits at x this round; pair k = (k, m + k)), twice: round R reads buffer R % 2 and writes
// every entry to its position of round R + 1 in the other buffer. Each thread's loads and stores
// are then at offsets fixed for the whole run, the A update needs no synchronisation of its own,
// and a round costs one __syncthreads. The diagonal d and the rotations (c, s) are kept apart,
// also double-buffered.
//
// * A tasks: the m (m - 1) / 2 off-diagonal 2x2 blocks of a round, fixed per thread (2 per thread
//   at n = 128, 1024 threads): 4 loads, 2 rotation loads, 16 FMA, 4 stores. The task holding the
//   entry that the next round pairs computes that pair's rotation and diagonal update from its
//   fresh value, so rotations need no phase of their own; these m tasks come first so that their
//   longer dependency chain overlaps the other warps' work.
// * V in registers: thread (segment g, row r) owns row r's columns of pairs 8g..8g+7 (16 floats);
//   each round the ring moves one column into each neighbouring segment, through shared memory.
// * Stopping (core/jacobi.h): the off-norm is summed in double during the last round of a sweep,
//   whose designated tasks only move the diagonal; the next sweep's first rotations are computed
//   after the decision, by the rotate_pairs phase.
// * Then one Newton-Schulz step (two n x n x n products in shared memory), ranks, signs and
//   coalesced stores.
//
// Expected cost at n = 128 (from the sm_90 SASS): ~140 instructions per thread per round (2 tasks
// of ~32, ~60 for V, the rest loop, barrier and exchange), i.e. ~1100 cycles of issue for 32
// warps, with ~1000 shared-memory wavefronts alongside: ~1100-1300 cycles per round. 127 rounds
// per sweep, 6-13 sweeps (8 for a random Gram matrix): ~1.1-1.3 M cycles typical, 0.6-0.75 ms
// at 1.75 GHz, for any N up to the number of SMs (one CTA per SM). Measured on the H100
// (benchmarks/bench_rank.py, 64 matrices): 1.22 ms for random Gram matrices, 1.65 ms for planted
// low-rank ones, so about twice the issue estimate.
//
// D > 128 (A would not fit in shared memory): float64 at::linalg_eigh, then the same order and
// sign convention.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "../core/jacobi.h"
#include "../sym_eig_api.h"

namespace adaattn {
namespace {

constexpr int kMaxSmemDim = 128;

template <int N>
struct EigCfg {
  static constexpr int M = N / 2;
  static constexpr int S = N + 1;   // A row stride: odd, so columns are conflict-free too
  static constexpr int S2 = N + 4;  // post-processing stride: 16-byte rows, 4-bank row shift
  static constexpr int G = N / 16;  // V segments (8 pairs each) per row
  static constexpr int VT = N * G;  // V threads; also the (N / 4)^2 GEMM tiles
  static constexpr int T = (VT + 31) / 32 * 32;  // whole warps (block_sum)
  static constexpr int WARPS = T / 32;
  static constexpr int TASKS = M * (M - 1) / 2;
  static constexpr int NT = (TASKS + T - 1) / T;  // tasks per thread
  // Shared memory, in floats.
  static constexpr int ABUF = N * S2;  // one A buffer (N * S used); U and U^T U - I afterwards
  static constexpr int OFF_D = 2 * ABUF;
  static constexpr int OFF_ROT = OFF_D + 2 * N;
  static constexpr int OFF_X = OFF_ROT + 4 * M;  // V exchange [2][2][VT]; ranks, signs later
  static constexpr int OFF_RED = OFF_X + 4 * VT;
  static constexpr int FLOATS = OFF_RED + 2 * WARPS;  // one double per warp
  static constexpr int SMEM_BYTES = FLOATS * 4;
  static_assert(4 * VT >= 3 * N, "ranks, inverse ranks and signs reuse the exchange buffer");
  static_assert(M <= T, "the designated tasks (the first m) must be every thread's first task");
};

// Offset of entry (x, y), x != y, in an A buffer (upper triangle, stride S).
template <int N>
__device__ __forceinline__ int upper(int x, int y) {
  return x < y ? x * EigCfg<N>::S + y : y * EigCfg<N>::S + x;
}

// One off-diagonal block (pairs i < j) of every round, with its load and store offsets.
struct Task {
  int rb1, rb2;    // offsets of a(k_i, k_j) and of a(k_j, m + k_i) - m
  int w[4];        // where the 4 entries live next round
  int roti, rotj;  // byte offsets of the pairs' rotations; roti < 0: no task
  int desig;       // (next pair k + 1) | (entry e << 8) when this block holds the next a_pq
};

// Task f: first the m blocks that hold the next round's pairs (next pair k comes from blocks
// (0, 1), (0, 2), (k - 1, k + 1) for 2 <= k <= m - 2 and (m - 2, m - 1)), then the others row by
// row: j >= 3 in row 0, j = i + 1 and j >= i + 3 in rows 1..m-3.
template <int N>
__device__ Task make_task(int f) {
  using C = EigCfg<N>;
  constexpr int M = C::M, S = C::S;
  Task t;
  t.desig = 0;
  if (f >= C::TASKS) {
    t.roti = -1;
    return t;
  }
  int i, j;
  if (f < M) {
    const int k = f;
    i = k == 0 ? 0 : k == 1 ? 0 : k == M - 1 ? M - 2 : k - 1;
    j = k == 0 ? 1 : k == 1 ? 2 : k == M - 1 ? M - 1 : k + 1;
  } else {
    int rest = f - M;
    for (i = 0;; ++i) {
      const int len = M - 1 - i - (i == 0 ? 2 : 1);
      if (rest < len) break;
      rest -= len;
    }
    j = i == 0 ? 3 + rest : i + 1 + rest + (rest >= 1);
  }
  t.roti = i * static_cast<int>(sizeof(float2));
  t.rotj = j * static_cast<int>(sizeof(float2));
  t.rb1 = i * S + j;
  t.rb2 = j * S + i;
  const int xs[4] = {i, i, M + i, M + i};
  const int ys[4] = {j, M + j, j, M + j};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int nx = jacobi_ring_next(xs[e], M), ny = jacobi_ring_next(ys[e], M);
    t.w[e] = upper<N>(nx, ny);
    if (f < M && t.w[e] == upper<N>(f, M + f)) t.desig = (f + 1) | (e << 8);
  }
  return t;
}

// Sum of v over the CTA in a fixed order (every thread gets the same value). Synchronises.
template <int N>
__device__ __forceinline__ double block_sum(double v, double* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  double s = 0;
#pragma unroll 1
  for (int w = 0; w < EigCfg<N>::WARPS; ++w) s += red[w];
  return s;
}

// The first rotations of a sweep (thread k < m: pair k), in place in the buffers of parity P.
template <int N>
__device__ __forceinline__ void rotate_pair(float* sm, int P, int k, float skip_tol) {
  using C = EigCfg<N>;
  constexpr int M = C::M, S = C::S;
  float* A = sm + P * C::ABUF;
  float* d = sm + C::OFF_D + P * N;
  const float apq = A[k * S + M + k], app = d[k], aqq = d[M + k];
  const JacobiRotation r = jacobi_rotation(app, aqq, apq, skip_tol);
  reinterpret_cast<float2*>(sm + C::OFF_ROT)[P * M + k] = make_float2(r.c, r.s);
  if (!r.skipped) {
    d[k] = app - r.t * apq;
    d[M + k] = aqq + r.t * apq;
    A[k * S + M + k] = 0.f;
  }
}

// One round: apply the rotations of parity P to A (into the other buffer) and to V, and prepare
// the next round's rotations, or, in the LAST round of a sweep, move the diagonal and sum the
// off-norm.
template <int N, int P, bool LAST>
__device__ __forceinline__ void jacobi_round(float* sm, const Task (&task)[EigCfg<N>::NT],
                                             int wdiag, float (&top)[8], float (&bot)[8],
                                             float skip_tol, double& off2) {
  using C = EigCfg<N>;
  constexpr int M = C::M, S = C::S, G = C::G, VT = C::VT;
  const float* Ar = sm + P * C::ABUF;
  float* Aw = sm + (1 - P) * C::ABUF;
  const float2* rot = reinterpret_cast<const float2*>(sm + C::OFF_ROT) + P * M;
  const char* rot_bytes = reinterpret_cast<const char*>(rot);
  float2* rot_next = reinterpret_cast<float2*>(sm + C::OFF_ROT) + (1 - P) * M;
  const float* d = sm + C::OFF_D + P * N;
  float* d_next = sm + C::OFF_D + (1 - P) * N;
  const int tid = threadIdx.x;

#pragma unroll
  for (int s = 0; s < C::NT; ++s) {
    const Task& tk = task[s];
    if (tk.roti < 0) continue;
    float x[4] = {Ar[tk.rb1], Ar[tk.rb1 + M], Ar[tk.rb2 + M], Ar[tk.rb1 + M * S + M]};
    const float2 ri = *reinterpret_cast<const float2*>(rot_bytes + tk.roti);
    const float2 rj = *reinterpret_cast<const float2*>(rot_bytes + tk.rotj);
    jacobi_rotate_block(x, ri.x, ri.y, rj.x, rj.y);
    if (LAST) {
      off2 += 2.0 * ((double)x[0] * x[0] + (double)x[1] * x[1] + (double)x[2] * x[2] +
                     (double)x[3] * x[3]);
    }
    if (s == 0 && tk.desig) {  // designated tasks are the first T
      const int k = (tk.desig & 0xff) - 1, e = tk.desig >> 8;
      const float apq = e == 0 ? x[0] : e == 1 ? x[1] : e == 2 ? x[2] : x[3];
      const float app = d[jacobi_ring_prev(k, M)], aqq = d[jacobi_ring_prev(M + k, M)];
      if (LAST) {
        d_next[k] = app;
        d_next[M + k] = aqq;
      } else {
        const JacobiRotation r = jacobi_rotation(app, aqq, apq, skip_tol);
        rot_next[k] = make_float2(r.c, r.s);
        d_next[k] = app - r.t * apq;
        d_next[M + k] = aqq + r.t * apq;
        if (!r.skipped) {
          if (e == 0) x[0] = 0.f;
          if (e == 1) x[1] = 0.f;
          if (e == 2) x[2] = 0.f;
          if (e == 3) x[3] = 0.f;
        }
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) Aw[tk.w[e]] = x[e];
  }
  // The pairs' own a_pq (0, or kept when skipped) move too.
  if (tid < M) {
    const float v = Ar[tid * S + M + tid];
    Aw[wdiag] = v;
    if (LAST) off2 += 2.0 * (double)v * v;
  }

  if (tid < VT) {
    const int g = tid / N;
    const float4* r4 = reinterpret_cast<const float4*>(rot + 8 * g);
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      const float4 cs = r4[h];
      const float c[2] = {cs.x, cs.z}, sn[2] = {cs.y, cs.w};
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int u = 2 * h + b;
        const float tp = top[u], bt = bot[u];
        top[u] = c[b] * tp - sn[b] * bt;
        bot[u] = sn[b] * tp + c[b] * bt;
      }
    }
    // Ring step: tops move one pair right, bottoms one pair left; pair 0's top stays, the last
    // top turns into the last bottom and the first bottom into pair 1's top.
    float* xo = sm + C::OFF_X + P * 2 * VT;
    xo[tid] = top[7];
    xo[VT + tid] = bot[0];
    const float last_top = top[7], first_bot = bot[0];
#pragma unroll
    for (int u = 7; u >= 2; --u) top[u] = top[u - 1];
    top[1] = g == 0 ? first_bot : top[0];
#pragma unroll
    for (int u = 0; u < 7; ++u) bot[u] = bot[u + 1];
    if (g == G - 1) bot[7] = last_top;
    // top[0] (g > 0) and bot[7] (g < G - 1) arrive after the barrier: receive_columns.
  }
}

template <int N>
__device__ __forceinline__ void receive_columns(const float* sm, int P, float (&top)[8],
                                                float (&bot)[8]) {
  using C = EigCfg<N>;
  const int tid = threadIdx.x;
  if (tid >= C::VT) return;
  const int g = tid / N;
  const float* xo = sm + C::OFF_X + P * 2 * C::VT;
  if (g > 0) top[0] = xo[tid - N];
  if (g < C::G - 1) bot[7] = xo[C::VT + tid + N];
}

template <int N>
__global__ void __launch_bounds__(EigCfg<N>::T, 1)
    sym_eig_kernel(const float* __restrict__ a_all, float* __restrict__ w_all,
                   float* __restrict__ v_all, int dim) {
  using C = EigCfg<N>;
  constexpr int M = C::M, S = C::S, S2 = C::S2, VT = C::VT, Q = N / 4;
  extern __shared__ __align__(16) float sm[];
  double* red = reinterpret_cast<double*>(sm + C::OFF_RED);
  const int tid = threadIdx.x;
  const int64_t mat = blockIdx.x;
  const float* a = a_all + mat * dim * dim;

  // A (lower triangle, zero-padded to N) -> buffer 0 and d; norms in double.
  double norm2 = 0, off2 = 0;
  for (int idx = tid; idx < N * N; idx += C::T) {
    const int y = idx / N, x = idx % N;
    if (x > y) continue;
    const float v = y < dim ? a[y * dim + x] : 0.f;
    if (x == y) {
      sm[C::OFF_D + x] = v;
      norm2 += (double)v * v;
    } else {
      sm[x * S + y] = v;
      norm2 += 2.0 * v * v;
      off2 += 2.0 * v * v;
    }
  }
  Task task[C::NT];
#pragma unroll
  for (int s = 0; s < C::NT; ++s) task[s] = make_task<N>(tid + s * C::T);
  const int wdiag =
      tid < M ? upper<N>(jacobi_ring_next(tid, M), jacobi_ring_next(M + tid, M)) : 0;
  const int g = tid / N, row = tid % N;
  float top[8], bot[8];
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    top[u] = row == 8 * g + u ? 1.f : 0.f;
    bot[u] = row == M + 8 * g + u ? 1.f : 0.f;
  }
  norm2 = block_sum<N>(norm2, red);
  __syncthreads();
  off2 = block_sum<N>(off2, red);
  const double thr2 = kSymEigTol * kSymEigTol * norm2;
  const float skip_tol = static_cast<float>(kSymEigTol * sqrt(norm2) / N);

  int P = 0;
#pragma unroll 1
  for (int sweep = 0; sweep < kSymEigMaxSweeps && off2 > thr2; ++sweep) {
    if (tid < M) rotate_pair<N>(sm, P, tid, skip_tol);
    __syncthreads();
    double acc = 0;
#pragma unroll 1
    for (int t = 0; t < N - 2; ++t) {
      if (P == 0) {
        jacobi_round<N, 0, false>(sm, task, wdiag, top, bot, skip_tol, acc);
      } else {
        jacobi_round<N, 1, false>(sm, task, wdiag, top, bot, skip_tol, acc);
      }
      __syncthreads();
      receive_columns<N>(sm, P, top, bot);
      P ^= 1;
    }
    if (P == 0) {
      jacobi_round<N, 0, true>(sm, task, wdiag, top, bot, skip_tol, acc);
    } else {
      jacobi_round<N, 1, true>(sm, task, wdiag, top, bot, skip_tol, acc);
    }
    __syncthreads();
    receive_columns<N>(sm, P, top, bot);
    P ^= 1;
    off2 = block_sum<N>(acc, red);
  }
  // Every thread is past the last reads of the A buffers (the last barrier), which now hold U.
  const float* d = sm + C::OFF_D + P * N;
  float* ut = sm;            // ut[x][r] = U[r][x], stride S2, zero outside [0, dim)^2
  float* mm = sm + C::ABUF;  // U^T U - I
  if (tid < VT) {
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int xt = 8 * g + u, xb = M + 8 * g + u;
      ut[xt * S2 + row] = xt < dim && row < dim ? top[u] : 0.f;
      ut[xb * S2 + row] = xb < dim && row < dim ? bot[u] : 0.f;
    }
  }
  __syncthreads();
  // Newton-Schulz: mm = U^T U - I; thread tile rows a0 + i Q, columns b0 + j Q (strided rows keep
  // the float4 loads of different rows on different banks).
  if (tid < VT) {
    const int a0 = tid / Q, b0 = tid % Q;
    float acc[4][4] = {};
#pragma unroll 1
    for (int r = 0; r < N; r += 4) {
      float4 yb[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) yb[j] = *reinterpret_cast<const float4*>(ut + (b0 + j * Q) * S2 + r);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 xa = *reinterpret_cast<const float4*>(ut + (a0 + i * Q) * S2 + r);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc[i][j] += xa.x * yb[j].x;
          acc[i][j] += xa.y * yb[j].y;
          acc[i][j] += xa.z * yb[j].z;
          acc[i][j] += xa.w * yb[j].w;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int x = a0 + i * Q, y = b0 + j * Q;
        mm[x * S2 + y] = acc[i][j] - (x == y ? 1.f : 0.f);
      }
    }
  }
  __syncthreads();
  // U^T <- U^T - mm U^T / 2 (mm is symmetric); thread tile rows 4 a0.., columns 4 b0...
  float4 wt[4];
  if (tid < VT) {
    const int a0 = tid / Q, b0 = tid % Q;
    float acc[4][4] = {};
#pragma unroll 4
    for (int k = 0; k < N; ++k) {
      const float4 mk = *reinterpret_cast<const float4*>(mm + k * S2 + 4 * a0);
      const float4 uk = *reinterpret_cast<const float4*>(ut + k * S2 + 4 * b0);
      const float mv[4] = {mk.x, mk.y, mk.z, mk.w}, uv[4] = {uk.x, uk.y, uk.z, uk.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += mv[i] * uv[j];
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 u = *reinterpret_cast<const float4*>(ut + (4 * a0 + i) * S2 + 4 * b0);
      wt[i] = make_float4(u.x - 0.5f * acc[i][0], u.y - 0.5f * acc[i][1], u.z - 0.5f * acc[i][2],
                          u.w - 0.5f * acc[i][3]);
    }
  }
  __syncthreads();
  if (tid < VT) {
    const int a0 = tid / Q, b0 = tid % Q;
#pragma unroll
    for (int i = 0; i < 4; ++i) *reinterpret_cast<float4*>(ut + (4 * a0 + i) * S2 + 4 * b0) = wt[i];
  }
  __syncthreads();

  // Order (descending, jacobi_precedes) and sign (largest entry positive) of each eigenvector.
  int* inv = reinterpret_cast<int*>(sm + C::OFF_X);  // inv[rank] = index
  float* sgn = sm + C::OFF_X + N;
  if (tid < dim) {
    const float lam = d[tid];
    int rank = 0;
    for (int y = 0; y < dim; ++y) rank += jacobi_precedes(d[y], y, lam, tid);
    inv[rank] = tid;
    // Scanning from row tid spreads the threads over the banks; the winner does not depend on
    // the order.
    const float* u = ut + tid * S2;
    int big = 0;
    float bv = u[0];
    for (int s = 0; s < dim; ++s) {
      const int r = s + tid < dim ? s + tid : s + tid - dim;
      const float v = u[r];
      if (jacobi_larger_entry(v, r, bv, big)) {
        big = r;
        bv = v;
      }
    }
    sgn[tid] = bv < 0.f ? -1.f : 1.f;
  }
  __syncthreads();
  float* w = w_all + mat * dim;
  float* v = v_all + mat * dim * dim;
  if (tid < dim) w[tid] = d[inv[tid]];
  for (int o = tid; o < dim * dim; o += C::T) {
    const int r = o / dim, x = inv[o % dim];
    v[o] = sgn[x] * ut[x * S2 + r];
  }
}

template <int N>
void launch(const at::Tensor& a, at::Tensor& w, at::Tensor& v) {
  using C = EigCfg<N>;
  auto kernel = sym_eig_kernel<N>;
  if (C::SMEM_BYTES > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        C::SMEM_BYTES));
  }
  kernel<<<static_cast<unsigned>(a.size(0)), C::T, C::SMEM_BYTES,
           at::cuda::getCurrentCUDAStream()>>>(a.data_ptr<float>(), w.data_ptr<float>(),
                                               v.data_ptr<float>(), static_cast<int>(a.size(1)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// D > 128: float64 eigh (cuSOLVER), then the kernel's order and sign convention.
std::tuple<at::Tensor, at::Tensor> sym_eig_eigh(const at::Tensor& a) {
  auto [w64, v64] = at::linalg_eigh(a.to(at::kDouble));
  at::Tensor w = w64.flip(-1).to(at::kFloat).contiguous();
  at::Tensor v = v64.flip(-1).to(at::kFloat);
  const at::Tensor big = v.gather(-2, v.abs().argmax(-2, /*keepdim=*/true));  // first on ties
  v = at::where(big < 0, -v, v).contiguous();
  return {w, v};
}

std::tuple<at::Tensor, at::Tensor> sym_eig_cuda(const at::Tensor& a) {
  check_sym_eig_input(a);
  const c10::cuda::CUDAGuard guard(a.device());
  const int dim = static_cast<int>(a.size(1));
  if (dim > kMaxSmemDim && a.size(0) > 0) return sym_eig_eigh(a);
  auto [w, v] = sym_eig_outputs(a);
  if (a.size(0) == 0) return {w, v};
  switch (jacobi_padded_dim(dim)) {
    case 16: launch<16>(a, w, v); break;
    case 32: launch<32>(a, w, v); break;
    case 48: launch<48>(a, w, v); break;
    case 64: launch<64>(a, w, v); break;
    case 80: launch<80>(a, w, v); break;
    case 96: launch<96>(a, w, v); break;
    case 112: launch<112>(a, w, v); break;
    default: launch<128>(a, w, v); break;
  }
  return {w, v};
}

}  // namespace

TORCH_LIBRARY_IMPL(adaattn, CUDA, m) { m.impl("sym_eig", &sym_eig_cuda); }

}  // namespace adaattn
