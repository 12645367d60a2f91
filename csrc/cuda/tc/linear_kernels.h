// Tensor-core chunked linear attention, fp16/bf16 inputs, fp32 states. Every sequence
// is cut into chunks of kChunk = 64 rows (chunks never cross a sequence boundary); with the
// augmented state S = [S_v | z] (core/linear.h) of chunk c's predecessors, S_{c-1}:
//   u_i = phi(q_i) S_{c-1} + sum_{j <= i in chunk} (phi(q_i) . phi(k_j)) [v_j | 1]
// Forward:  (1) state_scan_kernel: walks each sequence's chunks in order, adding
//               phi(K_c)^T [V_c | 1] to an fp32 running state that starts at the initial state,
//               and writes S_{c-1} before chunk c (causal) or the total (non-causal) as a
//               prefix state; the fp32 total is state_out;
//           (2) fwd_out_kernel: per chunk, u = phi(Q_c) S_{c-1} + mask(phi(Q_c) phi(K_c)^T) V_c,
//               out = u_v / u_z.
// Backward (formulas in cpu/linear_cpu.cpp; du_i = [r_i g_i | du_z_i], r = 1 / u_z):
//           (1) as forward (S_{c-1}, or the total);
//           (2) bwd_dq_kernel: recomputes u, writes r and du_z per row and
//               dphi(Q) = dU_v S_v^T + du_z z^T + mask(dU_v V^T + du_z 1^T) phi(K);
//           (3) state_scan_kernel in reverse from dstate, adding phi(Q_c)^T dU_c: dR after each
//               chunk (or the total), whose fp32 total is dstate_in;
//           (4) bwd_dkdv_kernel: dV = phi(K) dR_v + mask(P)^T dU_v,
//               dphi(K) = V dR_v^T + 1 dR_z^T + mask(dU V^T + du_z)^T phi(Q).
// A prefix state is S_v rounded to the input dtype ([D][Dv], the MMA operand its consumers
// would round it to anyway) plus the fp32 z column, in a [slots, H, D, Dv] / [slots, H, D]
// pair (slot = virtual chunk when causal, sequence when not): half the bytes of an fp32 state
// and written once, where a separate per-chunk pass and scan moved four fp32 copies.
// The z column never enters an MMA: its products are fp32 vector work (row sums of the rounded
// intra-chunk weights, dot products with z). phi is applied in fp32 on the shared-memory tiles
// and rounded to the input dtype, as are the states loaded as MMA operands (S_v, dR_v); every
// MMA accumulates in fp32 and states are summed in fp32. Rows past a sequence's end are zero in
// every tile, so they add nothing to states or products.
//
// Chunk kernels: CTA per (chunk, head), 4 warps, each warp owning 16 rows of the chunk. The
// scan: CTA per (sequence, head, tile of the state), see state_scan_kernel. Packed sequences
// use a virtual chunk index vc = floor(cu[n] / 64) + n + j for chunk j of sequence n (at most
// T/64 + N of them, none scheduled for padding); the prefix states are [chunks, H, ...].
#pragma once

#include "../../core/linear.h"
#include "mma.h"

