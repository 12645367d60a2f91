// Entry points of the tensor-core linear attention (linear_api.h): dtype dispatch to the
// instantiations in linear_tc_{bf16,fp16}_{fwd,bwd}.cu. Design in tc/linear_kernels.h.
#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../linear_api.h"
#include "tc/linear_launch.h"

namespace adaattn {
namespace tc {
namespace lin {

// Instantiated in linear_tc_{bf16,fp16}_{fwd,bwd}.cu.
extern template void run_linear<__nv_bfloat16, false>(const LinearParams& p);
extern template void run_linear<__nv_bfloat16, true>(const LinearParams& p);
extern template void run_linear<__half, false>(const LinearParams& p);
extern template void run_linear<__half, true>(const LinearParams& p);
}  // namespace lin
}  // namespace tc

namespace {

template <bool kBwd>
void dispatch(const LinearParams& p, c10::ScalarType dtype, const char* name) {
  TORCH_CHECK(linear_tc_supports(dtype, p.dim, p.dim_v), "adaattn: ", name,
              " takes float16/bfloat16 with D, Dv in {64, 128}, got ", dtype, ", D = ", p.dim,
              ", Dv = ", p.dim_v);
  if (dtype == at::kBFloat16) {
    tc::lin::run_linear<__nv_bfloat16, kBwd>(p);
  } else {
    tc::lin::run_linear<__half, kBwd>(p);
  }
}

}  // namespace

void linear_fwd_tc_cuda(const LinearParams& p, c10::ScalarType dtype) {
  dispatch<false>(p, dtype, "linear_fwd_tc_cuda");
}

void linear_bwd_tc_cuda(const LinearParams& p, c10::ScalarType dtype) {
  dispatch<true>(p, dtype, "linear_bwd_tc_cuda");
}

}  // namespace adaattn
