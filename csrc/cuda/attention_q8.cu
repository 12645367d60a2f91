// precision="fp8" on CUDA: the pre-pass that quantises Q, K and V as adaattn/precision.py's
// default scheme (int8-e4m3-hadamard) does, and the launch of the 8-bit Hopper forward
// (tc/fwd_q8_sm90.h). The pre-pass reads each operand once more than the forward would (K
// twice: its per-channel mean is needed before any block of it is quantised) and writes half
// the bytes, in two launches:
//   1. quantize_q_partials: per (b, kv head, chunk of keys) the per-channel sums of K and the
//      per-channel maxima of |V| (no atomics: the next kernels reduce the chunks in order),
//      and per (b, head, block of 64 Q rows) the rotation by the normalised Hadamard matrix (a
//      butterfly), one int8 scale per block (amax / 127; codes round(x * (1 / scale)), to
//      nearest even);
//   2. quantize_kv: per (b, kv head, 128 keys) two CTAs: K minus its mean, rotated and
//      quantised as Q is, and V / (amax_c / 448) to e4m3, written transposed and with the keys
//      of each 16 in the order the kernel's P operand reads them.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>

#include "../attention_api.h"
#include "tc/fwd_q8_sm90.h"
#include "tc/launch.h"

namespace adaattn {
namespace {

constexpr int kPartialRows = 256;  // keys per column-sums CTA (column_partials_block)

using tc::to_float;

// max(a, b) that carries a NaN of either (fmaxf drops NaN; a NaN must reach the scale): one
// instruction (max.NaN, sm_80+) where a compare and select would take three.
__device__ __forceinline__ float nan_max(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// The operands of column_partials_block: k [B, heads_kv, len, D] and v [..., DV] (16-bit, strides
// in elements) to k_sum [bh][chunks][D] and v_amax [bh][chunks][DV].
struct PartialArgs {
  const void* k;
  const void* v;
  int heads_kv, len, chunks;
  int64_t k_bs, k_hs, k_rs, v_bs, v_hs, v_rs;
  float* k_sum;
  float* v_amax;
};

// Shared memory of column_partials_block: each row lane's sums, [rows in flight][channels].
template <int D, int DV, int kThreads>
constexpr int partials_smem_bytes() {
  return 4 * kThreads / ((D > DV ? D : DV) / 8) * (D > DV ? D : DV);
}

// Per-channel sums of K and maxima of |V| over keys [chunk * kPartialRows, ...) of (b, kv head)
// bh, item = bh * chunks + chunk: k_sum[bh][chunk][D], v_amax[bh][chunk][Dv]. A NaN in V makes
// its channel's max NaN. The CTA's kThreads threads call it.
template <typename T, int D, int DV, int kThreads>
__device__ __forceinline__ void column_partials_block(const PartialArgs& a, int64_t item,
                                                      unsigned char* smem) {
  constexpr int kCols = D > DV ? D : DV;
  constexpr int kLanes = kCols / 8;  // threads per row, 8 channels each
  constexpr int kRowsPar = kThreads / kLanes;
  float(*const red)[kCols] = reinterpret_cast<float(*)[kCols]>(smem);  // [kRowsPar][kCols]
  const int64_t bh = item / a.chunks;
  const int chunk = static_cast<int>(item % a.chunks);
  const int64_t b = bh / a.heads_kv, h = bh % a.heads_kv;
  const int c0 = (threadIdx.x % kLanes) * 8;
  const int r0 = threadIdx.x / kLanes;
  const int row_end = min(a.len, (chunk + 1) * kPartialRows);
  for (int pass = 0; pass < 2; ++pass) {
    const int width = pass == 0 ? D : DV;
    const T* base = pass == 0 ? static_cast<const T*>(a.k) + b * a.k_bs + h * a.k_hs
                              : static_cast<const T*>(a.v) + b * a.v_bs + h * a.v_hs;
    const int64_t rs = pass == 0 ? a.k_rs : a.v_rs;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (c0 < width) {
      for (int r = chunk * kPartialRows + r0; r < row_end; r += kRowsPar) {
        const uint4 raw = *reinterpret_cast<const uint4*>(base + r * rs + c0);
        const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float f = to_float(x[e]);
          // fmaxf would drop a NaN; the max must carry it to the scale.
          acc[e] = pass == 0 ? acc[e] + f : nan_max(acc[e], fabsf(f));
        }
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) red[r0][c0 + e] = acc[e];
    }
    __syncthreads();
    for (int c = threadIdx.x; c < width; c += kThreads) {
      float x = red[0][c];
      for (int r = 1; r < kRowsPar; ++r) {
        const float y = red[r][c];
        x = pass == 0 ? x + y : nan_max(x, y);
      }
      float* dst = pass == 0 ? a.k_sum + item * D : a.v_amax + item * DV;
      dst[c] = x;
    }
    __syncthreads();
  }
}

// amax / fmt_max, or 1 where the block is all zeros (as adaattn.precision._safe_scale). A
// non-finite amax stays non-finite: the op sends heads with a non-finite scale to the 16-bit
// forward, as the emulation sends heads holding NaN/Inf to the bf16 scheme.
__device__ __forceinline__ float safe_scale(float amax, float fmt_max) {
  const float s = amax / fmt_max;
  return s > 0.f || !isfinite(s) ? s : 1.f;
}

// 8 consecutive 16-bit values (one 16-byte load) as float32.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& raw, float* v) {
  const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = to_float(x[e]);
}

// round(x) (to nearest even) in the low byte of the result's bits, for |x| < 2^22: the float
// bias trick (an add instead of a conversion).
__device__ __forceinline__ uint32_t rounded_bits(float x) {
  return static_cast<uint32_t>(__float_as_int(__fadd_rn(x, 12582912.f)));
}

// The low bytes of a, b, c, d as one word (a lowest): two byte permutes for the pairs, one to
// join them.
__device__ __forceinline__ uint32_t low_bytes(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  uint32_t ab, cd, r;
  asm("prmt.b32 %0, %1, %2, 0x0040;" : "=r"(ab) : "r"(a), "r"(b));
  asm("prmt.b32 %0, %1, %2, 0x0040;" : "=r"(cd) : "r"(c), "r"(d));
  asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(r) : "r"(ab), "r"(cd));
  return r;
}

