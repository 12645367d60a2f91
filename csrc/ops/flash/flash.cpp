// The flash family (dense and packed softmax attention, softcap): its schemas, the CPU
// registration and the C++ autograd function registered at the Autograd key. Validation and
// AttnParams construction are the attention core's (common/attention_inputs.h); the CUDA
// registration is flash_cuda.cpp.
#include <torch/autograd.h>
#include <torch/library.h>

#include <limits>

#include "../../attention_api.h"
#include "../common/attention_inputs.h"
#include "../common/autograd_util.h"
#include "../common/checks.h"

namespace adaattn {

namespace {

std::tuple<at::Tensor, at::Tensor> flash_fwd_cpu_op(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& seqlens, std::optional<double> softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& rel_bias) {
  const char* op = flash_op_name(cu_seqlens_q, cu_seqlens_k);
  check_flash_inputs(op, q_in, k_in, v_in, seqlens, cu_seqlens_q, cu_seqlens_k);
  const FlashOptions opt = resolve_flash_options(op, q_in, softmax_scale, causal, window_left,
                                                 window_right, BwdMode::kAtomic, softcap);
  const ScoreTensors mods(op, q_in, batch_entries(q_in, cu_seqlens_q), alibi_slopes, sinks,
                          rel_bias);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  const bool packed = cu_seqlens_q.has_value();
  at::Tensor out = empty_following(q_in, v.size(-1), q.options());
  at::Tensor lse = at::empty(lse_shape(q, packed), q.options().dtype(at::kFloat));
  if (no_rows(q, cu_seqlens_q)) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
  } else {
    AttnParams p = make_params(q, k, v, seqlens, cu_seqlens_q, cu_seqlens_k, opt);
    mods.set(p);
    set_fwd_outputs(p, out, lse);
    attention_fwd_cpu(softmax_variant(opt, mods), p, q.scalar_type());
  }
  return {out.to(q_in.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_bwd_cpu_op(
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
  at::Tensor dsinks = mods.grad_like(mods.sinks, param_grads, q_in);
  at::Tensor drel_bias = mods.grad_like(mods.rel_bias, param_grads, q_in);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  const at::Tensor out = cpu_compute(out_in), dout = cpu_compute(dout_in);
  at::Tensor dq = empty_following(q_in, q.size(-1), q.options());
  at::Tensor dk = empty_following(k_in, k.size(-1), k.options());
  at::Tensor dv = empty_following(v_in, v.size(-1), v.options());
  at::Tensor delta = at::empty(lse.sizes(), lse.options());
  if (!no_rows(q, cu_seqlens_q) && k.numel() > 0) {
    AttnParams p = make_params(q, k, v, seqlens, cu_seqlens_q, cu_seqlens_k, opt);
    mods.set(p, &dsinks, &drel_bias);
    set_bwd_tensors(p, dout, out, lse, dq, dk, dv, delta);
    attention_bwd_cpu(softmax_variant(opt, mods), p, q.scalar_type());
  } else {
    dq.zero_();
    dk.zero_();
    dv.zero_();
  }
  const auto t = q_in.scalar_type();
  return {dq.to(t), dk.to(t), dv.to(t), dsinks, drel_bias};
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

using FlashFwdSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
    std::optional<double>, bool, int64_t, int64_t, const OptTensor&, const OptTensor&, double,
    const OptTensor&, const OptTensor&, const OptTensor&);
using FlashBwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const OptTensor&, std::optional<double>, bool, int64_t, int64_t, bool,
    const OptTensor&, const OptTensor&, double, const OptTensor&, const OptTensor&,
    const OptTensor&, bool);

c10::TypedOperatorHandle<FlashFwdSig> flash_fwd_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("adaattn::flash_fwd", "")
                       .typed<FlashFwdSig>();
  return op;
}

// Forward: flash_fwd below autograd; backward: flash_bwd. lse is returned but not differentiable.
class FlashAttnFunction : public torch::autograd::Function<FlashAttnFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const OptTensor& seqlens,
                               std::optional<double> softmax_scale, bool causal,
                               int64_t window_left, int64_t window_right, bool deterministic,
                               const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
                               double softcap, const OptTensor& alibi_slopes,
                               const OptTensor& sinks, const OptTensor& rel_bias) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = flash_fwd_op().call(q, k, v, seqlens, softmax_scale, causal, window_left,
                                          window_right, cu_seqlens_q, cu_seqlens_k, softcap,
                                          alibi_slopes, sinks, rel_bias);
    ctx->save_for_backward({q, k, v, out, lse, seqlens.value_or(at::Tensor()),
                            cu_seqlens_q.value_or(at::Tensor()),
                            cu_seqlens_k.value_or(at::Tensor()),
                            alibi_slopes.value_or(at::Tensor()), sinks.value_or(at::Tensor()),
                            rel_bias.value_or(at::Tensor())});
    save_scale(ctx, softmax_scale);
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["window_right"] = window_right;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->saved_data["softcap"] = softcap;
    // Whether the backward computes the sinks / rel_bias gradients.
    ctx->saved_data["param_grads"] = (sinks.has_value() && sinks->requires_grad()) ||
                                     (rel_bias.has_value() && rel_bias->requires_grad());
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& out = saved[3];
    const std::optional<double> scale = saved_scale(ctx);
    const at::Tensor dout = output_grad(grads[0], out);
    static auto bwd = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("adaattn::flash_bwd", "")
                          .typed<FlashBwdSig>();
    const bool param_grads = ctx->saved_data["param_grads"].toBool();
    auto [dq, dk, dv, dsinks, drel_bias] = bwd.call(
        dout, saved[0], saved[1], saved[2], out, saved[4], saved_optional(saved[5]), scale,
        ctx->saved_data["causal"].toBool(), ctx->saved_data["window_left"].toInt(),
        ctx->saved_data["window_right"].toInt(), ctx->saved_data["deterministic"].toBool(),
        saved_optional(saved[6]), saved_optional(saved[7]), ctx->saved_data["softcap"].toDouble(),
        saved_optional(saved[8]), saved_optional(saved[9]), saved_optional(saved[10]),
        param_grads);
    return {dq,           dk,           dv,           at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(),
            param_grads && saved[9].defined() ? dsinks : at::Tensor(),
            param_grads && saved[10].defined() ? drel_bias : at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> flash_attn_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& seqlens,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    bool deterministic, const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
    double softcap, const OptTensor& alibi_slopes, const OptTensor& sinks,
    const OptTensor& rel_bias) {
  auto res = FlashAttnFunction::apply(q, k, v, seqlens, softmax_scale, causal, window_left,
                                      window_right, deterministic, cu_seqlens_q, cu_seqlens_k,
                                      softcap, alibi_slopes, sinks, rel_bias);
  return {res[0], res[1]};
}

// Below autograd (inference mode, or backends reached past the Autograd key).
std::tuple<at::Tensor, at::Tensor> flash_attn_no_grad(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& seqlens,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    bool /*deterministic*/, const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
    double softcap, const OptTensor& alibi_slopes, const OptTensor& sinks,
    const OptTensor& rel_bias) {
  return flash_fwd_op().call(q, k, v, seqlens, softmax_scale, causal, window_left, window_right,
                             cu_seqlens_q, cu_seqlens_k, softcap, alibi_slopes, sinks, rel_bias);
}

}  // namespace

