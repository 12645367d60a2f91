// Hopper backward (dQ by atomic bulk reductions; Dv in {64, 128}, D = Dv or, for low-rank
// scores, D in {32, 64} below it): the dK/dV pass of bwd_sm80.h on warpgroup MMAs. A CTA owns
// 128 keys of one (batch, kv head), 64 per warpgroup (or 64 keys and one warpgroup, two CTAs per
// SM: Sm90BwdTraits), and walks the query tiles (64 rows, every query head of its GQA group)
// that meet them, with Q and dO double-buffered through cp.async, issued by every thread or by
// a producer warpgroup (Sm90BwdTraits::kProducer, launch.h's sm90_bwd_producer says where).
// Per step and warpgroup:
//   S^T = K Q^T, dP^T = V dO^T        (both operands in shared memory)
//   P^T, dS^T = P^T (dP^T - Delta)    (registers: the accumulator rows are keys)
//   dV += P^T dO, dK += dS^T Q        (P^T, dS^T as register A operands; dO, Q read transposed)
//   dQ += dS K                        (dS^T staged in shared memory by both warpgroups; with two
//                                      warpgroups and D >= 64 warpgroup w adds its half of the
//                                      columns over all 128 keys to the fp32 accumulator,
//                                      otherwise all columns over its own 64 keys: the step's
//                                      rows are staged in fp32 and added by one bulk reduction
//                                      per tile after the next step's barrier)
// Five products per tile pair, as FlashAttention-2/3. dK/dV stay in registers; the dQ
// accumulator is scaled and converted by bwd_dq_convert_kernel. Without the dQ product
// (Sm90BwdTraits::kDq = false) this is the dK/dV pass of the two-pass backward, whose dQ pass
// is bwd_dq_sm90.h: no dS^T staging and no CTA barrier inside a step.
// The variant's score modifier is applied to S^T (its derivative, if not 1, multiplies dS^T;
// a learnable table stages dS^T in fp32 for the CTA's partial sums, in a fixed order). A
// non-normalised transform (D = Dv) takes dV from the weights A^T (skipped when the
// warpgroup's are all zero) and uses dS^T = P^T (M dA^T - Delta) with the row pass's Delta.
#pragma once

#include <cmath>
#include <type_traits>

#include "../../core/mask.h"
#include "../../core/params.h"
#include "bwd_common.h"
#include "softmax_frag.h"
#include "tiles.h"
#include "wgmma.h"

