// The composed score modifier: softcap, ALiBi and the relative-bias table in one type whose
// members are off when their argument is (softcap 0, null slopes, null table), so that any
// combination costs one instantiation instead of one per combination. Order (docs/ops.md):
//   s = c tanh(x / c)                    softcap, on the scaled score x = scale q_i.k_j
//   s -= slope[b, h] |i - j|             ALiBi (flash-attn's, i the bottom-right aligned position)
//   s += bias[h, i - j], 0 <= i - j < W  the relative-bias table (rel_bias.h), learnable
// then the mask and the softmax. ds/dx is the softcap's (the additive terms have unit
// derivative); the table's gradient sums dS over param_slot as RelBiasMod's.
#pragma once

#include <cmath>

#include "rel_bias.h"
#include "variant.h"

namespace adaattn {

struct ComposedMod {
  static constexpr bool kIdentity = false;
  static constexpr bool kUnitGrad = false;
  static constexpr bool kParamGrad = true;
  static constexpr bool kPositional = true;
  static constexpr bool kFoldsScale = false;

  template <typename T>
  ADAATTN_HD static T apply(const AttnParams& p, int b, int h, int i, int j, T x) {
    using std::tanh;
    T s = x;
    if (p.softcap > 0) {
      const T c = static_cast<T>(p.softcap);
      s = c * tanh(x / c);
    }
    if (p.alibi_slopes != nullptr) {
      const int d = i > j ? i - j : j - i;
      s -= static_cast<T>(p.alibi_slopes[b * p.alibi_batch_stride + h]) * static_cast<T>(d);
    }
    if (p.bias != nullptr) s = RelBiasMod::apply(p, b, h, i, j, s);
    return s;
  }
  // From x, not s: s carries the additive terms.
  template <typename T>
  ADAATTN_HD static T grad(const AttnParams& p, T x, T) {
    using std::tanh;
    if (!(p.softcap > 0)) return T(1);
    const T t = tanh(x / static_cast<T>(p.softcap));
    return T(1) - t * t;
  }
  ADAATTN_HD static int param_slot(const AttnParams& p, int i, int j) {
    return p.bias != nullptr ? RelBiasMod::param_slot(p, i, j) : -1;
  }
  ADAATTN_HD static bool wants_param_grad(const AttnParams& p) { return p.dbias != nullptr; }
  ADAATTN_HD static int param_slots(const AttnParams& p) { return RelBiasMod::param_slots(p); }
  ADAATTN_HD static int param_count(const AttnParams& p) { return p.bias_window; }
  ADAATTN_HD static int param_key(const AttnParams& p, int i, int slot) {
    return RelBiasMod::param_key(p, i, slot);
  }
  ADAATTN_HD static float* param_grad_out(const AttnParams& p) { return p.dbias; }
};

}  // namespace adaattn
