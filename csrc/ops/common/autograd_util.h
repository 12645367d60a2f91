// Pieces shared by the C++ autograd functions of every op family.
#pragma once

#include <torch/autograd.h>

#include <optional>

namespace adaattn {

// softmax_scale through the context (saved_data holds IValues, which have no optional double).
inline void save_scale(torch::autograd::AutogradContext* ctx, std::optional<double> scale) {
  ctx->saved_data["has_scale"] = scale.has_value();
  ctx->saved_data["scale"] = scale.value_or(0.0);
}

inline std::optional<double> saved_scale(torch::autograd::AutogradContext* ctx) {
  if (!ctx->saved_data["has_scale"].toBool()) return std::nullopt;
  return ctx->saved_data["scale"].toDouble();
}

// An optional tensor saved as an undefined one.
inline std::optional<at::Tensor> saved_optional(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The incoming gradient of `out` as the backward ops take it: zeros when autograd passes none,
// with a contiguous last dim. sym_stride keeps torch.compile from guarding on shapes.
inline at::Tensor output_grad(const at::Tensor& grad, const at::Tensor& out) {
  at::Tensor g = grad.defined() ? grad : at::zeros_like(out);
  return g.sym_stride(-1) != 1 ? g.contiguous() : g;
}

}  // namespace adaattn
