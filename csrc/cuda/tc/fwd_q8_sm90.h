// Hopper forward on 8-bit operands (precision="fp8", adaattn/precision.py's scheme
// "int8-e4m3-hadamard"): S = Q K^T on s8 wgmma (exact s32), online softmax in float32, P
// quantised to e4m3 with the fixed per-row scale 448 and O += P V^T on e4m3 wgmma, both
// products at the 8-bit rate. The operands come from the pre-pass (cuda/attention_q8.cu):
//   p.q: int8 Q (rotated), [B, Hq, Lq, D], one scale per 64 rows in p.q_scale;
//   p.k: int8 K (smoothed, rotated), [B, Hkv, Lk, D], one scale per 128 keys in p.k_scale;
//   p.v: e4m3 V^T, [B, Hkv, Dv, Lk rounded up to 128] (v_row_stride: the padded length), keys
//        permuted within each 16 so that the score accumulator's registers are P's A
//        operand as they stand (kVtKeyOrder below), one scale per channel in p.v_scale.
// Strides of p.q/p.k/p.v are in bytes (elements). The structure is fwd_sm90.h's normalised
// mainloop (warp-specialised, two or three consumer warpgroups of 64 rows taking turns, two
// load stages), with the tile's scale sq * sk * softmax scale folded into the exponent's FMA and no
// max slack (the quantised P must be exp(S - m) <= 1 times 448, as the emulation forms it).
#pragma once

#include <cmath>

#include "../../core/mask.h"
#include "../../core/params.h"
#include "softmax_frag.h"
#include "tiles.h"
#include "wgmma.h"

