// Launchers of the linear-attention family, one per device path. Each takes fully
// validated parameters (see linear_ops.h) whose outputs are allocated and writes every output
// element: forward: out and state_out; backward: dq, dk, dv and dstate_in.
#pragma once

#include <c10/core/ScalarType.h>

#include "core/linear.h"

namespace adaattn {

// CPU, float32 or float64 (the op upcasts fp16/bf16). Chunked (64 rows), accumulating in
// double, parallel over sequences x heads, deterministic.
void linear_fwd_cpu(const LinearParams& p, c10::ScalarType dtype);
void linear_bwd_cpu(const LinearParams& p, c10::ScalarType dtype);

#ifdef ADAATTN_WITH_CUDA
// CUDA exact path, float32 or float64: one block per (sequence, head) scanning the rows in
// order, state accumulated in double. The op also routes fp16/bf16 here (upcast to float32).
void linear_fwd_exact_cuda(const LinearParams& p, c10::ScalarType dtype);
void linear_bwd_exact_cuda(const LinearParams& p, c10::ScalarType dtype);
// Tensor-core path (fp16/bf16, D and Dv in {64, 128}): chunked (64 rows) kernels, MMA operands
// in the input dtype, fp32 accumulation and fp32 states (cuda/tc/linear_kernels.h). Same contract
// as the exact launchers with q/k/v/dout in fp16/bf16 and float32 states; q, k, v and dout need
// 16-byte aligned rows (base pointer and every stride but the last a multiple of 8 elements).
void linear_fwd_tc_cuda(const LinearParams& p, c10::ScalarType dtype);
void linear_bwd_tc_cuda(const LinearParams& p, c10::ScalarType dtype);

// Whether the tensor-core path takes this dtype and head dims.
inline bool linear_tc_supports(c10::ScalarType dtype, int64_t dim, int64_t dim_v) {
  const auto ok = [](int64_t x) { return x == 64 || x == 128; };
  return (dtype == c10::ScalarType::Half || dtype == c10::ScalarType::BFloat16) && ok(dim) &&
         ok(dim_v);
}
#endif

}  // namespace adaattn