// Threads of a quantize_rows_block CTA for blocks of kBlock rows: every row's lanes, at most 256.
template <int D, int kBlock>
constexpr int rows_threads() {
  return kBlock * (D / 32) < 256 ? kBlock * (D / 32) : 256;
}

// The operand of quantize_rows_block: x [B, heads, len, D] (16-bit, strides in elements) to
// int8 out [B, heads, len, D], one scale per block of rows at scales[bh][blk].
struct RowsArgs {
  const void* x;
  int heads, len;
  int64_t bs, hs, rs;
  const float* k_sum;  // K: the column sums [bh][chunks][D] (column_partials_block), its mean
  int chunks;
  int8_t* out;
  float* scales;
  int blocks;          // blocks per (b, head)
  float* stats;        // kStats: [bh][blk][2][D]
};

// A reduce-scatter of per-channel sums over the lanes of a warp that hold the same kN channels
// of other rows (lanes equal modulo 32 / kN): each level exchanges half of the kHalf * 2 sums a
// lane carries across one lane bit (16 first) and keeps the other half, summed; after the last
// (kHalf = 1) sq[0] and err[0] are the totals of the group's channel lane / (32 / kN). The
// halves are picked by bit masks: the compiler may turn a select between two array elements
// into an indexed load, which puts the arrays in local memory.
template <int kHalf, int kN>
__device__ __forceinline__ void scatter_halves(float (&sq)[kN], float (&err)[kN], int lane) {
  constexpr int m = 32 * kHalf / kN;
  const uint32_t upper = (lane & m) != 0 ? 0xffffffffu : 0u;  // this lane keeps the upper half
  auto pick = [upper](float hi, float lo) {
    return __uint_as_float((__float_as_uint(hi) & upper) | (__float_as_uint(lo) & ~upper));
  };
#pragma unroll
  for (int j = 0; j < kHalf; ++j) {
    const float sq_send = pick(sq[j], sq[j + kHalf]);
    const float err_send = pick(err[j], err[j + kHalf]);
    sq[j] = pick(sq[j + kHalf], sq[j]) + __shfl_xor_sync(0xffffffff, sq_send, m);
    err[j] = pick(err[j + kHalf], err[j]) + __shfl_xor_sync(0xffffffff, err_send, m);
  }
  if constexpr (kHalf > 1) scatter_halves<kHalf / 2>(sq, err, lane);
}

// Block `item` (= bh * blocks + blk) of kBlock rows (64 for Q, 128 for K) of Q or K (kSmooth:
// K, smoothed by its mean) to int8 in one pass: D / 32 lanes per row, each holding 32
// consecutive channels (kPasses rows per thread in registers), so that the butterfly of the
// Hadamard rotation runs over index bits 1..16 inside a thread and the higher bits across
// lanes, in the order of adaattn.precision.hadamard_rotate; the block's amax, then
// codes = round(x * (1 / scale)). The CTA's kRowsThreads threads call it.
//
// kStats (precision="auto"): per channel, the block's sums of x^2 and of the squared rounding
// error (code * scale - x)^2 of the rotated rows, at stats[bh][blk][0 / 1][D]: the statistics
// of adaattn.precision.estimate_precision_error (K's variance over the keys is its mean square
// once smoothed).
// Shared memory of quantize_rows_block: K's mean, the warps' maxima and (kStats) their sums.
template <int D, int kRowsThreads, bool kStats>
constexpr int rows_smem_bytes() {
  return 4 * (D + kRowsThreads / 32 + (kStats ? kRowsThreads / 32 * 2 * D : 0));
}

