// The variant interface. Every attention kernel (CPU, exact CUDA, tensor-core SM80 and Hopper,
// forward and backward) is written once over a Variant = score modifier + probability
// transform; the mask (core/mask.h, seq.h, tiles.h) is the other, independent policy.
//
//   s_ij = Mod(scale * q_i.k_j; h, i, j)      score modifier (i = row_position, j = key)
//   p_ij = exp(s_ij - lse_i)                  softmax over the row's attended keys
//   a_ij = Transform::weight(p_ij, c_i)       probability transform, c_i = row_term(h, i)
//   o_i  = sum_j a_ij v_j   (divided by the row sum when Transform::kNormalized)
//
// Backward, with dA_ij = dO_i.v_j and M_ij = Transform::live(p_ij, c_i):
//   dS_ij = p_ij (M_ij dA_ij - Delta_i) * Mod::grad(x_ij, s_ij),  dq = scale dS k, ...
//   Delta_i = sum_j M_ij p_ij dA_ij           the backward row term; for a normalised transform
//                                             it equals dO_i.o_i (the delta kernel)
//   parameter gradients: Mod's from dS (Mod::param_slot), Transform's from G_i = sum_j M dA.
//
// A score modifier is a type with
//   kIdentity      Mod(x) == x: the kernels fold the scale into the exponent
//   kUnitGrad      d Mod / dx == 1: the backward skips the factor
//   kParamGrad     it has a learnable table whose gradient sums dS_ij over param_slot(i, j)
//   kPositional    it reads the positions (i, j), not only x
//   apply(p, h, i, j, x) -> s, grad(p, x, s) -> ds/dx, param_slot(p, i, j) -> table index or -1
//   wants_param_grad(p)   the caller asked for the table's gradient
//   with kParamGrad also: param_grad(p) -> the float [Hq, param_size(p)] gradient output (or
//   null), param_slots(p) -> how many leading slots param_slot can return in this problem
//   (partial tables need no more; the gradient of the slots past them is 0)
// and, for the tensor-core kernels (variants/*_tc.h), the same on accumulator fragments.
// A probability transform is a type with
//   kNormalized    one online pass, o /= row sum, Delta = dO.o; else an lse pass before the
//                  weights and a backward row pass for Delta (and G)
//   kRowParamGrad  it has a per-head parameter whose gradient sums G_i * row_term_grad(i)
//   row_term(p, h, i) -> c_i, weight(p, c) -> a, live(p, c) -> M, row_term_grad(p, i)
//   kCountsZeros   the forward can count zero weights (AttnParams::stats)
//   with kRowParamGrad also: param_grad(p) -> the float [Hq] gradient output (or null)
#pragma once

#include "../core/params.h"
#include "../core/seq.h"

namespace adaattn {

template <typename ModT, typename TransformT>
struct Variant {
  using Mod = ModT;
  using Transform = TransformT;
  static constexpr bool kNormalized = Transform::kNormalized;
};

// The identity score modifier.
struct NoScoreMod {
  static constexpr bool kIdentity = true;
  static constexpr bool kUnitGrad = true;
  static constexpr bool kParamGrad = false;
  static constexpr bool kPositional = false;

  template <typename T>
  ADAATTN_HD static T apply(const AttnParams&, int, int, int, T x) {
    return x;
  }
  template <typename T>
  ADAATTN_HD static T grad(const AttnParams&, T, T) {
    return T(1);
  }
  ADAATTN_HD static int param_slot(const AttnParams&, int, int) { return -1; }
  ADAATTN_HD static bool wants_param_grad(const AttnParams&) { return false; }
};

}  // namespace adaattn
