// Fragment-level pieces of the attention mainloops, shared by the SM80 and Hopper kernels and
// naming no kernel: row ranges and masking of score fragments, the online softmax, the weight
// pass of a non-normalised transform (variants/variant.h) and its statistics, and the score
// modifier applied to a tile. Fragments are laid out as mma.sync accumulators (a warp's rows of
// a wgmma accumulator are laid out the same way): s[mi][ni][e] is row r0 + mi*16 + g + 8*(e/2),
// key c0 + ni*8 + 2t + e%2 (g = lane / 4, t = lane % 4); "key rows" fragments (S^T) swap them.
#pragma once

#include <cmath>
#include <type_traits>

#include "../../core/mask.h"
#include "../../core/params.h"
#include "mma.h"

namespace adaattn {
namespace tc {

// Per-thread view of the rows it holds in accumulator fragments: rows g and g + 8 of each of
// the warp's MI 16-row groups.
template <int MI>
struct RowRanges {
  int lo[MI][2];
  int hi[MI][2];
};

// The key ranges of rows row0 + g and row0 + g + 8 (g = lane / 4) of a warp's 16.
__device__ __forceinline__ RowRanges<1> warp_row_ranges(const AttnParams& p, const SeqLens& lens,
                                                        int row0, int lane) {
  RowRanges<1> rr;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const KeyRange r = key_range(p, lens, row0 + (lane >> 2) + 8 * hh);
    rr.lo[0][hh] = r.lo;
    rr.hi[0][hh] = r.hi;
  }
  return rr;
}

// Sets scores outside each row's key range to -inf. Scores are [MI][NT] fragments whose column
// n-tile ni starts at key n0 + 8 * ni.
template <int MI, int NT>
__device__ __forceinline__ void mask_scores(float (&s)[MI][NT][4], const RowRanges<MI>& rr, int n0,
                                            int lane) {
  const int t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        const int col = n0 + ni * 8 + 2 * t + (e & 1);
        if (col < rr.lo[mi][h] || col >= rr.hi[mi][h]) s[mi][ni][e] = -INFINITY;
      }
}

// x[0] op ... op x[N - 1] as a pairwise tree (depth log2 N).
template <int N, typename Op>
__device__ __forceinline__ float fold_pairwise(float (&x)[N], Op op) {
#pragma unroll
  for (int w = 1; w < N; w *= 2)
#pragma unroll
    for (int i = 0; i + w < N; i += 2 * w) x[i] = op(x[i], x[i + w]);
  return x[0];
}

