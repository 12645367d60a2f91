// Tensor-core forward of the flash family (FlashAttention-2 style): one CTA per (query tile,
// batch, head); each warp owns 16*MI query rows, keeps O and the softmax state in registers,
// and streams K/V tiles through shared memory with cp.async (the V load overlaps Q K^T, the
// next K load overlaps P V). The mask is a policy (mask.h, tiles.h): only the key tiles of the
// tile's key range (block-sparse: of its listed blocks) are visited, and only boundary tiles
// are masked element-wise. The variant
// (variant.h) picks the score modifier and the probability transform: softmax runs one online
// pass; the elastic softmax of lazy attention runs an lse pass over K, then a weight pass that
// skips the P V product of every warp tile whose weights are all zero. Q and K have head dim DK,
// V and the output DV (flash: DK may be smaller, e.g. low-rank attention's projected scores).
#pragma once

#include <cmath>

#include "../../core/mask.h"
#include "../../core/params.h"
#include "mma.h"
#include "tiles.h"
#include "variant.h"

namespace adaattn {
namespace tc {

template <typename T, int DK, int DV, int NWARPS, int MI, int BN>
struct FwdTraits {
  static constexpr int kThreads = NWARPS * 32;
  static constexpr int kBlockM = NWARPS * 16 * MI;
  static constexpr int kBlockN = BN;
  // Q, K and V tiles; the output is staged through a [kBlockM][DV] tile at the same place.
  static constexpr int kTileElems = (kBlockM + kBlockN) * DK + kBlockN * DV;
  static constexpr int kSmemBytes =
      (kTileElems > kBlockM * DV ? kTileElems : kBlockM * DV) * sizeof(T);
};

// Per-thread view of the rows it holds in accumulator fragments: rows g and g + 8 of each of
// the warp's MI 16-row groups.
template <int MI>
struct RowRanges {
  int lo[MI][2];
  int hi[MI][2];
};

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

// Elastic (lazy attention) scores of a warp's 16 * MI rows from r0 against key tile n0: the
// distance bias added (in log2 units) and the mask applied. Returns the scale that takes them
// to log2 units: the softmax scale when the tile meets no bias (it then goes into the
// exponent's FMA), else 1 (the scores were scaled here; also for a scale <= 0).
template <int MI, int NT>
__device__ __forceinline__ float elastic_scores(float (&s)[MI][NT][4], const AttnParams& p,
                                                const SeqLens& lens, const RowRanges<MI>& rr,
                                                int h, int r0, int n0, int lane) {
  float scale = p.scale_log2;
  const bool biased = tile_meets_bias(p, lens, r0, n0 + NT * 8 - 1);
  if (biased || !(scale > 0.f)) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mi][ni][e] *= scale;
    if (biased) add_bias<false>(s, p, lens, h, r0, n0, lane);
    scale = 1.f;
  }
  if (!tile_is_full(p, lens, r0, r0 + 16 * MI, n0, n0 + NT * 8)) mask_scores(s, rr, n0, lane);
  return scale;
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
// rescale); exponents stay below 2^slack.
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
template <bool kRaw = false, int MI, int NT>
__device__ __forceinline__ void online_softmax(float (&s)[MI][NT][4], float (&row_max)[MI][2],
                                               float (&row_sum)[MI][2], float (&corr)[MI][2],
                                               float scale = 1.f, float slack = 0.f) {
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
      if constexpr (kRaw) mx = fmaxf(row_max[mi][hh], mx * scale);
      if (!(mx - row_max[mi][hh] > slack)) mx = row_max[mi][hh];
      const float base = mx == -INFINITY ? 0.f : mx;
      corr[mi][hh] = exp2f(row_max[mi][hh] - base);
      row_max[mi][hh] = mx;
      float sum = 0.f;
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = kRaw ? exp2f(fmaf(s[mi][ni][2 * hh + e], scale, -base))
                                : exp2f(s[mi][ni][2 * hh + e] - base);
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

// Weight-pass counters of one thread (lazy statistics, see AttnParams::stats).
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

// Elastic softmax transform in place: a = max(0, exp2(scale * s - lse2) + shift) on attended
// scores, 0 on masked ones (s = -inf); scale > 0. kCount: adds the zero and attended weights
// to `st`.
template <int MI, int NT, bool kCount>
__device__ __forceinline__ TileWeights elastic_weights(float (&s)[MI][NT][4],
                                                       const float (&lse2)[MI][2],
                                                       const float (&shift)[MI][2],
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
          a = fmaxf(0.f, exp2f(fmaf(sv, scale, -lse2[mi][e >> 1])) + shift[mi][e >> 1]);
          if (kCount) {
            ++attended;
            zeros += a == 0.f;
          }
        }
        s[mi][ni][e] = a;
        any |= a > 0.f;
      }
  TileWeights w{__any_sync(0xffffffff, any) != 0, false};
  if (kCount) {
    st.zeros += zeros;
    st.attended += attended;
    w.visited = __any_sync(0xffffffff, attended > 0);
  }
  return w;
}

