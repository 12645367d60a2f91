// Split-KV decode over an 8-bit paged cache (e4m3 k/v, one float32 scale per page and kv head)
// for plain softmax attention: half the bytes of a 16-bit cache, whose conversions make it
// bound by instructions unless its mainloop is lean; hence one of its own.
//
// The products run key-major, S^T = K Q^T and O^T = V^T P^T (m16n8k16, f16): a warp's 16 keys
// are the rows of an mma, the query rows (group * Lq <= 16 per kv head) its 8 or 16 columns
// (kRowTiles). With the few rows of decode (four at GQA 4, Lq = 1) this takes half the
// products, exponentials and registers of row-major fragments, whose 16 mma rows would be
// mostly padding. e4m3 converts exactly to f16 (one instruction per pair), so the products run
// on the stored values, with q converted to f16 at a power-of-two scale per row and the page
// scales applied outside the products: k's to the scores, v's to the probabilities
// (Fp8ValueScale).
// Fragments are built from the bytes in registers: K^T's from 16-byte loads of the lane's own
// dims (q's B-fragments take the same dims), V^T's from byte interleaves of rows pairwise, P^T's
// from S^T by movmatrix. Each warp copies, converts and multiplies its own 16 keys of a tile, so
// the mainloop needs warp barriers only.
#pragma once

#include <cuda_fp8.h>

#include <climits>
#include <cmath>
#include <type_traits>

#include "decode.h"