namespace adaattn {
namespace tc {
namespace lin {

constexpr int kChunk = 64;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kScanRows = 32;  // state rows of one scan CTA
constexpr int kScanGroups = 2; // groups in the scan's cp.async ring (one lands while one is used)

// Chunks per step of the scan's walk: 4, but 2 at Dv = 128 so that the ring (84 KiB) lets two
// CTAs share an SM, which a split walk (ScanSplit) needs to run all its segments at once.
template <int DV>
constexpr int scan_group() {
  return DV == 128 ? 2 : 4;
}

// State columns of one scan CTA. Measured on the H100 (bf16, 64k tokens, H = 16): at Dv = 64,
// 32-column CTAs (twice as many) made forward+backward 10% faster than CTAs over all 64
// columns. At Dv = 128 only an earlier 32-column variant was measured: same forward walk, 20%
// faster backward walk; the all-column tile here is the one measured in this form.
template <int DV>
constexpr int scan_cols() {
  return DV == 64 ? 32 : DV;
}

// Threads of a scan CTA: one warp per 16 rows x 32 columns of its tile.
template <int DV>
constexpr int scan_threads() {
  return kScanRows / 16 * (scan_cols<DV>() / 32) * 32;
}

// CTAs of the scan per SM that registers must allow (the ring's shared memory allows 2 at
// Dv = 128, 3 at Dv = 64).
template <int DV>
constexpr int scan_ctas_per_sm() {
  return DV == 128 ? 2 : 3;
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

// ---- tile passes ---------------------------------------------------------------------------

// The four packed pairs of a 16-byte chunk, each mapped by fn(float2) -> packed pair.
template <typename T, typename Fn>
__device__ __forceinline__ uint4 map_pairs(uint4 x, Fn fn) {
  return make_uint4(fn(unpack2<T>(x.x)), fn(unpack2<T>(x.y)), fn(unpack2<T>(x.z)),
                    fn(unpack2<T>(x.w)));
}

// In place over a [kChunk][W] tile: x -> phi(x) (fp32, rounded back to T); rows >= valid -> 0
// (phi(0) = 1 for elu, and padding rows must add nothing).
template <typename T, int W, int THREADS = kThreads>
__device__ __forceinline__ void features_in_place(T* tile, FeatureMap f, int valid, int tid) {
  if (f == FeatureMap::kIdentity) return;  // cp.async already zero-filled the padding rows
  constexpr int kVecs = kChunk * W / 8;  // 16-byte chunks; the swizzle keeps each in its row
  static_assert(kVecs % THREADS == 0, "tile chunks must divide evenly among threads");
  uint4* t8 = reinterpret_cast<uint4*>(tile);
  // Two at a time: the chains of load, exp, store overlap (a full unroll spills in bwd_dq_kernel).
#pragma unroll 2
  for (int k = 0; k < kVecs / THREADS; ++k) {
    const int i = tid + k * THREADS;
    const bool live = 8 * i / W < valid;
    t8[i] = map_pairs<T>(t8[i], [&](float2 v) {
      return live ? MmaOp<T>::pack(feature(f, v.x), feature(f, v.y)) : 0u;
    });
  }
}

// A prefix state (slot base pointers sv [D][DV], sz [D]) into a swizzled [D][DV] tile and z
// (normalize only); the tile joins the caller's cp.async group.
template <typename T, int D, int DV>
__device__ __forceinline__ void load_state(T* tile, float* z, const T* sv, const float* sz,
                                           bool normalize, int tid) {
  load_tile_async<D, DV, kThreads>(tile, sv, DV, D, tid);
  if (normalize) {
    for (int d = tid; d < D; d += kThreads) z[d] = sz[d];
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

// load_tile_async for a loop that copies many [ROWS][W] tiles of one row stride: the per-thread
// offsets are computed once, so a copy costs a compare, an add and the cp.async per 16 bytes
// (in the scan the address arithmetic otherwise took half the issue slots of a chunk).
template <int ROWS, int W, int THREADS>
struct TileCopy {
  static constexpr int kPer = ROWS * W / 8 / THREADS;
  static_assert(kPer * THREADS * 8 == ROWS * W, "tile chunks must divide evenly among threads");
  int row[kPer];
  int dst[kPer];
  int64_t src[kPer];
  __device__ __forceinline__ TileCopy(int64_t row_stride, int tid) {
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int c = tid + k * THREADS;
      row[k] = c / (W / 8);
      const int col = c % (W / 8) * 8;
      dst[k] = swz<W>(row[k], col);
      src[k] = row[k] * row_stride + col;
    }
  }
  // Rows >= valid_rows are zero-filled.
  template <typename T>
  __device__ __forceinline__ void issue(T* tile, const T* base, int valid_rows) const {
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const bool valid = row[k] < valid_rows;
      cp_async16(tile + dst[k], base + (valid ? src[k] : 0), valid);
    }
  }
};

template <int DV, typename T>
struct ScanSmem {
  // Per chunk slot of the ring: the chunk's [kChunk][kScanRows] slice of A, its
  // [kChunk][scan_cols] slice of B' and (r, du_z) per row (backward).
  static constexpr int kABytes = kChunk * kScanRows * static_cast<int>(sizeof(T));
  static constexpr int kBBytes = kChunk * scan_cols<DV>() * static_cast<int>(sizeof(T));
  static constexpr int kSlotBytes = kABytes + kBBytes + kChunk * 8;
  static constexpr int kSlots = scan_group<DV>() * kScanGroups;
  static constexpr int kBytes = kSlots * kSlotBytes;
};

// zc += A^T [y_hi | y_lo | 0 ...] for the 16 columns [a_col0, a_col0 + 16) of a [kChunk][32]
// tile A: the z column of a chunk's state by tensor core (lanes with t = 0 get
// z(row g) = zc[0] + zc[1] and z(row g + 8) = zc[2] + zc[3]). Forward: y = 1 (rows past the
// chunk are zero in A). Backward: y = du_z (sw[i].y) split as y_hi + y_lo, both in T, so the
// sum keeps about 16 bits of y where B' keeps T's.
template <typename T, bool kBwd>
__device__ __forceinline__ void chunk_column_sums(float (&zc)[4], const T* sA, int a_col0,
                                                  const float2* sw, int lane) {
  const int g = lane >> 2, t = lane & 3;
  auto y_pair = [&](int i) {  // (y[i], y[i + 1]) as column g of B: hi (g = 0), lo (g = 1), 0
    if (g > 1) return 0u;
    if (!kBwd) return g == 0 ? MmaOp<T>::pack(1.f, 1.f) : 0u;
    const float y0 = sw[i].y, y1 = sw[i + 1].y;
    const float h0 = round_to<T>(y0), h1 = round_to<T>(y1);
    return g == 0 ? MmaOp<T>::pack(h0, h1) : MmaOp<T>::pack(y0 - h0, y1 - h1);
  };
#pragma unroll
  for (int kt = 0; kt < kChunk / 16; ++kt) {
    uint32_t a[4];
    ldmatrix_x4_trans(a, sA + swz<kScanRows>(kt * 16 + (lane & 7) + ((lane >> 4) << 3),
                                             a_col0 + ((lane >> 3) & 1) * 8));
    MmaOp<T>::run(zc, a, y_pair(kt * 16 + 2 * t), y_pair(kt * 16 + 2 * t + 8));
  }
}

// A sequence's walk cut into segments of seg_chunks steps (walk order: reverse in the backward),
// one CTA per segment (grid z), so that a short batch still fills the GPU: a first launch
// (kSegTotals) sums every segment but the last on its own into seg_totals [segs - 1, N, H, D, E]
// (fp32); the second starts segment s from init + the totals of segments 0..s-1 in that order.
struct ScanSplit {
  int64_t seg_chunks;  // walk steps per segment, a multiple of the scan group
  float* seg_totals;   // null when the walk is not split
};

// Prefix states of one sequence: the running state S = init + sum over chunks (in order;
// kBwd: in reverse) of A_c^T [B'_c | y_c] with
//   forward:  A = phi(K), B' = V, y = 1, init = state_in;
//   backward: A = phi(Q), B' = diag(r) dO, y = du_z (rs[vc, h, i] = (r_i, du_z_i) from
//             bwd_dq_kernel, zero past a chunk's rows), init = dstate.
// CTA (pair = n * H + h, tile, segment): state rows [d0, d0 + kScanRows) x columns
// [v0, v0 + scan_cols) in fp32 fragments for the whole walk (warp w: rows 16 (w % 2), columns
// 32 (w / 2) of the tile); in the tiles of column 0, warps 0 and 1 also keep z of their rows.
// Causal: before chunk c is added, the state is written to slot c (the virtual chunk);
// non-causal: the total is written to slot n. total (may be null): the fp32 total [N, H, D, E].
// kSegTotals: only the segment's own sum, to split.seg_totals.
// The walk is sequential and latency-bound: it steps scan_group chunks at a time (their
// products are independent MMA chains, then the prefixes are summed in registers), with one
// group of tiles landing through cp.async while the other is used.
template <typename T, int D, int DV, bool kBwd, bool kSegTotals>
__global__ void __launch_bounds__(scan_threads<DV>(), scan_ctas_per_sm<DV>())
    state_scan_kernel(const LinearParams p, int64_t cps, ScanSplit split, T* __restrict__ pv,
                      float* __restrict__ pz, const float* __restrict__ init,
                      float* __restrict__ total, const float2* __restrict__ rs) {
  using Smem = ScanSmem<DV, T>;
  constexpr int kThr = scan_threads<DV>();
  constexpr int kCols = scan_cols<DV>();
  constexpr int kGroup = scan_group<DV>();
  constexpr int NT = 4;  // 32 columns per warp
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto slot_a = [&](int s) { return reinterpret_cast<T*>(smem_raw + s * Smem::kSlotBytes); };
  auto slot_b = [&](int s) {
    return reinterpret_cast<T*>(smem_raw + s * Smem::kSlotBytes + Smem::kABytes);
  };
  auto slot_w = [&](int s) {
    return reinterpret_cast<float2*>(smem_raw + s * Smem::kSlotBytes + Smem::kABytes +
                                     Smem::kBBytes);
  };
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, t = lane & 3;
  const int64_t pair = blockIdx.x;
  const int n = static_cast<int>(pair / p.heads), h = static_cast<int>(pair % p.heads);
  const int d0 = static_cast<int>(blockIdx.y) / (DV / kCols) * kScanRows;
  const int v0 = static_cast<int>(blockIdx.y) % (DV / kCols) * kCols;
  const int a_col0 = (warp % 2) * 16;  // the warp's state rows within the tile
  const int b_col0 = (warp / 2) * 32;  // and columns
  const int row0 = d0 + a_col0, col0 = v0 + b_col0;
  const bool keeps_z = p.normalize && v0 == 0 && warp < 2;
  int64_t start, len;
  seq_range(p, n, start, len);
  const int64_t chunks = (len + kChunk - 1) / kChunk;
  // This CTA's segment: walk steps [j0, j1). The last segment (the only one of an unsplit
  // walk) writes the total; the others only have prefixes to write, and none when non-causal.
  const int seg = static_cast<int>(blockIdx.z);
  const int64_t seg_chunks = split.seg_totals != nullptr ? split.seg_chunks : chunks;
  const int64_t last_seg = chunks == 0 ? 0 : (chunks - 1) / seg_chunks;
  if (seg > last_seg || (kSegTotals && seg == last_seg) ||
      (!kSegTotals && !p.causal && seg != last_seg)) {
    return;
  }
  const int64_t j0 = seg * seg_chunks;
  const int64_t j1 = chunks < j0 + seg_chunks ? chunks : j0 + seg_chunks;
  const int64_t base = chunk_base(p, cps, n);
  const int e = p.state_cols;
  const int64_t pairs = static_cast<int64_t>(gridDim.x);
  const LinearStrides& as = kBwd ? p.q_s : p.k_s;
  const LinearStrides& bs = kBwd ? p.do_s : p.v_s;
  // Chunk c's rows start at a_seq + c * a_step (its A columns d0...), b_seq + c * b_step.
  const T* a_seq = static_cast<const T*>(kBwd ? p.q : p.k) + row_offset(as, p, n, h, start, 0) + d0;
  const T* b_seq =
      static_cast<const T*>(kBwd ? p.dout : p.v) + row_offset(bs, p, n, h, start, 0) + v0;
  const int64_t a_step = kChunk * as.row, b_step = kChunk * bs.row;
  const TileCopy<kChunk, kScanRows, kThr> copy_a(as.row, tid);
  const TileCopy<kChunk, kCols, kThr> copy_b(bs.row, tid);
  const float2* rs_seq = rs + (base * p.heads + h) * kChunk + 2 * tid;

  float acc[NT][4];
  float z[2] = {0.f, 0.f};  // rows row0 + g, row0 + g + 8 (lanes with t = 0)
#pragma unroll
  for (int ni = 0; ni < NT; ++ni)
#pragma unroll
    for (int k = 0; k < 4; ++k) acc[ni][k] = 0.f;
  // The fp32 [D][E] state at st, this thread's elements.
  auto element = [&](int ni, int k) {
    return static_cast<int64_t>(row0 + g + 8 * (k >> 1)) * e + col0 + ni * 8 + 2 * t + (k & 1);
  };
  auto add_state = [&](const float* st) {
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[ni][k] += st[element(ni, k)];
    if (keeps_z) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) z[hh] += st[static_cast<int64_t>(row0 + g + 8 * hh) * e + DV];
    }
  };
  auto store_state = [&](float* st) {
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int k = 0; k < 4; ++k) st[element(ni, k)] = acc[ni][k];
    if (keeps_z && t == 0) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) st[static_cast<int64_t>(row0 + g + 8 * hh) * e + DV] = z[hh];
    }
  };
  auto seg_total = [&](int s) { return split.seg_totals + (s * pairs + pair) * D * e; };
  if (!kSegTotals) {
    if (init != nullptr) add_state(init + pair * D * e);
    for (int s = 0; s < seg; ++s) add_state(seg_total(s));
  }
  // Writes the running state to a slot (rounded S_v, fp32 z).
  auto write_slot = [&](int64_t slot) {
    T* dst = pv + (slot * p.heads + h) * D * DV;
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        *reinterpret_cast<uint32_t*>(dst + (row0 + g + 8 * hh) * DV + col0 + ni * 8 + 2 * t) =
            MmaOp<T>::pack(acc[ni][2 * hh], acc[ni][2 * hh + 1]);
    if (keeps_z && t == 0) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) pz[(slot * p.heads + h) * D + row0 + g + 8 * hh] = z[hh];
    }
  };
  auto chunk_of = [&](int64_t j) { return kBwd ? chunks - 1 - j : j; };
  auto rows_of = [&](int64_t c) {
    return static_cast<int>(len - c * kChunk < kChunk ? len - c * kChunk : kChunk);
  };
  // Group q's chunks (walk steps j0 + q * kGroup + u) into ring slots
  // (q % kScanGroups) * kGroup + u.
  auto issue = [&](int64_t q) {
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {
      const int64_t j = j0 + q * kGroup + u;
      if (j < j1) {
        const int64_t c = chunk_of(j);
        const int s = static_cast<int>(q % kScanGroups) * kGroup + u;
        copy_a.issue(slot_a(s), a_seq + c * a_step, rows_of(c));
        copy_b.issue(slot_b(s), b_seq + c * b_step, rows_of(c));
        if (kBwd && tid < kChunk / 2) {
          cp_async16(slot_w(s) + 2 * tid, rs_seq + c * p.heads * kChunk, true);
        }
      }
    }
    cp_async_commit();  // empty groups keep the wait count uniform
  };
  const int64_t groups = (j1 - j0 + kGroup - 1) / kGroup;
