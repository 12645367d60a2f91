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
  // Entries per head of the table.
  ADAATTN_HD static int param_count(const AttnParams& p) { return p.bias_window; }
  // The key that row position i reads entry `slot` with (param_slot's inverse), or a negative
  // value when none.
  ADAATTN_HD static int param_key(const AttnParams&, int i, int slot) { return i - slot; }
  // The table gradient, [Hq, param_count] float32 (non-null when wants_param_grad).
  ADAATTN_HD static float* param_grad_out(const AttnParams& p) { return p.dbias; }
};

}  // namespace adaattn
