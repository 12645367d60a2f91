// Hopper backward at head dims above 128 ((D, Dv) = (192, 128), (192, 192), (256, 256)) for
// normalised transforms whose modifier neither adds terms nor has a learnable table.
// bwd_sm90.h's warpgroups each own 64 keys and hold whole dK and dV rows, 256
// registers a thread at D = Dv = 256; here a CTA owns 64 keys of one (batch, kv head), walks
// the 64-row query steps that meet them (every query head of its GQA group), and its two
// warpgroups split each step:
//   S^T = K Q^T, dP^T = V dO^T   warpgroup w: the 64 keys x queries [32 w, 32 w + 32)
//   P^T, dS^T                     in registers, then staged as 16-bit [key][query] tiles
//   dV += P^T dO, dK += dS^T Q    warpgroup w: the 64 keys x column half w (both operands in
//                                 shared memory)
//   dQ += dS K                    warpgroup w: the step's 64 queries x column half w, added to
//                                 the float32 accumulator by bulk reductions while the tensor
//                                 cores run dV and dK
// Five products per tile pair, as bwd_sm90.h. Q and dO are double-buffered through cp.async
// (208 KiB at D = Dv = 256); two CTA barriers per step: the step's tiles have landed, and both
// warpgroups' P^T and dS^T are staged. A step's float32 dQ (64 KiB at D = 256) does not fit
// beside them: warp w of each warpgroup holds the same 16 rows (w % 4), so each such pair of
// warps stages its rows 4 at a time as whole rows (contiguous in the accumulator) in 4 KiB of
// its own, and one lane adds them with one bulk reduction: few large reductions, because
// per-thread ones fill the load/store queue and small bulk ones cost per operation
// (docs/lab/head-dims.md).
#pragma once

#include <cmath>
#include <type_traits>

#include "../../core/mask.h"
#include "../../core/params.h"
#include "softmax_frag.h"
#include "tiles.h"
#include "wgmma.h"

