// sym_eig, the batched symmetric eigensolver for small matrices (tridiagonalisation, multisection
// and inverse iteration, see core/sym_eig.h): validation and output allocation shared by the CPU (sym_eig.cpp) and CUDA
// (cuda/sym_eig.cu) kernels.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace adaattn {

// a: float32 [N, D, D], contiguous, 1 <= D <= kSymEigMaxDim; errors name `op` (sym_eig or
// sym_eig_top) and the argument (ops/common/checks.h).
void check_sym_eig_input(const char* op, const at::Tensor& a);

// sym_eig_top's energy in (0, 1], min_rank and multiple >= 1.
void check_sym_eig_top_args(double energy, int64_t min_rank, int64_t multiple);

// (eigenvalues float32 [N, D], eigenvectors float32 [N, D, D]) on a's device.
std::tuple<at::Tensor, at::Tensor> sym_eig_outputs(const at::Tensor& a);

}  // namespace adaattn
