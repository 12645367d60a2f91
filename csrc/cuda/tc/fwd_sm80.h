// SM80 tensor-core forward (FlashAttention-2 style): one CTA per (query tile, batch, head);
// each warp owns 16*MI query rows, keeps O and the softmax state in registers, and streams K/V
// tiles through shared memory with cp.async (the V load overlaps Q K^T, the next K load overlaps
// P V). The mask is a policy (mask.h, tiles.h): only the key tiles of the tile's key range
// (block-sparse: of its listed blocks) are visited, and only boundary tiles are masked
// element-wise. The variant (variants/variant.h) supplies the score modifier and the probability
// transform: a normalised transform runs one online pass; any other runs an lse pass over K,
// then a weight pass that skips the A V product of every warp tile whose weights are all zero.
// Q and K have head dim DK, V and the output DV (DK may be smaller, e.g. low-rank attention's
// projected scores).
#pragma once

#include <cmath>

#include "../../core/mask.h"
#include "../../core/params.h"
#include "mma.h"
#include "softmax_frag.h"
#include "tiles.h"

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

template <typename Traits, typename T, int DK, int DV, int MI, int BN, typename Variant>
__global__ void __launch_bounds__(Traits::kThreads)
    fwd_sm80_kernel(const AttnParams p) {
  using Mod = typename Variant::Mod;
  using Transform = typename Variant::Transform;
  constexpr bool kLsePass = !Variant::kNormalized;
  // The lse pass double-buffers K in sK and sV.
  static_assert(!kLsePass || DK == DV, "an lse pass needs DK == DV");
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
  if (!tile.valid || q8_owns_head(p, tile.b, tile.h)) return;
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
  float row_term[MI][2];  // the transform's c_i of each row
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = m0 + warp_row0 + mi * 16 + g + 8 * hh;
      const KeyRange r = key_range(p, lens, row);
      rr.lo[mi][hh] = r.lo;
      rr.hi[mi][hh] = r.hi;
      if (kLsePass) {
        row_term[mi][hh] = Transform::template row_term<float>(p, h, query_position(lens, row));
      }
    }

  float o[MI][DT][4];
  zero(o);
  float row_max[MI][2];
  float row_sum[MI][2];
  float lse2[MI][2];  // lse pass: log2-domain lse (+inf: row sees nothing)
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      init_row_state<Transform>(p, h, lane, row_max[mi][hh], row_sum[mi][hh]);
      lse2[mi][hh] = INFINITY;
    }

  // Scores of key tile n0 against sK in log2 units: scaled, modified, masked.
  auto scores = [&](float (&s)[MI][NT][4], const T* sk, int n0) {
    zero(s);
    warp_gemm_nt<MI, NT, DK>(s, sQ, warp_row0, sk, 0, lane);
    scale_frag(s, p.scale_log2);
    if (!Mod::kIdentity && Mod::tile_active(p, lens, m0 + warp_row0,
                                               m0 + warp_row0 + 16 * MI - 1, n0, n0 + BN - 1)) {
      modify_scores<Mod, false>(s, p, lens, b, h, m0 + warp_row0, n0, lane);
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
                                        p.k_row_stride, lens.rows_k - tile * BN, tid, p.head_dim);
    };
    // Values past the attended keys (padding) are zero-filled: their weights are 0, and 0 times
    // whatever the padding holds (NaN) must not reach the rows.
    auto load_v = [&](int tile) {
      load_tile_async<BN, DV, kThreads>(sV, v + static_cast<int64_t>(tile) * BN * p.v_row_stride,
                                        p.v_row_stride, lens.k - tile * BN, tid, p.head_dim_v);
    };
    if (tiles.count > 0) {
      load_tile_async<kBlockM, DK, kThreads>(sQ, q, p.q_row_stride, valid_q, tid, p.head_dim);
      load_k(sK, tiles.at(0));
      cp_async_commit();

      if (kLsePass && p.lse_pass == LsePass::kGiven) {
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            lse2[mi][hh] = lse_log2(lse, m0 + warp_row0 + mi * 16 + g + 8 * hh, lens.rows_q);
          }
      } else if constexpr (kLsePass) {
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
            if (row_saw_keys(l)) lse2[mi][hh] = row_max[mi][hh] + log2f(l);
          }
        if (p.lse_pass == LsePass::kOnly) return;
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
        if constexpr (kLsePass) {
          if (Transform::kCountsZeros && p.stats != nullptr) {
            const TileWeights w =
                transform_weights<Transform, MI, NT, true>(s, lse2, row_term, stats);
            stats.tile(w.visited, !w.any, lane);
            any = w.any;
          } else {
            any = transform_weights<Transform, MI, NT, false>(s, lse2, row_term, stats).any;
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
  // Block lists are walked for normalised transforms only (a second copy of the two-pass
  // mainloop costs registers and compile time, and no op pairs them).
  if (!Variant::kNormalized || p.block_kv_num == nullptr) {
    mainloop(dense_key_tiles<BN>(tile_keys));
  } else {
    mainloop(key_tiles<BN>(p, tile_keys, b, h, m0));
  }

  // Finalise: a normalised transform divides by the row sum, others do not. lse is the
  // natural-log log-sum-exp of the scores (and of the transform's initial state); rows that
  // saw nothing (and no initial state): out 0, lse -inf.
  float inv[MI][2];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float l = row_sum[mi][hh];
      if (!kLsePass) {
        l += __shfl_xor_sync(0xffffffff, l, 1);
        l += __shfl_xor_sync(0xffffffff, l, 2);
      }
      inv[mi][hh] = kLsePass ? 1.f : (row_saw_keys(l) ? 1.f / l : 0.f);
      const int row = m0 + warp_row0 + mi * 16 + g + 8 * hh;
      if ((lane & 3) == 0 && row < lens.rows_q && (!kLsePass || p.lse_pass != LsePass::kGiven)) {
        lse[row] = row_saw_keys(l) ? (row_max[mi][hh] + log2f(l)) * float(M_LN2) : -INFINITY;
      }
    }
  if (kLsePass && Transform::kCountsZeros && p.stats != nullptr) flush_stats(p.stats, stats);
  if (kLsePass && p.lse_pass == LsePass::kOnly) return;
  // Each warp stages its rows in a [kBlockM][DV] tile at the start of shared memory, over
  // sQ/sK/sV, which nobody reads after this barrier.
  __syncthreads();
  store_rows<MI, DT, DV>(o, inv, reinterpret_cast<T*>(smem_raw), warp_row0, out, p.o_row_stride,
                         valid_q, lane, 0, p.head_dim_v);
}

}  // namespace tc
}  // namespace adaattn
