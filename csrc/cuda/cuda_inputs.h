// Input preparation shared by the CUDA op registrations: which path a dtype takes, alignment of
// tensor-core operands and the head-dim check.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "../flash_api.h"

namespace adaattn {

inline bool use_tensor_cores(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// cp.async moves 16-byte chunks: base pointers and every stride but the last dim's must be
// multiples of 8 elements. Other layouts are copied once (rare: odd strides or a misaligned
// storage offset).
inline at::Tensor tc_aligned(const at::Tensor& t) {
  auto ok = [](const at::Tensor& x) {
    if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) return false;
    for (int64_t d = 0; d + 1 < x.dim(); ++d) {
      if (x.stride(d) % 8 != 0) return false;
    }
    return true;
  };
  if (ok(t)) return t;
  at::Tensor c = t.contiguous();
  return ok(c) ? c : c.clone();
}

inline void check_cuda_head_dims(const at::Tensor& q, const at::Tensor& v) {
  if (use_tensor_cores(q.scalar_type())) {
    TORCH_CHECK(tc_supports_head_dims(static_cast<int>(q.size(-1)), static_cast<int>(v.size(-1))),
                "adaattn: head dims D = q.size(-1) = ", q.size(-1), ", Dv = v.size(-1) = ",
                v.size(-1), " are not supported for ", q.scalar_type(), " on CUDA; supported ",
                "(D, Dv): ", tc_head_dims(), " (float32/float64 accept any D, Dv <= 256)");
  }
}

}  // namespace adaattn