namespace adaattn {
namespace tc {

// The fixed scale of P before its e4m3 rounding (P <= 1 uses e4m3's range up to 448), as an
// exponent offset: log2(448).
constexpr float kLog2PScale = 8.807354922057604f;
// Keys per K scale (and per V^T tile): the kernel's key tile (adaattn.precision's block_k).
constexpr int kQ8Block = 128;
// Query rows per Q scale: a consumer warpgroup's rows (block_q).
constexpr int kQ8QBlock = 64;

// Where key kappa (0..15) of each 16-key group of V^T sits: a thread's accumulator holds keys
// 2t, 2t + 1, 8 + 2t, 9 + 2t of a 16-key group of its rows, which an e4m3 A operand reads as
// reduction columns 4t .. 4t + 3.
__host__ __device__ constexpr int q8_vt_position(int kappa) {
  return 4 * ((kappa % 8) / 2) + kappa % 2 + 2 * (kappa / 8);
}

// kWarpgroupCount: consumer warpgroups (64 rows each), 2 or 3 (launch_q8).
template <int DK, int DV, int kWarpgroupCount>
struct Sm90Q8FwdTraits
    : sm90::WarpSpecialisedSplit<kWarpgroupCount, 32, kWarpgroupCount == 3 ? 160 : 232> {
  static constexpr int kBlockM = kWarpgroupCount * 64;
  static constexpr int kBlockN = 128;
  static constexpr int kStages = 2;
  // Tiles in 16-bit units (an 8-bit row of D bytes is a 16-bit row of D / 2).
  static constexpr int kQUnits = kBlockM * DK / 2;
  static constexpr int kKUnits = kBlockN * DK / 2;
  static constexpr int kVUnits = DV * kBlockN / 2;
  static constexpr int kSmemBytes = (kQUnits + kStages * (kKUnits + kVUnits)) * 2 + 1024;
  static_assert(kBlockN == kQ8Block, "one K scale per key tile");
  static_assert((DK == 64 || DK == 128) && (DV == 64 || DV == 128), "D, Dv in {64, 128}");
  // The bf16 output rows are staged over the tiles.
  static_assert(kBlockM * DV <= kQUnits + kStages * (kKUnits + kVUnits), "staging fits");
};

template <typename Traits, typename T, int DK, int DV>
__global__ void __launch_bounds__(Traits::kThreads, 1) fwd_q8_sm90_kernel(const AttnParams p) {
#ifdef ADAATTN_SM90A_DEVICE
  using U = uint16_t;  // 8-bit tiles as 16-bit units of half the width
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int BN = Traits::kBlockN;
  constexpr int kConsumerThreads = Traits::kConsumerThreads;
  static_assert(Traits::kStages == 2, "two-stage mbarrier ring");
  constexpr int NT = BN / 8;
  constexpr int DT = DV / 8;
  constexpr int kQK = DK / 2;  // Q/K tile width in units
  constexpr int kVK = BN / 2;  // V^T tile width in units (its rows are channels)
  constexpr int kQWidth = sm90::GmmaLayout<kQK>::kWidth;
  constexpr int kOutputBarrier = 1 + Traits::kWarpgroups;
  constexpr int kTurnBarrier = 2 + Traits::kWarpgroups;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ uint64_t full[Traits::kStages], empty[Traits::kStages];
  U* const sQ = reinterpret_cast<U*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
  U* const sK = sQ + Traits::kQUnits;
  U* const sV = sK + Traits::kStages * Traits::kKUnits;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const RowTile tile = row_tile<kBlockM>(p, blockIdx.x);
  if (!tile.valid || !q8_owns_head(p, tile.b, tile.h)) return;
  const int b = tile.b, h = tile.h, h_kv = tile.h_kv, m0 = tile.m0;
  const SeqLens lens = tile.lens;
  const int valid_q = lens.rows_q - m0;
  sm90::init_load_ring(full, empty, kConsumerThreads);
  const DenseKeyTiles tiles = dense_key_tiles<BN>(tile.keys);

  if (warp >= kConsumerThreads / 32) {
    sm90::regs_dealloc<Traits::kProducerRegs>();
    if (tiles.count == 0) return;
    const int ptid = tid - kConsumerThreads;
    const U* q = reinterpret_cast<const U*>(q_rows<int8_t>(p, lens, b, h, m0));
    const U* k = reinterpret_cast<const U*>(k_rows<int8_t>(p, lens, b, h_kv, 0));
    const U* vt = reinterpret_cast<const U*>(v_rows<uint8_t>(p, lens, b, h_kv, 0));
    for (int j = 0; j <= tiles.count; ++j) {
      if (j >= 2) sm90::mbar_wait(&empty[j % 2], ((j - 2) >> 1) & 1);
      if (j == 0) {
        sm90::load_tile_gmma<kBlockM, kQK, 128>(sQ, q, p.q_row_stride / 2, valid_q, ptid);
      }
      if (j < tiles.count) {
        const int n = tiles.at(j);
        sm90::load_tile_gmma<BN, kQK, 128>(sK + (j % 2) * Traits::kKUnits,
                                           k + static_cast<int64_t>(n) * BN * p.k_row_stride / 2,
                                           p.k_row_stride / 2, lens.rows_k - n * BN, ptid);
      }
      if (j > 0) {
        // V^T is padded to whole tiles with zeros: every row (channel) of a tile is in bounds.
        const int n = tiles.at(j - 1);
        sm90::load_tile_gmma<DV, kVK, 128>(sV + ((j - 1) % 2) * Traits::kVUnits,
                                           vt + n * kVK, p.v_row_stride / 2, DV, ptid);
      }
      sm90::publish_stage(&full[j % 2]);
    }
  } else {
    sm90::regs_alloc<Traits::kConsumerRegs>();
    const int wg = warp / 4;
    const int warp_row0 = warp * 16;
    const int g = lane >> 2;
    const RowRanges<1> rr = warp_row_ranges(p, lens, m0 + warp_row0, lane);
    float o[DT][4];
    zero<1, DT>(reinterpret_cast<float(&)[1][DT][4]>(o));
    float row_max[1][2] = {{-INFINITY, -INFINITY}};
    float row_sum[1][2] = {{0.f, 0.f}};
    // The scores' scale of key tile n: sq * sk[n] * softmax scale, in log2 units.
    const float q_scale_log2 =
        p.q_scale[(static_cast<int64_t>(b) * p.heads_q + h) * p.q_scale_blocks +
                  (m0 + kQ8QBlock * wg) / kQ8QBlock] *
        p.scale_log2;
    const float* k_scale = p.k_scale + (static_cast<int64_t>(b) * p.heads_kv + h_kv) *
                                           p.k_scale_blocks;

    auto issue_scores = [&](int32_t (&s)[NT][4], int stage) {
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DK / 32; ++kk) {
        const U* a = sQ + sm90::gmma_kcol<kBlockM, kQK>(kk * 16) + wg * 64 * kQWidth;
        const U* bk = sK + stage * Traits::kKUnits + sm90::gmma_kcol<BN, kQK>(kk * 16);
        sm90::wgmma_ss_s8<NT>(s, sm90::gmma_desc_k<kQK>(a), sm90::gmma_desc_k<kQK>(bk), kk > 0);
      }
      sm90::wgmma_commit();
    };
    auto issue_pv = [&](const uint32_t (&pa)[BN / 32][4], int stage) {
      sm90::wgmma_fence();
#pragma unroll
      for (int kt = 0; kt < BN / 32; ++kt) {
        const U* bv = sV + stage * Traits::kVUnits + sm90::gmma_kcol<DV, kVK>(kt * 16);
        sm90::wgmma_rs_e4m3<DT>(o, pa[kt], sm90::gmma_desc_k<kVK>(bv));
      }
      sm90::wgmma_commit();
    };
    auto wait_full = [&](int j) { sm90::mbar_wait(&full[j % 2], (j >> 1) & 1); };
    auto release = [&](int j) {
      if (lane == 0) sm90::mbar_arrive(&empty[j % 2]);
    };
    // The scores of key tile n (masked: -inf), then the online softmax; s holds P * 448. The
    // integer scores stay biased floats (online_softmax's kBiasedInt: one integer add each);
    // the scale is > 0 (the op refuses softmax_scale <= 0).
    auto softmax_scores = [&](const int32_t (&si)[NT][4], float (&s)[1][NT][4], int n,
                              float (&corr)[1][2]) {
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][ni][e] = sm90::s32_as_biased_float(si[ni][e]);
      const float scale = q_scale_log2 * k_scale[n];
      const int n0 = n * BN;
      if (!tile_is_full(p, lens, m0 + warp_row0, m0 + warp_row0 + 16, n0, n0 + BN)) {
        mask_scores(s, rr, n0, lane);
      }
      online_softmax<true, true>(s, row_max, row_sum, corr, scale, 0.f, kLog2PScale);
    };
    // P (the softmax made it P * 448 <= 448) in e4m3, as the A operand of the k = 32 steps
    // (wgmma.h).
    auto quantize_p = [&](const float (&s)[1][NT][4], uint32_t (&pa)[BN / 32][4]) {
#pragma unroll
      for (int kt = 0; kt < BN / 32; ++kt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int j = 4 * kt + 2 * (r / 2);  // n-tiles j, j + 1; rows g (r even), g + 8
          const int e = 2 * (r % 2);
          const uint32_t lo = sm90::pack_e4m3x2(s[0][j][e], s[0][j][e + 1]);
          const uint32_t hi = sm90::pack_e4m3x2(s[0][j + 1][e], s[0][j + 1][e + 1]);
          pa[kt][r] = lo | hi << 16;
        }
    };

