// Hopper dQ pass of the two-pass backward (normalised transforms): the dQ half of bwd_sm80.h's
// bwd_dq_block on warpgroup MMAs, warp-specialised as the Hopper forward (fwd_sm90.h). It
// runs first and also computes each row's Delta = rowsum(dO * O) for the dK/dV pass (no
// separate delta kernel).
// A CTA owns 128 query rows of one (batch, query head), 64 per consumer warpgroup, and walks
// the key tiles its rows see (dense ranges or the listed blocks of a block-sparse mask, as the
// forward does). Per key tile and warpgroup:
//   S = Q K^T, dP = dO V^T      (both operands in shared memory)
//   P = exp2(Mod(S scale) - lse), dS = P (dP - Delta) Mod'(S scale)
//   dQ += dS K                  (dS as the register A operand; K read transposed)
// dQ stays in registers and is written once, scaled, in the inputs' dtype: no float32
// accumulator to zero, reduce into and convert, and no reductions racing each other, so the
// result is deterministic. The dK/dV pass is bwd_sm90.h without its dQ product.
// Three products per tile pair on top of the dK/dV pass's four (seven against the atomic
// backward's five): it pays where the accumulator's fixed traffic dominates (block-sparse
// layouts) and where determinism is asked for (launch.h's sm90_two_pass).
#pragma once

#include <cmath>
#include <type_traits>

#include "../../core/mask.h"
#include "../../core/params.h"
#include "query_ring_sm90.h"
#include "softmax_frag.h"
#include "tiles.h"
#include "wgmma.h"

namespace adaattn {
namespace tc {

// Sum of the products of two packs of 8 elements of T, in float32.
template <typename T>
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  const T* x = reinterpret_cast<const T*>(&a);
  const T* y = reinterpret_cast<const T*>(&b);
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) acc = fmaf(to_float(x[i]), to_float(y[i]), acc);
  return acc;
}

template <typename T, int DK, int DV>
struct Sm90BwdDqTraits : sm90::WarpSpecialisedSplit<2, 32, 232> {
  static constexpr int kBlockM = kWarpgroups * 64;
  static constexpr int kBlockN = 128;
  static constexpr int kStages = 2;
  static constexpr int kQElems = kBlockM * DK;
  static constexpr int kDoElems = kBlockM * DV;
  static constexpr int kKElems = kBlockN * DK;
  static constexpr int kVElems = kBlockN * DV;
  // Q, dO, two K and two V stages; 1024 bytes of slack to align the swizzled tiles.
  static constexpr int kSmemBytes =
      (kQElems + kDoElems + kStages * (kKElems + kVElems)) * static_cast<int>(sizeof(T)) + 1024;
  static_assert((DK == 32 || DK == 64 || DK == 128) && (DV == 64 || DV == 128) && DK <= DV,
                "the Hopper dQ pass takes Dv in {64, 128} and D in {32, 64, 128}, D <= Dv");
};