// Online max/sum update of one score tile for the rows this thread holds; returns the factor
// by which earlier partial results of each row must be rescaled. The scores in log2 units are
// s (kRaw = false) or scale * s with scale > 0 (kRaw = true: the max is taken on the raw scores
// and each exponent is one FMA, which saves the scaling pass). The running max moves only when
// the tile's exceeds it by more than `slack` (then corr = 1 and the caller may skip the
// rescale); exponents stay below 2^slack. The probabilities (and the row sum) come out
// multiplied by 2^log2_gain (the 8-bit forward's fixed P scale, folded into the exponent).
// With one row group per warp (MI = 1, the Hopper kernels' wgmma accumulators: two rows per
// thread) the row max and row sum are trees, and the sum is taken after all the exponentials:
// a chain of adds interleaved with them made the warp wait on each exponential's latency, and
// a warpgroup's softmax runs beside few other warps. Standalone Hopper forward, same call,
// H100, bf16, B = 4, H = 16, L = 4096, medians of 25 launches: 0.762 / 0.755 / 0.771 / 0.764 ->
// 0.702 / 0.708 / 0.710 / 0.714 ms at the 32-wide low-rank scores (Dv = 128), 0.868 / 0.872 /
// 0.871 / 0.872 -> 0.856 / 0.863 / 0.859 / 0.858 ms at D = 128; four independent chains per row
// interleaved with the exponentials instead: no gain (0.754-0.776 and 0.877-0.908 ms). MI = 2
// (the SM80 kernels) keeps one chain per row, four per thread: the trees' temporaries made the
// SM80 forward spill 292 instead of 208 bytes.
// kBiasedInt (with kRaw): the raw scores are integers x held as the floats 1.5 * 2^23 + x
// (s32_to_float without its subtraction), whose order is x's; the bias leaves through the
// exponent's FMA (one rounding of a per-row constant).
template <bool kRaw = false, bool kBiasedInt = false, int MI, int NT>
__device__ __forceinline__ void online_softmax(float (&s)[MI][NT][4], float (&row_max)[MI][2],
                                               float (&row_sum)[MI][2], float (&corr)[MI][2],
                                               float scale = 1.f, float slack = 0.f,
                                               float log2_gain = 0.f) {
  if constexpr (!kRaw) scale = 1.f;
  constexpr bool kTrees = MI == 1;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float mx = kRaw ? -INFINITY : row_max[mi][hh];
      if constexpr (kTrees) {
        float part[NT];
#pragma unroll
        for (int ni = 0; ni < NT; ++ni) {
          part[ni] = fmaxf(s[mi][ni][2 * hh], s[mi][ni][2 * hh + 1]);
        }
        mx = fmaxf(mx, fold_pairwise(part, [](float a, float b) { return fmaxf(a, b); }));
      } else {
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
          mx = fmaxf(mx, fmaxf(s[mi][ni][2 * hh], s[mi][ni][2 * hh + 1]));
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      constexpr float kIntBias = 12582912.f;
      if constexpr (kRaw) mx = fmaxf(row_max[mi][hh], (kBiasedInt ? mx - kIntBias : mx) * scale);
      if (!(mx - row_max[mi][hh] > slack)) mx = row_max[mi][hh];
      const float base = mx == -INFINITY ? 0.f : mx;
      corr[mi][hh] = exp2f(row_max[mi][hh] - base);
      row_max[mi][hh] = mx;
      const float shift = kBiasedInt ? fmaf(kIntBias, scale, base - log2_gain) : base - log2_gain;
      float sum = 0.f;
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = kRaw ? fmaf(s[mi][ni][2 * hh + e], scale, -shift)
                         : s[mi][ni][2 * hh + e] - shift;
          const float pe = exp2f(x);
          s[mi][ni][2 * hh + e] = pe;
          if constexpr (!kTrees) sum += pe;
        }
      if constexpr (kTrees) {
        float part[NT];
#pragma unroll
        for (int ni = 0; ni < NT; ++ni) part[ni] = s[mi][ni][2 * hh] + s[mi][ni][2 * hh + 1];
        sum = fold_pairwise(part, [](float a, float b) { return a + b; });
      }
      row_sum[mi][hh] = row_sum[mi][hh] * corr[mi][hh] + sum;
    }
}

// Whether a row's softmax sum counts attended keys: at least 1 once a finite score is attended,
// exactly 0 when none is (masked and -inf scores weigh exp2(-inf) = 0). A NaN sum counts, so the
// NaN reaches out and lse instead of a zero row: online_softmax's fmaxf skips a NaN score, whose
// own exp2 is NaN, and a +inf score makes the max +inf and its exp2(inf - inf) NaN.
__device__ __forceinline__ bool row_saw_keys(float row_sum) { return row_sum != 0.f; }

// log2-domain lse for recomputing P = exp2(s * scale_log2 - lse2); rows that saw nothing (and
// rows past the tensor) get +inf so that P = 0 exactly.
__device__ __forceinline__ float lse_log2(const float* lse, int row, int len) {
  if (row >= len) return INFINITY;
  const float l = lse[row];
  return l == -INFINITY ? INFINITY : l * float(M_LOG2E);
}

// Weight-pass counters of one thread (AttnParams::stats, for transforms that count zeros).
struct WeightStats {
  int zeros = 0;
  int attended = 0;
  int skipped = 0;
  int visited = 0;

  // Counts one warp tile: `visited` when it has attended entries, `skipped` when its weight
  // product was skipped (the skip granularity is the kernel's: a warp, or a whole CTA).
  __device__ __forceinline__ void tile(bool was_visited, bool was_skipped, int lane) {
    if (lane == 0 && was_visited) {
      ++visited;
      skipped += was_skipped;
    }
  }
};

// Whether a warp's weight tile has any non-zero weight, and any attended entry (kCount only).
struct TileWeights {
  bool any;
  bool visited;
};

