// The composed score modifier: softcap, ALiBi and the relative-bias table in one type whose
// members are off when their argument is (softcap 0, null slopes, null table), so that any
// combination costs one instantiation instead of one per combination. Order (docs/ops.md):
//   s = c tanh(x / c)                    softcap, on the scaled score x = scale q_i.k_j
//   s -= slope[b, h] |i - j|             ALiBi (flash-attn's, i the bottom-right aligned position)
//   s += bias[h, i - j], 0 <= i - j < W  the relative-bias table (rel_bias.h), learnable
// then the mask and the softmax. ds/dx is the softcap's (the additive terms have unit
// derivative); the table's gradient sums dS over param_slot as RelBiasMod's. On the tensor
// cores the backward reads the softcap's derivative from the modified score less the added
// terms (kAddsTerms), since the additive terms would otherwise enter tanh's value.
#pragma once

#include <cmath>

#include "rel_bias.h"
#include "softcap.h"
#include "variant.h"

namespace adaattn {

struct ComposedMod {
  static constexpr bool kIdentity = false;
  static constexpr bool kUnitGrad = false;
  static constexpr bool kParamGrad = true;
  static constexpr bool kPositional = true;
  static constexpr bool kFoldsScale = false;
  static constexpr bool kAddsTerms = true;
  static constexpr bool kScaledTerms = true;

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

  // ---- launcher hooks (read on the host: see RelBiasMod's) ----
  // The derivative is 1 without a softcap.
  ADAATTN_HD static bool grad_active(const AttnParams& p) { return p.softcap > 0; }
  static int64_t param_grad_scratch(const AttnParams& p, int64_t key_slots) {
    return RelBiasMod::param_grad_scratch(p, key_slots);
  }
  static void set_param_grad_scratch(AttnParams& p, float* scratch) {
    RelBiasMod::set_param_grad_scratch(p, scratch);
  }
  static int64_t param_grad_items(const AttnParams& p) { return RelBiasMod::param_grad_items(p); }

#if defined(__CUDACC__)
  // ---- tensor-core hooks (fragments: csrc/cuda/tc/softmax_frag.h) ----

  // Every tile under a softcap or ALiBi (|i - j| > 0 off the diagonal); the table's tiles
  // otherwise. A call with none of the three (sinks only) modifies nothing.
  __device__ __forceinline__ static bool tile_active(const AttnParams& p, const SeqLens& lens,
                                                    int first_row, int last_row, int first_key,
                                                    int last_key) {
    return p.softcap > 0 || p.alibi_slopes != nullptr ||
           (p.bias != nullptr &&
            RelBiasMod::tile_active(p, lens, first_row, last_row, first_key, last_key));
  }
  // ALiBi and the table are terms of the score; a softcap maps it first (kScaledTerms).
  __device__ __forceinline__ static bool terms_only(const AttnParams& p) {
    return !(p.softcap > 0);
  }
  // On scores in log2 units, in the order above (with terms_only, `scale` may take raw scores
  // there). Layouts as RelBiasMod::modify_frag's (b the batch entry or packed sequence).
  template <bool kKeyRows, int MI, int NT>
  __device__ __forceinline__ static void modify_frag(float (&s)[MI][NT][4], const AttnParams& p,
                                                    const SeqLens& lens, int b, int h, int r0,
                                                    int c0, int lane, float scale = 1.f) {
    if (p.softcap > 0) SoftcapMod::modify_frag<kKeyRows>(s, p, lens, b, h, r0, c0, lane);
    add_terms<kKeyRows>(s, p, lens, b, h, r0, c0, lane, 1.f, scale);
  }
  // Takes ALiBi and the table off modified scores (log2 units): what is left is c tanh(x / c).
  template <bool kKeyRows, int MI, int NT>
  __device__ __forceinline__ static void subtract_terms_frag(float (&s)[MI][NT][4],
                                                            const AttnParams& p,
                                                            const SeqLens& lens, int b, int h,
                                                            int r0, int c0, int lane) {
    add_terms<kKeyRows>(s, p, lens, b, h, r0, c0, lane, -1.f);
  }
  // The softcap's 1 - tanh^2 from c tanh(x / c) in log2 units.
  __device__ __forceinline__ static float grad_log2(float s2, const AttnParams& p) {
    return SoftcapMod::grad_log2(s2, p);
  }

