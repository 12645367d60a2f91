// sym_gram: q^T q + k^T k per batch entry, the Gram matrix rank_plan decomposes. Validation
// shared by the CPU kernel (sym_gram.cpp) and the CUDA kernel (cuda/sym_gram.cu).
#pragma once

#include <ATen/ATen.h>

namespace adaattn {

// Largest head dim D of sym_gram (the CUDA kernel keeps a D x D float32 accumulator per CTA).
constexpr int kGramMaxDim = 128;

// q [N, Rq, D], k [N, Rk, D]: float16 or bfloat16, one dtype and device, D a multiple of 8 in
// [8, kGramMaxDim], N within int32; each row contiguous, row and batch strides multiples of 8
// elements and the data 16-byte aligned (rows are copied in 16-byte pieces).
void check_sym_gram_args(const at::Tensor& q, const at::Tensor& k);

}  // namespace adaattn
