// sym_sketch_top: the top invariant subspace of a batch of small symmetric positive
// semi-definite matrices by randomized subspace iteration, sized by the energy rule of rank_plan.
// Validation and outputs shared by the CPU kernel (sym_sketch.cpp, which states the algorithm)
// and the CUDA kernel (cuda/sym_sketch.cu).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace adaattn {

// Largest D and sketch width P the kernels take (the CUDA kernel keeps A, two D x P blocks and
// a P x P float64 block in one CTA's shared memory).
constexpr int kSketchMaxDim = 128;
constexpr int kSketchMaxWidth = 64;

// a: float32 [N, D, D] contiguous, 1 <= D <= kSketchMaxDim; omega: float32 [D, P] contiguous
// on a's device, 1 <= P <= min(D, kSketchMaxWidth); energy in (0, 1]; min_rank, multiple >= 1;
// power_iters in [0, 8], oversample >= 0, rel_shift finite and >= 0.
void check_sym_sketch_args(const at::Tensor& a, const at::Tensor& omega, double energy,
                           int64_t min_rank, int64_t multiple, int64_t power_iters,
                           int64_t oversample, double rel_shift);

// (values float32 [N, D], basis float32 [N, D, P], ranks int32 [N], decided bool [N],
// summary int32 [3] zeroed: the largest rank, the undecided matrices, the matrices whose trace is
// not finite).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sym_sketch_outputs(
    const at::Tensor& a, const at::Tensor& omega);

}  // namespace adaattn
