// The softcap score modifier (Gemma 2; spec 3.6): s = c tanh(x / c) after scaling, c > 0.
// ds/dx = 1 - tanh^2 = 1 - (s / c)^2.
#pragma once

#include <cmath>

#include "variant.h"

namespace adaattn {

struct SoftcapMod {
  static constexpr bool kIdentity = false;
  static constexpr bool kUnitGrad = false;
  static constexpr bool kParamGrad = false;
  static constexpr bool kPositional = false;

  template <typename T>
  ADAATTN_HD static T apply(const AttnParams& p, int, int, int, T x) {
    using std::tanh;
    const T c = static_cast<T>(p.softcap);
    return c * tanh(x / c);
  }
  template <typename T>
  ADAATTN_HD static T grad(const AttnParams& p, T, T s) {
    const T r = s / static_cast<T>(p.softcap);
    return T(1) - r * r;
  }
  ADAATTN_HD static int param_slot(const AttnParams&, int, int) { return -1; }
  ADAATTN_HD static bool wants_param_grad(const AttnParams&) { return false; }
};

}  // namespace adaattn