namespace adaattn {
namespace tc {

template <typename Variant>
constexpr bool kSm90WideBwdVariant =
    Variant::kNormalized && !Variant::Mod::kParamGrad && !Variant::Mod::kAddsTerms;

template <typename T, int DK, int DV>
struct Sm90WideBwdTraits {
  static constexpr int kThreads = 256;
  static constexpr int kBlockN = 64;  // keys per CTA
  static constexpr int kBlockM = 64;  // queries per step
  static constexpr int kKElems = kBlockN * DK;
  static constexpr int kVElems = kBlockN * DV;
  static constexpr int kQElems = kBlockM * DK;
  static constexpr int kDoElems = kBlockM * DV;
  static constexpr int kPElems = kBlockN * kBlockM;  // P^T, and dS^T
  // dQ's staging: a slab of kDqSlabRows whole float32 rows per pair of warps (four pairs).
  static constexpr int kDqSlabRows = 4;
  static constexpr int kDqSlabFloats = kDqSlabRows * DK;
  static constexpr int kDqStageFloats = 4 * kDqSlabFloats;
  // K, V, two stages of Q and dO, P^T and dS^T, then lse and delta of both stages and dQ's
  // slabs; 1024 bytes of slack to align the swizzled tiles.
  static constexpr int kSmemBytes =
      (kKElems + kVElems + 2 * (kQElems + kDoElems) + 2 * kPElems) * static_cast<int>(sizeof(T)) +
      (2 * 2 * kBlockM + kDqStageFloats) * static_cast<int>(sizeof(float)) + 1024;
  static_assert(DK % 64 == 0 && DV % 64 == 0 && DK <= 256 && DV <= 256 && DK >= DV,
                "(D, Dv) with whole 64-column blocks up to 256, D >= Dv");
  static_assert(kSmemBytes <= 227 * 1024, "the tiles fit shared memory");
};

// Instructions a warpgroup's column half of `cols` columns takes per k-step (in n-tiles of 8):
// the whole half where it starts at a 64-column block (either half of 128 or 256 columns),
// else 32-column slices, which never cross a block of the swizzled layout (192: halves start
// at columns 0 and 96).
template <int kHalfCols>
constexpr int kWideSliceTiles = kHalfCols % 64 == 0 ? (kHalfCols < 128 ? kHalfCols : 128) / 8 : 4;

template <typename Traits, typename T, int DK, int DV, typename Variant>
__global__ void __launch_bounds__(Traits::kThreads, 1) bwd_wide_sm90_kernel(const AttnParams p) {
#ifdef ADAATTN_SM90A_DEVICE
  using Mod = typename Variant::Mod;
  static_assert(kSm90WideBwdVariant<Variant>, "plain softmax with a modifier of its own score");
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int BM = Traits::kBlockM;
  constexpr int kThreads = Traits::kThreads;
  constexpr int kHalfM = BM / 2;   // queries of a warpgroup's S^T and dP^T
  constexpr int NT = kHalfM / 8;   // their n-tiles per warp
  constexpr int DKH = DK / 2;      // a warpgroup's columns of dK and dQ
  constexpr int DVH = DV / 2;      // and of dV
  constexpr int kKWidth = sm90::GmmaLayout<DK>::kWidth;
  constexpr int kVWidth = sm90::GmmaLayout<DV>::kWidth;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const sK = reinterpret_cast<T*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
  T* const sV = sK + Traits::kKElems;
  T* const sQ0 = sV + Traits::kVElems;         // [2][BM][DK]
  T* const sdO0 = sQ0 + 2 * Traits::kQElems;   // [2][BM][DV]
  T* const sP = sdO0 + 2 * Traits::kDoElems;   // P^T [kBlockN keys][BM queries]
  T* const sdS = sP + Traits::kPElems;         // dS^T, likewise
  float* const sLse0 = reinterpret_cast<float*>(sdS + Traits::kPElems);
  float* const sDelta0 = sLse0 + 2 * BM;
  auto sQ = [&](int buf) { return sQ0 + buf * Traits::kQElems; };
  auto sdO = [&](int buf) { return sdO0 + buf * Traits::kDoElems; };

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int wg = warp / 4;
  const int g = lane >> 2;
  const int t = lane & 3;
  // The pair of warps (one per warpgroup) that holds dQ rows [16 pair, 16 pair + 16) of a step,
  // its dQ slab and its named barrier (ids 1-4; __syncthreads is 0).
  const int pair = warp % 4;
  float* const sDqSlab = sDelta0 + 2 * BM + pair * Traits::kDqSlabFloats;
  const int pair_barrier = 1 + pair;
  const bool slab_issuer = wg == 0 && lane == 0;
  const WorkItem tile = tile_item<true, false>(p, blockIdx.x, kBlockN);
  if (!tile.valid) return;
  const int b = tile.b;
  const int h_kv = tile.h;
  const int n0 = tile.index * kBlockN;
  const int key_row0 = (warp % 4) * 16;  // this warp's keys of the CTA's 64 (both warpgroups)
  const int q0 = wg * kHalfM;            // this warpgroup's queries of a step (S^T, dP^T)

  const SeqLens lens = seq_lens(p, b);
  const RowSpan rows = rows_meeting_keys(p, lens, n0, n0 + kBlockN);
  const T* kptr = k_rows<T>(p, lens, b, h_kv, n0);
  const T* vptr = v_rows<T>(p, lens, b, h_kv, n0);
  const int valid_k = lens.rows_k - n0;

  float dk[1][DKH / 8][4];
  float dv[1][DVH / 8][4];
  zero(dk);
  zero(dv);

  auto mainloop = [&](const auto& query) {
    const int steps = query.count;
    if (steps == 0) return;
    // Starts the loads of the step at (h, m0) into buffer buf: Q and dO rows (padding and rows
    // past the sequence as zeros, see bwd_sm90.h), raw lse and delta.
    auto issue_step = [&](int buf, int h, int m0) {
      const int ltid = sm90::opaque(tid);
      sm90::load_tile_gmma<BM, DK, kThreads>(sQ(buf), q_rows<T>(p, lens, b, h, m0),
                                             p.q_row_stride, lens.q - m0, ltid);
      sm90::load_tile_gmma<BM, DV, kThreads>(sdO(buf), dout_rows<T>(p, lens, b, h, m0),
                                             p.do_row_stride, lens.q - m0, ltid);
      if (tid < BM) {
        const int64_t off = row_stat_offset(p, lens, b, h) + m0 + tid;
        const bool valid = m0 + tid < lens.q;
        cp_async4(sLse0 + buf * BM + tid, p.lse + (valid ? off : 0), valid);
        cp_async4(sDelta0 + buf * BM + tid, p.delta + (valid ? off : 0), valid);
      }
    };
    sm90::load_tile_gmma<kBlockN, DK, kThreads>(sK, kptr, p.k_row_stride, lens.k - n0, tid);
    sm90::load_tile_gmma<kBlockN, DV, kThreads>(sV, vptr, p.v_row_stride, lens.k - n0, tid);
    int h, m0;  // this step's query head and first row
    query.at(p, 0, h, m0);
    issue_step(0, h, m0);
    cp_async_commit();
    // The step after next is looked up a step ahead (a block-sparse lookup reads the mask).
    int next_h = h, next_m0 = m0;
    if (steps > 1) query.at(p, 1, next_h, next_m0);

    for (int s = 0; s < steps; ++s) {
      const int buf = s & 1;
      cp_async_wait_all();
      sm90::fence_proxy_async();
      // Step s's tiles are visible, and every product of step s - 1 (which read buffer
      // buf ^ 1, P^T and dS^T) has completed.
      __syncthreads();
      const float* lse = sLse0 + buf * BM + q0;
      const float* delta = sDelta0 + buf * BM + q0;

      // S^T and dP^T: the CTA's 64 keys against this warpgroup's 32 queries.
      const uint64_t k_desc = sm90::opaque(sm90::gmma_desc_k<DK>(sK));
      const uint64_t v_desc = sm90::opaque(sm90::gmma_desc_k<DV>(sV));
      const uint64_t q_desc = sm90::opaque(sm90::gmma_desc_k<DK>(sQ(buf) + q0 * kKWidth));
      const uint64_t do_desc = sm90::opaque(sm90::gmma_desc_k<DV>(sdO(buf) + q0 * kVWidth));
      float st[1][NT][4];
      float dpt[1][NT][4];
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DK / 16; ++kk) {
        sm90::wgmma_ss<T, NT>(st[0],
                              sm90::desc_at<T>(k_desc, sm90::gmma_kcol<kBlockN, DK>(kk * 16)),
                              sm90::desc_at<T>(q_desc, sm90::gmma_kcol<BM, DK>(kk * 16)),
                              kk > 0);
      }
      sm90::wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < DV / 16; ++kk) {
        sm90::wgmma_ss<T, NT>(dpt[0],
                              sm90::desc_at<T>(v_desc, sm90::gmma_kcol<kBlockN, DV>(kk * 16)),
                              sm90::desc_at<T>(do_desc, sm90::gmma_kcol<BM, DV>(kk * 16)),
                              kk > 0);
      }
      sm90::wgmma_commit();
      // The next step's loads go out while the tensor cores work (behind the previous step's
      // dQ reductions in the memory pipeline, they would hold the products back).
      if (s + 1 < steps) {
        issue_step(buf ^ 1, next_h, next_m0);
        cp_async_commit();
      }
      int after_h = next_h, after_m0 = next_m0;
      if (s + 2 < steps) query.at(p, s + 2, after_h, after_m0);
      sm90::wgmma_wait<1>(st[0]);

      // P^T[key, query] = exp2(s scale - lse log2 e), 0 outside the mask (bwd_sm90.h): P goes
      // into pa, and st keeps P ds/dx where the modifier folds the scale (kGradInP).
      const bool full = tile_is_full(p, lens, m0 + q0, m0 + q0 + kHalfM, n0 + key_row0,
                                     n0 + key_row0 + 16);
      RowSpan seen[2];  // this warpgroup's queries (from q0) that see the thread's two keys
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        seen[hh] = rows_seeing_key(p, lens, n0 + key_row0 + g + 8 * hh);
        seen[hh].first -= m0 + q0;
        seen[hh].last -= m0 + q0;
      }
      const bool modified =
          !Mod::kIdentity && Mod::tile_active(p, lens, m0 + q0, m0 + q0 + kHalfM - 1,
                                              n0 + key_row0, n0 + key_row0 + 15);
      const float scale = backward_scores<Mod, true>(st, p, lens, b, h, n0 + key_row0, m0 + q0,
                                                     lane, modified);
      uint32_t pa[1][NT / 2][4];
      backward_probs<Mod, T>(st, pa, lse, scale, seen, full, p, lane);

