// CUDA registration of the flash ops: fp16/bf16 go to the tensor-core kernels (head dims without a
// kernel of their own on the pair that covers them, see TcLayout), fp32/fp64 to the exact kernels.
// Launches on the current stream; no host synchronisation.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "../../attention_api.h"
#include "../common/attention_inputs.h"
#include "../common/cuda_inputs.h"

namespace adaattn {
namespace {

std::tuple<at::Tensor, at::Tensor> flash_fwd_cuda_op(const at::Tensor& q_in,
                                                     const at::Tensor& k_in,
                                                     const at::Tensor& v_in,
                                                     const std::optional<at::Tensor>& seqlens,
                                                     std::optional<double> softmax_scale,
                                                     bool causal, int64_t window_left,
                                                     int64_t window_right,
                                                     const std::optional<at::Tensor>& cu_seqlens_q,
                                                     const std::optional<at::Tensor>& cu_seqlens_k,
                                                     double softcap,
                                                     const std::optional<at::Tensor>& alibi_slopes,
                                                     const std::optional<at::Tensor>& sinks,
                                                     const std::optional<at::Tensor>& rel_bias) {
  const char* op = flash_op_name(cu_seqlens_q, cu_seqlens_k);
  check_flash_inputs(op, q_in, k_in, v_in, seqlens, cu_seqlens_q, cu_seqlens_k);
  // Resolved on the caller's q: the default scale is D^-1/2 of the caller's D, not the padded.
  const FlashOptions opt = resolve_flash_options(op, q_in, softmax_scale, causal, window_left,
                                                 window_right, BwdMode::kAtomic, softcap);
  const ScoreTensors mods(op, q_in, batch_entries(q_in, cu_seqlens_q), alibi_slopes, sinks,
                          rel_bias);
  const VariantId variant = softmax_variant(opt, mods);
  const TcLayout layout = tc_layout(op, q_in, v_in, variant);
  const at::Tensor q = layout.qk(q_in);
  const at::Tensor k = layout.qk(k_in);
  const at::Tensor v = layout.vo(v_in);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = empty_following(q_in, v.size(-1), q.options());
  at::Tensor lse = at::empty(lse_shape(q, cu_seqlens_q.has_value()), q.options().dtype(at::kFloat));
  if (no_rows(q, cu_seqlens_q)) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {layout.crop(out, layout.head_dim_v), lse};
  }
  AttnParams p = make_params(q, k, v, seqlens, cu_seqlens_q, cu_seqlens_k, opt);
  mods.set(p);
  set_fwd_outputs(p, out, lse);
  if (use_tensor_cores(q.scalar_type())) {
    attention_fwd_tc_cuda(variant, p, q.scalar_type());
  } else {
    attention_fwd_exact_cuda(variant, p, q.scalar_type());
  }
  return {layout.crop(out, layout.head_dim_v), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_bwd_cuda_op(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse,
    const std::optional<at::Tensor>& seqlens, std::optional<double> softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, bool deterministic,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
    double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& rel_bias,
    bool param_grads) {
  const char* op = flash_op_name(cu_seqlens_q, cu_seqlens_k);
  check_flash_inputs(op, q_in, k_in, v_in, seqlens, cu_seqlens_q, cu_seqlens_k);
  check_flash_bwd_inputs(op, dout_in, q_in, v_in, out_in, lse, cu_seqlens_q.has_value());
  const FlashOptions opt = resolve_flash_options(op, q_in, softmax_scale, causal, window_left,
                                                 window_right, flash_bwd_mode(deterministic),
                                                 softcap);
  const ScoreTensors mods(op, q_in, batch_entries(q_in, cu_seqlens_q), alibi_slopes, sinks,
                          rel_bias);
  const VariantId variant = softmax_variant(opt, mods);
  at::Tensor dsinks = mods.grad_like(mods.sinks, param_grads, q_in);
  at::Tensor drel_bias = mods.grad_like(mods.rel_bias, param_grads, q_in);
  const TcLayout layout = tc_layout(op, q_in, v_in, variant);
  const at::Tensor q = layout.qk(q_in);
  const at::Tensor k = layout.qk(k_in);
  const at::Tensor v = layout.vo(v_in);
  const at::Tensor out = layout.vo(out_in);
  const at::Tensor dout = layout.vo(dout_in);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor dq = empty_following(q_in, q.size(-1), q.options());
  at::Tensor dk = empty_following(k_in, k.size(-1), k.options());
  at::Tensor dv = empty_following(v_in, v.size(-1), v.options());
  if (no_rows(q, cu_seqlens_q) || k.numel() == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {layout.crop(dq, layout.head_dim), layout.crop(dk, layout.head_dim),
            layout.crop(dv, layout.head_dim_v), dsinks, drel_bias};
  }
  at::Tensor delta = at::empty(lse.sizes(), lse.options());
  AttnParams p = make_params(q, k, v, seqlens, cu_seqlens_q, cu_seqlens_k, opt);
  mods.set(p, &dsinks, &drel_bias);
  set_bwd_tensors(p, dout, out, lse, dq, dk, dv, delta);
  if (use_tensor_cores(q.scalar_type())) {
    attention_bwd_tc_cuda(variant, p, q.scalar_type());
  } else {
    attention_bwd_exact_cuda(variant, p, q.scalar_type());
  }
  return {layout.crop(dq, layout.head_dim), layout.crop(dk, layout.head_dim),
          layout.crop(dv, layout.head_dim_v), dsinks, drel_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(adaattn, CUDA, m) {
  m.impl("flash_fwd", &flash_fwd_cuda_op);
  m.impl("flash_bwd", &flash_bwd_cuda_op);
}

}  // namespace adaattn