// The elastic weights of a warp's 16 rows x 8 NT keys straight into the A operand of A V (the
// Hopper forward without statistics). kMasked: masked scores (-inf) get weight 0 explicitly,
// which a positive shift (tau > 0) needs; with tau <= 0, max(0, 0 + shift) is 0 already. Returns
// whether any weight of the warp's tile is non-zero in T.
template <int NT, typename T, bool kMasked>
__device__ __forceinline__ bool elastic_weights_packed(const float (&s)[1][NT][4],
                                                       const float (&lse2)[1][2],
                                                       const float (&shift)[1][2], float scale,
                                                       uint32_t (&pa)[1][NT / 2][4]) {
  uint32_t bits = 0;
#pragma unroll
  for (int ni = 0; ni < NT; ++ni) {
    float a[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      a[e] = fmaxf(0.f, exp2f(fmaf(s[0][ni][e], scale, -lse2[0][e >> 1])) + shift[0][e >> 1]);
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

template <typename Traits, typename T, int DK, int DV, int MI, int BN, typename Variant>
__global__ void __launch_bounds__(Traits::kThreads)
    flash_fwd_kernel(const AttnParams p) {
  constexpr bool kElastic = Variant::kElastic;
  // The elastic lse pass double-buffers K in sK and sV.
  static_assert(!kElastic || DK == DV, "lazy attention has one head dim");
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kThreads = Traits::kThreads;
  constexpr int NT = BN / 8;   // score n-tiles per warp
  constexpr int DT = DV / 8;   // output n-tiles per warp
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * DK;
  T* sV = sK + BN * DK;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const RowTile tile = row_tile<kBlockM>(p, blockIdx.x);
  if (!tile.valid) return;
  const int b = tile.b, h = tile.h, h_kv = tile.h_kv, m0 = tile.m0;
  const SeqLens lens = tile.lens;
  const KeyRange tile_keys = tile.keys;

  const T* q = q_rows<T>(p, lens, b, h, m0);
  const T* k = k_rows<T>(p, lens, b, h_kv, 0);
  const T* v = v_rows<T>(p, lens, b, h_kv, 0);
  T* out = out_rows<T>(p, lens, b, h, m0);
  float* lse = p.lse + row_stat_offset(p, lens, b, h);

  const int warp_row0 = warp * 16 * MI;
  const int g = lane >> 2;
  RowRanges<MI> rr;
  float shift[MI][2];  // elastic: tau_h / (i + 1) of each row
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = m0 + warp_row0 + mi * 16 + g + 8 * hh;
      const KeyRange r = key_range(p, lens, row);
      rr.lo[mi][hh] = r.lo;
      rr.hi[mi][hh] = r.hi;
      if (kElastic) shift[mi][hh] = lazy_shift<float>(p, h, lazy_position(lens, row));
    }

  float o[MI][DT][4];
  zero(o);
  float row_max[MI][2];
  float row_sum[MI][2];
  float lse2[MI][2];  // elastic: log2-domain lse from the first pass (+inf: row sees nothing)
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      row_max[mi][hh] = -INFINITY;
      row_sum[mi][hh] = 0.f;
      lse2[mi][hh] = INFINITY;
    }

  // Scores of key tile n0 against sK in log2 units: scaled, modified, masked.
  auto scores = [&](float (&s)[MI][NT][4], const T* sk, int n0) {
    zero(s);
    warp_gemm_nt<MI, NT, DK>(s, sQ, warp_row0, sk, 0, lane);
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mi][ni][e] *= p.scale_log2;
    if (kElastic && tile_meets_bias(p, lens, m0 + warp_row0, n0 + BN - 1)) {
      add_bias<false>(s, p, lens, h, m0 + warp_row0, n0, lane);
    }
    if (!tile_is_full(p, lens, m0 + warp_row0, m0 + warp_row0 + 16 * MI, n0, n0 + BN)) {
      mask_scores(s, rr, n0, lane);
    }
  };

  WeightStats stats;
  const int valid_q = lens.rows_q - m0;
  // The mainloop over a tile sequence (tiles.h). Dense masks get their own copy with a plain
  // range, so the block-list lookup costs them nothing.
  auto mainloop = [&](const auto& tiles) {
    auto load_k = [&](T* dst, int tile) {
      load_tile_async<BN, DK, kThreads>(dst, k + static_cast<int64_t>(tile) * BN * p.k_row_stride,
                                        p.k_row_stride, lens.rows_k - tile * BN, tid);
    };
    auto load_v = [&](int tile) {
      load_tile_async<BN, DV, kThreads>(sV, v + static_cast<int64_t>(tile) * BN * p.v_row_stride,
                                        p.v_row_stride, lens.rows_k - tile * BN, tid);
    };
    if (tiles.count > 0) {
      load_tile_async<kBlockM, DK, kThreads>(sQ, q, p.q_row_stride, valid_q, tid);
      load_k(sK, tiles.at(0));
      cp_async_commit();

      if constexpr (kElastic) {
        // Pass 1: row max and sum only; sK and sV double-buffer K.
        for (int i = 0; i < tiles.count; ++i) {
          const int n0 = tiles.at(i) * BN;
          T* const cur = i % 2 == 0 ? sK : sV;
          cp_async_wait_all();
          __syncthreads();
          if (i + 1 < tiles.count) {
            load_k(cur == sK ? sV : sK, tiles.at(i + 1));
            cp_async_commit();
          }
          float s[MI][NT][4];
          scores(s, cur, n0);
          float corr[MI][2];
          online_softmax(s, row_max, row_sum, corr);
        }
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            float l = row_sum[mi][hh];
            l += __shfl_xor_sync(0xffffffff, l, 1);
            l += __shfl_xor_sync(0xffffffff, l, 2);
            row_sum[mi][hh] = l;
            if (l > 0.f) lse2[mi][hh] = row_max[mi][hh] + log2f(l);
          }
        __syncthreads();  // every warp is done with sK/sV before pass 2 refills them
        load_k(sK, tiles.at(0));
        cp_async_commit();
      }

      for (int i = 0; i < tiles.count; ++i) {
        const int n_block = tiles.at(i);
        const int n0 = n_block * BN;
        cp_async_wait_all();
        __syncthreads();
        load_v(n_block);
        cp_async_commit();

        float s[MI][NT][4];
        scores(s, sK, n0);
        bool any = true;
        if constexpr (kElastic) {
          if (p.stats != nullptr) {
            const TileWeights w = elastic_weights<MI, NT, true>(s, lse2, shift, stats);
            stats.tile(w.visited, !w.any, lane);
            any = w.any;
          } else {
            any = elastic_weights<MI, NT, false>(s, lse2, shift, stats).any;
          }
        } else {
          float corr[MI][2];
          online_softmax(s, row_max, row_sum, corr);
#pragma unroll
          for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int di = 0; di < DT; ++di)
#pragma unroll
              for (int e = 0; e < 4; ++e) o[mi][di][e] *= corr[mi][e >> 1];
        }

        uint32_t pa[MI][NT / 2][4];
        to_a_frags<MI, NT, T>(s, pa);

        cp_async_wait_all();
        __syncthreads();
        if (i + 1 < tiles.count) {
          load_k(sK, tiles.at(i + 1));
          cp_async_commit();
        }
        if (any) warp_gemm_rs<MI, DT, NT / 2, DV>(o, pa, sV, 0, lane);
      }
    }
  };
  if constexpr (kElastic) {
    mainloop(dense_key_tiles<BN>(tile_keys));  // lazy attention has no block-sparse form
  } else if (p.block_kv_num == nullptr) {
    mainloop(dense_key_tiles<BN>(tile_keys));
  } else {
    mainloop(key_tiles<BN>(p, tile_keys, b, h, m0));
  }

  // Finalise: softmax divides by the row sum; elastic weights are not renormalised. lse is the
  // natural-log log-sum-exp of the scores; rows that saw nothing: out 0, lse -inf.
  float inv[MI][2];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float l = row_sum[mi][hh];
      if (!kElastic) {
        l += __shfl_xor_sync(0xffffffff, l, 1);
        l += __shfl_xor_sync(0xffffffff, l, 2);
      }
      inv[mi][hh] = kElastic ? 1.f : (l > 0.f ? 1.f / l : 0.f);
      const int row = m0 + warp_row0 + mi * 16 + g + 8 * hh;
      if ((lane & 3) == 0 && row < lens.rows_q) {
        lse[row] = l > 0.f ? (row_max[mi][hh] + log2f(l)) * float(M_LN2) : -INFINITY;
      }
    }
  if (kElastic && p.stats != nullptr) flush_stats(p.stats, stats);
  // Each warp stages its rows in a [kBlockM][DV] tile at the start of shared memory, over
  // sQ/sK/sV, which nobody reads after this barrier.
  __syncthreads();
  store_rows<MI, DT, DV>(o, inv, reinterpret_cast<T*>(smem_raw), warp_row0, out, p.o_row_stride,
                         valid_q, lane);
}

}  // namespace tc
}  // namespace adaattn
