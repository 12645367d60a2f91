// Mask policy: which keys a query row may attend to.
//
// Every mask of the flash family (causal, sliding window, right-padded `seqlens`, packed
// sequences) is a contiguous key range [lo, hi) per query row whose ends never decrease as the row
// grows. Kernels only rely on that monotonicity: a tile of rows [m0, m1) needs key tiles
// covering [range(m0).lo, range(m1 - 1).hi), and a (row tile, key tile) pair needs no
// element-wise masking when it lies inside every row's range.
#pragma once

#include "params.h"
#include "seq.h"

namespace adaattn {

struct KeyRange {
  int lo;  // first key the row may see
  int hi;  // one past the last key; hi <= lo means the row sees nothing
};

// Causal and window limits are relative to the bottom-right aligned diagonal
// diag = row + (Lk - Lq) (flash-attn semantics).
ADAATTN_HD KeyRange key_range(const AttnParams& p, SeqLens lens, int row) {
  if (row >= lens.q) return {0, 0};
  const int diag = row + lens.shift;
  int lo = 0;
  int hi = lens.k;
  if (p.window_left >= 0) {
    const int l = diag - p.window_left;
    lo = l > 0 ? l : 0;
  }
  if (p.window_right >= 0) {
    const int h = diag + p.window_right + 1;
    hi = h < hi ? h : hi;
  }
  return {lo, hi};
}

// Key range needed by rows [m0, m1) (m0 < m1): the union of their ranges.
ADAATTN_HD KeyRange tile_key_range(const AttnParams& p, SeqLens lens, int m0, int m1) {
  const int last = (m1 < lens.q ? m1 : lens.q) - 1;
  if (last < m0) return {0, 0};
  const KeyRange first = key_range(p, lens, m0);
  const KeyRange end = key_range(p, lens, last);
  return {first.lo, end.hi};
}

// True when every row of [m0, m1) may see every key of [n0, n1): no element masking needed.
ADAATTN_HD bool tile_is_full(const AttnParams& p, SeqLens lens, int m0, int m1, int n0, int n1) {
  if (m1 > lens.q) return false;
  const KeyRange first = key_range(p, lens, m0);
  const KeyRange last = key_range(p, lens, m1 - 1);
  return n0 >= last.lo && n1 <= first.hi;
}

// Query rows [first, last) whose key ranges may meet keys [n0, n1): both ends of a row's range
// never decrease with the row, so the rows ending after n0 form a suffix and the rows starting
// before n1 a prefix (two binary searches). Rows inside may still miss some keys; callers mask.
struct RowSpan {
  int first;
  int last;
};

ADAATTN_HD RowSpan rows_meeting_keys(const AttnParams& p, SeqLens lens, int n0, int n1) {
  int lo = 0, hi = lens.q;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (key_range(p, lens, mid).hi > n0) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  const int first = lo;
  hi = lens.q;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (key_range(p, lens, mid).lo >= n1) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return {first, lo};
}

// The query rows [first, last) whose key_range holds key j: the same conditions solved for the
// row (lo(row) <= j < hi(row), row < q), so a backward tile whose rows are keys masks with two
// compares per element.
ADAATTN_HD RowSpan rows_seeing_key(const AttnParams& p, SeqLens lens, int j) {
  if (j >= lens.k) return {0, 0};
  int first = 0;
  int last = lens.q;
  if (p.window_right >= 0) {
    const int f = j - lens.shift - p.window_right;
    first = f > 0 ? f : 0;
  }
  if (p.window_left >= 0) {
    const int l = j - lens.shift + p.window_left + 1;
    last = l < last ? l : last;
  }
  return {first, last};
}

}  // namespace adaattn