template <typename T, int D, int kBlock, int kRowsThreads, bool kSmooth, bool kStats>
__device__ __forceinline__ void quantize_rows_block(const RowsArgs& a, int64_t item,
                                                    unsigned char* smem) {
  static_assert(D == 64 || D == 128, "D in {64, 128}");
  constexpr int kLanesPerRow = D / 32;
  constexpr int kRowsPerPass = kRowsThreads / kLanesPerRow;
  constexpr int kPasses = kBlock / kRowsPerPass;
  static_assert(kPasses * kRowsPerPass == kBlock, "whole passes");
  constexpr int kWarps = kRowsThreads / 32;
  // Shared memory (rows_smem_bytes): K's mean, the warps' maxima, the warps' statistics.
  float* const block_mean = reinterpret_cast<float*>(smem);
  float* const warp_amax = block_mean + D;
  float(*const warp_stats)[2][D] = reinterpret_cast<float(*)[2][D]>(warp_amax + kWarps);
  const int blk = static_cast<int>(item % a.blocks);
  const int64_t bh = item / a.blocks;
  const int64_t b = bh / a.heads, h = bh % a.heads;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int part = threadIdx.x % kLanesPerRow;  // channels [32 * part, 32 * part + 32)
  const int row_in_pass = threadIdx.x / kLanesPerRow;
  const int row0 = blk * kBlock;
  const int rows_here = min(kBlock, a.len - row0);
  const T* src = static_cast<const T*>(a.x) + b * a.bs + h * a.hs +
                 static_cast<int64_t>(row0) * a.rs + part * 32;
  // The rows' loads first: K's are in flight while its mean is summed.
  uint4 raw[kPasses][4];
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int r = row_in_pass + i * kRowsPerPass;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      raw[i][c] = r < rows_here ? *reinterpret_cast<const uint4*>(src + r * a.rs + 8 * c)
                                : make_uint4(0, 0, 0, 0);
    }
  }
  // K's per-channel mean from the column sums' chunks, summed in order, in shared memory and
  // read where it is subtracted: held in registers it would keep 32 of them live beside the
  // rows.
  if constexpr (kSmooth) {
    for (int c = threadIdx.x; c < D; c += kRowsThreads) {
      const float* partial = a.k_sum + bh * a.chunks * D + c;
      float sum = 0.f;
      int k = 0;
      for (; k + 8 <= a.chunks; k += 8) {  // in order, eight loads in flight
        float part_sum[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) part_sum[u] = partial[(k + u) * D];
#pragma unroll
        for (int u = 0; u < 8; ++u) sum += part_sum[u];
      }
      for (; k < a.chunks; ++k) sum += partial[k * D];
      block_mean[c] = __fdiv_rn(sum, static_cast<float>(a.len));
    }
    __syncthreads();
  }
  // fp32(1 / sqrt(D)), as the emulation.
  const float norm = static_cast<float>(D == 64 ? 0.125 : 0.08838834764831845);
  float v[kPasses][32];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
#pragma unroll
    for (int c = 0; c < 4; ++c) unpack8<T>(raw[i][c], &v[i][8 * c]);
    if constexpr (kSmooth) {
      // Rows past the block's end take the mean: zero once smoothed.
      const bool row_here = row_in_pass + i * kRowsPerPass < rows_here;
      const float4* mean = reinterpret_cast<const float4*>(block_mean + part * 32);
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const float4 m = mean[c];
        const float mc[4] = {m.x, m.y, m.z, m.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          v[i][4 * c + e] = __fsub_rn(row_here ? v[i][4 * c + e] : mc[e], mc[e]);
        }
      }
    }
#pragma unroll
    for (int m = 1; m < 32; m <<= 1)
#pragma unroll
      for (int e = 0; e < 32; ++e)
        if ((e & m) == 0) {
          const float x0 = v[i][e], x1 = v[i][e + m];
          v[i][e] = __fadd_rn(x0, x1);
          v[i][e + m] = __fsub_rn(x0, x1);
        }
#pragma unroll
    for (int m = 1; m < kLanesPerRow; m <<= 1) {
      const float sign = (part & m) ? -1.f : 1.f;  // the upper partner keeps a - b
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        const float y = __shfl_xor_sync(0xffffffff, v[i][e], m);
        v[i][e] = __fmaf_rn(sign, v[i][e], y);
      }
    }
#pragma unroll
    for (int e = 0; e < 32; ++e) {
      v[i][e] = __fmul_rn(v[i][e], norm);
      amax = nan_max(amax, fabsf(v[i][e]));
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) amax = nan_max(amax, __shfl_xor_sync(0xffffffff, amax, m));
  if (lane == 0) warp_amax[warp] = amax;
  __syncthreads();
  amax = warp_amax[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) amax = nan_max(amax, warp_amax[w]);
  const float scale = safe_scale(amax, 127.f);
  if (threadIdx.x == 0) a.scales[item] = scale;
  const float inv = __frcp_rn(scale);
  if constexpr (kStats) {
    // Rows past the block's end hold 0 (code 0): they add nothing. In groups of kShare
    // channels (kShare lanes hold the same channels of other rows): summed over this thread's
    // rows, then reduce-scattered over those lanes (log2(kShare) exchanges of halving width
    // rather than a full tree per channel), so that 2 kShare sums are live beside the block's
    // values, not 64.
    constexpr int kShare = 32 / kLanesPerRow;
    const int rank = lane / kLanesPerRow;
#pragma unroll
    for (int group = 0; group < 32 / kShare; ++group) {
      const int g0 = group * kShare;
      float sq[kShare], err[kShare];
#pragma unroll
      for (int j = 0; j < kShare; ++j) {
        sq[j] = 0.f;
        err[j] = 0.f;
#pragma unroll
        for (int i = 0; i < kPasses; ++i) {
          const float x = v[i][g0 + j];
          const float code = __fsub_rn(__fadd_rn(__fmul_rn(x, inv), 12582912.f), 12582912.f);
          const float d = __fsub_rn(__fmul_rn(code, scale), x);
          sq[j] = __fmaf_rn(x, x, sq[j]);
          err[j] = __fmaf_rn(d, d, err[j]);
        }
      }
      scatter_halves<kShare / 2>(sq, err, lane);
      warp_stats[warp][0][part * 32 + g0 + rank] = sq[0];
      warp_stats[warp][1][part * 32 + g0 + rank] = err[0];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * D; i += kRowsThreads) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += warp_stats[w][i / D][i % D];
      a.stats[item * 2 * D + i] = sum;
    }
  }
  int8_t* dst = a.out + (bh * a.len + row0) * D + part * 32;
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int r = row_in_pass + i * kRowsPerPass;
    if (r >= rows_here) continue;
    uint32_t words[8];
    // |x * inv| <= 127 up to rounding: no clamp needed (a NaN block runs 16-bit).
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      words[w] = low_bytes(rounded_bits(__fmul_rn(v[i][4 * w], inv)),
                           rounded_bits(__fmul_rn(v[i][4 * w + 1], inv)),
                           rounded_bits(__fmul_rn(v[i][4 * w + 2], inv)),
                           rounded_bits(__fmul_rn(v[i][4 * w + 3], inv)));
    }
    uint4* o = reinterpret_cast<uint4*>(dst + r * D);
    o[0] = make_uint4(words[0], words[1], words[2], words[3]);
    o[1] = make_uint4(words[4], words[5], words[6], words[7]);
  }
}