namespace adaattn {
namespace tc {

// Stages of the 8-bit tiles: a full-width tile holds half a 16-bit tile's bytes, so at three
// CTAs per SM 96 KB of copies per SM are in flight; narrow keys (R = 32, Dv = 128: 10 KB a
// tile) run four CTAs per SM, 80 KB in flight.
constexpr int kDecodeFp8Stages = 3;

// CTAs per SM that decode_fp8_kernel's registers allow (its launch bounds; the split count of
// keys narrower than the values): four for narrow keys in one row tile (at most 128 registers).
template <typename Traits, int kRowTiles>
constexpr int decode_fp8_ctas_per_sm() {
  return kRowTiles == 1 ? (Traits::kD < Traits::kDV ? 4 : 3) : 2;
}

// The 8-bit stages' layout: rows of bytes, whose 16-byte units are XOR-swizzled by the row so
// that the fragment reads below (per quarter warp: two rows 1 apart at even or odd units, or
// four rows 4 apart at the same two units) hit distinct banks. kUnits: units per row (a power
// of 2).
template <int kUnits>
__device__ __forceinline__ int fp8_unit(int row, int unit) {
  return unit ^ ((((row >> 1) & 6) ^ (row & 1)) & (kUnits - 1));
}

// Two e4m3 values (low byte first) as f16x2, exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t pair) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffff), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// The tile row (of a warp's 16 keys) of S^T's fragment row m: the keys of lane c's P^T
// B-fragments (m = 2c, 2c + 1, 2c + 8, 2c + 9) are the consecutive rows 4c..4c+3, whose bytes
// the lane interleaves into its V^T A-fragments.
__device__ __forceinline__ int fp8_key_row(int m) {
  return 4 * ((m & 7) >> 1) + (m & 1) + (m & 8 ? 2 : 0);
}

// The value scales of an 8-bit cache in the probabilities: P V over tiles of scales v_t is
// v_ref * sum_t (P_t * v_t / v_ref) V8_t, with v_ref rebased (the accumulator rescaled by
// v_ref_old / v_ref_new) when a tile's scale exceeds it or falls below kMinRatio of it, so that
// the f16 probabilities keep their range. A zero scale (a page of zeros) weighs 0; a NaN one
// makes the row NaN.
struct Fp8ValueScale {
  static constexpr float kMinRatio = 1.f / 64;
  float ref = 0.f;
  // The tile's factor for the probabilities; *rebase (1 unless rebased) scales the accumulator.
  __device__ __forceinline__ float tile(float v_t, float* rebase) {
    *rebase = 1.f;
    if (v_t > ref || (v_t > 0.f && v_t < ref * kMinRatio)) {
      *rebase = ref / v_t;
      ref = v_t;
    }
    return v_t == 0.f ? 0.f : v_t / ref;
  }
};

// Row stride (floats) of the key warps' outputs in the merge: padded off a multiple of 32 banks.
template <int DV>
constexpr int decode_fp8_out_stride() {
  return DV + 4;
}

// Shared memory of decode_fp8_kernel: the stages and their scales (a k, v pair per stage and
// warp), or the merge buffers if larger.
template <typename Traits, int kRowTiles>
constexpr int decode_fp8_smem_bytes() {
  constexpr int kWarps = Traits::kThreads / 32;
  constexpr int kPipe = kDecodeFp8Stages * Traits::kBlockN * (Traits::kD + Traits::kDV) +
                        2 * kDecodeFp8Stages * kWarps * static_cast<int>(sizeof(float));
  constexpr int kMerge = kWarps * 8 * kRowTiles * (2 + decode_fp8_out_stride<Traits::kDV>()) *
                         static_cast<int>(sizeof(float));
  return kPipe > kMerge ? kPipe : kMerge;
}

// A low-rank key cache's queries projected in the kernel (p.q_basis): the CTA's rows 0 ..
// kRows - 1 (head-major rows of kv head h_kv) become q U in float32, passed to
// store(r, col, value) once per (r, col) < (kRows, R) (0 for rows past `rows`). Thread t sums
// column t % R over the dims of slice t / R (kThreads / R slices of q_full_dim, each a multiple
// of 8: decode_projects_query); the slices add up through `partial`, kThreads * kRows floats
// of shared memory that the caller must not overwrite before its next barrier.
template <typename T, int R, int kRows, int kThreads, typename Store>
__device__ __forceinline__ void project_query_rows(const AttnParams& p, int b, int h_kv,
                                                   int rows, float* partial, int tid,
                                                   Store&& store) {
  static_assert(kThreads % R == 0, "whole slices of threads");
  constexpr int kSlices = kThreads / R;
  const int col = tid % R, slice = tid / R;
  const int dims = p.q_full_dim / kSlices;
  const int n = min(rows, kRows);
  const int group = p.heads_q / p.heads_kv;
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride;
  int64_t row_off[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = min(r, rows - 1);
    row_off[r] =
        (h_kv * group + row / p.len_q) * p.q_head_stride + (row % p.len_q) * p.q_row_stride;
  }
  const int64_t basis = (static_cast<int64_t>(b) * p.heads_kv + h_kv) * p.q_full_dim * R + col;
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
#pragma unroll 2
  for (int d = slice * dims; d < (slice + 1) * dims; d += 8) {
    float u[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t at = basis + static_cast<int64_t>(d + j) * R;
      u[j] = p.q_basis_f32 ? static_cast<const float*>(p.q_basis)[at]
                           : to_float(static_cast<const T*>(p.q_basis)[at]);
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r < n) {
        const uint4 raw = *reinterpret_cast<const uint4*>(q + row_off[r] + d);
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float lo, hi;
          unpack_pair<T>(words[j], lo, hi);
          acc[r] = fmaf(lo, u[2 * j], acc[r]);
          acc[r] = fmaf(hi, u[2 * j + 1], acc[r]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r < n) partial[(slice * kRows + r) * R + col] = acc[r];
  }
  __syncthreads();
  for (int i = tid; i < kRows * R; i += kThreads) {
    const int r = i / R, c = i % R;
    float sum = 0.f;
    if (r < n) {
#pragma unroll
      for (int sl = 0; sl < kSlices; ++sl) sum += partial[(sl * kRows + r) * R + c];
    }
    store(r, c, sum);
  }
}

// One CTA per (sequence, kv head, key split) over its group * Lq <= 8 * kRowTiles query rows.
template <typename T, typename Traits, int kRowTiles>
__device__ __forceinline__ void decode_fp8_pass(const AttnParams& p, const DecodeSplits& sp) {
  constexpr int D = Traits::kD, DV = Traits::kDV;
  constexpr int BN = Traits::kBlockN;
  constexpr int kWarps = Traits::kThreads / 32;
  static_assert(Traits::kRowWarps == 1 && Traits::kWarpKeys == 16 && kWarps == Traits::kKeyWarps,
                "each warp takes 16 keys of a tile and every row");
  static_assert(D == 32 || D == 64 || D == 128, "keys of width 32, 64 or 128");
  static_assert(DV == 64 || DV == 128, "values of width 64 or 128");
  constexpr int kRows = 8 * kRowTiles;
  constexpr int kStages = kDecodeFp8Stages;
  constexpr int kStageBytes = BN * (D + DV);
  constexpr int KS = D / 16;           // k-steps of S^T = K Q^T (a word of the lane's K bytes each)
  constexpr int kVWords = DV / 32;     // words of the lane's V bytes per row: two m-tiles each
  constexpr int kKUnits = D / 16, kVUnits = DV / 16;  // 16-byte units per row
  constexpr float kMaxSlack = 8.f;
  // Probabilities come out times 2^kLog2Gain (within f16's range: at most 2^(kMaxSlack +
  // kLog2Gain), capped at 2^15 for scores beyond 2^25), so that fewer are f16 subnormals.
  constexpr float kLog2Gain = 6.f;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint8_t* const sStages = smem_raw;
  float* const sScales = reinterpret_cast<float*>(smem_raw + kStages * kStageBytes);

  const int b = blockIdx.x / p.heads_kv, h_kv = blockIdx.x % p.heads_kv;
  const int split = blockIdx.z;
  const int group = p.heads_q / p.heads_kv;
  const int rows = group * p.len_q;
  const SeqLens lens = seq_lens(p, b);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, c = lane & 3;

  // This lane's S^T columns: rows 8 nr + 2c + e, and the keys each attends.
  int lo[kRowTiles][2], hi[kRowTiles][2];
  int all_lo = 0, all_hi = INT_MAX;
#pragma unroll
  for (int nr = 0; nr < kRowTiles; ++nr)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = 8 * nr + 2 * c + e;
      const KeyRange r = row < rows ? key_range(p, lens, row % p.len_q) : KeyRange{0, 0};
      lo[nr][e] = r.lo;
      hi[nr][e] = r.hi;
      if (row < rows) {
        all_lo = max(all_lo, r.lo);
        all_hi = min(all_hi, r.hi);
      }
    }
#pragma unroll
  for (int off = 1; off < 4; off *= 2) {
    all_lo = max(all_lo, __shfl_xor_sync(0xffffffff, all_lo, off));
    all_hi = min(all_hi, __shfl_xor_sync(0xffffffff, all_hi, off));
  }

  const int2 tiles = split_key_tiles<BN>(p, lens, sp, split);
  const int first = tiles.x, last = tiles.y;

  // The copies: lane copies units u = lane + 32 i of the warp's 16 rows, row u / kUnits; its
  // source offsets advance by a fixed step, its destinations are fixed per stage.
  constexpr int kKCopies = 16 * kKUnits / 32, kVCopies = 16 * kVUnits / 32;
  constexpr int kKRowStep = 32 / kKUnits, kVRowStep = 32 / kVUnits;
  const int k_row = lane / kKUnits, v_row = lane / kVUnits;
  const int64_t k_src = static_cast<int64_t>(warp * 16 + k_row) * p.k_row_stride +
                        16 * (lane % kKUnits);
  const int64_t v_src = static_cast<int64_t>(warp * 16 + v_row) * p.v_row_stride +
                        16 * (lane % kVUnits);
  const int64_t k_step = static_cast<int64_t>(kKRowStep) * p.k_row_stride;
  const int64_t v_step = static_cast<int64_t>(kVRowStep) * p.v_row_stride;
  int k_dst[kKCopies], v_dst[kVCopies];
#pragma unroll
  for (int i = 0; i < kKCopies; ++i) {
    const int r = warp * 16 + k_row + i * kKRowStep;
    k_dst[i] = r * D + 16 * fp8_unit<kKUnits>(r, lane % kKUnits);
  }
#pragma unroll
  for (int i = 0; i < kVCopies; ++i) {
    const int r = warp * 16 + v_row + i * kVRowStep;
    v_dst[i] = BN * D + r * DV + 16 * fp8_unit<kVUnits>(r, lane % kVUnits);
  }
  auto scale_slot = [&](int stage) { return sScales + 2 * (warp * kStages + stage); };
  // A tile's page, looked up a tile ahead (its latency hides behind a tile's compute); pages
  // hold whole tiles (the host requires it). A tile past the sequence looks up key 0's.
  auto lookup = [&](int tile) { return cache_block_raw(p, b, tile * BN < lens.k ? tile * BN : 0); };
  auto load_stage = [&](int tile, int stage, int raw_block) {
    const int block = clamp_block(p, raw_block);
    const int key0 = tile * BN;
    const uint8_t* k_tile = static_cast<const uint8_t*>(p.k) +
                            tile_offset(p, block, p.k_batch_stride, p.k_head_stride,
                                        p.k_row_stride, h_kv, key0);
    const uint8_t* v_tile = static_cast<const uint8_t*>(p.v) +
                            tile_offset(p, block, p.v_batch_stride, p.v_head_stride,
                                        p.v_row_stride, h_kv, key0);
    const uint32_t stage_addr = smem_addr(sStages + stage * kStageBytes);
    // Rows of the warp's 16 inside the sequence; the rest copy nothing from the tile's first
    // row (in bounds).
    const int left = lens.k - key0 - warp * 16;
    auto copy = [&](auto full) {
      const uint8_t* ks = k_tile + k_src;
#pragma unroll
      for (int i = 0; i < kKCopies; ++i, ks += k_step) {
        const bool valid = decltype(full)::value || k_row + i * kKRowStep < left;
        cp_async16(stage_addr + k_dst[i], valid ? ks : k_tile, valid);
      }
      const uint8_t* vs = v_tile + v_src;
#pragma unroll
      for (int i = 0; i < kVCopies; ++i, vs += v_step) {
        const bool valid = decltype(full)::value || v_row + i * kVRowStep < left;
        cp_async16(stage_addr + v_dst[i], valid ? vs : v_tile, valid);
      }
    };
    if (left >= 16) {
      copy(std::true_type{});
    } else {
      copy(std::false_type{});
    }
    if (lane == 0) {
      const int64_t at = static_cast<int64_t>(block) * p.heads_kv + h_kv;
      cp_async4(scale_slot(stage), p.k_cache_scale + at, true);
      cp_async4(scale_slot(stage) + 1, p.v_cache_scale + at, true);
    }
  };

  int next_block = lookup(first);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (first + s < last) {
      load_stage(first + s, s, next_block);
      next_block = lookup(first + s + 1);
    }
    cp_async_commit();
  }

