// SM80 tensor-core backward:
//   1. row term:      Delta_i = dO_i . O_i (bwd_common.h's delta kernel)
//   2. dK/dV kernel:  one CTA per (key tile, batch, kv head); warps own key rows and compute the
//      transposed scores S^T = K Q^T directly, so P^T and dS^T are already A-fragments for
//      dV += P^T dO and dK += dS^T Q. It loops over the query heads of its GQA group, so K/V are
//      never expanded to Hq heads and dK/dV are reduced in registers.
//   3. dQ, in one of two ways:
//      - atomic (p.dq_accum set; by default where launch.h's FlashConfig measured it faster):
//        each dK/dV step also stages dS^T in shared memory and adds dS K for its query tile
//        into a float32 accumulator with atomics; a last kernel scales and converts it. Five
//        products per (query, key) tile pair in all.
//      - deterministic (BwdMode::kTwoPass): a dQ CTA per (query tile, batch, head), like the
//        forward, recomputes S and dP (seven products in all) so that no sum depends on the
//        order in which CTAs finish: results are bit-reproducible.
//
// A non-normalised transform (variants/variant.h) replaces step 1 by a row pass over the keys
// (the dQ kernel's loop without its last product) that accumulates G_i = sum_j M_ij dA_ij and
// Delta_i = sum_j M_ij p_ij dA_ij; steps 2 and 3 then use dS = P (M dA - Delta) and weights A
// instead of P for dV, and skip dA and A^T dO wherever a warp tile's weights are all zero. A
// score modifier with a learnable table has the dK/dV CTAs add their dS into per-CTA partials
// (reduced in a fixed order later); one whose derivative is not 1 multiplies it into dS.
// On Hopper, bwd_rows_sm90.h and bwd_sm90.h run the same steps on warpgroup MMAs.
//
// Q, K, dQ and dK have head dim DK; V, O, dO and dV have DV (see fwd_sm80.h).
#pragma once

#include <cmath>

#include "../../core/mask.h"
#include "../../core/params.h"
#include "bwd_common.h"
#include "mma.h"
#include "softmax_frag.h"
#include "tiles.h"

