// Launchers of the flash family, one per device path. Each takes fully validated parameters
// (see ops.cpp) whose outputs are allocated; it writes every output element.
#pragma once

#include <c10/core/ScalarType.h>

#include <utility>

#include "core/params.h"

namespace adaattn {

// CPU, fp32 or fp64 (ops.cpp upcasts fp16/bf16). Tiled, O(L) extra memory, parallel over
// batch x heads. Forward writes out and lse; backward reads out and dout (it recomputes the
// row statistics in T) and writes dq, dk, dv. With AttnParams' block-sparse section set, both
// visit only the listed blocks (block sizes must be multiples of the 64-row CPU tile).
void flash_fwd_cpu(const AttnParams& p, c10::ScalarType dtype);
void flash_bwd_cpu(const AttnParams& p, c10::ScalarType dtype);

#ifdef ADAATTN_WITH_CUDA
// CUDA exact path, fp32 or fp64 scalar arithmetic (validation and gradcheck). Current stream.
void flash_fwd_exact_cuda(const AttnParams& p, c10::ScalarType dtype);
void flash_bwd_exact_cuda(const AttnParams& p, c10::ScalarType dtype);

// CUDA tensor-core path, fp16 or bf16 with fp32 accumulation, head dims in tc_head_dims().
// Current stream.
void flash_fwd_tc_cuda(const AttnParams& p, c10::ScalarType dtype);
void flash_bwd_tc_cuda(const AttnParams& p, c10::ScalarType dtype);
// (D, Dv) pairs with a tensor-core kernel: D == Dv in {64, 128} for every family; the flash
// family also takes the narrower query/key widths of low-rank attention (D < Dv).
const char* tc_head_dims();  // the supported pairs, for error messages
// The compiled pair (D', Dv') >= (D, Dv) with the least work per score (D' + Dv'): the pair
// itself where it is compiled, else the one other head dims run on zero-padded; {0, 0} when
// none covers them. `lazy`: the lazy family's pairs.
std::pair<int, int> tc_kernel_head_dims(int head_dim, int head_dim_v, bool lazy);
#endif

}  // namespace adaattn
