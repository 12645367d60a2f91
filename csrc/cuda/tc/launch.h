// Tile configurations and launchers of the tensor-core attention kernels, over the variants
// (variants/variant.h). Each instantiation lives in its own generated .cu (csrc/cuda/tc/inst/,
// see generate.py) so builds compile them in parallel.
#pragma once

// No torch header: every generated instantiation includes this file, and torch comes through
// runtime.h's functions (runtime.cu).
#include <cstdlib>
#include <limits>

#include "../../core/env.h"
#include "bwd_common.h"
#include "bwd_dq_sm90.h"
#include "bwd_rows_sm90.h"
#include "bwd_sm80.h"
#include "bwd_sm90.h"
#include "bwd_wide_sm90.h"
#include "fwd_sm80.h"
#include "fwd_sm90.h"
#include "runtime.h"

namespace adaattn {
namespace tc {

// Tile shapes of the SM80 kernels per head dims (D, Dv): warps per CTA, 16-row groups per warp
// (MI), the streamed tile size, and the column slices of the dK/dV CTAs. Two row groups per warp
// halve the shared-memory reads per MMA, which bound these kernels on Hopper, as long as the
// accumulators still fit in registers. Where even one row group's dK and dV rows do not (the
// widest head dims), kKVSlices CTAs per key tile each recompute the step's scores and dP for
// their share of the dK and dV columns (bwd_sm80.h).
// kAtomicDQ: whether the BwdMode::kAtomic backward accumulates dQ with atomics in the dK/dV
// CTAs (bwd_sm80.h). Measured on the H100 (bf16, B.L = 16k): at DV = 64 it is 4-8%
// faster end to end than the two-pass backward; at DV = 128 the dK/dV CTA (one row group per
// warp, as the dK and dV accumulators take 128 registers) is bound by shared-memory reads, the
// dQ product adds to them, and the atomic form was 0-5% slower, so DV = 128 keeps two passes.
template <int DK, int DV, bool kWide = (DK > 128 || DV > 128)>
struct FlashConfig;

template <int DK>
struct FlashConfig<DK, 64, false> {
  static constexpr int kFwdWarps = 4, kFwdMI = 2, kFwdBlockN = 64;
  static constexpr int kKVWarps = 4, kKVMI = 2, kKVBlockM = 32, kKVSlices = 1;
  static constexpr bool kAtomicDQ = true;
  static constexpr int kQWarps = 4, kQMI = 2, kQBlockN = 64;
};

template <int DK>
struct FlashConfig<DK, 128, false> {
  static constexpr int kFwdWarps = 4, kFwdMI = 2, kFwdBlockN = 64;
  static constexpr int kKVWarps = 4, kKVMI = 1, kKVBlockM = 64, kKVSlices = 1;
  static constexpr bool kAtomicDQ = false;
  static constexpr int kQWarps = 4, kQMI = 2, kQBlockN = 32;
};

// D or Dv above 128: one row group per warp everywhere (O and dQ alone take up to 128
// registers), 32-row query steps (shared memory), and dK/dV split in two column slices unless
// they take at most 160 registers together.
template <int DK, int DV>
struct FlashConfig<DK, DV, true> {
  static constexpr int kFwdWarps = 4, kFwdMI = 1, kFwdBlockN = 64;
  static constexpr int kKVWarps = 4, kKVMI = 1, kKVBlockM = 32;
  static constexpr int kKVSlices = DK + DV > 320 ? 2 : 1;
  static constexpr bool kAtomicDQ = false;
  static constexpr int kQWarps = 4, kQMI = 1, kQBlockN = 32;
};

inline int grid_size(int64_t blocks) {
  if (blocks > std::numeric_limits<int>::max()) grid_too_large(blocks);
  return static_cast<int>(blocks);
}

template <typename Kernel>
void set_smem(Kernel kernel, int bytes) {
  if (bytes > 48 * 1024) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  }
}

// p with tile_item's CTA order for a launch of `block_rows`-row tiles (kKeys: key tiles per kv
// head, else query tiles per query head), `ctas_per_sm` CTAs resident per SM, where a
// causal-like mask (an upper key bound) makes a unit's tiles differ in work: (head, batch)
// pairs in chunks of about one wave (seq.h interleave_chunk), heads of packed sequences in
// chunks of four to seven (packed_interleave_chunk). Head-major otherwise (uniform tiles, block
// lists) and with ADAATTN_HEAD_MAJOR=1.
template <bool kKeys>
AttnParams in_cta_order(const AttnParams& p, int block_rows, int ctas_per_sm) {
  AttnParams ordered = p;
  if (p.block_kv_num != nullptr || p.block_q_num != nullptr || p.window_right < 0 ||
      p.batch <= 0 || env::head_major()) {
    return ordered;
  }
  const int heads = kKeys ? p.heads_kv : p.heads_q;
  if (is_packed(p)) {
    ordered.interleave_pairs = packed_interleave_chunk(heads);
    return ordered;
  }
  const int64_t wave =
      static_cast<int64_t>(current_device_properties().multiProcessorCount) *
      ctas_per_sm;
  ordered.interleave_pairs = interleave_chunk(static_cast<int64_t>(heads) * p.batch,
                                              tile_slots<kKeys>(p, block_rows) / p.batch, wave);
  return ordered;
}

// The Hopper forward's TMA maps (Sm90FwdMaps), where its operands are dense rows of one length
// and the maps encode; disabled (cp.async) otherwise.
template <typename Traits, typename T, int DK, int DV>
Sm90FwdMaps fwd_sm90_maps(const AttnParams& p) {
  Sm90FwdMaps maps{};
  maps.enabled = false;
  if constexpr (DK % 64 == 0) {
    const bool dense_rows = p.cu_seqlens_q == nullptr && p.cu_seqlens_k == nullptr &&
                            p.seqlens == nullptr && p.cache_seqlens == nullptr;
    if (!dense_rows || !env::fwd_tma()) return maps;
    constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
    maps.enabled =
        encode_operand_map(&maps.q, p.q, kBf16, p.head_dim, p.len_q, p.heads_q, p.batch,
                           p.q_row_stride, p.q_head_stride, p.q_batch_stride, Traits::kBlockM) &&
        encode_operand_map(&maps.k, p.k, kBf16, p.head_dim, p.len_k, p.heads_kv, p.batch,
                           p.k_row_stride, p.k_head_stride, p.k_batch_stride, Traits::kBlockN) &&
        encode_operand_map(&maps.v, p.v, kBf16, p.head_dim_v, p.len_k, p.heads_kv, p.batch,
                           p.v_row_stride, p.v_head_stride, p.v_batch_stride, Traits::kBlockN);
  }
  return maps;
}

template <typename Traits, typename T, int DK, int DV, typename Variant>
void launch_fwd_sm90_traits(const AttnParams& p_in) {
  const AttnParams p = in_cta_order<false>(p_in, Traits::kBlockM, 1);
  auto kernel = fwd_sm90_kernel<Traits, T, DK, DV, Variant, false>;
  if constexpr (Variant::Transform::kCountsZeros) {
    if (p.stats != nullptr) kernel = fwd_sm90_kernel<Traits, T, DK, DV, Variant, true>;
  }
  set_smem(kernel, Traits::kSmemBytes);
  const int grid = grid_size(tile_slots<false>(p, Traits::kBlockM) * p.heads_q);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, current_stream()>>>(
      p, fwd_sm90_maps<Traits, T, DK, DV>(p));
  check_launch();
}

// kWarpgroups: consumer warpgroups (sm90_fwd_warpgroups below). The online softmax at
// D + Dv > 384 streams 80-key tiles, except over block-sparse lists (their blocks must be whole
// tiles); the lse pass keeps 64 (it keeps more live beside O).
template <typename T, int DK, int DV, typename Variant, int kWarpgroups>
void launch_fwd_sm90_with(const AttnParams& p) {
  if constexpr (DK + DV > 384 && Variant::kNormalized) {
    if (p.block_kv_num == nullptr) {
      launch_fwd_sm90_traits<Sm90FwdTraits<T, DK, DV, kWarpgroups, true>, T, DK, DV, Variant>(p);
      return;
    }
  }
  launch_fwd_sm90_traits<Sm90FwdTraits<T, DK, DV, kWarpgroups>, T, DK, DV, Variant>(p);
}

// Consumer warpgroups of the Hopper forward at D = 64 for rows that allow more than two
// (launch_fwd_sm90): three for the plain softmax, whose products are too short for two to cover
// each other's softmax, and for a transform with an lse pass (one tile of S live at a time). A
// score modifier under the online softmax spills at the 160 registers a thread three leave.
template <int DK, int DV, typename Variant>
constexpr int sm90_fwd_warpgroups() {
  constexpr bool kPlainSoftmax = Variant::kNormalized && Variant::Mod::kIdentity;
  return DK == 64 && DV == 64 && (kPlainSoftmax || !Variant::kNormalized) ? 3 : 2;
}

// Three consumer warpgroups (192-row tiles) only for whole, unpacked rows; block lists are laid
// out in 128-row blocks. The online softmax keeps causal rows at two: three were 12% slower at
// L = 1k (the diagonal's partial tiles grow with the tile) and 0-2% faster at 4k-16k, against
// 1.00x / 1.07x cuDNN non-causal at 4k / 16k (H100). A transform with an lse pass, whose rows are
// causal, gains 11% / 21% forward at 4k / 16k (H200, docs/lab/history.md).
template <typename T, int DK, int DV, typename Variant>
void launch_fwd_sm90(const AttnParams& p) {
  constexpr int kWarpgroups = sm90_fwd_warpgroups<DK, DV, Variant>();
  if constexpr (kWarpgroups != 2) {
    constexpr int kWidestRight = Variant::kNormalized ? -1 : 0;  // -1: no window, 0: causal
    const bool whole_rows = p.window_left < 0 && p.window_right <= kWidestRight &&
                            p.block_kv_num == nullptr && p.cu_seqlens_q == nullptr;
    if (whole_rows) {
      launch_fwd_sm90_with<T, DK, DV, Variant, kWarpgroups>(p);
      return;
    }
  }
  launch_fwd_sm90_with<T, DK, DV, Variant, 2>(p);
}

// The forward of every variant: out, lse (and the transform's statistics).
template <typename T, int DK, int DV, typename Variant>
void run_fwd(const AttnParams& p) {
  if constexpr (DK % 64 == 0 || DK == 32) {
    if (use_sm90()) {
      launch_fwd_sm90<T, DK, DV, Variant>(p);
      return;
    }
  }
  using C = FlashConfig<DK, DV>;
  using Traits = FwdTraits<T, DK, DV, C::kFwdWarps, C::kFwdMI, C::kFwdBlockN>;
  auto kernel = fwd_sm80_kernel<Traits, T, DK, DV, C::kFwdMI, C::kFwdBlockN, Variant>;
  set_smem(kernel, Traits::kSmemBytes);
  const int grid = grid_size(tile_slots<false>(p, Traits::kBlockM) * p.heads_q);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, current_stream()>>>(
      in_cta_order<false>(p, Traits::kBlockM, 1));
  check_launch();
}

// The SM80 dK/dV launch; two-pass: fused with the dQ CTAs (both read lse and delta), atomic:
// dQ accumulated by the dK/dV CTAs into p.dq_accum.
template <typename T, int DK, int DV, typename Variant, bool kAtomicDQ>
void launch_bwd_sm80(const AttnParams& p_in) {
  using C = FlashConfig<DK, DV>;
  using KV = BwdKVTraits<T, DK, DV, C::kKVWarps, C::kKVMI, C::kKVBlockM, Variant, kAtomicDQ,
                         C::kKVSlices>;
  using Q = BwdQTraits<T, DK, DV, C::kQWarps, C::kQMI, C::kQBlockN>;
  auto kernel = bwd_kernel<KV, Q, T, DK, DV, Variant, kAtomicDQ>;
  constexpr int kSmem =
      kAtomicDQ || KV::kSmemBytes > Q::kSmemBytes ? KV::kSmemBytes : Q::kSmemBytes;
  set_smem(kernel, kSmem);
  // The dQ CTAs of the two-pass form take the key side's chunks too (any chunk is a valid order).
  const AttnParams p = in_cta_order<true>(p_in, KV::kBlockN, 1);
  const int64_t kv_blocks = tile_slots<true>(p, KV::kBlockN) * p.heads_kv * KV::kSlices;
  const int64_t q_blocks = kAtomicDQ ? 0 : tile_slots<false>(p, Q::kBlockM) * p.heads_q;
  kernel<<<grid_size(kv_blocks + q_blocks), KV::kThreads, kSmem,
           current_stream()>>>(p, grid_size(kv_blocks));
  check_launch();
}

// bwd_dq_convert_kernel over every query row.
template <typename T, int DK, bool kSwizzled>
void launch_dq_convert(const AttnParams& p, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t items = row_items<false>(p) * (DK / 8);
  bwd_dq_convert_kernel<T, DK, kSwizzled>
      <<<grid_size((items + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p);
  check_launch();
}

// Rows of the float32 dQ accumulator: one per query row, plus a query tile of padding for the
// Hopper backward, whose bulk reductions add whole tiles (zeros past the sequence).
inline int64_t dq_accum_rows(const AttnParams& p) {
  return row_items<false>(p) + kSm90BwdBlockM;
}

// Whether the Hopper backward with atomic dQ has a producer warpgroup (bwd_sm90.h), for two
// warpgroups and DK == DV. H200, bf16, fwd+bwd, one build, against every thread loading:
// - D = 64: 1.14-1.21x (no modifier, or one without terms) and 1.11-1.12x (an lse-pass
//   transform with a learnable table) at L = 4k / 16k; a normalised transform with a learnable
//   table was 0.94-1.02x, so it keeps all-thread loads.
// - D = 128, every variant: 1.09-1.21x without terms (L = 1k / 4k / 16k, causal and not),
//   1.11-1.19x with additive terms or an extra logit, 1.04-1.17x with a learnable table (whose
//   gradient's staging then shares the dQ staging tile, Sm90BwdTraits). Dense rows only:
//   block-list steps make both sides spill, so block lists take the kernel without a producer
//   (launch_bwd_sm90).
template <int DK, int DV, typename Variant, int kWarpgroups>
constexpr bool sm90_bwd_producer() {
  if constexpr (kWarpgroups != 2 || DK != DV) return false;
  if constexpr (DK == 64) return !Variant::kNormalized || !Variant::Mod::kParamGrad;
  return DK == 128;
}

// The Hopper dK/dV launch (bwd_sm90.h). kDq: with atomic dQ, p.dq_accum zeroed, with
// dq_accum_rows(p) rows; else the dK/dV pass of the two-pass backward. kDerivative,
// kTableGrad: see launch_bwd_sm90_atomic. kMayProduce = false: the kernel without a producer.
template <typename T, int DK, int DV, typename Variant, bool kDq = true, int kWarpgroups = 2,
          bool kDerivative = true, bool kTableGrad = true, bool kMayProduce = true>
void launch_bwd_sm90(const AttnParams& p_in) {
  constexpr bool kProducer =
      kMayProduce && kDq && sm90_bwd_producer<DK, DV, Variant, kWarpgroups>();
  using Traits =
      Sm90BwdTraits<T, DK, DV, Variant, kDq, kWarpgroups, kDerivative, kTableGrad, kProducer>;
  if constexpr (kProducer && !Traits::kBlockLists) {
    if (p_in.block_kv_num != nullptr) {
      launch_bwd_sm90<T, DK, DV, Variant, kDq, kWarpgroups, kDerivative, kTableGrad, false>(p_in);
      return;
    }
  }
  auto kernel = bwd_sm90_kernel<Traits, T, DK, DV, Variant>;
  set_smem(kernel, Traits::kSmemBytes);
  if constexpr (Traits::kMinBlocks > 1) {  // room for the CTAs that share an SM
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    cudaSharedmemCarveoutMaxShared));
  }
  const AttnParams p = in_cta_order<true>(p_in, Traits::kBlockN, Traits::kMinBlocks);
  const int grid = grid_size(tile_slots<true>(p, Traits::kBlockN) * p.heads_kv);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, current_stream()>>>(p);
  check_launch();
}

