// Device-independent halves of the lazy ops: validation and AttnParams construction, shared by
// the CPU registration (lazy.cpp) and the CUDA one (lazy_cuda.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "../../core/params.h"

namespace adaattn {

// Validates q, k, v, seqlens (as flash; packed with one cu_seqlens for q and k), plus Lq <= Lk
// (packed: Tq == Tk), tau float32 [Hq], bias float32 [Hq, W] with W >= 1, both contiguous and on
// q's device. Errors name the argument.
void check_lazy_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& tau, const at::Tensor& bias,
                       const std::optional<at::Tensor>& seqlens,
                       const std::optional<at::Tensor>& cu_seqlens);

// Causal params with tau/bias set; outputs/scratch pointers are null (callers set them).
AttnParams make_lazy_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& tau, const at::Tensor& bias,
                            const std::optional<at::Tensor>& seqlens,
                            const std::optional<at::Tensor>& cu_seqlens,
                            std::optional<double> softmax_scale);

}  // namespace adaattn