namespace adaattn {
namespace tc {

// kSliceCount: column slices of dK and dV, one CTA each per key tile (launch.h's FlashConfig).
template <typename T, int DK, int DV, int NWARPS, int MI_K, int BM, typename Variant,
          bool kAtomicDQ, int kSliceCount = 1>
struct BwdKVTraits {
  static constexpr int kThreads = NWARPS * 32;
  static constexpr int kBlockN = NWARPS * 16 * MI_K;  // keys per CTA
  static constexpr int kBlockM = BM;                  // queries per step
  static constexpr int kMI = MI_K;
  static constexpr int kSlices = kSliceCount;
  static_assert(DK % (16 * kSlices) == 0 && DV % (16 * kSlices) == 0,
                "slices of whole 16-column groups");
  // What every slice would add again: the dQ product (so slices take the two-pass dQ); the
  // table's gradient is slice 0's alone.
  static_assert(kSlices == 1 || !kAtomicDQ, "column slices take the two-pass dQ");
  // K, V, and double-buffered Q, dO tiles, then lse2/delta (non-normalised: and the row term)
  // of both buffers; with a learnable score table: an fp32 [kStageKeys][BM] dS^T staging tile
  // for its partial sums, filled in rounds of kStageKeys keys. Rounds of at most 2048 floats
  // keep the D=128 kernel at two CTAs per SM.
  static constexpr int kRowVectors = Variant::kNormalized ? 2 : 3;
  static constexpr int kStageKeys = kBlockN * kBlockM > 2048 ? 2048 / kBlockM : kBlockN;
  static_assert(kStageKeys % (16 * MI_K) == 0, "a staging round holds whole warps' key rows");
  static constexpr int kStageFloats = Variant::Mod::kParamGrad ? kStageKeys * kBlockM : 0;
  // Atomic dQ: the step's dS^T, [kBlockN][BM] in T, after the float vectors.
  static constexpr int kDsElems = kAtomicDQ ? kBlockN * kBlockM : 0;
  static constexpr int kSmemBytes = (kBlockN + 2 * kBlockM) * (DK + DV) * sizeof(T) +
                                    (2 * kRowVectors * kBlockM + kStageFloats) * sizeof(float) +
                                    kDsElems * sizeof(T);
  // Atomic dQ: warps split the [BM][DK] dQ tile into 16-row groups x column ranges, done in
  // chunks of at most 64 columns (32 accumulator registers) next to the dK/dV accumulators.
  static constexpr int kDqWarpsM = kBlockM / 16;
  static constexpr int kDqWarpsN = NWARPS / kDqWarpsM;
  static constexpr int kDqCols = DK / kDqWarpsN;
  static constexpr int kDqChunk = kDqCols < 64 ? kDqCols : 64;
  static_assert(!kAtomicDQ || (NWARPS % kDqWarpsM == 0 && DK % kDqWarpsN == 0 &&
                               kDqCols % kDqChunk == 0 && kDqChunk % 16 == 0),
                "the dQ tile must split evenly among the warps");
};

// Atomic dQ of one dK/dV step: dq_accum[row0 + i] += dS[i] K over the CTA's kBlockN keys for
// the step's BM queries (rows >= valid_rows are outside the sequence and skipped), from the
// staged dS^T [kBlockN][BM] and the key tile [kBlockN][DK].
template <typename Traits, typename T, int DK, int BM>
__device__ __forceinline__ void bwd_atomic_dq(const AttnParams& p, const T* sdS, const T* sK,
                                              int64_t row0, int valid_rows, int warp, int lane) {
  constexpr int kChunk = Traits::kDqChunk;
  const int q0 = (warp % Traits::kDqWarpsM) * 16;
  const int c0 = (warp / Traits::kDqWarpsM) * Traits::kDqCols;
  const int g = lane >> 2;
  const int t = lane & 3;
#pragma unroll 1
  for (int c = c0; c < c0 + Traits::kDqCols; c += kChunk) {
    float acc[kChunk / 8][4];
#pragma unroll
    for (int ni = 0; ni < kChunk / 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[ni][e] = 0.f;
    warp_gemm_tn<kChunk / 8, Traits::kBlockN / 16, BM, DK>(acc, sdS, q0, sK, c, lane);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = q0 + g + 8 * hh;
      if (i >= valid_rows) continue;
      float* dst = p.dq_accum + (row0 + i) * DK + c + 2 * t;
#pragma unroll
      for (int ni = 0; ni < kChunk / 8; ++ni) {
        atomic_add2(dst + ni * 8, acc[ni][2 * hh], acc[ni][2 * hh + 1]);
      }
    }
  }
}

// dK/dV for key tile `block / kSlices` (key tile index is the slowest-varying part), columns
// of slice `block % kSlices`.
template <typename Traits, typename T, int DK, int DV, int MI, int BM, typename Variant,
          bool kAtomicDQ>
__device__ __forceinline__ void bwd_dkdv_block(const AttnParams& p, int block) {
  using Mod = typename Variant::Mod;
  using Transform = typename Variant::Transform;
  constexpr bool kLsePass = !Variant::kNormalized;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kThreads = Traits::kThreads;
  constexpr int NT = BM / 8;  // query n-tiles of S^T per warp
  constexpr int kSlices = Traits::kSlices;
  constexpr int DTK = DK / 8 / kSlices;  // this CTA's n-tiles of dK and dV
  constexpr int DTV = DV / 8 / kSlices;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kBlockN * DK;
  // Buffer `buf` of the double-buffered Q/dO tiles and their row vectors.
  T* const sQ0 = sV + kBlockN * DV;
  T* const sdO0 = sQ0 + 2 * BM * DK;
  float* const sLse0 = reinterpret_cast<float*>(sdO0 + 2 * BM * DV);
  float* const sDelta0 = sLse0 + 2 * BM;
  float* const sRowTerm0 = sDelta0 + 2 * BM;                   // non-normalised only
  float* const sStage = sLse0 + 2 * Traits::kRowVectors * BM;  // learnable score table only
  T* const sdS = reinterpret_cast<T*>(sStage + Traits::kStageFloats);  // atomic dQ only
  auto sQ = [&](int buf) { return sQ0 + buf * BM * DK; };
  auto sdO = [&](int buf) { return sdO0 + buf * BM * DV; };
  auto sLse = [&](int buf) { return sLse0 + buf * BM; };
  auto sDelta = [&](int buf) { return sDelta0 + buf * BM; };
  auto sRowTerm = [&](int buf) { return sRowTerm0 + buf * BM; };

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane >> 2;
  const int t = lane & 3;
  const WorkItem tile = tile_item<true, false>(p, block / kSlices, kBlockN);
  if (!tile.valid) return;
  const int b = tile.b;
  const int h_kv = tile.h;
  const int n0 = tile.index * kBlockN;
  const int warp_row0 = warp * 16 * MI;
  const int k_col0 = block % kSlices * (DK / kSlices);  // this CTA's columns of dK, dV
  const int v_col0 = block % kSlices * (DV / kSlices);

  const SeqLens lens = seq_lens(p, b);
  const RowSpan rows = rows_meeting_keys(p, lens, n0, n0 + kBlockN);

  const T* kptr = k_rows<T>(p, lens, b, h_kv, n0);
  const T* vptr = v_rows<T>(p, lens, b, h_kv, n0);
  const int valid_k = lens.rows_k - n0;

  float dk[MI][DTK][4];
  float dv[MI][DTV][4];
  zero(dk);
  zero(dv);

  // The mainloop over the key tile's query steps (tiles.h). Dense masks get their own copy
  // with a plain range, so the block-list lookup costs them nothing.
  auto mainloop = [&](const auto& query) {
    const int steps = query.count;
    [[maybe_unused]] const bool param_grads = Mod::kParamGrad && Mod::wants_param_grad(p);

    auto issue_step = [&](int s, int buf) {
      int h, m0;
      query.at(p, s, h, m0);
      const T* q = q_rows<T>(p, lens, b, h, m0);
      const T* d = dout_rows<T>(p, lens, b, h, m0);
      load_tile_async<BM, DK, kThreads>(sQ(buf), q, p.q_row_stride, lens.q - m0, tid, p.head_dim);
      load_tile_async<BM, DV, kThreads>(sdO(buf), d, p.do_row_stride, lens.q - m0, tid,
                                        p.head_dim_v);
      const int64_t lse_off = row_stat_offset(p, lens, b, h);
      for (int i = tid; i < BM; i += kThreads) {
        const bool valid = m0 + i < lens.rows_q;
        sLse(buf)[i] = lse_log2(p.lse + lse_off, m0 + i, lens.rows_q);
        sDelta(buf)[i] = valid ? p.delta[lse_off + m0 + i] : 0.f;
        if (kLsePass) {
          sRowTerm(buf)[i] =
              valid ? Transform::template row_term<float>(p, h, query_position(lens, m0 + i)) : 0.f;
        }
      }
    };

    if (steps > 0) {
      load_tile_async<kBlockN, DK, kThreads>(sK, kptr, p.k_row_stride, lens.k - n0, tid,
                                             p.head_dim);
      load_tile_async<kBlockN, DV, kThreads>(sV, vptr, p.v_row_stride, lens.k - n0, tid,
                                             p.head_dim_v);
      issue_step(0, 0);
      cp_async_commit();
    }

    for (int s = 0; s < steps; ++s) {
      const int buf = s & 1;
      int h, m0;
      query.at(p, s, h, m0);
      cp_async_wait_all();
      __syncthreads();
      if (s + 1 < steps) {
        issue_step(s + 1, buf ^ 1);
        cp_async_commit();
      }

      // S^T[key, query] in log2 units, then P^T (and the weights A^T of a non-normalised
      // transform, with their live mask M as bits 4 ni + e of live[mi]).
      float st[MI][NT][4];
      zero(st);
      warp_gemm_nt<MI, NT, DK>(st, sK, warp_row0, sQ(buf), 0, lane);
      scale_frag(st, p.scale_log2);
      if (!Mod::kIdentity && Mod::tile_active(p, lens, m0, m0 + BM - 1, n0 + warp_row0,
                                                 n0 + warp_row0 + 16 * MI - 1)) {
        modify_scores<Mod, true>(st, p, lens, b, h, n0 + warp_row0, m0, lane);
      }
      const bool full =
          tile_is_full(p, lens, m0, m0 + BM, n0 + warp_row0, n0 + warp_row0 + 16 * MI);
      float at[MI][NT][4];  // weights A^T (non-normalised)
      uint32_t live[MI] = {};
      bool any_weight = true;
  #pragma unroll
      for (int mi = 0; mi < MI; ++mi)
  #pragma unroll
        for (int ni = 0; ni < NT; ++ni)
  #pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int qcol = ni * 8 + 2 * t + (e & 1);
            float pe = exp2f(st[mi][ni][e] - sLse(buf)[qcol]);
            bool attended = true;
            if (!full) {
              const int key = n0 + warp_row0 + mi * 16 + g + 8 * (e >> 1);
              const KeyRange r = key_range(p, lens, m0 + qcol);
              attended = key >= r.lo && key < r.hi;
              if (!attended) pe = 0.f;
            }
            st[mi][ni][e] = pe;
            if (kLsePass) {
              const float c = sRowTerm(buf)[qcol];
              at[mi][ni][e] = attended ? Transform::weight(pe, c) : 0.f;
              if (attended && Transform::live(pe, c)) live[mi] |= 1u << (ni * 4 + e);
            }
          }
      if (kLsePass) {
        bool any = false;
  #pragma unroll
        for (int mi = 0; mi < MI; ++mi)
  #pragma unroll
          for (int ni = 0; ni < NT; ++ni)
  #pragma unroll
            for (int e = 0; e < 4; ++e) any |= at[mi][ni][e] != 0.f;
        any_weight = __any_sync(0xffffffff, any);
      }

      // dA^T = dP^T = V dO^T (non-normalised: only where some weight is non-zero).
      float dpt[MI][NT][4];
      zero(dpt);
      if (any_weight) warp_gemm_nt<MI, NT, DV>(dpt, sV, warp_row0, sdO(buf), 0, lane);

      if (any_weight) {
        uint32_t pa[MI][NT / 2][4];
        to_a_frags<MI, NT, T>(kLsePass ? at : st, pa);
        warp_gemm_rs<MI, DTV, NT / 2, DV>(dv, pa, sdO(buf), 0, lane, v_col0);
      }

      // dS^T = P^T * (M dA^T - Delta)   (normalised: M = 1).
  #pragma unroll
      for (int mi = 0; mi < MI; ++mi)
  #pragma unroll
        for (int ni = 0; ni < NT; ++ni)
  #pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int qcol = ni * 8 + 2 * t + (e & 1);
            const bool m = !kLsePass || (live[mi] >> (ni * 4 + e)) & 1u;
            const float da = m ? dpt[mi][ni][e] : 0.f;
            dpt[mi][ni][e] = st[mi][ni][e] * (da - sDelta(buf)[qcol]);
          }

      // The table's gradient takes dS of the modified scores; dK and dQ that of the raw ones.
      if constexpr (Mod::kParamGrad) {
        if (param_grads && block % kSlices == 0 &&
            Mod::tile_active(p, lens, m0, m0 + BM - 1, n0, n0 + kBlockN - 1)) {
          Mod::template accumulate_param_grad<kBlockN, BM, Traits::kStageKeys, BM, kThreads>(
              p, lens, sStage, dpt, h, m0, n0, tile.slot, warp_row0, lane, tid,
              [] { __syncthreads(); });
        }
      }
      if constexpr (Mod::kAddsTerms) {
        const float* lse2 = sLse(buf);
        raw_score_grads<Mod, true>(
            dpt, st, [&](int, int ni, int e) { return lse2[ni * 8 + 2 * t + (e & 1)]; }, p,
            lens, b, h, n0 + warp_row0, m0, lane);
      } else if constexpr (!Mod::kUnitGrad) {
  #pragma unroll
        for (int mi = 0; mi < MI; ++mi)
  #pragma unroll
          for (int ni = 0; ni < NT; ++ni)
  #pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int qcol = ni * 8 + 2 * t + (e & 1);
              dpt[mi][ni][e] =
                  raw_score_grad<Mod>(dpt[mi][ni][e], st[mi][ni][e], sLse(buf)[qcol], p);
            }
      }

