// Block-sparse mask helpers (spec 3.3), shared by the CPU and CUDA kernels: the BCSR lists of
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

}  // namespace adaattn
