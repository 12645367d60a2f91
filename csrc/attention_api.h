// Launchers of the attention core, one per device path, each over the compiled variants
// (variants/table.h). Each takes fully validated parameters whose outputs are allocated and
// writes every output element: forward out and lse (and p.stats when the variant counts and it
// is non-null); backward dq, dk, dv and, where asked, the variant's parameter gradients.
#pragma once

#include <c10/core/ScalarType.h>

#include <utility>

#include "core/params.h"
#include "variants/table.h"

namespace adaattn {

// CPU, fp32 or fp64 (the ops upcast fp16/bf16). Tiled, O(L) extra memory, parallel over
// batch x heads. With block lists set, only the listed blocks are visited (block sizes must be
// multiples of the 64-row CPU tile).
void attention_fwd_cpu(VariantId variant, const AttnParams& p, c10::ScalarType dtype);
void attention_bwd_cpu(VariantId variant, const AttnParams& p, c10::ScalarType dtype);

#ifdef ADAATTN_WITH_CUDA
// CUDA exact path, fp32 or fp64 scalar arithmetic (validation and gradcheck). Current stream.
void attention_fwd_exact_cuda(VariantId variant, const AttnParams& p, c10::ScalarType dtype);
void attention_bwd_exact_cuda(VariantId variant, const AttnParams& p, c10::ScalarType dtype);

// CUDA tensor-core path, fp16 or bf16 with fp32 accumulation. Current stream.
void attention_fwd_tc_cuda(VariantId variant, const AttnParams& p, c10::ScalarType dtype);
void attention_bwd_tc_cuda(VariantId variant, const AttnParams& p, c10::ScalarType dtype);
// The (D, Dv) pairs with a tensor-core kernel for `variant`, for error messages.
const char* tc_head_dims(VariantId variant);
// The compiled pair (D', Dv') >= (D, Dv) of `variant` with the least work per score
// (D' + Dv'): the pair itself where it is compiled, else the one other head dims run on
// zero-padded; {0, 0} when none covers them.
std::pair<int, int> tc_kernel_head_dims(VariantId variant, int head_dim, int head_dim_v);
#endif

}  // namespace adaattn