  // q's B-fragments (lane: row 8 nr + g, k-step s: dims c * D / 4 + 4s .. + 3, the K bytes the
  // lane converts), read straight from global memory: a 16-bit row scaled by the power of two
  // that puts its largest magnitude in [2^14, 2^15) (exact but for values below 2^-24 of it,
  // which f16 rounds as subnormals); q_unscale undoes it in the scores of the lane's S^T
  // columns (rows 8 nr + 2c + e).
  // Keys narrower than the values are a low-rank key cache's: q may come at full width, which
  // the CTA projects into the last stage, unwritten until the mainloop.
  const T* q_projected = nullptr;
  if constexpr (D < DV) {
    if (p.q_basis != nullptr) {
      float* partial = reinterpret_cast<float*>(sStages + (kStages - 1) * kStageBytes);
      T* sProj = reinterpret_cast<T*>(partial + Traits::kThreads * kRows);
      static_assert(Traits::kThreads * kRows * 4 + kRows * D * 2 <= kStageBytes,
                    "the projection's partial sums and rows fit a stage");
      project_query_rows<T, D, kRows, Traits::kThreads>(
          p, b, h_kv, rows, partial, tid,
          [&](int r, int col, float x) { sProj[r * D + col] = from_float<T>(x); });
      __syncthreads();
      q_projected = sProj;
    }
  }
  uint32_t qb[kRowTiles][KS][2];
  float q_unscale[kRowTiles][2];
#pragma unroll
  for (int nr = 0; nr < kRowTiles; ++nr) {
    const int row = 8 * nr + g;
    const bool valid = row < rows;
    const T* src = q_projected != nullptr
                       ? q_projected + row * D + c * (D / 4)
                       : static_cast<const T*>(p.q) + b * p.q_batch_stride +
                             (h_kv * group + (valid ? row / p.len_q : 0)) * p.q_head_stride +
                             (valid ? row % p.len_q : 0) * p.q_row_stride + c * (D / 4);
    float x[D / 4];
#pragma unroll
    for (int u = 0; u < D / 32; ++u) {
      uint4 raw = make_uint4(0, 0, 0, 0);
      if (valid) raw = *reinterpret_cast<const uint4*>(src + 8 * u);
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) unpack_pair<T>(words[j], x[8 * u + 2 * j], x[8 * u + 2 * j + 1]);
    }
    float scale = 1.f, unscale = 1.f;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      float mx = 0.f;
#pragma unroll
      for (int j = 0; j < D / 4; ++j) mx = fmaxf(mx, fabsf(x[j]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      // Its exponent, clamped so that both powers stay normal floats (inf and NaN rows stay
      // inf and NaN).
      const int ex = min(max(((__float_as_int(mx) >> 23) & 0xff) - 127, -100), 100);
      scale = __int_as_float((127 + 14 - ex) << 23);
      unscale = __int_as_float((127 - 14 + ex) << 23);
    }
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      qb[nr][s][0] = MmaOp<__half>::pack(x[4 * s] * scale, x[4 * s + 1] * scale);
      qb[nr][s][1] = MmaOp<__half>::pack(x[4 * s + 2] * scale, x[4 * s + 3] * scale);
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      q_unscale[nr][e] = __shfl_sync(0xffffffff, unscale, 4 * (2 * c + e));
    }
  }
  if (q_projected != nullptr) __syncthreads();  // before the mainloop's copies reuse the stage

