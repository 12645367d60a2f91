// The lazy family (relative-bias scores, elastic softmax with per-head tau): validation and
// AttnParams construction (lazy_ops.h), its schemas, the CPU registration and the C++ autograd
// function registered at the Autograd key. The CUDA registration is lazy_cuda.cpp.
#include <torch/autograd.h>
#include <torch/library.h>

#include <limits>

#include "../../attention_api.h"
#include "../common/attention_inputs.h"
#include "../common/autograd_util.h"
#include "../common/checks.h"
#include "lazy_ops.h"

namespace adaattn {

void check_lazy_params(const char* op, const at::Tensor& q, const at::Tensor& tau,
                       const at::Tensor& bias) {
  const int64_t heads = q.size(1);
  ADAATTN_CHECK_TYPE(tau.scalar_type() == at::kFloat, "tau must be float32, got ",
                     tau.scalar_type());
  ADAATTN_CHECK_VALUE(tau.dim() == 1 && tau.size(0) == heads, "tau must have shape [Hq] = [",
                      heads, "], got ", tau.sizes());
  ADAATTN_CHECK_TYPE(bias.scalar_type() == at::kFloat, "bias must be float32, got ",
                     bias.scalar_type());
  ADAATTN_CHECK_VALUE(bias.dim() == 2 && bias.size(0) == heads && bias.size(1) >= 1,
                      "bias must have shape [Hq, W] = [", heads, ", W] with W >= 1, got ",
                      bias.sizes());
  ADAATTN_CHECK_VALUE(bias.size(1) <= std::numeric_limits<int>::max(),
                      "the bias window W = bias.size(1) must fit in int32, got ", bias.size(1));
  ADAATTN_CHECK_VALUE(tau.is_contiguous(), "tau must be contiguous; call .contiguous() on it");
  ADAATTN_CHECK_VALUE(bias.is_contiguous(), "bias must be contiguous; call .contiguous() on it");
  ADAATTN_CHECK_DEVICE(tau.device() == q.device(), "tau must be on q's device ", q.device(),
                       ", got ", tau.device());
  ADAATTN_CHECK_DEVICE(bias.device() == q.device(), "bias must be on q's device ", q.device(),
                       ", got ", bias.device());
}

void check_lazy_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const at::Tensor& tau, const at::Tensor& bias,
                       const std::optional<at::Tensor>& seqlens,
                       const std::optional<at::Tensor>& cu_seqlens,
                       std::optional<double> softmax_scale) {
  if (cu_seqlens.has_value() && q.dim() == 3 && k.dim() == 3) {
    ADAATTN_CHECK_VALUE(q.size(0) == k.size(0),
                        "packed lazy attention is self-attention over one cu_seqlens: q and k "
                        "must have the same number of rows T, got q.size(0) = ", q.size(0),
                        ", k.size(0) = ", k.size(0));
  }
  check_flash_inputs(op, q, k, v, seqlens, cu_seqlens, cu_seqlens, "cu_seqlens", "cu_seqlens");
  ADAATTN_CHECK_VALUE(v.size(-1) == q.size(-1),
                      "lazy attention needs v with q's head dim (Dv == D), got ", v.size(-1),
                      " and ", q.size(-1));
  if (!cu_seqlens.has_value()) {
    ADAATTN_CHECK_VALUE(q.size(2) <= k.size(2),
                        "lazy attention needs Lq <= Lk (query row r sits at position r + Lk - "
                        "Lq), got Lq = q.size(2) = ", q.size(2), " > Lk = k.size(2) = ",
                        k.size(2));
  }
  check_lazy_params(op, q, tau, bias);
  lazy_options(op, q, softmax_scale);
}

FlashOptions lazy_options(const char* op, const at::Tensor& q,
                          std::optional<double> softmax_scale) {
  // Causal, bottom-right aligned: window (-1, 0). The kernels are deterministic by construction.
  return resolve_flash_options(op, q, softmax_scale, /*causal=*/true, /*window_left=*/-1,
                               /*window_right=*/0, BwdMode::kTwoPass, /*softcap=*/0.0);
}

