// Split-KV decode (flash-decoding) on mma.sync tensor cores, for SM80 and Hopper alike: decode
// is bound by reading the KV cache, not by the products. One CTA per (sequence, kv head, row
// block, key split). Its rows are the query rows of every query head of the kv head's GQA group
// (group * Lq rows, head-major), so each K/V byte is read once per split. The warps split the
// rows 16 at a time (kRowWarps) and each tile's keys between them (kKeyWarps), each keeping its
// own softmax state; K/V tiles stream through a cp.async pipeline, rows fetched one by one so a
// paged cache costs only its block-table lookups. Warps merge their states through shared
// memory; with several splits each writes a partial result and decode_combine_kernel merges them.
//
// A normalised transform runs one online pass (DecodePass::kOnline). Any other needs the row's
// finished lse before its weights: an lse pass over K (kLse, merged over splits by their lse),
// then a weight pass over K and V (kWeights, whose splits' partial outputs simply add up).
// A positional score modifier is applied per score with each row's head and position (the rows
// of a warp mix heads).
//
// An 8-bit paged cache (kFp8Cache: e4m3 k/v, one float32 scale per page and kv head) streams
// half the bytes: its stages hold the e4m3 rows, and each tile is dequantised (value * scale,
// rounded to q's dtype) into one 16-bit tile, which the products then read as a 16-bit cache's.
#pragma once

#include <cuda_fp8.h>

#include <climits>
#include <cmath>
#include <type_traits>

#include "../../core/mask.h"
#include "../../core/params.h"
#include "mma.h"
#include "softmax_frag.h"

