// Score modifier and probability transform of lazy attention (spec 3.2), shared by every lazy
// kernel. Lazy attention is causal; its mask is the flash mask policy (mask.h) with
// window (-1, 0).
//   score modifier:  s_ij += bias[h, i - j] when 0 <= i - j < W (beyond the table: + 0)
//   transform:       a_ij = max(0, p_ij + tau_h / (i + 1)), p = softmax_j(s)
// where i = r + Lk - Lq is the position of query row r within its sequence.
#pragma once

#include "mask.h"
#include "params.h"

namespace adaattn {

ADAATTN_HD int lazy_position(const SeqLens& lens, int row) { return row + lens.shift; }

// Distance bias of (position i, key j); 0 outside the table.
ADAATTN_HD float lazy_bias(const AttnParams& p, int h, int i, int j) {
  const int d = i - j;
  return d >= 0 && d < p.bias_window ? p.bias[static_cast<int64_t>(h) * p.bias_window + d] : 0.f;
}

// The shift tau_h / (i + 1) added to every probability of the row at position i.
template <typename T>
ADAATTN_HD T lazy_shift(const AttnParams& p, int h, int i) {
  return static_cast<T>(p.tau[h]) / static_cast<T>(i + 1);
}

}  // namespace adaattn