// The key at position pos of its 16 in V^T: the inverse of tc::q8_vt_position.
__host__ __device__ constexpr int q8_vt_key(int pos) {
  return pos % 4 < 2 ? 2 * (pos / 4) + pos % 4 : 8 + 2 * (pos / 4) + pos % 4 - 2;
}
constexpr bool q8_vt_order_inverts() {
  for (int pos = 0; pos < 16; ++pos) {
    if (tc::q8_vt_position(q8_vt_key(pos)) != pos) return false;
  }
  return true;
}
static_assert(q8_vt_order_inverts(), "V^T's key order is the P operand's");

// The operand of quantize_vt_tile: v [B, heads_kv, len, DV] (16-bit, strides in elements) to
// e4m3 vt [B, heads_kv, DV, padded_len], one scale per channel at v_scale[bh][c].
struct VtArgs {
  const void* v;
  int heads_kv, len;
  int64_t bs, hs, rs;
  const float* v_amax;  // the column maxima of |V| [bh][chunks][DV] (column_partials_block)
  int chunks;
  uint8_t* vt;
  int64_t padded_len;
  float* v_scale;
  int tiles;            // 128-key tiles per (b, kv head)
  float* stats;         // kStats: [bh][tile][2][DV]
};

// Tile `item` (= bh * tiles + tile) of 128 keys of V to e4m3 V^T: vt[bh][c][tile * 128 +
// position] with position tc::q8_vt_position of the key within its 16; keys past len are zero.
// A thread writes 32 positions (two 16-key groups) of one channel with one 32-byte store. The
// CTA's kVtThreads threads call it.
// kStats: per channel the tile's sums of v^2 and of the squared rounding error
// (e4m3(v / scale) * scale - v)^2, at stats[bh][tile][0 / 1][DV].
// Shared memory of quantize_vt_tile: the 16-bit tile, the channels' inverse scales and scales,
// and (kStats) the threads' sums.
template <typename T, int DV, int kVtThreads, bool kStats>
constexpr int vt_smem_bytes() {
  return static_cast<int>(sizeof(T)) * tc::kQ8Block * DV +
         4 * (2 * DV + (kStats ? kVtThreads / DV * 2 * DV : 0));
}

