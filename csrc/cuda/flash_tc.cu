// Dispatch of the tensor-core kernels (flash and lazy) over dtype and head dims. The kernels
// themselves are instantiated in csrc/cuda/tc/inst/ (one file each, see tc/generate.py).
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../flash_api.h"
#include "../lazy_api.h"

namespace adaattn {
namespace tc {
template <typename T, int DK, int DV>
void run_flash_fwd(const AttnParams& p);
template <typename T, int DK, int DV>
void run_flash_bwd(const AttnParams& p);
template <typename T, int D>
void run_lazy_fwd(const AttnParams& p);
template <typename T, int D>
void run_lazy_bwd(const AttnParams& p);
}  // namespace tc

namespace {

using Launcher = void (*)(const AttnParams&);

// One tensor-core instantiation: (D, Dv) and its bf16 / fp16 launchers.
struct Kernel {
  int head_dim;
  int head_dim_v;
  Launcher bf16;
  Launcher fp16;
};

template <bool kBackward, int DK, int DV>
constexpr Kernel flash_kernel() {
  if constexpr (kBackward) {
    return {DK, DV, tc::run_flash_bwd<__nv_bfloat16, DK, DV>, tc::run_flash_bwd<__half, DK, DV>};
  } else {
    return {DK, DV, tc::run_flash_fwd<__nv_bfloat16, DK, DV>, tc::run_flash_fwd<__half, DK, DV>};
  }
}

// Keep in step with FLASH_DIMS in csrc/cuda/tc/generate.py.
template <bool kBackward>
constexpr Kernel kFlashKernels[] = {
    flash_kernel<kBackward, 64, 64>(),  flash_kernel<kBackward, 128, 128>(),
    flash_kernel<kBackward, 32, 64>(),  flash_kernel<kBackward, 32, 128>(),
    flash_kernel<kBackward, 64, 128>(),
};

const Kernel kLazyFwd[] = {
    {64, 64, tc::run_lazy_fwd<__nv_bfloat16, 64>, tc::run_lazy_fwd<__half, 64>},
    {128, 128, tc::run_lazy_fwd<__nv_bfloat16, 128>, tc::run_lazy_fwd<__half, 128>},
};
const Kernel kLazyBwd[] = {
    {64, 64, tc::run_lazy_bwd<__nv_bfloat16, 64>, tc::run_lazy_bwd<__half, 64>},
    {128, 128, tc::run_lazy_bwd<__nv_bfloat16, 128>, tc::run_lazy_bwd<__half, 128>},
};

template <size_t N>
const Kernel* find(const Kernel (&kernels)[N], int head_dim, int head_dim_v) {
  for (const Kernel& k : kernels) {
    if (k.head_dim == head_dim && k.head_dim_v == head_dim_v) return &k;
  }
  return nullptr;
}

template <size_t N>
void dispatch(const AttnParams& p, c10::ScalarType dtype, const Kernel (&kernels)[N]) {
  const Kernel* kernel = find(kernels, p.head_dim, p.head_dim_v);
  TORCH_CHECK(kernel != nullptr, "adaattn: head dims (D, Dv) = (", p.head_dim, ", ",
              p.head_dim_v, ") have no tensor-core kernel; supported: ", tc_head_dims());
  const bool bf16 = dtype == c10::kBFloat16;
  TORCH_CHECK(bf16 || dtype == c10::kHalf,
              "adaattn: tensor-core kernels take float16 or bfloat16, got ", dtype);
  (bf16 ? kernel->bf16 : kernel->fp16)(p);
}

}  // namespace

const char* tc_head_dims() {
  return "(64, 64), (128, 128); flash attention also (32, 64), (32, 128), (64, 128); other "
         "D, Dv <= 128 run zero-padded to the smallest of these that covers them";
}

std::pair<int, int> tc_kernel_head_dims(int head_dim, int head_dim_v, bool lazy) {
  std::pair<int, int> best{0, 0};
  auto consider = [&](const Kernel& k) {
    if (k.head_dim < head_dim || k.head_dim_v < head_dim_v) return;
    if (best.first == 0 || k.head_dim + k.head_dim_v < best.first + best.second) {
      best = {k.head_dim, k.head_dim_v};
    }
  };
  if (lazy) {
    for (const Kernel& k : kLazyFwd) consider(k);
  } else {
    for (const Kernel& k : kFlashKernels<false>) consider(k);
  }
  return best;
}

void flash_fwd_tc_cuda(const AttnParams& p, c10::ScalarType dtype) {
  dispatch(p, dtype, kFlashKernels<false>);
}

void flash_bwd_tc_cuda(const AttnParams& p, c10::ScalarType dtype) {
  dispatch(p, dtype, kFlashKernels<true>);
}

void lazy_fwd_tc_cuda(const AttnParams& p, c10::ScalarType dtype) { dispatch(p, dtype, kLazyFwd); }

void lazy_bwd_tc_cuda(const AttnParams& p, c10::ScalarType dtype) { dispatch(p, dtype, kLazyBwd); }

}  // namespace adaattn
