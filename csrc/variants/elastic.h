// The elastic transform of lazy attention (spec 3.2): a_ij = max(0, p_ij + tau_h / (i + 1)),
// not renormalised. The weights need the finished row lse (an lse pass first); the backward's
// M_ij = [p_ij + tau_h / (i + 1) > 0] makes Delta_i = sum_j M p dA != dO.o, and
// dtau_h = sum_i G_i / (i + 1) with G_i = sum_j M_ij dA_ij.
#pragma once

#include "variant.h"

namespace adaattn {

struct ElasticTransform {
  static constexpr bool kNormalized = false;
  static constexpr bool kRowParamGrad = true;
  static constexpr bool kCountsZeros = true;

  // The shift tau_h / (i + 1) added to every probability of the row at position i.
  template <typename T>
  ADAATTN_HD static T row_term(const AttnParams& p, int h, int i) {
    return static_cast<T>(p.tau[h]) / static_cast<T>(i + 1);
  }
  // max(0, p + c) that keeps a NaN (as torch.clamp does) instead of hiding it as a zero weight.
  template <typename T>
  ADAATTN_HD static T weight(T prob, T c) {
    const T a = prob + c;
    return a < T(0) ? T(0) : a;
  }
  template <typename T>
  ADAATTN_HD static bool live(T prob, T c) {
    return prob + c > T(0);
  }
  // d c_i / d tau_h.
  template <typename T>
  ADAATTN_HD static T row_term_grad(const AttnParams&, int i) {
    return T(1) / static_cast<T>(i + 1);
  }
  ADAATTN_HD static bool wants_param_grad(const AttnParams& p) { return p.dtau != nullptr; }
  // The parameter's gradient dtau [Hq] (null: not asked for).
  ADAATTN_HD static float* param_grad(const AttnParams& p) { return p.dtau; }
};

}  // namespace adaattn