// The Hopper dQ pass of the two-pass backward (bwd_dq_sm90.h).
template <typename T, int DK, int DV, typename Variant>
void launch_bwd_dq_sm90(const AttnParams& p_in) {
  using Traits = Sm90BwdDqTraits<T, DK, DV>;
  auto kernel = bwd_dq_sm90_kernel<Traits, T, DK, DV, Variant>;
  set_smem(kernel, Traits::kSmemBytes);
  const AttnParams p = in_cta_order<false>(p_in, Traits::kBlockM, 1);
  const int grid = grid_size(tile_slots<false>(p, Traits::kBlockM) * p.heads_q);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, current_stream()>>>(p);
  check_launch();
}

// The Hopper backward above 128 columns (bwd_wide_sm90.h): p.dq_accum zeroed, with
// dq_accum_rows(p) rows.
template <typename T, int DK, int DV, typename Variant>
void launch_bwd_wide_sm90(const AttnParams& p_in) {
  using Traits = Sm90WideBwdTraits<T, DK, DV>;
  auto kernel = bwd_wide_sm90_kernel<Traits, T, DK, DV, Variant>;
  set_smem(kernel, Traits::kSmemBytes);
  const AttnParams p = in_cta_order<true>(p_in, Traits::kBlockN, 1);
  const int grid = grid_size(tile_slots<true>(p, Traits::kBlockN) * p.heads_kv);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, current_stream()>>>(p);
  check_launch();
}

