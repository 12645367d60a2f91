// Hopper row pass of the backward of a non-normalised transform (step 1 of bwd_sm80.h's): per
// query row, G_i = sum_j M_ij dA_ij and Delta_i = sum_j M_ij p_ij dA_ij with dA = dO V^T and
// M = Transform::live(p, c_i) on attended entries. The forward's structure: a producer
// warpgroup loads Q and dO (with the first key tile), then K and V tiles of 128 keys into a
// two-stage mbarrier ring; two consumer warpgroups of 64 query rows take turns issuing their
// two products per tile, S = Q K^T and dA = dO V^T (both operands in shared memory, V read
// K-major), so that one warpgroup's P, M and sums run under the other's products.
#pragma once

#include <cmath>

#include "../../core/mask.h"
#include "../../core/params.h"
#include "softmax_frag.h"
#include "tiles.h"
#include "wgmma.h"

namespace adaattn {
namespace tc {

// Two consumer warpgroups of 64 rows; at 32 registers the producer spilled.
template <typename T, int D>
struct Sm90RowsTraits : sm90::WarpSpecialisedSplit<2, 40, 224> {
  static constexpr int kBlockM = kWarpgroups * 64;
  static constexpr int kBlockN = 128;
  static constexpr int kStages = 2;
  static constexpr int kRowElems = kBlockM * D;
  static constexpr int kKeyElems = kBlockN * D;
  // Q, dO, and two stages of K and V; 1024 bytes of slack to align the swizzled tiles.
  static constexpr int kSmemBytes =
      (2 * kRowElems + 2 * kStages * kKeyElems) * static_cast<int>(sizeof(T)) + 1024;
  static_assert(D == 64 || D == 128, "the Hopper row pass takes D in {64, 128}");
};

template <typename Traits, typename T, int D, typename Variant>
__global__ void __launch_bounds__(Traits::kThreads, 1) bwd_rows_sm90_kernel(const AttnParams p) {
#ifdef ADAATTN_SM90A_DEVICE
  using Transform = typename Variant::Transform;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int BN = Traits::kBlockN;
  constexpr int kConsumerThreads = Traits::kConsumerThreads;
  static_assert(Traits::kStages == 2, "two-stage mbarrier ring");
  constexpr int NT = BN / 8;
  constexpr int kWidth = sm90::GmmaLayout<D>::kWidth;
  constexpr int kTurnBarrier = 1;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ uint64_t full[Traits::kStages], empty[Traits::kStages];
  T* const sQ = reinterpret_cast<T*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
  T* const sdO = sQ + Traits::kRowElems;
  T* const sK = sdO + Traits::kRowElems;               // [kStages][BN][D]
  T* const sV = sK + Traits::kStages * Traits::kKeyElems;  // [kStages][BN][D]

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const RowTile tile = row_tile<kBlockM>(p, blockIdx.x);
  if (!tile.valid) return;
  const int b = tile.b, h = tile.h, h_kv = tile.h_kv, m0 = tile.m0;
  const SeqLens lens = tile.lens;
  const DenseKeyTiles tiles = dense_key_tiles<BN>(tile.keys);
  sm90::init_load_ring(full, empty, kConsumerThreads);

  if (warp >= kConsumerThreads / 32) {
    sm90::regs_dealloc<Traits::kProducerRegs>();
    if (tiles.count == 0) return;
    const int ptid = tid - kConsumerThreads;
    const T* k = k_rows<T>(p, lens, b, h_kv, 0);
    const T* v = v_rows<T>(p, lens, b, h_kv, 0);
    for (int j = 0; j < tiles.count; ++j) {
      if (j >= Traits::kStages) sm90::mbar_wait(&empty[j % 2], ((j - 2) >> 1) & 1);
      if (j == 0) {
        sm90::load_tile_gmma<kBlockM, D, 128>(sQ, q_rows<T>(p, lens, b, h, m0), p.q_row_stride,
                                              lens.q - m0, ptid, p.head_dim);
        sm90::load_tile_gmma<kBlockM, D, 128>(sdO, dout_rows<T>(p, lens, b, h, m0),
                                              p.do_row_stride, lens.q - m0, ptid, p.head_dim_v);
      }
      const int n0 = tiles.at(j) * BN;
      sm90::load_tile_gmma<BN, D, 128>(sK + (j % 2) * Traits::kKeyElems,
                                       k + static_cast<int64_t>(n0) * p.k_row_stride,
                                       p.k_row_stride, lens.k - n0, ptid, p.head_dim);
      sm90::load_tile_gmma<BN, D, 128>(sV + (j % 2) * Traits::kKeyElems,
                                       v + static_cast<int64_t>(n0) * p.v_row_stride,
                                       p.v_row_stride, lens.k - n0, ptid, p.head_dim_v);
      sm90::publish_stage(&full[j % 2]);
    }
    return;
  }

  sm90::regs_alloc<Traits::kConsumerRegs>();
  const int wg = warp / 4;
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

  const sm90::WarpgroupTurns<Traits::kWarpgroups, kTurnBarrier> turns{wg};
  if (wg == Traits::kWarpgroups - 1 && tiles.count > 0) turns.pass();
  for (int i = 0; i < tiles.count; ++i) {
    const int stage = i % 2;
    const int n0 = tiles.at(i) * BN;
    sm90::mbar_wait(&full[stage], (i >> 1) & 1);

    // S = Q K^T, then dA = dO V^T, over the K-major row and key tiles.
    float s[1][NT][4];
    float da[1][NT][4];
    const T* sk = sK + stage * Traits::kKeyElems;
    const T* sv = sV + stage * Traits::kKeyElems;
    turns.take();
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
    // Every take but the last warpgroup's final one is answered by the other's pass.
    if (wg != Traits::kWarpgroups - 1 || i + 1 < tiles.count) turns.pass();
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
    if (lane == 0) sm90::mbar_arrive(&empty[stage]);
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
