// Launchers of the tensor-core linear-attention kernels (linear_kernels.h). run_linear<T, kBwd>
// is instantiated per dtype and pass in csrc/cuda/linear_tc_{bf16,fp16}_{fwd,bwd}.cu (compiled
// in parallel) and dispatched from csrc/cuda/linear_tc.cu.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <limits>
#include <type_traits>

#include "launch.h"
#include "linear_kernels.h"

namespace adaattn {
namespace tc {
namespace lin {

// Chunk grid of a problem: chunks per dense sequence (0 when packed) and the virtual chunk
// count (dense: B * ceil(T / 64); packed: floor(T / 64) + N, see linear_kernels.h).
struct Grid {
  int64_t cps;
  int64_t chunks;
};

inline Grid chunk_grid(const LinearParams& p) {
  if (p.cu_seqlens == nullptr) {
    const int64_t cps = (static_cast<int64_t>(p.len) + kChunk - 1) / kChunk;
    return {cps, cps * p.num_seqs};
  }
  return {0, static_cast<int64_t>(p.len) / kChunk + p.num_seqs};
}

inline at::Tensor scratch(int64_t numel) {
  // Stream-ordered caching allocator: freed on return, alive for the kernels queued here.
  return at::empty({numel}, at::TensorOptions()
                                .dtype(at::kFloat)
                                .device(at::kCUDA, c10::cuda::current_device()));
}

inline dim3 chunk_blocks(const LinearParams& p, const Grid& g) {
  TORCH_CHECK(g.chunks <= std::numeric_limits<int>::max() && p.heads <= 65535,
              "adaattn: linear attention problem too large for one launch (", g.chunks,
              " chunks, ", p.heads, " heads)");
  return dim3(static_cast<unsigned>(g.chunks), static_cast<unsigned>(p.heads));
}

template <typename T, int D, int DV, bool kBwd>
void launch_chunk_states(const LinearParams& p, const Grid& g, float* local, const float2* rs) {
  chunk_state_kernel<T, D, DV, kBwd><<<chunk_blocks(p, g), kThreads, 0,
                                       at::cuda::getCurrentCUDAStream()>>>(p, g.cps, local, rs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The fp32 scan over chunks (scan_kernel in linear_tc.cu, one copy for every dtype).
void launch_scan(const LinearParams& p, const Grid& g, float* local, const void* init,
                 void* total, bool reverse);

template <typename T, int D, int DV>
void run_fwd(const LinearParams& p) {
  const Grid g = chunk_grid(p);
  const int64_t de = static_cast<int64_t>(D) * p.state_cols;
  const at::Tensor local = scratch(g.chunks * p.heads * de);
  if (g.chunks > 0) launch_chunk_states<T, D, DV, false>(p, g, local.data_ptr<float>(), nullptr);
  launch_scan(p, g, local.data_ptr<float>(), p.state_in, p.state_out, false);
  if (g.chunks == 0) return;
  constexpr int kSmem = OutSmem<D, DV, T>::kBytes;
  auto kernel = fwd_out_kernel<T, D, DV>;
  set_smem(kernel, kSmem);
  kernel<<<chunk_blocks(p, g), kThreads, kSmem, at::cuda::getCurrentCUDAStream()>>>(
      p, g.cps, local.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int D, int DV>
void run_bwd(const LinearParams& p) {
  const Grid g = chunk_grid(p);
  const int64_t de = static_cast<int64_t>(D) * p.state_cols;
  // One [chunks, H, D, E] buffer: S prefixes for the dq kernel, then dR suffixes.
  const at::Tensor local = scratch(g.chunks * p.heads * de);
  const at::Tensor total = scratch(static_cast<int64_t>(p.num_seqs) * p.heads * de);
  const at::Tensor rs = scratch(2 * g.chunks * p.heads * kChunk);
  float* buf = local.data_ptr<float>();
  float2* rows = reinterpret_cast<float2*>(rs.data_ptr<float>());
  if (g.chunks == 0) {
    launch_scan(p, g, buf, p.dstate, p.dstate_in, true);
    return;
  }
  launch_chunk_states<T, D, DV, false>(p, g, buf, nullptr);
  launch_scan(p, g, buf, p.state_in, total.data_ptr<float>(), false);
  {
    constexpr int kSmem = DqSmem<D, DV, T>::kBytes;
    auto kernel = bwd_dq_kernel<T, D, DV>;
    set_smem(kernel, kSmem);
    kernel<<<chunk_blocks(p, g), kThreads, kSmem, at::cuda::getCurrentCUDAStream()>>>(
        p, g.cps, buf, total.data_ptr<float>(), rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  launch_chunk_states<T, D, DV, true>(p, g, buf, rows);
  launch_scan(p, g, buf, p.dstate, p.dstate_in, true);
  {
    constexpr int kSmem = DkdvSmem<D, DV, T>::kBytes;
    auto kernel = bwd_dkdv_kernel<T, D, DV>;
    set_smem(kernel, kSmem);
    kernel<<<chunk_blocks(p, g), kThreads, kSmem, at::cuda::getCurrentCUDAStream()>>>(
        p, g.cps, buf, rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// D, Dv in {64, 128} (linear_tc_supports in linear_api.h).
template <typename T, bool kBwd>
void run_linear(const LinearParams& p) {
  auto pick = [&](auto d, auto dv) {
    constexpr int D = decltype(d)::value, DV = decltype(dv)::value;
    if constexpr (kBwd) {
      run_bwd<T, D, DV>(p);
    } else {
      run_fwd<T, D, DV>(p);
    }
  };
  using C64 = std::integral_constant<int, 64>;
  using C128 = std::integral_constant<int, 128>;
  if (p.dim == 64 && p.dim_v == 64) return pick(C64{}, C64{});
  if (p.dim == 64 && p.dim_v == 128) return pick(C64{}, C128{});
  if (p.dim == 128 && p.dim_v == 64) return pick(C128{}, C64{});
  if (p.dim == 128 && p.dim_v == 128) return pick(C128{}, C128{});
  TORCH_CHECK(false, "adaattn: the tensor-core linear attention supports D, Dv in {64, 128}, "
              "got D = ", p.dim, ", Dv = ", p.dim_v);
}

}  // namespace lin
}  // namespace tc
}  // namespace adaattn
