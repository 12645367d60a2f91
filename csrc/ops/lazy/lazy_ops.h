// Device-independent halves of the lazy ops: validation and AttnParams construction, shared by
// the CPU registration (lazy.cpp) and the CUDA one (lazy_cuda.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "../../core/params.h"
#include "../common/attention_inputs.h"

namespace adaattn {

// Validates tau float32 [Hq] and bias float32 [Hq, W] (W >= 1), both contiguous and on q's
// device (Hq = q.size(1)). Errors name the argument.
void check_lazy_params(const at::Tensor& q, const at::Tensor& tau, const at::Tensor& bias);

// Validates q, k, v, seqlens (as flash; packed with one cu_seqlens for q and k), plus Lq <= Lk
// (packed: Tq == Tk) and tau/bias (check_lazy_params). Errors name the argument.
void check_lazy_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& tau, const at::Tensor& bias,
                       const std::optional<at::Tensor>& seqlens,
                       const std::optional<at::Tensor>& cu_seqlens);

// The mask and math options of lazy attention: causal (bottom-right aligned), deterministic,
// scale default D^-1/2.
FlashOptions lazy_options(const at::Tensor& q, std::optional<double> softmax_scale);

// Causal params with tau/bias set; outputs/scratch pointers are null (callers set them).
AttnParams make_lazy_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& tau, const at::Tensor& bias,
                            const std::optional<at::Tensor>& seqlens,
                            const std::optional<at::Tensor>& cu_seqlens,
                            std::optional<double> softmax_scale);

}  // namespace adaattn
