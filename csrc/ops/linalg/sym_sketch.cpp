// sym_sketch_top (sym_sketch_checks.h): validation, the CPU kernel and its registration; the CUDA
// kernel is cuda/sym_sketch.cu. rank_plan(method="sketch") runs it on float32 Gram matrices.
//
// The algorithm, per matrix A [D, D] (its lower triangle is read) with the test matrix
// Omega [D, P]:
//   1. t = trace(A) (float64), s = rel_shift t / D: the shift (rank_plan: 1e-3) bounds
//      cond(A + s I) by ~D / rel_shift, so that the Cholesky QR passes below stay accurate on
//      rank-deficient A. It does not change the subspace iteration's limit.
//   2. Y = (A + s I) Omega; power_iters times Y = (A + s I) orth(Y); Q = orth32(orth(Y)).
//      Products in float32 (the sum over k in order); orth's Gram matrix and Cholesky factor in
//      float64, its substitution in float32 (it preserves the span; on the tests' spectra the
//      kept subspaces move by ~1e-5 at most against a float64 substitution):
//      orth(Y) = Y L^-T with L L^T = Y^T Y + c I, c = 11 (D P + P (P + 1)) eps64 trace(Y^T Y)
//      (right-looking Cholesky; a pivot <= 0 gives a zero column). The shift leaves orth(Y)
//      orthonormal only to ~1e-3; orth32, the same in float32 without the shift, then makes it
//      so to float32 precision (its input is that well conditioned).
//   3. values_j = max(q_j^T A q_j, 0), the Rayleigh quotients of the orthonormal columns.
//   4. The rank: with c_j = values_0 + ... + values_j, first = P + 1 - #{j : c_j >= energy t},
//      r = max(first, min_rank) rounded up to a multiple of `multiple`; decided = r +
//      oversample <= P and t > 0; r = min(r, P).
//   5. basis: Q with columns r.. set to 0; values [D]: the P quotients, then the rest of the
//      trace, max(t - sum values, 0), spread evenly over the other D - P entries.
//   6. summary (over the batch): the largest r, the number of matrices not decided, the number
//      whose t is not finite (exactly those with a NaN or inf entry: a non-finite entry reaches
//      the diagonal through the Gram step, and Cauchy-Schwarz bounds the rest by it), so that
//      rank_plan reads one small tensor.
// Cholesky QR keeps the columns nested (span(q_0..q_j) = span(y_0..y_j)), so span(q_0..q_j)
// is the subspace iteration of Omega's first j + 1 columns and tends to the top j + 1
// eigenvectors. By Ky Fan's maximum principle c_j never exceeds the sum of the j + 1 largest
// eigenvalues: r is never below the exact rule's rank (sym_eig_top's), and the kept columns hold
// c_{r-1} >= energy t of the trace exactly (to rounding). No Rayleigh-Ritz eigensolve: the
// columns are not eigenvectors, only an orthonormal basis of the kept subspace.
//
// The CPU kernel takes the CUDA kernel's steps in the same precisions, one matrix per task of
// at::parallel_for; the order of the float64 sums differs (the CUDA kernel splits them).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/checks.h"
#include "matrix_checks.h"
#include "sym_sketch_checks.h"

