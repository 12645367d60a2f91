// Tensor-core chunked linear attention (spec 3.5), fp16/bf16 inputs, fp32 states. Every sequence
// is cut into chunks of kChunk = 64 rows (chunks never cross a sequence boundary); with the
// augmented state S = [S_v | z] (core/linear.h) of chunk c's predecessors, S_{c-1}:
//   u_i = phi(q_i) S_{c-1} + sum_{j <= i in chunk} (phi(q_i) . phi(k_j)) [v_j | 1]
// Forward:  (1) chunk_state_kernel: per chunk, L_c = phi(K_c)^T [V_c | 1] (fp32);
//           (2) scan_kernel: exclusive prefix over a sequence's chunks in fp32, starting from the
//               initial state; its total is state_out (and the non-causal state);
//           (3) fwd_out_kernel: per chunk, u = phi(Q_c) S_{c-1} + mask(phi(Q_c) phi(K_c)^T) V_c,
//               out = u_v / u_z.
// Backward (formulas in cpu/linear_cpu.cpp; du_i = [r_i g_i | du_z_i], r = 1 / u_z):
//           (1)+(2) as forward (S_{c-1} and the total);
//           (3) bwd_dq_kernel: recomputes u, writes r and du_z per row and
//               dphi(Q) = dU_v S_v^T + du_z z^T + mask(dU_v V^T + du_z 1^T) phi(K);
//           (4) chunk_state_kernel (backward mode): per chunk, phi(Q_c)^T dU_c;
//           (5) scan_kernel in reverse from dstate: dR after each chunk, total = dstate_in;
//           (6) bwd_dkdv_kernel: dV = phi(K) dR_v + mask(P)^T dU_v,
//               dphi(K) = V dR_v^T + 1 dR_z^T + mask(dU V^T + du_z)^T phi(Q).
// The z column never enters an MMA: its products are fp32 vector work (row sums of the rounded
// intra-chunk weights, dot products with z). phi is applied in fp32 on the shared-memory tiles
// and rounded to the input dtype, as are the states loaded as MMA operands (S_v, dR_v); every
// MMA accumulates in fp32 and states are summed in fp32. Rows past a sequence's end are zero in
// every tile, so they add nothing to states or products.
//
// CTA per (chunk, head), 4 warps, each warp owning 16 rows of the chunk (state kernel: 16 rows
// of the state per pass of 64). Packed sequences use a virtual chunk index vc = floor(cu[n] / 64) + n + j
// for chunk j of sequence n (at most T/64 + N of them, none scheduled for padding); the
// fp32 state scratch is [chunks, H, D, E].
#pragma once

#include "../../core/linear.h"
#include "mma.h"