  // The lane's K rows (S^T fragment rows g and g + 8) and V rows (4c..4c+3) of the warp's keys.
  const int k_row_a = warp * 16 + fp8_key_row(g);
  const int v_row0 = warp * 16 + 4 * c;
  Fp8ValueScale v_scale;
  float o[2 * kVWords][kRowTiles][4];
#pragma unroll
  for (int t = 0; t < 2 * kVWords; ++t)
#pragma unroll
    for (int nr = 0; nr < kRowTiles; ++nr)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[t][nr][e] = 0.f;
  float row_max[kRowTiles][2], row_sum[kRowTiles][2];
#pragma unroll
  for (int nr = 0; nr < kRowTiles; ++nr)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      row_max[nr][e] = -INFINITY;
      row_sum[nr][e] = 0.f;
    }

  for (int tile = first; tile < last; ++tile) {
    const int i = tile - first;
    cp_async_wait<kStages - 2>();
    __syncwarp();
    if (tile + kStages - 1 < last) {
      load_stage(tile + kStages - 1, (i + kStages - 1) % kStages, next_block);
      next_block = lookup(tile + kStages);
    }
    cp_async_commit();
    const int stage = i % kStages;
    const uint8_t* sK = sStages + stage * kStageBytes;
    const uint8_t* sV = sK + BN * D;

    // S^T = K Q^T: the lane's D / 4 bytes of its two K rows, a word per k-step.
    uint32_t ka[KS], kb[KS];
    auto load_k = [&](int r, uint32_t(&w)[KS]) {
      if constexpr (D == 32) {
        const uint2 x = *reinterpret_cast<const uint2*>(
            sK + r * D + 16 * fp8_unit<kKUnits>(r, c / 2) + 8 * (c % 2));
        w[0] = x.x;
        w[1] = x.y;
      } else {
#pragma unroll
        for (int u = 0; u < D / 64; ++u) {
          const uint4 x = *reinterpret_cast<const uint4*>(
              sK + r * D + 16 * fp8_unit<kKUnits>(r, c * (D / 64) + u));
          w[4 * u] = x.x;
          w[4 * u + 1] = x.y;
          w[4 * u + 2] = x.z;
          w[4 * u + 3] = x.w;
        }
      }
    };
    load_k(k_row_a, ka);
    load_k(k_row_a + 2, kb);  // fp8_key_row(g + 8)
    float st[kRowTiles][4];
#pragma unroll
    for (int nr = 0; nr < kRowTiles; ++nr)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nr][e] = 0.f;
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      const uint32_t a[4] = {e4m3x2_to_f16x2(ka[s]), e4m3x2_to_f16x2(kb[s]),
                             e4m3x2_to_f16x2(ka[s] >> 16), e4m3x2_to_f16x2(kb[s] >> 16)};