      uint32_t dsa[MI][NT / 2][4];
      to_a_frags<MI, NT, T>(dpt, dsa);
      if constexpr (kAtomicDQ) {
        // dS^T [key][query] for the dQ product (the A-fragment words are pairs of neighbouring
        // queries of one key row).
  #pragma unroll
        for (int mi = 0; mi < MI; ++mi)
  #pragma unroll
          for (int kt = 0; kt < NT / 2; ++kt)
  #pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int key = warp_row0 + mi * 16 + g + 8 * (r & 1);
              const int query = kt * 16 + 8 * (r >> 1) + 2 * t;
              *reinterpret_cast<uint32_t*>(sdS + swz<BM>(key, query)) = dsa[mi][kt][r];
            }
      }
      warp_gemm_rs<MI, DTK, NT / 2, DK>(dk, dsa, sQ(buf), 0, lane, k_col0);
      if constexpr (kAtomicDQ) {
        __syncthreads();  // every warp's dS^T rows are staged
        bwd_atomic_dq<Traits, T, DK, BM>(p, sdS, sK, row_stat_offset(p, lens, b, h) + m0,
                                         lens.rows_q - m0, warp, lane);
      }
    }

  };
  if (kLsePass || p.block_kv_num == nullptr) {  // block lists: normalised only (fwd_sm80.h)
    mainloop(dense_query_steps<BM>(p, h_kv, rows));
  } else {
    mainloop(query_steps<BM>(p, b, h_kv, n0, rows));
  }

  // Stage through the warp's own rows of sK (all reads of sK/sV are done after this barrier).
  __syncthreads();
  float kscale[MI][2];
  float one[MI][2];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      kscale[mi][hh] = static_cast<float>(p.scale);
      one[mi][hh] = 1.f;
    }
  T* dkptr = dk_rows<T>(p, lens, b, h_kv, n0);
  T* dvptr = dv_rows<T>(p, lens, b, h_kv, n0);
  store_rows<MI, DTK, DK>(dk, kscale, sK, warp_row0, dkptr, p.dk_row_stride, valid_k, lane,
                         k_col0, p.head_dim);
  store_rows<MI, DTV, DV>(dv, one, sV, warp_row0, dvptr, p.dv_row_stride, valid_k, lane, v_col0,
                          p.head_dim_v);
}

