// Dispatch of the tensor-core kernels over variant, dtype and head dims, from the generated
// table of instantiations (tc/generate.py writes tc/inst/table.inc and one .cu per entry).
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <array>
#include <string>

#include "../attention_api.h"

namespace adaattn {
namespace tc {
template <typename T, int DK, int DV, typename Variant>
void run_fwd(const AttnParams& p);
template <typename T, int DK, int DV, typename Variant>
void run_bwd(const AttnParams& p);
}  // namespace tc

namespace {

using Launcher = void (*)(const AttnParams&);

// One compiled (variant, D, Dv) and its launchers per pass and dtype.
struct Kernel {
  VariantId variant;
  int head_dim;
  int head_dim_v;
  Launcher fwd_bf16, fwd_fp16, bwd_bf16, bwd_fp16;
};

#define ADAATTN_TC_KERNEL(ID, VARIANT, DK, DV)                                          \
  {VariantId::ID, DK, DV, tc::run_fwd<__nv_bfloat16, DK, DV, VARIANT>,                   \
   tc::run_fwd<__half, DK, DV, VARIANT>, tc::run_bwd<__nv_bfloat16, DK, DV, VARIANT>, \
   tc::run_bwd<__half, DK, DV, VARIANT>},
const Kernel kKernels[] = {
#include "tc/inst/table.inc"
};
#undef ADAATTN_TC_KERNEL

const Kernel* find(VariantId variant, int head_dim, int head_dim_v) {
  for (const Kernel& k : kKernels) {
    if (k.variant == variant && k.head_dim == head_dim && k.head_dim_v == head_dim_v) return &k;
  }
  return nullptr;
}

// The kernels of (D, Dv), or, where tc_masks_head_dims, those of the smallest compiled pair that
// covers them: they read the columns past the caller's as zeros and write only the caller's
// (the loads and stores take p.head_dim, p.head_dim_v).
const Kernel* find_covering(VariantId variant, int head_dim, int head_dim_v) {
  if (const Kernel* exact = find(variant, head_dim, head_dim_v)) return exact;
  if (!tc_masks_head_dims(variant, head_dim, head_dim_v)) return nullptr;
  const std::pair<int, int> cover = tc_kernel_head_dims(variant, head_dim, head_dim_v);
  return find(variant, cover.first, cover.second);
}

void dispatch(VariantId variant, const AttnParams& p, c10::ScalarType dtype, bool backward) {
  const Kernel* kernel = find_covering(variant, p.head_dim, p.head_dim_v);
  TORCH_CHECK(kernel != nullptr, "adaattn: head dims (D, Dv) = (", p.head_dim, ", ",
              p.head_dim_v, ") have no tensor-core kernel; supported: ", tc_head_dims(variant));
  const bool bf16 = dtype == c10::kBFloat16;
  TORCH_CHECK(bf16 || dtype == c10::kHalf,
              "adaattn: tensor-core kernels take float16 or bfloat16, got ", dtype);
  const Launcher run = backward ? (bf16 ? kernel->bwd_bf16 : kernel->bwd_fp16)
                                : (bf16 ? kernel->fwd_bf16 : kernel->fwd_fp16);
  run(p);
}

}  // namespace

const char* tc_head_dims(VariantId variant) {
  // "(64, 64), (128, 128), ...; other ...", built on first use (thread-safe statics).
  auto describe = [](VariantId id) {
    std::string s;
    for (const Kernel& k : kKernels) {
      if (k.variant != id) continue;
      if (!s.empty()) s += ", ";
      s += "(" + std::to_string(k.head_dim) + ", " + std::to_string(k.head_dim_v) + ")";
    }
    return s + "; other D, Dv <= 256 run on the smallest of these that covers them";
  };
  static const auto texts = [&] {
    std::array<std::string, static_cast<int>(VariantId::kCount)> t;
    for (size_t i = 0; i < t.size(); ++i) t[i] = describe(static_cast<VariantId>(i));
    return t;
  }();
  return texts[static_cast<int>(variant)].c_str();
}

std::pair<int, int> tc_kernel_head_dims(VariantId variant, int head_dim, int head_dim_v) {
  std::pair<int, int> best{0, 0};
  for (const Kernel& k : kKernels) {
    if (k.variant != variant || k.head_dim < head_dim || k.head_dim_v < head_dim_v) continue;
    if (best.first == 0 || k.head_dim + k.head_dim_v < best.first + best.second) {
      best = {k.head_dim, k.head_dim_v};
    }
  }
  return best;
}

bool tc_masks_head_dims(VariantId variant, int head_dim, int head_dim_v) {
  if (head_dim % 8 != 0 || head_dim_v % 8 != 0) return false;
  const std::pair<int, int> cover = tc_kernel_head_dims(variant, head_dim, head_dim_v);
  return cover.first > 0 && cover.first <= 128 && cover.second <= 128;
}

void attention_fwd_tc_cuda(VariantId variant, const AttnParams& p, c10::ScalarType dtype) {
  dispatch(variant, p, dtype, false);
}

void attention_bwd_tc_cuda(VariantId variant, const AttnParams& p, c10::ScalarType dtype) {
  dispatch(variant, p, dtype, true);
}

}  // namespace adaattn
