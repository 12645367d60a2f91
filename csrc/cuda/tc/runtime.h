// What the tensor-core launchers (launch.h) take from torch at run time: the current stream and
// device, the caching allocator and its error checks. Declared here and defined in runtime.cu,
// so that the generated instantiations (inst/) include no torch header: torch's tensor headers
// were about 20 s of the 25-30 s each instantiation took to compile for sm_80 and sm_90a, the
// bulk of a build on CI's two cores.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "../../core/env.h"

namespace adaattn {
namespace tc {

// torch's current stream on the current device.
cudaStream_t current_stream();

// The current device's properties (torch caches them).
const cudaDeviceProp& current_device_properties();

// Whether the library carries sm_90a code (ADAATTN_SM90A, set by the build when "90a" is among
// the architectures): without it, no Hopper kernel runs (and launchers need not instantiate one).
#ifdef ADAATTN_SM90A
constexpr bool kBuiltSm90a = true;
#else
constexpr bool kBuiltSm90a = false;
#endif

// Whether the Hopper (wgmma) kernels run: the library carries sm_90a code, the current GPU is an
// sm_90 one, and env::disable_sm90() does not ask for the SM80 kernels.
inline bool use_sm90() {
  if (!kBuiltSm90a || env::disable_sm90()) return false;
  const cudaDeviceProp& prop = current_device_properties();
  return prop.major == 9 && prop.minor == 0;
}

// Raises torch's CUDA error (C10_CUDA_CHECK) unless err is cudaSuccess.
void check_cuda(cudaError_t err);

// After a launch: raises torch's error for a launch that failed (C10_CUDA_KERNEL_LAUNCH_CHECK).
void check_launch();

// Raises torch's error for a launch of more CTAs than one grid takes.
[[noreturn]] void grid_too_large(int64_t blocks);

// n float32 values from torch's caching allocator on the current device (zeroed on the current
// stream if asked), given back when the last copy of the object goes: the allocator reuses them
// only after the work queued on the current stream, so kernels launched before may still use
// them.
class Scratch {
 public:
  Scratch() = default;
  Scratch(int64_t n, bool zeroed);
  float* data() const { return data_; }

 private:
  std::shared_ptr<void> owner_;  // the tensor
  float* data_ = nullptr;
};

}  // namespace tc
}  // namespace adaattn