// Warpgroups per CTA of the Hopper backward with atomic dQ. One (64-key CTAs, two per SM) where
// a step's products are short: the narrow scores of low_rank_attn (query/key width below the
// value width). There a step's dependent chain (products, exponentials, the dS^T barrier, the
// dQ product) leaves the SM idle in a way a second, independent CTA fills, while one CTA of
// more warpgroups keeps them in step (H100, fwd+bwd: low-rank R = 32 9% faster). Two elsewhere:
// at D >= 64 the warpgroups split dQ's columns over the CTA's 128 keys, which halves the dQ
// reductions and the Q/dO reloads per key (H100, D = 64 fwd+bwd: flash 3% / 5% faster than one
// warpgroup, non-causal / causal; an lse-pass transform and additive score terms, with and
// without a table, 4-6% faster than two warpgroups with a dQ tile each).
template <int DK, int DV, typename Variant>
constexpr int sm90_bwd_warpgroups() {
  if constexpr (!Variant::kNormalized || Variant::Mod::kParamGrad) return 2;
  return DK < DV ? 1 : 2;
}

// Whether the Hopper backward takes two passes (dK/dV, then dQ without a float32 accumulator)
// instead of atomic dQ: as p.bwd_mode says (block_sparse_attn's bwd_mode, flash_attn's
// deterministic), unless the environment forces either way (env::bwd_two_pass). Normalised
// transforms with a modifier that has no learnable score table and adds no terms only.
template <typename Variant>
constexpr bool kSm90TwoPassVariant =
    Variant::kNormalized && !Variant::Mod::kParamGrad && !Variant::Mod::kAddsTerms;

