// Split-KV decode (flash-decoding) on mma.sync tensor cores, for SM80 and Hopper alike (64-row
// CTAs run their products as wgmma on Hopper: DecodeTraits::kGmma): decode is bound by
// reading the KV cache, not by the products. One CTA per (sequence, kv head, row
// block, key split). Its rows are the query rows of every query head of the kv head's GQA group
// (group * Lq rows, head-major), so each K/V byte is read once per split. The warps split the
// rows 16 at a time (kRowWarps) and each tile's keys between them (kKeyWarps), each keeping its
// own softmax state; K/V tiles stream through a cp.async pipeline, rows fetched one by one so a
// paged cache costs only its block-table lookups. Warps merge their states through shared
// memory; with several splits each writes a partial result and decode_combine_kernel merges them.
//
// A normalised transform runs one online pass (DecodePass::kOnline). Any other needs the row's
// finished lse before its weights: an lse pass over K (kLse, merged over splits by their lse),
// then a weight pass over K and V (kWeights, whose splits' partial outputs simply add up); at
// one split both run in one kernel (decode_lse_weights_kernel).
// A positional score modifier is applied per score with each row's head and position (the rows
// of a warp mix heads).
// An 8-bit paged cache has a mainloop of its own (decode_fp8.h).
#pragma once

#include <climits>
#include <cmath>
#include <type_traits>

#include "../../core/mask.h"
#include "../../core/params.h"
#include "mma.h"
#include "pdl.h"
#include "softmax_frag.h"
#include "wgmma.h"

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

// kStages_: the fewest stages of any pass; kStageBytes_ (0: kStages_ whole K + V stages): the
// shared memory a pass packs with as many of its stages as fit (decode_stages). kGmma_: one
// warpgroup (four row warps, 64 rows) whose products are Hopper wgmma reading Q, K and V in
// shared memory (sm_90a; launched only where tc::use_sm90()), else mma.sync per warp.
template <int D, int DV, int kRowWarps_, int kKeyWarps_, int kBlockN_, int kStages_,
          int kMinBlocks_ = 1, int kStageBytes_ = 0, bool kGmma_ = false>
struct DecodeTraits {
  static constexpr bool kGmma = kGmma_;
  static_assert(!kGmma || (kRowWarps_ == 4 && kKeyWarps_ == 1 && D == DV && D % 64 == 0 &&
                           (kBlockN_ == 32 || kBlockN_ == 64 || kBlockN_ == 128)),
                "wgmma decode: one warpgroup of 64 rows, D = Dv a multiple of 64");
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
  static constexpr int kStagesBytes = kStageBytes_ > 0 ? kStageBytes_ : kStages * kStageElems * 2;
  static constexpr int kMergeBytes = kKeyWarps * kRows * (DV + 2) * 4;
  static constexpr int kSmemBytes = kQBytes + kStagesBytes;
  static_assert(kMergeBytes <= kSmemBytes, "merge buffers fit in shared memory");
};

// Element offset of (row, col) in a [ROWS][W] shared tile of the decode kernel: the mma.sync
// kernels' swizzle, or the layout wgmma reads (its column blocks of 64, the same swizzle).
template <bool kGmma, int ROWS, int W>
__device__ __forceinline__ int decode_tile_off(int row, int col) {
  if constexpr (kGmma) {
    return sm90::gmma_off<ROWS, W>(row, col);
  } else {
    return swz<W>(row, col);
  }
}

// Where key j of entry b lives: its page as the block table says (paged cache; may be out of
// range, see clamp_block) or b.
__device__ __forceinline__ int cache_block_raw(const AttnParams& p, int b, int j) {
  if (p.block_table == nullptr) return b;
  const int index = p.page_shift >= 0 ? j >> p.page_shift : j / p.page_size;
  return p.block_table[b * p.block_table_stride + index];
}
// A page of the block table clamped into the page pool (a bad table entry reads a wrong page,
// never out of bounds).
__device__ __forceinline__ int clamp_page(const AttnParams& p, int page) {
  return min(max(page, 0), p.num_pages - 1);
}
// A block of cache_block_raw clamped into the page pool.
__device__ __forceinline__ int clamp_block(const AttnParams& p, int block) {
  return p.block_table == nullptr ? block : clamp_page(p, block);
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

// Keys of a tile segment: a page of a power of two >= kDecodeSegmentKeys keys holds whole
// segments of every tile.
constexpr int kDecodeSegmentKeys = 64;

// Element offset of the first cache row of the tile segment starting at key `key0` (clamped
// into the sequence) of kv head h, when the segment lies in one block (contiguous cache, or
// pages of whole segments: page_shift >= 0); its rows follow at row_stride. One address per
// segment instead of one per row: the per-row block and slot arithmetic (64-bit products,
// branches) made a paged cache 1.3x a contiguous one at the same addresses (H200).
__device__ __forceinline__ int64_t tile_offset(const AttnParams& p, int block,
                                               int64_t batch_stride, int64_t head_stride,
                                               int64_t row_stride, int h, int key0) {
  const int slot = p.block_table == nullptr ? key0 : key0 & (p.page_size - 1);
  return block * batch_stride + h * head_stride + slot * row_stride;
}

// The key tiles [x, y) of kBlockN keys that split `split` of a CTA takes: of the tiles the query
// rows' ranges cover (every head of a GQA group shares them), the split's share.
template <int kBlockN>
__device__ __forceinline__ int2 split_key_tiles(const AttnParams& p, const SeqLens& lens,
                                                const DecodeSplits& sp, int split) {
  const KeyRange keys = tile_key_range(p, lens, 0, p.len_q);
  const int first = keys.lo / kBlockN + split * sp.tiles_per_split;
  const int end_tile = keys.hi > keys.lo ? (keys.hi + kBlockN - 1) / kBlockN : 0;
  return make_int2(first, min(first + sp.tiles_per_split, end_tile));
}

// The max and the sum of x over the 8 lanes that hold one column of a key-major (S^T) tile:
// lanes g = 0..7 of the same c (4 apart).
__device__ __forceinline__ float key_column_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 16));
}
__device__ __forceinline__ float key_column_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 4);
  x += __shfl_xor_sync(0xffffffff, x, 8);
  return x + __shfl_xor_sync(0xffffffff, x, 16);
}

