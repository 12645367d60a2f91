// CUDA registration of the linear-attention ops. float16/bfloat16 with D and Dv in {64, 128} run
// the tensor-core kernels (linear_fwd_tc_cuda / linear_bwd_tc_cuda, states in float32);
// float32/float64 run the exact kernels, and so do other float16/bfloat16 shapes, upcast to
// float32 (the outputs cast back).
// Launches on the current stream; no host synchronisation (cu_seqlens' values are not read on
// the host: the kernels clamp them, and packed outputs start zeroed so rows outside every
// sequence read 0).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <string>

#include "../../linear_api.h"
#include "linear_ops.h"

namespace adaattn {
namespace {

at::Tensor exact_compute(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16 ? t.to(at::kFloat) : t;
}

// The tensor-core path: fp16/bf16, D and Dv in {64, 128}, heads within a grid dimension.
bool use_tc(const at::Tensor& q, const at::Tensor& v) {
  return linear_tc_supports(q.scalar_type(), q.size(-1), v.size(-1)) && q.size(1) <= 65535;
}

// cp.async moves 16-byte row pieces: the base pointer and every stride but the last must be a
// multiple of 8 elements. Other layouts are copied once.
at::Tensor tc_operand(const at::Tensor& t) {
  auto ok = [](const at::Tensor& x) {
    if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) return false;
    for (int64_t d = 0; d + 1 < x.dim(); ++d) {
      if (x.stride(d) % 8 != 0) return false;
    }
    return true;
  };
  if (ok(t)) return t;
  at::Tensor c = t.contiguous();
  return ok(c) ? c : c.clone();
}

at::TensorOptions state_options(const at::Tensor& q) {
  return q.options().dtype(linear_state_dtype(q));
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
  const bool tc = use_tc(q_in, v_in);
  const auto prepare = [&](const at::Tensor& t) { return tc ? tc_operand(t) : exact_compute(t); };
  const at::Tensor q = prepare(q_in), k = prepare(k_in), v = prepare(v_in);
  const auto initial_state = contiguous_opt(initial_state_in);
  const bool packed = cu_seqlens.has_value();
  at::Tensor out = output_like(v, packed);
  at::Tensor state =
      at::empty(linear_state_shape(q, v, cu_seqlens, normalize), state_options(q_in));
  if (state.numel() > 0) {
    LinearParams p =
        make_linear_params(q, k, v, initial_state, cu_seqlens, fmap, causal, normalize);
    p.out = out.data_ptr();
    p.o_s = linear_strides(out);
    p.state_out = state.data_ptr();
    if (tc) {
      linear_fwd_tc_cuda(p, q.scalar_type());
    } else {
      linear_fwd_exact_cuda(p, q.scalar_type());
    }
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
  const bool tc = use_tc(q_in, v_in);
  const auto prepare = [&](const at::Tensor& t) { return tc ? tc_operand(t) : exact_compute(t); };
  const at::Tensor q = prepare(q_in), k = prepare(k_in), v = prepare(v_in);
  const at::Tensor dout = prepare(dout_in);
  const auto initial_state = contiguous_opt(initial_state_in);
  const auto grad_state = contiguous_opt(grad_state_in);
  const bool packed = cu_seqlens.has_value();
  at::Tensor dq = output_like(q, packed);
  at::Tensor dk = output_like(k, packed);
  at::Tensor dv = output_like(v, packed);
  at::Tensor dstate =
      at::empty(linear_state_shape(q, v, cu_seqlens, normalize), state_options(q_in));
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
    if (tc) {
      linear_bwd_tc_cuda(p, q.scalar_type());
    } else {
      linear_bwd_exact_cuda(p, q.scalar_type());
    }
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