      // dS^T = P^T (dP^T - Delta), times the modifier's derivative.
      sm90::wgmma_wait<0>(dpt[0]);
#pragma unroll
      for (int ni = 0; ni < NT; ++ni) {
        const float2 dl = *reinterpret_cast<const float2*>(delta + ni * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float ds = st[0][ni][e] * (dpt[0][ni][e] - ((e & 1) ? dl.y : dl.x));
          if constexpr (!Mod::kUnitGrad && !kGradInP<Mod>) {
            const float lse2 = lse[ni * 8 + 2 * t + (e & 1)] * float(M_LOG2E);
            ds = raw_score_grad<Mod>(ds, st[0][ni][e], lse2, p);
          }
          dpt[0][ni][e] = ds;
        }
      }
      uint32_t dsa[1][NT / 2][4];
      to_a_frags<1, NT, T>(dpt, dsa);

      // Both staged as [key][query] GmmaLayout<BM> tiles: (key, query) with key = key_row0 + g
      // + 8 (r & 1), query = q0 + 16 kt + 8 (r >> 1) + 2t sits in swizzled chunk
      // (query / 8) ^ g of its key's row (key % 8 = g).
      {
        const int gx = sm90::opaque(g);
        const int row = sm90::opaque((key_row0 + g) * BM + 2 * t);
#pragma unroll
        for (int kt = 0; kt < NT / 2; ++kt)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int at = row + (r & 1) * 8 * BM + (((q0 / 8 + 2 * kt + (r >> 1)) ^ gx) * 8);
            *reinterpret_cast<uint32_t*>(sP + at) = pa[0][kt][r];
            *reinterpret_cast<uint32_t*>(sdS + at) = dsa[0][kt][r];
          }
      }
      sm90::fence_proxy_async();
      __syncthreads();  // both warpgroups' halves of P^T and dS^T are staged

