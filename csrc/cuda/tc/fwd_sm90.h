// Hopper forward: the mainloop of fwd_sm80.h with its two products on warpgroup MMAs (wgmma.h)
// instead of per-warp mma.sync, warp-specialised (see the kernel). Two consumer warpgroups own
// 64 query rows each and keep O and the softmax state in registers; K and V tiles of 128 keys
// (64 or 80 at the widest head dims: Sm90FwdTraits) are double-buffered in shared memory. Masks
// (dense ranges and block-sparse lists, tiles.h), the softmax and the variant hooks are the
// fragment-level ones of softmax_frag.h, since a warp's rows of a wgmma accumulator are laid
// out as its mma.sync fragments.
#pragma once

#include <cmath>

#include "../../core/mask.h"
#include "../../core/params.h"
#include "softmax_frag.h"
#include "tiles.h"
#include "tma.h"
#include "wgmma.h"

namespace adaattn {
namespace tc {

// kWarpgroupCount: consumer warpgroups, 2 or 3 (launch.h's sm90_fwd_warpgroups). kKeys80:
// 80-key tiles (FA3's at head dim 256) for the online softmax at D + Dv > 384, where 64-key
// tiles left the tensor pipe waiting on each tile's softmax (launch.h picks them).
// setmaxnreg's split of the register file: the producer keeps what its copies need (the column
// blocks of D + Dv > 256 take more than 32); 80 keys of S beside a 64 x 256 O take 240 a
// consumer thread, which leaves the producer 24.
template <typename T, int DK, int DV, int kWarpgroupCount, bool kKeys80 = false>
struct Sm90FwdTraits
    : sm90::WarpSpecialisedSplit<kWarpgroupCount, (kKeys80 ? 24 : (DK + DV > 256) ? 40 : 32),
                                 (kWarpgroupCount == 3 ? 160 : kKeys80 ? 240 : 232)> {
  static_assert(!kKeys80 || (DK + DV > 384 && kWarpgroupCount == 2),
                "80-key tiles are (256, 256)'s, with two consumer warpgroups");
  // Ping-pong turns (the kernel's softmax mainloop): at D + Dv > 384 a product is long beside
  // a softmax and waiting for the turn cost 4-10% (H200, (256, 256)).
  static constexpr bool kTakeTurns = DK + DV <= 384;
  static constexpr int kBlockM = kWarpgroupCount * 64;
  static constexpr int kStages = 2;
  static constexpr int kQElems = kBlockM * DK;
  // Keys per streamed tile: 128, or 64 where 128-key stages do not fit the 227 KiB an SM90 CTA
  // may take (D + Dv > 320: (192, 192), (256, 256)), or 80.
  static constexpr int kBlockN =
      kKeys80 ? 80
      : (kQElems + kStages * 128 * (DK + DV)) * static_cast<int>(sizeof(T)) + 1024 <= 227 * 1024
          ? 128
          : 64;
  static constexpr int kKElems = kBlockN * DK;
  static constexpr int kVElems = kBlockN * DV;
  // Q, two K and two V stages; 1024 bytes of slack to align the swizzled tiles.
  static constexpr int kSmemBytes =
      (kQElems + kStages * (kKElems + kVElems)) * static_cast<int>(sizeof(T)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "the tiles fit shared memory");
  static_assert((DK % 64 == 0 || DK == 32) && DK <= 256 && DV % 64 == 0 && DV <= 256,
                "wgmma tiles: DK % 64 == 0 or 32, DV % 64 == 0, both <= 256");
  static_assert(kBlockM * DV <= kQElems + kStages * (kKElems + kVElems),
                "output staging fits over Q, K and V");
};

// Tensor maps of q, k and v for the producer's TMA loads (tma.h; boxes of kBlockM query rows, of
// kBlockN key rows), where the launcher could encode them: dense rows of one length (no packed
// sequences, seqlens or cache), so that rows past the tensor, which TMA zero-fills, are all the
// rows past the attended ones. Otherwise `enabled` is false and 128 producer threads copy with
// cp.async.
struct Sm90FwdMaps {
  CUtensorMap q, k, v;
  bool enabled;
};

// The Hopper forward. Consumer warpgroups run the mainloop of fwd_sm80.h on wgmma; a
// producer warpgroup loads Q, K and V (by TMA from one thread where `maps` are enabled; else
// with cp.async from all 128, every row layout of the flash family loading as the SM80 kernels
// do) and they meet at mbarriers, never at a CTA barrier: load group j goes
// to stage j % 2, `full[j % 2]` completes when it has landed, `empty[j % 2]` when both consumers
// are done with it, which lets group j + 2 in. The producer gives its registers to the consumers
// (setmaxnreg).
// * Normalised transforms: group g holds K_g and V_{g-1} (group 0: Q and K_0). Iteration i issues S_i
//   and then O += P_{i-1} V_{i-1}, then the softmax of S_i, and rescales O once that product
//   has landed. ptxas moves the product's wait above the softmax (SASS), so within a
//   warpgroup they do not overlap; a rotated loop that keeps them apart was 1-5% faster on
//   dense rows and 3-5% slower on masked ones (docs/lab).
//   The warpgroups take turns issuing their products (ping-pong, one named barrier each), so
//   that one's softmax runs under the others' products (7% at D = 128 on the H100; too short
//   to cover a softmax at the 32-wide low-rank scores, where it neither helps nor hurts). At
//   D = 64 three warpgroups take turns (sm90_fwd_warpgroups); above D + Dv = 384 none do.
// * Other transforms (kStats: the weight pass counts into p.stats, a separate instantiation):
//   groups 0..n-1 hold K_i for the lse pass (one tile's S in flight at a time);
//   groups n..2n-1 hold K_i and V_i for the weight pass, which skips the A V product of a
//   warpgroup's 64 x 128 tile whose weights are all zero (a warpgroup vote).
template <typename Traits, typename T, int DK, int DV, typename Variant, bool kStats>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    fwd_sm90_kernel(const AttnParams p, const __grid_constant__ Sm90FwdMaps maps) {
#ifdef ADAATTN_SM90A_DEVICE
  using Mod = typename Variant::Mod;
  using Transform = typename Variant::Transform;
  constexpr bool kLsePass = !Variant::kNormalized;
  static_assert(!kLsePass || DK == DV, "an lse pass needs DK == DV");
  static_assert(kLsePass || !kStats, "statistics count the weights of an lse-pass transform");
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int BN = Traits::kBlockN;
  constexpr int kConsumerThreads = Traits::kConsumerThreads;
  // The ring's phase parity below is (j / 2) % 2.
  static_assert(Traits::kStages == 2, "two-stage mbarrier ring");
  constexpr int NT = BN / 8;  // score n-tiles per warp
  constexpr int DT = DV / 8;  // output n-tiles per warp
  constexpr int kQWidth = sm90::GmmaLayout<DK>::kWidth;
  // Named barrier after the mainloop: every consumer is done with Q and K (1 to kWarpgroups
  // are warpgroup_any's).
  constexpr int kOutputBarrier = 1 + Traits::kWarpgroups;
  // Named barriers kTurnBarrier + wg: warpgroup wg's turn to issue its products (softmax
  // mainloop; the waiting warpgroup and the one passing the turn meet there).
  constexpr int kTurnBarrier = 2 + Traits::kWarpgroups;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ uint64_t full[Traits::kStages], empty[Traits::kStages];
  // The 128-byte swizzle is a function of address bits 4-9: tiles start 1024-byte aligned.
  T* const sQ = reinterpret_cast<T*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
  T* const sK = sQ + Traits::kQElems;                  // [kStages][BN][DK]
  T* const sV = sK + Traits::kStages * Traits::kKElems;  // [kStages][BN][DV]

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const RowTile tile = row_tile<kBlockM>(p, blockIdx.x);
  if (!tile.valid || q8_owns_head(p, tile.b, tile.h)) return;
  const int b = tile.b, h = tile.h, h_kv = tile.h_kv, m0 = tile.m0;
  const SeqLens lens = tile.lens;
  const int valid_q = lens.rows_q - m0;
  sm90::init_load_ring(full, empty, kConsumerThreads, maps.enabled ? 1 : 128);

  // Block lists are walked for normalised transforms only (fwd_sm80.h says why).
  auto with_tiles = [&](auto&& body) {
    if (kLsePass || p.block_kv_num == nullptr) {
      body(dense_key_tiles<BN>(tile.keys));
    } else {
      body(key_tiles<BN>(p, tile.keys, b, h, m0));
    }
  };

  if (warp >= kConsumerThreads / 32) {
    sm90::regs_dealloc<Traits::kProducerRegs>();
    const int ptid = tid - kConsumerThreads;
    with_tiles([&](const auto& tiles) {
      // No key tiles: the consumers write zeros over sQ without waiting, so nothing may load.
      if (tiles.count == 0) return;
      const int lse_groups = kLsePass && p.lse_pass != LsePass::kGiven ? tiles.count : 0;
      const int groups = !kLsePass ? tiles.count + 1
                                   : lse_groups + (p.lse_pass == LsePass::kOnly ? 0 : tiles.count);
      // The launcher encodes maps only for tiles of whole 64-column blocks (not 32-wide ones).
      if constexpr (DK % 64 == 0) {
        if (maps.enabled) {
          // One thread issues every load (the groups of the cp.async loop below); `full`
          // completes on its arrival and the group's bytes.
          if (ptid != 0) return;
          constexpr uint32_t kQBytes = kBlockM * DK * sizeof(T);
          constexpr uint32_t kKBytes = BN * DK * sizeof(T), kVBytes = BN * DV * sizeof(T);
          for (int j = 0; j < groups; ++j) {
            if (j >= 2) sm90::mbar_wait(&empty[j % 2], ((j - 2) >> 1) & 1);
            uint64_t* const bar = &full[j % 2];
            const bool with_k = kLsePass || j < tiles.count;
            const bool with_v = kLsePass ? j >= lse_groups : j > 0;
            sm90::mbar_arrive_expect_tx(bar, (j == 0 ? kQBytes : 0) + (with_k ? kKBytes : 0) +
                                                 (with_v ? kVBytes : 0));
            if (j == 0) sm90::load_tile_tma<kBlockM, DK>(sQ, &maps.q, m0, h, b, bar);
            const int i = kLsePass && j >= lse_groups ? j - lse_groups : j;
            if (with_k) {
              sm90::load_tile_tma<BN, DK>(sK + (j % 2) * Traits::kKElems, &maps.k,
                                          tiles.at(i) * BN, h_kv, b, bar);
            }
            if (with_v) {
              const int n = kLsePass ? i : i - 1, stage = kLsePass ? j % 2 : (j - 1) % 2;
              sm90::load_tile_tma<BN, DV>(sV + stage * Traits::kVElems, &maps.v,
                                          tiles.at(n) * BN, h_kv, b, bar);
            }
          }
          return;
        }
      }
      const T* q = q_rows<T>(p, lens, b, h, m0);
      const T* k = k_rows<T>(p, lens, b, h_kv, 0);
      const T* v = v_rows<T>(p, lens, b, h_kv, 0);
      auto load_k = [&](int stage, int n) {
        sm90::load_tile_gmma<BN, DK, 128>(sK + stage * Traits::kKElems,
                                          k + static_cast<int64_t>(n) * BN * p.k_row_stride,
                                          p.k_row_stride, lens.rows_k - n * BN, ptid, p.head_dim);
      };
      // Values past the attended keys (padding) are zero-filled: their weights are 0, and 0
      // times whatever the padding holds (NaN) must not reach the rows.
      auto load_v = [&](int stage, int n) {
        sm90::load_tile_gmma<BN, DV, 128>(sV + stage * Traits::kVElems,
                                          v + static_cast<int64_t>(n) * BN * p.v_row_stride,
                                          p.v_row_stride, lens.k - n * BN, ptid, p.head_dim_v);
      };
      for (int j = 0; j < groups; ++j) {
        if (j >= 2) sm90::mbar_wait(&empty[j % 2], ((j - 2) >> 1) & 1);
        if (j == 0) {
          sm90::load_tile_gmma<kBlockM, DK, 128>(sQ, q, p.q_row_stride, valid_q, ptid,
                                                 p.head_dim);
        }
        if (kLsePass) {
          const int i = j < lse_groups ? j : j - lse_groups;
          load_k(j % 2, tiles.at(i));
          if (j >= lse_groups) load_v(j % 2, tiles.at(i));
        } else {
          if (j < tiles.count) load_k(j % 2, tiles.at(j));
          if (j > 0) load_v((j - 1) % 2, tiles.at(j - 1));
        }
        sm90::publish_stage(&full[j % 2]);
      }
    });
  } else {
    sm90::regs_alloc<Traits::kConsumerRegs>();
    const int wg = warp / 4;
    const int warp_row0 = warp * 16;  // = 64 * wg + 16 * (warp % 4)
    const int g = lane >> 2;
    const RowRanges<1> rr = warp_row_ranges(p, lens, m0 + warp_row0, lane);
    float row_term[1][2];  // the transform's c_i of each row
    if (kLsePass) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = m0 + warp_row0 + g + 8 * hh;
        row_term[0][hh] = Transform::template row_term<float>(p, h, query_position(lens, row));
      }
    }
    float o[1][DT][4];
    zero(o);
    float row_max[1][2];
    float row_sum[1][2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      init_row_state<Transform>(p, h, lane, row_max[0][hh], row_sum[0][hh]);
    }
    float lse2[1][2] = {{INFINITY, INFINITY}};  // lse pass: log2 lse (+inf: no keys)
    WeightStats stats;

