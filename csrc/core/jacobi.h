// The parallel cyclic Jacobi eigensolver of sym_eig, shared by the CPU and CUDA kernels: ordering,
// rotations, stopping rule and the output conventions. Both kernels run the same algorithm:
//
// * The matrix is padded with zero rows/columns to n = jacobi_padded_dim(D) (a multiple of 16).
//   A padded index only ever meets entries that are exactly 0, so its rotations are skipped and it
//   never mixes with the real ones.
// * Ordering (round-robin tournament): n/2 disjoint pairs per round, n - 1 rounds per sweep, every
//   pair of indices meets once per sweep. Indices sit at positions 0..n-1: pair k of a round is
//   (k, m + k), m = n / 2 ("top" k, "bottom" m + k). After each round every index but the one at
//   position 0 moves one step along the ring 1 -> 2 -> ... -> m-1 -> 2m-1 -> 2m-2 -> ... -> m -> 1
//   (jacobi_ring_next), so after a sweep every index is back where it started.
// * Rotation of pair (p, q) = (top, bottom): the Golub-Van Loan / Rutishauser angle that zeroes
//   a_pq (|angle| <= pi/4), A <- J^T A J and V <- V J with column p' = c p - s q,
//   q' = s p + c q. It is skipped (c = 1, s = 0, a_pq kept) when |a_pq| <= skip_tol.
// * A sweep starts only while off(A) > kSymEigTol * ||A||_F (Frobenius norms, accumulated in
//   double), at most kSymEigMaxSweeps sweeps.
// * Then one Newton-Schulz step restores orthonormality lost to float32 rounding over ~1000
//   rotations per column: U <- U - U (U^T U - I) / 2.
// * Output: eigenvalues descending (ties: lower index first, NaN last), eigenvectors as columns in
//   the same order, each with its entry of largest magnitude positive (ties: lowest row).
#pragma once

#include <cmath>

#ifndef ADAATTN_HD
#if defined(__CUDACC__)
#define ADAATTN_HD __host__ __device__ __forceinline__
#else
#define ADAATTN_HD inline
#endif
#endif

namespace adaattn {

constexpr int kSymEigMaxDim = 256;
// Relative off-diagonal norm that ends the iteration. Convergence is quadratic at the end: the
// sweep that passes 1e-5 typically lands near 1e-8, and eigenvalues / A U - U diag(w) are then
// accurate to a few 1e-7 * ||A||_F (float32 rounding).
constexpr double kSymEigTol = 1e-7;
// Measured sweeps for D = 128 at kSymEigTol: 6 (well-separated spectra) to 13 (tight clusters,
// eigenvalues graded over 8 decades); the cap only bounds the time of pathological inputs
// (the result is then accurate to the off-norm reached).
constexpr int kSymEigMaxSweeps = 15;

ADAATTN_HD int jacobi_padded_dim(int dim) { return dim <= 16 ? 16 : (dim + 15) / 16 * 16; }

// Position of an index in the next round, given its position now (m = n / 2).
ADAATTN_HD int jacobi_ring_next(int pos, int m) {
  if (pos == 0) return 0;
  if (pos < m - 1) return pos + 1;
  if (pos == m - 1) return 2 * m - 1;
  if (pos == m) return 1;
  return pos - 1;
}

// Position now of the index that will be at `pos` in the next round.
ADAATTN_HD int jacobi_ring_prev(int pos, int m) {
  if (pos == 0) return 0;
  if (pos == 1) return m;
  if (pos < m) return pos - 1;
  if (pos == 2 * m - 1) return m - 1;
  return pos + 1;
}

struct JacobiRotation {
  float c, s, t;  // t = s / c; the diagonal becomes a_pp - t a_pq, a_qq + t a_pq
  bool skipped;
};

// IEEE division and square root even under --use_fast_math: c^2 + s^2 = 1 to an ulp keeps A's
// spectrum unchanged through ~1000 rotations.
ADAATTN_HD float jacobi_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

ADAATTN_HD float jacobi_sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

ADAATTN_HD JacobiRotation jacobi_rotation(float app, float aqq, float apq, float skip_tol) {
  if (!(fabsf(apq) > skip_tol)) return {1.f, 0.f, 0.f, true};
  const float theta = jacobi_div(aqq - app, 2.f * apq);
  const float abs_theta = fabsf(theta);
  // theta^2 overflows past ~1.8e19; there t = 1 / (2 theta) to float precision.
  float t = abs_theta > 1e18f ? jacobi_div(0.5f, abs_theta)
                              : jacobi_div(1.f, abs_theta + jacobi_sqrt(1.f + theta * theta));
  if (theta < 0.f) t = -t;
  const float c = jacobi_div(1.f, jacobi_sqrt(1.f + t * t));
  return {c, t * c, t, false};
}

// One 2x2 piece of an off-diagonal block of a round: x = [a(p_i, p_j), a(p_i, q_j), a(q_i, p_j),
// a(q_i, q_j)] for pairs i != j becomes J_i^T x J_j (rows first, then columns).
ADAATTN_HD void jacobi_rotate_block(float x[4], float ci, float si, float cj, float sj) {
  const float y0 = ci * x[0] - si * x[2], y1 = ci * x[1] - si * x[3];
  const float y2 = si * x[0] + ci * x[2], y3 = si * x[1] + ci * x[3];
  x[0] = cj * y0 - sj * y1;
  x[1] = sj * y0 + cj * y1;
  x[2] = cj * y2 - sj * y3;
  x[3] = sj * y2 + cj * y3;
}

// Strict total order of the output: larger eigenvalue first, NaN after every number, then the
// lower index.
ADAATTN_HD bool jacobi_precedes(float a, int i, float b, int j) {
  const float ka = a != a ? -INFINITY : a;
  const float kb = b != b ? -INFINITY : b;
  return ka > kb || (ka == kb && i < j);
}

// Whether row i's entry a beats row j's entry b as a column's entry of largest magnitude.
ADAATTN_HD bool jacobi_larger_entry(float a, int i, float b, int j) {
  const float ka = a != a ? -1.f : fabsf(a);
  const float kb = b != b ? -1.f : fabsf(b);
  return ka > kb || (ka == kb && i < j);
}

}  // namespace adaattn
