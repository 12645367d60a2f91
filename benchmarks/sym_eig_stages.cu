// Standalone timing of the sym_eig CUDA kernel (csrc/cuda/sym_eig_kernel.cuh), stage by stage,
// without torch. Build and run (on a machine with an sm_90 GPU):
//
//   nvcc -O3 -std=c++17 -arch=sm_90 --use_fast_math -DADAATTN_SYM_EIG_STAGES -Icsrc \
//       benchmarks/sym_eig_stages.cu -o /tmp/sym_eig_stages && /tmp/sym_eig_stages [N]
//
// (--use_fast_math as in setup.py's nvcc flags.) For N (default 64) Gram matrices G = X^T X of
// 128 x 128, X with 8192 rows (rank_plan's G = q^T q + k^T k with Lq = Lk = 4096, as in
// benchmarks/bench_rank.py), in two kinds:
// * random: X standard normal (Marchenko-Pastur spectrum in [~6300, ~10400]);
// * planted: X = C B^T + 0.05 E, C 8192 x 32 and E standard normal, B 128 x 32 orthonormal
//   (32 eigenvalues ~8192 plus a 96-member noise cluster near 0.0025 * 8192).
// For each kind, two modes of the kernel: sym_eig (all columns) and sym_eig_top (rank_plan's:
// energy 0.99, min_rank = multiple = 16). Prints each one's median time over 20 launches (CUDA
// events, after warmup), then for one launch each stage's median over CTAs of clock64() cycles
// and its share of the kernel's median, the cluster structure the eigenvalues imply, the ranks,
// and the checks: max |A U - U diag(w)| / ||A||_F and max |U^T U - I| in float32 epsilons over
// the first `rank` columns (tests/test_sym_eig.py's bounds: 1e-5 and 64), descending
// eigenvalues, columns past the rank exactly 0, ranks equal to sym_eig_rank on the returned
// eigenvalues, sym_eig_top's eigenvalues bitwise equal to sym_eig's, and a second launch bitwise
// equal to the first. Exits 1 when a check fails. The stage probes add 11 global stores per CTA.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/sym_eig_kernel.cuh"
#include "standalone_cuda.cuh"

#ifndef ADAATTN_SYM_EIG_STAGES
#error "build with -DADAATTN_SYM_EIG_STAGES"
#endif

constexpr int kD = 128, kRows = 8192, kPlanted = 32;

// x[b, r, :] <- c[b, r, :] B[b]^T + 0.05 x[b, r, :] (B [N, kD, kPlanted]).
__global__ void plant(float* x, const float* c, const float* basis) {
  const size_t row = blockIdx.x;  // b * kRows + r
  const int i = threadIdx.x, b = static_cast<int>(row / kRows);
  float s = 0.f;
  for (int t = 0; t < kPlanted; ++t) s += c[row * kPlanted + t] * basis[(b * kD + i) * kPlanted + t];
  x[row * kD + i] = s + 0.05f * x[row * kD + i];
}

// g[b] = x[b]^T x[b]: one CTA of 256 threads per matrix, each an 8 x 8 tile (exactly symmetric:
// g_ij and g_ji sum the same products in the same order).
__global__ void gram(const float* x, float* g) {
  __shared__ float xs[32][kD];
  const int ti = threadIdx.x / 16, tj = threadIdx.x % 16;
  const float* xb = x + size_t(blockIdx.x) * kRows * kD;
  float acc[8][8] = {};
  for (int r0 = 0; r0 < kRows; r0 += 32) {
    __syncthreads();
    for (int o = threadIdx.x; o < 32 * kD; o += 256) xs[o / kD][o % kD] = xb[size_t(r0) * kD + o];
    __syncthreads();
    for (int r = 0; r < 32; ++r) {
#pragma unroll
      for (int a = 0; a < 8; ++a) {
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[a][c] += xs[r][ti + 16 * a] * xs[r][tj + 16 * c];
      }
    }
  }
  for (int a = 0; a < 8; ++a) {
    for (int c = 0; c < 8; ++c) g[(size_t(blockIdx.x) * kD + ti + 16 * a) * kD + tj + 16 * c] = acc[a][c];
  }
}

static const char* kStageNames[adaattn::kSymEigStageCount] = {
    "", "scale/load", "tridiagonalisation", "split", "multisection", "order/rank",
    "inverse iteration", "cluster Gram-Schmidt", "back-transformation", "Newton-Schulz",
    "sign/store"};

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0. : v[v.size() / 2];
}

struct Result {
  std::vector<float> w, v;
  std::vector<int> ranks;
};