namespace adaattn {
namespace tc {

enum class DecodePass { kOnline, kLse, kWeights };

// Partial results of the key splits (decode_combine_kernel merges them): o [splits, B, Hq, Lq,
// Dv] (kOnline: normalised; kWeights: sums), lse [splits, B, Hq, Lq] natural log (-inf: the
// split saw no key of the row). With one split the CTA writes out and lse itself.
struct DecodeSplits {
  float* o_part;
  float* lse_part;
  int num_splits;
  int tiles_per_split;  // key tiles (kBlockN keys) per split
  // Scores of the lse pass (log2 units, modified, masked), which the weight pass then reads
  // instead of K, or null: [B, Hkv, group * Lq, scores_stride] float32 (scores_stride: Lmax
  // rounded up to whole tiles). Pays where a key's scores take fewer bytes than its K row.
  float* scores;
  int64_t scores_stride;
};

template <int D, int DV, int kRowWarps_, int kKeyWarps_, int kBlockN_, int kStages_,
          int kMinBlocks_ = 1>
struct DecodeTraits {
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kRowWarps = kRowWarps_;
  static constexpr int kKeyWarps = kKeyWarps_;
  static constexpr int kThreads = 32 * kRowWarps * kKeyWarps;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kRows = 16 * kRowWarps;
  static constexpr int kWarpKeys = kBlockN / kKeyWarps;
  static_assert(kWarpKeys % 16 == 0, "each warp's key slice is a multiple of 16");
  static constexpr int kD = D, kDV = DV;
  static_assert(D <= DV && DV % D == 0, "K rows (D <= Dv, low-rank keys) ride with V rows");
  // Cache rows each thread copies per tile: 16-byte chunks of a V row and, in the same columns,
  // of the K row (its first D), so a thread's K and V rows share their cache position and page.
  static constexpr int kChunksPerRow = DV / 8;
  static constexpr int kRowsPerThread = kBlockN * kChunksPerRow / kThreads;
  static_assert(kBlockN * kChunksPerRow % kThreads == 0, "tile chunks divide among threads");
  // Cached scores of a tile, [kRows][kScoreStride] float32 in a stage's K area (the weight
  // pass, decode_kernel); the padding keeps 64-bit reads of a half-warp conflict-free.
  static constexpr int kScoreStride = kBlockN + 8;
  static constexpr bool kCanCacheScores = kRows * kScoreStride * 4 <= kBlockN * D * 2;
  // Q, then the K/V stages; after the mainloop they hold the warps' merge buffers.
  static constexpr int kQBytes = kRows * D * 2;
  static constexpr int kStageElems = kBlockN * (D + DV);
  static constexpr int kStagesBytes = kStages * kStageElems * 2;
  static constexpr int kMergeBytes = kKeyWarps * kRows * (DV + 2) * 4;
  static constexpr int kSmemBytes = kQBytes + kStagesBytes;
  static_assert(kMergeBytes <= kSmemBytes, "merge buffers fit in shared memory");
};

// Where key j of entry b lives: its page as the block table says (paged cache; may be out of
// range, see clamp_block) or b.
__device__ __forceinline__ int cache_block_raw(const AttnParams& p, int b, int j) {
  if (p.block_table == nullptr) return b;
  const int index = p.page_shift >= 0 ? j >> p.page_shift : j / p.page_size;
  return p.block_table[b * p.block_table_stride + index];
}
// A block of cache_block_raw clamped into the page pool.
__device__ __forceinline__ int clamp_block(const AttnParams& p, int block) {
  if (p.block_table == nullptr) return block;
  return block < 0 ? 0 : (block >= p.num_pages ? p.num_pages - 1 : block);
}
__device__ __forceinline__ int cache_block(const AttnParams& p, int b, int j) {
  return clamp_block(p, cache_block_raw(p, b, j));
}

// Element offset of key j of kv head h in block `block` (cache_block) of a cache operand.
__device__ __forceinline__ int64_t cache_offset(const AttnParams& p, int block,
                                                int64_t batch_stride, int64_t head_stride,
                                                int64_t row_stride, int h, int j) {
  const int slot = p.block_table == nullptr ? j
                   : p.page_shift >= 0      ? j & (p.page_size - 1)
                                            : j % p.page_size;
  return block * batch_stride + h * head_stride + slot * row_stride;
}

// Stages of an 8-bit cache's tiles: the 16-bit cache's stage memory holds them and the one
// dequantised 16-bit tile, so that the kernel keeps the 16-bit kernel's CTAs per SM (decode
// needs them to keep enough bytes in flight; docs/lab/decode.md). Its shared memory: the
// 16-bit kernel's and the stages' scales.
template <typename Traits>
constexpr int decode_fp8_stages() {
  constexpr int kTileBytes = Traits::kBlockN * (Traits::kD + Traits::kDV);
  return (Traits::kStagesBytes - 2 * kTileBytes) / kTileBytes;
}
template <typename Traits, bool kFp8Cache>
constexpr int decode_smem_bytes() {
  // A scale pair per stage and warp (a warp-private pipeline), or per stage.
  constexpr int kScaleBytes =
      2 * decode_fp8_stages<Traits>() * (Traits::kThreads / 32) * static_cast<int>(sizeof(float));
  return kFp8Cache ? Traits::kSmemBytes + kScaleBytes : Traits::kSmemBytes;
}

// Eight e4m3 values times `scale`, rounded to T (what a 16-bit cache would hold).
template <typename T>
__device__ __forceinline__ uint4 dequantize_e4m3x8(uint2 raw, float scale) {
  const uint32_t words[2] = {raw.x, raw.y};
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const auto pair = static_cast<__nv_fp8x2_storage_t>(words[i / 2] >> (16 * (i % 2)));
    const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
    out[i] = MmaOp<T>::pack(f.x * scale, f.y * scale);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// kScoresIn: the weight pass reads the scores the lse pass cached (DecodeSplits::scores)
// instead of K. kFp8Cache: an 8-bit paged cache (p.k_cache_scale, p.v_cache_scale).
template <typename T, typename Traits, typename Variant, DecodePass kPass, bool kScoresIn = false,
          bool kFp8Cache = false>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocks)
    decode_kernel(const AttnParams p, const DecodeSplits sp) {
  constexpr int D = Traits::kD;
  constexpr int DV = Traits::kDV;
  constexpr int kThreads = Traits::kThreads;
  constexpr int kRowWarps = Traits::kRowWarps;
  using Mod = typename Variant::Mod;
  using Transform = typename Variant::Transform;
  static_assert(Variant::kNormalized == (kPass == DecodePass::kOnline),
                "a normalised transform runs the online pass, any other the lse and weight passes");
  constexpr bool kLoadV = kPass != DecodePass::kLse;
  constexpr int BN = Traits::kBlockN;
  constexpr int kRows = Traits::kRows;
  constexpr int kKeyWarps = Traits::kKeyWarps;
  constexpr int kWarpKeys = Traits::kWarpKeys;
  static_assert(!kScoresIn || (kPass == DecodePass::kWeights && Traits::kCanCacheScores),
                "cached scores feed the weight pass");
  // A stage holds the tile's K (or its cached scores) and V; a pass that loads less (the lse
  // pass: K alone; the weight pass over cached scores: the scores and V) packs more stages into
  // the same shared memory, so that as many bytes are in flight as in the online pass (with
  // half-empty stages each pass streamed the cache below the online pass's rate).
  static_assert(!kFp8Cache || (kPass == DecodePass::kOnline && D == DV),
                "an 8-bit cache feeds the online pass of full-width keys");
  // Cache elements as stored: q's 16-bit type, or e4m3 bytes.
  using CacheElem = std::conditional_t<kFp8Cache, uint8_t, T>;
  constexpr int kElemBytes = static_cast<int>(sizeof(CacheElem));
  constexpr int kKeyAreaElems = kScoresIn ? kRows * Traits::kScoreStride * 2 : BN * D;
  constexpr int kStageElems = kKeyAreaElems + (kLoadV ? BN * DV : 0);
  constexpr int kPackedStages = Traits::kStagesBytes / (kStageElems * kElemBytes);
  constexpr int kStages = kFp8Cache                       ? decode_fp8_stages<Traits>()
                          : kPackedStages > Traits::kStages ? kPackedStages
                                                            : Traits::kStages;
  static_assert(kStages >= 2, "two stages at least");
  static_assert(kStages * kStageElems * kElemBytes + (kFp8Cache ? BN * (D + DV) * 2 : 0) <=
                    Traits::kStagesBytes,
                "stages (and the dequantised tile) fit");
  static_assert(kKeyAreaElems * kElemBytes % 128 == 0, "stage areas stay 128-byte aligned");
  constexpr int NT = kWarpKeys / 8;
  constexpr int DT = DV / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  CacheElem* sStages = reinterpret_cast<CacheElem*>(sQ + kRows * D);
  // 8-bit cache: the dequantised tile (K, then V, swizzled as a 16-bit stage) and the stages'
  // scales (k, v).
  T* const sTile = reinterpret_cast<T*>(sStages + kStages * kStageElems);
  float* const sScales = reinterpret_cast<float*>(sTile + BN * (D + DV));

  const int b = blockIdx.x / p.heads_kv, h_kv = blockIdx.x % p.heads_kv;
  const int row0 = blockIdx.y * kRows;
  const int split = blockIdx.z;
  const int group = p.heads_q / p.heads_kv;
  const int rows = group * p.len_q;
  const SeqLens lens = seq_lens(p, b);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2;
  const int row_warp = warp % kRowWarps, key_warp = warp / kRowWarps;
  const int warp_row0 = row_warp * 16;
  RowRanges<1> rr;
  int row_head[2], row_pos[2];  // this thread's rows: query head and position
  float row_term[2], lse2[2];   // kWeights: the transform's c_i and the log2-domain lse
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = row0 + warp_row0 + g + 8 * hh;
    const int q_row = row % p.len_q;
    const KeyRange r = row < rows ? key_range(p, lens, q_row) : KeyRange{0, 0};
    rr.lo[0][hh] = r.lo;
    rr.hi[0][hh] = r.hi;
    row_head[hh] = h_kv * group + (row < rows ? row / p.len_q : 0);
    row_pos[hh] = row_position(lens, q_row);
    if constexpr (kPass == DecodePass::kWeights) {
      row_term[hh] = Transform::template row_term<float>(p, row_head[hh], row_pos[hh]);
      const float lse = row < rows ? p.lse[(static_cast<int64_t>(b) * p.heads_q + row_head[hh]) *
                                               p.len_q + q_row]
                                   : -INFINITY;
      lse2[hh] = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
    }
  }

