// Device-independent halves of the lazy ops: validation and AttnParams construction, shared by
// the CPU registration (lazy.cpp) and the CUDA one (lazy_cuda.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "../../core/params.h"
#include "../common/attention_inputs.h"

namespace adaattn {

// The public name of a lazy call, for errors: packed calls are lazy_attn_varlen's.
inline const char* lazy_op_name(const std::optional<at::Tensor>& cu_seqlens) {
  return cu_seqlens.has_value() ? "lazy_attn_varlen" : "lazy_attn";
}

// Validates tau float32 [Hq] and bias float32 [Hq, W] (W >= 1), both contiguous and on q's
// device (Hq = q.size(1)). Errors name `op` and the argument (common/checks.h).
void check_lazy_params(const char* op, const at::Tensor& q, const at::Tensor& tau,
                       const at::Tensor& bias);

// Validates q, k, v, seqlens (as flash; packed with one cu_seqlens for q and k), plus Lq <= Lk
// (packed: Tq == Tk), tau/bias (check_lazy_params) and softmax_scale.
void check_lazy_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const at::Tensor& tau, const at::Tensor& bias,
                       const std::optional<at::Tensor>& seqlens,
                       const std::optional<at::Tensor>& cu_seqlens,
                       std::optional<double> softmax_scale);

// The mask and math options of lazy attention: causal (bottom-right aligned), deterministic,
// scale default D^-1/2.
FlashOptions lazy_options(const char* op, const at::Tensor& q,
                          std::optional<double> softmax_scale);

// Causal params with tau/bias set; outputs/scratch pointers are null (callers set them).
AttnParams make_lazy_params(const char* op, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& tau, const at::Tensor& bias,
                            const std::optional<at::Tensor>& seqlens,
                            const std::optional<at::Tensor>& cu_seqlens,
                            std::optional<double> softmax_scale);

}  // namespace adaattn
