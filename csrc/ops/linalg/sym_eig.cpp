// sym_eig: eigenvalues and eigenvectors of a batch of small symmetric float32 matrices by
// tridiagonalisation, multisection and inverse iteration (core/sym_eig.h). Validation, the CPU
// kernel and its registration; the CUDA kernel is cuda/sym_eig.cu.
//
// The CPU kernel runs the CUDA kernel's algorithm step by step in float32, one matrix per task of
// at::parallel_for, so that it tests the algorithm where no GPU is present; only the order of
// float sums differs (the CUDA kernel's reductions are trees).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "../../core/sym_eig.h"
#include "../common/checks.h"
#include "sym_eig_checks.h"

namespace adaattn {

void check_sym_eig_input(const char* op, const at::Tensor& a) {
  ADAATTN_CHECK_TYPE(a.scalar_type() == at::kFloat, "a must be float32, got ", a.scalar_type());
  ADAATTN_CHECK_VALUE(a.dim() == 3, "a must have 3 dims [N, D, D], got ", a.dim(),
                      " dims (shape ", a.sizes(), ")");
  ADAATTN_CHECK_VALUE(a.size(1) == a.size(2), "a must be square [N, D, D], got shape ",
                      a.sizes());
  ADAATTN_CHECK_VALUE(a.size(1) >= 1 && a.size(1) <= kSymEigMaxDim,
                      "D = a.size(1) must be in [1, ", kSymEigMaxDim, "], got ", a.size(1));
  ADAATTN_CHECK_VALUE(a.size(0) <= std::numeric_limits<int>::max(),
                      "the batch N = a.size(0) must fit in int32, got ", a.size(0));
  ADAATTN_CHECK_VALUE(a.is_contiguous(), "a must be contiguous; call .contiguous() on it");
}

void check_sym_eig_top_args(double energy, int64_t min_rank, int64_t multiple) {
  constexpr const char* op = "sym_eig_top";
  ADAATTN_CHECK_VALUE(energy > 0.0 && energy <= 1.0, "energy must be in (0, 1], got ", energy);
  ADAATTN_CHECK_VALUE(min_rank >= 1 && multiple >= 1,
                      "min_rank and multiple must be positive, got ", min_rank, ", ", multiple);
}

std::tuple<at::Tensor, at::Tensor> sym_eig_outputs(const at::Tensor& a) {
  return {at::empty({a.size(0), a.size(1)}, a.options()), at::empty(a.sizes(), a.options())};
}

namespace {

// One matrix: a [D, D] (its lower triangle is read) -> w [D], v [D, D] (columns); returns the
// rank r. energy >= 1: sym_eig (r = D); else sym_eig_top: r = sym_eig_rank (min_rank, multiple
// in [1, D]) and columns r.. of v are 0.
int sym_eig_matrix(const float* a, int n, float* w, float* v, double energy, int min_rank,
                   int multiple) {
  // 1. Scale (A full, symmetric).
  float max_abs = 0.f;
  for (int y = 0; y < n; ++y) {
    for (int x = 0; x <= y; ++x) max_abs = std::fmax(max_abs, std::fabs(a[y * n + x]));
  }
  const int ex = sym_eig_exponent(max_abs);
  std::vector<float> A(static_cast<size_t>(n) * n);
  double norm2 = 0;
  for (int y = 0; y < n; ++y) {
    for (int x = 0; x <= y; ++x) {
      const float s = std::ldexp(a[y * n + x], -ex);
      A[x * n + y] = A[y * n + x] = s;
      norm2 += (x == y ? 1. : 2.) * s * s;
    }
  }
  const float anorm = static_cast<float>(std::sqrt(norm2));

  // 2. Tridiagonalisation; v of step k is kept in row k, entries k+2..n-1.
  std::vector<float> d(n), e(n, 0.f), tau(n, 0.f), p(n);
  for (int k = 0; k + 2 < n; ++k) {
    float* x = &A[k * n];
    d[k] = x[k];
    const float alpha = x[k + 1];
    float sigma = 0.f;
    for (int i = k + 2; i < n; ++i) sigma += x[i] * x[i];
    e[k] = alpha;
    if (sigma == 0.f) continue;
    const float mu = std::sqrt(alpha * alpha + sigma);
    const float beta = alpha <= 0.f ? mu : -mu;
    const float t = (beta - alpha) / beta, sc = 1.f / (alpha - beta);
    for (int i = k + 2; i < n; ++i) x[i] *= sc;
    e[k] = beta;
    tau[k] = t;
    const auto vi = [&](int i) { return i == k + 1 ? 1.f : x[i]; };
    float pv = 0.f;
    for (int i = k + 1; i < n; ++i) {
      float s = 0.f;
      for (int j = k + 1; j < n; ++j) s += A[i * n + j] * vi(j);
      p[i] = t * s;
      pv += p[i] * vi(i);
    }
    const float kk = 0.5f * t * pv;
    for (int i = k + 1; i < n; ++i) p[i] -= kk * vi(i);  // p is w now
    for (int i = k + 1; i < n; ++i) {
      for (int j = k + 1; j < n; ++j) A[i * n + j] -= vi(i) * p[j] + p[i] * vi(j);
    }
  }
  if (n >= 2) {
    d[n - 2] = A[(n - 2) * n + n - 2];
    e[n - 2] = A[(n - 1) * n + n - 2];
  }
  d[n - 1] = A[(n - 1) * n + n - 1];

  // 3. Split into unreduced blocks: start[i] = first index of i's block.
  std::vector<float> e2(n, 0.f);
  std::vector<int> start(n);
  for (int i = 0; i < n; ++i) {
    if (i > 0 && std::fabs(e[i - 1]) <= kSymEigSplit * anorm) e[i - 1] = 0.f;
    if (i > 0) e2[i - 1] = e[i - 1] * e[i - 1];
    start[i] = i > 0 && e[i - 1] != 0.f ? start[i - 1] : i;
  }
  const auto block_size = [&](int b) {
    int m = 1;
    while (b + m < n && start[b + m] == b) ++m;
    return m;
  };

  // 4. Eigenvalues (ascending within each block).
  std::vector<float> lam(n);
  for (int b = 0; b < n; b += block_size(b)) {
    const int m = block_size(b);
    if (m == 1) {
      lam[b] = d[b];
      continue;
    }
    float glo, ghi;
    sym_eig_gerschgorin(d.data(), e.data(), b, m, glo, ghi);
    for (int j = 0; j < m; ++j) {
      float lo = glo, hi = ghi;
      for (int step = 0; step < kSymEigSections; ++step) {
        float nlo = lo, nhi = hi;
        for (int t = 0; t < kSymEigPoints; ++t) {
          const float xt = sym_eig_point(lo, hi, t);
          if (sym_eig_sturm(d.data(), e2.data(), b, m, xt) <= j) {
            nlo = xt;
          } else if (nhi == hi) {
            nhi = xt;
          }
        }
        lo = nlo;
        hi = nhi;
      }
      lam[b + j] = 0.5f * (lo + hi);
    }
  }

  // Output order, rank, cluster starts, and the eigenvalues whose vectors the first r columns
  // need (their own or a later member of their cluster).
  std::vector<int> order(n), pos(n), c0(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int i, int j) { return sym_eig_precedes(lam[i], i, lam[j], j); });
  for (int i = 0; i < n; ++i) pos[order[i]] = i;
  const int rank = sym_eig_rank(lam.data(), order.data(), n, energy, min_rank, multiple);
  const float tiny = kSymEigPivot * anorm, ctol = kSymEigCluster * anorm;
  for (int j = 0; j < n; ++j) {
    int c = j;
    while (c > start[j] && lam[c] - lam[c - 1] <= ctol) --c;
    c0[j] = c;
  }
  std::vector<char> need(n);
  for (int j = 0; j < n; ++j) {
    bool nd = pos[j] < rank;
    for (int y = j + 1; !nd && y < n && c0[y] <= j; ++y) nd = pos[y] < rank;
    need[j] = nd;
  }