    // S = Q K^T of K stage `stage`: DK / 16 steps of k = 16 over the K-major Q and K tiles.
    auto issue_scores = [&](float (&s)[1][NT][4], int stage) {
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DK / 16; ++kk) {
        const T* a = sQ + sm90::gmma_kcol<kBlockM, DK>(kk * 16) + wg * 64 * kQWidth;
        const T* bk = sK + stage * Traits::kKElems + sm90::gmma_kcol<BN, DK>(kk * 16);
        sm90::wgmma_ss<T, NT>(s[0], sm90::gmma_desc_k<DK>(a), sm90::gmma_desc_k<DK>(bk),
                              kk > 0);
      }
      sm90::wgmma_commit();
    };
    // O += P V of V stage `stage`: BN / 16 steps of 16 keys; V is read transposed (MN-major).
    auto issue_pv = [&](const uint32_t (&pa)[NT / 2][4], int stage) {
      sm90::wgmma_fence();
#pragma unroll
      for (int kt = 0; kt < BN / 16; ++kt) {
        const T* bv = sV + stage * Traits::kVElems + kt * 16 * sm90::GmmaLayout<DV>::kWidth;
        sm90::wgmma_rs_cols<T, DT>(o[0], pa[kt], [&](int col) {
          return sm90::gmma_desc_mn<BN, DV>(bv + sm90::gmma_kcol<BN, DV>(col));
        });
      }
      sm90::wgmma_commit();
    };
    auto wait_full = [&](int j) { sm90::mbar_wait(&full[j % 2], (j >> 1) & 1); };
    auto release = [&](int j) {
      if (lane == 0) sm90::mbar_arrive(&empty[j % 2]);
    };

