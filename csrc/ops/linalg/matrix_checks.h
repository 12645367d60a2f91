// The input check shared by the ops on batches of small matrices (shifted_cholesky_info,
// sym_sketch_top): their CPU and CUDA kernels index a float32 [N, D, D] batch with int32 N.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>

#include "../common/checks.h"

namespace adaattn {

// a: float32 [N, D, D], contiguous, N within int32, D >= 1 and, when max_dim > 0, D <= max_dim.
// Errors name `op` and `a`.
inline void check_matrix_batch(const char* op, const at::Tensor& a, int64_t max_dim) {
  ADAATTN_CHECK_TYPE(a.scalar_type() == at::kFloat, "a must be float32, got ", a.scalar_type());
  ADAATTN_CHECK_VALUE(a.dim() == 3 && a.size(1) == a.size(2), "a must be [N, D, D], got shape ",
                      a.sizes());
  if (max_dim > 0) {
    ADAATTN_CHECK_VALUE(a.size(1) >= 1 && a.size(1) <= max_dim, "D = a.size(1) must be in [1, ",
                        max_dim, "], got ", a.size(1));
  } else {
    ADAATTN_CHECK_VALUE(a.size(1) >= 1, "D = a.size(1) must be >= 1");
  }
  ADAATTN_CHECK_VALUE(a.size(0) <= std::numeric_limits<int>::max(),
                      "the batch N = a.size(0) must fit in int32, got ", a.size(0));
  ADAATTN_CHECK_VALUE(a.is_contiguous(), "a must be contiguous; call .contiguous() on it");
}

}  // namespace adaattn
