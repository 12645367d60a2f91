// The softmax transform: a = p, normalised, one online pass (flash attention).
#pragma once

#include "variant.h"

namespace adaattn {

struct SoftmaxTransform {
  static constexpr bool kNormalized = true;
  static constexpr bool kRowParamGrad = false;
  static constexpr bool kCountsZeros = false;

  template <typename T>
  ADAATTN_HD static T row_term(const AttnParams&, int, int) {
    return T(0);
  }
  template <typename T>
  ADAATTN_HD static T weight(T prob, T) {
    return prob;
  }
  template <typename T>
  ADAATTN_HD static bool live(T, T) {
    return true;
  }
  template <typename T>
  ADAATTN_HD static T row_term_grad(const AttnParams&, int) {
    return T(0);
  }
  ADAATTN_HD static bool wants_param_grad(const AttnParams&) { return false; }
};

}  // namespace adaattn