#pragma unroll
      for (int nr = 0; nr < kRowTiles; ++nr) {
        MmaOp<__half>::run(st[nr], a, qb[nr][s][0], qb[nr][s][1]);
      }
    }
    // The softmax scale joins the page's: the row max is then taken on the very values
    // exponentiated (a fused scale's rounding at large scores would exceed f16's range).
    const float k_scale = scale_slot(stage)[0] * p.scale_log2;
#pragma unroll
    for (int nr = 0; nr < kRowTiles; ++nr)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nr][e] *= q_unscale[nr][e & 1] * k_scale;
    const int n0 = tile * BN + warp * 16;
    if (!(n0 >= all_lo && n0 + 16 <= all_hi)) {
      const int ja = n0 + fp8_key_row(g);
#pragma unroll
      for (int nr = 0; nr < kRowTiles; ++nr)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = ja + (e >> 1) * 2;
          if (j < lo[nr][e & 1] || j >= hi[nr][e & 1]) st[nr][e] = -INFINITY;
        }
    }

    // Online softmax per column of S^T (a query row): its 16 keys lie across lanes 4 apart.
    // The running max may stay up to kMaxSlack (log2 units) below the true one, so O is
    // rescaled only when it grows by more (as the Hopper forward, fwd_sm90.h).
    float corr[kRowTiles][2];
