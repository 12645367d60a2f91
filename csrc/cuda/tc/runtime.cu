// runtime.h's functions, the one place of the tensor-core launchers that includes torch.
#include "runtime.h"

#include <cudaTypedefs.h>

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include "tma.h"

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

namespace {

// The driver's tensor-map encoder, looked up once (no link against libcuda); null where the
// driver has none.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return PFN_cuTensorMapEncodeTiled_v12000{nullptr};
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encoder;
}

}  // namespace

bool encode_operand_map(CUtensorMap* map, const void* base, bool bf16, int64_t cols, int64_t rows,
                        int64_t heads, int64_t batch, int64_t row_stride, int64_t head_stride,
                        int64_t batch_stride, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || cols < 1 || rows < 1 || heads < 1 || batch < 1) return false;
  // A dimension of one entry is never stepped over: any valid stride describes it.
  if (heads == 1) head_stride = row_stride * rows;
  if (batch == 1) batch_stride = head_stride * heads;
  constexpr int64_t kElem = 2;
  const int64_t strides[3] = {row_stride * kElem, head_stride * kElem, batch_stride * kElem};
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  for (const int64_t stride : strides) {
    if (stride <= 0 || stride % 16 != 0 || stride >= (int64_t{1} << 40)) return false;
  }
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t byte_strides[3] = {static_cast<cuuint64_t>(strides[0]),
                                      static_cast<cuuint64_t>(strides[1]),
                                      static_cast<cuuint64_t>(strides[2])};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                const_cast<void*>(base), dims, byte_strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
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
