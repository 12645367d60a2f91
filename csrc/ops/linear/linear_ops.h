// Device-independent halves of the linear-attention ops: validation and LinearParams
// construction, shared by the CPU registration (linear.cpp) and the CUDA one (linear_cuda.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

#include "../../core/linear.h"

namespace adaattn {

// Validates the inputs of linear_fwd/linear_bwd; errors name the argument. Dense: q/k
// [B, H, T, D], v [B, H, T, Dv]. Packed (cu_seqlens given): q/k [T, H, D], v [T, H, Dv],
// cu_seqlens int32 [N + 1]. initial_state: [N, H, D, Dv + normalize] in linear_state_dtype(q).
// Returns the parsed feature map.
FeatureMap check_linear_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& initial_state,
                               const std::optional<at::Tensor>& cu_seqlens,
                               const std::string& feature_map, bool normalize);

// Checks grad_out (out's shape and q's dtype) and grad_state (the state's shape and dtype).
void check_linear_grads(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_state,
                        const at::Tensor& q, const at::Tensor& v,
                        const std::optional<at::Tensor>& cu_seqlens, bool normalize);

// float64 for float64 inputs, float32 otherwise (fp16/bf16 are computed in float32).
at::ScalarType linear_state_dtype(const at::Tensor& q);

// Shape of the state [N, H, D, Dv + normalize].
std::vector<int64_t> linear_state_shape(const at::Tensor& q, const at::Tensor& v,
                                        const std::optional<at::Tensor>& cu_seqlens,
                                        bool normalize);

// Input pointers, shapes and options; output/backward pointers are null (callers set them).
// q, k, v must already be in the compute dtype (float32/float64).
LinearParams make_linear_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::optional<at::Tensor>& initial_state,
                                const std::optional<at::Tensor>& cu_seqlens, FeatureMap fmap,
                                bool causal, bool normalize);

LinearStrides linear_strides(const at::Tensor& t);

}  // namespace adaattn
