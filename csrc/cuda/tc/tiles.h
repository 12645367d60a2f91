// Which tiles a tensor-core CTA visits: the mask policy's say over the mainloops. A row tile
// walks key tiles, and a key tile (dK/dV) walks (query head, query tile) steps, either over a
// contiguous range (causal, window, seqlens, packed sequences: mask.h) or over the blocks listed
// in a block-sparse mask (core/block_sparse.h). Elements inside a visited tile are still masked
// by key_range, so block-sparse with causal masks both ways.
#pragma once

#include "../../core/block_sparse.h"
#include "../../core/mask.h"

namespace adaattn {
namespace tc {

// The query tile of a row-tile CTA (forward, a transform's row pass, deterministic dQ): its
// batch entry, query head and kv head, first row, sequence lengths and the union of its rows'
// key ranges.
// CTA order: seq.h tile_item (query tiles walked backwards, in the launch's chunks of units).
struct RowTile {
  int b, h, h_kv, m0;
  SeqLens lens;
  KeyRange keys;
  bool valid;
};

template <int kBlockM>
__device__ __forceinline__ RowTile row_tile(const AttnParams& p, int64_t block) {
  const WorkItem tile = tile_item<false, true>(p, block, kBlockM);
  RowTile t;
  t.valid = tile.valid;
  if (!tile.valid) return t;
  t.b = tile.b;
  t.h = tile.h;
  t.h_kv = tile.h / (p.heads_q / p.heads_kv);
  t.m0 = tile.index * kBlockM;
  t.lens = seq_lens(p, t.b);
  t.keys = tile_key_range(p, t.lens, t.m0, t.m0 + kBlockM);
  return t;
}

// Whether the 8-bit forward computes head h of entry b (AttnParams::head_q8; every head when
// the call has no per-head choice is the 16-bit forward's).
__device__ __forceinline__ bool q8_owns_head(const AttnParams& p, int b, int h) {
  return p.head_q8 != nullptr && p.head_q8[static_cast<int64_t>(b) * p.heads_q + h] != 0;
}

// Key tiles of BN keys for one row tile: tile at(i) for i in [0, count).
struct KeyTiles {
  int begin;      // dense: first tile
  int count;      // tiles to visit
  BlockList list; // block-sparse: listed key blocks (list.idx == nullptr for dense masks)
  int per_block;  // block-sparse: tiles per key block

  __device__ __forceinline__ int at(int i) const {
    if (list.idx == nullptr) return begin + i;
    const int blk = list.at(i / per_block);
    // An out-of-range index (a malformed mask on the GPU) reads tile 0: wrong but in bounds.
    return (blk == kNoBlock ? 0 : blk) * per_block + i % per_block;
  }
};

// The key tiles of a contiguous key range, for loops specialised to dense masks.
struct DenseKeyTiles {
  int begin;
  int count;
  __device__ __forceinline__ int at(int i) const { return begin + i; }
};

template <int BN>
__device__ __forceinline__ DenseKeyTiles dense_key_tiles(KeyRange keys) {
  if (keys.hi <= keys.lo) return {0, 0};
  return {keys.lo / BN, (keys.hi + BN - 1) / BN - keys.lo / BN};
}

// Rows [m0, m0 + block_m) of (b, h) with key range `keys` (their union); block-sparse needs the
// row tile to be one mask block row (the launcher checks block_m against the tile).
template <int BN>
__device__ __forceinline__ KeyTiles key_tiles(const AttnParams& p, KeyRange keys, int b, int h,
                                              int m0) {
  KeyTiles t{0, 0, {nullptr, 0, 0}, 1};
  if (keys.hi <= keys.lo) return t;
  if (p.block_kv_num == nullptr) {
    t.begin = keys.lo / BN;
    t.count = (keys.hi + BN - 1) / BN - t.begin;
  } else {
    t.list = kv_blocks(p, b, h, m0 / p.block_m);
    t.per_block = p.block_n / BN;
    t.count = t.list.count * t.per_block;
  }
  return t;
}

// (query head, query tile of BM rows) steps of one key tile [n0, n0 + block_n), over the query
// heads h0 .. h0 + group - 1 of its kv head: the tiles meeting `rows` (dense) or the tiles of
// the query blocks listing the key tile's block (block-sparse).
template <int BM>
struct QuerySteps {
  int b, h0, group, n_block;  // n_block: block-sparse key block
  int m_begin, per_head;      // dense: first tile and tiles per head
  int per_block;              // block-sparse: query tiles per block
  int count;

  __device__ __forceinline__ void at(const AttnParams& p, int s, int& h, int& m0) const {
    if (p.block_kv_num == nullptr) {
      h = h0 + s / per_head;
      m0 = (m_begin + s % per_head) * BM;
      return;
    }
    int hh = 0;
    BlockList list = q_blocks(p, b, h0, n_block);
    while (s >= list.count * per_block && hh + 1 < group) {
      s -= list.count * per_block;
      ++hh;
      list = q_blocks(p, b, h0 + hh, n_block);
    }
    h = h0 + hh;
    const int blk = list.at(s / per_block);
    m0 = ((blk == kNoBlock ? 0 : blk) * per_block + s % per_block) * BM;
  }
};

// The steps of a contiguous row span over every query head of the group, for loops specialised
// to dense masks.
template <int BM>
struct DenseQuerySteps {
  int h0, m_begin, per_head, count;

  __device__ __forceinline__ void at(const AttnParams&, int s, int& h, int& m0) const {
    h = h0 + s / per_head;
    m0 = (m_begin + s % per_head) * BM;
  }
};

template <int BM>
__device__ __forceinline__ DenseQuerySteps<BM> dense_query_steps(const AttnParams& p, int h_kv,
                                                                 RowSpan rows) {
  const int group = p.heads_q / p.heads_kv;
  if (rows.last <= rows.first) return {h_kv * group, 0, 1, 0};
  const int m_begin = rows.first / BM;
  const int per_head = (rows.last + BM - 1) / BM - m_begin;
  return {h_kv * group, m_begin, per_head, per_head * group};
}

template <int BM>
__device__ __forceinline__ QuerySteps<BM> query_steps(const AttnParams& p, int b, int h_kv,
                                                      int n0, RowSpan rows) {
  const int group = p.heads_q / p.heads_kv;
  QuerySteps<BM> st{b, h_kv * group, group, 0, 0, 0, 1, 0};
  if (rows.last <= rows.first) return st;
  if (p.block_kv_num == nullptr) {
    st.m_begin = rows.first / BM;
    st.per_head = (rows.last + BM - 1) / BM - st.m_begin;
    st.count = st.per_head * group;
  } else {
    st.n_block = n0 / p.block_n;
    st.per_block = p.block_m / BM;
    for (int hh = 0; hh < group; ++hh) {
      st.count += q_blocks(p, b, st.h0 + hh, st.n_block).count * st.per_block;
    }
  }
  return st;
}

}  // namespace tc
}  // namespace adaattn
