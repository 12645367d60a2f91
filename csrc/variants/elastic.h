// The elastic transform of lazy attention: a_ij = max(0, p_ij + tau_h / (i + 1)),
// not renormalised. The weights need the finished row lse (an lse pass first); the backward's
// M_ij = [p_ij + tau_h / (i + 1) > 0] makes Delta_i = sum_j M p dA != dO.o, and
// dtau_h = sum_i G_i / (i + 1) with G_i = sum_j M_ij dA_ij.
#pragma once

#include <type_traits>

#include "variant.h"

namespace adaattn {

struct ElasticTransform {
  static constexpr bool kNormalized = false;
  static constexpr bool kRowParamGrad = true;
  static constexpr bool kCountsZeros = true;
  static constexpr bool kLseParamGrad = false;

  // The shift tau_h / (i + 1) added to every probability of the row at position i.
  template <typename T>
  ADAATTN_HD static T row_term(const AttnParams& p, int h, int i) {
    return static_cast<T>(p.tau[h]) / static_cast<T>(i + 1);
  }
  // max(0, p + c) that keeps a NaN (as torch.clamp does) instead of hiding it as a zero weight;
  // one instruction on the GPU (max.NaN, sm_80+).
  template <typename T>
  ADAATTN_HD static T weight(T prob, T c) {
    const T a = prob + c;
#if defined(__CUDA_ARCH__)
    if constexpr (std::is_same<T, float>::value) {
      float r;
      asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(0.f));
      return r;
    }
#endif
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
  // The parameter's gradient, [Hq] float32 (non-null when wants_param_grad).
  ADAATTN_HD static float* param_grad_out(const AttnParams& p) { return p.dtau; }

#if defined(__CUDACC__)
  // dtau[h] = sum over (b, rows) of G_i / (i + 1) (p.row_g holds the terms): one CTA per head,
  // fixed-order tree reduction. kThreads threads per CTA, shared memory of kThreads floats.
  template <int kThreads>
  __device__ static void reduce_param_grad(const AttnParams& p, float* partial) {
    const int h = blockIdx.x;
    // Dense: the Lq rows of every (b, h); packed: the Tq rows of head h.
    const int segments = is_packed(p) ? 1 : p.batch;
    float acc = 0.f;
    for (int b = 0; b < segments; ++b) {
      const float* g = p.row_g + (static_cast<int64_t>(b) * p.heads_q + h) * p.len_q;
      for (int r = threadIdx.x; r < p.len_q; r += kThreads) acc += g[r];
    }
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (int width = kThreads / 2; width > 0; width >>= 1) {
      if (static_cast<int>(threadIdx.x) < width) partial[threadIdx.x] += partial[threadIdx.x + width];
      __syncthreads();
    }
    if (threadIdx.x == 0) p.dtau[h] = partial[0];
  }
  // Where the backward's row pass leaves G_i * row_term_grad(i) for reduce_param_grad.
  __device__ __forceinline__ static float* row_grad_terms(const AttnParams& p) { return p.row_g; }
#endif
};

}  // namespace adaattn