namespace adaattn {
namespace tc {
namespace lin {

constexpr int kChunk = 64;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kScanThreads = 256;
constexpr int kScanBatch = 8;  // loads in flight per thread in the sequential scan

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

// ---- chunk grid ----------------------------------------------------------------------------

// Virtual index of sequence n's first chunk; cps = chunks per sequence (dense only).
__device__ __forceinline__ int64_t chunk_base(const LinearParams& p, int64_t cps, int n) {
  if (p.cu_seqlens == nullptr) return n * cps;
  int64_t a = p.cu_seqlens[n];
  a = a < 0 ? 0 : (a > p.len ? p.len : a);
  return a / kChunk + n;
}

struct Chunk {
  int n;          // sequence
  int64_t start;  // the sequence's first row
  int64_t c0;     // the chunk's first row, counted from start
  int rows;       // valid rows; 0: no work (padding of the virtual grid)
};

__device__ __forceinline__ Chunk locate_chunk(const LinearParams& p, int64_t cps, int64_t vc) {
  Chunk c;
  int64_t j;
  if (p.cu_seqlens == nullptr) {
    c.n = static_cast<int>(vc / cps);
    j = vc % cps;
  } else {
    // Largest n with chunk_base(n) <= vc (any answer in range for a malformed cu_seqlens).
    int lo = 0, hi = p.num_seqs - 1;
    while (lo < hi) {
      const int mid = lo + (hi - lo + 1) / 2;
      if (chunk_base(p, cps, mid) <= vc) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    c.n = lo;
    j = vc - chunk_base(p, cps, lo);
  }
  int64_t len;
  seq_range(p, c.n, c.start, len);
  c.c0 = j * kChunk;
  const int64_t left = len - c.c0;
  c.rows = j < 0 || left <= 0 ? 0 : static_cast<int>(left < kChunk ? left : kChunk);
  return c;
}

// ---- warp-level products beyond mma.h ------------------------------------------------------

// A-fragments a[MI][KT] of rows [row0, row0 + 16*MI) x cols [0, 16*KT) of a swizzled [rows][W]
// tile (the A loads of warp_gemm_nt).
template <int MI, int KT, int W, typename T>
__device__ __forceinline__ void load_a_frags(uint32_t (&a)[MI][KT][4], const T* sA, int row0,
                                             int lane) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      const int row = row0 + mi * 16 + (lane & 15);
      ldmatrix_x4(a[mi][kt], sA + swz<W>(row, kt * 16 + (lane >> 4) * 8));
    }
}

// acc[MI][NT] += A B^T with A in registers (16*MI x 16*KT) and B = rows [b_row0, b_row0 + 8*NT)
// of a swizzled [rows][W] tile, reduced over its first 16*KT columns (the B loads of
// warp_gemm_nt). (dU S^T, dU V^T, V dR^T.)
template <int MI, int NT, int KT, int W, typename T>
__device__ __forceinline__ void warp_gemm_rs_nt(float (&acc)[MI][NT][4],
                                                const uint32_t (&a)[MI][KT][4], const T* sB,
                                                int b_row0, int lane) {
  static_assert(NT % 2 == 0, "NT must be even (x4 ldmatrix loads two n-tiles)");
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
    for (int ni = 0; ni < NT; ni += 2) {
      uint32_t b[4];
      const int row = b_row0 + ni * 8 + (lane & 7) + ((lane >> 4) << 3);
      ldmatrix_x4(b, sB + swz<W>(row, kt * 16 + ((lane >> 3) & 1) * 8));
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        MmaOp<T>::run(acc[mi][ni], a[mi][kt], b[0], b[1]);
        MmaOp<T>::run(acc[mi][ni + 1], a[mi][kt], b[2], b[3]);
      }
    }
  }
}