AttnParams make_lazy_params(const char* op, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& tau, const at::Tensor& bias,
                            const std::optional<at::Tensor>& seqlens,
                            const std::optional<at::Tensor>& cu_seqlens,
                            std::optional<double> softmax_scale) {
  AttnParams p = make_params(q, k, v, seqlens, cu_seqlens, cu_seqlens,
                             lazy_options(op, q, softmax_scale));
  p.tau = tau.data_ptr<float>();
  p.bias = bias.data_ptr<float>();
  p.bias_window = static_cast<int>(bias.size(1));
  return p;
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> lazy_fwd_cpu_op(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& tau,
    const at::Tensor& bias, const std::optional<at::Tensor>& seqlens,
    std::optional<double> softmax_scale, bool return_stats,
    const std::optional<at::Tensor>& cu_seqlens) {
  const char* op = lazy_op_name(cu_seqlens);
  check_lazy_inputs(op, q_in, k_in, v_in, tau, bias, seqlens, cu_seqlens, softmax_scale);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  at::Tensor out = at::empty(out_shape(q, v), q.options());
  at::Tensor lse = at::empty(lse_shape(q, cu_seqlens.has_value()), q.options().dtype(at::kFloat));
  at::Tensor stats = at::zeros({return_stats ? 4 : 0}, q.options().dtype(at::kLong));
  if (no_rows(q, cu_seqlens)) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
  } else {
    AttnParams p = make_lazy_params(op, q, k, v, tau, bias, seqlens, cu_seqlens, softmax_scale);
    set_fwd_outputs(p, out, lse);
    p.stats = return_stats ? stats.data_ptr<int64_t>() : nullptr;
    attention_fwd_cpu(VariantId::kLazy, p, q.scalar_type());
  }
  return {out.to(q_in.scalar_type()), lse, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lazy_bwd_cpu_op(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& tau, const at::Tensor& bias,
    const at::Tensor& out_in, const at::Tensor& lse, const std::optional<at::Tensor>& seqlens,
    std::optional<double> softmax_scale, bool param_grads,
    const std::optional<at::Tensor>& cu_seqlens) {
  const char* op = lazy_op_name(cu_seqlens);
  check_lazy_inputs(op, q_in, k_in, v_in, tau, bias, seqlens, cu_seqlens, softmax_scale);
  check_flash_bwd_inputs(op, dout_in, q_in, v_in, out_in, lse, cu_seqlens.has_value());
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  const at::Tensor out = cpu_compute(out_in), dout = cpu_compute(dout_in);
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  const bool run = !no_rows(q, cu_seqlens) && k.numel() > 0;
  // Without param_grads the kernel skips that work and the op returns zeros (fast path).
  at::Tensor dtau = run && param_grads ? at::empty_like(tau) : at::zeros_like(tau);
  at::Tensor dbias = run && param_grads ? at::empty_like(bias) : at::zeros_like(bias);
  if (run) {
    AttnParams p = make_lazy_params(op, q, k, v, tau, bias, seqlens, cu_seqlens, softmax_scale);
    // The CPU kernel keeps its row scratch in T (float32 is too coarse for fp64 gradients) and
    // reads neither p.delta nor p.row_g: an empty tensor stands in for the delta scratch.
    at::Tensor no_scratch = at::empty({0}, lse.options());
    set_bwd_tensors(p, dout, out, lse, dq, dk, dv, no_scratch);
    if (param_grads) {
      p.dtau = dtau.data_ptr<float>();
      p.dbias = dbias.data_ptr<float>();
    }
    attention_bwd_cpu(VariantId::kLazy, p, q.scalar_type());
  } else {
    dq.zero_();
    dk.zero_();
    dv.zero_();
  }
  const auto t = q_in.scalar_type();
  return {dq.to(t), dk.to(t), dv.to(t), dtau, dbias};
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

using LazyFwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const OptTensor&, std::optional<double>, bool, const OptTensor&);
using LazyBwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
    std::optional<double>, bool, const OptTensor&);

c10::TypedOperatorHandle<LazyFwdSig> lazy_fwd_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("adaattn::lazy_fwd", "")
                       .typed<LazyFwdSig>();
  return op;
}

