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
// The distance of element (ni, e) is a thread constant + 8 (e/2 - ni) - e%2 (S; S^T: + 8 (ni -
// e/2) + e%2), so the 4 NT elements of a row group take 2 (NT + 1) table entries: each is
// loaded once and added to the (up to) two elements at its distance.
template <bool kKeyRows, int MI, int NT>
__device__ __forceinline__ void add_bias(float (&s)[MI][NT][4], const AttnParams& p,
                                         const SeqLens& lens, int h, int r0, int c0, int lane) {
  const float* bias = p.bias + static_cast<int64_t>(h) * p.bias_window;
  const unsigned window = static_cast<unsigned>(p.bias_window);
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
    // Distance of element (ni = 0, e = 0); k below is e/2 - ni (S) or ni - e/2 (S^T).
    const int d0 = kKeyRows ? lazy_position(lens, c0 + 2 * t) - (r0 + mi * 16 + g)
                            : lazy_position(lens, r0 + mi * 16 + g) - (c0 + 2 * t);
#pragma unroll
    for (int k = kKeyRows ? -1 : 1 - NT; k <= (kKeyRows ? NT - 1 : 1); ++k)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int d = kKeyRows ? d0 + 8 * k + c : d0 + 8 * k - c;
        const float b = static_cast<unsigned>(d) < window ? __ldg(bias + d) * float(M_LOG2E) : 0.f;
        // (e/2, ni) pairs at this k: S: (0, -k) and (1, 1 - k); S^T: (0, k) and (1, k + 1).
        const int ni_top = kKeyRows ? k : -k;
        const int ni_bottom = kKeyRows ? k + 1 : 1 - k;
        if (ni_top >= 0 && ni_top < NT) s[mi][ni_top][c] += b;
        if (ni_bottom >= 0 && ni_bottom < NT) s[mi][ni_bottom][2 + c] += b;
      }
  }
}

}  // namespace tc
}  // namespace adaattn
