// Tile building blocks of the CPU attention kernel (attention_cpu.cpp): tasks own tiles of kBlockM
// query rows, keys are copied transposed into kBlockN-column tiles so that the inner loops run
// with unit stride (vectorisable, fixed summation order).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "../core/block_sparse.h"
#include "../core/mask.h"
#include "../core/seq.h"

namespace adaattn {
namespace cpu {

constexpr int kBlockM = 64;  // query rows per task (forward, backward dq pass)
constexpr int kBlockN = 64;  // keys per tile

// One [B, H, L, D] operand (packed [T, H, D]: batch_stride 0): base pointer and element strides.
template <typename T>
struct Operand {
  T* base;
  int64_t batch_stride, head_stride, row_stride;

  T* row(int b, int h, int i) const {
    return base + b * batch_stride + h * head_stride + i * row_stride;
  }
  // The operand seen from a batch entry whose rows start at row `start` (packed sequences).
  Operand shifted(int64_t start) const {
    return {base + start * row_stride, batch_stride, head_stride, row_stride};
  }
};

// Most rows of q (kKeys = false) or k/v of any batch entry: the grid of row tiles covers them.
template <bool kKeys>
int max_entry_rows(const AttnParams& p) {
  int rows = 0;
  for (int b = 0; b < p.batch; ++b) {
    const SeqLens lens = seq_lens(p, b);
    rows = std::max(rows, kKeys ? lens.rows_k : lens.rows_q);
  }
  return rows;
}

template <typename T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

// Copies keys [n0, n0 + cols) of one head into tile[d * kBlockN + c].
template <typename T>
inline void load_transposed(const Operand<const T>& src, int b, int h, int n0, int cols, int dim,
                            T* __restrict__ tile) {
  for (int c = 0; c < cols; ++c) {
    const T* __restrict__ src_row = src.row(b, h, n0 + c);
    for (int d = 0; d < dim; ++d) tile[d * kBlockN + c] = src_row[d];
  }
}

// out[c] = x . tile[:, c] for c in [c0, c1).
template <typename T>
inline void dot_tile(const T* __restrict__ x, const T* __restrict__ tile, int dim, int c0, int c1,
                     T* __restrict__ out) {
  std::fill(out + c0, out + c1, T(0));
  for (int d = 0; d < dim; ++d) {
    const T xd = x[d];
    const T* __restrict__ tile_row = tile + d * kBlockN;
    for (int c = c0; c < c1; ++c) out[c] += xd * tile_row[c];
  }
}

// y += a * x over dim elements.
template <typename T>
inline void axpy(T a, const T* __restrict__ x, T* __restrict__ y, int dim) {
  for (int d = 0; d < dim; ++d) y[d] += a * x[d];
}

// x . y over dim elements.
template <typename T>
inline T dot(const T* __restrict__ x, const T* __restrict__ y, int dim) {
  T acc = 0;
  for (int d = 0; d < dim; ++d) acc += x[d] * y[d];
  return acc;
}

// Calls fn(n0, cols) for each key tile [n0, n0 + cols), cols <= kBlockN, that rows [m0, m0 + rows)
// of (b, h) visit: their key range or, block-sparse, that range cut to the listed blocks of the
// rows' query block (a row tile lies in one query block: block_m is a multiple of kBlockM).
template <typename Fn>
inline void for_each_key_tile(const AttnParams& p, const SeqLens& lens, int b, int h, int m0,
                              int rows, Fn&& fn) {
  const KeyRange span = tile_key_range(p, lens, m0, m0 + rows);
  for_each_key_span(p, b, h, m0, span, [&](int lo, int hi) {
    for (int n0 = lo; n0 < hi; n0 += kBlockN) fn(n0, std::min(kBlockN, hi - n0));
  });
}

// The columns [lo, hi) of key tile [n0, n0 + cols) inside a row's key range (empty: lo >= hi).
inline KeyRange tile_columns(KeyRange range, int n0, int cols) {
  return {std::max(range.lo, n0) - n0, std::min(range.hi, n0 + cols) - n0};
}

// Whether a row's softmax sum counts attended keys: it is at least 1 once a key with a finite
// score is attended (the max's own term), exactly 0 when none is. A NaN sum (a NaN or +inf
// score) counts, so the NaN reaches out and lse instead of turning into a zero row.
template <typename T>
inline bool row_saw_keys(T row_sum) {
  return row_sum != T(0);
}

// exp(s - lse), a probability from its row's finished lse. A row whose every score is -inf (an
// Inf in q or k) has lse -inf and probabilities 0, as masked keys have, not exp(-inf + inf).
template <typename T>
inline T prob_from_lse(T s, T lse) {
  return std::exp(s - (lse == neg_inf<T>() ? -lse : lse));
}

// One online-softmax step of a row over tile columns [c0, c1) (all inside the row's key range)
// of its final scores: raises the running max, rescales the row's accumulator and running sum,
// and passes each column's unnormalised weight exp(s - max) to add(c, weight). std::max skips a
// NaN score, whose weight exp(NaN) then makes the sum NaN; a +inf score gives exp(inf - inf).
template <typename T, typename Add>
inline void online_softmax_step(const T* __restrict__ scores, int c0, int c1, T& row_max,
                                T& row_sum, T* acc_row, int dim, Add&& add) {
  T tile_max = neg_inf<T>();
  for (int c = c0; c < c1; ++c) tile_max = std::max(tile_max, scores[c]);
  const T new_max = std::max(row_max, tile_max);
  // Scores that are all -inf so far (an Inf in q or k) weigh exp(-inf) = 0, as masked keys do,
  // not exp(-inf + inf) = NaN. exp(-inf) = 0 also rescales a row's first tile: the zero
  // accumulator stays zero.
  const T base = new_max == neg_inf<T>() ? T(0) : new_max;
  const T rescale = std::exp(row_max - base);
  if (rescale != T(1)) {
    for (int d = 0; d < dim; ++d) acc_row[d] *= rescale;
  }
  T sum = row_sum * rescale;
  for (int c = c0; c < c1; ++c) {
    const T weight = std::exp(scores[c] - base);
    sum += weight;
    add(c, weight);
  }
  row_sum = sum;
  row_max = new_max;
}

}  // namespace cpu
}  // namespace adaattn