template <typename T, int DK, int DV, int NWARPS, int MI, int BN>
struct BwdQTraits {
  static constexpr int kThreads = NWARPS * 32;
  static constexpr int kMI = MI;
  static constexpr int kBlockM = NWARPS * 16 * MI;
  static constexpr int kBlockN = BN;
  // Q, dO, and double-buffered K, V tiles.
  static constexpr int kSmemBytes = (kBlockM + 2 * kBlockN) * (DK + DV) * sizeof(T);
};

// dQ for query tile `block` (heavy, late query tiles first). kRowPass (non-normalised
// transforms): the same loop accumulates G and Delta per row (G's terms for the transform's
// parameter gradient, Delta into p.delta) instead of dQ.
template <typename Traits, typename T, int DK, int DV, int MI, int BN, typename Variant,
          bool kRowPass>
__device__ __forceinline__ void bwd_dq_block(const AttnParams& p, int block) {
  using Mod = typename Variant::Mod;
  using Transform = typename Variant::Transform;
  constexpr bool kLsePass = !Variant::kNormalized;
  static_assert(kLsePass || !kRowPass, "only a non-normalised transform needs a row pass");
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kThreads = Traits::kThreads;
  constexpr int NT = BN / 8;
  constexpr int DTK = DK / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + kBlockM * DK;
  T* const sK0 = sdO + kBlockM * DV;
  T* const sV0 = sK0 + 2 * BN * DK;
  auto sK = [&](int buf) { return sK0 + buf * BN * DK; };
  auto sV = [&](int buf) { return sV0 + buf * BN * DV; };

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane >> 2;
  const RowTile tile = row_tile<kBlockM>(p, block);
  if (!tile.valid) return;
  const int b = tile.b, h = tile.h, h_kv = tile.h_kv, m0 = tile.m0;
  const int warp_row0 = warp * 16 * MI;
  const SeqLens lens = tile.lens;
  const KeyRange tile_keys = tile.keys;
  const T* q = q_rows<T>(p, lens, b, h, m0);
  const T* dout = dout_rows<T>(p, lens, b, h, m0);
  const T* k = k_rows<T>(p, lens, b, h_kv, 0);
  const T* v = v_rows<T>(p, lens, b, h_kv, 0);
  const int64_t lse_off = row_stat_offset(p, lens, b, h);

  RowRanges<MI> rr;
  float lse2[MI][2];
  float delta[MI][2];
  float row_term[MI][2];  // non-normalised: the transform's c_i
  float row_g[MI][2];    // row pass: partial G of this thread's columns
  float row_dl[MI][2];   // row pass: partial Delta
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = m0 + warp_row0 + mi * 16 + g + 8 * hh;
      const KeyRange r = key_range(p, lens, row);
      rr.lo[mi][hh] = r.lo;
      rr.hi[mi][hh] = r.hi;
      lse2[mi][hh] = lse_log2(p.lse + lse_off, row, lens.rows_q);
      delta[mi][hh] = !kRowPass && row < lens.rows_q ? p.delta[lse_off + row] : 0.f;
      if (kLsePass) {
        row_term[mi][hh] = Transform::template row_term<float>(p, h, query_position(lens, row));
      }
      row_g[mi][hh] = 0.f;
      row_dl[mi][hh] = 0.f;
    }

  float dq[MI][DTK][4];
  zero(dq);
  const int valid_q = lens.rows_q - m0;
  // The mainloop over the row tile's key tiles (tiles.h); dense masks get their own copy, as
  // in the forward kernel.
  auto mainloop = [&](const auto& tiles) {
    if (tiles.count > 0) {
      auto issue_kv = [&](int n_block, int buf) {
        const int n0 = n_block * BN;
        load_tile_async<BN, DK, kThreads>(sK(buf), k + static_cast<int64_t>(n0) * p.k_row_stride,
                                          p.k_row_stride, lens.k - n0, tid, p.head_dim);
        load_tile_async<BN, DV, kThreads>(sV(buf), v + static_cast<int64_t>(n0) * p.v_row_stride,
                                          p.v_row_stride, lens.k - n0, tid, p.head_dim_v);
      };
      load_tile_async<kBlockM, DK, kThreads>(sQ, q, p.q_row_stride, lens.q - m0, tid,
                                             p.head_dim);
      load_tile_async<kBlockM, DV, kThreads>(sdO, dout, p.do_row_stride, lens.q - m0, tid,
                                             p.head_dim_v);
      issue_kv(tiles.at(0), 0);
      cp_async_commit();

      for (int i = 0; i < tiles.count; ++i) {
        const int buf = i & 1;
        const int n0 = tiles.at(i) * BN;
        cp_async_wait_all();
        __syncthreads();
        if (i + 1 < tiles.count) {
          issue_kv(tiles.at(i + 1), buf ^ 1);
          cp_async_commit();
        }
        float s[MI][NT][4];
        zero(s);
        warp_gemm_nt<MI, NT, DK>(s, sQ, warp_row0, sK(buf), 0, lane);
        const bool full =
            tile_is_full(p, lens, m0 + warp_row0, m0 + warp_row0 + 16 * MI, n0, n0 + BN);
        scale_frag(s, p.scale_log2);
        if (!Mod::kIdentity && Mod::tile_active(p, lens, m0 + warp_row0,
                                                 m0 + warp_row0 + 16 * MI - 1, n0, n0 + BN - 1)) {
          modify_scores<Mod, false>(s, p, lens, b, h, m0 + warp_row0, n0, lane);
        }
        if (!full) mask_scores(s, rr, n0, lane);
        // P, and the live mask M of a non-normalised transform kept in `live`.
        uint32_t live[MI] = {};
        bool any_live = true;
  #pragma unroll
        for (int mi = 0; mi < MI; ++mi)
  #pragma unroll
          for (int ni = 0; ni < NT; ++ni)
  #pragma unroll
            for (int e = 0; e < 4; ++e) {
              const bool attended = s[mi][ni][e] != -INFINITY;
              const float pe = exp2f(s[mi][ni][e] - lse2[mi][e >> 1]);
              s[mi][ni][e] = pe;
              if (kLsePass && attended && Transform::live(pe, row_term[mi][e >> 1])) {
                live[mi] |= 1u << (ni * 4 + e);
              }
            }
        if (kLsePass) {
          uint32_t mine = 0;
  #pragma unroll
          for (int mi = 0; mi < MI; ++mi) mine |= live[mi];
          any_live = __any_sync(0xffffffff, mine != 0);
        }

        float dp[MI][NT][4];
        zero(dp);
        if (any_live) warp_gemm_nt<MI, NT, DV>(dp, sdO, warp_row0, sV(buf), 0, lane);
        if constexpr (kRowPass) {
  #pragma unroll
          for (int mi = 0; mi < MI; ++mi)
  #pragma unroll
            for (int ni = 0; ni < NT; ++ni)
  #pragma unroll
              for (int e = 0; e < 4; ++e) {
                if (live[mi] & (1u << (ni * 4 + e))) {
                  row_g[mi][e >> 1] += dp[mi][ni][e];
                  row_dl[mi][e >> 1] += s[mi][ni][e] * dp[mi][ni][e];
                }
              }
        } else {
  #pragma unroll
          for (int mi = 0; mi < MI; ++mi)
  #pragma unroll
            for (int ni = 0; ni < NT; ++ni)
  #pragma unroll
              for (int e = 0; e < 4; ++e) {
                const float da =
                    !kLsePass || (live[mi] & (1u << (ni * 4 + e))) ? dp[mi][ni][e] : 0.f;
                const float ds = s[mi][ni][e] * (da - delta[mi][e >> 1]);
                dp[mi][ni][e] = Mod::kAddsTerms
                                    ? ds
                                    : raw_score_grad<Mod>(ds, s[mi][ni][e], lse2[mi][e >> 1], p);
              }
          if constexpr (Mod::kAddsTerms) {
            raw_score_grads<Mod, false>(
                dp, s, [&](int mi, int, int e) { return lse2[mi][e >> 1]; }, p, lens, b, h,
                m0 + warp_row0, n0, lane);
          }
          uint32_t dsa[MI][NT / 2][4];
          to_a_frags<MI, NT, T>(dp, dsa);
          warp_gemm_rs<MI, DTK, NT / 2, DK>(dq, dsa, sK(buf), 0, lane);
        }
      }
    }

  };
  if (kLsePass || p.block_kv_num == nullptr) {  // block lists: normalised only (fwd_sm80.h)
    mainloop(dense_key_tiles<BN>(tile_keys));
  } else {
    mainloop(key_tiles<BN>(p, tile_keys, b, h, m0));
  }

  if constexpr (kRowPass) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float gs = row_g[mi][hh], ds = row_dl[mi][hh];
        gs += __shfl_xor_sync(0xffffffff, gs, 1);
        gs += __shfl_xor_sync(0xffffffff, gs, 2);
        ds += __shfl_xor_sync(0xffffffff, ds, 1);
        ds += __shfl_xor_sync(0xffffffff, ds, 2);
        const int row = m0 + warp_row0 + mi * 16 + g + 8 * hh;
        if ((lane & 3) == 0 && row < lens.rows_q) {
          Transform::row_grad_terms(p)[lse_off + row] =
              gs * Transform::template row_term_grad<float>(p, query_position(lens, row));
          p.delta[lse_off + row] = ds;
        }
      }
  } else {
    __syncthreads();
    float qscale[MI][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) qscale[mi][hh] = static_cast<float>(p.scale);
    T* dqptr = dq_rows<T>(p, lens, b, h, m0);
    store_rows<MI, DTK, DK>(dq, qscale, sQ, warp_row0, dqptr, p.dq_row_stride, valid_q, lane, 0,
                            p.head_dim);
  }
}