  // 5-6. Eigenvectors of T: zt[j][i] = Z[i][j]; rt[j] the factors of T - lam_j I.
  std::vector<float> zt(static_cast<size_t>(n) * n, 0.f), rt(static_cast<size_t>(n) * n), h(n);
  for (int j = 0; j < n; ++j) {
    if (!need[j]) continue;
    const int b = start[j], m = block_size(b);
    float* z = &zt[j * n];
    float* r = &rt[j * n];
    if (m == 1) {
      z[b] = 1.f;
      continue;
    }
    const bool degenerate = j > b && lam[j] - lam[j - 1] <= kSymEigDegenerate * anorm;
    sym_eig_factor(d.data(), e.data(), b, m, lam[j], tiny, r, 1);
    for (int y = b; y < b + m; ++y) z[y] = sym_eig_start(y, j);
    for (int it = 0; it < (degenerate ? 1 : kSymEigInverseIts); ++it) {
      sym_eig_solve(e.data(), b, m, r, 1, z, 1);
    }
    const int c = c0[j];
    for (int round = 0; round < (c == j ? 0 : degenerate ? 2 : 1); ++round) {
      if (round == 1) sym_eig_solve(e.data(), b, m, r, 1, z, 1);
      for (int pass = 0; pass < 2; ++pass) {
        for (int i = c; i < j; ++i) {
          float s = 0.f;
          for (int y = b; y < b + m; ++y) s += zt[i * n + y] * z[y];
          h[i] = s;
        }
        for (int y = b; y < b + m; ++y) {
          float s = 0.f;
          for (int i = c; i < j; ++i) s += h[i] * zt[i * n + y];
          z[y] -= s;
        }
      }
    }
    float s = 0.f;
    for (int y = b; y < b + m; ++y) s += z[y] * z[y];
    const float inv = 1.f / std::sqrt(s);
    for (int y = b; y < b + m; ++y) z[y] *= inv;
  }