// Row r's max m and sum l (log2 units) merged over the key warps' states in sMax / sSum
// ([kKeyWarps][kRows]), from the state (m0, l0) before the first key. A warp whose scores were
// all NaN keeps max -inf and sum NaN: its NaN still reaches l.
template <int kKeyWarps, int kRows>
__device__ __forceinline__ void merge_warp_stats(const float* sMax, const float* sSum, int r,
                                                 float m0, float l0, float& m, float& l) {
  m = m0;
#pragma unroll
  for (int w = 0; w < kKeyWarps; ++w) m = fmaxf(m, sMax[w * kRows + r]);
  const float base = m == -INFINITY ? 0.f : m;
  l = l0 != 0.f ? l0 * exp2f(m0 - base) : 0.f;
#pragma unroll
  for (int w = 0; w < kKeyWarps; ++w) {
    const float lw = sSum[w * kRows + r];
    if (row_saw_keys(lw)) l += lw * exp2f(sMax[w * kRows + r] - base);
  }
}

// Cache elements of one stage of a pass (decode_kernel): the tile's K (or, kScoresIn, its
// cached scores, [kRows][kScoreStride] float32) and, but in the lse pass, its V.
template <typename Traits, DecodePass kPass, bool kScoresIn>
constexpr int decode_key_area_elems() {
  return kScoresIn ? Traits::kRows * Traits::kScoreStride * 2 : Traits::kBlockN * Traits::kD;
}
template <typename Traits, DecodePass kPass, bool kScoresIn>
constexpr int decode_stage_elems() {
  return decode_key_area_elems<Traits, kPass, kScoresIn>() +
         (kPass != DecodePass::kLse ? Traits::kBlockN * Traits::kDV : 0);
}
// Stages of a pass: as many as Traits::kStagesBytes holds, at least Traits::kStages. A pass
// that loads less (the lse pass: K alone; the weight pass over cached scores: the scores and
// V) so keeps as many bytes in flight as the online pass (with half-empty stages each pass
// streamed the cache below the online pass's rate).
template <typename Traits, DecodePass kPass, bool kScoresIn>
constexpr int decode_stages() {
  constexpr int kPacked =
      Traits::kStagesBytes / (decode_stage_elems<Traits, kPass, kScoresIn>() * 2);
  return kPacked > Traits::kStages ? kPacked : Traits::kStages;
}
// Shared memory of a pass: Q and the stages, with wgmma tiles' alignment slack, or the merge
// buffers if larger.
template <typename Traits, DecodePass kPass, bool kScoresIn>
constexpr int decode_smem_bytes() {
  constexpr int kStages = decode_stages<Traits, kPass, kScoresIn>();
  constexpr int kBytes = Traits::kQBytes +
                         kStages * decode_stage_elems<Traits, kPass, kScoresIn>() * 2 +
                         (Traits::kGmma ? 1024 : 0);
  return kBytes > Traits::kMergeBytes ? kBytes : Traits::kMergeBytes;
}

// The CTA's rows once its key warps are merged: each valid row's output (or, with several
// splits, the split's partial output and lse), the sum over the warps' scaled outputs in sO
// ([kKeyWarps][kRows][kStride] float32, row r of the CTA is query row row0 + r of its kv
// head's group); kWithLse: lse_of(r), the row's natural-log lse, goes out beside it.
template <typename T, int DV, int kKeyWarps, int kRows, int kStride, int kThreads, bool kWithLse,
          typename LseOf>
__device__ __forceinline__ void store_decode_rows(const AttnParams& p, const DecodeSplits& sp,
                                                  const float* sO, int valid_rows, int row0,
                                                  int b, int h_kv, int group, int split, int tid,
                                                  LseOf&& lse_of) {
  for (int idx = tid; idx < valid_rows * DV; idx += kThreads) {
    const int r = idx / DV, col = idx % DV;
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < kKeyWarps; ++w) acc += sO[(w * kRows + r) * kStride + col];
    const int row = row0 + r;
    const int h = h_kv * group + row / p.len_q, q_row = row % p.len_q;
    const int64_t stat = (static_cast<int64_t>(b) * p.heads_q + h) * p.len_q + q_row;
    const bool with_lse = kWithLse && col == 0;
    const float lse = with_lse ? lse_of(r) : 0.f;
    if (sp.num_splits == 1) {
      T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride +
               q_row * p.o_row_stride;
      out[col] = from_float<T>(acc);
      if (with_lse) p.lse[stat] = lse;
    } else {
      const int64_t part = static_cast<int64_t>(split) * p.batch * p.heads_q * p.len_q + stat;
      sp.o_part[part * DV + col] = acc;
      if (with_lse) sp.lse_part[part] = lse;
    }
  }
}

// The decode kernel writes the rows a call appends (p.k_new, p.v_new) where each of the first
// kAppendChunkThreads threads of a CTA takes at most one 16-byte chunk of them (a decode step's
// few rows: Lq * (D + Dv) / 8 chunks); the launcher runs append_kernel ahead of it otherwise.
constexpr int kAppendChunkThreads = 128;

