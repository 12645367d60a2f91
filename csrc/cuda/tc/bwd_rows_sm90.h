// Hopper row pass of the backward of a non-normalised transform (step 1 of bwd_sm80.h's): per
// query row, G_i = sum_j M_ij dA_ij and Delta_i = sum_j M_ij p_ij dA_ij with dA = dO V^T and
// M = Transform::live(p, c_i) on attended entries. The forward's shape: a CTA is two warpgroups of
// 64 query rows with Q and dO in shared memory; K and V tiles of 128 keys are double-buffered
// with cp.async. Per key tile two products, S = Q K^T and dA = dO V^T (both operands in shared
// memory, V read K-major), issued together so that dA runs while P and M are formed, then the
// sums in registers.
#pragma once

#include <cmath>

#include "../../core/mask.h"
#include "../../core/params.h"
#include "softmax_frag.h"
#include "tiles.h"
#include "wgmma.h"

namespace adaattn {
namespace tc {

template <typename T, int D>
struct Sm90RowsTraits {
  static constexpr int kThreads = 256;
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 128;
  static constexpr int kRowElems = kBlockM * D;
  static constexpr int kKeyElems = kBlockN * D;
  // Q, dO, and two stages of K and V; 1024 bytes of slack to align the swizzled tiles.
  static constexpr int kSmemBytes =
      (2 * kRowElems + 4 * kKeyElems) * static_cast<int>(sizeof(T)) + 1024;
  static_assert(D == 64 || D == 128, "the Hopper row pass takes D in {64, 128}");
};

template <typename Traits, typename T, int D, typename Variant>
__global__ void __launch_bounds__(Traits::kThreads, 1) bwd_rows_sm90_kernel(const AttnParams p) {
#ifdef ADAATTN_SM90A_DEVICE
  using Transform = typename Variant::Transform;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int BN = Traits::kBlockN;
  constexpr int kThreads = Traits::kThreads;
  constexpr int NT = BN / 8;
  constexpr int kWidth = sm90::GmmaLayout<D>::kWidth;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const sQ = reinterpret_cast<T*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
  T* const sdO = sQ + Traits::kRowElems;
  T* const sK = sdO + Traits::kRowElems;     // [2][BN][D]
  T* const sV = sK + 2 * Traits::kKeyElems;  // [2][BN][D]

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int wg = warp / 4;
  const RowTile tile = row_tile<kBlockM>(p, blockIdx.x);
  if (!tile.valid) return;
  const int b = tile.b, h = tile.h, h_kv = tile.h_kv, m0 = tile.m0;
  const SeqLens lens = tile.lens;
  const DenseKeyTiles tiles = dense_key_tiles<BN>(tile.keys);
  const T* k = k_rows<T>(p, lens, b, h_kv, 0);
  const T* v = v_rows<T>(p, lens, b, h_kv, 0);
  const int64_t lse_off = row_stat_offset(p, lens, b, h);

  const int warp_row0 = warp * 16;
  const int g = lane >> 2;
  RowRanges<1> rr;
  float lse2[2], row_term[2];
  float row_g[2] = {0.f, 0.f};   // partial G of this thread's columns
  float row_dl[2] = {0.f, 0.f};  // partial Delta
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = m0 + warp_row0 + g + 8 * hh;
    const KeyRange r = key_range(p, lens, row);
    rr.lo[0][hh] = r.lo;
    rr.hi[0][hh] = r.hi;
    lse2[hh] = lse_log2(p.lse + lse_off, row, lens.rows_q);
    row_term[hh] = Transform::template row_term<float>(p, h, query_position(lens, row));
  }

