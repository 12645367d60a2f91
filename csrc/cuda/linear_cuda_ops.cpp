// CUDA registration of the linear-attention ops. float32/float64 run the exact kernels;
// float16/bfloat16 are upcast to float32 for the exact kernels (and the output cast back) until
// tensor-core kernels (linear_fwd_tc_cuda / linear_bwd_tc_cuda in linear_api.h) exist.
// Launches on the current stream; no host synchronisation (cu_seqlens' values are not read on
// the host: the kernels clamp them, and packed outputs start zeroed so rows outside every
// sequence read 0).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <string>

#include "../linear_api.h"
#include "../linear_ops.h"

namespace adaattn {
namespace {

at::Tensor exact_compute(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16 ? t.to(at::kFloat) : t;
}

at::Tensor output_like(const at::Tensor& t, bool packed) {
  return packed ? at::zeros(t.sizes(), t.options()) : at::empty(t.sizes(), t.options());
}

std::optional<at::Tensor> contiguous_opt(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

std::tuple<at::Tensor, at::Tensor> linear_fwd_cuda_op(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& initial_state_in, const std::optional<at::Tensor>& cu_seqlens,
    c10::string_view feature_map, bool causal, bool normalize) {
  const FeatureMap fmap = check_linear_inputs(q_in, k_in, v_in, initial_state_in, cu_seqlens,
                                              std::string(feature_map), normalize);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = exact_compute(q_in), k = exact_compute(k_in), v = exact_compute(v_in);
  const auto initial_state = contiguous_opt(initial_state_in);
  const bool packed = cu_seqlens.has_value();
  at::Tensor out = output_like(v, packed);
  at::Tensor state = at::empty(linear_state_shape(q, v, cu_seqlens, normalize), q.options());
  if (state.numel() > 0) {
    LinearParams p =
        make_linear_params(q, k, v, initial_state, cu_seqlens, fmap, causal, normalize);
    p.out = out.data_ptr();
    p.o_s = linear_strides(out);
    p.state_out = state.data_ptr();
    linear_fwd_exact_cuda(p, q.scalar_type());
  }
  return {out.to(q_in.scalar_type()), state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_bwd_cuda_op(
    const at::Tensor& dout_in, const std::optional<at::Tensor>& grad_state_in,
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& initial_state_in, const std::optional<at::Tensor>& cu_seqlens,
    c10::string_view feature_map, bool causal, bool normalize) {
  const FeatureMap fmap = check_linear_inputs(q_in, k_in, v_in, initial_state_in, cu_seqlens,
                                              std::string(feature_map), normalize);
  check_linear_grads(dout_in, grad_state_in, q_in, v_in, cu_seqlens, normalize);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = exact_compute(q_in), k = exact_compute(k_in), v = exact_compute(v_in);
  const at::Tensor dout = exact_compute(dout_in);
  const auto initial_state = contiguous_opt(initial_state_in);
  const auto grad_state = contiguous_opt(grad_state_in);
  const bool packed = cu_seqlens.has_value();
  at::Tensor dq = output_like(q, packed);
  at::Tensor dk = output_like(k, packed);
  at::Tensor dv = output_like(v, packed);
  at::Tensor dstate = at::empty(linear_state_shape(q, v, cu_seqlens, normalize), q.options());
  if (dstate.numel() > 0) {
    LinearParams p =
        make_linear_params(q, k, v, initial_state, cu_seqlens, fmap, causal, normalize);
    p.dout = dout.data_ptr();
    p.do_s = linear_strides(dout);
    p.dstate = grad_state.has_value() ? grad_state->data_ptr() : nullptr;
    p.dq = dq.data_ptr();
    p.dk = dk.data_ptr();
    p.dv = dv.data_ptr();
    p.dq_s = linear_strides(dq);
    p.dk_s = linear_strides(dk);
    p.dv_s = linear_strides(dv);
    p.dstate_in = dstate.data_ptr();
    linear_bwd_exact_cuda(p, q.scalar_type());
  }
  const auto t = q_in.scalar_type();
  return {dq.to(t), dk.to(t), dv.to(t), dstate};
}

}  // namespace

TORCH_LIBRARY_IMPL(adaattn, CUDA, m) {
  m.impl("linear_fwd", &linear_fwd_cuda_op);
  m.impl("linear_bwd", &linear_bwd_cuda_op);
}

}  // namespace adaattn
