// Tile configurations and launchers of the tensor-core kernels (flash and lazy attention). Each instantiation lives
// in its own generated .cu (csrc/cuda/tc/inst/) so builds compile them in parallel.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAException.h>

#include <cstdlib>
#include <limits>

#include "flash_bwd_kernel.h"
#include "flash_fwd_kernel.h"
#include "flash_bwd_dq_sm90.h"
#include "flash_bwd_sm90.h"
#include "flash_fwd_sm90.h"
#include "lazy_rows_sm90.h"

namespace adaattn {
namespace tc {

// Tile shapes per value head dim DV (the widest register accumulators, O and dV, are DV wide):
// warps per CTA, 16-row groups per warp (MI), and the streamed tile size. Two row groups per
// warp halve the shared-memory reads per MMA, which bound these kernels on Hopper, as long as
// the accumulators still fit in registers.
// kAtomicDQ: whether the non-deterministic backward accumulates dQ with atomics in the dK/dV
// CTAs (flash_bwd_kernel.h). Measured on the H100 (bf16, B.L = 16k): at DV = 64 it is 4-8%
// faster end to end than the two-pass backward; at DV = 128 the dK/dV CTA (one row group per
// warp, as the dK and dV accumulators take 128 registers) is bound by shared-memory reads, the
// dQ product adds to them, and the atomic form was 0-5% slower, so DV = 128 keeps two passes.
template <int DV>
struct FlashConfig;

template <>
struct FlashConfig<64> {
  static constexpr int kFwdWarps = 4, kFwdMI = 2, kFwdBlockN = 64;
  static constexpr int kKVWarps = 4, kKVMI = 2, kKVBlockM = 32;
  static constexpr bool kAtomicDQ = true;
  static constexpr int kQWarps = 4, kQMI = 2, kQBlockN = 64;
};

template <>
struct FlashConfig<128> {
  static constexpr int kFwdWarps = 4, kFwdMI = 2, kFwdBlockN = 64;
  static constexpr int kKVWarps = 4, kKVMI = 1, kKVBlockM = 64;
  static constexpr bool kAtomicDQ = false;
  static constexpr int kQWarps = 4, kQMI = 2, kQBlockN = 32;
};

inline int grid_size(int64_t blocks) {
  TORCH_CHECK(blocks <= std::numeric_limits<int>::max(),
              "adaattn: problem too large for one launch (", blocks, " CTAs)");
  return static_cast<int>(blocks);
}

template <typename Kernel>
void set_smem(Kernel kernel, int bytes) {
  if (bytes > 48 * 1024) {
    C10_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  }
}

// Whether the Hopper (wgmma) kernels run: the library carries sm_90a code (ADAATTN_SM90A, set by
// the build when "90a" is among the architectures) and the current GPU is an sm_90 one.
// ADAATTN_DISABLE_SM90=1 selects the SM80 kernels instead (A/B runs, testing both paths on one
// GPU); it is read at every call so that a test can flip it.
inline bool use_sm90() {
#ifdef ADAATTN_SM90A
  const char* disable = std::getenv("ADAATTN_DISABLE_SM90");
  if (disable != nullptr && disable[0] == '1') return false;
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  return prop->major == 9 && prop->minor == 0;
#else
  return false;
#endif
}

template <typename T, int DK, int DV, typename Variant>
void launch_fwd_sm90(const AttnParams& p) {
  using Traits = Sm90FwdTraits<T, DK, DV>;
  auto kernel = flash_fwd_sm90_kernel<Traits, T, DK, DV, Variant, false>;
  if constexpr (Variant::kElastic) {
    if (p.stats != nullptr) kernel = flash_fwd_sm90_kernel<Traits, T, DK, DV, Variant, true>;
  }
  set_smem(kernel, Traits::kSmemBytes);
  const int grid = grid_size(tile_slots<false>(p, Traits::kBlockM) * p.heads_q);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int DK, int DV, typename Variant>
void launch_fwd(const AttnParams& p) {
  if constexpr (DK % 64 == 0 || DK == 32) {
    if (use_sm90()) {
      launch_fwd_sm90<T, DK, DV, Variant>(p);
      return;
    }
  }
  using C = FlashConfig<DV>;
  using Traits = FwdTraits<T, DK, DV, C::kFwdWarps, C::kFwdMI, C::kFwdBlockN>;
  auto kernel = flash_fwd_kernel<Traits, T, DK, DV, C::kFwdMI, C::kFwdBlockN, Variant>;
  set_smem(kernel, Traits::kSmemBytes);
  const int grid = grid_size(tile_slots<false>(p, Traits::kBlockM) * p.heads_q);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The dK/dV launch; deterministic: fused with the dQ CTAs (both read lse and delta), atomic:
// dQ accumulated by the dK/dV CTAs into p.dq_accum.
template <typename T, int DK, int DV, typename Variant, bool kAtomicDQ>
void launch_bwd_main(const AttnParams& p) {
  using C = FlashConfig<DV>;
  using KV = BwdKVTraits<T, DK, DV, C::kKVWarps, C::kKVMI, C::kKVBlockM, Variant, kAtomicDQ>;
  using Q = BwdQTraits<T, DK, DV, C::kQWarps, C::kQMI, C::kQBlockN>;
  auto kernel = flash_bwd_kernel<KV, Q, T, DK, DV, Variant, kAtomicDQ>;
  constexpr int kSmem =
      kAtomicDQ || KV::kSmemBytes > Q::kSmemBytes ? KV::kSmemBytes : Q::kSmemBytes;
  set_smem(kernel, kSmem);
  const int64_t kv_blocks = tile_slots<true>(p, KV::kBlockN) * p.heads_kv;
  const int64_t q_blocks = kAtomicDQ ? 0 : tile_slots<false>(p, Q::kBlockM) * p.heads_q;
  kernel<<<grid_size(kv_blocks + q_blocks), KV::kThreads, kSmem,
           at::cuda::getCurrentCUDAStream()>>>(p, grid_size(kv_blocks));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// flash_bwd_dq_convert_kernel over every query row.
template <typename T, int DK, bool kSwizzled>
void launch_dq_convert(const AttnParams& p, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t items = row_items<false>(p) * (DK / 8);
  flash_bwd_dq_convert_kernel<T, DK, kSwizzled>
      <<<grid_size((items + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p);
}

template <typename T, int DK, int DV>
void run_flash_fwd(const AttnParams& p) {
  launch_fwd<T, DK, DV, SoftmaxVariant>(p);
}

// Rows of the float32 dQ accumulator: one per query row, plus a query tile of padding for the
// Hopper backward, whose bulk reductions add whole tiles (zeros past the sequence).
inline int64_t dq_accum_rows(const AttnParams& p) {
  return row_items<false>(p) + kSm90BwdBlockM;
}

// The Hopper dK/dV launch (flash_bwd_sm90.h). kDq: with atomic dQ, p.dq_accum zeroed, with
// dq_accum_rows(p) rows; else the dK/dV pass of the two-pass backward.
template <typename T, int DK, int DV, typename Variant, bool kDq = true, int kWarpgroups = 2>
void launch_bwd_sm90(const AttnParams& p) {
  using Traits = Sm90BwdTraits<T, DK, DV, Variant::kElastic, kDq, kWarpgroups>;
  auto kernel = flash_bwd_sm90_kernel<Traits, T, DK, DV, Variant>;
  set_smem(kernel, Traits::kSmemBytes);
  if constexpr (Traits::kMinBlocks > 1) {  // room for the CTAs that share an SM
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
  }
  const int grid = grid_size(tile_slots<true>(p, Traits::kBlockN) * p.heads_kv);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The Hopper dQ pass of the two-pass backward (flash_bwd_dq_sm90.h).
template <typename T, int DK, int DV>
void launch_bwd_dq_sm90(const AttnParams& p) {
  using Traits = Sm90BwdDqTraits<T, DK, DV>;
  auto kernel = flash_bwd_dq_sm90_kernel<Traits, T, DK, DV>;
  set_smem(kernel, Traits::kSmemBytes);
  const int grid = grid_size(tile_slots<false>(p, Traits::kBlockM) * p.heads_q);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Warpgroups per CTA of the Hopper backward with atomic dQ. One (64-key CTAs, two per SM) where
// a step's products are short: the narrow scores of low_rank_attn (query/key width below the
// value width) and D = 64. There a step's dependent chain (products, exponentials, the dS^T
// barrier, the dQ product) leaves the SM idle in a way a second, independent CTA fills, while
// one CTA of more warpgroups keeps them in step. Same-build A/Bs on the H100 (bf16, medians of
// 4 rounds, fwd+bwd): low_rank_attn (B = 4, H = 16, L = 4096, Dv = 128) R = 32 3.427 -> 3.123
// ms, causal 2.003 -> 1.901 ms; R = 64 3.765 -> 3.738 (noise); flash D = 64 (B = 4, H = 32,
// L = 4096, 4 alternating rounds) 5.99-6.15 -> 5.74-5.79 ms, causal 3.54-3.59 -> 3.30-3.37 ms.
// A 192-key CTA of three warpgroups at R = 32 (one CTA per SM, spilling at 168 registers):
// 3.433 -> 3.382.
template <int DK, int DV>
constexpr int sm90_bwd_warpgroups() {
  return DK < DV || DK == 64 ? 1 : 2;
}

// Whether the Hopper backward takes two passes (dK/dV, then dQ without a float32 accumulator)
// instead of atomic dQ: when asked to be deterministic. block_sparse_attn asks for it also when
// a mask's rows list few keys, where the accumulator's fixed traffic (zeroing it, reducing into
// it and converting it: 0.16 ms at B = 4, H = 16, L = 4096, D = 128) outweighs the two products
// the dQ pass recomputes per listed block (adaattn/block_sparse.py, prefers_two_pass).
// ADAATTN_BWD_TWO_PASS=1 / =0 forces / disables it (A/B runs; read at every call).
inline bool sm90_two_pass(const AttnParams& p) {
  const char* mode = std::getenv("ADAATTN_BWD_TWO_PASS");
  if (mode != nullptr) return mode[0] == '1';
  return p.deterministic;
}

// dK/dV/dQ. On Hopper (every compiled (D, Dv) pair): the two-pass wgmma kernels (the dQ pass
// computes delta, then the dK/dV pass) where sm90_two_pass says so, else the wgmma kernel with
// atomic dQ. Elsewhere: atomic dQ where the config measured it faster (fewer products, a
// float32 accumulator of 2x dq's size) unless p.deterministic, else the two-pass kernels; both
// after the delta kernel (which zeroes the accumulator).
template <typename T, int DK, int DV>
void run_flash_bwd(const AttnParams& p_in) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  constexpr bool kSm90Dims = (DK == 32 || DK == 64 || DK == 128) && (DV == 64 || DV == 128) &&
                             DK <= DV;
  const bool sm90 = kSm90Dims && use_sm90();
  AttnParams p = p_in;
  p.dq_accum = nullptr;
  if (sm90 && sm90_two_pass(p)) {
    if constexpr (kSm90Dims) {
      launch_bwd_dq_sm90<T, DK, DV>(p);
      launch_bwd_sm90<T, DK, DV, SoftmaxVariant, false>(p);
    }
    return;
  }
  const bool atomic = sm90 || (FlashConfig<DV>::kAtomicDQ && !p.deterministic);
  at::Tensor accum;  // freed on return; the caching allocator keeps it for this stream
  if (atomic) {
    accum = at::empty({dq_accum_rows(p) * DK}, at::TensorOptions().dtype(at::kFloat).device(
                                                   at::kCUDA, c10::cuda::current_device()));
    p.dq_accum = accum.data_ptr<float>();
  }
  constexpr int kRowsPerBlock = 8;
  const int row_grid = grid_size((row_items<false>(p) + kRowsPerBlock - 1) / kRowsPerBlock);
  flash_bwd_delta_kernel<T, DV><<<row_grid, kRowsPerBlock * 32, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!atomic) {
    launch_bwd_main<T, DK, DV, SoftmaxVariant, false>(p);
    return;
  }
  if (sm90) {
    if constexpr (kSm90Dims) {
      launch_bwd_sm90<T, DK, DV, SoftmaxVariant, true, sm90_bwd_warpgroups<DK, DV>()>(p);
    }
    launch_dq_convert<T, DK, true>(p, stream);
  } else {
    if constexpr (FlashConfig<DV>::kAtomicDQ) launch_bwd_main<T, DK, DV, SoftmaxVariant, true>(p);
    launch_dq_convert<T, DK, false>(p, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int D>
void run_lazy_fwd(const AttnParams& p) {
  launch_fwd<T, D, D, LazyVariant>(p);
}

// Lazy backward: row pass (G, Delta), the dK/dV + dQ launch, then the deterministic dtau/dbias
// reductions when the parameters need gradients. On Hopper both passes are the wgmma kernels,
// dQ by atomics (dq's summation order varies between runs; dk, dv, dtau and dbias do not);
// elsewhere the SM80 row pass and the fused two-pass kernels.
template <typename T, int D>
void run_lazy_bwd(const AttnParams& p_in) {
  using C = FlashConfig<D>;
  using KV = BwdKVTraits<T, D, D, C::kKVWarps, C::kKVMI, C::kKVBlockM, LazyVariant, false>;
  using Q = BwdQTraits<T, D, D, C::kQWarps, C::kQMI, C::kQBlockN>;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool sm90 = use_sm90();
  AttnParams p = p_in;
  const int64_t key_slots =
      tile_slots<true>(p, sm90 ? Sm90BwdTraits<T, D, D, true>::kBlockN : KV::kBlockN);
  const int64_t bias_span = p.bias_window < p.len_k ? p.bias_window : p.len_k;
  // Freed on return; the caching allocator keeps them for this stream.
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA,
                                                                c10::cuda::current_device());
  at::Tensor partial, accum;
  if (p.dbias != nullptr) {
    partial = at::zeros({p.heads_q * key_slots * bias_span}, f32);
    p.dbias_partial = partial.data_ptr<float>();
  }
  if (sm90) {
    using Rows = Sm90LazyRowsTraits<T, D>;
    auto kernel = lazy_rows_sm90_kernel<Rows, T, D>;
    set_smem(kernel, Rows::kSmemBytes);
    const int64_t q_blocks = tile_slots<false>(p, Rows::kBlockM) * p.heads_q;
    kernel<<<grid_size(q_blocks), Rows::kThreads, Rows::kSmemBytes, stream>>>(p);
  } else {
    auto kernel = lazy_bwd_rows_kernel<Q, T, D>;
    set_smem(kernel, Q::kSmemBytes);
    const int64_t q_blocks = tile_slots<false>(p, Q::kBlockM) * p.heads_q;
    kernel<<<grid_size(q_blocks), Q::kThreads, Q::kSmemBytes, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (sm90) {
    accum = at::zeros({dq_accum_rows(p) * D}, f32);
    p.dq_accum = accum.data_ptr<float>();
    launch_bwd_sm90<T, D, D, LazyVariant>(p);
    launch_dq_convert<T, D, true>(p, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    launch_bwd_main<T, D, D, LazyVariant, false>(p);
  }
  if (p.dtau == nullptr) return;
  constexpr int kReduceThreads = 256;
  lazy_dtau_kernel<kReduceThreads><<<p.heads_q, kReduceThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t items = static_cast<int64_t>(p.heads_q) * p.bias_window;
  lazy_dbias_kernel<kReduceThreads>
      <<<grid_size((items + kReduceThreads - 1) / kReduceThreads), kReduceThreads, 0, stream>>>(
          p, key_slots);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace tc
}  // namespace adaattn
