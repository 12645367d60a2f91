// Block-sparse mask helpers, shared by the CPU and CUDA kernels: the BCSR lists of
// AttnParams' block-sparse section. Element (i, j) of (b, h) is attended iff key block
// j / block_n is listed for query block i / block_m, and j is inside key_range (mask.h: causal).
//
// The lists are read without trusting them: a count is clamped to its row's length and an
// out-of-range index reads as kNoBlock (callers skip it), so a malformed mask on the GPU (where
// the op cannot check values without a host sync) never reads or writes out of bounds.
#pragma once

#include <cstdint>

#include "mask.h"
#include "params.h"

namespace adaattn {

constexpr int kNoBlock = -1;

// One (b, h, block) list: the first `count` entries of `idx`.
struct BlockList {
  const int* idx;
  int count;  // in [0, limit]
  int limit;  // number of blocks on the other axis: valid indices are [0, limit)

  // Entry e in [0, count): a block index, or kNoBlock when the stored index is out of range.
  ADAATTN_HD int at(int e) const {
    const int v = idx[e];
    return v >= 0 && v < limit ? v : kNoBlock;
  }
};

ADAATTN_HD BlockList make_block_list(const int* num, const int* idx, int limit) {
  int n = *num;
  n = n < 0 ? 0 : (n > limit ? limit : n);
  return {idx, n, limit};
}

// Key blocks listed for query block mb of batch b, query head h (forward, backward dq).
ADAATTN_HD BlockList kv_blocks(const AttnParams& p, int b, int h, int mb) {
  const int* num = p.block_kv_num + b * p.block_kv_num_batch_stride +
                   h * p.block_kv_num_head_stride + mb;
  const int* idx = p.block_kv_idx + b * p.block_kv_idx_batch_stride +
                   h * p.block_kv_idx_head_stride + static_cast<int64_t>(mb) * p.block_nkv;
  return make_block_list(num, idx, p.block_nkv);
}

// Query blocks that list key block nb for batch b, query head h (backward dk/dv).
ADAATTN_HD BlockList q_blocks(const AttnParams& p, int b, int h, int nb) {
  const int* num = p.block_q_num + b * p.block_q_num_batch_stride +
                   h * p.block_q_num_head_stride + nb;
  const int* idx = p.block_q_idx + b * p.block_q_idx_batch_stride +
                   h * p.block_q_idx_head_stride + static_cast<int64_t>(nb) * p.block_nq;
  return make_block_list(num, idx, p.block_nq);
}

// Query rows [first, last) of query block mb.
ADAATTN_HD RowSpan block_rows(const AttnParams& p, int mb) {
  const int first = mb * p.block_m;
  const int last = first + p.block_m;
  return {first, last < p.len_q ? last : p.len_q};
}

// Keys [lo, hi) of key block nb.
ADAATTN_HD KeyRange block_keys(const AttnParams& p, int nb) {
  const int lo = nb * p.block_n;
  const int hi = lo + p.block_n;
  return {lo, hi < p.len_k ? hi : p.len_k};
}

// Calls fn(lo, hi) for each span of keys that query row `row` of (b, h) visits: its key range
// (dense masks) or, block-sparse, that range cut to each listed key block, in list order.
template <typename Fn>
ADAATTN_HD void for_each_key_span(const AttnParams& p, int b, int h, int row, KeyRange range,
                                  Fn&& fn) {
  if (p.block_kv_num == nullptr) {
    if (range.hi > range.lo) fn(range.lo, range.hi);
    return;
  }
  const BlockList list = kv_blocks(p, b, h, row / p.block_m);
  for (int e = 0; e < list.count; ++e) {
    const int blk = list.at(e);
    if (blk == kNoBlock) continue;
    const KeyRange keys = block_keys(p, blk);
    const int lo = keys.lo > range.lo ? keys.lo : range.lo;
    const int hi = keys.hi < range.hi ? keys.hi : range.hi;
    if (lo < hi) fn(lo, hi);
  }
}

// Calls fn(first, last) for each span of query rows of (b, h) whose scores with key `key` are
// visited: `rows` (dense masks) or, block-sparse, `rows` cut to each query block that lists the
// key's block, in list order.
template <typename Fn>
ADAATTN_HD void for_each_row_span(const AttnParams& p, int b, int h, int key, RowSpan rows,
                                  Fn&& fn) {
  if (p.block_kv_num == nullptr) {
    if (rows.last > rows.first) fn(rows.first, rows.last);
    return;
  }
  const BlockList list = q_blocks(p, b, h, key / p.block_n);
  for (int e = 0; e < list.count; ++e) {
    const int blk = list.at(e);
    if (blk == kNoBlock) continue;
    const RowSpan block = block_rows(p, blk);
    const int first = block.first > rows.first ? block.first : rows.first;
    const int last = block.last < rows.last ? block.last : rows.last;
    if (first < last) fn(first, last);
  }
}

}  // namespace adaattn
