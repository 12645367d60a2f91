// The variant interface. Every attention kernel (CPU, exact CUDA, tensor-core SM80 and Hopper,
// forward and backward) is written once over a Variant = score modifier + probability
// transform; the mask (core/mask.h, seq.h, tiles.h) is the other, independent policy.
//
//   s_ij = Mod(scale * q_i.k_j; h, i, j)      score modifier (i = row_position, j = key)
//   p_ij = exp(s_ij - lse_i)                  softmax over the row's attended keys
//   a_ij = Transform::weight(p_ij, c_i)       probability transform, c_i = row_term(h, pos_i)
//                                             (pos_i = query_position: the row's place in the
//                                             sequence; row_position plus the position of key 0
//                                             for a block of a sharded sequence, seq.h)
//   o_i  = sum_j a_ij v_j   (divided by the row sum when Transform::kNormalized)
//
// Backward, with dA_ij = dO_i.v_j and M_ij = Transform::live(p_ij, c_i):
//   dS_ij = p_ij (M_ij dA_ij - Delta_i)       the gradient of s_ij
//   dX_ij = dS_ij * Mod::grad(x_ij, s_ij)     of x_ij = scale q_i.k_j: dq = scale dX k, ...
//   Delta_i = sum_j M_ij p_ij dA_ij           the backward row term; for a normalised transform
//                                             it equals dO_i.o_i (the delta kernel)
//   parameter gradients: Mod's table (added to the score) sums dS over Mod::param_slot;
//   Transform's sums G_i = sum_j M_ij dA_ij times row_term_grad(i).
//
// A score modifier is a type with
//   kIdentity      Mod(x) == x: the kernels fold the scale into the exponent
//   kUnitGrad      d Mod / dx == 1: the backward skips the factor
//   kParamGrad     it has a learnable table, added to the score, whose gradient sums dS_ij over
//                  param_slot(i, j); such a modifier also has param_count(p) (entries per
//                  head), param_key(p, i, slot) (the key j with param_slot(p, i, j) == slot, or
//                  < 0: a row reads each entry at most once) and param_grad_out(p) (the
//                  [Hq, param_count] float32 gradient) and param_slots(p) (how many leading
//                  slots param_slot can return in this problem: partial tables need no more)
//   kPositional    it reads the positions (i, j), not only x
//   kScaledTerms   on the tensor cores, where terms_only(p) (it adds terms of (b, h, i, j) and
//                  maps x by nothing), modify_frag's last argument `scale` takes raw scores q.k:
//                  each becomes scale * s + terms in one FFMA (the softmax scale costs no pass
//                  of its own); modify_frag with scale 1 is the plain form
//   kFoldsScale    on the tensor cores it takes raw scores q.k and returns the factor that takes
//                  its output to log2 units (modify_raw_frag(s, p)), which the exponent's FMA
//                  then applies: the softmax scale never costs a pass of its own
//   apply(p, b, h, i, j, x) -> s (b the batch entry or packed sequence), grad(p, x, s) -> ds/dx,
//   param_slot(p, i, j) -> table index or -1
//   wants_param_grad(p)   the caller asked for the table's gradient
//   kAddsTerms     (without kUnitGrad) the modified score is a map g(x), whose derivative
//                  grad_log2 reads, plus terms of derivative 1 that depend on (b, h, i, j)
// and, for the tensor-core kernels, the same on accumulator fragments: tile_active(p, lens,
// first_row, last_row, first_key, last_key) (whether a tile, bounds inclusive, needs the modifier
// at all), modify_frag<kKeyRows>(s, p, lens, b, h, r0, c0, lane) on scores in log2 units, without
// kUnitGrad grad_log2(s2, p) (the derivative from g(x) in log2 units: the modified score, less its
// added terms with kAddsTerms), with kAddsTerms subtract_terms_frag<kKeyRows>(s2, ...)
// (modify_frag's arguments: takes the added terms off modified scores) and grad_active(p) (false:
// the derivative is 1 throughout this problem), with kFoldsScale grad_raw_frag(v, p) (the
// derivative from the value modify_raw_frag left: the Hopper backward folds it into P,
// softmax_frag.h kGradInP), and with kParamGrad the per-CTA partial sums (accumulate_param_grad)
// and their fixed-order reduction (reduce_param_grad).
// The hooks a launcher reads on the host (grad_active, wants_param_grad, param_grad_scratch,
// set_param_grad_scratch, param_grad_items; a transform's wants_lse_param_grad) sit outside the
// __CUDACC__ block: the host-only CPU build then compiles them, and rejects a __device__ one,
// to which nvcc gives a host body of exit(1) without a warning in template code.
// A probability transform is a type with
//   kNormalized    a = p (softmax): one online pass, o /= row sum, Delta = dO.o; else an lse
//                  pass before the weights and a backward row pass for Delta (and G)
//   kRowParamGrad  it has a per-head parameter whose gradient sums G_i * row_term_grad(i);
//                  such a transform also has param_grad_out(p) (the [Hq] float32 gradient)
//   row_term(p, h, i) -> c_i, weight(p, c) -> a, live(p, c) -> M, row_term_grad(p, i)
//   kCountsZeros   the forward can count zero weights (AttnParams::stats)
//   kLseParamGrad  it has a per-head parameter whose gradient sums a term of each row's
//                  finished (lse_i, Delta_i): lse_param_term(p, h, lse, delta), written to
//                  lse_param_grad_out(p) ([Hq] float32) when wants_lse_param_grad(p) (on the
//                  tensor cores a fixed-order reduction after the backward, bwd_common.h)
//   row_init(p, h, max, sum)  (normalised transforms) the online softmax's state before the
//                  first key: -inf and 0, or a sink's logit and 1 (sinks.h)
// and, with kRowParamGrad on the tensor cores, reduce_param_grad over the row pass's terms.
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
  static constexpr bool kFoldsScale = false;
  static constexpr bool kAddsTerms = false;
  static constexpr bool kScaledTerms = false;

  template <typename T>
  ADAATTN_HD static T apply(const AttnParams&, int, int, int, int, T x) {
    return x;
  }
  template <typename T>
  ADAATTN_HD static T grad(const AttnParams&, T, T) {
    return T(1);
  }
  ADAATTN_HD static int param_slot(const AttnParams&, int, int) { return -1; }
  ADAATTN_HD static bool wants_param_grad(const AttnParams&) { return false; }
#if defined(__CUDACC__)
  __device__ __forceinline__ static bool tile_active(const AttnParams&, const SeqLens&, int, int,
                                                    int, int) {
    return false;
  }
  template <bool kKeyRows, int MI, int NT>
  __device__ __forceinline__ static void modify_frag(float (&)[MI][NT][4], const AttnParams&,
                                                     const SeqLens&, int, int, int, int, int) {}
#endif
};

}  // namespace adaattn