    // Normalised transforms. The first iteration and the last product are peeled, so that no
    // wgmma wait depends on a branch (ptxas would serialise the products).
    auto online_mainloop = [&](const auto& tiles) {
      // The scale goes into the exponent's FMA; a scale <= 0 (allowed, if odd) is applied
      // first since the row max is taken on raw scores. A row keeps a running max that is up
      // to kMaxSlack (log2 units) below its true max, so that O is rescaled only when the max
      // grows by more than that (FA4's trick): probabilities stay <= 2^8 before the final
      // division, well inside float32 and the 16-bit P operand. Measured on the H100 (same
      // build, slack 0 against 8): forward 0.892 -> 0.875 ms at B=4, L=4k, D=128, the 32-wide
      // low-rank forward 0.85 -> 0.81 ms, the block-sparse window 0.306 -> 0.295 ms.
      constexpr float kMaxSlack = 8.f;
      auto softmax_scores = [&](float (&s)[1][NT][4], int n0, float (&corr)[1][2]) {
        const float scale = fold_scores<Mod>(s, p, lens, rr, b, h, m0 + warp_row0, n0, lane);
        online_softmax<true>(s, row_max, row_sum, corr, scale, kMaxSlack);
      };
      // Turns (FA3's ping-pong; without them the warpgroups wait on the same loads and run
      // their softmaxes at once), passed round the warpgroups in order. The last gives
      // warpgroup 0 the first turn and passes none after its last product, so that every
      // arrival is consumed.
      constexpr int kWgs = Traits::kWarpgroups;
      const sm90::WarpgroupTurns<kWgs, kTurnBarrier> turns{wg};
      if (Traits::kTakeTurns && wg == kWgs - 1) turns.pass();
      uint32_t pa[1][NT / 2][4];
      {
        wait_full(0);
        float s[1][NT][4];
        if (Traits::kTakeTurns) turns.take();
        issue_scores(s, 0);
        if (Traits::kTakeTurns) turns.pass();
        sm90::wgmma_wait<0>(s[0]);
        release(0);
        float corr[1][2];  // O is still 0
        softmax_scores(s, tiles.at(0) * BN, corr);
        to_a_frags<1, NT, T>(s, pa);
      }
      for (int i = 1; i < tiles.count; ++i) {
        wait_full(i);
        float s[1][NT][4];
        if (Traits::kTakeTurns) turns.take();
        issue_scores(s, i % 2);
        issue_pv(pa[0], (i - 1) % 2);
        if (Traits::kTakeTurns) turns.pass();
        sm90::wgmma_wait<1>(s[0]);
        float corr[1][2];
        softmax_scores(s, tiles.at(i) * BN, corr);
        sm90::wgmma_wait<0>(o[0]);
        sm90::fence_operand(pa[0]);  // P_{i-1} stays intact until its product has read it
        release(i);
        if (corr[0][0] != 1.f || corr[0][1] != 1.f) {  // a max moved past the slack
#pragma unroll
          for (int di = 0; di < DT; ++di)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[0][di][e] *= corr[0][e >> 1];
        }
        to_a_frags<1, NT, T>(s, pa);
      }
      wait_full(tiles.count);
      if (Traits::kTakeTurns) turns.take();
      issue_pv(pa[0], (tiles.count - 1) % 2);
      if (Traits::kTakeTurns && wg != kWgs - 1) turns.pass();
      sm90::wgmma_wait<0>(o[0]);
      sm90::fence_operand(pa[0]);
    };