namespace adaattn {
namespace tc {

// Query rows per step of the Hopper backward (the tile its dQ reductions add).
constexpr int kSm90BwdBlockM = 64;

// kWithDerivative / kWithTableGrad = false: without the pass that multiplies dS by the
// derivative of a modifier that adds terms, or without its table's gradient, for calls that
// need it not (launch.h's launch_bwd_sm90_atomic).
// kWithProducer: a producer warpgroup loads each step's tiles into a two-stage ring (the
// forward's warp specialisation, on named barriers) and the consumers meet only once a step, for
// dS^T; dS^T and dQ's staging tiles are double-buffered for that (two consumer warpgroups with
// dQ; a learnable table's staging may then share dQ's tile: kStageInDq).
template <typename T, int DK, int DV, typename Variant, bool kWithDq = true,
          int kWarpgroupCount = 2, bool kWithDerivative = true, bool kWithTableGrad = true,
          bool kWithProducer = false>
struct Sm90BwdTraits {
  static constexpr bool kLsePass = !Variant::kNormalized;
  static constexpr bool kDerivative = kWithDerivative;
  static constexpr bool kParamGrad = Variant::Mod::kParamGrad && kWithTableGrad;
  // kWithDq = false: the dK/dV pass of the two-pass backward (bwd_dq_sm90.h adds dQ).
  static constexpr bool kDq = kWithDq;
  // Warpgroups per CTA, 64 keys each. With one, two CTAs share an SM (kMinBlocks) and their
  // steps are not tied together by CTA barriers (sm90_bwd_warpgroups says where that pays).
  static constexpr int kWarpgroups = kWarpgroupCount;
  static constexpr int kMinBlocks = kWarpgroups == 1 ? 2 : 1;
  static constexpr bool kProducer = kWithProducer;
  static constexpr int kConsumerThreads = 128 * kWarpgroups;
  static constexpr int kThreads = kConsumerThreads + (kProducer ? 128 : 0);
  // setmaxnreg's split with a producer (FA3's for its backward): the consumers hold dK and dV.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static constexpr int kBuffers = kProducer ? 2 : 1;  // of dS^T and of dQ's staging
  // Whether the kernel walks block lists: not a producer's at D = 128, whose block-list steps
  // make both sides spill (launch.h gives block lists the kernel without a producer there).
  static constexpr bool kBlockLists = !kProducer || DK <= 64;
  static constexpr int kBlockN = 64 * kWarpgroups;  // keys per CTA
  static constexpr int kBlockM = kSm90BwdBlockM;  // queries per step
  static constexpr int kKElems = kBlockN * DK;
  static constexpr int kVElems = kBlockN * DV;
  static constexpr int kQElems = kBlockM * DK;
  static constexpr int kDoElems = kBlockM * DV;
  static constexpr int kDsElems = kDq ? kBlockN * kBlockM : 0;
  // dQ: with two warpgroups and DK >= 64, warpgroup w adds columns [w DK / 2, (w + 1) DK / 2)
  // over all 128 keys (one tile per step to reduce); otherwise all DK columns over its own 64
  // keys (both add to the same rows).
  static constexpr bool kDqSplitCols = kWarpgroups == 2 && DK >= 64;
  static constexpr int kDqKeys = kDqSplitCols ? kBlockN : 64;
  static constexpr int kDqCols = kDqSplitCols ? DK / 2 : DK;
  // The step's fp32 dQ rows, staged for the bulk reductions: split columns, one [BM][DK] tile
  // (the two warpgroups' column halves), else one [BM][DK] tile per warpgroup. Rows are
  // stored as the accumulator holds them (dq_swizzle), so that a tile is one contiguous copy.
  static constexpr int kDqTileFloats = kWarpgroups * kBlockM * kDqCols;
  static constexpr int kDqStageFloats = kDq ? kBuffers * kDqTileFloats : 0;
  // K, V, two stages of Q and dO, dS^T, then lse and delta (non-normalised: and the row term)
  // of both stages, (learnable score table) the fp32 dS^T staging tile and the dQ staging
  // tiles; 1024 bytes of slack to align the swizzled tiles.
  static constexpr int kRowVectors = kLsePass ? 3 : 2;
  static constexpr int kStageStride = kBlockM + 8;  // conflict-free paired stores
  static constexpr int kTileBytes =
      (kKElems + kVElems + 2 * (kQElems + kDoElems) + kBuffers * kDsElems) *
          static_cast<int>(sizeof(T)) +
      (2 * kRowVectors * kBlockM + kDqStageFloats) * static_cast<int>(sizeof(float)) + 1024;
  // Where the fp32 dS^T tile is staged for the table's gradient: its own area, or, where that
  // would not fit beside a producer's buffers, the step's dQ staging tile (free until dQ is
  // staged), 64 keys at a time.
  static constexpr int kStageTileFloats = kParamGrad ? kBlockN * kStageStride : 0;
  static constexpr bool kStageInDq =
      kProducer && kParamGrad &&
      kTileBytes + kStageTileFloats * static_cast<int>(sizeof(float)) > 227 * 1024;
  static constexpr int kStageKeys = kStageInDq ? 64 : kBlockN;
  static constexpr int kStageFloats = kStageInDq ? 0 : kStageTileFloats;
  static constexpr int kSmemBytes = kTileBytes + kStageFloats * static_cast<int>(sizeof(float));
  static_assert(!kStageInDq || kStageKeys * kStageStride <= kDqTileFloats,
                "the table's staging fits a dQ staging tile");
  static_assert((DK == 32 || DK == 64 || DK == 128) && (DV == 64 || DV == 128) && DK <= DV,
                "the Hopper backward takes Dv in {64, 128} and D in {32, 64, 128}, D <= Dv");
  static_assert(kDq || !kLsePass, "a non-normalised transform accumulates dQ in this pass");
  static_assert(kWarpgroups == 2 || (kWarpgroups == 1 && !kDqSplitCols && !kLsePass &&
                                     !kParamGrad),
                "one warpgroup per CTA: D <= 64, normalised, no learnable score table");
  static_assert(!kProducer || (kWarpgroups == 2 && kDq),
                "a producer: two consumer warpgroups with dQ");
  static_assert(!kProducer || kWarpgroups * 128 * kConsumerRegs + 128 * kProducerRegs <=
                                  sm90::launch_register_budget(kThreads),
                "the register split fits what the CTA was launched with");
  static_assert(kSmemBytes <= 227 * 1024, "the tiles fit shared memory");
};

template <typename Traits, typename T, int DK, int DV, typename Variant>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocks)
    bwd_sm90_kernel(const AttnParams p) {
#ifdef ADAATTN_SM90A_DEVICE
  using Mod = typename Variant::Mod;
  using Transform = typename Variant::Transform;
  constexpr bool kLsePass = !Variant::kNormalized;
  static_assert(!kLsePass || DK == DV, "a non-normalised transform takes DK == DV");
  constexpr bool kDq = Traits::kDq;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int BM = Traits::kBlockM;
  constexpr int kThreads = Traits::kThreads;
  constexpr int NT = BM / 8;  // query n-tiles of S^T per warp
  constexpr int DKT = DK / 8;
  constexpr int DVT = DV / 8;
  constexpr int kKWidth = sm90::GmmaLayout<DK>::kWidth;  // elements per swizzled row
  constexpr int kVWidth = sm90::GmmaLayout<DV>::kWidth;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const sK = reinterpret_cast<T*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
  T* const sV = sK + Traits::kKElems;
  T* const sQ0 = sV + Traits::kVElems;         // [2][BM][DK]
  T* const sdO0 = sQ0 + 2 * Traits::kQElems;   // [2][BM][DV]
  T* const sdS0 = sdO0 + 2 * Traits::kDoElems;  // [kBuffers][kBlockN keys][BM queries]
  float* const sLse0 = reinterpret_cast<float*>(sdS0 + Traits::kBuffers * Traits::kDsElems);
  float* const sDelta0 = sLse0 + 2 * BM;
  float* const sRowTerm0 = sDelta0 + 2 * BM;                   // non-normalised only
  float* const sStage = sLse0 + 2 * Traits::kRowVectors * BM;  // learnable score table only
  float* const sDq0 = sStage + Traits::kStageFloats;  // [kBuffers] dQ staging, see the traits
  auto sQ = [&](int buf) { return sQ0 + buf * Traits::kQElems; };
  auto sdO = [&](int buf) { return sdO0 + buf * Traits::kDoElems; };
  // With a producer: each stage's query head and first row, and the named barriers of the
  // consumers per step (1 + wg are warpgroup_any's) and of the two-stage load ring: stage b has
  // landed at kFullBarrier + b (the producer arrives, the consumers wait) and is free at
  // kEmptyBarrier + b (the other way round). Named barriers, not mbarriers, because the
  // consumers read the stages' row statistics with ordinary loads, whose ordering racecheck
  // checks through bar.sync.
  constexpr bool kProducer = Traits::kProducer;
  constexpr int kConsumerThreads = Traits::kConsumerThreads;
  __shared__ int2 stage_rows[2];
  constexpr int kDsBarrier = 3;
  constexpr int kFullBarrier = 4;
  constexpr int kEmptyBarrier = 6;
  // A barrier of the consumers alone (with a producer, which never waits on it) or of the CTA.
  auto consumer_sync = [] {
    if constexpr (kProducer) {
      sm90::named_sync(kDsBarrier, kConsumerThreads);
    } else {
      __syncthreads();
    }
  };

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int wg = warp / 4;
  const int g = lane >> 2;
  const int t = lane & 3;
  const WorkItem tile = tile_item<true, false>(p, blockIdx.x, kBlockN);
  if (!tile.valid) return;
  const int b = tile.b;
  const int h_kv = tile.h;
  const int n0 = tile.index * kBlockN;
  const int warp_row0 = warp * 16;  // this warp's first key row of the CTA's tile

  const SeqLens lens = seq_lens(p, b);
  const RowSpan rows = rows_meeting_keys(p, lens, n0, n0 + kBlockN);
  const T* kptr = k_rows<T>(p, lens, b, h_kv, n0);
  const T* vptr = v_rows<T>(p, lens, b, h_kv, n0);
  // Padding (rows past lens.q / lens.k) is loaded as zeros, so whatever it holds reaches no
  // gradient through the masked entries' zero P; outputs are written up to rows_k.
  const int valid_k = lens.rows_k - n0;

  float dk[1][DKT][4];
  float dv[1][DVT][4];
  zero(dk);
  zero(dv);

  // The loaders: every thread, or the producer warpgroup.
  constexpr int kLoaders = kProducer ? 128 : kThreads;
  // Starts the loads of the step at (h, m0) into buffer buf (ltid: the loader's index).
  auto issue_step = [&](int buf, int h, int m0, int ltid) {
    const T* q = q_rows<T>(p, lens, b, h, m0);
    const T* d = dout_rows<T>(p, lens, b, h, m0);
    sm90::load_tile_gmma<BM, DK, kLoaders>(sQ(buf), q, p.q_row_stride, lens.q - m0, ltid,
                                           p.head_dim);
    sm90::load_tile_gmma<BM, DV, kLoaders>(sdO(buf), d, p.do_row_stride, lens.q - m0, ltid,
                                           p.head_dim_v);
    // Raw lse and delta of the step's rows, with the tiles (rows past the sequence or its
    // padding: 0; they and rows with lse = -inf see no key, so the mask zeroes their P
    // whatever lse is).
    if (ltid < BM) {
      const int64_t off = row_stat_offset(p, lens, b, h) + m0 + ltid;
      const bool valid = m0 + ltid < lens.q;
      cp_async4(sLse0 + buf * BM + ltid, p.lse + (valid ? off : 0), valid);
      cp_async4(sDelta0 + buf * BM + ltid, p.delta + (valid ? off : 0), valid);
      if (kLsePass) {
        sRowTerm0[buf * BM + ltid] =
            valid ? Transform::template row_term<float>(p, h, query_position(lens, m0 + ltid))
                  : 0.f;
      }
    }
  };
  auto load_keys = [&](int ltid) {
    sm90::load_tile_gmma<kBlockN, DK, kLoaders>(sK, kptr, p.k_row_stride, lens.k - n0, ltid,
                                                p.head_dim);
    sm90::load_tile_gmma<kBlockN, DV, kLoaders>(sV, vptr, p.v_row_stride, lens.k - n0, ltid,
                                                p.head_dim_v);
  };
  // Block lists: normalised transforms only (fwd_sm80.h).
  auto with_steps = [&](auto&& body) {
    if constexpr (Traits::kBlockLists) {
      if (kLsePass || p.block_kv_num == nullptr) {
        body(dense_query_steps<BM>(p, h_kv, rows));
      } else {
        body(query_steps<BM>(p, b, h_kv, n0, rows));
      }
    } else {
      body(dense_query_steps<BM>(p, h_kv, rows));
    }
  };

  if (kProducer && warp >= kConsumerThreads / 32) {
    // The producer: load group j (K and V with the first) goes to stage j % 2 once both
    // consumers are done with group j - 2.
    sm90::regs_dealloc<Traits::kProducerRegs>();
    const int ptid = tid - kConsumerThreads;
    with_steps([&](const auto& query) {
      if (query.count > 0) load_keys(ptid);
      for (int j = 0; j < query.count; ++j) {
        if (j >= 2) sm90::named_sync(kEmptyBarrier + j % 2, kThreads);
        int h, m0;
        query.at(p, j, h, m0);
        issue_step(j % 2, h, m0, sm90::opaque(ptid));
        if (ptid == 0) stage_rows[j % 2] = make_int2(h, m0);
        cp_async_commit();
        cp_async_wait<0>();
        sm90::fence_proxy_async();  // before the consumers' wgmma reads
        sm90::named_arrive(kFullBarrier + j % 2, kThreads);
      }
    });
    return;
  }
  if constexpr (kProducer) sm90::regs_alloc<Traits::kConsumerRegs>();

  auto mainloop = [&](const auto& query) {
    const int steps = query.count;
    if (steps == 0) return;
    int h = 0, m0 = 0;  // this step's query head and first row (a producer's: its stage's)
    if constexpr (!kProducer) query.at(p, 0, h, m0);
    // The next step's head and row are looked up a step ahead: a block-sparse lookup reads the
    // mask from global memory, and its latency then passes during a whole step.
    int prev_h = h, prev_m0 = m0;  // the step whose dQ is staged
    int next_h = h, next_m0 = m0;
    if constexpr (!kProducer) {
      load_keys(tid);
      // Per-chunk addresses from an opaque tid are recomputed each step, not kept live.
      issue_step(0, h, m0, sm90::opaque(tid));
      cp_async_commit();
      if (steps > 1) query.at(p, 1, next_h, next_m0);
    }
    // dQ of a step is staged at its end and added after the next barrier, by thread 0 (split
    // columns: the whole tile) or the first thread of each warpgroup (its own tile).
    constexpr bool kDqSplit = Traits::kDqSplitCols;
    const bool dq_issuer = kDqSplit ? tid == 0 : tid % 128 == 0;
    auto add_staged_dq = [&](int dq_h, int dq_m0, int dq_buf) {
      if (!kDq || !dq_issuer) return;
      constexpr int kTileFloats = BM * DK;
      sm90::bulk_reduce_add(p.dq_accum + (row_stat_offset(p, lens, b, dq_h) + dq_m0) * DK,
                            sDq0 + dq_buf * Traits::kDqTileFloats +
                                (kDqSplit ? 0 : wg * kTileFloats),
                            kTileFloats * sizeof(float));
      sm90::bulk_commit();
    };

    for (int s = 0; s < steps; ++s) {
      const int buf = s & 1;
      // This step's dS^T and dQ staging tiles (with a producer, the consumers' barrier per step
      // is one step's: buffer buf was last read two steps ago).
      [[maybe_unused]] T* const sdS = sdS0 + (kProducer ? buf * Traits::kDsElems : 0);
      [[maybe_unused]] float* const sDq = sDq0 + (kProducer ? buf * Traits::kDqTileFloats : 0);
      if constexpr (kProducer) {
        sm90::named_sync(kFullBarrier + buf, kThreads);
        const int2 rows_at = stage_rows[buf];
        h = rows_at.x;
        m0 = rows_at.y;
      } else {
        cp_async_wait_all();
        sm90::fence_proxy_async();
        // Step s's tiles are visible; every warpgroup is done with buffer buf ^ 1 and with
        // sdS, and has staged step s - 1's dQ.
        __syncthreads();
        if (s > 0) add_staged_dq(prev_h, prev_m0, 0);
      }
      const float* lse = sLse0 + buf * BM;
      const float* delta = sDelta0 + buf * BM;
      [[maybe_unused]] const float* row_term = sRowTerm0 + buf * BM;  // non-normalised only
      // Base descriptors of this step's K-major operands (this warpgroup's 64 key rows).
      const uint64_t k_desc = sm90::opaque(sm90::gmma_desc_k<DK>(sK + wg * 64 * kKWidth));
      const uint64_t v_desc = sm90::opaque(sm90::gmma_desc_k<DV>(sV + wg * 64 * kVWidth));
      const uint64_t q_desc = sm90::opaque(sm90::gmma_desc_k<DK>(sQ(buf)));
      const uint64_t do_desc = sm90::opaque(sm90::gmma_desc_k<DV>(sdO(buf)));

      // S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys.
      float st[1][NT][4];
      float dpt[1][NT][4];
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DK / 16; ++kk) {
        const int key_col = sm90::gmma_kcol<kBlockN, DK>(kk * 16);
        const int query_col = sm90::gmma_kcol<BM, DK>(kk * 16);
        sm90::wgmma_ss<T, NT>(st[0], sm90::desc_at<T>(k_desc, key_col),
                              sm90::desc_at<T>(q_desc, query_col), kk > 0);
      }
      sm90::wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < DV / 16; ++kk) {
        const int key_col = sm90::gmma_kcol<kBlockN, DV>(kk * 16);
        const int query_col = sm90::gmma_kcol<BM, DV>(kk * 16);
        sm90::wgmma_ss<T, NT>(dpt[0], sm90::desc_at<T>(v_desc, key_col),
                              sm90::desc_at<T>(do_desc, query_col), kk > 0);
      }
      sm90::wgmma_commit();
      // The next step's loads go out while the tensor cores work.
      int after_h = next_h, after_m0 = next_m0;
      if constexpr (!kProducer) {
        if (s + 1 < steps) {
          issue_step(buf ^ 1, next_h, next_m0, sm90::opaque(tid));
          cp_async_commit();
        }
        if (s + 2 < steps) query.at(p, s + 2, after_h, after_m0);
      }
      sm90::wgmma_wait<1>(st[0]);

      // P^T[key, query] = exp2(s * scale_log2 - lse[query] * log2 e), 0 outside the mask; a
      // modifier applies to the scaled scores first. A non-normalised transform's weights A^T
      // go straight into dV's A operand, with their live mask M as bits.
      const bool full =
          tile_is_full(p, lens, m0, m0 + BM, n0 + warp_row0, n0 + warp_row0 + 16);
      RowSpan seen[2];  // query rows (relative to m0) that see this thread's two keys
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        seen[hh] = rows_seeing_key(p, lens, n0 + warp_row0 + g + 8 * hh);
        seen[hh].first -= m0;
        seen[hh].last -= m0;
      }
      uint32_t pa[1][NT / 2][4];
      uint32_t live = 0;  // non-normalised: bit 4 ni + e is M of st[0][ni][e]
      bool any_weight = false;  // non-normalised: a weight != 0 (a NaN one included)
      const bool modified =
          !Mod::kIdentity &&
          Mod::tile_active(p, lens, m0, m0 + BM - 1, n0 + warp_row0, n0 + warp_row0 + 15);
      const float scale =
          backward_scores<Mod, true>(st, p, lens, b, h, n0 + warp_row0, m0, lane, modified);
      if constexpr (kLsePass) {
        auto weights = [&](auto masked) {
#pragma unroll
          for (int ni = 0; ni < NT; ++ni) {
            const float2 l = *reinterpret_cast<const float2*>(lse + ni * 8 + 2 * t);
            const float2 c = *reinterpret_cast<const float2*>(row_term + ni * 8 + 2 * t);
            float a[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float lse2 = ((e & 1) ? l.y : l.x) * float(M_LOG2E);
              const float ce = (e & 1) ? c.y : c.x;
              const float pe = exp2f(fmaf(st[0][ni][e], scale, -lse2));
              bool in = true;  // selects, not branches, for masked entries
              if constexpr (decltype(masked)::value) {
                const int qcol = ni * 8 + 2 * t + (e & 1);
                const RowSpan& r = seen[e >> 1];
                in = qcol >= r.first && qcol < r.last;
              }
              a[e] = in ? Transform::weight(pe, ce) : 0.f;
              any_weight |= a[e] != 0.f;
              // Masked after the product: a masked score's derivative may be NaN (0 * inf
              // from a zero padding row against an infinite key).
              float pg = pe;
              if constexpr (kGradInP<Mod>) pg *= Mod::grad_raw_frag(st[0][ni][e], p);
              st[0][ni][e] = in ? pg : 0.f;
              live |= static_cast<uint32_t>(in && Transform::live(pe, ce)) << (4 * ni + e);
            }
            pa[0][ni / 2][2 * (ni & 1)] = MmaOp<T>::pack(a[0], a[1]);
            pa[0][ni / 2][2 * (ni & 1) + 1] = MmaOp<T>::pack(a[2], a[3]);
          }
        };
        if (full) {
          weights(std::false_type{});
        } else {
          weights(std::true_type{});
        }
      } else {
        backward_probs<Mod, T>(st, pa, lse, scale, seen, full, p, lane);
      }
      // dV += P^T dO (non-normalised: A^T dO, skipped when the warpgroup's weights are all
      // zero; a NaN weight is not M = 1 but must still reach dV): dO [BM][DV] is read
      // transposed.
      if (!kLsePass || sm90::warpgroup_any(any_weight, wg)) {
        sm90::fence_operand(dv[0]);
        sm90::wgmma_fence();
        const uint64_t do_t_desc = sm90::opaque(sm90::gmma_desc_mn<BM, DV>(sdO(buf)));
#pragma unroll
        for (int kt = 0; kt < BM / 16; ++kt) {
          sm90::wgmma_rs<T, DVT>(dv[0], pa[0][kt],
                                 sm90::desc_at<T>(do_t_desc, kt * 16 * kVWidth));
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<1>(dpt[0]);  // dP^T is ready (dV may still run)
      } else {
        sm90::wgmma_wait<0>(dpt[0]);
      }

      // dS^T = P^T (M dP^T - Delta) (normalised: M = 1); staged [key][query] for the dQ
      // product.
#pragma unroll
      for (int ni = 0; ni < NT; ++ni) {
        const float2 dl = *reinterpret_cast<const float2*>(delta + ni * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float da = !kLsePass || ((live >> (4 * ni + e)) & 1u) ? dpt[0][ni][e] : 0.f;
          dpt[0][ni][e] = st[0][ni][e] * (da - ((e & 1) ? dl.y : dl.x));
        }
      }
      // The table's gradient takes dS of the modified scores; dK and dQ that of the raw ones.
      if constexpr (Traits::kParamGrad) {
        if (Mod::wants_param_grad(p) &&
            Mod::tile_active(p, lens, m0, m0 + BM - 1, n0, n0 + kBlockN - 1)) {
          if constexpr (Traits::kStageInDq) {
            // The reduction issued last step read this step's dQ staging tile.
            if (dq_issuer) sm90::bulk_wait_read();
            consumer_sync();
          }
          Mod::template accumulate_param_grad<kBlockN, BM, Traits::kStageKeys,
                                              Traits::kStageStride, kConsumerThreads>(
              p, lens, Traits::kStageInDq ? sDq : sStage, dpt, h, m0, n0, tile.slot, warp_row0,
              lane, tid, consumer_sync);
        }
      }
      if constexpr (Mod::kAddsTerms) {
        if constexpr (Traits::kDerivative) {
          raw_score_grads<Mod, true>(
              dpt, st,
              [&](int, int ni, int e) { return lse[ni * 8 + 2 * t + (e & 1)] * float(M_LOG2E); },
              p, lens, b, h, n0 + warp_row0, m0, lane);
        }
      } else if constexpr (!Mod::kUnitGrad && !kGradInP<Mod>) {
#pragma unroll
        for (int ni = 0; ni < NT; ++ni) {
          const float2 l = *reinterpret_cast<const float2*>(lse + ni * 8 + 2 * t);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float lse2 = ((e & 1) ? l.y : l.x) * float(M_LOG2E);
            dpt[0][ni][e] = raw_score_grad<Mod>(dpt[0][ni][e], st[0][ni][e], lse2, p);
          }
        }
      }
      uint32_t dsa[1][NT / 2][4];
      to_a_frags<1, NT, T>(dpt, dsa);
      if constexpr (kDq) {
        // dS^T staged for the dQ product. gmma_off of (key, query), key = warp_row0 + g + 8 (r
        // & 1), query = 16 kt + 8 (r >> 1) + 2t: key % 8 = g, so the swizzled chunk is (2 kt +
        // (r >> 1)) ^ g. From opaque values, so that the 16 addresses are not kept live across
        // steps.
        const int gx = sm90::opaque(g);
        T* const row = sdS + sm90::opaque((warp_row0 + g) * 64 + 2 * t);
#pragma unroll
        for (int kt = 0; kt < NT / 2; ++kt)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int chunk = (2 * kt + (r >> 1)) ^ gx;
            *reinterpret_cast<uint32_t*>(row + (r & 1) * 8 * 64 + chunk * 8) = dsa[0][kt][r];
          }
      }

      // dK += dS^T Q: Q [BM][DK] read transposed.
      sm90::fence_operand(dk[0]);
      sm90::wgmma_fence();
      const uint64_t q_t_desc = sm90::opaque(sm90::gmma_desc_mn<BM, DK>(sQ(buf)));
