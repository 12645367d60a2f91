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

void check_lazy_block_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, const at::Tensor& tau, const at::Tensor& bias,
                             std::optional<double> softmax_scale, int64_t q_position,
                             int64_t k_position) {
  check_lazy_inputs(op, q, k, v, tau, bias, std::nullopt, std::nullopt, softmax_scale);
  const int64_t int_max = std::numeric_limits<int>::max();
  ADAATTN_CHECK_VALUE(q_position >= 0 && q_position <= int_max - q.size(2),
                      "q_position must be >= 0 with q_position + Lq in int32, got ", q_position);
  ADAATTN_CHECK_VALUE(k_position >= 0 && k_position <= int_max - k.size(2),
                      "k_position must be >= 0 with k_position + Lk in int32, got ", k_position);
}

void check_lazy_row_stat(const char* op, const char* name, const at::Tensor& t,
                         const at::Tensor& q) {
  const std::vector<int64_t> expected = lse_shape(q, false);
  ADAATTN_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be float32, got ",
                     t.scalar_type());
  ADAATTN_CHECK_VALUE(t.sizes() == at::IntArrayRef(expected), name,
                      " must have shape [B, Hq, Lq] = ", at::IntArrayRef(expected), ", got ",
                      t.sizes());
  ADAATTN_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
  ADAATTN_CHECK_DEVICE(t.device() == q.device(), name, " must be on q's device ", q.device(),
                       ", got ", t.device());
}

AttnParams make_lazy_block_params(const char* op, const at::Tensor& q, const at::Tensor& k,
                                  const at::Tensor& v, const at::Tensor& tau,
                                  const at::Tensor& bias, std::optional<double> softmax_scale,
                                  int64_t q_position, int64_t k_position) {
  AttnParams p = make_lazy_params(op, q, k, v, tau, bias, std::nullopt, std::nullopt,
                                  softmax_scale);
  p.explicit_positions = true;
  p.q_position0 = static_cast<int>(q_position);
  p.k_position0 = static_cast<int>(k_position);
  return p;
}

void set_lazy_block_row_pass(AttnParams& p, const at::Tensor& dout, const at::Tensor& lse,
                             at::Tensor& delta, at::Tensor& row_g) {
  p.dout = dout.data_ptr();
  p.do_batch_stride = dout.stride(0);
  p.do_head_stride = dout.stride(1);
  p.do_row_stride = dout.stride(2);
  p.lse = const_cast<float*>(lse.data_ptr<float>());
  p.delta = delta.data_ptr<float>();
  p.row_g = row_g.data_ptr<float>();
  p.row_pass = LsePass::kOnly;
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

// ---- block ops (ring_lazy_attn) ---------------------------------------------------------------
// The lse of the block's scores (LsePass::kOnly); v is not read (k stands in for it).
at::Tensor lazy_block_lse_cpu_op(const at::Tensor& q_in, const at::Tensor& k_in,
                                 const at::Tensor& tau, const at::Tensor& bias,
                                 std::optional<double> softmax_scale, int64_t q_position,
                                 int64_t k_position) {
  const char* op = "lazy_block_lse";
  check_lazy_block_inputs(op, q_in, k_in, k_in, tau, bias, softmax_scale, q_position, k_position);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in);
  at::Tensor lse = at::empty(lse_shape(q, false), q.options().dtype(at::kFloat));
  if (q.numel() == 0) return lse.fill_(-std::numeric_limits<float>::infinity());
  AttnParams p = make_lazy_block_params(op, q, k, k, tau, bias, softmax_scale, q_position,
                                        k_position);
  p.lse = lse.data_ptr<float>();  // out is not written
  p.lse_pass = LsePass::kOnly;
  attention_fwd_cpu(VariantId::kLazy, p, q.scalar_type());
  return lse;
}

// The block's share of the output against the whole row's lse (LsePass::kGiven).
at::Tensor lazy_block_out_cpu_op(const at::Tensor& q_in, const at::Tensor& k_in,
                                 const at::Tensor& v_in, const at::Tensor& tau,
                                 const at::Tensor& bias, const at::Tensor& lse,
                                 std::optional<double> softmax_scale, int64_t q_position,
                                 int64_t k_position) {
  const char* op = "lazy_block_out";
  check_lazy_block_inputs(op, q_in, k_in, v_in, tau, bias, softmax_scale, q_position, k_position);
  check_lazy_row_stat(op, "lse", lse, q_in);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  at::Tensor out = at::zeros(out_shape(q, v), q.options());
  if (q.numel() > 0) {
    AttnParams p = make_lazy_block_params(op, q, k, v, tau, bias, softmax_scale, q_position,
                                          k_position);
    at::Tensor lse_in = lse;
    set_fwd_outputs(p, out, lse_in);
    p.lse_pass = LsePass::kGiven;
    attention_fwd_cpu(VariantId::kLazy, p, q.scalar_type());
  }
  return out.to(q_in.scalar_type());
}