    // Other transforms: pass 1 (lse), then pass 2 (weights); either alone with p.lse_pass
    // (kOnly: the lse; kGiven: the weights against p.lse).
    auto two_pass_mainloop = [&](const auto& tiles) {
      const int n = tiles.count;
      // Whether a masked score (p = 0) could get a non-zero weight in this thread's rows.
      const bool masked_weights = Transform::weight(0.f, row_term[0][0]) != 0.f ||
                                  Transform::weight(0.f, row_term[0][1]) != 0.f;
      const int lse_groups = p.lse_pass == LsePass::kGiven ? 0 : n;
      if (lse_groups == 0) {
        const float* lse = p.lse + row_stat_offset(p, lens, b, h);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          lse2[0][hh] = lse_log2(lse, m0 + warp_row0 + g + 8 * hh, lens.rows_q);
        }
      } else {
        // One tile's S at a time (the other warpgroup's products fill the tensor cores):
        // overlapping the next tile's S takes either a wgmma wait that depends on a branch (the
        // last tile's), on which ptxas serialises every product of the kernel (C7518), or, peeled,
        // ~96 bytes of spills at D = 128.
        for (int i = 0; i < n; ++i) {
          wait_full(i);
          float s[1][NT][4];
          issue_scores(s, i % 2);
          sm90::wgmma_wait<0>(s[0]);
          release(i);
          const float scale =
              fold_scores<Mod>(s, p, lens, rr, b, h, m0 + warp_row0, tiles.at(i) * BN, lane);
          float corr[1][2];
          online_softmax<true>(s, row_max, row_sum, corr, scale);
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          float l = row_sum[0][hh];
          l += __shfl_xor_sync(0xffffffff, l, 1);
          l += __shfl_xor_sync(0xffffffff, l, 2);
          row_sum[0][hh] = l;
          if (row_saw_keys(l)) lse2[0][hh] = row_max[0][hh] + log2f(l);
        }
      }
      if (p.lse_pass == LsePass::kOnly) return;
      for (int i = 0; i < n; ++i) {
        const int j = lse_groups + i;
        const int n0 = tiles.at(i) * BN;
        wait_full(j);
        float s[1][NT][4];
        issue_scores(s, j % 2);
        sm90::wgmma_wait<0>(s[0]);
        TileWeights w{true, false};  // the warp tile has a weight / entries
        uint32_t pa[1][NT / 2][4];
        const float scale = fold_scores<Mod>(s, p, lens, rr, b, h, m0 + warp_row0, n0, lane);
        if constexpr (kStats) {
          w = transform_weights<Transform, 1, NT, true>(s, lse2, row_term, stats, scale);
          to_a_frags<1, NT, T>(s, pa);
        } else if (masked_weights &&
                   !tile_is_full(p, lens, m0 + warp_row0, m0 + warp_row0 + 16, n0, n0 + BN)) {
          w.any = transform_weights_packed<Transform, NT, T, true>(s, lse2, row_term, scale, pa);
        } else {
          w.any = transform_weights_packed<Transform, NT, T, false>(s, lse2, row_term, scale, pa);
        }
        // An all-zero tile of the warpgroup skips the product (it would add exact zeros).
        const bool any = sm90::warpgroup_any(w.any, wg);
        if (kStats) stats.tile(w.visited, !any, lane);
        if (any) {
          issue_pv(pa[0], j % 2);
          sm90::wgmma_wait<0>(o[0]);
        }
        release(j);
      }
    };

    with_tiles([&](const auto& tiles) {
      if (tiles.count == 0) return;
      if constexpr (kLsePass) {
        two_pass_mainloop(tiles);
      } else {
        online_mainloop(tiles);
      }
    });

    // Finalise: a normalised transform divides by the row sum, others do not (their row sums
    // were reduced after pass 1). lse is the natural-log log-sum-exp of the scores (and of the
    // transform's initial state); rows that saw nothing (and no initial state): out 0, lse -inf.
    T* out = out_rows<T>(p, lens, b, h, m0);
    float* lse = p.lse + row_stat_offset(p, lens, b, h);
    float inv[1][2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float l = row_sum[0][hh];
      if (!kLsePass) {
        l += __shfl_xor_sync(0xffffffff, l, 1);
        l += __shfl_xor_sync(0xffffffff, l, 2);
      }
      inv[0][hh] = kLsePass ? 1.f : (row_saw_keys(l) ? 1.f / l : 0.f);
      const int row = m0 + warp_row0 + g + 8 * hh;
      if ((lane & 3) == 0 && row < lens.rows_q && (!kLsePass || p.lse_pass != LsePass::kGiven)) {
        lse[row] = row_saw_keys(l) ? (row_max[0][hh] + log2f(l)) * float(M_LN2) : -INFINITY;
      }
    }
    if (kStats) flush_stats(p.stats, stats);
    if (kLsePass && p.lse_pass == LsePass::kOnly) return;
    // Output rows are staged over sQ/sK, which no consumer reads after this barrier (every load
    // has landed: the consumers waited for the last group).
    sm90::named_sync(kOutputBarrier, kConsumerThreads);
    store_rows<1, DT, DV>(o, inv, sQ, warp_row0, out, p.o_row_stride, valid_q, lane, 0,
                          p.head_dim_v);
  }
#endif
}

}  // namespace tc
}  // namespace adaattn
