// The relative-bias score modifier: s_ij = x_ij + bias[h, i - j] for 0 <= i - j < W, + 0
// beyond the table (lazy attention's distance bias; rel_bias in docs/ops.md). Learnable:
// dbias[h, d] = sum over (b, i - j = d) of dS_ij.
#pragma once

#include "variant.h"

namespace adaattn {

#if defined(__CUDACC__)
// Adds f(d) to every element of score fragments, d = i - j its distance (i the row's position).
// kKeyRows = false: fragments laid out [rows][keys] (S), element (mi, ni, e) is row
// r0 + mi*16 + g + 8*(e/2), key c0 + ni*8 + 2t + e%2. kKeyRows = true: laid out [keys][rows]
// (S^T in the dK/dV pass), element (mi, ni, e) is key r0 + mi*16 + g + 8*(e/2), row
// c0 + ni*8 + 2t + e%2. The distance of element (ni, e) is a thread constant + 8 (e/2 - ni) - e%2
// (S; S^T: + 8 (ni - e/2) + e%2), so the 4 NT elements of a row group take 2 (NT + 1)
// distances: f(d, d0f, of) is evaluated once for each and added to the (up to) two elements at
// it (RelBiasMod::modify_frag walks the same distances for its table alone). d = d0 + offset; as
// a float it is d0f + of, from one conversion per row group (d0f) and a constant (of): an
// int-to-float conversion per distance would run on the pipe the softmax's exp2 already fills,
// and a term linear in d costs one FFMA per distance (a d0f product shared by the row group).
template <bool kKeyRows, int MI, int NT, typename F>
__device__ __forceinline__ void add_by_distance(float (&s)[MI][NT][4], const SeqLens& lens,
                                                int r0, int c0, int lane, const F& f,
                                                float scale = 1.f) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
    // Distance of element (ni = 0, e = 0); k below is e/2 - ni (S) or ni - e/2 (S^T).
    const int d0 = kKeyRows ? row_position(lens, c0 + 2 * t) - (r0 + mi * 16 + g)
                            : row_position(lens, r0 + mi * 16 + g) - (c0 + 2 * t);
    const float d0f = static_cast<float>(d0);
#pragma unroll
    for (int k = kKeyRows ? -1 : 1 - NT; k <= (kKeyRows ? NT - 1 : 1); ++k)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int offset = kKeyRows ? 8 * k + c : 8 * k - c;
        const float b = f(d0 + offset, d0f, static_cast<float>(offset));
        // (e/2, ni) pairs at this k: S: (0, -k) and (1, 1 - k); S^T: (0, k) and (1, k + 1).
        const int ni_top = kKeyRows ? k : -k;
        const int ni_bottom = kKeyRows ? k + 1 : 1 - k;
        if (ni_top >= 0 && ni_top < NT) s[mi][ni_top][c] = fmaf(s[mi][ni_top][c], scale, b);
        if (ni_bottom >= 0 && ni_bottom < NT) {
          s[mi][ni_bottom][2 + c] = fmaf(s[mi][ni_bottom][2 + c], scale, b);
        }
      }
  }
}
#endif

struct RelBiasMod {
  static constexpr bool kIdentity = false;
  static constexpr bool kUnitGrad = true;
  static constexpr bool kParamGrad = true;
  static constexpr bool kPositional = true;
  static constexpr bool kFoldsScale = false;
  static constexpr bool kAddsTerms = false;
  static constexpr bool kScaledTerms = true;

  template <typename T>
  ADAATTN_HD static T apply(const AttnParams& p, int, int h, int i, int j, T x) {
    const int d = i - j;
    return d >= 0 && d < p.bias_window
               ? x + static_cast<T>(p.bias[static_cast<int64_t>(h) * p.bias_window + d])
               : x;
  }
  template <typename T>
  ADAATTN_HD static T grad(const AttnParams&, T, T) {
    return T(1);
  }
  // The table entry of (i, j): the distance i - j, or -1 outside the table.
  ADAATTN_HD static int param_slot(const AttnParams& p, int i, int j) {
    const int d = i - j;
    return d >= 0 && d < p.bias_window ? d : -1;
  }
  ADAATTN_HD static bool wants_param_grad(const AttnParams& p) { return p.dbias != nullptr; }
  // Slots param_slot can return in this problem: i - j <= max_row_position (Lk - 1 bottom-right
  // aligned), so min(W, that + 1), the size of a partial table; entries past it get a zero
  // gradient.
  ADAATTN_HD static int param_slots(const AttnParams& p) {
    const int reach = max_row_position(p) + 1;
    return reach < 0 ? 0 : (p.bias_window < reach ? p.bias_window : reach);
  }
  // Entries per head of the table.
  ADAATTN_HD static int param_count(const AttnParams& p) { return p.bias_window; }
  // The key that row position i reads entry `slot` with (param_slot's inverse), or a negative
  // value when none.
  ADAATTN_HD static int param_key(const AttnParams&, int i, int slot) { return i - slot; }
  // The table gradient, [Hq, param_count] float32 (non-null when wants_param_grad).
  ADAATTN_HD static float* param_grad_out(const AttnParams& p) { return p.dbias; }

