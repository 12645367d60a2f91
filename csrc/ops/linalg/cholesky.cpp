// shifted_cholesky_info (cholesky_checks.h): validation, the CPU kernel and its registration; the
// CUDA kernel is cuda/cholesky.cu.
//
// For each matrix A (its lower triangle is read): t = rel_shift * trace(A) (summed in order, in
// float32), then the right-looking Cholesky factorisation of A - t I in float32. info = 0 when
// every pivot is positive, else the 1-based index of the first pivot that is not (NaN included),
// as LAPACK's potrf. Both kernels take the same steps in float32; their rounding can differ
// (the GPU contracts multiply-adds), so their info can differ only on pivots within rounding of 0.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "../common/checks.h"
#include "cholesky_checks.h"
#include "matrix_checks.h"

namespace adaattn {

void check_shifted_cholesky_input(const at::Tensor& a, double rel_shift) {
  constexpr const char* op = "shifted_cholesky_info";
  check_matrix_batch(op, a, 0);
  ADAATTN_CHECK_VALUE(std::isfinite(rel_shift), "rel_shift must be finite, got ", rel_shift);
}

namespace {

int shifted_cholesky_matrix(const float* a, int n, float rel_shift, std::vector<float>& l) {
  float trace = 0.f;
  for (int i = 0; i < n; ++i) trace += a[i * n + i];
  const float shift = rel_shift * trace;
  for (int i = 0; i < n; ++i) {
    for (int k = 0; k <= i; ++k) l[i * n + k] = a[i * n + k] - (i == k ? shift : 0.f);
  }
  for (int j = 0; j < n; ++j) {
    const float d = l[j * n + j];
    if (!(d > 0.f)) return j + 1;
    const float inv = 1.f / std::sqrt(d);
    for (int i = j + 1; i < n; ++i) l[i * n + j] *= inv;
    for (int i = j + 1; i < n; ++i) {
      const float li = l[i * n + j];
      for (int k = j + 1; k <= i; ++k) l[i * n + k] -= li * l[k * n + j];
    }
  }
  return 0;
}

at::Tensor shifted_cholesky_info_cpu(const at::Tensor& a, double rel_shift) {
  check_shifted_cholesky_input(a, rel_shift);
  const int64_t batch = a.size(0);
  const int n = static_cast<int>(a.size(1));
  at::Tensor info = at::empty({batch}, a.options().dtype(at::kInt));
  const float* src = a.data_ptr<float>();
  int* dst = info.data_ptr<int>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> l(static_cast<size_t>(n) * n);
    for (int64_t m = begin; m < end; ++m) {
      dst[m] = shifted_cholesky_matrix(src + m * n * n, n, static_cast<float>(rel_shift), l);
    }
  });
  return info;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adaattn, m) {
  m.def("shifted_cholesky_info(Tensor a, float rel_shift) -> Tensor");
}

TORCH_LIBRARY_IMPL(adaattn, CPU, m) {
  m.impl("shifted_cholesky_info", &shifted_cholesky_info_cpu);
}

}  // namespace adaattn
