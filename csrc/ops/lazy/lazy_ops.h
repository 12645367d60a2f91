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

// The block ops of ring_lazy_attn (adaattn/distributed.py): one block of a sequence sharded over
// ranks, dense q [B, Hq, Lq, D] against k/v [B, Hkv, Lk, D] with query row r at position
// q_position + r and key j at k_position + j (causal on those positions, the bias on their
// distance, tau / (i + 1) on the query's). Validates the inputs as check_lazy_inputs (no
// seqlens) plus the positions (>= 0, int32).
void check_lazy_block_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, const at::Tensor& tau, const at::Tensor& bias,
                             std::optional<double> softmax_scale, int64_t q_position,
                             int64_t k_position);

// Validates a per-row float32 statistic (lse, delta) given to a block op: [B, Hq, Lq] like q's
// rows, contiguous, on q's device. Errors name `name`.
void check_lazy_row_stat(const char* op, const char* name, const at::Tensor& t,
                         const at::Tensor& q);

// make_lazy_params with the block's positions.
AttnParams make_lazy_block_params(const char* op, const at::Tensor& q, const at::Tensor& k,
                                  const at::Tensor& v, const at::Tensor& tau,
                                  const at::Tensor& bias, std::optional<double> softmax_scale,
                                  int64_t q_position, int64_t k_position);

// The tensors of a block's backward row pass alone (LsePass::kOnly): grad_out and lse read,
// delta and row_g written; nothing else is touched.
void set_lazy_block_row_pass(AttnParams& p, const at::Tensor& dout, const at::Tensor& lse,
                             at::Tensor& delta, at::Tensor& row_g);

}  // namespace adaattn