// One thread's chunk of the appended rows: 16 bytes of a new K or V row and its cache address
// (null: the thread has none).
struct AppendChunk {
  uint4 value;
  void* dst;
};

// Thread tid's chunk of the appended rows of kv head h of entry b at positions in
// [key_lo, key_hi): row tid / ((D + Dv) / 8), its K chunks first, then its V chunks.
template <int D, int DV>
__device__ __forceinline__ AppendChunk load_append_chunk(const AttnParams& p, int b, int h,
                                                         const SeqLens& lens, int key_lo,
                                                         int key_hi, int tid) {
  constexpr int kKChunks = D / 8, kRowChunks = (D + DV) / 8;
  AppendChunk c{make_uint4(0, 0, 0, 0), nullptr};
  const int cached = p.cache_seqlens[b];
  const int r = tid / kRowChunks, chunk = tid % kRowChunks;
  const int pos = cached + r;
  if (tid >= kAppendChunkThreads || cached < 0 || r >= p.cache_appended || pos < key_lo ||
      pos >= key_hi || pos >= lens.k) {
    return c;
  }
  const int block = cache_block(p, b, pos);
  const bool is_k = chunk < kKChunks;
  const int col = (is_k ? chunk : chunk - kKChunks) * 8;
  const uint16_t* src =
      is_k ? static_cast<const uint16_t*>(p.k_new) + b * p.k_new_batch_stride +
                 h * p.k_new_head_stride + r * p.k_new_row_stride
           : static_cast<const uint16_t*>(p.v_new) + b * p.v_new_batch_stride +
                 h * p.v_new_head_stride + r * p.v_new_row_stride;
  uint16_t* dst =
      is_k ? static_cast<uint16_t*>(const_cast<void*>(p.k)) +
                 cache_offset(p, block, p.k_batch_stride, p.k_head_stride, p.k_row_stride, h, pos)
           : static_cast<uint16_t*>(const_cast<void*>(p.v)) +
                 cache_offset(p, block, p.v_batch_stride, p.v_head_stride, p.v_row_stride, h, pos);
  c.value = *reinterpret_cast<const uint4*>(src + col);
  c.dst = dst + col;
  return c;
}

__device__ __forceinline__ void store_append_chunk(const AppendChunk& c) {
  if (c.dst != nullptr) *static_cast<uint4*>(c.dst) = c.value;
}

// O^T += V^T P^T over a warp's 16 keys of a tile (key-major passes): b0, b1 are P^T's
// B-fragments (lane (g, c): keys 2c, 2c + 1 and 2c + 8, 2c + 9 of the warp's, query row g);
// V^T's A-fragments come by transposing loads, lanes 8m.. addressing matrix m = (keys
// warp_key0 + 8 (m / 2).., value columns 16t + 8 (m % 2)..) of the stage sV.
template <typename T, bool kGmma, int BN, int DV>
__device__ __forceinline__ void add_key_major_values(float (&ot)[DV / 16][4], const T* sV,
                                                     int warp_key0, int lane, uint32_t b0,
                                                     uint32_t b1) {
  const int key = warp_key0 + (lane & 7) + ((lane >> 4) << 3);
#pragma unroll
  for (int t = 0; t < DV / 16; ++t) {
    uint32_t a[4];
    const int col = 16 * t + ((lane >> 3) & 1) * 8;
    ldmatrix_x4_trans(a, sV + decode_tile_off<kGmma, BN, DV>(key, col));
    MmaOp<T>::run(ot[t], a, b0, b1);
  }
}

// The most rows (query heads of a kv head times new tokens) a key-major pass takes: the 8
// columns of one mma n-tile.
constexpr int kKeyMajorMaxRows = 8;

// Whether a pass has the key-major form (decode_pass's kKeyMajor): the online pass, the lse
// pass, or the weight pass over its cached scores, of one row warp with 16 keys a warp, under no
// or a positional score modifier.
template <typename Traits, typename Variant, DecodePass kPass, bool kScoresIn>
constexpr bool decode_has_key_major() {
  using Mod = typename Variant::Mod;
  return (kPass != DecodePass::kWeights || kScoresIn) && Traits::kRowWarps == 1 &&
         !Traits::kGmma && Traits::kWarpKeys == 16 && (Mod::kIdentity || Mod::kPositional) &&
         !Mod::kFoldsScale;
}

// One pass of the decode kernel by the whole CTA (Traits::kThreads threads).
// kScoresIn: the weight pass reads the scores the lse pass cached (DecodeSplits::scores)
// instead of K.
// kKeyMajor: the online pass, the lse pass, or the weight pass over its cached scores, of one
// row warp over at most kKeyMajorMaxRows rows, key-major: S^T = K Q^T and O^T = V^T P^T with
// the warp's 16 keys as mma rows and the query rows as the 8 columns of one n-tile, half the
// products, exponentials and score modifications of 16 padded rows.
template <typename T, typename Traits, typename Variant, DecodePass kPass, bool kScoresIn,
          bool kKeyMajor = false>