#pragma unroll
    for (int nr = 0; nr < kRowTiles; ++nr)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float mx = key_column_max(fmaxf(st[nr][e], st[nr][2 + e]));
        mx = fmaxf(row_max[nr][e], mx);
        if (!(mx - row_max[nr][e] > kMaxSlack)) mx = row_max[nr][e];
        const float base = mx == -INFINITY ? 0.f : mx;
        corr[nr][e] = exp2f(row_max[nr][e] - base);
        row_max[nr][e] = mx;
        const float shift = base - kLog2Gain;
#pragma unroll
        for (int k = e; k < 4; k += 2) {
          const float x = st[nr][k] - shift;
          // Capped at f16's range (a NaN passes), in the sum as in P: kMaxSlack + kLog2Gain
          // leave f16 about two bits of headroom, which the shift's rounding exceeds where
          // scores reach 2^25 (log2 units); below that the cap never binds.
          st[nr][k] = exp2f(x > 15.f ? 15.f : x);
        }
        row_sum[nr][e] = row_sum[nr][e] * corr[nr][e] + (st[nr][e] + st[nr][2 + e]);
      }
    float rebase;
    const float factor = v_scale.tile(scale_slot(stage)[1], &rebase);
    bool rescale = false;
#pragma unroll
    for (int nr = 0; nr < kRowTiles; ++nr)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        corr[nr][e] *= rebase;
        rescale |= corr[nr][e] != 1.f;
      }
    if (__any_sync(0xffffffff, rescale)) {
#pragma unroll
      for (int t = 0; t < 2 * kVWords; ++t)
#pragma unroll
        for (int nr = 0; nr < kRowTiles; ++nr)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[t][nr][e] *= corr[nr][e & 1];
    }
    // P^T as B-fragments: S^T's f16 pairs (fragment rows g, g + 8; columns 2c, 2c + 1)
    // transposed, so that lane (g, c) holds keys 2c, 2c + 1 (and + 8) of query row g.
    uint32_t pb[kRowTiles][2];
#pragma unroll
    for (int nr = 0; nr < kRowTiles; ++nr) {
      pb[nr][0] = movmatrix_trans(MmaOp<__half>::pack(st[nr][0] * factor, st[nr][1] * factor));
      pb[nr][1] = movmatrix_trans(MmaOp<__half>::pack(st[nr][2] * factor, st[nr][3] * factor));
    }

    // O^T += V^T P^T: lane (g, c) reads bytes g * DV / 8.. of rows 4c..4c+3 and interleaves
    // rows pairwise, so each 16-bit pair holds one value column of two consecutive keys: word q
    // gives m-tile 2q (columns g * DV / 8 + 4q, + 1 as fragment rows g, g + 8) and m-tile
    // 2q + 1 (columns + 2, + 3).
    uint32_t v[4][kVWords];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = v_row0 + r;
      const int byte = g * (DV / 8);
      const uint8_t* src = sV + row * DV + 16 * fp8_unit<kVUnits>(row, byte / 16) + byte % 16;
      if constexpr (kVWords == 4) {
        const uint4 x = *reinterpret_cast<const uint4*>(src);
        v[r][0] = x.x;
        v[r][1] = x.y;
        v[r][2] = x.z;
        v[r][3] = x.w;
      } else {
        const uint2 x = *reinterpret_cast<const uint2*>(src);
        v[r][0] = x.x;
        v[r][1] = x.y;
      }
    }