// acc[MI][NT] += A^T B where A = columns [a_col0, a_col0 + 16*MI) of a swizzled [K][WA] tile and
// B = columns [0, 8*NT) of a swizzled [K][WB] tile, reduced over all K rows (the chunk's rows):
// the A-fragments come from transposing ldmatrix loads. (phi(K)^T V, phi(Q)^T dU.)
template <int MI, int NT, int K, int WA, int WB, typename T>
__device__ __forceinline__ void warp_gemm_tn(float (&acc)[MI][NT][4], const T* sA, int a_col0,
                                             const T* sB, int lane) {
  static_assert(NT % 2 == 0, "NT must be even (x4 ldmatrix loads two n-tiles)");
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 16) {
    uint32_t a[MI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      // Matrix j = lane / 8 is A rows +8*(j&1), k +8*(j>>1): tile rows k, columns m.
      const int row = k0 + (lane & 7) + ((lane >> 4) << 3);
      ldmatrix_x4_trans(a[mi], sA + swz<WA>(row, a_col0 + mi * 16 + ((lane >> 3) & 1) * 8));
    }
#pragma unroll
    for (int ni = 0; ni < NT; ni += 2) {
      uint32_t b[4];
      const int row = k0 + (lane & 7) + (((lane >> 3) & 1) << 3);
      ldmatrix_x4_trans(b, sB + swz<WB>(row, ni * 8 + (lane >> 4) * 8));
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        MmaOp<T>::run(acc[mi][ni], a[mi], b[0], b[1]);
        MmaOp<T>::run(acc[mi][ni + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// ---- tile passes ---------------------------------------------------------------------------

// In place over a [kChunk][W] tile: x -> phi(x) (fp32, rounded back to T); rows >= valid -> 0
// (phi(0) = 1 for elu, and padding rows must add nothing).
template <typename T, int W>
__device__ __forceinline__ void features_in_place(T* tile, FeatureMap f, int valid, int tid) {
  if (f == FeatureMap::kIdentity) return;  // cp.async already zero-filled the padding rows
  uint32_t* t2 = reinterpret_cast<uint32_t*>(tile);
  for (int i = tid; i < kChunk * W / 2; i += kThreads) {
    const int row = 2 * i / W;  // the swizzle permutes chunks within a row only
    const float2 x = unpack2<T>(t2[i]);
    t2[i] = row < valid ? MmaOp<T>::pack(feature(f, x.x), feature(f, x.y)) : 0u;
  }
}

// In place over a [kChunk][W] tile: row i *= scale[i].
template <typename T, int W>
__device__ __forceinline__ void scale_rows(T* tile, const float* scale, int tid) {
  uint32_t* t2 = reinterpret_cast<uint32_t*>(tile);
  for (int i = tid; i < kChunk * W / 2; i += kThreads) {
    const float s = scale[2 * i / W];
    const float2 x = unpack2<T>(t2[i]);
    t2[i] = MmaOp<T>::pack(x.x * s, x.y * s);
  }
}

// The [D][DV] part of an fp32 state (row stride E) as a swizzled T tile, its z column (col DV)
// into z[0:D] when normalize.
template <typename T, int D, int DV>
__device__ __forceinline__ void load_state(T* tile, float* z, const float* st, int e,
                                           bool normalize, int tid) {
  for (int i = tid; i < D * DV; i += kThreads) {
    const int row = i / DV, col = i % DV;
    tile[swz<DV>(row, col)] = from_float<T>(st[static_cast<int64_t>(row) * e + col]);
  }
  if (normalize) {
    for (int d = tid; d < D; d += kThreads) z[d] = st[static_cast<int64_t>(d) * e + DV];
  }
}

// acc *= phi'(x) element-wise for the warp's rows (x: the raw input rows, row stride `stride`);
// rows >= valid are left alone (never stored).
template <int NT, typename T>
__device__ __forceinline__ void times_feature_grad(float (&acc)[1][NT][4], FeatureMap f,
                                                   const T* x, int64_t stride, int row0,
                                                   int valid, int lane) {
  if (f == FeatureMap::kIdentity) return;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = row0 + g + 8 * hh;
    if (row >= valid) continue;
#pragma unroll
    for (int ni = 0; ni < NT; ++ni) {
      const float2 xv =
          unpack2<T>(*reinterpret_cast<const uint32_t*>(x + row * stride + ni * 8 + 2 * t));
      acc[0][ni][2 * hh] *= feature_grad(f, xv.x);
      acc[0][ni][2 * hh + 1] *= feature_grad(f, xv.y);
    }
  }
}

// Sum over the 4 lanes of a quad (the lanes holding one accumulator row).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  x += __shfl_xor_sync(0xffffffff, x, 2);
  return x;
}

// Partial phi(q_row) . z over columns t, t+4, ... for the warp's rows g and g + 8 (quad_sum it).
template <int D, typename T>
__device__ __forceinline__ void dot_z_partial(float (&acc)[2], const T* sQ, const float* z,
                                              int row0, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = row0 + g + 8 * hh;
    float s = 0.f;
#pragma unroll 8
    for (int d = 2 * t; d < D; d += 8) {
      const float2 q = unpack2<T>(*reinterpret_cast<const uint32_t*>(sQ + swz<D>(row, d)));
      s += q.x * z[d] + q.y * z[d + 1];
    }
    acc[hh] += s;
  }
}

// Intra-chunk weights phi(Q) phi(K)^T (or transposed) of the warp's 16 rows: keep (row, col)
// iff col <= row (kLower) or col >= row (upper, for the transposed products), zero elsewhere.
template <bool kLower>
__device__ __forceinline__ void causal_mask(float (&s)[1][8][4], int row0, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int ni = 0; ni < 8; ++ni)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + g + 8 * (e >> 1);
      const int col = ni * 8 + 2 * t + (e & 1);
      if (kLower ? col > row : col < row) s[0][ni][e] = 0.f;
    }
}

