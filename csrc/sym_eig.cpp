// sym_eig: eigenvalues and eigenvectors of a batch of small symmetric float32 matrices by the
// parallel cyclic Jacobi method of core/jacobi.h. Validation, the CPU kernel and its
// registration; the CUDA kernel is cuda/sym_eig.cu.
//
// The CPU kernel runs the CUDA kernel's algorithm (ordering, rotations, stopping rule,
// Newton-Schulz step, output conventions) in the same float32 arithmetic, one matrix per task of
// at::parallel_for, so that it tests the algorithm where no GPU is present. It keeps the matrix
// full and indexed by the original indices; only the pairing follows the positions of the ring.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "core/jacobi.h"
#include "sym_eig_api.h"

namespace adaattn {

void check_sym_eig_input(const at::Tensor& a) {
  TORCH_CHECK(a.scalar_type() == at::kFloat, "adaattn: sym_eig: a must be float32, got ",
              a.scalar_type());
  TORCH_CHECK(a.dim() == 3, "adaattn: sym_eig: a must have 3 dims [N, D, D], got ", a.dim(),
              " dims (shape ", a.sizes(), ")");
  TORCH_CHECK(a.size(1) == a.size(2), "adaattn: sym_eig: a must be square [N, D, D], got shape ",
              a.sizes());
  TORCH_CHECK(a.size(1) >= 1 && a.size(1) <= kSymEigMaxDim, "adaattn: sym_eig: D = a.size(1) must "
              "be in [1, ", kSymEigMaxDim, "], got ", a.size(1));
  TORCH_CHECK(a.size(0) <= std::numeric_limits<int>::max(),
              "adaattn: sym_eig: the batch N = a.size(0) must fit in int32, got ", a.size(0));
  TORCH_CHECK(a.is_contiguous(), "adaattn: sym_eig: a must be contiguous; call .contiguous() on it");
}

std::tuple<at::Tensor, at::Tensor> sym_eig_outputs(const at::Tensor& a) {
  return {at::empty({a.size(0), a.size(1)}, a.options()), at::empty(a.sizes(), a.options())};
}

namespace {

// One matrix: a [D, D] (its lower triangle is read) -> w [D], v [D, D] (columns).
void sym_eig_matrix(const float* a, int dim, float* w, float* v) {
  const int n = jacobi_padded_dim(dim), m = n / 2;
  std::vector<float> A(static_cast<size_t>(n) * n, 0.f);
  std::vector<float> vt(static_cast<size_t>(n) * n, 0.f);  // vt[x][r] = V[r][x]
  for (int y = 0; y < dim; ++y) {
    for (int x = 0; x <= y; ++x) A[x * n + y] = A[y * n + x] = a[y * dim + x];
  }
  for (int x = 0; x < n; ++x) vt[x * n + x] = 1.f;

  const auto off_norm2 = [&] {
    double s = 0;
    for (int y = 0; y < n; ++y) {
      for (int x = 0; x < n; ++x) s += x == y ? 0. : static_cast<double>(A[y * n + x]) * A[y * n + x];
    }
    return s;
  };
  double norm2 = 0;
  for (float x : A) norm2 += static_cast<double>(x) * x;
  double off2 = off_norm2();
  const float skip_tol = static_cast<float>(kSymEigTol * std::sqrt(norm2) / n);

  std::vector<int> at(n), next(n);  // at[pos]: the index at position pos this round
  std::iota(at.begin(), at.end(), 0);
  std::vector<JacobiRotation> rot(m);
  for (int sweep = 0; sweep < kSymEigMaxSweeps; ++sweep) {
    if (!(off2 > kSymEigTol * kSymEigTol * norm2)) break;
    for (int round = 0; round < n - 1; ++round) {
      for (int k = 0; k < m; ++k) {
        const int p = at[k], q = at[m + k];
        const float apq = A[p * n + q];
        rot[k] = jacobi_rotation(A[p * n + p], A[q * n + q], apq, skip_tol);
        if (rot[k].skipped) continue;
        A[p * n + p] -= rot[k].t * apq;
        A[q * n + q] += rot[k].t * apq;
        A[p * n + q] = A[q * n + p] = 0.f;
      }
      for (int i = 0; i < m; ++i) {
        const int pi = at[i], qi = at[m + i];
        for (int j = i + 1; j < m; ++j) {
          const int pj = at[j], qj = at[m + j];
          float x[4] = {A[pi * n + pj], A[pi * n + qj], A[qi * n + pj], A[qi * n + qj]};
          jacobi_rotate_block(x, rot[i].c, rot[i].s, rot[j].c, rot[j].s);
          A[pi * n + pj] = A[pj * n + pi] = x[0];
          A[pi * n + qj] = A[qj * n + pi] = x[1];
          A[qi * n + pj] = A[pj * n + qi] = x[2];
          A[qi * n + qj] = A[qj * n + qi] = x[3];
        }
      }
      for (int k = 0; k < m; ++k) {
        if (rot[k].skipped) continue;
        const float c = rot[k].c, s = rot[k].s;
        float* vp = &vt[at[k] * n];
        float* vq = &vt[at[m + k] * n];
        for (int r = 0; r < n; ++r) {
          const float xp = vp[r], xq = vq[r];
          vp[r] = c * xp - s * xq;
          vq[r] = s * xp + c * xq;
        }
      }
      for (int pos = 0; pos < n; ++pos) next[jacobi_ring_next(pos, m)] = at[pos];
      at.swap(next);
    }
    off2 = off_norm2();
  }

  // Newton-Schulz on U = V[:D, :D]: U^T <- U^T - (U^T U - I) U^T / 2.
  std::vector<float> mm(static_cast<size_t>(dim) * dim), ut(static_cast<size_t>(dim) * dim);
  for (int x = 0; x < dim; ++x) {
    for (int y = 0; y < dim; ++y) {
      float s = 0.f;
      for (int r = 0; r < dim; ++r) s += vt[x * n + r] * vt[y * n + r];
      mm[x * dim + y] = s - (x == y ? 1.f : 0.f);
    }
  }
  for (int x = 0; x < dim; ++x) {
    for (int r = 0; r < dim; ++r) {
      float s = 0.f;
      for (int k = 0; k < dim; ++k) s += mm[k * dim + x] * vt[k * n + r];
      ut[x * dim + r] = vt[x * n + r] - 0.5f * s;
    }
  }

  std::vector<int> order(dim);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int i, int j) {
    return jacobi_precedes(A[i * n + i], i, A[j * n + j], j);
  });
  for (int col = 0; col < dim; ++col) {
    const int x = order[col];
    const float* u = &ut[x * dim];
    int big = 0;
    for (int r = 1; r < dim; ++r) {
      if (jacobi_larger_entry(u[r], r, u[big], big)) big = r;
    }
    const float sign = u[big] < 0.f ? -1.f : 1.f;
    w[col] = A[x * n + x];
    for (int r = 0; r < dim; ++r) v[r * dim + col] = sign * u[r];
  }
}

std::tuple<at::Tensor, at::Tensor> sym_eig_cpu(const at::Tensor& a) {
  check_sym_eig_input(a);
  auto [w, v] = sym_eig_outputs(a);
  const int64_t batch = a.size(0), dim = a.size(1);
  const float* pa = a.data_ptr<float>();
  float* pw = w.data_ptr<float>();
  float* pv = v.data_ptr<float>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      sym_eig_matrix(pa + i * dim * dim, static_cast<int>(dim), pw + i * dim, pv + i * dim * dim);
    }
  });
  return {w, v};
}

}  // namespace

TORCH_LIBRARY_IMPL(adaattn, CPU, m) { m.impl("sym_eig", &sym_eig_cpu); }

}  // namespace adaattn
