// Where the rows of one batch entry live, for the dense layout ([B, H, L, D], optionally
// right-padded by `seqlens`) and the packed one ([T, H, D] split by cu_seqlens), and how kernels
// map their work items (rows, row tiles) onto batch entries. Kernels index every tensor through
// SeqLens, so one kernel serves both layouts.
#pragma once

#include <cstdint>

#include "host_device.h"
#include "params.h"

namespace adaattn {

struct SeqLens {
  int q;           // query rows that attend (rows in [q, rows_q) are padding and give 0)
  int k;           // keys that may be attended
  int rows_q;      // rows of q/out/lse that belong to this entry (writes stay below it)
  int rows_k;      // rows of k/v that belong to this entry (reads stay below it)
  int shift;       // row r's causal diagonal is key r + shift (Lk - Lq, bottom-right aligned)
  int key_position;  // position of key 0 in the sequence (0 unless explicit_positions)
  int64_t q_start; // first row of this entry in q/out/dout/dq (packed: cu_seqlens_q[b])
  int64_t k_start; // first row in k/v/dk/dv (packed: cu_seqlens_k[b])
};

ADAATTN_HD bool is_packed(const AttnParams& p) { return p.cu_seqlens_q != nullptr; }

// Position of query row r relative to key 0, bottom-right aligned (r + Lk - Lq; packed:
// positions restart in every sequence): the distance of key j is row_position - j. Score
// modifiers take it as i, with the key index as j.
ADAATTN_HD int row_position(const SeqLens& lens, int row) { return row + lens.shift; }

// Position of query row r in its sequence: row_position, unless the call is a block of a
// sequence that starts past key 0 (explicit positions). Per-position row terms take it.
ADAATTN_HD int query_position(const SeqLens& lens, int row) {
  return row + lens.shift + lens.key_position;
}

// An upper bound of row_position over the problem's rows (the largest distance to key 0):
// Lk - 1 bottom-right aligned (packed, padded and decode entries sit at most there), the last
// row's distance to key 0 with explicit positions.
ADAATTN_HD int max_row_position(const AttnParams& p) {
  return p.explicit_positions ? p.q_position0 - p.k_position0 + p.len_q - 1 : p.len_k - 1;
}

// Sequence b of a packed tensor with `total` rows: cu_seqlens clamped into [0, total] and made
// non-decreasing, so a malformed cu_seqlens can never index outside the tensor.
ADAATTN_HD void packed_range(const int* cu, int b, int total, int64_t& start, int& len) {
  int a = cu[b], e = cu[b + 1];
  a = a < 0 ? 0 : (a > total ? total : a);
  e = e < a ? a : (e > total ? total : e);
  start = a;
  len = e - a;
}

ADAATTN_HD SeqLens seq_lens(const AttnParams& p, int b) {
  if (is_packed(p)) {
    SeqLens s;
    packed_range(p.cu_seqlens_q, b, p.len_q, s.q_start, s.q);
    packed_range(p.cu_seqlens_k, b, p.len_k, s.k_start, s.k);
    s.rows_q = s.q;
    s.rows_k = s.k;
    s.shift = s.k - s.q;
    s.key_position = 0;
    return s;
  }
  int q = p.len_q, k = p.len_k;
  if (p.cache_seqlens != nullptr) {
    // Decode: every query row is real; the keys end at the cache's new length (clamped to its
    // capacity, so a bad cache_seqlens never reads outside it), and nothing past them is read:
    // those slots may hold anything.
    const int cached = p.cache_seqlens[b] < 0 ? 0 : p.cache_seqlens[b];
    k = cached < p.len_k - p.cache_appended ? cached + p.cache_appended : p.len_k;
    return {q, k, p.len_q, k, k - q, 0, 0, 0};
  }
  if (p.seqlens != nullptr) {
    const int s = p.seqlens[b] < 0 ? 0 : p.seqlens[b];
    q = s < q ? s : q;
    k = s < k ? s : k;
  }
  if (p.explicit_positions) {
    return {q, k, p.len_q, p.len_k, p.q_position0 - p.k_position0, p.k_position0, 0, 0};
  }
  return {q, k, p.len_q, p.len_k, p.len_k - p.len_q, 0, 0, 0};
}

// Offset of row 0 of (b, h) in the row-statistics layout of lse (and of the delta/row_g
// scratch): dense [B, Hq, Lq], packed [Hq, Tq].
ADAATTN_HD int64_t row_stat_offset(const AttnParams& p, const SeqLens& lens, int b, int h) {
  return is_packed(p) ? static_cast<int64_t>(h) * p.len_q + lens.q_start
                      : (static_cast<int64_t>(b) * p.heads_q + h) * p.len_q;
}

// Row `row` of a sequence (counted from its first row, lens.q_start or lens.k_start) of head h
// of batch entry b in each attention tensor: q, out, dout, dq by query row, k, v, dk, dv by key.
#define ADAATTN_ROW_POINTER(NAME, FIELD, STRIDE, START, QUAL)                                 \
  template <typename T>                                                                       \
  ADAATTN_HD QUAL T* NAME(const AttnParams& p, const SeqLens& lens, int b, int h, int64_t row) { \
    return static_cast<QUAL T*>(p.FIELD) + b * p.STRIDE##_batch_stride +                      \
           h * p.STRIDE##_head_stride + (lens.START + row) * p.STRIDE##_row_stride;          \
  }
ADAATTN_ROW_POINTER(q_rows, q, q, q_start, const)
ADAATTN_ROW_POINTER(k_rows, k, k, k_start, const)
ADAATTN_ROW_POINTER(v_rows, v, v, k_start, const)
ADAATTN_ROW_POINTER(dout_rows, dout, do, q_start, const)
ADAATTN_ROW_POINTER(out_rows, out, o, q_start, )
ADAATTN_ROW_POINTER(dq_rows, dq, dq, q_start, )
ADAATTN_ROW_POINTER(dk_rows, dk, dk, k_start, )
ADAATTN_ROW_POINTER(dv_rows, dv, dv, k_start, )
#undef ADAATTN_ROW_POINTER

// Last sequence b in [0, n) with key(b) <= x (0 if none); key must be non-decreasing for a
// meaningful answer, and any answer is in range.
template <typename Key>
ADAATTN_HD int last_sequence_at_or_before(int n, int64_t x, Key&& key) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    if (key(mid) <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// A work item of one (batch entry, head): row `row` or row tile `block`; valid == false when the
// item maps to no real row (packed slots past a sequence's end, or rows outside every sequence).
struct WorkItem {
  int b;
  int h;
  int index;  // row, or row tile
  int slot;   // this item's slot among its head's items (see tile_slots)
  bool valid;
};

// Rows of the q side (kKeys = false) or the k side (true) in lse order: dense (b, h, row) with
// row < L; packed (h, t) over the T packed rows.
template <bool kKeys>
ADAATTN_HD int64_t row_items(const AttnParams& p) {
  const int heads = kKeys ? p.heads_kv : p.heads_q;
  const int len = kKeys ? p.len_k : p.len_q;
  return static_cast<int64_t>(is_packed(p) ? 1 : p.batch) * heads * len;
}

template <bool kKeys>
ADAATTN_HD WorkItem row_item(const AttnParams& p, int64_t item) {
  const int heads = kKeys ? p.heads_kv : p.heads_q;
  const int len = kKeys ? p.len_k : p.len_q;
  const int t = static_cast<int>(item % len);
  const int64_t bh = item / len;
  if (!is_packed(p)) {
    return {static_cast<int>(bh / heads), static_cast<int>(bh % heads), t, t, true};
  }
  const int* cu = kKeys ? p.cu_seqlens_k : p.cu_seqlens_q;
  const int b = last_sequence_at_or_before(p.batch, t, [&](int s) {
    int64_t start;
    int n;
    packed_range(cu, s, len, start, n);
    return start;
  });
  int64_t start;
  int n;
  packed_range(cu, b, len, start, n);
  const int r = t - static_cast<int>(start);
  return {b, static_cast<int>(bh), r, t, r >= 0 && r < n};
}

// Row tiles of `block_rows` rows per head. Dense: batch * ceil(L / block_rows) tiles, (b, tile)
// in order. Packed: sequence b's tiles occupy slots floor(start_b / block_rows) + b onwards;
// these ranges never overlap, so floor(T / block_rows) + batch slots cover every sequence and at
// most one slot per sequence stays empty: no work is scheduled for padding.
template <bool kKeys>
ADAATTN_HD int64_t tile_slots(const AttnParams& p, int block_rows) {
  const int len = kKeys ? p.len_k : p.len_q;
  return is_packed(p) ? static_cast<int64_t>(len / block_rows) + p.batch
                      : static_cast<int64_t>(p.batch) * ((len + block_rows - 1) / block_rows);
}

// Units per chunk of tile_item's order (below) for `units` units of `tiles` tiles each and
// `wave` CTAs resident at once: units / n for n = units / ceil(wave / tiles) chunks (at least
// one), so that a chunk holds about one wave of CTAs and the last one, which takes the units
// left over, is never the short one (its heavy tiles would run alone at the end of the grid).
ADAATTN_HD int interleave_chunk(int64_t units, int64_t tiles, int64_t wave) {
  if (units <= 0 || tiles <= 0 || wave <= 0) return 1;
  const int64_t per_chunk = (wave + tiles - 1) / tiles;
  const int64_t chunks = units / per_chunk > 1 ? units / per_chunk : 1;
  return static_cast<int>(units / chunks);
}

// The same for the heads of packed sequences, whose tile slots start heavy at every sequence:
// chunks of four to seven heads (all of them when fewer). A list-scheduling model of the HF
// packed batch gained little past four (docs/lab/history.md), and more heads' K/V in flight
// outgrew L2 on the H100.
ADAATTN_HD int packed_interleave_chunk(int heads) {
  constexpr int kHeads = 4;
  const int chunks = heads / kHeads > 1 ? heads / kHeads : 1;
  return heads > 0 ? heads / chunks : 1;
}

// The tile of CTA x in a grid of heads * tile_slots CTAs. The grid's units are (head, batch
// entry) pairs, or heads with packed sequences (whose tile slots span every sequence), taken in
// chunks of C = p.interleave_pairs units (0 or 1: head-major; the last chunk also takes the
// units left over); inside a chunk the j-th tile of each unit before the (j + 1)-th, kReverse
// walking them from the last (under causal masking the late query tiles are the heavy ones).
// Under a causal mask a unit's tiles differ up to tiles-fold in work, and head-major order
// starts the last units' heaviest tiles at the end of the grid (GQA makes them few and long: a
// kv head's CTA walks every query head of its group); interleaving every unit outgrew L2 on the
// H100 (docs/lab/history.md), so launchers bound the chunks (launch.h in_cta_order).
template <bool kKeys, bool kReverse>
ADAATTN_HD WorkItem tile_item(const AttnParams& p, int64_t x, int block_rows) {
  const bool packed = is_packed(p);
  const int item = static_cast<int>(x);  // grids fit in int
  const int chunk = p.interleave_pairs > 1 ? p.interleave_pairs : 1;
  const int per_head = packed ? 1 : p.batch;
  const int tiles = static_cast<int>(tile_slots<kKeys>(p, block_rows)) / per_head;
  const int units = (kKeys ? p.heads_kv : p.heads_q) * per_head;
  const int last = units / chunk - 1;  // chunk <= units (in_cta_order's chunk sizes)
  const int c = item / (chunk * tiles) < last ? item / (chunk * tiles) : last;
  const int first = c * chunk;
  const int width = c == last ? units - first : chunk;
  const int r = item - first * tiles;
  const int unit = first + r % width, j = r / width;
  const int tile = kReverse ? tiles - 1 - j : j;
  if (!packed) {
    const int b = unit % p.batch;
    return {b, unit / p.batch, tile, b * tiles + tile, true};
  }
  const int h = unit, slot = tile;
  const int* cu = kKeys ? p.cu_seqlens_k : p.cu_seqlens_q;
  const int len = kKeys ? p.len_k : p.len_q;
  auto first_slot = [&](int s) {
    int64_t start;
    int n;
    packed_range(cu, s, len, start, n);
    return start / block_rows + s;
  };
  const int b = last_sequence_at_or_before(p.batch, slot, first_slot);
  int64_t start;
  int n;
  packed_range(cu, b, len, start, n);
  const int64_t index = slot - first_slot(b);
  const bool valid = index >= 0 && index < (n + block_rows - 1) / block_rows;
  return {b, h, static_cast<int>(index), slot, valid};
}

}  // namespace adaattn