// Deterministic: the dK/dV and dQ passes are independent (both only read delta), so one
// launch runs both: the first kv_blocks CTAs do dK/dV, the rest dQ. Sharing the grid lets each
// pass fill the other's last partial wave. Atomic dQ: every CTA is a dK/dV CTA.
template <typename KVTraits, typename QTraits, typename T, int DK, int DV, typename Variant,
          bool kAtomicDQ>
__global__ void __launch_bounds__(KVTraits::kThreads)
    bwd_kernel(const AttnParams p, int kv_blocks) {
  static_assert(KVTraits::kThreads == QTraits::kThreads, "both passes share the block shape");
  if (kAtomicDQ || static_cast<int>(blockIdx.x) < kv_blocks) {
    bwd_dkdv_block<KVTraits, T, DK, DV, KVTraits::kMI, KVTraits::kBlockM, Variant, kAtomicDQ>(
        p, blockIdx.x);
  } else if constexpr (!kAtomicDQ) {
    bwd_dq_block<QTraits, T, DK, DV, QTraits::kMI, QTraits::kBlockN, Variant, false>(
        p, blockIdx.x - kv_blocks);
  }
}

// Backward step 1 of a non-normalised transform: G and Delta of every query row.
template <typename QTraits, typename T, int D, typename Variant>
__global__ void __launch_bounds__(QTraits::kThreads) bwd_rows_kernel(const AttnParams p) {
  bwd_dq_block<QTraits, T, D, D, QTraits::kMI, QTraits::kBlockN, Variant, true>(p, blockIdx.x);
}

}  // namespace tc
}  // namespace adaattn