  // The table's gradient: RelBiasMod's partial sums and reduction, over the tiles that read the
  // table (the condition is the same for the whole CTA, as its barriers need).
  template <int kBlockN, int BM, int kStageKeys, int kStride, int kThreads, int MI, int NT,
            typename Sync>
  __device__ static void accumulate_param_grad(const AttnParams& p, const SeqLens& lens,
                                               float* sStage, const float (&ds)[MI][NT][4],
                                               int h, int m0, int n0, int slot, int warp_row0,
                                               int lane, int tid, const Sync& sync) {
    if (!RelBiasMod::tile_active(p, lens, m0, m0 + BM - 1, n0, n0 + kBlockN - 1)) return;
    RelBiasMod::accumulate_param_grad<kBlockN, BM, kStageKeys, kStride, kThreads>(
        p, lens, sStage, ds, h, m0, n0, slot, warp_row0, lane, tid, sync);
  }
  template <int kThreads>
  __device__ static void reduce_param_grad(const AttnParams& p, int64_t slots) {
    RelBiasMod::reduce_param_grad<kThreads>(p, slots);
  }

  // sign * (-slope[b, h] |i - j| + bias[h, i - j]) in log2 units added to score fragments
  // (layouts: add_by_distance). Both terms are functions of the distance alone: one pass
  // evaluates them once per distance (a single pass over the fragment, and half the terms, of
  // one pass per term).
  template <bool kKeyRows, int MI, int NT>
  __device__ __forceinline__ static void add_terms(float (&s)[MI][NT][4], const AttnParams& p,
                                                  const SeqLens& lens, int b, int h, int r0,
                                                  int c0, int lane, float sign,
                                                  float scale = 1.f) {
    const bool alibi = p.alibi_slopes != nullptr;
    const bool table = p.bias != nullptr;
    if (!alibi && !table) {
      if (scale != 1.f) {
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int ni = 0; ni < NT; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mi][ni][e] *= scale;
      }
      return;
    }
    const float unit = sign * float(M_LOG2E);
    const float slope2 = alibi ? -unit * p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.f;
    if (!table) {  // ALiBi alone: no table bound to test per distance
      // Off the diagonal every distance of the fragment has one sign: |d| = sign * d is linear,
      // one FFMA per distance. The fragment's rows and keys (add_by_distance's layouts):
      const int first_row = kKeyRows ? c0 : r0;
      const int last_row = first_row + (kKeyRows ? 8 * NT : 16 * MI) - 1;
      const int first_key = kKeyRows ? r0 : c0;
      const int last_key = first_key + (kKeyRows ? 16 * MI : 8 * NT) - 1;
      const bool below = row_position(lens, first_row) - last_key >= 0;  // every d >= 0
      const bool above = row_position(lens, last_row) - first_key <= 0;  // every d <= 0
      if (below || above) {
        const float signed_slope = below ? slope2 : -slope2;
        add_by_distance<kKeyRows>(s, lens, r0, c0, lane, [&](int, float d0f, float of) {
          return fmaf(signed_slope, of, signed_slope * d0f);
        }, scale);
      } else {
        add_by_distance<kKeyRows>(s, lens, r0, c0, lane, [&](int, float d0f, float of) {
          return slope2 * fabsf(d0f + of);
        }, scale);
      }
      return;
    }
    const unsigned window = static_cast<unsigned>(p.bias_window);
    const float* bias = p.bias + static_cast<int64_t>(h) * p.bias_window;
    add_by_distance<kKeyRows>(s, lens, r0, c0, lane, [&](int d, float d0f, float of) {
      const float a = slope2 * fabsf(d0f + of);
      return static_cast<unsigned>(d) < window ? fmaf(__ldg(bias + d), unit, a) : a;
    }, scale);
  }
#endif
};

}  // namespace adaattn