__device__ __forceinline__ void flush_stats(int64_t* stats, const WeightStats& st) {
  int zeros = st.zeros, attended = st.attended;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    zeros += __shfl_xor_sync(0xffffffff, zeros, off);
    attended += __shfl_xor_sync(0xffffffff, attended, off);
  }
  if ((threadIdx.x & 31) == 0) {
    auto* c = reinterpret_cast<unsigned long long*>(stats);
    atomicAdd(c + 0, static_cast<unsigned long long>(zeros));
    atomicAdd(c + 1, static_cast<unsigned long long>(attended));
    atomicAdd(c + 2, static_cast<unsigned long long>(st.skipped));
    atomicAdd(c + 3, static_cast<unsigned long long>(st.visited));
  }
}


// Applies the score modifier Mod to a tile of scores already in log2 units (scale applied).
// kKeyRows: the fragments are S^T. Callers skip tiles that Mod::tile_active says it leaves alone.
// b is the batch entry (packed: the sequence), h the query head.
template <typename Mod, bool kKeyRows, int MI, int NT>
__device__ __forceinline__ void modify_scores(float (&s)[MI][NT][4], const AttnParams& p,
                                              const SeqLens& lens, int b, int h, int r0, int c0,
                                              int lane) {
  if constexpr (!Mod::kIdentity) {
    Mod::template modify_frag<kKeyRows>(s, p, lens, b, h, r0, c0, lane);
  }
}

// dS of the modified score times the modifier's derivative, for a modifier whose derivative is
// not 1: the modified score (log2 units) is recovered from the probability, s2 = log2(P) + lse2,
// so the backward keeps no second tile of registers. P = 0 (masked, or underflow) has dS = 0.
template <typename Mod>
__device__ __forceinline__ float raw_score_grad(float ds, float prob, float lse2,
                                                const AttnParams& p) {
  if constexpr (Mod::kUnitGrad) {
    return ds;
  } else {
    return ds * Mod::grad_log2(prob > 0.f ? log2f(prob) + lse2 : 0.f, p);
  }
}

// scale * s + the modifier's terms (log2 units) in one FFMA per score where the modifier adds
// terms only (variant.h, kScaledTerms); false: nothing done (the caller scales, then modifies).
template <typename Mod, bool kKeyRows, int MI, int NT>
__device__ __forceinline__ bool scaled_terms(float (&s)[MI][NT][4], const AttnParams& p,
                                             const SeqLens& lens, int b, int h, int r0, int c0,
                                             int lane, float scale) {
  if constexpr (Mod::kScaledTerms) {
    if (Mod::terms_only(p)) {
      Mod::template modify_frag<kKeyRows>(s, p, lens, b, h, r0, c0, lane, scale);
      return true;
    }
  }
  return false;
}

// The backward's scores: Mod applied to a tile of raw scores q.k (kKeyRows: S^T) where it is
// active; returns the scale that takes them to log2 units in the exponent's FMA. A modifier
// that folds the scale (kFoldsScale) leaves its own value in the fragment, from which
// Mod::grad_raw_frag gives ds/dx (kGradInP).
template <typename Mod, bool kKeyRows, int MI, int NT>
__device__ __forceinline__ float backward_scores(float (&s)[MI][NT][4], const AttnParams& p,
                                                 const SeqLens& lens, int b, int h, int r0,
                                                 int c0, int lane, bool active) {
  if constexpr (Mod::kFoldsScale) {
    return Mod::modify_raw_frag(s, p);
  } else {
    if (Mod::kIdentity || !active) return p.scale_log2;
    if (!scaled_terms<Mod, kKeyRows>(s, p, lens, b, h, r0, c0, lane, p.scale_log2)) {
      scale_frag(s, p.scale_log2);
      modify_scores<Mod, kKeyRows>(s, p, lens, b, h, r0, c0, lane);
    }
    return 1.f;
  }
}

// Whether a Hopper backward keeps P times the modifier's derivative (from backward_scores'
// folded value, before the exponent overwrites it) instead of P: P itself is only the dV
// operand, packed in the same pass, so dS = P ds/dx (dP - Delta) is the raw score's gradient
// at once, without recovering the modified score from log2(P) (an SFU op per score). Not with
// a learnable table, whose gradient needs dS of the modified score.
template <typename Mod>
constexpr bool kGradInP = Mod::kFoldsScale && !Mod::kUnitGrad && !Mod::kParamGrad;

