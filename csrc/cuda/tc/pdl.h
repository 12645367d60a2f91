// Programmatic dependent launch (sm_90): a kernel launched with launch_overlapping() may start
// while the kernel ahead of it in the stream still runs, once every CTA of that kernel has
// called allow_dependent_grids() (or exited). It must call wait_prior_grid() before it reads
// anything the kernel ahead writes, and before it exits, so that its own completion implies
// that kernel's (the next kernel in the stream waits for this one only). Elsewhere (an SM80
// build, an older GPU, a launch without the attribute) both calls do nothing.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace adaattn {
namespace tc {

// Blocks until the grid ahead of this one (if it was launched overlapping) has completed and
// its memory operations are visible.
__device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the grid behind this one start (launched overlapping) once every CTA of this one has
// called it.
__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}

// Launches kernel<<<grid, block, smem, stream>>>(args...), allowed to overlap the kernel ahead
// of it when `overlap` (the caller has checked that the device runs the sm_90 code above).
template <typename... Params, typename... Args>
cudaError_t launch_overlapping(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                               cudaStream_t stream, bool overlap, Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = overlap ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace tc
}  // namespace adaattn
