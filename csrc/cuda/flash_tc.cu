// Dispatch of the tensor-core kernels (flash and lazy) over dtype and head dim. The kernels
// themselves are instantiated in csrc/cuda/tc/inst/ (one file each).
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../flash_api.h"
#include "../lazy_api.h"

namespace adaattn {
namespace tc {
template <typename T, int D>
void run_flash_fwd(const AttnParams& p);
template <typename T, int D>
void run_flash_bwd(const AttnParams& p);
template <typename T, int D>
void run_lazy_fwd(const AttnParams& p);
template <typename T, int D>
void run_lazy_bwd(const AttnParams& p);
}  // namespace tc

bool tc_supports_head_dim(int head_dim) { return head_dim == 64 || head_dim == 128; }

const char* tc_head_dims() { return "{64, 128}"; }

namespace {

using Launcher = void (*)(const AttnParams&);

// Picks the instantiation of `launchers` ({bf16 D64, bf16 D128, fp16 D64, fp16 D128}).
void dispatch(const AttnParams& p, c10::ScalarType dtype, const Launcher (&launchers)[4]) {
  TORCH_CHECK(tc_supports_head_dim(p.head_dim), "adaattn: head dim ", p.head_dim,
              " has no tensor-core kernel; supported: ", tc_head_dims());
  const bool bf16 = dtype == c10::kBFloat16;
  TORCH_CHECK(bf16 || dtype == c10::kHalf,
              "adaattn: tensor-core kernels take float16 or bfloat16, got ", dtype);
  // Work per tile is uniform unless exactly one side of the window is bounded (causal).
  AttnParams ordered = p;
  ordered.head_major = (p.window_left < 0) == (p.window_right < 0);
  launchers[(bf16 ? 0 : 2) + (p.head_dim == 128 ? 1 : 0)](ordered);
}

}  // namespace

void flash_fwd_tc_cuda(const AttnParams& p, c10::ScalarType dtype) {
  dispatch(p, dtype,
           {tc::run_flash_fwd<__nv_bfloat16, 64>, tc::run_flash_fwd<__nv_bfloat16, 128>,
            tc::run_flash_fwd<__half, 64>, tc::run_flash_fwd<__half, 128>});
}

void flash_bwd_tc_cuda(const AttnParams& p, c10::ScalarType dtype) {
  dispatch(p, dtype,
           {tc::run_flash_bwd<__nv_bfloat16, 64>, tc::run_flash_bwd<__nv_bfloat16, 128>,
            tc::run_flash_bwd<__half, 64>, tc::run_flash_bwd<__half, 128>});
}

void lazy_fwd_tc_cuda(const AttnParams& p, c10::ScalarType dtype) {
  dispatch(p, dtype,
           {tc::run_lazy_fwd<__nv_bfloat16, 64>, tc::run_lazy_fwd<__nv_bfloat16, 128>,
            tc::run_lazy_fwd<__half, 64>, tc::run_lazy_fwd<__half, 128>});
}

void lazy_bwd_tc_cuda(const AttnParams& p, c10::ScalarType dtype) {
  dispatch(p, dtype,
           {tc::run_lazy_bwd<__nv_bfloat16, 64>, tc::run_lazy_bwd<__nv_bfloat16, 128>,
            tc::run_lazy_bwd<__half, 64>, tc::run_lazy_bwd<__half, 128>});
}

}  // namespace adaattn