// P^T of a Hopper backward step for a normalised transform, from the S^T fragments (key rows)
// that backward_scores left in st with `scale`: P = exp2(st scale - lse log2 e), lse[c] that of
// the fragment's query column c, and 0 for the columns outside the spans of columns that see
// each of the thread's two keys (seen, from the same first column) unless the tile is full.
// pa gets P as dV's A operand; st keeps P, or P ds/dx where the modifier folds the scale
// (kGradInP), masked after the product (a masked score's derivative may be NaN: 0 * inf from a
// zero padding row against an infinite key). Full tiles (most) take a copy without the mask's
// compares and selects (three instructions per score): 2-3% off the backward on the H100.
template <typename Mod, typename T, int NT>
__device__ __forceinline__ void backward_probs(float (&st)[1][NT][4],
                                               uint32_t (&pa)[1][NT / 2][4], const float* lse,
                                               float scale, const RowSpan (&seen)[2], bool full,
                                               const AttnParams& p, int lane) {
  const int t = lane & 3;
  auto probs = [&](auto masked) {
#pragma unroll
    for (int ni = 0; ni < NT; ++ni) {
      const float2 l = *reinterpret_cast<const float2*>(lse + ni * 8 + 2 * t);
      const float lse2[2] = {l.x * float(M_LOG2E), l.y * float(M_LOG2E)};
      float pr[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float pe = exp2f(fmaf(st[0][ni][e], scale, -lse2[e & 1]));
        float pg = pe;
        if constexpr (kGradInP<Mod>) pg *= Mod::grad_raw_frag(st[0][ni][e], p);
        if constexpr (decltype(masked)::value) {
          const int qcol = ni * 8 + 2 * t + (e & 1);
          const RowSpan& r = seen[e >> 1];
          if (qcol < r.first || qcol >= r.last) pe = pg = 0.f;
        }
        pr[e] = pe;
        st[0][ni][e] = pg;
      }
      if constexpr (kGradInP<Mod>) {
        pa[0][ni / 2][2 * (ni & 1)] = MmaOp<T>::pack(pr[0], pr[1]);
        pa[0][ni / 2][2 * (ni & 1) + 1] = MmaOp<T>::pack(pr[2], pr[3]);
      }
    }
  };
  if (full) {
    probs(std::false_type{});
  } else {
    probs(std::true_type{});
  }
  if constexpr (!kGradInP<Mod>) to_a_frags<1, NT, T>(st, pa);
}

// raw_score_grad over a fragment, for a modifier that adds terms to its map of the score
// (kAddsTerms): the modified scores are recovered into `prob` (s2 = log2(P) + lse2(mi, ni, e),
// 0 where P = 0), the terms taken off (their position is the fragment's: modify_scores'
// arguments), and ds multiplied by the derivative of what is left. prob is overwritten. Entries
// with P = 0 have dS = 0 and keep it (the stand-in score gives a finite derivative).
template <typename Mod, bool kKeyRows, int MI, int NT, typename Lse2>
__device__ __forceinline__ void raw_score_grads(float (&ds)[MI][NT][4], float (&prob)[MI][NT][4],
                                                const Lse2& lse2, const AttnParams& p,
                                                const SeqLens& lens, int b, int h, int r0,
                                                int c0, int lane) {
  static_assert(Mod::kAddsTerms, "other modifiers take raw_score_grad per score");
  if (!Mod::grad_active(p)) return;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pe = prob[mi][ni][e];
        prob[mi][ni][e] = pe > 0.f ? log2f(pe) + lse2(mi, ni, e) : 0.f;
      }
  Mod::template subtract_terms_frag<kKeyRows>(prob, p, lens, b, h, r0, c0, lane);
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) ds[mi][ni][e] *= Mod::grad_log2(prob[mi][ni][e], p);
}

// The online softmax's state of a row before its first key (Transform::row_init) in log2
// units, split over the four threads of a quad that hold the row: each takes the max, one the
// sum (the quad's sums are added at the end). Transforms with an lse pass start from nothing.
template <typename Transform>
__device__ __forceinline__ void init_row_state(const AttnParams& p, int h, int lane,
                                               float& row_max, float& row_sum) {
  if constexpr (Transform::kNormalized) {
    float m, l;
    Transform::template row_init<float>(p, h, m, l);
    row_max = m * float(M_LOG2E);
    row_sum = (lane & 3) == 0 ? l : 0.f;
  } else {
    row_max = -INFINITY;
    row_sum = 0.f;
  }
}

