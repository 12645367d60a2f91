// The launchers and CUDA registration of sym_eig and sym_eig_top: D <= 128 runs the kernel of
// sym_eig_kernel.cuh (its header comment describes the kernel and its cost), D > 128 float64
// at::linalg_eigh, then the same order and sign convention (and sym_eig_rank per matrix).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../ops/linalg/sym_eig_checks.h"
#include "sym_eig_kernel.cuh"

namespace adaattn {
namespace {

void launch(const at::Tensor& a, at::Tensor& w, at::Tensor& v, int* ranks = nullptr,
            double energy = 1.0, int64_t min_rank = 1, int64_t multiple = 1) {
  C10_CUDA_CHECK(sym_eig_launch(a.data_ptr<float>(), w.data_ptr<float>(), v.data_ptr<float>(),
                                static_cast<int>(a.size(0)), static_cast<int>(a.size(1)),
                                at::cuda::getCurrentCUDAStream(), energy, min_rank, multiple,
                                ranks));
}

// D > 128: sym_eig_rank of each matrix's descending eigenvalues w [batch, n], one thread each.
__global__ void sym_eig_rank_kernel(const float* __restrict__ w, int* __restrict__ ranks,
                                    int batch, int n, double energy, int min_rank,
                                    int multiple) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= batch) return;
  int order[kSymEigMaxDim];
  for (int j = 0; j < n; ++j) order[j] = j;
  ranks[i] = sym_eig_rank(w + static_cast<int64_t>(i) * n, order, n, energy, min_rank, multiple);
}

// D > 128: float64 eigh (cuSOLVER), then the kernel's order and sign convention.
std::tuple<at::Tensor, at::Tensor> sym_eig_eigh(const at::Tensor& a) {
  auto [w64, v64] = at::linalg_eigh(a.to(at::kDouble));
  at::Tensor w = w64.flip(-1).to(at::kFloat).contiguous();
  at::Tensor v = v64.flip(-1).to(at::kFloat);
  const at::Tensor big = v.gather(-2, v.abs().argmax(-2, /*keepdim=*/true));  // first on ties
  v = at::where(big < 0, -v, v).contiguous();
  return {w, v};
}

std::tuple<at::Tensor, at::Tensor> sym_eig_cuda(const at::Tensor& a) {
  check_sym_eig_input("sym_eig", a);
  const c10::cuda::CUDAGuard guard(a.device());
  const int dim = static_cast<int>(a.size(1));
  if (dim > kMaxSmemDim && a.size(0) > 0) return sym_eig_eigh(a);
  auto [w, v] = sym_eig_outputs(a);
  if (a.size(0) == 0) return {w, v};
  launch(a, w, v);
  return {w, v};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sym_eig_top_cuda(const at::Tensor& a,
                                                                double energy, int64_t min_rank,
                                                                int64_t multiple) {
  check_sym_eig_input("sym_eig_top", a);
  check_sym_eig_top_args(energy, min_rank, multiple);
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t batch = a.size(0), dim = a.size(1);
  at::Tensor ranks = at::empty({batch}, a.options().dtype(at::kInt));
  if (batch == 0) {
    auto [w, v] = sym_eig_outputs(a);
    return {w, v, ranks};
  }
  if (dim > kMaxSmemDim) {
    auto [w, v] = sym_eig_eigh(a);
    const int mr = static_cast<int>(std::min(min_rank, dim));
    const int mu = static_cast<int>(std::min(multiple, dim));
    sym_eig_rank_kernel<<<static_cast<unsigned>((batch + 127) / 128), 128, 0,
                          at::cuda::getCurrentCUDAStream()>>>(
        w.data_ptr<float>(), ranks.data_ptr<int>(), static_cast<int>(batch),
        static_cast<int>(dim), energy, mr, mu);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const at::Tensor keep = at::arange(dim, ranks.options().dtype(at::kLong)) <
                            ranks.unsqueeze(-1).unsqueeze(-1);
    return {w, at::where(keep, v, at::zeros({}, v.options())).contiguous(), ranks};
  }
  auto [w, v] = sym_eig_outputs(a);
  launch(a, w, v, ranks.data_ptr<int>(), energy, min_rank, multiple);
  return {w, v, ranks};
}

}  // namespace

TORCH_LIBRARY_IMPL(adaattn, CUDA, m) {
  m.impl("sym_eig", &sym_eig_cuda);
  m.impl("sym_eig_top", &sym_eig_top_cuda);
}

}  // namespace adaattn