// The block's shares of each row's Delta and G * d c_i / d tau (LsePass::kOnly row pass).
std::tuple<at::Tensor, at::Tensor> lazy_block_row_terms_cpu_op(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& tau, const at::Tensor& bias, const at::Tensor& lse,
    std::optional<double> softmax_scale, int64_t q_position, int64_t k_position) {
  const char* op = "lazy_block_row_terms";
  check_lazy_block_inputs(op, q_in, k_in, v_in, tau, bias, softmax_scale, q_position, k_position);
  check_flash_bwd_inputs(op, dout_in, q_in, v_in, dout_in, lse, false);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  const at::Tensor dout = cpu_compute(dout_in);
  at::Tensor delta = at::zeros(lse.sizes(), lse.options());
  at::Tensor row_g = at::zeros(lse.sizes(), lse.options());
  if (q.numel() > 0 && k.numel() > 0) {
    AttnParams p = make_lazy_block_params(op, q, k, v, tau, bias, softmax_scale, q_position,
                                          k_position);
    set_lazy_block_row_pass(p, dout, lse, delta, row_g);
    attention_bwd_cpu(VariantId::kLazy, p, q.scalar_type());
  }
  return {delta, row_g};
}

// dq, dk, dv and dbias of the block against the whole row's lse and Delta (LsePass::kGiven).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lazy_block_bwd_cpu_op(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& tau, const at::Tensor& bias, const at::Tensor& lse,
    const at::Tensor& delta, std::optional<double> softmax_scale, int64_t q_position,
    int64_t k_position, bool bias_grad) {
  const char* op = "lazy_block_bwd";
  check_lazy_block_inputs(op, q_in, k_in, v_in, tau, bias, softmax_scale, q_position, k_position);
  check_flash_bwd_inputs(op, dout_in, q_in, v_in, dout_in, lse, false);
  check_lazy_row_stat(op, "delta", delta, q_in);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  const at::Tensor dout = cpu_compute(dout_in);
  at::Tensor dq = at::zeros(q.sizes(), q.options());
  at::Tensor dk = at::zeros(k.sizes(), k.options());
  at::Tensor dv = at::zeros(v.sizes(), v.options());
  at::Tensor dbias = at::zeros(bias.sizes(), bias.options());
  if (q.numel() > 0 && k.numel() > 0) {
    AttnParams p = make_lazy_block_params(op, q, k, v, tau, bias, softmax_scale, q_position,
                                          k_position);
    at::Tensor delta_in = delta;
    // Without normalisation the backward never reads out (dout stands in for it).
    set_bwd_tensors(p, dout, dout, lse, dq, dk, dv, delta_in);
    p.row_pass = LsePass::kGiven;
    if (bias_grad) p.dbias = dbias.data_ptr<float>();
    attention_bwd_cpu(VariantId::kLazy, p, q.scalar_type());
  }
  const auto t = q_in.scalar_type();
  return {dq.to(t), dk.to(t), dv.to(t), dbias};
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
  // Blocks of a sequence sharded over ranks (ring_lazy_attn): explicit positions, and the lse
  // pass, the weights, the row terms and the gradients as separate calls (see lazy_ops.h).
  m.def(
      "lazy_block_lse(Tensor q, Tensor k, Tensor tau, Tensor bias, float? softmax_scale, "
      "int q_position, int k_position) -> Tensor lse");
  m.def(
      "lazy_block_out(Tensor q, Tensor k, Tensor v, Tensor tau, Tensor bias, Tensor lse, "
      "float? softmax_scale, int q_position, int k_position) -> Tensor out");
  m.def(
      "lazy_block_row_terms(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor tau, "
      "Tensor bias, Tensor lse, float? softmax_scale, int q_position, int k_position) -> "
      "(Tensor delta, Tensor row_g)");
  m.def(
      "lazy_block_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor tau, Tensor bias, "
      "Tensor lse, Tensor delta, float? softmax_scale, int q_position, int k_position, "
      "bool bias_grad) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(adaattn, CPU, m) {
  m.impl("lazy_fwd", &lazy_fwd_cpu_op);
  m.impl("lazy_bwd", &lazy_bwd_cpu_op);
  m.impl("lazy_block_lse", &lazy_block_lse_cpu_op);
  m.impl("lazy_block_out", &lazy_block_out_cpu_op);
  m.impl("lazy_block_row_terms", &lazy_block_row_terms_cpu_op);
  m.impl("lazy_block_bwd", &lazy_block_bwd_cpu_op);
}

TORCH_LIBRARY_IMPL(adaattn, Autograd, m) { m.impl("lazy_attn", &lazy_attn_autograd); }

TORCH_LIBRARY_IMPL(adaattn, CompositeExplicitAutograd, m) {
  m.impl("lazy_attn", &lazy_attn_no_grad);
}

}  // namespace adaattn
