// CUDA registration of flash_fwd_fp8: the pre-pass (quantize_q8_cuda), then the 8-bit Hopper
// forward over its operands. fp16/bf16 q, k, v, dense [B, H, L, D], (D, Dv) in {(64, 64),
// (128, 128)}; current stream, no host synchronisation.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "../../attention_api.h"
#include "../common/attention_inputs.h"
#include "../common/cuda_inputs.h"

namespace adaattn {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_fwd_fp8_cuda_op(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    std::optional<double> fp8_tol) {
  const char* op = "flash_attn";
  check_flash_inputs(op, q_in, k_in, v_in, std::nullopt, std::nullopt, std::nullopt);
  TORCH_CHECK_TYPE(use_tensor_cores(q_in.scalar_type()), "adaattn.", op,
                   ": precision='fp8' takes float16 or bfloat16 q, k, v, got ",
                   q_in.scalar_type());
  const int64_t d = q_in.size(-1), dv = v_in.size(-1);
  TORCH_CHECK_VALUE((d == 64 && dv == 64) || (d == 128 && dv == 128), "adaattn.", op,
                    ": precision='fp8' needs head dims D = Dv in {64, 128}, got D = q.size(-1) = ",
                    d, ", Dv = v.size(-1) = ", dv);
  TORCH_CHECK(q8_forward_available(), "adaattn.", op,
              ": precision='fp8' needs an sm_90 GPU (H100/H200); use precision='bf16' here");
  TORCH_CHECK_VALUE(!fp8_tol.has_value() || (std::isfinite(*fp8_tol) && *fp8_tol >= 0),
                    "adaattn.", op, ": fp8_tol must be finite and >= 0, got ",
                    fp8_tol.value_or(0.0));
  const FlashOptions opt = resolve_flash_options(op, q_in, softmax_scale, causal, window_left,
                                                 window_right, BwdMode::kAtomic, 0.0);
  TORCH_CHECK_VALUE(opt.scale > 0, "adaattn.", op,
                    ": precision='fp8' needs softmax_scale > 0, got ", opt.scale);
  const at::Tensor q = tc_aligned(q_in);
  const at::Tensor k = tc_aligned(k_in);
  const at::Tensor v = tc_aligned(v_in);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty(out_shape(q, v), q.options());
  at::Tensor lse = at::empty(lse_shape(q, false), q.options().dtype(at::kFloat));
  if (no_rows(q, std::nullopt)) {
    return {out, lse, at::zeros({q.size(0), q.size(1)}, q.options().dtype(at::kBool))};
  }
  const Q8Operands ops = quantize_q8_cuda(q, k, v, fp8_tol.has_value());
  const at::Tensor run_q8 = choose_q8_heads_cuda(ops, fp8_tol, q.size(2), k.size(2), opt.scale);
  AttnParams p = make_params(q, k, v, std::nullopt, std::nullopt, std::nullopt, opt);
  set_fwd_outputs(p, out, lse);
  p.head_q8 = reinterpret_cast<const uint8_t*>(run_q8.data_ptr<bool>());  // bool: 1 byte, 0 / 1
  // The other heads on the 16-bit forward (each kernel skips the other's heads).
  attention_fwd_tc_cuda(softmax_variant(opt), p, q.scalar_type());
  p.q = ops.q.data_ptr();
  p.q_batch_stride = ops.q.stride(0);
  p.q_head_stride = ops.q.stride(1);
  p.q_row_stride = ops.q.stride(2);
  p.k = ops.k.data_ptr();
  p.k_batch_stride = ops.k.stride(0);
  p.k_head_stride = ops.k.stride(1);
  p.k_row_stride = ops.k.stride(2);
  p.v = ops.vt.data_ptr();
  p.v_batch_stride = ops.vt.stride(0);
  p.v_head_stride = ops.vt.stride(1);
  p.v_row_stride = ops.vt.stride(2);
  p.q_scale = ops.q_scale.data_ptr<float>();
  p.k_scale = ops.k_scale.data_ptr<float>();
  p.v_scale = ops.v_scale.data_ptr<float>();
  p.q_scale_blocks = static_cast<int>(ops.q_scale.size(2));
  p.k_scale_blocks = static_cast<int>(ops.k_scale.size(2));
  attention_fwd_q8_cuda(p, q.scalar_type());
  return {out, lse, run_q8};
}

}  // namespace

TORCH_LIBRARY_IMPL(adaattn, CUDA, m) { m.impl("flash_fwd_fp8", &flash_fwd_fp8_cuda_op); }

}  // namespace adaattn