// Scores of a warp's 16 * MI rows from r0 against key tile n0 (NT * 8 keys) prepared for an
// exponent with the scale folded in: the modifier applied (scaled first, or with the scale in
// one FFMA: scaled_terms) and the mask. Returns
// the scale that takes them to log2 units: the softmax scale when nothing was applied (it then
// goes into the exponent's FMA), the modifier's factor when it folds the scale itself
// (kFoldsScale), else 1 (also for a scale <= 0).
template <typename Mod, int MI, int NT>
__device__ __forceinline__ float fold_scores(float (&s)[MI][NT][4], const AttnParams& p,
                                             const SeqLens& lens, const RowRanges<MI>& rr,
                                             int b, int h, int r0, int n0, int lane) {
  const bool full = tile_is_full(p, lens, r0, r0 + 16 * MI, n0, n0 + NT * 8);
  if constexpr (Mod::kFoldsScale) {
    const float scale = Mod::modify_raw_frag(s, p);
    if (!full) mask_scores(s, rr, n0, lane);
    return scale;
  }
  float scale = p.scale_log2;
  const bool modified =
      !Mod::kIdentity && Mod::tile_active(p, lens, r0, r0 + 16 * MI - 1, n0, n0 + NT * 8 - 1);
  if (modified || !(scale > 0.f)) {
    if (!(modified && scaled_terms<Mod, false>(s, p, lens, b, h, r0, n0, lane, scale))) {
      scale_frag(s, scale);
      if (modified) modify_scores<Mod, false>(s, p, lens, b, h, r0, n0, lane);
    }
    scale = 1.f;
  }
  if (!full) mask_scores(s, rr, n0, lane);
  return scale;
}

// The weights a = Transform::weight(exp2(scale * s - lse2), c) of a non-normalised transform in
// place, 0 on masked scores (s = -inf); scale > 0. kCount: adds the zero and attended weights
// to `st`.
template <typename Transform, int MI, int NT, bool kCount>
__device__ __forceinline__ TileWeights transform_weights(float (&s)[MI][NT][4],
                                                         const float (&lse2)[MI][2],
                                                         const float (&c)[MI][2],
                                                         WeightStats& st, float scale = 1.f) {
  bool any = false;
  int zeros = 0, attended = 0;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float sv = s[mi][ni][e];
        float a = 0.f;
        if (sv != -INFINITY) {
          a = Transform::weight(exp2f(fmaf(sv, scale, -lse2[mi][e >> 1])), c[mi][e >> 1]);
          if (kCount) {
            ++attended;
            zeros += a == 0.f;
          }
        }
        s[mi][ni][e] = a;
        any |= a != 0.f;
      }
  TileWeights w{__any_sync(0xffffffff, any) != 0, false};
  if (kCount) {
    st.zeros += zeros;
    st.attended += attended;
    w.visited = __any_sync(0xffffffff, attended > 0);
  }
  return w;
}

// The same weights of a warp's 16 rows x 8 NT keys straight into the A operand of A V (the
// Hopper forward without statistics). kMasked: masked scores (-inf) get weight 0 explicitly,
// which a transform with weight(0, c) != 0 needs. Returns whether any weight of the warp's tile
// is non-zero in T.
template <typename Transform, int NT, typename T, bool kMasked>
__device__ __forceinline__ bool transform_weights_packed(const float (&s)[1][NT][4],
                                                         const float (&lse2)[1][2],
                                                         const float (&c)[1][2], float scale,
                                                         uint32_t (&pa)[1][NT / 2][4]) {
  uint32_t bits = 0;
#pragma unroll
  for (int ni = 0; ni < NT; ++ni) {
    float a[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      a[e] = Transform::weight(exp2f(fmaf(s[0][ni][e], scale, -lse2[0][e >> 1])), c[0][e >> 1]);
      if (kMasked && s[0][ni][e] == -INFINITY) a[e] = 0.f;
    }
    const uint32_t lo = MmaOp<T>::pack(a[0], a[1]);
    const uint32_t hi = MmaOp<T>::pack(a[2], a[3]);
    pa[0][ni / 2][2 * (ni & 1)] = lo;
    pa[0][ni / 2][2 * (ni & 1) + 1] = hi;
    bits |= lo | hi;
  }
  return __any_sync(0xffffffff, bits != 0) != 0;
}

}  // namespace tc
}  // namespace adaattn