      // dQ[:, half] = dS K first (A = dS^T [key][query] MN-major, B = K [key][DK] MN-major),
      // then dV[:, half] += P^T dO and dK[:, half] += dS^T Q (A [64 keys][64 queries]
      // K-major, B the step's rows read transposed from column half wg on): dQ's reductions
      // into global memory run while the tensor cores work on dV and dK.
      float dq[DKH / 8][4];
      sm90::fence_operand(dv[0]);
      sm90::fence_operand(dk[0]);
      sm90::wgmma_fence();
      const uint64_t ds_t_desc = sm90::opaque(sm90::gmma_desc_mn<kBlockN, BM>(sdS));
#pragma unroll
      for (int kt = 0; kt < kBlockN / 16; ++kt) {
        sm90::wgmma_ss_cols<T, DKH / 8, kWideSliceTiles<DKH>, 1, 1>(
            dq, sm90::desc_at<T>(ds_t_desc, kt * 16 * BM), [&](int col) {
              return sm90::gmma_desc_mn<kBlockN, DK>(
                  sK + sm90::gmma_kcol<kBlockN, DK>(wg * DKH + col) + kt * 16 * kKWidth);
            }, kt > 0);
      }
      sm90::wgmma_commit();
      const uint64_t p_desc = sm90::opaque(sm90::gmma_desc_k<BM>(sP));
      const uint64_t ds_desc = sm90::opaque(sm90::gmma_desc_k<BM>(sdS));
      const T* const do_t = sdO(buf);
      const T* const q_t = sQ(buf);
#pragma unroll
      for (int kt = 0; kt < BM / 16; ++kt) {
        sm90::wgmma_ss_cols<T, DVH / 8, kWideSliceTiles<DVH>, 0, 1>(
            dv[0], sm90::desc_at<T>(p_desc, kt * 16), [&](int col) {
              return sm90::gmma_desc_mn<BM, DV>(
                  do_t + sm90::gmma_kcol<BM, DV>(wg * DVH + col) + kt * 16 * kVWidth);
            }, 1);
        sm90::wgmma_ss_cols<T, DKH / 8, kWideSliceTiles<DKH>, 0, 1>(
            dk[0], sm90::desc_at<T>(ds_desc, kt * 16), [&](int col) {
              return sm90::gmma_desc_mn<BM, DK>(
                  q_t + sm90::gmma_kcol<BM, DK>(wg * DKH + col) + kt * 16 * kKWidth);
            }, 1);
      }
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>(dq);