  // ---- launcher hooks (the tensor-core launch reads them on the host; outside the CUDA
  // block, so the host-only CPU build compiles them and rejects a device-only one) ----

  // Floats of the per-CTA partial sums the dK/dV CTAs write (AttnParams::dbias_partial) for
  // `key_slots` key tiles.
  static int64_t param_grad_scratch(const AttnParams& p, int64_t key_slots) {
    return p.heads_q * key_slots * param_slots(p);
  }
  static void set_param_grad_scratch(AttnParams& p, float* scratch) { p.dbias_partial = scratch; }
  // Table entries the reduction after the dK/dV pass writes.
  static int64_t param_grad_items(const AttnParams& p) {
    return static_cast<int64_t>(p.heads_q) * p.bias_window;
  }

#if defined(__CUDACC__)
  // ---- tensor-core hooks (fragments: csrc/cuda/tc/softmax_frag.h) ----

  // True when a (rows, keys) tile holds some pair at distance 0 <= i - j < W, i.e. needs the
  // table: the smallest distance is pos(first row) - (last key), the largest pos(last row) -
  // (first key).
  __device__ __forceinline__ static bool tile_active(const AttnParams& p, const SeqLens& lens,
                                                    int first_row, int last_row, int first_key,
                                                    int last_key) {
    return row_position(lens, first_row) - last_key < p.bias_window &&
           row_position(lens, last_row) - first_key >= 0;
  }

  // Adds the distance bias (in log2 units) to score fragments. kKeyRows = false: fragments laid
  // out [rows][keys] (S), element (mi, ni, e) is row r0 + mi*16 + g + 8*(e/2), key
  // c0 + ni*8 + 2t + e%2. kKeyRows = true: laid out [keys][rows] (S^T in the dK/dV pass), element
  // (mi, ni, e) is key r0 + mi*16 + g + 8*(e/2), row c0 + ni*8 + 2t + e%2.
  // The distance of element (ni, e) is a thread constant + 8 (e/2 - ni) - e%2 (S; S^T: + 8 (ni -
  // e/2) + e%2), so the 4 NT elements of a row group take 2 (NT + 1) table entries: each is
  // loaded once and added to the (up to) two elements at its distance.
  // The table is a term of the score alone (kScaledTerms).
  __device__ __forceinline__ static bool terms_only(const AttnParams&) { return true; }