// Launches sym_eig (energy 1, no ranks) or sym_eig_top (energy < 1, min_rank = multiple = 16) on
// the n Gram matrices d_g (host copy g): timing, stages, accuracy of the first rank columns
// against g, the ranks against the rule on the returned eigenvalues, columns past the rank 0,
// eigenvalues equal to sym_eig's (`full`), and a second launch bitwise equal to the first.
static bool solve(const char* kind, const char* op, int n, const float* d_g,
                  const std::vector<float>& g, double energy, const Result* full, Result& out) {
  const bool is_top = energy < 1.0;
  float *d_w, *d_v;
  int* d_r;
  long long* d_st;
  CK(cudaMalloc(&d_w, size_t(n) * kD * 4));
  CK(cudaMalloc(&d_v, size_t(n) * kD * kD * 4));
  CK(cudaMalloc(&d_r, size_t(n) * 4));
  CK(cudaMalloc(&d_st, size_t(n) * adaattn::kSymEigStageCount * 8));
  auto launch = [&] {
    CK(adaattn::sym_eig_launch(d_g, d_w, d_v, n, kD, 0, energy, 16, 16, is_top ? d_r : nullptr,
                               d_st));
  };
  for (int i = 0; i < 3; ++i) launch();
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<double> ms;
  for (int i = 0; i < 20; ++i) {
    CK(cudaEventRecord(e0));
    launch();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  const double ms_med = median(ms);
  std::vector<float>& w = out.w;
  std::vector<float>& v = out.v;
  std::vector<int>& rk = out.ranks;
  w.resize(size_t(n) * kD);
  v.resize(size_t(n) * kD * kD);
  rk.assign(n, kD);
  std::vector<long long> st(size_t(n) * adaattn::kSymEigStageCount);
  CK(cudaMemcpy(w.data(), d_w, w.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(v.data(), d_v, v.size() * 4, cudaMemcpyDeviceToHost));
  if (is_top) CK(cudaMemcpy(rk.data(), d_r, rk.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(st.data(), d_st, st.size() * 8, cudaMemcpyDeviceToHost));
  // Determinism: one more launch, compared bitwise.
  CK(cudaMemset(d_v, 0xff, size_t(n) * kD * kD * 4));
  launch();
  std::vector<float> w2(w.size()), v2(v.size());
  std::vector<int> rk2(rk);
  CK(cudaMemcpy(w2.data(), d_w, w.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(v2.data(), d_v, v.size() * 4, cudaMemcpyDeviceToHost));
  if (is_top) CK(cudaMemcpy(rk2.data(), d_r, rk.size() * 4, cudaMemcpyDeviceToHost));
  const bool same = std::memcmp(w.data(), w2.data(), w.size() * 4) == 0 &&
                    std::memcmp(v.data(), v2.data(), v.size() * 4) == 0 && rk == rk2;
  CK(cudaFree(d_w));
  CK(cudaFree(d_v));
  CK(cudaFree(d_r));
  CK(cudaFree(d_st));

  const int ns = adaattn::kSymEigStageCount;
  std::vector<double> total;
  for (int b = 0; b < n; ++b) total.push_back(double(st[b * ns + ns - 1] - st[b * ns]));
  const double tot = median(total);
  std::printf("\n%s, %s: %d matrices of %d: kernel %.3f ms (median of 20); %.0f cycles per CTA "
              "(median; %.2f GHz if the kernel time were all CTA time)\n",
              kind, op, n, kD, ms_med, tot, tot / (ms_med * 1e6));
  for (int s = 1; s < ns; ++s) {
    std::vector<double> c;
    for (int b = 0; b < n; ++b) c.push_back(double(st[b * ns + s] - st[b * ns + s - 1]));
    const double m = median(c);
    std::printf("  %-22s %9.0f cycles  %5.1f%%\n", kStageNames[s], m, 100. * m / tot);
  }

  // Accuracy (float64) of the first rank columns and the cluster structure of the spectrum.
  double res = 0, orth = 0, tail = 0, wdiff = 0, vdiff = 0, sumr = 0;
  int clustered = 0, degenerate = 0, rank_bad = 0, rmin = kD, rmax = 0;
  bool order = true;
  std::vector<int> ident(kD);
  for (int i = 0; i < kD; ++i) ident[i] = i;
  for (int b = 0; b < n; ++b) {
    const float* a = &g[size_t(b) * kD * kD];
    const float* u = &v[size_t(b) * kD * kD];
    const float* wb = &w[size_t(b) * kD];
    const int r = rk[b];
    rmin = std::min(rmin, r);
    rmax = std::max(rmax, r);
    sumr += r;
    const int want = is_top ? adaattn::sym_eig_rank(wb, ident.data(), kD, energy, 16, 16) : kD;
    rank_bad += r != want;
    double norm = 0;
    for (int o = 0; o < kD * kD; ++o) norm += double(a[o]) * a[o];
    norm = std::sqrt(norm);
    for (int j = 0; j < kD; ++j) {
      if (full != nullptr) wdiff = std::max(wdiff, double(std::fabs(wb[j] - full->w[b * kD + j])));
      if (j > 0 && wb[j] > wb[j - 1]) order = false;
      if (j > 0 && wb[j - 1] - wb[j] <= 1e-3 * norm) ++clustered;
      if (j > 0 && wb[j - 1] - wb[j] <= 16 * 5.96e-8 * norm) ++degenerate;
      for (int i = 0; i < kD; ++i) {
        if (j >= r) {
          tail = std::max(tail, double(std::fabs(u[i * kD + j])));
          continue;
        }
        double au = 0, uu = 0;
        for (int k = 0; k < kD; ++k) {
          au += double(a[i * kD + k]) * u[k * kD + j];
          if (i < r) uu += double(u[k * kD + i]) * u[k * kD + j];
        }
        res = std::max(res, std::fabs(au - double(u[i * kD + j]) * wb[j]) / norm);
        if (full != nullptr) {
          const float ref = full->v[(size_t(b) * kD + i) * kD + j];
          vdiff = std::max(vdiff, double(std::fabs(u[i * kD + j] - ref)));
        }
        if (i < r) orth = std::max(orth, std::fabs(uu - (i == j ? 1. : 0.)));
      }
    }
  }
  const double eps = 1.1920929e-7;
  const bool ok = order && res <= 1e-5 && orth <= 64 * eps && same && rank_bad == 0 &&
                  tail == 0 && wdiff == 0;
  std::printf("  clustered gaps (<= 1e-3 ||A||_F) %.1f per matrix, degenerate %.1f per matrix\n",
              double(clustered) / n, double(degenerate) / n);
  std::printf("  ranks %d..%d (mean %.1f), %d differ from sym_eig_rank on the eigenvalues; columns "
              "past the rank max |.| %g; vs sym_eig: eigenvalues max |diff| %g, columns %.1e\n",
              rmin, rmax, sumr / n, rank_bad, tail, wdiff, vdiff);
  std::printf("  residual %.2e ||A||_F, orthonormal to %.1f eps, descending %s, second launch "
              "bitwise equal %s: %s\n", res, orth / eps, order ? "yes" : "NO", same ? "yes" : "NO",
              ok ? "ok" : "FAILED");
  return ok;
}

static bool run(const char* kind, int n, float* d_x, float* d_g) {
  const size_t xs = size_t(n) * kRows * kD;
  fill_normal<<<4096, 256>>>(d_x, xs, 1234u);
  if (kind[0] == 'p') {
    std::mt19937_64 rng(42);
    std::normal_distribution<double> nd;
    std::vector<float> basis(size_t(n) * kD * kPlanted);
    std::vector<double> q(kD * kPlanted);
    for (int b = 0; b < n; ++b) {  // modified Gram-Schmidt of a normal 128 x 32, in double
      for (double& t : q) t = nd(rng);
      for (int c = 0; c < kPlanted; ++c) {
        for (int p = 0; p < c; ++p) {
          double s = 0;
          for (int i = 0; i < kD; ++i) s += q[i * kPlanted + p] * q[i * kPlanted + c];
          for (int i = 0; i < kD; ++i) q[i * kPlanted + c] -= s * q[i * kPlanted + p];
        }
        double s = 0;
        for (int i = 0; i < kD; ++i) s += q[i * kPlanted + c] * q[i * kPlanted + c];
        for (int i = 0; i < kD; ++i) q[i * kPlanted + c] /= std::sqrt(s);
      }
      for (int o = 0; o < kD * kPlanted; ++o) basis[size_t(b) * kD * kPlanted + o] = float(q[o]);
    }
    float *d_c, *d_b;
    CK(cudaMalloc(&d_c, size_t(n) * kRows * kPlanted * 4));
    CK(cudaMalloc(&d_b, basis.size() * 4));
    CK(cudaMemcpy(d_b, basis.data(), basis.size() * 4, cudaMemcpyHostToDevice));
    fill_normal<<<4096, 256>>>(d_c, size_t(n) * kRows * kPlanted, 777u);
    plant<<<n * kRows, kD>>>(d_x, d_c, d_b);
    CK(cudaDeviceSynchronize());
    CK(cudaFree(d_c));
    CK(cudaFree(d_b));
  }
  gram<<<n, 256>>>(d_x, d_g);
  CK(cudaGetLastError());
  std::vector<float> g(size_t(n) * kD * kD);
  CK(cudaMemcpy(g.data(), d_g, g.size() * 4, cudaMemcpyDeviceToHost));
  Result full, top;
  bool ok = solve(kind, "sym_eig", n, d_g, g, 1.0, nullptr, full);
  ok = solve(kind, "sym_eig_top (energy 0.99, min_rank 16, multiple 16)", n, d_g, g, 0.99, &full,
             top) && ok;
  return ok;
}

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 64;
  if (n < 1) return 2;
  float *d_x, *d_g;
  CK(cudaMalloc(&d_x, size_t(n) * kRows * kD * 4));
  CK(cudaMalloc(&d_g, size_t(n) * kD * kD * 4));
  bool ok = run("random", n, d_x, d_g);
  ok = run("planted", n, d_x, d_g) && ok;
  CK(cudaFree(d_x));
  CK(cudaFree(d_g));
  return ok ? 0 : 1;
}