  // Keys that every real row of the warp sees: a warp slice inside them needs no element mask
  // (padding rows of the last 16-row group are never written, whatever they compute).
  int all_lo = 0, all_hi = INT_MAX;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    if (row0 + warp_row0 + g + 8 * hh < rows) {
      all_lo = max(all_lo, rr.lo[0][hh]);
      all_hi = min(all_hi, rr.hi[0][hh]);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    all_lo = max(all_lo, __shfl_xor_sync(0xffffffff, all_lo, off));
    all_hi = min(all_hi, __shfl_xor_sync(0xffffffff, all_hi, off));
  }

  // This split's key tiles: of the tiles the query rows' ranges cover (every head of the
  // group shares them), the split's share.
  const KeyRange keys = tile_key_range(p, lens, 0, p.len_q);
  const int first = keys.lo / BN + split * sp.tiles_per_split;
  const int end_tile = keys.hi > keys.lo ? (keys.hi + BN - 1) / BN : 0;
  const int last = min(first + sp.tiles_per_split, end_tile);

  // Each thread copies the same kRowsPerThread rows of every K and V tile; their blocks (pages)
  // are looked up one tile ahead and first used (clamped) when that tile is loaded, so the
  // lookups' latency hides behind a tile's compute.
  constexpr int kPerThread = Traits::kRowsPerThread;
  // 8-bit cache, one row warp (each warp's products read only its own 16 keys of a tile): each
  // warp copies and dequantises its own 16 rows, so its stages and its rows of the dequantised
  // tile are its own, and the mainloop needs no CTA barrier (warp barriers only).
  constexpr bool kWarpRows = kFp8Cache && kRowWarps == 1 && kWarpKeys == 16;
  constexpr int kRowStep = (kWarpRows ? 32 : kThreads) / Traits::kChunksPerRow;
  static_assert(!kWarpRows || kPerThread * kRowStep == kWarpKeys, "a warp copies its own keys");
  const int my_row = kWarpRows ? warp * kWarpKeys + lane / Traits::kChunksPerRow
                               : tid / Traits::kChunksPerRow;
  const int my_col = ((kWarpRows ? lane : tid) % Traits::kChunksPerRow) * 8;
  // The stage's scales (k, v): one pair per stage, or per warp and stage (kWarpRows).
  auto scale_slot = [&](int stage) {
    return sScales + 2 * (kWarpRows ? warp * kStages + stage : stage);
  };
  int blocks[kPerThread];
  // A page of BN keys or more (a power of two) holds whole tiles: one lookup per tile.
  const bool tile_pages = p.block_table == nullptr || (p.page_shift >= 0 && p.page_size >= BN);
  auto lookup = [&](int tile) {
    if (tile_pages) {
      const int block = cache_block_raw(p, b, tile * BN < lens.k ? tile * BN : 0);
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) blocks[i] = block;
      return;
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int j = tile * BN + my_row + i * kRowStep;
      blocks[i] = cache_block_raw(p, b, j < lens.k ? j : 0);
    }
  };
  // The weight pass over cached scores loads them (into the K area) instead of K.
  constexpr bool kScoreCache = kPass != DecodePass::kOnline && Traits::kCanCacheScores;
  const bool cached = kScoreCache && sp.scores != nullptr;
  const int64_t scores_row0 =
      ((static_cast<int64_t>(b) * p.heads_kv + h_kv) * rows + row0) * sp.scores_stride;
  auto load_stage = [&](int tile, int stage) {
    CacheElem* sK = sStages + stage * kStageElems;
    CacheElem* sV = sK + kKeyAreaElems;
    if constexpr (kScoresIn) {
      float* sS = reinterpret_cast<float*>(sK);
      constexpr int kChunks = kRows * BN / 4;
#pragma unroll
      for (int c = tid; c < kChunks; c += kThreads) {
        const int r = c / (BN / 4), col = (c % (BN / 4)) * 4;
        const bool valid = row0 + r < rows;
        cp_async16(sS + r * Traits::kScoreStride + col,
                   sp.scores + scores_row0 + (valid ? r * sp.scores_stride : 0) + tile * BN + col,
                   valid);
      }
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int r = my_row + i * kRowStep;
      const int j = tile * BN + r;
      const bool valid = j < lens.k;
      const int jj = valid ? j : 0;
      const int block = clamp_block(p, blocks[i]);
      const CacheElem* k_src = static_cast<const CacheElem*>(p.k) +
                               cache_offset(p, block, p.k_batch_stride, p.k_head_stride,
                                            p.k_row_stride, h_kv, jj) + my_col;
      const CacheElem* v_src = static_cast<const CacheElem*>(p.v) +
                               cache_offset(p, block, p.v_batch_stride, p.v_head_stride,
                                            p.v_row_stride, h_kv, jj) + my_col;
      if constexpr (kFp8Cache) {
        // Plain rows of bytes: the thread that copies a chunk dequantises it (convert_stage).
        cp_async8(sK + r * D + my_col, k_src, valid);
        cp_async8(sV + r * DV + my_col, v_src, valid);
      } else {
        if (!kScoresIn && (D == DV || my_col < D)) {
          cp_async16(sK + swz<D>(r, my_col), k_src, valid);
        }
        if constexpr (kLoadV) cp_async16(sV + swz<DV>(r, my_col), v_src, valid);
      }
    }
    if constexpr (kFp8Cache) {
      // Pages hold whole tiles (the host requires it): one scale pair per tile.
      if ((kWarpRows ? lane : tid) == 0) {
        const int64_t at = static_cast<int64_t>(clamp_block(p, blocks[0])) * p.heads_kv + h_kv;
        cp_async4(scale_slot(stage), p.k_cache_scale + at, true);
        cp_async4(scale_slot(stage) + 1, p.v_cache_scale + at, true);
      }
    }
  };
  // 8-bit cache: this thread's chunks of a landed stage, dequantised into sTile (after a
  // barrier, of the CTA or kWarpRows of the warp, that ends the previous tile's products and
  // makes the scales visible).
  auto convert_stage = [&](int stage) {
    const uint8_t* k8 = reinterpret_cast<const uint8_t*>(sStages + stage * kStageElems);
    const uint8_t* v8 = k8 + BN * D;
    const float k_scale = scale_slot(stage)[0], v_scale = scale_slot(stage)[1];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int r = my_row + i * kRowStep;
      *reinterpret_cast<uint4*>(sTile + swz<D>(r, my_col)) = dequantize_e4m3x8<T>(
          *reinterpret_cast<const uint2*>(k8 + r * D + my_col), k_scale);
      *reinterpret_cast<uint4*>(sTile + BN * D + swz<DV>(r, my_col)) = dequantize_e4m3x8<T>(
          *reinterpret_cast<const uint2*>(v8 + r * DV + my_col), v_scale);
    }
  };

  load_rows_async<kRows, D, kThreads>(sQ, [&](int r) {
    const int row = row0 + r;
    return static_cast<const T*>(p.q) + b * p.q_batch_stride +
           (h_kv * group + row / p.len_q) * p.q_head_stride + (row % p.len_q) * p.q_row_stride;
  }, rows - row0, tid);
  lookup(first);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (first + s < last) {
      load_stage(first + s, s);
      lookup(first + s + 1);
    }
    cp_async_commit();
  }

  float o[1][DT][4];
  zero(o);
  float row_max[1][2] = {{-INFINITY, -INFINITY}};
  float row_sum[1][2] = {{0.f, 0.f}};
  for (int tile = first; tile < last; ++tile) {
    const int i = tile - first;
    cp_async_wait<kStages - 2>();
    // The first tile's barrier also makes Q, which every warp copied a part of, visible.
    if (kWarpRows && tile != first) {
      __syncwarp();
    } else {
      __syncthreads();
    }
    if (tile + kStages - 1 < last) {
      load_stage(tile + kStages - 1, (i + kStages - 1) % kStages);
      lookup(tile + kStages);
    }
    cp_async_commit();
    const T* sK;
    const T* sV;
    if constexpr (kFp8Cache) {
      convert_stage(i % kStages);
      if constexpr (kWarpRows) {
        __syncwarp();
      } else {
        __syncthreads();
      }
      sK = sTile;
      sV = sTile + BN * D;
    } else {
      sK = sStages + (i % kStages) * kStageElems;
      sV = sK + kKeyAreaElems;
    }

    float s[1][NT][4];
    const int n0 = tile * BN + key_warp * kWarpKeys;
    float scale = p.scale_log2;
    if constexpr (kScoresIn) {
      const float* sS = reinterpret_cast<const float*>(sK);
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const float2 v = *reinterpret_cast<const float2*>(
              sS + (warp_row0 + g + 8 * hh) * Traits::kScoreStride + key_warp * kWarpKeys +
              ni * 8 + 2 * (lane & 3));
          s[0][ni][2 * hh] = v.x;
          s[0][ni][2 * hh + 1] = v.y;
        }
      scale = 1.f;
    } else {
      zero(s);
      warp_gemm_nt<1, NT, D>(s, sQ, warp_row0, sK, key_warp * kWarpKeys, lane);
      if constexpr (Mod::kFoldsScale) {
        scale = Mod::modify_raw_frag(s, p);
      } else if constexpr (Mod::kPositional) {
        const float x_scale = static_cast<float>(p.scale);
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int hh = e >> 1, j = n0 + ni * 8 + 2 * (lane & 3) + (e & 1);
            s[0][ni][e] = Mod::apply(p, b, row_head[hh], row_pos[hh], j, s[0][ni][e] * x_scale) *
                          float(M_LOG2E);
          }
        scale = 1.f;
      } else if (!Mod::kIdentity || !(scale > 0.f)) {
        scale_frag(s, scale);
        modify_scores<Mod, false>(s, p, lens, b, h_kv * group, 0, n0, lane);
        scale = 1.f;
      }
      if (!(n0 >= all_lo && n0 + kWarpKeys <= all_hi)) mask_scores(s, rr, n0, lane);
      if (kPass == DecodePass::kLse && cached) {
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int r = warp_row0 + g + 8 * hh;
            if (row0 + r < rows) {
              *reinterpret_cast<float2*>(sp.scores + scores_row0 + r * sp.scores_stride + n0 +
                                         ni * 8 + 2 * (lane & 3)) =
                  make_float2(s[0][ni][2 * hh] * scale, s[0][ni][2 * hh + 1] * scale);
            }
          }
      }
    }
    if constexpr (kPass == DecodePass::kWeights) {
      WeightStats unused;
      const float lse2_frag[1][2] = {{lse2[0], lse2[1]}};
      const float c_frag[1][2] = {{row_term[0], row_term[1]}};
      const bool any =
          transform_weights<Transform, 1, NT, false>(s, lse2_frag, c_frag, unused, scale).any;
      if (any) {
        uint32_t pa[1][NT / 2][4];
        to_a_frags<1, NT, T>(s, pa);
        warp_gemm_rs<1, DT, NT / 2, DV>(o, pa, sV, key_warp * kWarpKeys, lane);
      }
      continue;
    }
    // The running max may stay up to kMaxSlack (log2 units) below the true one, so O is
    // rescaled only when it grows by more (as the Hopper forward, fwd_sm90.h).
    constexpr float kMaxSlack = 8.f;
    float corr[1][2];
    online_softmax<true>(s, row_max, row_sum, corr, scale, kMaxSlack);
    if constexpr (kPass == DecodePass::kOnline) {
      if (__any_sync(0xffffffff, corr[0][0] != 1.f || corr[0][1] != 1.f)) {
#pragma unroll
        for (int di = 0; di < DT; ++di)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[0][di][e] *= corr[0][e >> 1];
      }
      uint32_t pa[1][NT / 2][4];
      to_a_frags<1, NT, T>(s, pa);
      warp_gemm_rs<1, DT, NT / 2, DV>(o, pa, sV, key_warp * kWarpKeys, lane);
    }
  }
  cp_async_wait_all();
  __syncthreads();  // Q and the stages become the merge buffers

  // Merge the key warps: per row the max M and sum L over warps; each warp's O rescaled by
  // exp2(m_w - M) / L (kWeights: as it is), then summed.
  float* sMax = reinterpret_cast<float*>(smem_raw);
  float* sSum = sMax + kKeyWarps * kRows;
  float* sO = sSum + kKeyWarps * kRows;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float l = row_sum[0][hh];
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    row_sum[0][hh] = l;
    if ((lane & 3) == 0) {
      const int r = warp_row0 + g + 8 * hh;
      sMax[key_warp * kRows + r] = row_max[0][hh];
      sSum[key_warp * kRows + r] = l;
    }
  }
  __syncthreads();
  auto row_stats = [&](int r, float& m, float& l) {
    m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kKeyWarps; ++w) m = fmaxf(m, sMax[w * kRows + r]);
    // A warp whose scores were all NaN keeps max -inf and sum NaN: its NaN still reaches l.
    const float base = m == -INFINITY ? 0.f : m;
    l = 0.f;
