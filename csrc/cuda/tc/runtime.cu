// runtime.h's functions, the one place of the tensor-core launchers that includes torch.
#include "runtime.h"

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

namespace adaattn {
namespace tc {

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

const cudaDeviceProp& current_device_properties() {
  return *at::cuda::getCurrentDeviceProperties();
}

void check_cuda(cudaError_t err) { C10_CUDA_CHECK(err); }

void check_launch() { C10_CUDA_KERNEL_LAUNCH_CHECK(); }

void grid_too_large(int64_t blocks) {
  TORCH_CHECK(false, "adaattn: problem too large for one launch (", blocks, " CTAs)");
}

Scratch::Scratch(int64_t n, bool zeroed) {
  const auto options =
      at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, c10::cuda::current_device());
  auto tensor = std::make_shared<at::Tensor>(zeroed ? at::zeros({n}, options)
                                                    : at::empty({n}, options));
  data_ = tensor->data_ptr<float>();
  owner_ = std::move(tensor);
}

}  // namespace tc
}  // namespace adaattn