#pragma unroll
  for (int q = 0; q < kScanGroups - 1; ++q) issue(q);
#pragma unroll 1
  for (int64_t q = 0; q < groups; ++q) {
    cp_async_wait<kScanGroups - 2>();
    __syncthreads();  // group q landed for every thread; every thread is done with group q - 1
    issue(q + kScanGroups - 1);
    const int s0 = static_cast<int>(q % kScanGroups) * kGroup;
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {
      const int64_t j = j0 + q * kGroup + u;
      if (j >= j1) break;
      features_in_place<T, kScanRows, kThr>(slot_a(s0 + u), p.feature_map, rows_of(chunk_of(j)),
                                            tid);
      if (kBwd) {
        uint4* b8 = reinterpret_cast<uint4*>(slot_b(s0 + u));
        const float2* sw = slot_w(s0 + u);
#pragma unroll
        for (int k = 0; k < kChunk * kCols / 8 / kThr; ++k) {
          const int i = tid + k * kThr;
          const float r = sw[8 * i / kCols].x;
          b8[i] = map_pairs<T>(b8[i], [&](float2 v) { return MmaOp<T>::pack(v.x * r, v.y * r); });
        }
      }
    }
    __syncthreads();
    // The group's products, independent of the running state and of each other.
    float x[kGroup][NT][4];
    float zc[kGroup][4];
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int k = 0; k < 4; ++k) x[u][ni][k] = 0.f;
#pragma unroll
      for (int k = 0; k < 4; ++k) zc[u][k] = 0.f;
      if (j0 + q * kGroup + u < j1) {
        warp_gemm_tn<NT, kChunk / 16, kScanRows, kCols>(x[u], slot_a(s0 + u), a_col0,
                                                        slot_b(s0 + u), b_col0, lane);
        if (keeps_z) {
          chunk_column_sums<T, kBwd>(zc[u], slot_a(s0 + u), a_col0, slot_w(s0 + u), lane);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {
      const int64_t j = j0 + q * kGroup + u;
      if (j >= j1) break;
      if (!kSegTotals && p.causal) write_slot(base + chunk_of(j));
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[ni][k] += x[u][ni][k];
      z[0] += zc[u][0] + zc[u][1];
      z[1] += zc[u][2] + zc[u][3];
    }
  }
  if (kSegTotals) {
    store_state(seg_total(seg));
    return;
  }
  if (seg != last_seg) return;
  if (!p.causal) write_slot(n);
  if (total != nullptr) store_state(total + pair * D * e);
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

// The prefix state of chunk vc of sequence n (causal: slot vc; else the total in slot n).
template <int D, int DV, typename T>
struct StateSlot {
  const T* v;
  const float* z;
  __device__ __forceinline__ StateSlot(const LinearParams& p, const T* pv, const float* pz,
                                       int64_t vc, int n, int h) {
    const int64_t slot = (p.causal ? vc : n) * p.heads + h;
    v = pv + slot * D * DV;
    z = pz != nullptr ? pz + slot * D : nullptr;
  }
};

// Loads the chunk's tiles for the output / dq kernels: Q (and K, V when causal), the state
// preceding the chunk and applies phi.
template <typename T, int D, int DV>
__device__ __forceinline__ void load_out_tiles(const LinearParams& p, const Chunk& c, int h,
                                               const StateSlot<D, DV, T>& st, T* sQ, T* sK,
                                               T* sV, T* sS, float* sz, int tid) {
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
  load_state<T, D, DV>(sS, sz, st.v, st.z, p.normalize, tid);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  features_in_place<T, D>(sQ, p.feature_map, c.rows, tid);
  if (p.causal) features_in_place<T, D>(sK, p.feature_map, c.rows, tid);
  __syncthreads();
}

// out rows of one chunk; pv, pz: the prefix states of state_scan_kernel.
template <typename T, int D, int DV>
__global__ void __launch_bounds__(kThreads)
    fwd_out_kernel(const LinearParams p, int64_t cps, const T* __restrict__ pv,
                   const float* __restrict__ pz) {
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
  load_out_tiles<T, D, DV>(p, c, h, StateSlot<D, DV, T>(p, pv, pz, vc, c.n, h), sQ, sK, sV, sS,
                           sz, tid);

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

// dq rows of one chunk; also writes rs[vc, h, i] = (r_i, du_z_i) for the backward scan (zero
// past the chunk's rows). pv, pz: the forward prefix states.
template <typename T, int D, int DV>
__global__ void __launch_bounds__(kThreads)
    bwd_dq_kernel(const LinearParams p, int64_t cps, const T* __restrict__ pv,
                  const float* __restrict__ pz, float2* __restrict__ rs) {
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
  load_tile_async<kChunk, DV, kThreads>(
      sdO, static_cast<const T*>(p.dout) + row_offset(p.do_s, p, c.n, h, c.start, c.c0),
      p.do_s.row, c.rows, tid);
  load_out_tiles<T, D, DV>(p, c, h, StateSlot<D, DV, T>(p, pv, pz, vc, c.n, h), sQ, sK, sV, sS,
                           sz, tid);

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
      if (t == 0) {
        rs[(vc * p.heads + h) * kChunk + row] =
            row < c.rows ? make_float2(r[hh], duz[hh]) : make_float2(0.f, 0.f);
      }
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

// dk, dv rows of one chunk. pv, pz: the backward scan's states (dR after each chunk, or the
// total dR).
template <typename T, int D, int DV>
__global__ void __launch_bounds__(kThreads)
    bwd_dkdv_kernel(const LinearParams p, int64_t cps, const T* __restrict__ pv,
                    const float* __restrict__ pz, const float2* __restrict__ rs) {
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
  const StateSlot<D, DV, T> dr(p, pv, pz, vc, c.n, h);
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
  load_state<T, D, DV>(sR, srz, dr.v, dr.z, p.normalize, tid);
  cp_async_commit();
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