template <typename Variant>
inline bool sm90_two_pass(const AttnParams& p) {
  if constexpr (!kSm90TwoPassVariant<Variant>) {
    return false;
  } else {
    const int forced = env::bwd_two_pass();
    return forced >= 0 ? forced == 1 : p.bwd_mode == BwdMode::kTwoPass;
  }
}

// The Hopper dK/dV launch with atomic dQ. A modifier that adds terms has it compiled at D = 128
// also without the passes a call does not need, the derivative's (grad_active false: it is 1)
// and the table gradient's (none asked for): each holds registers across the step (ptxas,
// sm_90a, bf16, composed modifier, spill stores with both / the derivative's / the table's /
// neither: 32 / 12 / 4 / 4 bytes with a producer, 228 / 136 / 40 / 48 without, as block lists
// run); at D = 64 the full kernel does not spill.
template <typename T, int DK, int DV, typename Variant, int kWarpgroups>
void launch_bwd_sm90_atomic(const AttnParams& p) {
  using Mod = typename Variant::Mod;
  if constexpr (Mod::kAddsTerms && DK == 128) {
    const bool derivative = Mod::grad_active(p);
    const bool table = Mod::kParamGrad && Mod::wants_param_grad(p);
    if (derivative && table) {
      launch_bwd_sm90<T, DK, DV, Variant, true, kWarpgroups, true, true>(p);
    } else if (derivative) {
      launch_bwd_sm90<T, DK, DV, Variant, true, kWarpgroups, true, false>(p);
    } else if (table) {
      launch_bwd_sm90<T, DK, DV, Variant, true, kWarpgroups, false, true>(p);
    } else {
      launch_bwd_sm90<T, DK, DV, Variant, true, kWarpgroups, false, false>(p);
    }
  } else {
    launch_bwd_sm90<T, DK, DV, Variant, true, kWarpgroups>(p);
  }
}