  // 7. Back-transformation of the first `rank` output columns: ut[g] = U's column g.
  std::vector<float> ut(static_cast<size_t>(rank) * n);
  for (int g = 0; g < rank; ++g) {
    float* z = &ut[g * n];
    std::copy_n(&zt[order[g] * n], n, z);
    for (int k = n - 3; k >= 0; --k) {
      if (tau[k] == 0.f) continue;
      const float* x = &A[k * n];
      float s = z[k + 1];
      for (int i = k + 2; i < n; ++i) s += x[i] * z[i];
      s *= tau[k];
      z[k + 1] -= s;
      for (int i = k + 2; i < n; ++i) z[i] -= s * x[i];
    }
  }

  // 8. Newton-Schulz on those columns: U^T <- U^T - (U^T U - I) U^T / 2.
  std::vector<float> mm(static_cast<size_t>(rank) * rank), us(static_cast<size_t>(rank) * n);
  for (int x = 0; x < rank; ++x) {
    for (int y = 0; y < rank; ++y) {
      float s = 0.f;
      for (int i = 0; i < n; ++i) s += ut[x * n + i] * ut[y * n + i];
      mm[x * rank + y] = s - (x == y ? 1.f : 0.f);
    }
  }
  for (int x = 0; x < rank; ++x) {
    for (int i = 0; i < n; ++i) {
      float s = 0.f;
      for (int k = 0; k < rank; ++k) s += mm[k * rank + x] * ut[k * n + i];
      us[x * n + i] = ut[x * n + i] - 0.5f * s;
    }
  }

  // 9. Signs, stores.
  for (int col = 0; col < n; ++col) {
    w[col] = std::ldexp(lam[order[col]], ex);
    if (col >= rank) {
      for (int y = 0; y < n; ++y) v[y * n + col] = 0.f;
      continue;
    }
    const float* u = &us[col * n];
    int big = 0;
    for (int y = 1; y < n; ++y) {
      if (sym_eig_larger_entry(u[y], y, u[big], big)) big = y;
    }
    const float sign = u[big] < 0.f ? -1.f : 1.f;
    for (int y = 0; y < n; ++y) v[y * n + col] = sign * u[y];
  }
  return rank;
}

// The batch on at::parallel_for; ranks (int32 [N]) is written when given.
void sym_eig_batch(const at::Tensor& a, at::Tensor& w, at::Tensor& v, int* ranks, double energy,
                   int64_t min_rank, int64_t multiple) {
  const int64_t batch = a.size(0), dim = a.size(1);
  const int mr = static_cast<int>(std::min(min_rank, dim));
  const int mu = static_cast<int>(std::min(multiple, dim));
  const float* pa = a.data_ptr<float>();
  float* pw = w.data_ptr<float>();
  float* pv = v.data_ptr<float>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int r = sym_eig_matrix(pa + i * dim * dim, static_cast<int>(dim), pw + i * dim,
                                   pv + i * dim * dim, energy, mr, mu);
      if (ranks != nullptr) ranks[i] = r;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> sym_eig_cpu(const at::Tensor& a) {
  check_sym_eig_input("sym_eig", a);
  auto [w, v] = sym_eig_outputs(a);
  sym_eig_batch(a, w, v, nullptr, 1.0, 1, 1);
  return {w, v};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sym_eig_top_cpu(const at::Tensor& a, double energy,
                                                               int64_t min_rank,
                                                               int64_t multiple) {
  check_sym_eig_input("sym_eig_top", a);
  check_sym_eig_top_args(energy, min_rank, multiple);
  auto [w, v] = sym_eig_outputs(a);
  at::Tensor ranks = at::empty({a.size(0)}, a.options().dtype(at::kInt));
  sym_eig_batch(a, w, v, ranks.data_ptr<int>(), energy, min_rank, multiple);
  return {w, v, ranks};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adaattn, m) {
  m.def("sym_eig(Tensor a) -> (Tensor eigenvalues, Tensor eigenvectors)");
  m.def(
      "sym_eig_top(Tensor a, float energy, int min_rank, int multiple) -> (Tensor eigenvalues, "
      "Tensor eigenvectors, Tensor ranks)");
}

TORCH_LIBRARY_IMPL(adaattn, CPU, m) {
  m.impl("sym_eig", &sym_eig_cpu);
  m.impl("sym_eig_top", &sym_eig_top_cpu);
}

}  // namespace adaattn