__device__ __forceinline__ void decode_pass(const AttnParams& p, const DecodeSplits& sp) {
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
  static_assert(!kKeyMajor || decode_has_key_major<Traits, Variant, kPass, kScoresIn>(),
                "key-major: the online or lse pass or the weight pass over cached scores, one "
                "row warp, 16 keys a warp, positional modifiers");
  // A stage (decode_stages) holds the tile's K (or its cached scores) and, but in the lse
  // pass, its V.
  constexpr int kKeyAreaElems = decode_key_area_elems<Traits, kPass, kScoresIn>();
  constexpr int kStageElems = decode_stage_elems<Traits, kPass, kScoresIn>();
  constexpr int kStages = decode_stages<Traits, kPass, kScoresIn>();
  static_assert(kStages >= 2, "two stages at least");
  static_assert(kKeyAreaElems * 2 % 128 == 0, "stage areas stay 128-byte aligned");
  constexpr int NT = kWarpKeys / 8;
  constexpr int DT = DV / 8;
  constexpr bool kGmma = Traits::kGmma;
  static_assert(!kGmma || (Traits::kQBytes % 1024 == 0 &&
                           kKeyAreaElems * 2 % 1024 == 0 && kStageElems * 2 % 1024 == 0),
                "wgmma tiles start 1024-byte aligned");
  auto k_off = [](int r, int col) { return decode_tile_off<kGmma, BN, D>(r, col); };
  auto v_off = [](int r, int col) { return decode_tile_off<kGmma, BN, DV>(r, col); };
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // wgmma's 128-byte swizzle is a function of address bits 4-9: its tiles start 1024-byte
  // aligned (decode_smem_bytes adds the slack).
  T* sQ = reinterpret_cast<T*>(
      kGmma ? smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023) : smem_raw);
  T* sStages = sQ + kRows * D;

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

  const int2 tiles = split_key_tiles<BN>(p, lens, sp, split);
  const int first = tiles.x, last = tiles.y;
  // The rows this call appends (p.k_new) that fall in this CTA's tiles: each thread loads its
  // chunk of them now and stores it into the cache before the first tile holding one is copied,
  // at the barrier of the iteration kStages - 1 tiles ahead of it (write_tile), or before the
  // prologue when the prologue copies it. Every CTA that reads such a row writes it itself (CTAs
  // of other row blocks write the same values), so none waits for another; and every appended
  // row lies in some split's tiles: the rows' key range ends at the newest key and starts at or
  // before the oldest new one.
  static_assert(sizeof(T) == 2 && Traits::kThreads >= kAppendChunkThreads,
                "16-bit caches; a chunk for each of the first kAppendChunkThreads threads");
  AppendChunk new_chunk{};
  int write_tile = INT_MAX;
  if (kPass != DecodePass::kWeights && p.k_new != nullptr) {
    new_chunk = load_append_chunk<D, DV>(p, b, h_kv, lens, first * BN, last * BN, tid);
    write_tile = max(first, max(p.cache_seqlens[b], 0) / BN) - (kStages - 1);
  }
  if (write_tile < first) {
    store_append_chunk(new_chunk);
    __syncthreads();
  }

  // Each thread copies the same kRowsPerThread rows of every K and V tile; their blocks (pages)
  // are looked up one tile ahead and first used (clamped) when that tile is loaded, so the
  // lookups' latency hides behind a tile's compute.
  constexpr int kPerThread = Traits::kRowsPerThread;
  constexpr int kRowStep = kThreads / Traits::kChunksPerRow;
  const int my_row = tid / Traits::kChunksPerRow;
  const int my_col = (tid % Traits::kChunksPerRow) * 8;
  // Pages of kDecodeSegmentKeys keys or more (a power of two) hold whole segments of a tile:
  // one lookup per segment (blocks[s]), and a thread's row i lies in segment
  // i * kRowStep / kDecodeSegmentKeys.
  constexpr int kSegments = BN / kDecodeSegmentKeys;
  static_assert(BN % kDecodeSegmentKeys == 0 && kDecodeSegmentKeys % kRowStep == 0 &&
                    kSegments <= kPerThread,
                "a thread's rows keep to their segments");
  int blocks[kPerThread];
  const bool tile_pages =
      p.block_table == nullptr || (p.page_shift >= 0 && p.page_size >= kDecodeSegmentKeys);
  // A segment's first key, or key 0 for a segment past the sequence (whose rows copy nothing).
  auto segment_key = [&](int tile, int segment) {
    const int key = tile * BN + segment * kDecodeSegmentKeys;
    return key < lens.k ? key : 0;
  };
  auto lookup = [&](int tile) {
    if (tile_pages) {
#pragma unroll
      for (int sg = 0; sg < kSegments; ++sg) {
        blocks[sg] = cache_block_raw(p, b, segment_key(tile, sg));
      }
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
    T* sK = sStages + stage * kStageElems;
    T* sV = sK + kKeyAreaElems;
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
    // Rows past the sequence copy nothing; their source is their segment's first row.
    if (tile_pages) {
      const T* k_segment[kSegments];
      const T* v_segment[kSegments];
#pragma unroll
      for (int sg = 0; sg < kSegments; ++sg) {
        const int block = clamp_block(p, blocks[sg]);
        const int key = segment_key(tile, sg);
        k_segment[sg] = static_cast<const T*>(p.k) + my_col +
                        tile_offset(p, block, p.k_batch_stride, p.k_head_stride,
                                    p.k_row_stride, h_kv, key);
        v_segment[sg] = static_cast<const T*>(p.v) + my_col +
                        tile_offset(p, block, p.v_batch_stride, p.v_head_stride,
                                    p.v_row_stride, h_kv, key);
      }
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int sg = i * kRowStep / kDecodeSegmentKeys;
        const int r = my_row + i * kRowStep;
        const bool valid = tile * BN + r < lens.k;
        const int rr = valid ? r - sg * kDecodeSegmentKeys : 0;
        if (!kScoresIn && (D == DV || my_col < D)) {
          cp_async16(sK + k_off(r, my_col), k_segment[sg] + rr * p.k_row_stride, valid);
        }
        if constexpr (kLoadV) {
          cp_async16(sV + v_off(r, my_col), v_segment[sg] + rr * p.v_row_stride, valid);
        }
      }
    } else {
      // Pages smaller than a tile (block_table set): a block and a slot per row, the slot's
      // form (mask or division) chosen once per tile so that the rows' copies stay
      // branch-free.
      const T* k_head =
          static_cast<const T*>(p.k) + h_kv * p.k_head_stride + my_col;
      const T* v_head =
          static_cast<const T*>(p.v) + h_kv * p.v_head_stride + my_col;
      auto copy_rows = [&](auto slot_of) {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
          const int r = my_row + i * kRowStep;
          const int j = tile * BN + r;
          const bool valid = j < lens.k;
          const int jj = valid ? j : 0;
          const int64_t block = clamp_page(p, blocks[i]);
          const int64_t slot = slot_of(jj);
          if (!kScoresIn && (D == DV || my_col < D)) {
            cp_async16(sK + k_off(r, my_col),
                       k_head + block * p.k_batch_stride + slot * p.k_row_stride, valid);
          }
          if constexpr (kLoadV) {
            cp_async16(sV + v_off(r, my_col),
                       v_head + block * p.v_batch_stride + slot * p.v_row_stride, valid);
          }
        }
      };
      if (p.page_shift >= 0) {
        copy_rows([&](int j) { return j & (p.page_size - 1); });
      } else {
        copy_rows([&](int j) { return j % p.page_size; });
      }
    }
  };

  load_rows_async<kRows, D, kThreads>(sQ, [&](int r) {
    const int row = row0 + r;
    return static_cast<const T*>(p.q) + b * p.q_batch_stride +
           (h_kv * group + row / p.len_q) * p.q_head_stride + (row % p.len_q) * p.q_row_stride;
  }, rows - row0, tid, [](int r, int col) { return decode_tile_off<kGmma, kRows, D>(r, col); });
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
  // O += P V over this warp's keys of the tile, P as to_a_frags left it; with wgmma the
  // warpgroup's product (every warp takes part: callers branch uniformly).
  auto accumulate_pv = [&](uint32_t(&pa)[1][NT / 2][4], const T* sV) {
    if constexpr (kGmma) {
      sm90::wgmma_fence();
#pragma unroll
      for (int kt = 0; kt < BN / 16; ++kt) {
        const T* bv = sV + kt * 16 * sm90::GmmaLayout<DV>::kWidth;
        sm90::wgmma_rs_cols<T, DT>(o[0], pa[0][kt], [&](int col) {
          return sm90::gmma_desc_mn<BN, DV>(bv + sm90::gmma_kcol<BN, DV>(col));
        });
      }
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>(o[0]);
      sm90::fence_operand(pa[0]);
    } else {
      warp_gemm_rs<1, DT, NT / 2, DV>(o, pa, sV, key_warp * kWarpKeys, lane);
    }
  };
  float row_max[1][2] = {{-INFINITY, -INFINITY}};
  float row_sum[1][2] = {{0.f, 0.f}};
  // The online pass of one row warp (16 rows) on mma.sync keeps its q rows as A-fragments from
  // the first tile on: every tile's product then reads only K from shared memory (flash decode
  // 0.4-1.0% faster at B = 32 and 128, H200). At D = Dv = 128 only: the registers (D / 4 a
  // thread) would cost D = 64 a CTA per SM, and keys narrower than the values the four CTAs per
  // SM they run at; in the lse and weight passes of a transform that is not normalised the gain
  // was mixed (B = 1 1.3% faster, B = 32 paged 1.6% slower in decode_lse_weights_kernel).
  constexpr bool kQInRegs = kPass == DecodePass::kOnline && !kKeyMajor && !kGmma &&
                            kRowWarps == 1 && D == DV && D >= 128;
  uint32_t qa[1][kQInRegs ? D / 16 : 1][4];
  // kKeyMajor: this lane's S^T columns are rows 2c + e (rows < rows - row0 <= 8): their key
  // ranges, heads, positions and softmax state; q's B-fragments (loaded with the first tile).
  const int c4 = lane & 3;
  int km_lo[2], km_hi[2], km_head[2], km_pos[2];
  float km_max[2] = {-INFINITY, -INFINITY}, km_sum[2] = {0.f, 0.f};
  uint32_t qb[kKeyMajor ? D / 16 : 1][2];
  // kKeyMajor online and weight passes: O^T, m-tile t holding value columns 16t + g (+ 8) of
  // rows 2c, 2c + 1.
  float ot[kKeyMajor && kPass != DecodePass::kLse ? DV / 16 : 1][4] = {};
  if constexpr (kKeyMajor) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = row0 + 2 * c4 + e;
      const int q_row = row % p.len_q;
      const KeyRange r = row < rows ? key_range(p, lens, q_row) : KeyRange{0, 0};
      km_lo[e] = r.lo;
      km_hi[e] = r.hi;
      km_head[e] = h_kv * group + (row < rows ? row / p.len_q : 0);
      km_pos[e] = row_position(lens, q_row);
    }
  }
  for (int tile = first; tile < last; ++tile) {
    const int i = tile - first;
    if (tile == write_tile) store_append_chunk(new_chunk);
    cp_async_wait<kStages - 2>();
    if constexpr (kGmma) sm90::fence_proxy_async();  // the copies, before wgmma reads them
    // The first tile's barrier also makes Q, which every warp copied a part of, visible.
    __syncthreads();
    if (tile + kStages - 1 < last) {
      load_stage(tile + kStages - 1, (i + kStages - 1) % kStages);
      lookup(tile + kStages);
    }
    cp_async_commit();
    const T* sK = sStages + (i % kStages) * kStageElems;
    const T* sV = sK + kKeyAreaElems;

    if constexpr (kKeyMajor && kPass == DecodePass::kWeights) {
      // P^T's B-fragments straight from the cached scores: lane (g, c) takes row g's keys
      // 2c, 2c + 1 and 2c + 8, 2c + 9 of the warp's 16 (both halves at row g's lse and term).
      const float* sS = reinterpret_cast<const float*>(sK) + g * Traits::kScoreStride +
                        key_warp * kWarpKeys + 2 * c4;
      const float2 lo = *reinterpret_cast<const float2*>(sS);
      const float2 hi = *reinterpret_cast<const float2*>(sS + 8);
      float w[1][1][4] = {{{lo.x, lo.y, hi.x, hi.y}}};
      WeightStats unused;
      const float lse2_frag[1][2] = {{lse2[0], lse2[0]}};
      const float c_frag[1][2] = {{row_term[0], row_term[0]}};
      if (transform_weights<Transform, 1, 1, false>(w, lse2_frag, c_frag, unused).any) {
        add_key_major_values<T, kGmma, BN, DV>(ot, sV, key_warp * kWarpKeys, lane,
                                               MmaOp<T>::pack(w[0][0][0], w[0][0][1]),
                                               MmaOp<T>::pack(w[0][0][2], w[0][0][3]));
      }
      continue;
    }
    if constexpr (kKeyMajor && kPass != DecodePass::kWeights) {
      const int n0 = tile * BN + key_warp * kWarpKeys;
      if (tile == first) {
        // B-fragments of q rows 0..7 (k-steps kk, kk + 1 per x4 load: dims kk * 16 + 8 m).
#pragma unroll
        for (int kk = 0; kk < D / 16; kk += 2) {
          uint32_t f[4];
          ldmatrix_x4(f, sQ + swz<D>(lane & 7, kk * 16 + (lane >> 3) * 8));
          qb[kk][0] = f[0];
          qb[kk][1] = f[1];
          qb[kk + 1][0] = f[2];
          qb[kk + 1][1] = f[3];
        }
      }
      // st[e]: key n0 + g + 8 (e >> 1), row 2c + (e & 1).
      float st[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, sK + k_off(key_warp * kWarpKeys + (lane & 15), kk * 16 + (lane >> 4) * 8));
        MmaOp<T>::run(st, a, qb[kk][0], qb[kk][1]);
      }
      float scale = p.scale_log2;
      if constexpr (Mod::kPositional) {
        const float x_scale = static_cast<float>(p.scale);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          st[e] = Mod::apply(p, b, km_head[e & 1], km_pos[e & 1], n0 + g + 8 * (e >> 1),
                             st[e] * x_scale) *
                  float(M_LOG2E);
        }
        scale = 1.f;
      } else if (!(scale > 0.f)) {
#pragma unroll
        for (int e = 0; e < 4; ++e) st[e] *= scale;
        scale = 1.f;
      }
      if (!(n0 >= all_lo && n0 + kWarpKeys <= all_hi)) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = n0 + g + 8 * (e >> 1);
          if (j < km_lo[e & 1] || j >= km_hi[e & 1]) st[e] = -INFINITY;
        }
      }
      if (cached) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 2 * c4 + (e & 1);
          if (row0 + r < rows) {
            sp.scores[scores_row0 + r * sp.scores_stride + n0 + g + 8 * (e >> 1)] = st[e] * scale;
          }
        }
      }
      // The online max and sum of each column, over its keys in lanes 4 apart (as
      // online_softmax: the max may stay up to kMaxSlack below the true one).
      constexpr float kMaxSlack = 8.f;
      float corr[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float mx = key_column_max(fmaxf(st[e], st[2 + e]));
        mx = fmaxf(km_max[e], mx * scale);
        if (!(mx - km_max[e] > kMaxSlack)) mx = km_max[e];
        const float base = mx == -INFINITY ? 0.f : mx;
        corr[e] = exp2f(km_max[e] - base);
        km_max[e] = mx;
        st[e] = exp2f(fmaf(st[e], scale, -base));
        st[2 + e] = exp2f(fmaf(st[2 + e], scale, -base));
        km_sum[e] = km_sum[e] * corr[e] + (st[e] + st[2 + e]);
      }
      if constexpr (kPass == DecodePass::kOnline) {
        if (__any_sync(0xffffffff, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
          for (int t = 0; t < DV / 16; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) ot[t][e] *= corr[e & 1];
        }
        // P^T's B-fragments are S^T's pairs (rows g, g + 8 of the fragment: keys; columns
        // 2c, 2c + 1: query rows) transposed.
        add_key_major_values<T, kGmma, BN, DV>(ot, sV, key_warp * kWarpKeys, lane,
                                               movmatrix_trans(MmaOp<T>::pack(st[0], st[1])),
                                               movmatrix_trans(MmaOp<T>::pack(st[2], st[3])));
      }
      continue;
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
      if constexpr (kGmma) {
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          sm90::wgmma_ss<T, NT>(s[0], sm90::gmma_desc_k<D>(sQ + sm90::gmma_kcol<kRows, D>(kk * 16)),
                                sm90::gmma_desc_k<D>(sK + sm90::gmma_kcol<BN, D>(kk * 16)),
                                kk > 0);
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>(s[0]);
      } else if constexpr (kQInRegs) {
        if (tile == first) load_a_frags<1, D / 16, D>(qa, sQ, warp_row0, lane);
        warp_gemm_rs_nt<1, NT, D / 16, D>(s, qa, sK, key_warp * kWarpKeys, lane);
      } else {
        warp_gemm_nt<1, NT, D>(s, sQ, warp_row0, sK, key_warp * kWarpKeys, lane);
      }
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
      if (!(n0 >= all_lo && n0 + kWarpKeys <= all_hi)) {
        mask_scores(s, rr, n0, lane);
      }
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
      if (kGmma || any) {
        uint32_t pa[1][NT / 2][4];
        to_a_frags<1, NT, T>(s, pa);
        accumulate_pv(pa, sV);
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
      accumulate_pv(pa, sV);
    }
  }
  cp_async_wait_all();
  __syncthreads();  // Q and the stages become the merge buffers

  // Merge the key warps: per row the max M and sum L over warps; each warp's O rescaled by
  // exp2(m_w - M) / L (kWeights: as it is), then summed.
  float* sMax = reinterpret_cast<float*>(smem_raw);
  float* sSum = sMax + kKeyWarps * kRows;
  float* sO = sSum + kKeyWarps * kRows;
  if constexpr (kKeyMajor) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float l = key_column_sum(km_sum[e]);
      km_sum[e] = l;
      if (g == 0) {
        sMax[key_warp * kRows + 2 * c4 + e] = km_max[e];
        sSum[key_warp * kRows + 2 * c4 + e] = l;
      }
    }
  } else {
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
  }
  __syncthreads();
  auto row_stats = [&](int r, float& m, float& l) {
    // The transform's state before the first key (Transform::row_init: a logit outside the
    // keys, of weight 1), counted once per row: here where this CTA finishes the row, else in
    // decode_combine_kernel.
    float m0 = -INFINITY, l0 = 0.f;
    if constexpr (kPass == DecodePass::kOnline) {
      if (sp.num_splits == 1 && row0 + r < rows) {
        Transform::template row_init<float>(p, h_kv * group + (row0 + r) / p.len_q, m0, l0);
        m0 *= float(M_LOG2E);
      }
    }
    merge_warp_stats<kKeyWarps, kRows>(sMax, sSum, r, m0, l0, m, l);
  };
  if constexpr (kKeyMajor && kPass != DecodePass::kLse) {
    // The online pass's columns scaled as the row-major rows below; the weight pass's sums as
    // they are.
    float f[2] = {1.f, 1.f};
    if constexpr (kPass == DecodePass::kOnline) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float m, l;
        row_stats(2 * c4 + e, m, l);
        f[e] = row_saw_keys(km_sum[e]) ? exp2f(km_max[e] - m) / l : 0.f;
      }
    }
