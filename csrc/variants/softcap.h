// The softcap score modifier (Gemma 2): s = c tanh(x / c) after scaling, c > 0.
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
  static constexpr bool kFoldsScale = true;
  static constexpr bool kAddsTerms = false;
  static constexpr bool kScaledTerms = false;

  template <typename T>
  ADAATTN_HD static T apply(const AttnParams& p, int, int, int, int, T x) {
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

#if defined(__CUDACC__)
  // ---- tensor-core hooks (fragments: csrc/cuda/tc/softmax_frag.h) ----
  __device__ __forceinline__ static bool tile_active(const AttnParams&, const SeqLens&, int, int,
                                                    int, int) {
    return true;
  }
  // On scores in log2 units: s <- C tanh(s / C) with C = softcap * log2(e) (the same map in
  // natural units). tanh.approx (one SFU op, relative error ~2^-11) is far below the fp16/bf16
  // rounding of the probabilities it feeds.
  template <bool kKeyRows, int MI, int NT>
  __device__ __forceinline__ static void modify_frag(float (&s)[MI][NT][4], const AttnParams& p,
                                                     const SeqLens&, int, int, int, int, int) {
    const float cap = static_cast<float>(p.softcap * M_LOG2E);
    const float inv_cap = 1.f / cap;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float t;
          asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(s[mi][ni][e] * inv_cap));
          s[mi][ni][e] = cap * t;
        }
  }
  // The same on raw scores x = q.k with the softmax scale folded in: s <- tanh(x * scale / c),
  // and C = c * log2(e) (> 0 for any scale) goes into the exponent's FMA. One multiply and the
  // tanh per score instead of three multiplies and the tanh.
  template <int MI, int NT>
  __device__ __forceinline__ static float modify_raw_frag(float (&s)[MI][NT][4],
                                                          const AttnParams& p) {
    const float cap = static_cast<float>(p.softcap * M_LOG2E);
    const float in = p.scale_log2 / cap;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          asm("tanh.approx.f32 %0, %1;" : "=f"(s[mi][ni][e]) : "f"(s[mi][ni][e] * in));
        }
    return cap;
  }
  // ds/dx = 1 - t^2 from modify_raw_frag's t = tanh(x * scale / c).
  __device__ __forceinline__ static float grad_raw_frag(float t, const AttnParams&) {
    return fmaf(-t, t, 1.f);
  }
  // ds/dx = 1 - tanh^2 = 1 - (s2 / C)^2 from the modified score s2 in log2 units.
  __device__ __forceinline__ static float grad_log2(float s2, const AttnParams& p) {
    const float r = s2 / static_cast<float>(p.softcap * M_LOG2E);
    return fmaf(-r, r, 1.f);
  }
#endif
};

}  // namespace adaattn
