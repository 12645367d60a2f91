// Launchers of the tensor-core linear-attention kernels (linear_kernels.h). run_linear<T, kBwd>
// is instantiated per dtype and pass in csrc/cuda/linear_tc_{bf16,fp16}_{fwd,bwd}.cu (compiled
// in parallel) and dispatched from csrc/cuda/linear_tc.cu.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
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

// Stream-ordered caching allocator: freed on return, alive for the kernels queued here.
inline at::Tensor scratch(int64_t numel, at::ScalarType dtype) {
  return at::empty({numel}, at::TensorOptions()
                                .dtype(dtype)
                                .device(at::kCUDA, c10::cuda::current_device()));
}

inline dim3 chunk_blocks(const LinearParams& p, const Grid& g) {
  TORCH_CHECK(g.chunks <= std::numeric_limits<int>::max() && p.heads <= 65535,
              "adaattn: linear attention problem too large for one launch (", g.chunks,
              " chunks, ", p.heads, " heads)");
  return dim3(static_cast<unsigned>(g.chunks), static_cast<unsigned>(p.heads));
}

// Prefix states (linear_kernels.h): S_v in T per slot and, when normalize, fp32 z.
template <typename T, int D, int DV>
struct PrefixStates {
  at::Tensor v, z;
  PrefixStates(const LinearParams& p, const Grid& g) {
    const int64_t slots = (p.causal ? g.chunks : p.num_seqs) * p.heads;
    v = scratch(slots * D * DV, std::is_same_v<T, __half> ? at::kHalf : at::kBFloat16);
    if (p.normalize) z = scratch(slots * D, at::kFloat);
  }
  T* sv() const { return reinterpret_cast<T*>(v.data_ptr()); }
  float* sz() const { return z.defined() ? z.data_ptr<float>() : nullptr; }
};

// Shortest segment of a split scan walk: shorter ones would spend more on the extra launch and
// the re-read of their tiles than the walk saves.
constexpr int64_t kMinSegChunks = 16;

// The scan walks every (sequence, head) pair's chunks in order, one CTA per state tile. When
// those CTAs fill less than the GPU, the walk is split into as many segments as the GPU holds
// at once (ScanSplit): one launch sums the segments, a second walks them all in parallel.
template <typename T, int D, int DV, bool kBwd>
void launch_scan(const LinearParams& p, const Grid& g, const PrefixStates<T, D, DV>& out,
                 const void* init, void* total, const float2* rs) {
  const int64_t pairs = static_cast<int64_t>(p.num_seqs) * p.heads;
  if (pairs == 0) return;
  constexpr int kTiles = D / kScanRows * (DV / scan_cols<DV>());
  constexpr int kSmem = ScanSmem<DV, T>::kBytes;
  constexpr int kThr = scan_threads<DV>();
  auto walk = state_scan_kernel<T, D, DV, kBwd, false>;
  auto sums = state_scan_kernel<T, D, DV, kBwd, true>;
  set_smem(walk, kSmem);
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, walk, kThr, kSmem));
  const int64_t resident =
      static_cast<int64_t>(per_sm) * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // The longest walk: a dense sequence's chunks, or (packed) every chunk in one sequence.
  const int64_t longest = g.cps > 0 ? g.cps : g.chunks;
  int64_t segs = std::min(resident / (pairs * kTiles), longest / kMinSegChunks);
  ScanSplit split{0, nullptr};
  at::Tensor seg_totals;  // freed on return; the caching allocator keeps it for this stream
  if (segs > 1) {
    constexpr int kGroup = scan_group<DV>();
    split.seg_chunks = ((longest + segs - 1) / segs + kGroup - 1) / kGroup * kGroup;
    segs = (longest + split.seg_chunks - 1) / split.seg_chunks;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 blocks(static_cast<unsigned>(grid_size(pairs)), kTiles,
                    static_cast<unsigned>(std::max<int64_t>(segs, 1)));
  if (segs > 1) {
    seg_totals = scratch((segs - 1) * pairs * D * p.state_cols, at::kFloat);
    split.seg_totals = seg_totals.data_ptr<float>();
    set_smem(sums, kSmem);
    sums<<<dim3(blocks.x, blocks.y, blocks.z - 1), kThr, kSmem, stream>>>(
        p, g.cps, split, out.sv(), out.sz(), nullptr, nullptr, rs);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  walk<<<blocks, kThr, kSmem, stream>>>(p, g.cps, split, out.sv(), out.sz(),
                                        static_cast<const float*>(init),
                                        static_cast<float*>(total), rs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// A chunk kernel (CTA per (chunk, head), kThreads threads, kSmem bytes of dynamic shared
// memory) called as kernel(p, cps, args...).
template <int kSmem, typename Kernel, typename... Args>
void launch_chunks(Kernel kernel, const LinearParams& p, const Grid& g, Args... args) {
  set_smem(kernel, kSmem);
  kernel<<<chunk_blocks(p, g), kThreads, kSmem, c10::cuda::getCurrentCUDAStream()>>>(p, g.cps,
                                                                                   args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int D, int DV>
void run_fwd(const LinearParams& p) {
  const Grid g = chunk_grid(p);
  const PrefixStates<T, D, DV> prefix(p, g);
  launch_scan<T, D, DV, false>(p, g, prefix, p.state_in, p.state_out, nullptr);
  if (g.chunks == 0) return;
  launch_chunks<OutSmem<D, DV, T>::kBytes>(fwd_out_kernel<T, D, DV>, p, g, prefix.sv(),
                                           prefix.sz());
}

template <typename T, int D, int DV>
void run_bwd(const LinearParams& p) {
  const Grid g = chunk_grid(p);
  // One set of prefix states: S before each chunk for the dq kernel, then dR after each chunk.
  const PrefixStates<T, D, DV> states(p, g);
  const at::Tensor rs = scratch(2 * g.chunks * p.heads * kChunk, at::kFloat);
  float2* rows = reinterpret_cast<float2*>(rs.data_ptr<float>());
  if (g.chunks > 0) {
    launch_scan<T, D, DV, false>(p, g, states, p.state_in, nullptr, nullptr);
    launch_chunks<DqSmem<D, DV, T>::kBytes>(bwd_dq_kernel<T, D, DV>, p, g, states.sv(),
                                            states.sz(), rows);
  }
  launch_scan<T, D, DV, true>(p, g, states, p.dstate, p.dstate_in, rows);
  if (g.chunks == 0) return;
  launch_chunks<DkdvSmem<D, DV, T>::kBytes>(bwd_dkdv_kernel<T, D, DV>, p, g, states.sv(),
                                            states.sz(), rows);
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