#pragma unroll
    for (int t = 0; t < DV / 16; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sO[(key_warp * kRows + 2 * c4 + (e & 1)) * DV + 16 * t + g + 8 * (e >> 1)] =
            ot[t][e] * f[e & 1];
      }
  }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    if constexpr (kPass == DecodePass::kLse || kKeyMajor) break;
    const int r = warp_row0 + g + 8 * hh;
    float m, l;
    row_stats(r, m, l);
    const float f = kPass == DecodePass::kWeights     ? 1.f
                    : row_saw_keys(row_sum[0][hh]) ? exp2f(row_max[0][hh] - m) / l
                                                   : 0.f;
#pragma unroll
    for (int di = 0; di < DT; ++di)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sO[(key_warp * kRows + r) * DV + di * 8 + 2 * (lane & 3) + e] = o[0][di][2 * hh + e] * f;
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
    store_decode_rows<T, DV, kKeyWarps, kRows, DV, kThreads, kPass == DecodePass::kOnline>(
        p, sp, sO, valid_rows, row0, b, h_kv, group, split, tid, [&](int r) {
          float m, l;
          row_stats(r, m, l);
          return row_saw_keys(l) ? (m + log2f(l)) * float(M_LN2) : -INFINITY;
        });
  }
}

template <typename T, typename Traits, typename Variant, DecodePass kPass, bool kScoresIn = false,
          bool kKeyMajor = false>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocks)
    decode_kernel(const AttnParams p, const DecodeSplits sp) {
  allow_dependent_grids();  // its combine kernel may start, and waits for this grid
  decode_pass<T, Traits, Variant, kPass, kScoresIn, kKeyMajor>(p, sp);
}

