// Attention variants of the tensor-core kernels. The mainloops (flash_fwd_kernel.h,
// flash_bwd_kernel.h) are shared; a variant decides what happens between S = Q K^T and the
// products with V / dO:
//   SoftmaxVariant  exact softmax, one online pass (flash attention, spec 3.1)
//   LazyVariant     distance bias on the scores, elastic softmax a = max(0, p + tau/(i+1))
//                   without renormalisation, so the forward takes an lse pass and a weight
//                   pass (lazy attention, spec 3.2; math in core/lazy.h)
#pragma once

#include <cmath>

#include "../../core/lazy.h"

namespace adaattn {
namespace tc {

struct SoftmaxVariant {
  static constexpr bool kElastic = false;
};

struct LazyVariant {
  static constexpr bool kElastic = true;
};

// True when a (rows, keys) tile holds some pair at distance i - j < W, i.e. needs the bias table:
// the smallest distance is pos(first row) - (last key).
__device__ __forceinline__ bool tile_meets_bias(const AttnParams& p, const SeqLens& lens,
                                                int first_row, int last_key) {
  return lazy_position(lens, first_row) - last_key < p.bias_window;
}

// Adds the distance bias (in log2 units) to score fragments. kKeyRows = false: fragments laid
// out [rows][keys] (S), element (mi, ni, e) is row r0 + mi*16 + g + 8*(e/2), key
// c0 + ni*8 + 2t + e%2. kKeyRows = true: laid out [keys][rows] (S^T in the dK/dV pass), element
// (mi, ni, e) is key r0 + mi*16 + g + 8*(e/2), row c0 + ni*8 + 2t + e%2.
template <bool kKeyRows, int MI, int NT>
__device__ __forceinline__ void add_bias(float (&s)[MI][NT][4], const AttnParams& p,
                                         const SeqLens& lens, int h, int r0, int c0, int lane) {
  const float* bias = p.bias + static_cast<int64_t>(h) * p.bias_window;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int frag_row = r0 + mi * 16 + g + 8 * (e >> 1);
        const int frag_col = c0 + ni * 8 + 2 * t + (e & 1);
        const int d = kKeyRows ? lazy_position(lens, frag_col) - frag_row
                               : lazy_position(lens, frag_row) - frag_col;
        if (d >= 0 && d < p.bias_window) s[mi][ni][e] += __ldg(bias + d) * float(M_LOG2E);
      }
}

}  // namespace tc
}  // namespace adaattn