// ---- kernels -------------------------------------------------------------------------------

// Per chunk: local[vc, h] = A^T B' and, when normalize, its z column sum_i A[i] y_i, with
// forward: A = phi(K), B' = V, y = 1;  backward: A = phi(Q), B' = diag(r) dO, y = du_z
// (rs[vc, h, i] = (r_i, du_z_i) from bwd_dq_kernel).
template <typename T, int D, int DV, bool kBwd>
__global__ void __launch_bounds__(kThreads)
    chunk_state_kernel(const LinearParams p, int64_t cps, float* __restrict__ local,
                       const float2* __restrict__ rs) {
  __shared__ __align__(16) T sA[kChunk * D];
  __shared__ __align__(16) T sB[kChunk * DV];
  __shared__ float sw[kChunk];
  __shared__ float sy[kChunk];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t vc = blockIdx.x;
  const int h = blockIdx.y;
  const Chunk c = locate_chunk(p, cps, vc);
  if (c.rows == 0) return;
  const LinearStrides& as = kBwd ? p.q_s : p.k_s;
  const LinearStrides& bs = kBwd ? p.do_s : p.v_s;
  const T* a = static_cast<const T*>(kBwd ? p.q : p.k) + row_offset(as, p, c.n, h, c.start, c.c0);
  const T* b =
      static_cast<const T*>(kBwd ? p.dout : p.v) + row_offset(bs, p, c.n, h, c.start, c.c0);
  load_tile_async<kChunk, D, kThreads>(sA, a, as.row, c.rows, tid);
  load_tile_async<kChunk, DV, kThreads>(sB, b, bs.row, c.rows, tid);
  cp_async_commit();
  const int64_t pair = vc * p.heads + h;
  if (tid < kChunk) {
    const bool valid = tid < c.rows;
    const float2 w = kBwd && valid ? rs[pair * kChunk + tid] : make_float2(1.f, 1.f);
    sw[tid] = valid ? w.x : 0.f;
    sy[tid] = valid ? w.y : 0.f;
  }
  cp_async_wait_all();
  __syncthreads();
  features_in_place<T, D>(sA, p.feature_map, c.rows, tid);
  if (kBwd) scale_rows<T, DV>(sB, sw, tid);
  __syncthreads();

  // State rows in passes of 64 (warp w: rows pass * 64 + 16 w): one 16-row accumulator set
  // per warp keeps D = 128 free of spills.
  constexpr int NT = DV / 8;
  const int e = p.state_cols;
  float* out = local + pair * D * e;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll 1
  for (int pass = 0; pass < D / 64; ++pass) {
    const int row0 = pass * 64 + warp * 16;
    float acc[1][NT][4];
    zero(acc);
    warp_gemm_tn<1, NT, kChunk, D, DV>(acc, sA, row0, sB, lane);
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int row = row0 + g + 8 * (k >> 1);
        out[static_cast<int64_t>(row) * e + ni * 8 + 2 * t + (k & 1)] = acc[0][ni][k];
      }
  }
  if (p.normalize) {
    for (int d = tid; d < D; d += kThreads) {
      float s = 0.f;
      for (int i = 0; i < c.rows; ++i) s += to_float(sA[swz<D>(i, d)]) * sy[i];
      out[static_cast<int64_t>(d) * e + DV] = s;
    }
  }
}

template <int D, int DV, typename T>
struct OutSmem {
  // Q, K, V tiles, the [D][DV] state tile (T), z (fp32).
  static constexpr int kBytes =
      (2 * kChunk * D + kChunk * DV + D * DV) * static_cast<int>(sizeof(T)) + D * 4;
};