// The producer warpgroup loads Q and dO with the first key tile, then K_j and V_j of tile j
// into stage j % 2 of a two-stage mbarrier ring (`full`: landed, `empty`: both consumers done
// with it); the consumers never meet at a CTA barrier.
template <typename Traits, typename T, int DK, int DV, typename Variant>
__global__ void __launch_bounds__(Traits::kThreads, 1) bwd_dq_sm90_kernel(const AttnParams p) {
#ifdef ADAATTN_SM90A_DEVICE
  using Mod = typename Variant::Mod;
  static_assert(Variant::kNormalized, "the two-pass backward takes normalised transforms");
  static_assert(!Mod::kParamGrad, "a learnable score table takes the atomic backward");
  static_assert(!Mod::kAddsTerms, "a modifier that adds terms takes the atomic backward");
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int BN = Traits::kBlockN;
  constexpr int kConsumerThreads = Traits::kConsumerThreads;
  static_assert(Traits::kStages == 2, "two-stage mbarrier ring");
  constexpr int NT = BN / 8;  // score n-tiles per warp
  constexpr int DKT = DK / 8;
  constexpr int kQWidth = sm90::GmmaLayout<DK>::kWidth;
  constexpr int kDoWidth = sm90::GmmaLayout<DV>::kWidth;
  // Named barrier after the mainloop: every consumer is done with Q. Number 3 as in the forward
  // (0 is __syncthreads, 1 and 2 are the forward's warpgroup_any barriers).
  constexpr int kOutputBarrier = 3;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ uint64_t full[Traits::kStages], empty[Traits::kStages];
  T* const sQ = reinterpret_cast<T*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
  T* const sdO = sQ + Traits::kQElems;
  T* const sK = sdO + Traits::kDoElems;                  // [kStages][BN][DK]
  T* const sV = sK + Traits::kStages * Traits::kKElems;  // [kStages][BN][DV]

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const RowTile tile = row_tile<kBlockM>(p, blockIdx.x);
  if (!tile.valid) return;
  const int b = tile.b, h = tile.h, h_kv = tile.h_kv, m0 = tile.m0;
  const SeqLens lens = tile.lens;
  const int valid_q = lens.rows_q - m0;
  sm90::init_load_ring(full, empty, kConsumerThreads);

  auto with_tiles = [&](auto&& body) {
    if (p.block_kv_num == nullptr) {
      body(dense_key_tiles<BN>(tile.keys));
    } else {
      body(key_tiles<BN>(p, tile.keys, b, h, m0));
    }
  };

  if (warp >= kConsumerThreads / 32) {
    sm90::regs_dealloc<Traits::kProducerRegs>();
    const int ptid = tid - kConsumerThreads;
    const T* k = k_rows<T>(p, lens, b, h_kv, 0);
    const T* v = v_rows<T>(p, lens, b, h_kv, 0);
    with_tiles([&](const auto& tiles) {
      // No key tiles: the consumers write zeros over sQ without waiting, so nothing may load.
      if (tiles.count == 0) return;
      produce_query_tile_ring<kBlockM, BN, DK, DV>(p, lens, b, h, m0, k, v, tiles, sQ, sdO, sK, sV,
                                                   full, empty, ptid);
    });
  } else {
    sm90::regs_alloc<Traits::kConsumerRegs>();
    const int wg = warp / 4;
    const int warp_row0 = warp * 16;  // = 64 * wg + 16 * (warp % 4)
    const int g = lane >> 2;
    const int t = lane & 3;
    const int64_t stat_off = row_stat_offset(p, lens, b, h);
    RowRanges<1> rr;
    float lse2[2];  // log2-domain lse; +inf for rows that saw nothing (P = 0)
    // Delta = rowsum(dO * O) of this thread's two rows (the four threads of a row split its
    // 16-byte chunks), written for the dK/dV pass, which runs after this one: no separate delta
    // kernel reading O and dO again. The rows are loaded here and summed once the first key
    // tile has landed, so that the two loads overlap.
    const T* o = out_rows<T>(p, lens, b, h, m0);
    const T* dout = dout_rows<T>(p, lens, b, h, m0);
    uint4 o_rows[2][DV / 32], do_rows[2][DV / 32];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = m0 + warp_row0 + g + 8 * hh;
      const KeyRange r = key_range(p, lens, row);
      rr.lo[0][hh] = r.lo;
      rr.hi[0][hh] = r.hi;
      lse2[hh] = lse_log2(p.lse + stat_off, row, lens.rows_q);
      const int64_t local = warp_row0 + g + 8 * hh;
#pragma unroll
      for (int c = 0; c < DV / 32; ++c) {
        const int col = (t + 4 * c) * 8;
        const bool valid = row < lens.rows_q && col < p.head_dim_v;
        o_rows[hh][c] = valid ? *reinterpret_cast<const uint4*>(o + local * p.o_row_stride + col)
                              : make_uint4(0, 0, 0, 0);
        do_rows[hh][c] = valid
                             ? *reinterpret_cast<const uint4*>(dout + local * p.do_row_stride + col)
                             : make_uint4(0, 0, 0, 0);
      }
    }
    float delta[2];
    auto row_deltas = [&]() {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float acc = 0.f;
#pragma unroll
        for (int c = 0; c < DV / 32; ++c) acc += dot8<T>(o_rows[hh][c], do_rows[hh][c]);
        acc += __shfl_xor_sync(0xffffffff, acc, 1);
        acc += __shfl_xor_sync(0xffffffff, acc, 2);
        delta[hh] = acc;
        const int row = m0 + warp_row0 + g + 8 * hh;
        if (t == 0 && row < lens.rows_q) p.delta[stat_off + row] = acc;
      }
    };
    float dq[1][DKT][4];
    zero(dq);

    // S = Q K^T and dP = dO V^T of K/V stage `stage` (two commit groups).
    auto issue_scores = [&](float (&s)[1][NT][4], float (&dp)[1][NT][4], int stage) {
      // Base descriptors from opaque values: the per-step descriptors are then computed where
      // they are used instead of being kept live across iterations.
      const uint64_t q_desc = sm90::opaque(sm90::gmma_desc_k<DK>(sQ + wg * 64 * kQWidth));
      const uint64_t do_desc = sm90::opaque(sm90::gmma_desc_k<DV>(sdO + wg * 64 * kDoWidth));
      const uint64_t k_desc = sm90::opaque(sm90::gmma_desc_k<DK>(sK + stage * Traits::kKElems));
      const uint64_t v_desc = sm90::opaque(sm90::gmma_desc_k<DV>(sV + stage * Traits::kVElems));
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DK / 16; ++kk) {
        sm90::wgmma_ss<T, NT>(s[0],
                              sm90::desc_at<T>(q_desc, sm90::gmma_kcol<kBlockM, DK>(kk * 16)),
                              sm90::desc_at<T>(k_desc, sm90::gmma_kcol<BN, DK>(kk * 16)), kk > 0);
      }
      sm90::wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < DV / 16; ++kk) {
        sm90::wgmma_ss<T, NT>(dp[0],
                              sm90::desc_at<T>(do_desc, sm90::gmma_kcol<kBlockM, DV>(kk * 16)),
                              sm90::desc_at<T>(v_desc, sm90::gmma_kcol<BN, DV>(kk * 16)), kk > 0);
      }
      sm90::wgmma_commit();
    };
    // P = exp2(s * scale_log2 - lse2), 0 outside each row's key range; full tiles (most) skip
    // the mask's compares and selects. A modifier applies to the scores first (kGradInP: s
    // keeps P times its derivative).
    auto probs = [&](float (&s)[1][NT][4], int n0) {
      const float scale = backward_scores<Mod, false>(
          s, p, lens, b, h, m0 + warp_row0, n0, lane,
          !Mod::kIdentity && Mod::tile_active(p, lens, m0 + warp_row0, m0 + warp_row0 + 15, n0,
                                              n0 + BN - 1));
      auto apply = [&](auto masked) {
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float pe = exp2f(fmaf(s[0][ni][e], scale, -lse2[e >> 1]));
            // Masked after the product (a masked score's derivative may be NaN).
            if constexpr (kGradInP<Mod>) pe *= Mod::grad_raw_frag(s[0][ni][e], p);
            if constexpr (decltype(masked)::value) {
              const int col = n0 + ni * 8 + 2 * t + (e & 1);
              if (col < rr.lo[0][e >> 1] || col >= rr.hi[0][e >> 1]) pe = 0.f;
            }
            s[0][ni][e] = pe;
          }
      };
      if (tile_is_full(p, lens, m0 + warp_row0, m0 + warp_row0 + 16, n0, n0 + BN)) {
        apply(std::false_type{});
      } else {
        apply(std::true_type{});
      }
    };
    // dS = P (dP - Delta) (times the modifier's derivative) as the A operand of the dQ product.
    auto grad_scores = [&](const float (&s)[1][NT][4], float (&dp)[1][NT][4],
                           uint32_t (&dsa)[1][NT / 2][4]) {
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float ds = s[0][ni][e] * (dp[0][ni][e] - delta[e >> 1]);
          dp[0][ni][e] =
              kGradInP<Mod> ? ds : raw_score_grad<Mod>(ds, s[0][ni][e], lse2[e >> 1], p);
        }
      to_a_frags<1, NT, T>(dp, dsa);
    };
    // dQ += dS K of K stage `stage`: K [BN][DK] read transposed.
    auto issue_dq = [&](const uint32_t (&dsa)[1][NT / 2][4], int stage) {
      sm90::fence_operand(dq[0]);
      sm90::wgmma_fence();
      const uint64_t k_t_desc =
          sm90::opaque(sm90::gmma_desc_mn<BN, DK>(sK + stage * Traits::kKElems));
#pragma unroll
      for (int kt = 0; kt < BN / 16; ++kt) {
        sm90::wgmma_rs<T, DKT>(dq[0], dsa[0][kt], sm90::desc_at<T>(k_t_desc, kt * 16 * kQWidth));
      }
      sm90::wgmma_commit();
    };
    auto wait_full = [&](int j) { sm90::mbar_wait(&full[j % 2], (j >> 1) & 1); };
    auto release = [&](int j) {
      if (lane == 0) sm90::mbar_arrive(&empty[j % 2]);
    };

    with_tiles([&](const auto& tiles) {
      if (tiles.count > 0) wait_full(0);
      row_deltas();
      for (int i = 0; i < tiles.count; ++i) {
        float s[1][NT][4];
        float dp[1][NT][4];
        wait_full(i);
        issue_scores(s, dp, i % 2);
        sm90::wgmma_wait<1>(s[0]);
        probs(s, tiles.at(i) * BN);
        sm90::wgmma_wait<0>(dp[0]);
        uint32_t dsa[1][NT / 2][4];
        grad_scores(s, dp, dsa);
        issue_dq(dsa, i % 2);
        sm90::wgmma_wait<0>(dq[0]);
        sm90::fence_operand(dsa[0]);
        release(i);
      }
    });

    // dQ rows are staged over sQ, which no consumer reads after this barrier (every load has
    // landed: the consumers waited for the last tile).
    sm90::named_sync(kOutputBarrier, kConsumerThreads);
    const float qscale[1][2] = {{static_cast<float>(p.scale), static_cast<float>(p.scale)}};
    store_rows<1, DKT, DK>(dq, qscale, sQ, warp_row0, dq_rows<T>(p, lens, b, h, m0),
                           p.dq_row_stride, valid_q, lane, 0, p.head_dim);
  }
#endif
}

}  // namespace tc
}  // namespace adaattn