namespace adaattn {

void check_sym_sketch_args(const at::Tensor& a, const at::Tensor& omega, double energy,
                           int64_t min_rank, int64_t multiple, int64_t power_iters,
                           int64_t oversample, double rel_shift) {
  constexpr const char* op = "sym_sketch_top";
  check_matrix_batch(op, a, kSketchMaxDim);
  ADAATTN_CHECK_TYPE(omega.scalar_type() == at::kFloat, "omega must be float32, got ",
                     omega.scalar_type());
  ADAATTN_CHECK_VALUE(omega.dim() == 2 && omega.size(0) == a.size(1),
                      "omega must be [D, P] with D = ", a.size(1), ", got shape ", omega.sizes());
  ADAATTN_CHECK_VALUE(omega.size(1) >= 1 && omega.size(1) <= std::min<int64_t>(a.size(1),
                                                                             kSketchMaxWidth),
                      "P = omega.size(1) must be in [1, min(D, ", kSketchMaxWidth, ")], got ",
                      omega.size(1));
  ADAATTN_CHECK_VALUE(omega.is_contiguous(), "omega must be contiguous");
  ADAATTN_CHECK_DEVICE(omega.device() == a.device(), "omega must be on a's device ", a.device(),
                       ", got ", omega.device());
  ADAATTN_CHECK_VALUE(energy > 0.0 && energy <= 1.0, "energy must be in (0, 1], got ", energy);
  ADAATTN_CHECK_VALUE(min_rank >= 1 && multiple >= 1,
                      "min_rank and multiple must be positive, got ", min_rank, ", ", multiple);
  ADAATTN_CHECK_VALUE(power_iters >= 0 && power_iters <= 8,
                      "power_iters must be in [0, 8], got ", power_iters);
  ADAATTN_CHECK_VALUE(oversample >= 0, "oversample must be >= 0, got ", oversample);
  ADAATTN_CHECK_VALUE(std::isfinite(rel_shift) && rel_shift >= 0.0,
                      "rel_shift must be finite and >= 0, got ", rel_shift);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sym_sketch_outputs(
    const at::Tensor& a, const at::Tensor& omega) {
  const int64_t batch = a.size(0), dim = a.size(1), width = omega.size(1);
  return {at::empty({batch, dim}, a.options()), at::empty({batch, dim, width}, a.options()),
          at::empty({batch}, a.options().dtype(at::kInt)),
          at::empty({batch}, a.options().dtype(at::kBool)),
          at::zeros({3}, a.options().dtype(at::kInt))};
}

namespace {

struct SketchRule {
  double energy, rel_shift;
  int min_rank, multiple, power_iters, oversample;
};

// y = (A + shift I) x for x, y [n, p] (row-major), the sum over k in order.
void shifted_product(const std::vector<float>& A, const std::vector<float>& x,
                     std::vector<float>& y, int n, int p, float shift) {
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < p; ++j) {
      float acc = 0.f;
      for (int k = 0; k < n; ++k) acc = std::fma(A[i * n + k], x[k * p + j], acc);
      y[i * p + j] = std::fma(shift, x[i * p + j], acc);
    }
  }
}

// y [n, p] <- y L^-T, L L^T = y^T y + c I (step 2 of the header): the Gram matrix and its
// factorisation in T (float64 with the shift, float32 without it: the last pass), the
// substitution in float32.
template <typename T>
void orth(std::vector<float>& y, int n, int p, std::vector<T>& w) {
  constexpr bool kShifted = std::is_same_v<T, double>;
  for (int r = 0; r < p; ++r) {
    for (int c = 0; c <= r; ++c) {
      T acc = 0;
      for (int i = 0; i < n; ++i) {
        acc = std::fma(static_cast<T>(y[i * p + r]), static_cast<T>(y[i * p + c]), acc);
      }
      w[r * p + c] = acc;
    }
  }
  if constexpr (kShifted) {
    double trace = 0.0;
    for (int j = 0; j < p; ++j) trace += w[j * p + j];
    const double shift =
        11.0 * (static_cast<double>(n) * p + p * (p + 1.0)) * DBL_EPSILON * trace;
    for (int j = 0; j < p; ++j) w[j * p + j] += shift;
  }
  std::vector<T> inv_sqrt(p);
  for (int j = 0; j < p; ++j) {
    const T d = w[j * p + j];
    const T inv = d > T(0) ? T(1) / d : T(0);
    inv_sqrt[j] = d > T(0) ? T(1) / std::sqrt(d) : T(0);
    for (int r = j + 1; r < p; ++r) {
      const T scaled = w[r * p + j] * inv;
      for (int c = j + 1; c <= r; ++c) w[r * p + c] -= scaled * w[c * p + j];
    }
  }
  // The substitution in float32 (as the CUDA kernel): L's columns and 1 / L_jj rounded once.
  std::vector<float> l(static_cast<size_t>(p) * p), inv32(p), row(p);
  for (int j = 0; j < p; ++j) {
    inv32[j] = static_cast<float>(inv_sqrt[j]);
    for (int r = j + 1; r < p; ++r) l[r * p + j] = static_cast<float>(w[r * p + j] * inv_sqrt[j]);
  }
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < p; ++j) row[j] = y[i * p + j];
    for (int j = 0; j < p; ++j) {
      const float q = row[j] * inv32[j];
      for (int r = j + 1; r < p; ++r) row[r] -= l[r * p + j] * q;
      y[i * p + j] = q;
    }
  }
}