  if (tiles.count > 0) {
    auto load_kv = [&](int stage, int n_block) {
      const int n0 = n_block * BN;
      sm90::load_tile_gmma<BN, D, kThreads>(sK + stage * Traits::kKeyElems,
                                            k + static_cast<int64_t>(n0) * p.k_row_stride,
                                            p.k_row_stride, lens.k - n0, tid);
      sm90::load_tile_gmma<BN, D, kThreads>(sV + stage * Traits::kKeyElems,
                                            v + static_cast<int64_t>(n0) * p.v_row_stride,
                                            p.v_row_stride, lens.k - n0, tid);
    };
    // Commit groups: {Q, dO, K0, V0}, then {K i+1, V i+1} in iteration i.
    sm90::load_tile_gmma<kBlockM, D, kThreads>(sQ, q_rows<T>(p, lens, b, h, m0),
                                               p.q_row_stride, lens.q - m0, tid);
    sm90::load_tile_gmma<kBlockM, D, kThreads>(sdO, dout_rows<T>(p, lens, b, h, m0),
                                               p.do_row_stride, lens.q - m0, tid);
    load_kv(0, tiles.at(0));
    cp_async_commit();
    for (int i = 0; i < tiles.count; ++i) {
      const int stage = i % 2;
      const int n0 = tiles.at(i) * BN;
      cp_async_wait<0>();
      sm90::fence_proxy_async();
      __syncthreads();  // K, V i visible; every warpgroup is done with stage 1 - stage
      if (i + 1 < tiles.count) load_kv(1 - stage, tiles.at(i + 1));
      cp_async_commit();

      // S = Q K^T, then dA = dO V^T, over the K-major row and key tiles.
      float s[1][NT][4];
      float da[1][NT][4];
      const T* sk = sK + stage * Traits::kKeyElems;
      const T* sv = sV + stage * Traits::kKeyElems;
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const T* a = sQ + sm90::gmma_kcol<kBlockM, D>(kk * 16) + wg * 64 * kWidth;
        const T* bk = sk + sm90::gmma_kcol<BN, D>(kk * 16);
        sm90::wgmma_ss<T, NT>(s[0], sm90::gmma_desc_k<D>(a), sm90::gmma_desc_k<D>(bk), kk > 0);
      }
      sm90::wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const T* a = sdO + sm90::gmma_kcol<kBlockM, D>(kk * 16) + wg * 64 * kWidth;
        const T* bv = sv + sm90::gmma_kcol<BN, D>(kk * 16);
        sm90::wgmma_ss<T, NT>(da[0], sm90::gmma_desc_k<D>(a), sm90::gmma_desc_k<D>(bv), kk > 0);
      }
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>(s[0]);  // S is ready (dA may still run)

      // p where M = 1, else -1.
      const float scale =
          fold_scores<typename Variant::Mod>(s, p, lens, rr, b, h, m0 + warp_row0, n0, lane);
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float score = s[0][ni][e];
          const float pe = exp2f(fmaf(score, scale, -lse2[e >> 1]));
          s[0][ni][e] = score != -INFINITY && Transform::live(pe, row_term[e >> 1]) ? pe : -1.f;
        }
      sm90::wgmma_wait<0>(da[0]);
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (s[0][ni][e] >= 0.f) {
            row_g[e >> 1] += da[0][ni][e];
            row_dl[e >> 1] += s[0][ni][e] * da[0][ni][e];
          }
        }
    }
  }

#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float gs = row_g[hh], ds = row_dl[hh];
    gs += __shfl_xor_sync(0xffffffff, gs, 1);
    gs += __shfl_xor_sync(0xffffffff, gs, 2);
    ds += __shfl_xor_sync(0xffffffff, ds, 1);
    ds += __shfl_xor_sync(0xffffffff, ds, 2);
    const int row = m0 + warp_row0 + g + 8 * hh;
    if ((lane & 3) == 0 && row < lens.rows_q) {
      Transform::row_grad_terms(p)[lse_off + row] =
          gs * Transform::template row_term_grad<float>(p, query_position(lens, row));
      p.delta[lse_off + row] = ds;
    }
  }
#endif
}

}  // namespace tc
}  // namespace adaattn