#pragma unroll
    for (int q = 0; q < kVWords; ++q)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t sel = half == 0 ? 0x5140 : 0x7362;
        const uint32_t k01 = __byte_perm(v[0][q], v[1][q], sel);
        const uint32_t k23 = __byte_perm(v[2][q], v[3][q], sel);
        const uint32_t a[4] = {e4m3x2_to_f16x2(k01), e4m3x2_to_f16x2(k01 >> 16),
                               e4m3x2_to_f16x2(k23), e4m3x2_to_f16x2(k23 >> 16)};
#pragma unroll
        for (int nr = 0; nr < kRowTiles; ++nr) {
          MmaOp<__half>::run(o[2 * q + half][nr], a, pb[nr][0], pb[nr][1]);
        }
      }
  }
  cp_async_wait_all();
  __syncthreads();  // the stages become the merge buffers

  // Merge the warps: per row the max M and sum L over warps; each warp's O^T rescaled by
  // exp2(m_w - M) / L, then summed.
  constexpr int kOStride = decode_fp8_out_stride<DV>();
  float* sMax = reinterpret_cast<float*>(smem_raw);
  float* sSum = sMax + kWarps * kRows;
  float* sO = sSum + kWarps * kRows;
#pragma unroll
  for (int nr = 0; nr < kRowTiles; ++nr)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float l = key_column_sum(row_sum[nr][e]);
      row_sum[nr][e] = l;
      if (g == 0) {
        const int r = 8 * nr + 2 * c + e;
        sMax[warp * kRows + r] = row_max[nr][e];
        sSum[warp * kRows + r] = l;
      }
    }
  __syncthreads();
  auto row_stats = [&](int r, float& m, float& l) {
    merge_warp_stats<kWarps, kRows>(sMax, sSum, r, -INFINITY, 0.f, m, l);
  };
#pragma unroll
  for (int nr = 0; nr < kRowTiles; ++nr)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = 8 * nr + 2 * c + e;
      float m, l;
      row_stats(r, m, l);
      const float f =
          row_saw_keys(row_sum[nr][e]) ? exp2f(row_max[nr][e] - m) / l * v_scale.ref : 0.f;
#pragma unroll
      for (int q = 0; q < kVWords; ++q) {
        *reinterpret_cast<float4*>(sO + (warp * kRows + r) * kOStride + g * (DV / 8) + 4 * q) =
            make_float4(o[2 * q][nr][e] * f, o[2 * q][nr][2 + e] * f, o[2 * q + 1][nr][e] * f,
                        o[2 * q + 1][nr][2 + e] * f);
      }
    }
  __syncthreads();
  store_decode_rows<T, DV, kWarps, kRows, kOStride, Traits::kThreads, true>(
      p, sp, sO, min(kRows, rows), 0, b, h_kv, group, split, tid, [&](int r) {
        float m, l;
        row_stats(r, m, l);
        return row_saw_keys(l) ? (m + log2f(l) - kLog2Gain) * float(M_LN2) : -INFINITY;
      });
}

template <typename T, typename Traits, int kRowTiles>
__global__ void __launch_bounds__(Traits::kThreads, decode_fp8_ctas_per_sm<Traits, kRowTiles>())
    decode_fp8_kernel(const AttnParams p, const DecodeSplits sp) {
  // Its combine kernel may start (and wait) as soon as every CTA runs; nothing is appended to
  // an 8-bit cache in the op, so no kernel ahead writes what this one reads.
  allow_dependent_grids();
  decode_fp8_pass<T, Traits, kRowTiles>(p, sp);
}

}  // namespace tc
}  // namespace adaattn
