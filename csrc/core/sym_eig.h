// The eigensolver of sym_eig, shared by the CPU and CUDA kernels: tridiagonalisation,
// multisection, inverse iteration and the output conventions. Both kernels run the same steps, in
// the same order, in float32 (only the norm is summed in double):
//
// 1. Scale: A <- A 2^-ex with max |a_ij| 2^-ex in [0.5, 1) (exact; keeps squares of entries of
//    1e30-scaled inputs finite). Eigenvalues are multiplied by 2^ex at the end.
// 2. Householder tridiagonalisation (LAPACK sytd2, lower): for k = 0..D-3, the reflector
//    H_k = I - tau v v^T (v_{k+1} = 1, beta = -sign(alpha) ||x||) maps x = A[k+1:, k] to
//    beta e_1; p = tau A' v, w = p - (tau / 2)(p . v) v, A' <- A' - v w^T - w v^T on the trailing
//    block. A column with x[1:] exactly 0 gets tau = 0 (H = I), so a diagonal input stays exact.
//    d = diag, e = subdiagonal; the v's stay below the subdiagonal for the back-transformation.
// 3. Split: e_i = 0 where |e_i| <= kSymEigSplit * ||A||_F. Each unreduced block [b, b + m) is solved
//    on its own; its eigenvectors are zero outside it, so different blocks' are exactly
//    orthogonal. 1 x 1 blocks give (d_b, unit vector) exactly: ties and identities stay exact.
// 4. Eigenvalues of a block by multisection on Sturm counts: kSymEigPoints points split the
//    bracket of the j-th smallest eigenvalue into kSymEigPoints + 1 parts, kSymEigSections times
//    from the block's Gerschgorin interval (width <= ~4 ||A||_F): 9^8 > 2^25, so the bracket ends
//    within ~2 float32 epsilons of ||A||_F (the tridiagonalisation's own error), well inside
//    kSymEigDegenerate; 10 steps cost 20% more and sharpened only eigenvalues far below ||A||.
//    Fixed step count: deterministic, and one eigenvalue per 8 threads on the GPU.
// 5. Eigenvectors by inverse iteration on T_block - lambda I: LU without pivoting (the Sturm
//    recurrence; pivots below kSymEigPivot * ||A||_F raised to it, a backward error of that size),
//    kSymEigInverseIts solves from a fixed pseudo-random start (sym_eig_start), each scaled to
//    max |z_i| = 1; normalised once its cluster step (6) is done.
//    An eigenvalue within kSymEigDegenerate * ||A||_F of the previous one of its block gets one
//    solve only: more would pull both vectors to the same direction of their (numerically single)
//    eigenspace, while one solve from a different start leaves an independent vector of it.
// 6. Clusters: runs of a block's eigenvalues (ascending) with consecutive gaps <= kSymEigCluster *
//    ||A||_F. Inverse iteration leaves vectors of eigenvalues g apart about eps ||A|| / g
//    non-orthogonal, and mixing them by that much moves A u - lambda u by only eps ||A||; inside a
//    cluster the j-th vector is orthogonalised against the cluster's earlier ones by classical
//    Gram-Schmidt applied twice (parallel over the earlier ones on the GPU). A degenerate member
//    (one solve) then gets one more solve and the same Gram-Schmidt (LAPACK stein's order): the
//    first projection may leave a small remainder, which the solve cleans of other eigenvectors.
//    Then normalised.
// 7. Back-transformation U = H_0 ... H_{D-3} Z, reflectors applied last first.
// 8. One Newton-Schulz step U <- U - U (U^T U - I) / 2: the pairs just outside clusters (gaps near
//    kSymEigCluster ||A||) are ~1e-4 non-orthogonal, ~1e-8 after it.
// 9. Output: eigenvalues descending (ties: lower index in the tridiagonal's block order first, NaN
//    last), eigenvectors as columns in the same order, each with its entry of largest magnitude
//    positive (ties: lowest row).
//
// sym_eig_top (rank_plan's op) computes the same eigenvalues, then the rank r of sym_eig_rank
// right after step 4, and steps 5-8 only for what the first r output columns need: inverse
// iteration and Gram-Schmidt for those eigenvalues and their clusters' lower members (step 6
// orthogonalises a member against the lower ones), back-transformation and Newton-Schulz for the
// r columns alone, in output order (sym_eig is the case r = D). Columns r.. of the output are 0.
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace adaattn {

constexpr int kSymEigMaxDim = 256;
constexpr int kSymEigPoints = 8;
constexpr int kSymEigSections = 8;
constexpr int kSymEigInverseIts = 3;
constexpr float kSymEigEps = 5.96e-8f;  // float32 unit roundoff
constexpr float kSymEigSplit = 16.f * kSymEigEps;
constexpr float kSymEigPivot = kSymEigEps;
constexpr float kSymEigCluster = 1e-3f;
constexpr float kSymEigDegenerate = 16.f * kSymEigEps;
// Sturm pivots are kept at least this far from 0 (scaled units: entries below 1, so e^2 / pivmin
// stays finite).
constexpr float kSymEigPivMin = 1e-30f;

// The exponent ex of max_abs = f 2^ex, f in [0.5, 1): A is scaled by 2^-ex (ldexpf, exact; 2^-ex
// itself may not be a float). 0 for 0 or non-finite input.
ADAATTN_HD int sym_eig_exponent(float max_abs) {
  if (!(max_abs > 0.f) || !(max_abs < INFINITY)) return 0;
  int ex;
  frexpf(max_abs, &ex);
  return ex;
}

// Number of eigenvalues of the unreduced block d[b..b+m), e2[b..b+m-1) (squared subdiagonal)
// below x. The CUDA kernel's sturm_packed is the same arithmetic on (d_i, e2_{i-1}) pairs.
ADAATTN_HD int sym_eig_sturm(const float* d, const float* e2, int b, int m, float x) {
  float q = d[b] - x;
  if (fabsf(q) < kSymEigPivMin) q = -kSymEigPivMin;
  int count = q < 0.f;
  for (int i = b + 1; i < b + m; ++i) {
    q = (d[i] - x) - e2[i - 1] / q;
    if (fabsf(q) < kSymEigPivMin) q = -kSymEigPivMin;
    count += q < 0.f;
  }
  return count;
}

// Point t (0..kSymEigPoints-1) of a multisection step of [lo, hi].
ADAATTN_HD float sym_eig_point(float lo, float hi, int t) {
  return lo + (hi - lo) * (static_cast<float>(t + 1) / static_cast<float>(kSymEigPoints + 1));
}

// Gerschgorin interval of block [b, b + m), widened so that its ends bracket strictly.
ADAATTN_HD void sym_eig_gerschgorin(const float* d, const float* e, int b, int m, float& lo,
                                    float& hi) {
  lo = INFINITY;
  hi = -INFINITY;
  for (int i = b; i < b + m; ++i) {
    const float r = (i > b ? fabsf(e[i - 1]) : 0.f) + (i < b + m - 1 ? fabsf(e[i]) : 0.f);
    lo = fminf(lo, d[i] - r);
    hi = fmaxf(hi, d[i] + r);
  }
  const float pad = 4.f * kSymEigEps * fmaxf(fabsf(lo), fabsf(hi)) + kSymEigPivMin;
  lo -= pad;
  hi += pad;
}

// Pseudo-random start entry in [-1, 1) for row i of eigenvector j.
ADAATTN_HD float sym_eig_start(int i, int j) {
  uint32_t h = static_cast<uint32_t>(i + 1) * 2654435761u ^ static_cast<uint32_t>(j + 1) * 2246822519u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  h *= 3266489917u;
  h ^= h >> 16;
  return static_cast<float>(h >> 8) * (1.f / 8388608.f) - 1.f;
}

// LU of T_block - lambda I without pivoting (block [b, b + m), m >= 2): r[i * rs] = 1 / u_i.
ADAATTN_HD void sym_eig_factor(const float* d, const float* e, int b, int m, float lambda,
                               float tiny, float* r, int rs) {
  float u = d[b] - lambda;
  for (int i = b;; ++i) {
    if (fabsf(u) < tiny) u = u < 0.f ? -tiny : tiny;
    r[i * rs] = 1.f / u;
    if (i + 1 == b + m) break;
    u = (d[i + 1] - lambda) - e[i] * e[i] * r[i * rs];
  }
}

// z <- (T_block - lambda I)^-1 z through the factors of sym_eig_factor (L y = z with
// l_i = e_i / u_i, then U z = y, in place), scaled to max |z_i| = 1.
ADAATTN_HD void sym_eig_solve(const float* e, int b, int m, const float* r, int rs, float* z,
                              int zs) {
  const int end = b + m;
  float y = z[b * zs];
  for (int i = b + 1; i < end; ++i) {
    y = z[i * zs] - e[i - 1] * r[(i - 1) * rs] * y;
    z[i * zs] = y;
  }
  float x = y * r[(end - 1) * rs], big = fabsf(x);
  z[(end - 1) * zs] = x;
  for (int i = end - 2; i >= b; --i) {
    x = (z[i * zs] - e[i] * x) * r[i * rs];
    z[i * zs] = x;
    big = fmaxf(big, fabsf(x));
  }
  const float inv = 1.f / big;
  for (int i = b; i < end; ++i) z[i * zs] *= inv;
}

// Strict total order of the output: larger eigenvalue first, NaN after every number, then the
// lower index.
ADAATTN_HD bool sym_eig_precedes(float a, int i, float b, int j) {
  const float ka = a != a ? -INFINITY : a;
  const float kb = b != b ? -INFINITY : b;
  return ka > kb || (ka == kb && i < j);
}

// rank_plan's rank (docs/ops.md) of the eigenvalues lam[order[0]] >= lam[order[1]] >= ... (any
// power-of-2 scale): the smallest r whose eigenvalues, clamped at 0, hold `energy` of their sum
// (none, e.g. NaN: n), then at least min_rank, rounded up to a multiple of `multiple`, at most n;
// energy >= 1 gives n. min_rank and multiple are in [1, n]. The sums are in double in the order of
// a 32-lane scan (the CUDA kernel's warp): with c = kSymEigRankChunk (n <= 128) or twice that,
// lane l sums entries cl..cl+c-1 one after another, an inclusive Kogge-Stone scan over the lanes'
// sums (strides 1, 2, 4, 8, 16) gives T_l, and the prefix through entry cl + i is
// T_{l-1} + (entries cl..cl+i) (T_{-1} = 0).
constexpr int kSymEigRankChunk = 4;
static_assert(kSymEigMaxDim <= 2 * 32 * kSymEigRankChunk, "sym_eig_rank's scan");

ADAATTN_HD double sym_eig_clamped(float x) { return x < 0.f ? 0.0 : static_cast<double>(x); }

ADAATTN_HD int sym_eig_round_rank(int first, int n, int min_rank, int multiple) {
  const int r = first > min_rank ? first : min_rank;
  const int up = (r + multiple - 1) / multiple * multiple;
  return up < n ? up : n;
}

ADAATTN_HD int sym_eig_rank(const float* lam, const int* order, int n, double energy,
                            int min_rank, int multiple) {
  if (!(energy < 1.0)) return n;
  const int c = n <= 32 * kSymEigRankChunk ? kSymEigRankChunk : 2 * kSymEigRankChunk;
  double t[32], local[2 * 32 * kSymEigRankChunk];
  for (int l = 0; l < 32; ++l) {
    double s = 0.0;
    for (int i = 0; i < c; ++i) {
      const int o = c * l + i;
      s += o < n ? sym_eig_clamped(lam[order[o]]) : 0.0;
      local[o] = s;
    }
    t[l] = s;
  }
  for (int stride = 1; stride < 32; stride *= 2) {
    for (int l = 31; l >= stride; --l) t[l] += t[l - stride];
  }
  const double target = energy * t[31];
  for (int o = 0; o < n; ++o) {
    if ((o >= c ? t[o / c - 1] : 0.0) + local[o] >= target) {
      return sym_eig_round_rank(o + 1, n, min_rank, multiple);
    }
  }
  return n;
}

// Whether row i's entry a beats row j's entry b as a column's entry of largest magnitude.
ADAATTN_HD bool sym_eig_larger_entry(float a, int i, float b, int j) {
  const float ka = a != a ? -1.f : fabsf(a);
  const float kb = b != b ? -1.f : fabsf(b);
  return ka > kb || (ka == kb && i < j);
}

}  // namespace adaattn
