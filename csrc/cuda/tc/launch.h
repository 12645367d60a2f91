// Tile configurations and launchers of the tensor-core flash kernels. Each instantiation lives
// in its own generated .cu (csrc/cuda/tc/inst/) so builds compile them in parallel.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <limits>

#include "flash_bwd_kernel.h"
#include "flash_fwd_kernel.h"

namespace adaattn {
namespace tc {

// Tile shapes per head dim: warps per CTA, 16-row groups per warp (MI), and the streamed tile
// size. Two row groups per warp halve the shared-memory reads per MMA, which bound these
// kernels on Hopper, as long as the accumulators still fit in registers.
template <int D>
struct FlashConfig;

template <>
struct FlashConfig<64> {
  static constexpr int kFwdWarps = 4, kFwdMI = 2, kFwdBlockN = 64;
  static constexpr int kKVWarps = 4, kKVMI = 2, kKVBlockM = 32;
  static constexpr int kQWarps = 4, kQMI = 2, kQBlockN = 64;
};

template <>
struct FlashConfig<128> {
  static constexpr int kFwdWarps = 4, kFwdMI = 2, kFwdBlockN = 32;
  static constexpr int kKVWarps = 4, kKVMI = 1, kKVBlockM = 64;
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

template <typename T, int D>
void run_flash_fwd(const AttnParams& p) {
  using C = FlashConfig<D>;
  using Traits = FwdTraits<T, D, C::kFwdWarps, C::kFwdMI, C::kFwdBlockN>;
  auto kernel = flash_fwd_kernel<Traits, T, D, C::kFwdMI, C::kFwdBlockN>;
  set_smem(kernel, Traits::kSmemBytes);
  const int64_t m_blocks = (p.len_q + Traits::kBlockM - 1) / Traits::kBlockM;
  const int grid = grid_size(m_blocks * p.batch * p.heads_q);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int D>
void run_flash_bwd(const AttnParams& p) {
  using C = FlashConfig<D>;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  {
    constexpr int kRowsPerBlock = 8;
    const int64_t rows = static_cast<int64_t>(p.batch) * p.heads_q * p.len_q;
    const int grid = grid_size((rows + kRowsPerBlock - 1) / kRowsPerBlock);
    flash_bwd_delta_kernel<T, D><<<grid, kRowsPerBlock * 32, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  using KV = BwdKVTraits<T, D, C::kKVWarps, C::kKVMI, C::kKVBlockM>;
  using Q = BwdQTraits<T, D, C::kQWarps, C::kQMI, C::kQBlockN>;
  auto kernel = flash_bwd_kernel<KV, Q, T, D>;
  constexpr int kSmem = KV::kSmemBytes > Q::kSmemBytes ? KV::kSmemBytes : Q::kSmemBytes;
  set_smem(kernel, kSmem);
  const int64_t kv_blocks =
      (p.len_k + KV::kBlockN - 1) / KV::kBlockN * p.batch * static_cast<int64_t>(p.heads_kv);
  const int64_t q_blocks =
      (p.len_q + Q::kBlockM - 1) / Q::kBlockM * p.batch * static_cast<int64_t>(p.heads_q);
  kernel<<<grid_size(kv_blocks + q_blocks), KV::kThreads, kSmem, stream>>>(
      p, grid_size(kv_blocks));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace tc
}  // namespace adaattn