// The variant's parameter gradients, after the dK/dV pass: the transform's per-head one from
// the row pass's terms or from each row's lse and Delta, the modifier's table from the CTAs'
// partials (`key_slots` key tiles).
template <typename Variant>
void reduce_param_grads(const AttnParams& p, int64_t key_slots, cudaStream_t stream) {
  using Mod = typename Variant::Mod;
  using Transform = typename Variant::Transform;
  constexpr int kThreads = 256;
  if constexpr (Transform::kRowParamGrad) {
    if (Transform::wants_param_grad(p)) {
      reduce_row_param_grad_kernel<Transform, kThreads><<<p.heads_q, kThreads, 0, stream>>>(p);
      check_launch();
    }
  }
  if constexpr (Transform::kLseParamGrad) {
    if (Transform::wants_lse_param_grad(p)) {
      reduce_lse_param_grad_kernel<Transform, kThreads><<<p.heads_q, kThreads, 0, stream>>>(p);
      check_launch();
    }
  }
  if constexpr (Mod::kParamGrad) {
    if (Mod::wants_param_grad(p)) {
      const int64_t items = Mod::param_grad_items(p);
      reduce_table_param_grad_kernel<Mod, kThreads>
          <<<grid_size((items + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p, key_slots);
      check_launch();
    }
  }
}

// dK/dV/dQ and the variant's parameter gradients. The row term first: Delta = dO.O (the delta
// kernel, which also zeroes the atomic dQ accumulator) for a normalised transform, the row pass
// (G and Delta) otherwise, or only that (p.row_pass kOnly), or the caller's (kGiven). On Hopper
// (the pairs up to 128 columns): the two-pass wgmma kernels (the dQ pass computes Delta, then
// the dK/dV pass) where sm90_two_pass says so, else the wgmma kernel with atomic dQ; above 128
// columns the wide wgmma kernel with atomic dQ (kSm90WideBwdVariant). Elsewhere: atomic dQ
// where the config measured it faster and p.bwd_mode is kAtomic (and the transform is
// normalised), else the fused two-pass kernels. A normalised variant without Hopper two-pass
// kernels (kSm90TwoPassVariant, and every variant above 128 columns) takes those fused
// two-pass kernels on Hopper too when p.bwd_mode asks for two passes, so that the
// deterministic backward stays bit-reproducible.
template <typename T, int DK, int DV, typename Variant>
void run_bwd(const AttnParams& p_in) {
  using Mod = typename Variant::Mod;
  constexpr bool kNormalized = Variant::kNormalized;
  const cudaStream_t stream = current_stream();
  constexpr bool kSm90Dims = (DK == 32 || DK == 64 || DK == 128) && (DV == 64 || DV == 128) &&
                             DK <= DV && (kNormalized || DK == DV);
  constexpr bool kSm90NoTwoPass = kNormalized && !kSm90TwoPassVariant<Variant>;
  const bool sm90 = kSm90Dims && use_sm90() &&
                    !(kSm90NoTwoPass && p_in.bwd_mode == BwdMode::kTwoPass);
  constexpr bool kSm90Wide = (DK > 128 || DV > 128) && kSm90WideBwdVariant<Variant>;
  const bool sm90_wide = kSm90Wide && use_sm90() && p_in.bwd_mode != BwdMode::kTwoPass;
  AttnParams p = p_in;
  p.dq_accum = nullptr;
  // Scratch freed on return; the caching allocator keeps it for this stream.
  using C = FlashConfig<DK, DV>;
  using KV = BwdKVTraits<T, DK, DV, C::kKVWarps, C::kKVMI, C::kKVBlockM, Variant, false>;
  constexpr int kSm90Warpgroups = sm90_bwd_warpgroups<DK, DV, Variant>();
  const int64_t key_slots =
      tile_slots<true>(p, sm90 ? 64 * kSm90Warpgroups : KV::kBlockN);
  Scratch param_scratch;
  if constexpr (Mod::kParamGrad) {
    if (Mod::wants_param_grad(p)) {
      param_scratch = Scratch(Mod::param_grad_scratch(p, key_slots), /*zeroed=*/true);
      Mod::set_param_grad_scratch(p, param_scratch.data());
    }
  }
  if (sm90 && sm90_two_pass<Variant>(p)) {
    if constexpr (kSm90Dims && kSm90TwoPassVariant<Variant>) {
      launch_bwd_dq_sm90<T, DK, DV, Variant>(p);
      launch_bwd_sm90<T, DK, DV, Variant, false>(p);
    }
    reduce_param_grads<Variant>(p, key_slots, stream);
    return;
  }
  const bool atomic =
      sm90 || sm90_wide || (kNormalized && C::kAtomicDQ && p.bwd_mode == BwdMode::kAtomic);
  Scratch accum;
  if (atomic && p.row_pass != LsePass::kOnly) {
    // The delta kernel zeroes it; the row pass does not.
    accum = Scratch(dq_accum_rows(p) * DK, /*zeroed=*/!kNormalized);
    p.dq_accum = accum.data();
  }
  if constexpr (kNormalized) {
    constexpr int kThreads = 256;
    constexpr int kRowsPerBlock = kThreads / delta_lanes_per_row<DV>();
    const int row_grid = grid_size((row_items<false>(p) + kRowsPerBlock - 1) / kRowsPerBlock);
    bwd_delta_kernel<T, DK, DV><<<row_grid, kThreads, 0, stream>>>(p);
    check_launch();
  } else if (p.row_pass == LsePass::kGiven) {
    // The caller's Delta and G (sums over every block of the row): no row pass.
  } else if (sm90) {
    if constexpr (kSm90Dims) {
      using Rows = Sm90RowsTraits<T, DK>;
      auto kernel = bwd_rows_sm90_kernel<Rows, T, DK, Variant>;
      set_smem(kernel, Rows::kSmemBytes);
      const int64_t q_blocks = tile_slots<false>(p, Rows::kBlockM) * p.heads_q;
      kernel<<<grid_size(q_blocks), Rows::kThreads, Rows::kSmemBytes, stream>>>(
          in_cta_order<false>(p, Rows::kBlockM, 1));
      check_launch();
    }
  } else {
    using Q = BwdQTraits<T, DK, DV, C::kQWarps, C::kQMI, C::kQBlockN>;
    auto kernel = bwd_rows_kernel<Q, T, DK, Variant>;
    set_smem(kernel, Q::kSmemBytes);
    const int64_t q_blocks = tile_slots<false>(p, Q::kBlockM) * p.heads_q;
    kernel<<<grid_size(q_blocks), Q::kThreads, Q::kSmemBytes, stream>>>(
        in_cta_order<false>(p, Q::kBlockM, 1));
    check_launch();
  }
  if (p.row_pass == LsePass::kOnly) return;  // this block's shares of Delta and G only
  if (sm90) {
    if constexpr (kSm90Dims) launch_bwd_sm90_atomic<T, DK, DV, Variant, kSm90Warpgroups>(p);
    launch_dq_convert<T, DK, true>(p, stream);
  } else if (sm90_wide) {
    if constexpr (kSm90Wide) launch_bwd_wide_sm90<T, DK, DV, Variant>(p);
    launch_dq_convert<T, DK, false>(p, stream);
  } else if (atomic) {
    if constexpr (C::kAtomicDQ && kNormalized) launch_bwd_sm80<T, DK, DV, Variant, true>(p);
    launch_dq_convert<T, DK, false>(p, stream);
  } else {
    launch_bwd_sm80<T, DK, DV, Variant, false>(p);
  }
  reduce_param_grads<Variant>(p, key_slots, stream);
}

}  // namespace tc
}  // namespace adaattn
