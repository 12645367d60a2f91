// The launcher and CUDA registration of sym_eig: D <= 128 runs the kernel of sym_eig_kernel.cuh
// (its header comment describes the kernel and its cost), D > 128 float64 at::linalg_eigh, then
// the same order and sign convention.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "../sym_eig_api.h"
#include "sym_eig_kernel.cuh"

namespace adaattn {
namespace {

void launch(const at::Tensor& a, at::Tensor& w, at::Tensor& v) {
  C10_CUDA_CHECK(sym_eig_launch(a.data_ptr<float>(), w.data_ptr<float>(), v.data_ptr<float>(),
                                static_cast<int>(a.size(0)), static_cast<int>(a.size(1)),
                                at::cuda::getCurrentCUDAStream()));
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
  check_sym_eig_input(a);
  const c10::cuda::CUDAGuard guard(a.device());
  const int dim = static_cast<int>(a.size(1));
  if (dim > kMaxSmemDim && a.size(0) > 0) return sym_eig_eigh(a);
  auto [w, v] = sym_eig_outputs(a);
  if (a.size(0) == 0) return {w, v};
  launch(a, w, v);
  return {w, v};
}

}  // namespace

TORCH_LIBRARY_IMPL(adaattn, CUDA, m) { m.impl("sym_eig", &sym_eig_cuda); }

}  // namespace adaattn