// Rows of the warp: u = phi(Q) S_v + mask(P) V (into o) and its normaliser u_z (den: full sums).
template <typename T, int D, int DV>
__device__ __forceinline__ void chunk_outputs(float (&o)[1][DV / 8][4], float (&den)[2],
                                              const LinearParams& p, const T* sQ, const T* sK,
                                              const T* sV, const T* sS, const float* sz,
                                              int row0, int lane) {
  zero(o);
  den[0] = den[1] = 0.f;
  {
    uint32_t qa[1][D / 16][4];
    load_a_frags<1, D / 16, D>(qa, sQ, row0, lane);
    warp_gemm_rs<1, DV / 8, D / 16, DV>(o, qa, sS, 0, lane);
  }
  if (p.normalize) dot_z_partial<D>(den, sQ, sz, row0, lane);
  if (p.causal) {
    float s[1][8][4];
    zero(s);
    warp_gemm_nt<1, 8, D>(s, sQ, row0, sK, 0, lane);
    causal_mask<true>(s, row0, lane);
    // The normaliser sums the weights exactly as rounded for the P V product.
#pragma unroll
    for (int ni = 0; ni < 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[0][ni][e] = round_to<T>(s[0][ni][e]);
        den[e >> 1] += s[0][ni][e];
      }
    uint32_t pa[1][4][4];
    to_a_frags<1, 8, T>(s, pa);
    warp_gemm_rs<1, DV / 8, 4, DV>(o, pa, sV, 0, lane);
  }
  den[0] = quad_sum(den[0]);
  den[1] = quad_sum(den[1]);
}

// Loads the chunk's tiles for the output / dq kernels: Q (and K, V when causal), the state
// preceding the chunk (causal: prefix[vc, h]; else the total) and applies phi.
template <typename T, int D, int DV>
__device__ __forceinline__ void load_out_tiles(const LinearParams& p, const Chunk& c, int h,
                                               const float* st, T* sQ, T* sK, T* sV, T* sS,
                                               float* sz, int tid) {
  load_tile_async<kChunk, D, kThreads>(
      sQ, static_cast<const T*>(p.q) + row_offset(p.q_s, p, c.n, h, c.start, c.c0), p.q_s.row,
      c.rows, tid);
  if (p.causal) {
    load_tile_async<kChunk, D, kThreads>(
        sK, static_cast<const T*>(p.k) + row_offset(p.k_s, p, c.n, h, c.start, c.c0), p.k_s.row,
        c.rows, tid);
    load_tile_async<kChunk, DV, kThreads>(
        sV, static_cast<const T*>(p.v) + row_offset(p.v_s, p, c.n, h, c.start, c.c0), p.v_s.row,
        c.rows, tid);
  }
  cp_async_commit();
  load_state<T, D, DV>(sS, sz, st, p.state_cols, p.normalize, tid);
  cp_async_wait_all();
  __syncthreads();
  features_in_place<T, D>(sQ, p.feature_map, c.rows, tid);
  if (p.causal) features_in_place<T, D>(sK, p.feature_map, c.rows, tid);
  __syncthreads();
}

// out rows of one chunk. prefix: [chunks, H, D, E] exclusive prefix states (causal);
// p.state_out: the total (non-causal).
template <typename T, int D, int DV>
__global__ void __launch_bounds__(kThreads)
    fwd_out_kernel(const LinearParams p, int64_t cps, const float* __restrict__ prefix) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kChunk * D;
  T* sV = sK + kChunk * D;
  T* sS = sV + kChunk * DV;
  float* sz = reinterpret_cast<float*>(sS + D * DV);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t vc = blockIdx.x;
  const int h = blockIdx.y;
  const Chunk c = locate_chunk(p, cps, vc);
  if (c.rows == 0) return;
  const int64_t de = static_cast<int64_t>(D) * p.state_cols;
  const float* st = p.causal ? prefix + (vc * p.heads + h) * de
                             : static_cast<const float*>(p.state_out) +
                                   (static_cast<int64_t>(c.n) * p.heads + h) * de;
  load_out_tiles<T, D, DV>(p, c, h, st, sQ, sK, sV, sS, sz, tid);

  const int row0 = warp * 16;
  float o[1][DV / 8][4];
  float den[2];
  chunk_outputs<T, D, DV>(o, den, p, sQ, sK, sV, sS, sz, row0, lane);
  float scale[1][2];
  scale[0][0] = p.normalize ? safe_reciprocal(den[0]) : 1.f;
  scale[0][1] = p.normalize ? safe_reciprocal(den[1]) : 1.f;
  __syncthreads();  // every warp is done reading sV: it stages the output rows
  T* out = static_cast<T*>(p.out) + row_offset(p.o_s, p, c.n, h, c.start, c.c0);
  store_rows<1, DV / 8, DV>(o, scale, sV, row0, out, p.o_s.row, c.rows, lane);
}