// Forward: lazy_fwd below autograd; backward: lazy_bwd, which computes the tau/bias gradients
// only when one of them is needed. lse and stats are returned but not differentiable.
class LazyAttnFunction : public torch::autograd::Function<LazyAttnFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& tau, const at::Tensor& bias,
                               const OptTensor& seqlens, std::optional<double> softmax_scale,
                               bool return_stats, const OptTensor& cu_seqlens) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse, stats] = lazy_fwd_op().call(q, k, v, tau, bias, seqlens, softmax_scale,
                                                return_stats, cu_seqlens);
    ctx->save_for_backward({q, k, v, tau, bias, out, lse, seqlens.value_or(at::Tensor()),
                            cu_seqlens.value_or(at::Tensor())});
    save_scale(ctx, softmax_scale);
    ctx->mark_non_differentiable({lse, stats});
    return {out, lse, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& out = saved[5];
    const std::optional<double> scale = saved_scale(ctx);
    const at::Tensor dout = output_grad(grads[0], out);
    const bool need_tau = ctx->needs_input_grad(3), need_bias = ctx->needs_input_grad(4);
    static auto bwd = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("adaattn::lazy_bwd", "")
                          .typed<LazyBwdSig>();
    auto [dq, dk, dv, dtau, dbias] =
        bwd.call(dout, saved[0], saved[1], saved[2], saved[3], saved[4], out, saved[6],
                 saved_optional(saved[7]), scale, need_tau || need_bias, saved_optional(saved[8]));
    return {dq, dk, dv, need_tau ? dtau : at::Tensor(), need_bias ? dbias : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> lazy_attn_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tau,
    const at::Tensor& bias, const OptTensor& seqlens, std::optional<double> softmax_scale,
    bool return_stats, const OptTensor& cu_seqlens) {
  auto res =
      LazyAttnFunction::apply(q, k, v, tau, bias, seqlens, softmax_scale, return_stats, cu_seqlens);
  return {res[0], res[1], res[2]};
}

// Below autograd (inference mode, or backends reached past the Autograd key).
std::tuple<at::Tensor, at::Tensor, at::Tensor> lazy_attn_no_grad(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tau,
    const at::Tensor& bias, const OptTensor& seqlens, std::optional<double> softmax_scale,
    bool return_stats, const OptTensor& cu_seqlens) {
  return lazy_fwd_op().call(q, k, v, tau, bias, seqlens, softmax_scale, return_stats, cu_seqlens);
}

}  // namespace

// Packed (cu_seqlens) calls are self-attention over one cu_seqlens for q and k.
TORCH_LIBRARY_FRAGMENT(adaattn, m) {
  m.def(
      "lazy_attn(Tensor q, Tensor k, Tensor v, Tensor tau, Tensor bias, Tensor? seqlens=None, "
      "float? softmax_scale=None, bool return_stats=False, Tensor? cu_seqlens=None) -> "
      "(Tensor out, Tensor lse, Tensor stats)");
  m.def(
      "lazy_fwd(Tensor q, Tensor k, Tensor v, Tensor tau, Tensor bias, Tensor? seqlens, "
      "float? softmax_scale, bool return_stats, Tensor? cu_seqlens=None) -> (Tensor out, "
      "Tensor lse, Tensor stats)");
  m.def(
      "lazy_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor tau, Tensor bias, "
      "Tensor out, Tensor lse, Tensor? seqlens, float? softmax_scale, bool param_grads, "
      "Tensor? cu_seqlens=None) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, "
      "Tensor grad_tau, Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(adaattn, CPU, m) {
  m.impl("lazy_fwd", &lazy_fwd_cpu_op);
  m.impl("lazy_bwd", &lazy_bwd_cpu_op);
}

TORCH_LIBRARY_IMPL(adaattn, Autograd, m) { m.impl("lazy_attn", &lazy_attn_autograd); }

TORCH_LIBRARY_IMPL(adaattn, CompositeExplicitAutograd, m) {
  m.impl("lazy_attn", &lazy_attn_no_grad);
}

}  // namespace adaattn