template <typename T, int DV, int kVtThreads, bool kStats>
__device__ __forceinline__ void quantize_vt_tile(const VtArgs& a, int64_t item,
                                                 unsigned char* smem) {
  static_assert(DV * tc::kQ8Block / 32 % kVtThreads == 0 && kVtThreads % DV == 0,
                "whole items per thread, each thread one channel");
  // Shared memory (vt_smem_bytes): the tile, the channels' inverse scales and scales, the
  // statistics' partial sums.
  T(*const tile_v)[DV] = reinterpret_cast<T(*)[DV]>(smem);
  float* const channel_inv = reinterpret_cast<float*>(smem + sizeof(T) * tc::kQ8Block * DV);
  float* const channel_scale = channel_inv + DV;
  float(*const tile_stats)[2][DV] = reinterpret_cast<float(*)[2][DV]>(channel_scale + DV);
  const int tile = static_cast<int>(item % a.tiles);
  const int64_t bh = item / a.tiles;
  const int64_t b = bh / a.heads_kv, h = bh % a.heads_kv;
  const int key0 = tile * tc::kQ8Block;
  const int keys = min(tc::kQ8Block, a.len - key0);
  const T* src = static_cast<const T*>(a.v) + b * a.bs + h * a.hs +
                 static_cast<int64_t>(key0) * a.rs;
  // The tile's loads first, in flight while the channels' scales are reduced.
  constexpr int kLoads = tc::kQ8Block * DV / 8 / kVtThreads;
  uint4 raw[kLoads];
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    const int i = threadIdx.x + u * kVtThreads;
    const int r = i / (DV / 8), c = (i % (DV / 8)) * 8;
    raw[u] = r < keys ? *reinterpret_cast<const uint4*>(src + r * a.rs + c)
                      : make_uint4(0, 0, 0, 0);
  }
  for (int c = threadIdx.x; c < DV; c += kVtThreads) {
    const float* partial = a.v_amax + bh * a.chunks * DV + c;
    float amax = 0.f;
    int k = 0;
    for (; k + 8 <= a.chunks; k += 8) {  // eight loads in flight
      float part_max[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) part_max[u] = partial[(k + u) * DV];
#pragma unroll
      for (int u = 0; u < 8; ++u) amax = nan_max(amax, part_max[u]);
    }
    for (; k < a.chunks; ++k) amax = nan_max(amax, partial[k * DV]);
    const float scale = safe_scale(amax, 448.f);
    channel_inv[c] = __frcp_rn(scale);
    channel_scale[c] = scale;
    if (tile == 0) a.v_scale[bh * DV + c] = scale;
  }
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    const int i = threadIdx.x + u * kVtThreads;
    *reinterpret_cast<uint4*>(&tile_v[i / (DV / 8)][(i % (DV / 8)) * 8]) = raw[u];
  }
  __syncthreads();
  uint8_t* dst = a.vt + bh * DV * a.padded_len + key0;
  // Consecutive threads take consecutive channels (conflict-free reads of a key's row).
  float sq = 0.f, err = 0.f;
  constexpr int kItems = DV * tc::kQ8Block / 32 / kVtThreads;
#pragma unroll
  for (int u = 0; u < kItems; ++u) {
    const int i = threadIdx.x + u * kVtThreads;
    const int c = i % DV;
    const int pos0 = (i / DV) * 32;
    const float inv = channel_inv[c];
    uint32_t words[8];
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      // Positions pos0 + 4w .. pos0 + 4w + 3.
      const int group = pos0 + (w / 4) * 16;
      float x[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int kj = group + q8_vt_key(4 * (w % 4) + j);
        x[j] = kj < keys ? __fmul_rn(to_float(tile_v[kj][c]), inv) : 0.f;
      }
      const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(x[0], x[1]), __NV_SATFINITE,
                                                   __NV_E4M3);
      const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(x[2], x[3]), __NV_SATFINITE,
                                                   __NV_E4M3);
      words[w] = lo | hi << 16;
      if constexpr (kStats) {
        const float scale = channel_scale[c];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const __half_raw code = __nv_cvt_fp8_to_halfraw(
              static_cast<__nv_fp8_storage_t>(words[w] >> (8 * j)), __NV_E4M3);
          // v (0 past len, as the zero-filled tile holds).
          const float value = to_float(tile_v[group + q8_vt_key(4 * (w % 4) + j)][c]);
          const float d = __half2float(__half(code)) * scale - value;
          sq = fmaf(value, value, sq);
          err = fmaf(d, d, err);
        }
      }
    }
    uint4* out = reinterpret_cast<uint4*>(dst + static_cast<int64_t>(c) * a.padded_len + pos0);
    out[0] = make_uint4(words[0], words[1], words[2], words[3]);
    out[1] = make_uint4(words[4], words[5], words[6], words[7]);
  }
  if constexpr (kStats) {
    tile_stats[threadIdx.x / DV][0][threadIdx.x % DV] = sq;
    tile_stats[threadIdx.x / DV][1][threadIdx.x % DV] = err;
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * DV; i += kVtThreads) {
      float sum = 0.f;
#pragma unroll
      for (int g = 0; g < kVtThreads / DV; ++g) sum += tile_stats[g][i / DV][i % DV];
      a.stats[item * 2 * DV + i] = sum;
    }
  }
}

// Q's blocks of 64 rows and the column sums of K and V (per chunk of keys) in one launch, the
// column sums' CTAs spread evenly among Q's: Q's rotation is issue-bound, the column sums'
// reads memory-bound, and the SMs run both at once.
template <typename T, int D, int DV, bool kStats>
__global__ void __launch_bounds__(rows_threads<D, tc::kQ8QBlock>())
    quantize_q_partials(const RowsArgs q, const PartialArgs p, int64_t q_items,
                        int64_t p_items) {
  constexpr int kThreads = rows_threads<D, tc::kQ8QBlock>();
  constexpr int kRowsBytes = rows_smem_bytes<D, kThreads, kStats>();
  constexpr int kPartialBytes = partials_smem_bytes<D, DV, kThreads>();
  __shared__ __align__(16) unsigned char smem[kRowsBytes > kPartialBytes ? kRowsBytes
                                                                         : kPartialBytes];
  // CTA i is the column sums' when the count floor(i * p_items / n) steps at i; the count
  // before it is its item, i less that count Q's.
  const int64_t items = q_items + p_items, i = blockIdx.x;
  const int64_t p_before = i * p_items / items;
  if ((i + 1) * p_items / items > p_before) {
    column_partials_block<T, D, DV, kThreads>(p, p_before, smem);
  } else {
    quantize_rows_block<T, D, tc::kQ8QBlock, kThreads, false, kStats>(q, i - p_before, smem);
  }
}