template <int D, int DV, typename T>
struct DqSmem {
  // Q, K, V, dO tiles, the [D][DV] state tile, z.
  static constexpr int kBytes =
      (2 * kChunk * D + 2 * kChunk * DV + D * DV) * static_cast<int>(sizeof(T)) + D * 4;
};

// dq rows of one chunk; also writes rs[vc, h, i] = (r_i, du_z_i) for the backward state kernel.
template <typename T, int D, int DV>
__global__ void __launch_bounds__(kThreads)
    bwd_dq_kernel(const LinearParams p, int64_t cps, const float* __restrict__ prefix,
                  const float* __restrict__ total, float2* __restrict__ rs) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kChunk * D;
  T* sV = sK + kChunk * D;
  T* sdO = sV + kChunk * DV;
  T* sS = sdO + kChunk * DV;
  float* sz = reinterpret_cast<float*>(sS + D * DV);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, t = lane & 3;
  const int64_t vc = blockIdx.x;
  const int h = blockIdx.y;
  const Chunk c = locate_chunk(p, cps, vc);
  if (c.rows == 0) return;
  const int64_t de = static_cast<int64_t>(D) * p.state_cols;
  const float* st = p.causal ? prefix + (vc * p.heads + h) * de
                             : total + (static_cast<int64_t>(c.n) * p.heads + h) * de;
  load_tile_async<kChunk, DV, kThreads>(
      sdO, static_cast<const T*>(p.dout) + row_offset(p.do_s, p, c.n, h, c.start, c.c0),
      p.do_s.row, c.rows, tid);
  load_out_tiles<T, D, DV>(p, c, h, st, sQ, sK, sV, sS, sz, tid);

  const int row0 = warp * 16;
  float r[2], duz[2];
  uint32_t ua[1][DV / 16][4];  // dU_v = r g as A-fragments
  {
    float o[1][DV / 8][4];
    float den[2];
    chunk_outputs<T, D, DV>(o, den, p, sQ, sK, sV, sS, sz, row0, lane);
    float gu[2] = {0.f, 0.f};
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) r[hh] = p.normalize ? safe_reciprocal(den[hh]) : 1.f;
#pragma unroll
    for (int kt = 0; kt < DV / 16; ++kt)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int ni = 2 * kt + half;
          const float2 gv = unpack2<T>(*reinterpret_cast<const uint32_t*>(
              sdO + swz<DV>(row0 + g + 8 * hh, ni * 8 + 2 * t)));
          gu[hh] += gv.x * o[0][ni][2 * hh] + gv.y * o[0][ni][2 * hh + 1];
          ua[0][kt][hh + 2 * half] = MmaOp<T>::pack(gv.x * r[hh], gv.y * r[hh]);
        }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      // du_z = -(g . u_v) / u_z^2
      duz[hh] = p.normalize ? -quad_sum(gu[hh]) * r[hh] * r[hh] : 0.f;
      const int row = row0 + g + 8 * hh;
      if (t == 0 && row < c.rows) rs[(vc * p.heads + h) * kChunk + row] = make_float2(r[hh], duz[hh]);
    }
  }

  float dq[1][D / 8][4];
  zero(dq);
  warp_gemm_rs_nt<1, D / 8, DV / 16, DV>(dq, ua, sS, 0, lane);
  if (p.normalize) {
#pragma unroll
    for (int ni = 0; ni < D / 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) dq[0][ni][e] += duz[e >> 1] * sz[ni * 8 + 2 * t + (e & 1)];
  }
  if (p.causal) {
    float m[1][8][4];
    zero(m);
    warp_gemm_rs_nt<1, 8, DV / 16, DV>(m, ua, sV, 0, lane);
#pragma unroll
    for (int ni = 0; ni < 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) m[0][ni][e] += duz[e >> 1];
    causal_mask<true>(m, row0, lane);
    uint32_t ma[1][4][4];
    to_a_frags<1, 8, T>(m, ma);
    warp_gemm_rs<1, D / 8, 4, D>(dq, ma, sK, 0, lane);
  }
  const T* q = static_cast<const T*>(p.q) + row_offset(p.q_s, p, c.n, h, c.start, c.c0);
  times_feature_grad<D / 8>(dq, p.feature_map, q, p.q_s.row, row0, c.rows, lane);
  // Only this warp reads its own rows of sQ, so they can stage its dq rows.
  const float one[1][2] = {{1.f, 1.f}};
  T* dqo = static_cast<T*>(p.dq) + row_offset(p.dq_s, p, c.n, h, c.start, c.c0);
  store_rows<1, D / 8, D>(dq, one, sQ, row0, dqo, p.dq_s.row, c.rows, lane);
}