    constexpr int kWgs = Traits::kWarpgroups;
    const sm90::WarpgroupTurns<kWgs, kTurnBarrier> turns{wg};
    if (tiles.count > 0) {
      if (wg == kWgs - 1) turns.pass();
      // The softmax does not run under this warpgroup's own P V product: ptxas schedules the
      // wait for it at the top of the softmax's basic block (docs/lab/fp8-kernel.md). The
      // other warpgroup's products cover it (the turns above).
      uint32_t pa[BN / 32][4];
      {
        wait_full(0);
        int32_t si[NT][4];
        turns.take();
        issue_scores(si, 0);
        turns.pass();
        sm90::wgmma_wait<0>(si);
        release(0);
        float s[1][NT][4];
        float corr[1][2];  // O is still 0
        softmax_scores(si, s, tiles.at(0), corr);
        quantize_p(s, pa);
      }
      for (int i = 1; i < tiles.count; ++i) {
        wait_full(i);
        int32_t si[NT][4];
        turns.take();
        issue_scores(si, i % 2);
        issue_pv(pa, (i - 1) % 2);
        turns.pass();
        sm90::wgmma_wait<1>(si);
        float s[1][NT][4];
        float corr[1][2];
        softmax_scores(si, s, tiles.at(i), corr);
        sm90::wgmma_wait<0>(o);
        sm90::fence_operand(pa);  // P_{i-1} stays intact until its product has read it
        release(i);
        if (corr[0][0] != 1.f || corr[0][1] != 1.f) {
#pragma unroll
          for (int di = 0; di < DT; ++di)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[di][e] *= corr[0][e >> 1];
        }
        quantize_p(s, pa);
      }
      wait_full(tiles.count);
      turns.take();
      issue_pv(pa, (tiles.count - 1) % 2);
      if (wg != kWgs - 1) turns.pass();
      sm90::wgmma_wait<0>(o);
      sm90::fence_operand(pa);
    }

    // out = acc * v_scale / l (l sums P * 448, as acc); lse from the float32 row sums.
    T* out = out_rows<T>(p, lens, b, h, m0);
    float* lse = p.lse + row_stat_offset(p, lens, b, h);
    float inv[1][2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float l = row_sum[0][hh];
      l += __shfl_xor_sync(0xffffffff, l, 1);
      l += __shfl_xor_sync(0xffffffff, l, 2);
      inv[0][hh] = row_saw_keys(l) ? 1.f / l : 0.f;
      const int row = m0 + warp_row0 + g + 8 * hh;
      if ((lane & 3) == 0 && row < lens.rows_q) {
        lse[row] = row_saw_keys(l) ? (row_max[0][hh] + log2f(l) - kLog2PScale) * float(M_LN2)
                                   : -INFINITY;
      }
    }
    const float* v_scale = p.v_scale + (static_cast<int64_t>(b) * p.heads_kv + h_kv) * DV;
#pragma unroll
    for (int di = 0; di < DT; ++di) {
      const float2 sv = *reinterpret_cast<const float2*>(v_scale + di * 8 + 2 * (lane & 3));
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        o[di][2 * hh] *= sv.x;
        o[di][2 * hh + 1] *= sv.y;
      }
    }
    sm90::named_sync(kOutputBarrier, kConsumerThreads);
    store_rows<1, DT, DV>(reinterpret_cast<const float(&)[1][DT][4]>(o), inv,
                          reinterpret_cast<T*>(sQ), warp_row0, out, p.o_row_stride, valid_q,
                          lane);
  }
#endif
}

}  // namespace tc
}  // namespace adaattn
