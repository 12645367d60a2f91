// CUDA registration of flash_fwd_fp8: the pre-pass (quantize_q8_cuda), then the 8-bit Hopper
// forward over its operands. fp16/bf16 q, k, v, dense [B, H, L, D], (D, Dv) in {(64, 64),
// (128, 128)}; current stream, no host synchronisation.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "../../attention_api.h"
#include "../common/attention_inputs.h"
#include "../common/cuda_inputs.h"

namespace adaattn {
namespace {

// Heads that run 8-bit: asked for (head_fp8) and with finite scales (finite q, k and v).
at::Tensor heads_to_quantize(const Q8Operands& ops, const std::optional<at::Tensor>& head_fp8,
                             int64_t heads_q) {
  const at::Tensor q_ok = at::isfinite(ops.q_scale).all(-1);
  const at::Tensor kv_ok =
      at::logical_and(at::isfinite(ops.k_scale).all(-1), at::isfinite(ops.v_scale).all(-1));
  at::Tensor ok = at::logical_and(q_ok, kv_ok.repeat_interleave(heads_q / kv_ok.size(1), 1));
  if (head_fp8.has_value()) ok = at::logical_and(ok, *head_fp8);
  return ok;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_fwd_fp8_cuda_op(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    const std::optional<at::Tensor>& head_fp8) {
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
  if (head_fp8.has_value()) {
    const at::Tensor& hf = *head_fp8;
    TORCH_CHECK_TYPE(hf.scalar_type() == at::kBool, "adaattn.", op,
                     ": head_fp8 must be bool, got ", hf.scalar_type());
    TORCH_CHECK_VALUE(hf.dim() == 2 && hf.size(0) == q_in.size(0) && hf.size(1) == q_in.size(1),
                      "adaattn.", op, ": head_fp8 must have shape [B, Hq] = [", q_in.size(0),
                      ", ", q_in.size(1), "], got ", hf.sizes());
    TORCH_CHECK(hf.device() == q_in.device(), "adaattn.", op,
                ": head_fp8 must be on q's device ", q_in.device(), ", got ", hf.device());
  }
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
  const Q8Operands ops = quantize_q8_cuda(q, k, v);
  const at::Tensor run_q8 = heads_to_quantize(ops, head_fp8, q.size(1));
  const at::Tensor head_q8 = run_q8.to(at::kByte).contiguous();
  AttnParams p = make_params(q, k, v, std::nullopt, std::nullopt, std::nullopt, opt);
  set_fwd_outputs(p, out, lse);
  p.head_q8 = head_q8.data_ptr<uint8_t>();
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