// K's blocks of 128 rows and V^T's 128-key tiles (as many) in one launch, alternating CTAs: the
// rotation's arithmetic (K) and the transposition's memory traffic (V) share the SMs rather
// than follow each other. Three CTAs per SM at D = 128 (80 registers, 16-28 bytes of spills)
// keep more loads in flight than the two that 107-128 registers allow (11% faster; four at
// D = 64, 64 registers); one row a thread at D = 128 (512 threads) would repeat each thread's
// fixed work per row and costs more than its occupancy gains (docs/lab/fp8-kernel.md).
template <typename T, int D, int DV, bool kStats>
__global__ void __launch_bounds__(rows_threads<D, tc::kQ8Block>(), D == 128 ? 3 : 4)
    quantize_kv(const RowsArgs k, const VtArgs v) {
  constexpr int kThreads = rows_threads<D, tc::kQ8Block>();
  constexpr int kRowsBytes = rows_smem_bytes<D, kThreads, kStats>();
  constexpr int kVtBytes = vt_smem_bytes<T, DV, kThreads, kStats>();
  __shared__ __align__(16) unsigned char smem[kRowsBytes > kVtBytes ? kRowsBytes : kVtBytes];
  if (blockIdx.x % 2 == 0) {
    quantize_rows_block<T, D, tc::kQ8Block, kThreads, true, kStats>(k, blockIdx.x / 2, smem);
  } else {
    quantize_vt_tile<T, DV, kThreads, kStats>(v, blockIdx.x / 2, smem);
  }
}

// Sum over the kThreads threads of a CTA (kThreads / 32 warps, at most 1024) into every thread.
template <int kThreads>
__device__ __forceinline__ float cta_sum(float x, float* scratch) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffff, x, m);
  __syncthreads();  // scratch may hold the previous sum
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  x = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) x += scratch[w];
  return x;
}

// Slices of the blocks a choose_q8_heads CTA sums per channel (kChooseSlices * D threads): each
// channel's sum is a chain of loads, and four threads per channel keep four times as many in
// flight.
constexpr int kChooseSlices = 4;

// One CTA per (b, query head), kChooseSlices threads per channel: whether the head runs 8-bit.
// Its scales must be finite (q's blocks, its kv head's key blocks and value channels); with
// `tol` (stats non-null) the estimate of estimate_precision_error from the pre-pass's per-block
// sums,
//   sqrt(scale^2 sum_c (E[dq_c^2] E[k_c^2] + E[q_c^2] E[dk_c^2]) + eps_v^2 + eps_p^2),
// E the mean over the sequence (K is smoothed: its mean square is its variance), eps_v^2 =
// sum_c E[dv_c^2] / sum_c E[v_c^2] (0 for zero values), must be <= tol (a NaN estimate is not).
template <int D>
__global__ void __launch_bounds__(kChooseSlices * D) choose_q8_heads(
    const float* __restrict__ q_scale, int q_blocks, const float* __restrict__ k_scale,
    const float* __restrict__ v_scale, int k_blocks, const float* __restrict__ q_stats,
    const float* __restrict__ k_stats, const float* __restrict__ v_stats, int heads_q,
    int heads_kv, int len_q, int len_k, float scale2, float eps_p2, float tol,
    bool* __restrict__ run_q8) {
  constexpr int kThreads = kChooseSlices * D;
  __shared__ float scratch[kThreads / 32];
  __shared__ float slice_sums[kChooseSlices][6][D];
  const int bh = blockIdx.x, c = threadIdx.x % D, slice = threadIdx.x / D;
  const int b = bh / heads_q, h = bh % heads_q;
  const int bkv = b * heads_kv + h / (heads_q / heads_kv);
  bool finite = slice > 0 || isfinite(v_scale[static_cast<int64_t>(bkv) * D + c]);
  for (int i = threadIdx.x; i < q_blocks; i += kThreads) {
    finite &= isfinite(q_scale[static_cast<int64_t>(bh) * q_blocks + i]);
  }
  for (int i = threadIdx.x; i < k_blocks; i += kThreads) {
    finite &= isfinite(k_scale[static_cast<int64_t>(bkv) * k_blocks + i]);
  }
  finite = __syncthreads_and(finite);
  bool ok = finite;
  if (q_stats != nullptr) {
    // This slice's sums of block rows (x^2, err^2) at channel c, in block order, eight loads
    // of each in flight.
    auto sums = [c, slice](const float* stats, int64_t head, int blocks, float* out) {
      const int first = blocks * slice / kChooseSlices;
      const int last = blocks * (slice + 1) / kChooseSlices;
      const float* rows = stats + head * blocks * 2 * D + c;
      float sq = 0.f, err = 0.f;
      int i = first;
      for (; i + 8 <= last; i += 8) {
        float x[8], e[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          x[u] = rows[(i + u) * 2 * D];
          e[u] = rows[(i + u) * 2 * D + D];
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          sq += x[u];
          err += e[u];
        }
      }
      for (; i < last; ++i) {
        sq += rows[i * 2 * D];
        err += rows[i * 2 * D + D];
      }
      out[0] = sq;
      out[1] = err;
    };
    float* mine = &slice_sums[slice][0][0];
    float part[6];
    sums(q_stats, bh, q_blocks, part);
    sums(k_stats, bkv, k_blocks, part + 2);
    sums(v_stats, bkv, k_blocks, part + 4);
#pragma unroll
    for (int j = 0; j < 6; ++j) mine[j * D + c] = part[j];
    __syncthreads();
    // The slices' sums in slice order, by the first slice's threads (the others add 0).
    float qs[2] = {0.f, 0.f}, ks[2] = {0.f, 0.f}, vs[2] = {0.f, 0.f};
    if (slice == 0) {
#pragma unroll
      for (int s = 0; s < kChooseSlices; ++s) {
        qs[0] += slice_sums[s][0][c];
        qs[1] += slice_sums[s][1][c];
        ks[0] += slice_sums[s][2][c];
        ks[1] += slice_sums[s][3][c];
        vs[0] += slice_sums[s][4][c];
        vs[1] += slice_sums[s][5][c];
      }
    }
    const float inv_q = len_q > 0 ? 1.f / static_cast<float>(len_q) : 0.f;
    const float inv_k = len_k > 0 ? 1.f / static_cast<float>(len_k) : 0.f;
    const float score = cta_sum<kThreads>(
        qs[1] * inv_q * (ks[0] * inv_k) + qs[0] * inv_q * (ks[1] * inv_k), scratch);
    const float v_energy = cta_sum<kThreads>(vs[0] * inv_k, scratch);
    const float v_err = cta_sum<kThreads>(vs[1] * inv_k, scratch);
    const float eps_v2 = v_energy > 0.f ? v_err / v_energy : 0.f;
    ok = finite && sqrtf(scale2 * score + eps_v2 + eps_p2) <= tol;
  }
  if (threadIdx.x == 0) run_q8[bh] = ok;
}