#pragma unroll
      for (int kt = 0; kt < BM / 16; ++kt) {
        sm90::wgmma_rs<T, DKT>(dk[0], dsa[0][kt], sm90::desc_at<T>(q_t_desc, kt * 16 * kKWidth));
      }
      sm90::wgmma_commit();

      if constexpr (!kDq) {
        sm90::wgmma_wait<0>(dk[0]);
        sm90::fence_operand(dv[0]);
        sm90::fence_operand(dsa[0]);
      } else {
        // Once the last reduction has read its staging tile (with a producer: two steps ago),
        // the barrier below frees it for this step.
        if (dq_issuer) sm90::bulk_wait_read();
        sm90::fence_proxy_async();
        if constexpr (kProducer) {
          // Both warpgroups' dS^T rows and step s - 1's dQ are staged.
          sm90::named_sync(kDsBarrier, kConsumerThreads);
          if (s > 0) add_staged_dq(prev_h, prev_m0, buf ^ 1);
        } else {
          __syncthreads();  // both warpgroups' dS^T rows are staged
        }
        // dQ += dS K (Traits::kDqSplitCols): A = dS^T staged [key][query] (MN-major), B = K
        // [key][DK] (MN-major): split, all keys and column half wg (at DK = 64 the half starts
        // inside a 128-byte swizzle row: the swizzle is a function of the absolute address, so
        // the descriptor may start there), else the warpgroup's own 64 keys.
        constexpr int kDqCols = Traits::kDqCols;
        float dq[kDqCols / 8][4];
        sm90::wgmma_fence();
        constexpr int kDqKeys = Traits::kDqKeys;
        const int dq_key0 = Traits::kDqSplitCols ? 0 : wg * 64;
        const int dq_col0 = Traits::kDqSplitCols ? wg * kDqCols : 0;
        const uint64_t ds_desc =
            sm90::opaque(sm90::gmma_desc_mn<kBlockN, BM>(sdS + dq_key0 * 64));
        const uint64_t k_t_desc = sm90::opaque(sm90::gmma_desc_mn<kBlockN, DK>(
            sK + (dq_col0 / kKWidth) * (kBlockN * kKWidth) + dq_col0 % kKWidth +
            dq_key0 * kKWidth));
#pragma unroll
        for (int kt = 0; kt < kDqKeys / 16; ++kt) {
          sm90::wgmma_ss<T, kDqCols / 8, 1, 1>(dq, sm90::desc_at<T>(ds_desc, kt * 16 * 64),
                                               sm90::desc_at<T>(k_t_desc, kt * 16 * kKWidth),
                                               kt > 0);
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>(dq);
        sm90::fence_operand(dk[0]);
        sm90::fence_operand(dv[0]);
        // Stage buf is read; the producer waits for it only to load step s + 2 (every arrival
        // is consumed).
        if (kProducer && s + 2 < steps) sm90::named_arrive(kEmptyBarrier + buf, kThreads);

        // dQ is staged for the bulk reduction after the next barrier (no per-thread atomics to
        // hold up the next step); rows past the sequence (padding included: their dQ is 0)
        // add zeros to the rows after them. The loop bounds rows by lens.q only, so that it
        // keeps one row bound live, not two.
        {
          const int valid_q = lens.q - m0;
          const int64_t row0 = row_stat_offset(p, lens, b, h) + m0;
          float* const stage = sDq + (kDqSplit ? 0 : wg * BM * DK);
          const int q0 = (warp % 4) * 16;
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int row = q0 + g + 8 * hh;
            const bool valid = row < valid_q;
#pragma unroll
            for (int ni = 0; ni < kDqCols / 8; ++ni) {
              const int col = dq_swizzle(row0 + row, dq_col0 + ni * 8 + 2 * t);
              *reinterpret_cast<float2*>(stage + row * DK + col) =
                  valid ? make_float2(dq[ni][2 * hh], dq[ni][2 * hh + 1])
                        : make_float2(0.f, 0.f);
            }
          }
        }
      }
      prev_h = h;
      prev_m0 = m0;
      h = next_h;
      m0 = next_m0;
      next_h = after_h;
      next_m0 = after_m0;
    }
    // The last step's dQ; the staging tiles and the accumulator must outlive the reductions.
    if constexpr (kDq) {
      sm90::fence_proxy_async();
      consumer_sync();
      add_staged_dq(prev_h, prev_m0, kProducer ? (steps - 1) & 1 : 0);
      if (dq_issuer) sm90::bulk_wait();
    }
  };
  with_steps(mainloop);

  // dK and dV rows are staged over sK and sV, which no consumer reads after this barrier.
  consumer_sync();
  const float kscale[1][2] = {{static_cast<float>(p.scale), static_cast<float>(p.scale)}};
  const float one[1][2] = {{1.f, 1.f}};
  T* dkptr = dk_rows<T>(p, lens, b, h_kv, n0);
  T* dvptr = dv_rows<T>(p, lens, b, h_kv, n0);
  store_rows<1, DKT, DK>(dk, kscale, sK, warp_row0, dkptr, p.dk_row_stride, valid_k, lane, 0,
                         p.head_dim);
  store_rows<1, DVT, DV>(dv, one, sV, warp_row0, dvptr, p.dv_row_stride, valid_k, lane, 0,
                         p.head_dim_v);
#endif
}

}  // namespace tc
}  // namespace adaattn
