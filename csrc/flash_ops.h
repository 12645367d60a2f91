// Device-independent halves of the flash ops: argument validation, output allocation and
// AttnParams construction. The CPU and CUDA registrations wrap these with their launchers.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "core/params.h"

namespace adaattn {

// Everything the mask and the math need, resolved from the op's arguments.
struct FlashOptions {
  double scale;
  int window_left;
  int window_right;
  bool deterministic;
};

FlashOptions resolve_flash_options(const at::Tensor& q, std::optional<double> softmax_scale,
                                   bool causal, int64_t window_left, int64_t window_right,
                                   bool deterministic);

// Validates q, k, v, seqlens (names the offending argument on failure).
void check_flash_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& seqlens);

// Validates dout/out/lse against q for the backward op.
void check_flash_bwd_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out,
                            const at::Tensor& lse);

// Fills sizes, strides, pointers and mask/math fields shared by forward and backward.
AttnParams make_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& seqlens, const FlashOptions& opt);

void set_fwd_outputs(AttnParams& p, at::Tensor& out, at::Tensor& lse);
void set_bwd_tensors(AttnParams& p, const at::Tensor& dout, const at::Tensor& out,
                     const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                     at::Tensor& delta);

}  // namespace adaattn
