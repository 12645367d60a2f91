// shifted_cholesky_info: whether each matrix of a batch minus a multiple of its trace times the
// identity has a float32 Cholesky factorisation, LAPACK's `info` convention. adaptive_rank_attn
// uses it as the certificate that every eigenvalue exceeds the shift (rank_plan would keep every
// direction), in one kernel instead of torch's shift, cuSOLVER factorisation and reductions.
// Validation shared by the CPU kernel (cholesky.cpp) and the CUDA kernel (cuda/cholesky.cu).
#pragma once

#include <ATen/ATen.h>

namespace adaattn {

// a: float32 [N, D, D], contiguous, D >= 1, N within int32; rel_shift finite.
void check_shifted_cholesky_input(const at::Tensor& a, double rel_shift);

}  // namespace adaattn