// The lse pass and the weight pass over its cached scores in one kernel, for one split per
// (sequence, kv head, row block): the CTA finishes its rows' lse (LseTraits), then weighs the
// keys (WeightTraits: the same warps and rows). Apart, each pass ran its own pipeline fill and
// wave tail, and the lse pass (products and exponentials over half the bytes) left DRAM idle
// that the weight pass could use: here CTAs in either phase share the SMs. Two CTAs per SM, as
// the passes apart ran (the weight pass alone took 158 registers a thread).
template <typename T, typename LseTraits, typename WeightTraits, typename Variant, bool kKeyMajor>
__global__ void __launch_bounds__(LseTraits::kThreads, 2)
    decode_lse_weights_kernel(const AttnParams p, const DecodeSplits lse_sp,
                              const DecodeSplits weight_sp) {
  static_assert(WeightTraits::kThreads == LseTraits::kThreads &&
                    LseTraits::kRows == WeightTraits::kRows,
                "the weight pass runs on the lse pass's warps and rows");
  allow_dependent_grids();
  decode_pass<T, LseTraits, Variant, DecodePass::kLse, false, kKeyMajor>(p, lse_sp);
  // p.lse and the cached scores, written above, are read below (one split: no merge).
  __syncthreads();
  decode_pass<T, WeightTraits, Variant, DecodePass::kWeights, true, kKeyMajor>(p, weight_sp);
}

