// sym_gram (sym_gram_checks.h): validation, the CPU kernel and its registration; the CUDA kernel
// is cuda/sym_gram.cu. G = q^T q + k^T k per batch entry, [N, D, D] float32, from float16 or
// bfloat16 rows with float32 accumulation: the matrix rank_plan decomposes (its k^T k + q^T q
// over a key head and the query heads that share it). G is exactly symmetric: both kernels
// compute the lower triangle and mirror it. The summation order differs between them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "../common/checks.h"
#include "sym_gram_checks.h"

namespace adaattn {

namespace {

void check_rows(const char* op, const char* name, const at::Tensor& x) {
  ADAATTN_CHECK_TYPE(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, name,
                     " must be float16 or bfloat16, got ", x.scalar_type());
  ADAATTN_CHECK_VALUE(x.dim() == 3, name, " must be [N, R, D], got shape ", x.sizes());
  ADAATTN_CHECK_VALUE(x.size(2) <= 1 || x.stride(2) == 1, name,
                      " must have contiguous rows (stride(2) == 1), got strides ", x.strides());
}

void check_row_layout(const char* op, const char* name, const at::Tensor& x) {
  ADAATTN_CHECK_VALUE(x.stride(1) % 8 == 0 && x.stride(0) % 8 == 0 &&
                          reinterpret_cast<std::uintptr_t>(x.data_ptr()) % 16 == 0,
                      name, " must have row and batch strides that are multiples of 8 and "
                      "16-byte aligned data; call .contiguous() on it (strides ", x.strides(), ")");
}

}  // namespace

void check_sym_gram_args(const at::Tensor& q, const at::Tensor& k) {
  constexpr const char* op = "sym_gram";
  check_rows(op, "q", q);
  check_rows(op, "k", k);
  ADAATTN_CHECK_TYPE(k.scalar_type() == q.scalar_type(), "k must have q's dtype ",
                     q.scalar_type(), ", got ", k.scalar_type());
  ADAATTN_CHECK_DEVICE(k.device() == q.device(), "k must be on q's device ", q.device(),
                       ", got ", k.device());
  ADAATTN_CHECK_VALUE(k.size(0) == q.size(0) && k.size(2) == q.size(2),
                      "q [N, Rq, D] and k [N, Rk, D] must agree in N and D, got shapes ",
                      q.sizes(), " and ", k.sizes());
  const int64_t d = q.size(2);
  ADAATTN_CHECK_VALUE(d >= 8 && d <= kGramMaxDim && d % 8 == 0,
                      "D = q.size(2) must be a multiple of 8 in [8, ", kGramMaxDim, "], got ", d);
  ADAATTN_CHECK_VALUE(q.size(0) <= std::numeric_limits<int>::max(),
                      "the batch N = q.size(0) must fit in int32, got ", q.size(0));
  check_row_layout(op, "q", q);
  check_row_layout(op, "k", k);
}

namespace {

at::Tensor sym_gram_cpu(const at::Tensor& q, const at::Tensor& k) {
  check_sym_gram_args(q, k);
  const at::Tensor qf = q.to(at::kFloat), kf = k.to(at::kFloat);
  const at::Tensor g = at::bmm(qf.mT(), qf) + at::bmm(kf.mT(), kf);
  const at::Tensor lower = g.tril();
  return lower + lower.tril(-1).mT();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adaattn, m) {
  m.def("sym_gram(Tensor q, Tensor k) -> Tensor");
}

TORCH_LIBRARY_IMPL(adaattn, CPU, m) {
  m.impl("sym_gram", &sym_gram_cpu);
}

}  // namespace adaattn
