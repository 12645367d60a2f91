// Argument checks and CPU-op helpers shared by every op family (ops/<family>/<family>.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

// The exception policy of the argument checks (the fake kernels, adaattn/_checks.py, raise the
// same): the message starts "adaattn.<op>: ", op being the public name of the op called (a
// `const char* op` in scope), and names the argument.
//   ADAATTN_CHECK_TYPE    TypeError     a wrong dtype
//   ADAATTN_CHECK_VALUE   ValueError    a wrong value, shape or layout
//   ADAATTN_CHECK_DEVICE  RuntimeError  a device mismatch
#define ADAATTN_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, "adaattn.", op, ": ", __VA_ARGS__)
#define ADAATTN_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, "adaattn.", op, ": ", __VA_ARGS__)
#define ADAATTN_CHECK_DEVICE(cond, ...) TORCH_CHECK(cond, "adaattn.", op, ": ", __VA_ARGS__)

namespace adaattn {

inline bool is_low_precision(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// CPU kernels run in fp32/fp64; fp16/bf16 inputs are computed in fp32 and cast back.
inline at::Tensor cpu_compute(const at::Tensor& t) {
  return is_low_precision(t.scalar_type()) ? t.to(at::kFloat) : t;
}

// Whether the values of `t` are checked: always on the CPU; on CUDA (reading costs a device
// sync) only with ADAATTN_CHECK_INPUTS=1, the kernels clamping them otherwise. Never on a
// meta tensor, which has none.
bool check_values_of(const at::Tensor& t);

// A cu_seqlens tensor's form: int32 [N + 1] (N >= 0), contiguous, on q's device. Errors name it.
void check_cu_seqlens_tensor(const char* op, const at::Tensor& cu, const char* name,
                             const at::Tensor& q);

// Values of a cu_seqlens tensor (where check_values_of): starts at 0, non-decreasing, ends at
// `total` (the error says "must end at <total_desc><total>").
void check_cu_seqlens_values(const char* op, const at::Tensor& cu, const char* name,
                             int64_t total, const char* total_desc);

}  // namespace adaattn