// Most threads of a decode_combine_kernel CTA, and the splits each thread loads at once.
constexpr int kCombineMaxThreads = 256;
constexpr int kCombineUnroll = 8;

// Threads of decode_combine_kernel's CTAs for `splits` partial results of Dv columns: a float4
// chunk of every column for each of up to `splits` splits at a time, in whole warps.
constexpr int decode_combine_threads(int dv, int splits) {
  const int chunks = dv / 4;
  const int lanes = splits < kCombineMaxThreads / chunks ? splits : kCombineMaxThreads / chunks;
  return (chunks * lanes + 31) / 32 * 32;
}

// Merges the splits' partial results of every row (b, h, r), one CTA per row. kOnline: outputs
// weighted by their lse (splits that saw no key of the row, lse -inf, are skipped; a row no
// split saw gets out 0 and lse -inf), the transform's state before the first key
// (Transform::row_init) joining the lse once. kLse: the lse alone. kWeights: outputs summed.
// Launched with decode_combine_threads(DV, splits) threads: thread t takes the float4 column
// chunk t % (DV / 4) of splits t / (DV / 4) + k * (threads / (DV / 4)), kCombineUnroll of them
// loaded before any is used, and issues them ahead of the lse's loads: the combine runs after
// the decode grid, on its critical path, so one memory round trip serves both instead of one
// for the lse and more for the outputs. The threads' sums meet in shared memory.
template <typename T, int DV, DecodePass kPass, typename Transform>
__global__ void __launch_bounds__(kCombineMaxThreads) decode_combine_kernel(
    const AttnParams p, const DecodeSplits sp) {
  constexpr int kChunks = DV / 4;
  static_assert(DV % 4 == 0 && (32 % kChunks == 0 || kChunks % 32 == 0) &&
                    kCombineMaxThreads % kChunks == 0,
                "whole float4 chunk rows in whole warps (decode_combine_threads)");
  constexpr int kMaxSplitLanes = kCombineMaxThreads / kChunks;
  const int split_lanes = blockDim.x / kChunks;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads_q * p.len_q;
  const int64_t stat = blockIdx.x;
  const int lane = threadIdx.x % 32;
  const int chunk = threadIdx.x % kChunks, split_lane = threadIdx.x / kChunks;
  const int b = static_cast<int>(stat / (static_cast<int64_t>(p.heads_q) * p.len_q));
  const int h = static_cast<int>(stat / p.len_q % p.heads_q);
  const int q_row = static_cast<int>(stat % p.len_q);
  const int splits = sp.num_splits;
  const float* __restrict__ lse_part = sp.lse_part;
  const float4* __restrict__ o_part = reinterpret_cast<const float4*>(sp.o_part);
  // Launched overlapping the decode kernel: its partial results are read only from here on.
  wait_prior_grid();

  float4 part[kCombineUnroll];
  float part_lse[kCombineUnroll];
  auto load_parts = [&](int s0) {
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      const int s = s0 + u * split_lanes;
      const bool in = s < splits;
      part[u] = in ? o_part[(s * rows + stat) * kChunks + chunk] : make_float4(0.f, 0.f, 0.f, 0.f);
      part_lse[u] = in && kPass == DecodePass::kOnline ? lse_part[s * rows + stat] : -INFINITY;
    }
  };
  if constexpr (kPass != DecodePass::kLse) load_parts(split_lane);

  float lse = 0.f;
  if constexpr (kPass != DecodePass::kWeights) {
    // Every warp merges the lse (a few loads per lane), so that none waits for another.
    float m0 = -INFINITY, l0 = 0.f;
    if constexpr (kPass == DecodePass::kOnline) Transform::template row_init<float>(p, h, m0, l0);
    float m = m0;
    for (int s = lane; s < splits; s += 32) m = fmaxf(m, lse_part[s * rows + stat]);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, off));
    // Splits that saw no key add exp(-inf) = 0; a NaN lse makes the row's NaN.
    const float base = m == -INFINITY ? 0.f : m;
    float sum = 0.f;
    for (int s = lane; s < splits; s += 32) sum += expf(lse_part[s * rows + stat] - base);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
    if (l0 != 0.f) sum += l0 * expf(m0 - base);
    lse = row_saw_keys(sum) ? base + logf(sum) : -INFINITY;
    if constexpr (kPass == DecodePass::kLse) {
      if (threadIdx.x == 0) p.lse[stat] = lse;
      return;
    }
  }

  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = split_lane;;) {
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      float w = s0 + u * split_lanes < splits ? 1.f : 0.f;
      if constexpr (kPass == DecodePass::kOnline) {
        w = part_lse[u] == -INFINITY ? 0.f : expf(part_lse[u] - lse);
      }
      // A skipped split adds nothing, whatever its partial output holds.
      if (w != 0.f) {
        acc.x += w * part[u].x;
        acc.y += w * part[u].y;
        acc.z += w * part[u].z;
        acc.w += w * part[u].w;
      }
    }
    s0 += split_lanes * kCombineUnroll;
    if (s0 >= splits) break;
    load_parts(s0);
  }
  __shared__ float4 lane_acc[kMaxSplitLanes][kChunks];
  lane_acc[split_lane][chunk] = acc;
  __syncthreads();
  if (threadIdx.x < kChunks) {
    float4 total = lane_acc[0][threadIdx.x];
    for (int l = 1; l < split_lanes; ++l) {
      const float4 x = lane_acc[l][threadIdx.x];
      total.x += x.x;
      total.y += x.y;
      total.z += x.z;
      total.w += x.w;
    }
    T* out = static_cast<T*>(p.out) + b * p.o_batch_stride + h * p.o_head_stride +
             q_row * p.o_row_stride + 4 * threadIdx.x;
    out[0] = from_float<T>(total.x);
    out[1] = from_float<T>(total.y);
    out[2] = from_float<T>(total.z);
    out[3] = from_float<T>(total.w);
    if (kPass == DecodePass::kOnline && threadIdx.x == 0) p.lse[stat] = lse;
  }
}

}  // namespace tc
}  // namespace adaattn
