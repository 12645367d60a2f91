// The relative-bias score modifier: s_ij = x_ij + bias[h, i - j] for 0 <= i - j < W, + 0
// beyond the table (lazy attention's distance bias, spec 3.2 / 3.6 rel_bias). Learnable:
// dbias[h, d] = sum over (b, i - j = d) of dS_ij.
#pragma once

#include "variant.h"

namespace adaattn {

struct RelBiasMod {
  static constexpr bool kIdentity = false;
  static constexpr bool kUnitGrad = true;
  static constexpr bool kParamGrad = true;
  static constexpr bool kPositional = true;

  template <typename T>
  ADAATTN_HD static T apply(const AttnParams& p, int h, int i, int j, T x) {
    const int d = i - j;
    return d >= 0 && d < p.bias_window
               ? x + static_cast<T>(p.bias[static_cast<int64_t>(h) * p.bias_window + d])
               : x;
  }
  template <typename T>
  ADAATTN_HD static T grad(const AttnParams&, T, T) {
    return T(1);
  }
  // The table entry of (i, j): the distance i - j, or -1 outside the table.
  ADAATTN_HD static int param_slot(const AttnParams& p, int i, int j) {
    const int d = i - j;
    return d >= 0 && d < p.bias_window ? d : -1;
  }
  ADAATTN_HD static bool wants_param_grad(const AttnParams& p) { return p.dbias != nullptr; }
  // The table's gradient dbias [Hq, param_size] (null: not asked for).
  ADAATTN_HD static float* param_grad(const AttnParams& p) { return p.dbias; }
  ADAATTN_HD static int param_size(const AttnParams& p) { return p.bias_window; }
  // Slots param_slot can return in this problem: i - j <= Lk - 1, so min(W, Lk) (the size of a
  // partial table; the entries past it get a zero gradient).
  ADAATTN_HD static int param_slots(const AttnParams& p) {
    return p.bias_window < p.len_k ? p.bias_window : p.len_k;
  }
};

}  // namespace adaattn