template <int D, int DV, typename T>
struct DkdvSmem {
  // Q, K, V, dO tiles, the [D][DV] dR tile, dR's z column, r and du_z per row.
  static constexpr int kBytes =
      (2 * kChunk * D + 2 * kChunk * DV + D * DV) * static_cast<int>(sizeof(T)) +
      (D + 2 * kChunk) * 4;
};

// dk, dv rows of one chunk. suffix: [chunks, H, D, E] dR after each chunk (causal);
// p.dstate_in: the total dR (non-causal).
template <typename T, int D, int DV>
__global__ void __launch_bounds__(kThreads)
    bwd_dkdv_kernel(const LinearParams p, int64_t cps, const float* __restrict__ suffix,
                    const float2* __restrict__ rs) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kChunk * D;
  T* sV = sK + kChunk * D;
  T* sdO = sV + kChunk * DV;
  T* sR = sdO + kChunk * DV;
  float* srz = reinterpret_cast<float*>(sR + D * DV);
  float* sr = srz + D;
  float* sduz = sr + kChunk;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int t = lane & 3;
  const int64_t vc = blockIdx.x;
  const int h = blockIdx.y;
  const Chunk c = locate_chunk(p, cps, vc);
  if (c.rows == 0) return;
  const int64_t de = static_cast<int64_t>(D) * p.state_cols;
  const float* dr = p.causal ? suffix + (vc * p.heads + h) * de
                             : static_cast<const float*>(p.dstate_in) +
                                   (static_cast<int64_t>(c.n) * p.heads + h) * de;
  const T* k = static_cast<const T*>(p.k) + row_offset(p.k_s, p, c.n, h, c.start, c.c0);
  load_tile_async<kChunk, D, kThreads>(sK, k, p.k_s.row, c.rows, tid);
  load_tile_async<kChunk, DV, kThreads>(
      sV, static_cast<const T*>(p.v) + row_offset(p.v_s, p, c.n, h, c.start, c.c0), p.v_s.row,
      c.rows, tid);
  if (p.causal) {
    load_tile_async<kChunk, D, kThreads>(
        sQ, static_cast<const T*>(p.q) + row_offset(p.q_s, p, c.n, h, c.start, c.c0), p.q_s.row,
        c.rows, tid);
    load_tile_async<kChunk, DV, kThreads>(
        sdO, static_cast<const T*>(p.dout) + row_offset(p.do_s, p, c.n, h, c.start, c.c0),
        p.do_s.row, c.rows, tid);
    if (tid < kChunk) {
      const float2 w =
          tid < c.rows ? rs[(vc * p.heads + h) * kChunk + tid] : make_float2(0.f, 0.f);
      sr[tid] = w.x;
      sduz[tid] = w.y;
    }
  }
  cp_async_commit();
  load_state<T, D, DV>(sR, srz, dr, p.state_cols, p.normalize, tid);
  cp_async_wait_all();
  __syncthreads();
  features_in_place<T, D>(sK, p.feature_map, c.rows, tid);
  if (p.causal) features_in_place<T, D>(sQ, p.feature_map, c.rows, tid);
  __syncthreads();

  const int row0 = warp * 16;  // this warp's key rows s
  const float one[1][2] = {{1.f, 1.f}};
  {
    // dV = phi(K) dR_v + (mask(P)^T diag(r)) dO, P^T[s][t] = phi(k_s) . phi(q_t), kept for t >= s.
    float dv[1][DV / 8][4];
    zero(dv);
    uint32_t ka[1][D / 16][4];
    load_a_frags<1, D / 16, D>(ka, sK, row0, lane);
    warp_gemm_rs<1, DV / 8, D / 16, DV>(dv, ka, sR, 0, lane);
    if (p.causal) {
      float pt[1][8][4];
      zero(pt);
      warp_gemm_nt<1, 8, D>(pt, sK, row0, sQ, 0, lane);
      causal_mask<false>(pt, row0, lane);
#pragma unroll
      for (int ni = 0; ni < 8; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) pt[0][ni][e] *= sr[ni * 8 + 2 * t + (e & 1)];
      uint32_t pa[1][4][4];
      to_a_frags<1, 8, T>(pt, pa);
      warp_gemm_rs<1, DV / 8, 4, DV>(dv, pa, sdO, 0, lane);
    }
    // sV rows of this warp are read by this warp only (A-fragments): they stage dv.
    T* dvo = static_cast<T*>(p.dv) + row_offset(p.dv_s, p, c.n, h, c.start, c.c0);
    float dk[1][D / 8][4];
    zero(dk);
    // dphi(K) = V dR_v^T + 1 dR_z^T + mask(dO V^T diag(r) + du_z)^T phi(Q).
    uint32_t va[1][DV / 16][4];
    load_a_frags<1, DV / 16, DV>(va, sV, row0, lane);
    store_rows<1, DV / 8, DV>(dv, one, sV, row0, dvo, p.dv_s.row, c.rows, lane);
    warp_gemm_rs_nt<1, D / 8, DV / 16, DV>(dk, va, sR, 0, lane);
    if (p.normalize) {
#pragma unroll
      for (int ni = 0; ni < D / 8; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[0][ni][e] += srz[ni * 8 + 2 * t + (e & 1)];
    }
    if (p.causal) {
      float mt[1][8][4];
      zero(mt);
      warp_gemm_rs_nt<1, 8, DV / 16, DV>(mt, va, sdO, 0, lane);
#pragma unroll
      for (int ni = 0; ni < 8; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = ni * 8 + 2 * t + (e & 1);
          mt[0][ni][e] = mt[0][ni][e] * sr[col] + sduz[col];
        }
      causal_mask<false>(mt, row0, lane);
      uint32_t ma[1][4][4];
      to_a_frags<1, 8, T>(mt, ma);
      warp_gemm_rs<1, D / 8, 4, D>(dk, ma, sQ, 0, lane);
    }
    times_feature_grad<D / 8>(dk, p.feature_map, k, p.k_s.row, row0, c.rows, lane);
    // Likewise sK's rows of this warp stage dk.
    T* dko = static_cast<T*>(p.dk) + row_offset(p.dk_s, p, c.n, h, c.start, c.c0);
    store_rows<1, D / 8, D>(dk, one, sK, row0, dko, p.dk_s.row, c.rows, lane);
  }
}

}  // namespace lin
}  // namespace tc
}  // namespace adaattn