#pragma unroll
    for (int w = 0; w < kKeyWarps; ++w) {
      const float lw = sSum[w * kRows + r];
      if (row_saw_keys(lw)) l += lw * exp2f(sMax[w * kRows + r] - base);
    }
  };
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    if constexpr (kPass == DecodePass::kLse) break;
    const int r = warp_row0 + g + 8 * hh;
    float m, l;
    row_stats(r, m, l);
    const float f = kPass == DecodePass::kWeights ? 1.f
                    : row_saw_keys(row_sum[0][hh]) ? exp2f(row_max[0][hh] - m) / l
                                                  : 0.f;
#pragma unroll
    for (int di = 0; di < DT; ++di) {
      const int col = di * 8 + 2 * (lane & 3);
      float* dst = sO + (key_warp * kRows + r) * DV + col;
      dst[0] = o[0][di][2 * hh] * f;
      dst[1] = o[0][di][2 * hh + 1] * f;
    }
  }
  __syncthreads();

  const int valid_rows = min(kRows, rows - row0);
  if constexpr (kPass == DecodePass::kLse) {
    for (int r = tid; r < valid_rows; r += kThreads) {
      const int row = row0 + r;
      const int h = h_kv * group + row / p.len_q, q_row = row % p.len_q;
      const int64_t stat = (static_cast<int64_t>(b) * p.heads_q + h) * p.len_q + q_row;
      float m, l;
      row_stats(r, m, l);
      const float lse = row_saw_keys(l) ? (m + log2f(l)) * float(M_LN2) : -INFINITY;
      if (sp.num_splits == 1) {
        p.lse[stat] = lse;
      } else {
        sp.lse_part[static_cast<int64_t>(split) * p.batch * p.heads_q * p.len_q + stat] = lse;
      }
    }
  } else {
    for (int idx = tid; idx < valid_rows * DV; idx += kThreads) {
      const int r = idx / DV, col = idx % DV;
      float acc = 0.f;
#pragma unroll
      for (int w = 0; w < kKeyWarps; ++w) acc += sO[(w * kRows + r) * DV + col];
      const int row = row0 + r;
      const int h = h_kv * group + row / p.len_q, q_row = row % p.len_q;
      const int64_t stat = (static_cast<int64_t>(b) * p.heads_q + h) * p.len_q + q_row;
      float lse = 0.f;
      if (kPass == DecodePass::kOnline && col == 0) {
        float m, l;
        row_stats(r, m, l);
        lse = row_saw_keys(l) ? (m + log2f(l)) * float(M_LN2) : -INFINITY;
      }
      if (sp.num_splits == 1) {
        T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride +
                 q_row * p.o_row_stride;
        out[col] = from_float<T>(acc);
        if (kPass == DecodePass::kOnline && col == 0) p.lse[stat] = lse;
      } else {
        const int64_t part = static_cast<int64_t>(split) * p.batch * p.heads_q * p.len_q + stat;
        sp.o_part[part * DV + col] = acc;
        if (kPass == DecodePass::kOnline && col == 0) sp.lse_part[part] = lse;
      }
    }
  }
}

