// The softmax transform with attention sinks (gpt-oss): a per-head logit sink_h joins every
// row's softmax denominator and attends to nothing,
//   lse_i = log(exp(sink_h) + sum_j exp(s_ij)),  p_ij = exp(s_ij - lse_i),  o_i = sum_j p_ij v_j,
// so a row that sees no key has lse = sink_h and o = 0. The online softmax starts from the sink
// as from a first key of zero value (row_init). Backward: the sink's value is zero, so
// Delta_i = dO_i.o_i and dS are the softmax's, and
//   d sink_h = -sum_i exp(sink_h - lse_i) Delta_i
// over every (b, row) of head h (lse_param_term). Off (plain softmax) when p.sinks is null.
#pragma once

#include <cmath>

#include "softmax.h"

namespace adaattn {

struct SinkSoftmaxTransform : SoftmaxTransform {
  static constexpr bool kLseParamGrad = true;

  // The online softmax's state before the first key: the sink as a key of weight 1 at max
  // sink_h (none for a -inf sink, or without sinks).
  template <typename T>
  ADAATTN_HD static void row_init(const AttnParams& p, int h, T& row_max, T& row_sum) {
    const T sink = p.sinks != nullptr ? static_cast<T>(p.sinks[h]) : -static_cast<T>(INFINITY);
    const bool live = sink != -static_cast<T>(INFINITY);
    row_max = sink;
    row_sum = live ? T(1) : T(0);
  }
  ADAATTN_HD static bool wants_lse_param_grad(const AttnParams& p) { return p.dsinks != nullptr; }
  // Row i's share of d sink_h from its finished lse and Delta_i.
  template <typename T>
  ADAATTN_HD static T lse_param_term(const AttnParams& p, int h, T lse, T delta) {
    using std::exp;
    const T sink = static_cast<T>(p.sinks[h]);
    if (sink == -static_cast<T>(INFINITY)) return T(0);
    return -exp(sink - lse) * delta;
  }
  ADAATTN_HD static float* lse_param_grad_out(const AttnParams& p) { return p.dsinks; }
};

}  // namespace adaattn