      // The pair's 16 rows go out in slabs of 4 (rows g and g + 8 of a lane: slab j holds rows
      // [4j, 4j + 4)): both warps stage their column halves, then the issuer adds the slab's
      // rows that exist. Rows past the sequence add dS = 0 (their P is masked); rows past the
      // tensor are not added. The slab is rewritten once the issuer's reduction has read it.
      {
        constexpr int kRows = Traits::kDqSlabRows;
        static_assert(kRows == 4, "a lane's rows g and g + 8 fall in slabs g / 4 and 2 + g / 4");
        const int rows_left = lens.rows_q - m0 - pair * 16;
        float* const acc = p.dq_accum + (row_stat_offset(p, lens, b, h) + m0 + pair * 16) * DK;
#pragma unroll
        for (int j = 0; j < 16 / kRows; ++j) {
          if (slab_issuer) sm90::bulk_wait_read();
          sm90::named_sync(pair_barrier, 64);
          if ((g >> 2) == (j & 1)) {
            float* const row = sDqSlab + (g & 3) * DK + wg * DKH + 2 * t;
#pragma unroll
            for (int ni = 0; ni < DKH / 8; ++ni) {
              *reinterpret_cast<float2*>(row + ni * 8) =
                  make_float2(dq[ni][2 * (j >> 1)], dq[ni][2 * (j >> 1) + 1]);
            }
          }
          sm90::fence_proxy_async();
          sm90::named_sync(pair_barrier, 64);
          const int rows = min(kRows, rows_left - j * kRows);
          if (slab_issuer && rows > 0) {
            sm90::bulk_reduce_add(acc + j * kRows * DK, sDqSlab,
                                  rows * DK * static_cast<int>(sizeof(float)));
            sm90::bulk_commit();
          }
        }
      }
      sm90::wgmma_wait<0>(dk[0]);
      sm90::fence_operand(dv[0]);
      h = next_h;
      m0 = next_m0;
      next_h = after_h;
      next_m0 = after_m0;
    }
  };
  if (p.block_kv_num == nullptr) {
    mainloop(dense_query_steps<BM>(p, h_kv, rows));
  } else {
    mainloop(query_steps<BM>(p, b, h_kv, n0, rows));
  }

  // dK and dV rows are staged over sK and sV (each warpgroup its column half of the warp's
  // rows), which nobody reads after this barrier.
  __syncthreads();
  const float kscale[1][2] = {{static_cast<float>(p.scale), static_cast<float>(p.scale)}};
  const float one[1][2] = {{1.f, 1.f}};
  T* dkptr = dk_rows<T>(p, lens, b, h_kv, n0);
  T* dvptr = dv_rows<T>(p, lens, b, h_kv, n0);
  store_rows<1, DKH / 8, DK>(dk, kscale, sK, key_row0, dkptr, p.dk_row_stride, valid_k, lane,
                             wg * DKH);
  store_rows<1, DVH / 8, DV>(dv, one, sV, key_row0, dvptr, p.dv_row_stride, valid_k, lane,
                             wg * DVH);
  // The slabs and the accumulator must outlive dQ's reductions.
  if (slab_issuer) sm90::bulk_wait();
#endif
}

}  // namespace tc
}  // namespace adaattn