// Merges the splits' partial results of every row (b, h, r), one warp per row. kOnline: outputs
// weighted by their lse (splits that saw no key of the row, lse -inf, are skipped; a row no
// split saw gets out 0 and lse -inf). kLse: the lse alone. kWeights: outputs summed.
template <typename T, int DV, DecodePass kPass>
__global__ void __launch_bounds__(128) decode_combine_kernel(const AttnParams p,
                                                             const DecodeSplits sp) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads_q * p.len_q;
  const int64_t stat = static_cast<int64_t>(blockIdx.x) * 4 + threadIdx.x / 32;
  if (stat >= rows) return;
  const int lane = threadIdx.x % 32;
  float lse = 0.f;
  if constexpr (kPass != DecodePass::kWeights) {
    float m = -INFINITY;
    for (int s = lane; s < sp.num_splits; s += 32) m = fmaxf(m, sp.lse_part[s * rows + stat]);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, off));
    // Splits that saw no key add exp(-inf) = 0; a NaN lse makes the row's NaN.
    const float base = m == -INFINITY ? 0.f : m;
    float sum = 0.f;
    for (int s = lane; s < sp.num_splits; s += 32) sum += expf(sp.lse_part[s * rows + stat] - base);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
    lse = row_saw_keys(sum) ? base + logf(sum) : -INFINITY;
    if (lane == 0) p.lse[stat] = lse;
    if constexpr (kPass == DecodePass::kLse) return;
  }

  constexpr int kCols = (DV + 31) / 32;
  float acc[kCols] = {};
  for (int s = 0; s < sp.num_splits; ++s) {
    float w = 1.f;
    if constexpr (kPass == DecodePass::kOnline) {
      const float ls = sp.lse_part[s * rows + stat];
      if (ls == -INFINITY) continue;
      w = expf(ls - lse);
    }
    const float* o = sp.o_part + (s * rows + stat) * DV;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      if (lane + 32 * c < DV) acc[c] += w * o[lane + 32 * c];
    }
  }
  const int b = static_cast<int>(stat / (static_cast<int64_t>(p.heads_q) * p.len_q));
  const int h = static_cast<int>(stat / p.len_q % p.heads_q);
  const int q_row = static_cast<int>(stat % p.len_q);
  T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride +
           q_row * p.o_row_stride;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    if (lane + 32 * c < DV) out[lane + 32 * c] = from_float<T>(acc[c]);
  }
}

}  // namespace tc
}  // namespace adaattn
