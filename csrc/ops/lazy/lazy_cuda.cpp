// CUDA registration of the lazy ops: fp16/bf16 go to the tensor-core kernels (head dims without a
// kernel of their own on the pair that covers them, see TcLayout), fp32/fp64 to the exact kernels.
// Launches on the current stream; no host synchronisation.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "../../attention_api.h"
#include "../common/attention_inputs.h"
#include "../common/cuda_inputs.h"
#include "lazy_ops.h"

namespace adaattn {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> lazy_fwd_cuda_op(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& tau,
    const at::Tensor& bias, const std::optional<at::Tensor>& seqlens,
    std::optional<double> softmax_scale, bool return_stats,
    const std::optional<at::Tensor>& cu_seqlens) {
  const char* op = lazy_op_name(cu_seqlens);
  check_lazy_inputs(op, q_in, k_in, v_in, tau, bias, seqlens, cu_seqlens, softmax_scale);
  const TcLayout layout = tc_layout(op, q_in, v_in, VariantId::kLazy);
  const bool tc = layout.tc && q_in.numel() > 0 && k_in.numel() > 0;
  const at::Tensor q = layout.qk(q_in);
  const at::Tensor k = layout.qk(k_in);
  const at::Tensor v = layout.vo(v_in);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty(out_shape(q, v), q.options());
  at::Tensor lse = at::empty(lse_shape(q, cu_seqlens.has_value()), q.options().dtype(at::kFloat));
  at::Tensor stats = return_stats ? at::zeros({4}, q.options().dtype(at::kLong))
                                  : at::empty({0}, q.options().dtype(at::kLong));
  if (no_rows(q, cu_seqlens)) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {layout.crop(out, layout.head_dim_v), lse, stats};
  }
  AttnParams p = make_lazy_params(op, q, k, v, tau, bias, seqlens, cu_seqlens,
                                   layout.scale(softmax_scale));
  set_fwd_outputs(p, out, lse);
  p.stats = return_stats ? stats.data_ptr<int64_t>() : nullptr;
  if (tc) {
    attention_fwd_tc_cuda(VariantId::kLazy, p, q.scalar_type());
  } else {
    attention_fwd_exact_cuda(VariantId::kLazy, p, q.scalar_type());
  }
  return {layout.crop(out, layout.head_dim_v), lse, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lazy_bwd_cuda_op(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& tau, const at::Tensor& bias,
    const at::Tensor& out_in, const at::Tensor& lse, const std::optional<at::Tensor>& seqlens,
    std::optional<double> softmax_scale, bool param_grads,
    const std::optional<at::Tensor>& cu_seqlens) {
  const char* op = lazy_op_name(cu_seqlens);
  check_lazy_inputs(op, q_in, k_in, v_in, tau, bias, seqlens, cu_seqlens, softmax_scale);
  check_flash_bwd_inputs(op, dout_in, q_in, v_in, out_in, lse, cu_seqlens.has_value());
  const TcLayout layout = tc_layout(op, q_in, v_in, VariantId::kLazy);
  const bool tc = layout.tc && q_in.numel() > 0 && k_in.numel() > 0;
  const at::Tensor q = layout.qk(q_in);
  const at::Tensor k = layout.qk(k_in);
  const at::Tensor v = layout.vo(v_in);
  const at::Tensor out = layout.vo(out_in);
  const at::Tensor dout = layout.vo(dout_in);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  const bool empty = no_rows(q, cu_seqlens) || k.numel() == 0;
  // Without parameter gradients (or with nothing to reduce) dtau/dbias are zeros.
  at::Tensor dtau = param_grads && !empty ? at::empty(tau.sizes(), tau.options())
                                          : at::zeros(tau.sizes(), tau.options());
  at::Tensor dbias = param_grads && !empty ? at::empty(bias.sizes(), bias.options())
                                           : at::zeros(bias.sizes(), bias.options());
  if (empty) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {layout.crop(dq, layout.head_dim), layout.crop(dk, layout.head_dim),
            layout.crop(dv, layout.head_dim_v), dtau, dbias};
  }
  at::Tensor delta = at::empty(lse.sizes(), lse.options());
  at::Tensor row_g = at::empty(lse.sizes(), lse.options());
  AttnParams p = make_lazy_params(op, q, k, v, tau, bias, seqlens, cu_seqlens,
                                   layout.scale(softmax_scale));
  set_bwd_tensors(p, dout, out, lse, dq, dk, dv, delta);
  p.row_g = row_g.data_ptr<float>();
  if (param_grads) {
    p.dtau = dtau.data_ptr<float>();
    p.dbias = dbias.data_ptr<float>();
  }
  if (tc) {
    attention_bwd_tc_cuda(VariantId::kLazy, p, q.scalar_type());
  } else {
    attention_bwd_exact_cuda(VariantId::kLazy, p, q.scalar_type());
  }
  return {layout.crop(dq, layout.head_dim), layout.crop(dk, layout.head_dim),
          layout.crop(dv, layout.head_dim_v), dtau, dbias};
}

// ---- block ops (ring_lazy_attn; lazy_ops.h) --------------------------------------------------

void run_lazy_fwd(const AttnParams& p, bool tc, c10::ScalarType dtype) {
  if (tc) {
    attention_fwd_tc_cuda(VariantId::kLazy, p, dtype);
  } else {
    attention_fwd_exact_cuda(VariantId::kLazy, p, dtype);
  }
}

void run_lazy_bwd(const AttnParams& p, bool tc, c10::ScalarType dtype) {
  if (tc) {
    attention_bwd_tc_cuda(VariantId::kLazy, p, dtype);
  } else {
    attention_bwd_exact_cuda(VariantId::kLazy, p, dtype);
  }
}

at::Tensor lazy_block_lse_cuda_op(const at::Tensor& q_in, const at::Tensor& k_in,
                                  const at::Tensor& tau, const at::Tensor& bias,
                                  std::optional<double> softmax_scale, int64_t q_position,
                                  int64_t k_position) {
  const char* op = "lazy_block_lse";
  check_lazy_block_inputs(op, q_in, k_in, k_in, tau, bias, softmax_scale, q_position, k_position);
  const TcLayout layout = tc_layout(op, q_in, k_in, VariantId::kLazy);
  const at::Tensor q = layout.qk(q_in);
  const at::Tensor k = layout.qk(k_in);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor lse = at::empty(lse_shape(q, false), q.options().dtype(at::kFloat));
  if (q.numel() == 0 || k.numel() == 0) {
    return lse.fill_(-std::numeric_limits<float>::infinity());
  }
  // k stands in for v, which the lse pass does not read.
  AttnParams p = make_lazy_block_params(op, q, k, k, tau, bias, layout.scale(softmax_scale),
                                        q_position, k_position);
  p.lse = lse.data_ptr<float>();  // out is not written
  p.lse_pass = LsePass::kOnly;
  run_lazy_fwd(p, layout.tc, q.scalar_type());
  return lse;
}

at::Tensor lazy_block_out_cuda_op(const at::Tensor& q_in, const at::Tensor& k_in,
                                  const at::Tensor& v_in, const at::Tensor& tau,
                                  const at::Tensor& bias, const at::Tensor& lse,
                                  std::optional<double> softmax_scale, int64_t q_position,
                                  int64_t k_position) {
  const char* op = "lazy_block_out";
  check_lazy_block_inputs(op, q_in, k_in, v_in, tau, bias, softmax_scale, q_position, k_position);
  check_lazy_row_stat(op, "lse", lse, q_in);
  const TcLayout layout = tc_layout(op, q_in, v_in, VariantId::kLazy);
  const at::Tensor q = layout.qk(q_in);
  const at::Tensor k = layout.qk(k_in);
  const at::Tensor v = layout.vo(v_in);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty(out_shape(q, v), q.options());
  if (q.numel() == 0 || k.numel() == 0) {
    out.zero_();
    return layout.crop(out, layout.head_dim_v);
  }
  AttnParams p = make_lazy_block_params(op, q, k, v, tau, bias, layout.scale(softmax_scale),
                                        q_position, k_position);
  at::Tensor lse_in = lse;
  set_fwd_outputs(p, out, lse_in);  // lse is read, not written
  p.lse_pass = LsePass::kGiven;
  run_lazy_fwd(p, layout.tc, q.scalar_type());
  return layout.crop(out, layout.head_dim_v);
}

std::tuple<at::Tensor, at::Tensor> lazy_block_row_terms_cuda_op(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& tau, const at::Tensor& bias, const at::Tensor& lse,
    std::optional<double> softmax_scale, int64_t q_position, int64_t k_position) {
  const char* op = "lazy_block_row_terms";
  check_lazy_block_inputs(op, q_in, k_in, v_in, tau, bias, softmax_scale, q_position, k_position);
  check_flash_bwd_inputs(op, dout_in, q_in, v_in, dout_in, lse, false);
  const TcLayout layout = tc_layout(op, q_in, v_in, VariantId::kLazy);
  const at::Tensor q = layout.qk(q_in);
  const at::Tensor k = layout.qk(k_in);
  const at::Tensor v = layout.vo(v_in);
  const at::Tensor dout = layout.vo(dout_in);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor delta = at::zeros(lse.sizes(), lse.options());
  at::Tensor row_g = at::zeros(lse.sizes(), lse.options());
  if (q.numel() == 0 || k.numel() == 0) return {delta, row_g};
  AttnParams p = make_lazy_block_params(op, q, k, v, tau, bias, layout.scale(softmax_scale),
                                        q_position, k_position);
  set_lazy_block_row_pass(p, dout, lse, delta, row_g);
  run_lazy_bwd(p, layout.tc, q.scalar_type());
  return {delta, row_g};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lazy_block_bwd_cuda_op(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& tau, const at::Tensor& bias, const at::Tensor& lse,
    const at::Tensor& delta, std::optional<double> softmax_scale, int64_t q_position,
    int64_t k_position, bool bias_grad) {
  const char* op = "lazy_block_bwd";
  check_lazy_block_inputs(op, q_in, k_in, v_in, tau, bias, softmax_scale, q_position, k_position);
  check_flash_bwd_inputs(op, dout_in, q_in, v_in, dout_in, lse, false);
  check_lazy_row_stat(op, "delta", delta, q_in);
  const TcLayout layout = tc_layout(op, q_in, v_in, VariantId::kLazy);
  const at::Tensor q = layout.qk(q_in);
  const at::Tensor k = layout.qk(k_in);
  const at::Tensor v = layout.vo(v_in);
  const at::Tensor dout = layout.vo(dout_in);
  const c10::cuda::CUDAGuard guard(q.device());
  const bool empty = q.numel() == 0 || k.numel() == 0;
  at::Tensor dq = empty ? at::zeros(q.sizes(), q.options()) : at::empty(q.sizes(), q.options());
  at::Tensor dk = empty ? at::zeros(k.sizes(), k.options()) : at::empty(k.sizes(), k.options());
  at::Tensor dv = empty ? at::zeros(v.sizes(), v.options()) : at::empty(v.sizes(), v.options());
  at::Tensor dbias = bias_grad && !empty ? at::empty(bias.sizes(), bias.options())
                                         : at::zeros(bias.sizes(), bias.options());
  if (!empty) {
    AttnParams p = make_lazy_block_params(op, q, k, v, tau, bias, layout.scale(softmax_scale),
                                          q_position, k_position);
    at::Tensor delta_in = delta;
    // Without normalisation the backward never reads out (dout stands in for it).
    set_bwd_tensors(p, dout, dout, lse, dq, dk, dv, delta_in);
    p.row_pass = LsePass::kGiven;
    if (bias_grad) p.dbias = dbias.data_ptr<float>();
    run_lazy_bwd(p, layout.tc, q.scalar_type());
  }
  return {layout.crop(dq, layout.head_dim), layout.crop(dk, layout.head_dim),
          layout.crop(dv, layout.head_dim_v), dbias};
}

}  // namespace

TORCH_LIBRARY_IMPL(adaattn, CUDA, m) {
  m.impl("lazy_fwd", &lazy_fwd_cuda_op);
  m.impl("lazy_bwd", &lazy_bwd_cuda_op);
  m.impl("lazy_block_lse", &lazy_block_lse_cuda_op);
  m.impl("lazy_block_out", &lazy_block_out_cuda_op);
  m.impl("lazy_block_row_terms", &lazy_block_row_terms_cuda_op);
  m.impl("lazy_block_bwd", &lazy_block_bwd_cuda_op);
}

}  // namespace adaattn
