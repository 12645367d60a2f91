// The softmax transform: a = p, normalised, one online pass (flash attention).
#pragma once

#include <cmath>

#include "variant.h"

namespace adaattn {

struct SoftmaxTransform {
  static constexpr bool kNormalized = true;
  static constexpr bool kRowParamGrad = false;
  static constexpr bool kCountsZeros = false;
  static constexpr bool kLseParamGrad = false;

  // The online softmax's state before the first key (normalised transforms).
  template <typename T>
  ADAATTN_HD static void row_init(const AttnParams&, int, T& row_max, T& row_sum) {
    row_max = -static_cast<T>(INFINITY);
    row_sum = T(0);
  }

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