  template <bool kKeyRows, int MI, int NT>
  __device__ __forceinline__ static void modify_frag(float (&s)[MI][NT][4], const AttnParams& p,
                                                    const SeqLens& lens, int, int h, int r0,
                                                    int c0, int lane, float scale = 1.f) {
    const float* bias = p.bias + static_cast<int64_t>(h) * p.bias_window;
    const unsigned window = static_cast<unsigned>(p.bias_window);
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      // Distance of element (ni = 0, e = 0); k below is e/2 - ni (S) or ni - e/2 (S^T).
      const int d0 = kKeyRows ? row_position(lens, c0 + 2 * t) - (r0 + mi * 16 + g)
                              : row_position(lens, r0 + mi * 16 + g) - (c0 + 2 * t);
#pragma unroll
      for (int k = kKeyRows ? -1 : 1 - NT; k <= (kKeyRows ? NT - 1 : 1); ++k)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int d = kKeyRows ? d0 + 8 * k + c : d0 + 8 * k - c;
          const float b = static_cast<unsigned>(d) < window ? __ldg(bias + d) * float(M_LOG2E) : 0.f;
          // (e/2, ni) pairs at this k: S: (0, -k) and (1, 1 - k); S^T: (0, k) and (1, k + 1).
          const int ni_top = kKeyRows ? k : -k;
          const int ni_bottom = kKeyRows ? k + 1 : 1 - k;
          if (ni_top >= 0 && ni_top < NT) s[mi][ni_top][c] = fmaf(s[mi][ni_top][c], scale, b);
          if (ni_bottom >= 0 && ni_bottom < NT) {
            s[mi][ni_bottom][2 + c] = fmaf(s[mi][ni_bottom][2 + c], scale, b);
          }
        }
    }
  }

  // dbias of one (key tile, query step) pair: the dS^T fragments of the tile's
  // kBlockN keys x BM queries are staged in fp32 ([keys][kStride], in rounds of kStageKeys keys;
  // kStride = BM + 8 makes the paired stores conflict-free), then thread i sums diagonals i,
  // i + kThreads, ... (distance d = pos(query) - key) in a fixed order into this CTA's partial
  // for head h. The kThreads threads that hold the tile's dS^T call it; sync() is their barrier.
  template <int kBlockN, int BM, int kStageKeys, int kStride, int kThreads, int MI, int NT,
            typename Sync>
  __device__ static void accumulate_param_grad(const AttnParams& p, const SeqLens& lens,
                                                      float* sStage, const float (&ds)[MI][NT][4],
                                                      int h, int m0, int n0, int slot,
                                                      int warp_row0, int lane, int tid,
                                                      const Sync& sync) {
    static_assert(kStride % 2 == 0 && kStride >= BM, "paired stores of whole query rows");
    const int bias_span = param_slots(p);
    float* partial = p.dbias_partial +
                     (h * tile_slots<true>(p, kBlockN) + slot) * static_cast<int64_t>(bias_span);
    const int base = row_position(lens, m0) - n0;
    const int g = lane >> 2, t = lane & 3;
    for (int r0 = 0; r0 < kBlockN; r0 += kStageKeys) {
      // The partial of this thread's first diagonal is read before the staging, so that the
      // global load's latency hides behind it.
      const int o_first = tid - (r0 + kStageKeys - 1);
      const int d_first = base + o_first;
      const bool owns_first = o_first < BM - r0 && d_first >= 0 && d_first < bias_span;
      const float first_partial = owns_first ? partial[d_first] : 0.f;
      if (warp_row0 >= r0 && warp_row0 < r0 + kStageKeys) {
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int ni = 0; ni < NT; ++ni)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int key = warp_row0 - r0 + mi * 16 + g + 8 * hh;
              *reinterpret_cast<float2*>(sStage + key * kStride + ni * 8 + 2 * t) =
                  make_float2(ds[mi][ni][2 * hh], ds[mi][ni][2 * hh + 1]);
            }
      }
      sync();
      // o = query - key; keys [r0, r0 + kStageKeys) meet queries [0, BM). Four partial sums
      // (a fixed order) keep the loads in flight.
      for (int o = o_first; o < BM - r0; o += kThreads) {
        const int d = base + o;
        if (d < 0 || d >= bias_span) continue;
        const int k_lo = -o > r0 ? -o : r0;
        const int k_hi = BM - o < r0 + kStageKeys ? BM - o : r0 + kStageKeys;
        const float* diag = sStage + o - r0 * kStride;  // element (kr, kr + o) at kr * (kStride + 1)
        float sum[4] = {0.f, 0.f, 0.f, 0.f};
        int kr = k_lo;
        for (; kr + 4 <= k_hi; kr += 4) {
#pragma unroll
          for (int u = 0; u < 4; ++u) sum[u] += diag[(kr + u) * (kStride + 1)];
        }
        for (; kr < k_hi; ++kr) sum[0] += diag[kr * (kStride + 1)];
        const float before = o == o_first ? first_partial : partial[d];
        partial[d] = before + ((sum[0] + sum[1]) + (sum[2] + sum[3]));
      }
      sync();
    }
  }

  // dbias[h, d] = sum over the key tile slots of the partials, in a fixed order; distances
  // >= param_slots never occur and get 0.
  template <int kThreads>
  __device__ static void reduce_param_grad(const AttnParams& p, int64_t slots) {
    const int bias_span = param_slots(p);
    const int64_t item = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    if (item >= static_cast<int64_t>(p.heads_q) * p.bias_window) return;
    const int h = static_cast<int>(item / p.bias_window);
    const int d = static_cast<int>(item % p.bias_window);
    float acc = 0.f;
    if (d < bias_span) {
      const float* part = p.dbias_partial + h * slots * bias_span + d;
      for (int64_t n = 0; n < slots; ++n) acc += part[n * bias_span];
    }
    p.dbias[item] = acc;
  }
#endif
};

}  // namespace adaattn
