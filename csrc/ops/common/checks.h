// Argument checks and CPU-op helpers shared by every op family (ops/<family>/<family>.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace adaattn {

inline bool is_low_precision(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// CPU kernels run in fp32/fp64; fp16/bf16 inputs are computed in fp32 and cast back.
inline at::Tensor cpu_compute(const at::Tensor& t) {
  return is_low_precision(t.scalar_type()) ? t.to(at::kFloat) : t;
}

// A cu_seqlens tensor's form: int32 [N + 1] (N >= 0), contiguous, on q's device. Errors name it.
void check_cu_seqlens_tensor(const at::Tensor& cu, const char* name, const at::Tensor& q);

// Values of a cu_seqlens tensor: starts at 0, non-decreasing, ends at `total` (the error says
// "must end at <total_desc><total>"). Reading a CUDA one synchronises, so it is checked there
// only on request (ADAATTN_CHECK_INPUTS=1). The kernels clamp it either way.
void check_cu_seqlens_values(const at::Tensor& cu, const char* name, int64_t total,
                             const char* total_desc);

}  // namespace adaattn