void sketch_matrix(const float* a, const float* omega, int n, int p, const SketchRule& rule,
                   float* values, float* basis, int* rank, bool* decided) {
  std::vector<float> A(static_cast<size_t>(n) * n), x(static_cast<size_t>(n) * p),
      y(static_cast<size_t>(n) * p);
  std::vector<double> w(static_cast<size_t>(p) * p);
  std::vector<float> w32(static_cast<size_t>(p) * p);
  for (int i = 0; i < n; ++i) {
    for (int k = 0; k <= i; ++k) A[i * n + k] = A[k * n + i] = a[i * n + k];
  }
  double trace = 0.0;
  for (int i = 0; i < n; ++i) trace += A[i * n + i];
  const float shift = static_cast<float>(rule.rel_shift * trace / n);
  std::copy(omega, omega + n * p, x.begin());
  shifted_product(A, x, y, n, p, shift);
  for (int it = 0; it < rule.power_iters; ++it) {
    orth(y, n, p, w);
    shifted_product(A, y, x, n, p, shift);
    std::swap(x, y);
  }
  orth(y, n, p, w);
  orth(y, n, p, w32);
  shifted_product(A, y, x, n, p, 0.f);
  const double target = rule.energy * trace;
  double cum = 0.0;
  int reached = 0;
  for (int j = 0; j < p; ++j) {
    double dot = 0.0;
    for (int i = 0; i < n; ++i) {
      dot = std::fma(static_cast<double>(y[i * p + j]), static_cast<double>(x[i * p + j]), dot);
    }
    dot = std::max(dot, 0.0);
    cum += dot;
    reached += cum >= target;
    values[j] = static_cast<float>(dot);
  }
  const int first = std::max(p + 1 - reached, rule.min_rank);
  const int r = (first + rule.multiple - 1) / rule.multiple * rule.multiple;
  *decided = r + rule.oversample <= p && trace > 0.0;
  *rank = std::min(r, p);
  const float rest = n > p ? static_cast<float>(std::max(trace - cum, 0.0) / (n - p)) : 0.f;
  for (int j = p; j < n; ++j) values[j] = rest;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < p; ++j) basis[i * p + j] = j < *rank ? y[i * p + j] : 0.f;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sym_sketch_top_cpu(
    const at::Tensor& a, const at::Tensor& omega, double energy, int64_t min_rank,
    int64_t multiple, int64_t power_iters, int64_t oversample, double rel_shift) {
  check_sym_sketch_args(a, omega, energy, min_rank, multiple, power_iters, oversample, rel_shift);
  auto [values, basis, ranks, decided, summary] = sym_sketch_outputs(a, omega);
  const int n = static_cast<int>(a.size(1)), p = static_cast<int>(omega.size(1));
  // min_rank and multiple past D act as D (the rank is capped at P <= D either way).
  const SketchRule rule{energy, rel_shift, static_cast<int>(std::min<int64_t>(min_rank, n + 1)),
                        static_cast<int>(std::min<int64_t>(multiple, n + 1)),
                        static_cast<int>(power_iters),
                        static_cast<int>(std::min<int64_t>(oversample, n + 1))};
  const float* src = a.data_ptr<float>();
  const float* om = omega.data_ptr<float>();
  float* val = values.data_ptr<float>();
  float* bas = basis.data_ptr<float>();
  int* rk = ranks.data_ptr<int>();
  bool* dec = decided.data_ptr<bool>();
  at::parallel_for(0, a.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      sketch_matrix(src + m * n * n, om, n, p, rule, val + m * n, bas + m * n * p, rk + m,
                    dec + m);
    }
  });
  int* sum = summary.data_ptr<int>();
  for (int64_t m = 0; m < a.size(0); ++m) {
    double trace = 0.0;
    for (int i = 0; i < n; ++i) trace += src[m * n * n + i * (n + 1)];
    sum[0] = std::max(sum[0], rk[m]);
    sum[1] += !dec[m];
    sum[2] += !std::isfinite(trace);
  }
  return {values, basis, ranks, decided, summary};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adaattn, m) {
  m.def(
      "sym_sketch_top(Tensor a, Tensor omega, float energy, int min_rank, int multiple, "
      "int power_iters, int oversample, float rel_shift) -> (Tensor values, Tensor basis, "
      "Tensor ranks, Tensor decided, Tensor summary)");
}

TORCH_LIBRARY_IMPL(adaattn, CPU, m) {
  m.impl("sym_sketch_top", &sym_sketch_top_cpu);
}

}  // namespace adaattn