// Dense and packed calls share each family's ops: cu_seqlens (packed) are optional trailing
// arguments, and with them q/k/v are [T, H, D] and lse is [Hq, T].
TORCH_LIBRARY_FRAGMENT(adaattn, m) {
  m.def(
      "flash_attn(Tensor q, Tensor k, Tensor v, Tensor? seqlens=None, float? softmax_scale=None, "
      "bool causal=False, int window_left=-1, int window_right=-1, bool deterministic=False, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, float softcap=0.0, "
      "Tensor? alibi_slopes=None, Tensor? sinks=None, Tensor? rel_bias=None) -> (Tensor out, "
      "Tensor lse)");
  m.def(
      "flash_fwd(Tensor q, Tensor k, Tensor v, Tensor? seqlens, float? softmax_scale, bool causal, "
      "int window_left, int window_right, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
      "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? sinks=None, Tensor? rel_bias=None) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "flash_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? seqlens, float? softmax_scale, bool causal, int window_left, int window_right, "
      "bool deterministic, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
      "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? sinks=None, Tensor? rel_bias=None, "
      "bool param_grads=False) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, "
      "Tensor grad_sinks, Tensor grad_rel_bias)");
}

TORCH_LIBRARY_IMPL(adaattn, CPU, m) {
  m.impl("flash_fwd", &flash_fwd_cpu_op);
  m.impl("flash_bwd", &flash_bwd_cpu_op);
}

TORCH_LIBRARY_IMPL(adaattn, Autograd, m) { m.impl("flash_attn", &flash_attn_autograd); }

TORCH_LIBRARY_IMPL(adaattn, CompositeExplicitAutograd, m) {
  m.impl("flash_attn", &flash_attn_no_grad);
}

}  // namespace adaattn