template <typename T, int D, int DV>
Q8Operands quantize_q8_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             bool stats) {
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2);
  const int64_t Hkv = k.size(1), Lk = k.size(2);
  const auto f32 = q.options().dtype(at::kFloat);
  const int chunks = static_cast<int>((Lk + kPartialRows - 1) / kPartialRows);
  const int q_blocks = static_cast<int>((Lq + tc::kQ8QBlock - 1) / tc::kQ8QBlock);
  const int k_blocks = static_cast<int>((Lk + tc::kQ8Block - 1) / tc::kQ8Block);
  Q8Operands r;
  r.q = at::empty({B, Hq, Lq, D}, q.options().dtype(at::kChar));
  r.k = at::empty({B, Hkv, Lk, D}, q.options().dtype(at::kChar));
  r.vt = at::empty({B, Hkv, DV, static_cast<int64_t>(k_blocks) * tc::kQ8Block},
                   q.options().dtype(at::kFloat8_e4m3fn));
  r.q_scale = at::empty({B, Hq, q_blocks}, f32);
  r.k_scale = at::empty({B, Hkv, k_blocks}, f32);
  r.v_scale = at::empty({B, Hkv, DV}, f32);
  if (stats) {
    r.q_stats = at::empty({B, Hq, q_blocks, 2, D}, f32);
    r.k_stats = at::empty({B, Hkv, k_blocks, 2, D}, f32);
    r.v_stats = at::empty({B, Hkv, k_blocks, 2, DV}, f32);
  }
  auto stats_ptr = [&](const at::Tensor& t) { return stats ? t.data_ptr<float>() : nullptr; };
  if (B * Hkv * Lk == 0) {
    r.v_scale.fill_(1.f);
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const T* qp = static_cast<const T*>(q.data_ptr());
  const T* kp = static_cast<const T*>(k.data_ptr());
  const T* vp = static_cast<const T*>(v.data_ptr());
  at::Tensor k_sum, v_amax;
  const int64_t p_items = B * Hkv * Lk > 0 ? B * Hkv * chunks : 0;
  const int64_t q_items = B * Hq * Lq > 0 ? B * Hq * q_blocks : 0;
  if (p_items > 0) {
    k_sum = at::empty({B * Hkv, chunks, D}, f32);
    v_amax = at::empty({B * Hkv, chunks, DV}, f32);
  }
  // The statistics' work stays out of the plain pre-pass (separate instantiations).
  if (p_items + q_items > 0) {
    const RowsArgs qa{qp, static_cast<int>(Hq), static_cast<int>(Lq), q.stride(0), q.stride(1),
                      q.stride(2), nullptr, 0, r.q.data_ptr<int8_t>(),
                      r.q_scale.data_ptr<float>(), q_blocks, stats_ptr(r.q_stats)};
    const PartialArgs pa{kp, vp, static_cast<int>(Hkv), static_cast<int>(Lk), chunks,
                         k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
                         v.stride(2), p_items > 0 ? k_sum.data_ptr<float>() : nullptr,
                         p_items > 0 ? v_amax.data_ptr<float>() : nullptr};
    auto kernel =
        stats ? quantize_q_partials<T, D, DV, true> : quantize_q_partials<T, D, DV, false>;
    kernel<<<tc::grid_size(q_items + p_items), rows_threads<D, tc::kQ8QBlock>(), 0, stream>>>(
        qa, pa, q_items, p_items);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (B * Hkv * Lk > 0) {
    const RowsArgs ka{kp, static_cast<int>(Hkv), static_cast<int>(Lk), k.stride(0), k.stride(1),
                      k.stride(2), k_sum.data_ptr<float>(), chunks, r.k.data_ptr<int8_t>(),
                      r.k_scale.data_ptr<float>(), k_blocks, stats_ptr(r.k_stats)};
    const VtArgs va{vp, static_cast<int>(Hkv), static_cast<int>(Lk), v.stride(0), v.stride(1),
                    v.stride(2), v_amax.data_ptr<float>(), chunks,
                    static_cast<uint8_t*>(r.vt.data_ptr()), r.vt.size(3),
                    r.v_scale.data_ptr<float>(), k_blocks, stats_ptr(r.v_stats)};
    auto kv_kernel = stats ? quantize_kv<T, D, DV, true> : quantize_kv<T, D, DV, false>;
    kv_kernel<<<tc::grid_size(2 * B * Hkv * k_blocks), rows_threads<D, tc::kQ8Block>(), 0,
                stream>>>(ka, va);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return r;
}

template <typename T>
Q8Operands quantize_q8_dims(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            bool stats) {
  const int64_t d = q.size(3), dv = v.size(3);
  if (d == 128 && dv == 128) return quantize_q8_typed<T, 128, 128>(q, k, v, stats);
  if (d == 64 && dv == 64) return quantize_q8_typed<T, 64, 64>(q, k, v, stats);
  TORCH_CHECK(false, "adaattn: the 8-bit forward has (D, Dv) in {(64, 64), (128, 128)}, got (",
              d, ", ", dv, ")");
}

// Three consumer warpgroups at D = 64, where a warpgroup's products are too short for two to
// cover each other's softmax; two at D = 128 (three would leave 160 registers a thread, below
// the 168 it uses).
template <typename T, int D>
void launch_q8(const AttnParams& p_in) {
  using Traits = tc::Sm90Q8FwdTraits<D, D, D == 64 ? 3 : 2>;
  auto kernel = tc::fwd_q8_sm90_kernel<Traits, T, D, D>;
  tc::set_smem(kernel, Traits::kSmemBytes);
  const AttnParams p = tc::in_cta_order<false>(p_in, Traits::kBlockM, 1);
  const int grid = tc::grid_size(tile_slots<false>(p, Traits::kBlockM) * p.heads_q);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool q8_forward_available() { return tc::use_sm90(); }

Q8Operands quantize_q8_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            bool stats) {
  if (q.scalar_type() == at::kBFloat16) return quantize_q8_dims<__nv_bfloat16>(q, k, v, stats);
  return quantize_q8_dims<__half>(q, k, v, stats);
}

at::Tensor choose_q8_heads_cuda(const Q8Operands& ops, std::optional<double> fp8_tol,
                                int64_t len_q, int64_t len_k, double scale) {
  const int64_t batch = ops.q.size(0), heads_q = ops.q.size(1), heads_kv = ops.k.size(1);
  const int64_t dim = ops.q.size(3);
  at::Tensor run_q8 = at::empty({batch, heads_q}, ops.q.options().dtype(at::kBool));
  if (run_q8.numel() == 0) return run_q8;
  TORCH_CHECK(ops.v_scale.size(2) == dim, "adaattn: the 8-bit forward has D == Dv");
  const bool stats = fp8_tol.has_value();
  // e4m3 P: the mean squared relative rounding error of 3 mantissa bits, log-uniform
  // mantissas (adaattn.precision._relative_rounding_variance).
  const double eps_p2 = std::pow(4.0, -3.0) / 12.0 * (3.0 / (8.0 * std::log(2.0)));
  auto stats_ptr = [stats](const at::Tensor& t) { return stats ? t.data_ptr<float>() : nullptr; };
  auto kernel = dim == 128 ? choose_q8_heads<128> : choose_q8_heads<64>;
  kernel<<<tc::grid_size(batch * heads_q), kChooseSlices * static_cast<int>(dim), 0,
           at::cuda::getCurrentCUDAStream()>>>(
      ops.q_scale.data_ptr<float>(), static_cast<int>(ops.q_scale.size(2)),
      ops.k_scale.data_ptr<float>(), ops.v_scale.data_ptr<float>(),
      static_cast<int>(ops.k_scale.size(2)), stats_ptr(ops.q_stats), stats_ptr(ops.k_stats),
      stats_ptr(ops.v_stats), static_cast<int>(heads_q), static_cast<int>(heads_kv),
      static_cast<int>(len_q), static_cast<int>(len_k), static_cast<float>(scale * scale),
      static_cast<float>(eps_p2), static_cast<float>(fp8_tol.value_or(0.0)),
      run_q8.data_ptr<bool>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return run_q8;
}

void attention_fwd_q8_cuda(const AttnParams& p, c10::ScalarType out_dtype) {
  TORCH_CHECK(tc::use_sm90(), "adaattn: the 8-bit forward needs an sm_90 GPU (H100/H200)");
  const bool bf16 = out_dtype == at::kBFloat16;
  if (p.head_dim == 128) {
    bf16 ? launch_q8<__nv_bfloat16, 128>(p) : launch_q8<__half, 128>(p);
  } else {
    bf16 ? launch_q8<__nv_bfloat16, 64>(p) : launch_q8<__half, 64>(p);
  }
}

}  // namespace adaattn
