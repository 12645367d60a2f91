// Linear attention: its schemas, argument validation, LinearParams construction, the
// CPU ops and the C++ autograd function registered at the Autograd key. The CUDA registration is
// linear_cuda.cpp.
#include <torch/autograd.h>
#include <torch/library.h>

#include <limits>
#include <sstream>
#include <string>

#include "../../linear_api.h"
#include "../common/autograd_util.h"
#include "../common/checks.h"
#include "linear_ops.h"

namespace adaattn {

namespace {

// Every check of this family names the op the user calls.
constexpr const char* op = "linear_attn";

FeatureMap parse_feature_map(const std::string& name) {
  if (name == "elu") return FeatureMap::kElu;
  if (name == "relu") return FeatureMap::kRelu;
  if (name == "identity") return FeatureMap::kIdentity;
  ADAATTN_CHECK_VALUE(false, "feature_map must be one of 'elu', 'relu', 'identity', got '", name,
                      "'");
}

void check_linear_tensor(const at::Tensor& t, const char* name, bool packed) {
  ADAATTN_CHECK_VALUE(t.dim() == (packed ? 3 : 4), name, " must have ",
                      packed ? "3 dims [T, H, *] (packed, with cu_seqlens)"
                             : "4 dims [B, H, T, *] (dense, without cu_seqlens)",
                      ", got ", t.dim(), " dims (shape ", t.sizes(), ")");
  ADAATTN_CHECK_TYPE(at::isFloatingType(t.scalar_type()), name,
                     " must be a floating tensor (float16, bfloat16, float32, float64), got ",
                     t.scalar_type());
  ADAATTN_CHECK_VALUE(t.numel() == 0 || t.stride(-1) == 1, name,
                      " must have a contiguous last dim (stride(-1) == 1), got strides ",
                      t.strides(), "; call .contiguous() on it");
}

// The state tensor's expected form, for error messages.
std::string state_description(const at::Tensor& q, const at::Tensor& v,
                              const std::optional<at::Tensor>& cu_seqlens, bool normalize) {
  std::ostringstream s;
  s << "a " << linear_state_dtype(q) << " tensor of shape [N, H, D, Dv"
    << (normalize ? " + 1" : "")
    << "] = " << at::IntArrayRef(linear_state_shape(q, v, cu_seqlens, normalize))
    << (normalize ? " (normalize=True: the last column is the normaliser z)" : "");
  return s.str();
}

void check_state(const at::Tensor& s, const char* name, const at::Tensor& q, const at::Tensor& v,
                 const std::optional<at::Tensor>& cu_seqlens, bool normalize) {
  ADAATTN_CHECK_TYPE(s.scalar_type() == linear_state_dtype(q), name, " must be a ",
                     linear_state_dtype(q), " tensor (the state dtype of ", q.scalar_type(),
                     " inputs), got ", s.scalar_type());
  const std::vector<int64_t> shape = linear_state_shape(q, v, cu_seqlens, normalize);
  ADAATTN_CHECK_VALUE(s.sizes() == at::IntArrayRef(shape), name, " must be ",
                      state_description(q, v, cu_seqlens, normalize), ", got ", s.sizes());
  ADAATTN_CHECK_DEVICE(s.device() == q.device(), name, " must be on q's device ", q.device(),
                       ", got ", s.device());
}

}  // namespace

at::ScalarType linear_state_dtype(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

std::vector<int64_t> linear_state_shape(const at::Tensor& q, const at::Tensor& v,
                                        const std::optional<at::Tensor>& cu_seqlens,
                                        bool normalize) {
  const bool packed = cu_seqlens.has_value();
  const int64_t seqs = packed ? cu_seqlens->size(0) - 1 : q.size(0);
  return {seqs, q.size(1), q.size(-1), v.size(-1) + (normalize ? 1 : 0)};
}

FeatureMap check_linear_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& initial_state,
                               const std::optional<at::Tensor>& cu_seqlens,
                               const std::string& feature_map, bool normalize) {
  const FeatureMap fmap = parse_feature_map(feature_map);
  const bool packed = cu_seqlens.has_value();
  if (packed) check_cu_seqlens_tensor(op, *cu_seqlens, "cu_seqlens", q);
  check_linear_tensor(q, "q", packed);
  check_linear_tensor(k, "k", packed);
  check_linear_tensor(v, "v", packed);
  ADAATTN_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                     "q, k and v must have the same dtype, got q ", q.scalar_type(), ", k ",
                     k.scalar_type(), ", v ", v.scalar_type());
  ADAATTN_CHECK_DEVICE(k.device() == q.device() && v.device() == q.device(),
                       "q, k and v must be on the same device, got q on ", q.device(), ", k on ",
                       k.device(), ", v on ", v.device());
  ADAATTN_CHECK_VALUE(k.sizes() == q.sizes(), "k must have q's shape ", q.sizes(),
                      " (linear attention takes as many kv heads as query heads and keys of the "
                      "queries' length), got ", k.sizes());
  ADAATTN_CHECK_VALUE(v.sizes().slice(0, v.dim() - 1) == q.sizes().slice(0, q.dim() - 1),
                      "v must have q's shape except for its last dim (Dv), got v ", v.sizes(),
                      " and q ", q.sizes());
  ADAATTN_CHECK_VALUE(q.size(-1) >= 1 && q.size(-1) <= 256,
                      "head dim D = q.size(-1) must be in [1, 256], got ", q.size(-1));
  ADAATTN_CHECK_VALUE(v.size(-1) >= 1 && v.size(-1) <= 256,
                      "value dim Dv = v.size(-1) must be in [1, 256], got ", v.size(-1));
  const int64_t int_max = std::numeric_limits<int>::max();
  ADAATTN_CHECK_VALUE(
      q.size(0) <= int_max && q.size(1) <= int_max && (packed || q.size(2) <= int_max),
      "batch, heads and sequence length must fit in int32");
  ADAATTN_CHECK_VALUE(!packed || cu_seqlens->size(0) - 1 <= int_max,
                      "the number of sequences must fit in int32");
  if (initial_state.has_value()) {
    check_state(*initial_state, "initial_state", q, v, cu_seqlens, normalize);
  }
  if (packed) {
    check_cu_seqlens_values(op, *cu_seqlens, "cu_seqlens", q.size(0), "T = q.size(0) = ");
  }
  return fmap;
}

void check_linear_grads(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_state,
                        const at::Tensor& q, const at::Tensor& v,
                        const std::optional<at::Tensor>& cu_seqlens, bool normalize) {
  ADAATTN_CHECK_VALUE(grad_out.sizes() == v.sizes(), "grad_out must have out's shape ",
                      v.sizes(), ", got ", grad_out.sizes());
  ADAATTN_CHECK_TYPE(grad_out.scalar_type() == q.scalar_type(), "grad_out must have q's dtype ",
                     q.scalar_type(), ", got ", grad_out.scalar_type());
  ADAATTN_CHECK_VALUE(grad_out.numel() == 0 || grad_out.stride(-1) == 1,
                      "grad_out must have a contiguous last dim");
  ADAATTN_CHECK_DEVICE(grad_out.device() == q.device(), "grad_out must be on q's device ",
                       q.device(), ", got ", grad_out.device());
  if (grad_state.has_value()) check_state(*grad_state, "grad_state", q, v, cu_seqlens, normalize);
}

LinearStrides linear_strides(const at::Tensor& t) {
  if (t.dim() == 3) return {0, t.stride(1), t.stride(0)};
  return {t.stride(0), t.stride(1), t.stride(2)};
}

LinearParams make_linear_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::optional<at::Tensor>& initial_state,
                                const std::optional<at::Tensor>& cu_seqlens, FeatureMap fmap,
                                bool causal, bool normalize) {
  LinearParams p{};
  const bool packed = cu_seqlens.has_value();
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_s = linear_strides(q);
  p.k_s = linear_strides(k);
  p.v_s = linear_strides(v);
  p.cu_seqlens = packed ? cu_seqlens->data_ptr<int>() : nullptr;
  p.num_seqs = static_cast<int>(packed ? cu_seqlens->size(0) - 1 : q.size(0));
  p.heads = static_cast<int>(q.size(1));
  p.len = static_cast<int>(packed ? q.size(0) : q.size(2));
  p.dim = static_cast<int>(q.size(-1));
  p.dim_v = static_cast<int>(v.size(-1));
  p.state_cols = p.dim_v + (normalize ? 1 : 0);
  p.feature_map = fmap;
  p.causal = causal;
  p.normalize = normalize;
  p.state_in = initial_state.has_value() ? initial_state->data_ptr() : nullptr;
  return p;
}

namespace {

std::optional<at::Tensor> contiguous_opt(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

std::tuple<at::Tensor, at::Tensor> linear_fwd_cpu_op(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& initial_state_in, const std::optional<at::Tensor>& cu_seqlens,
    c10::string_view feature_map, bool causal, bool normalize) {
  const FeatureMap fmap = check_linear_inputs(q_in, k_in, v_in, initial_state_in, cu_seqlens,
                                              std::string(feature_map), normalize);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  const auto initial_state = contiguous_opt(initial_state_in);
  at::Tensor out = at::empty(v.sizes(), v.options());
  at::Tensor state =
      at::empty(linear_state_shape(q, v, cu_seqlens, normalize), q.options());
  if (state.numel() > 0) {
    LinearParams p = make_linear_params(q, k, v, initial_state, cu_seqlens, fmap, causal,
                                        normalize);
    p.out = out.data_ptr();
    p.o_s = linear_strides(out);
    p.state_out = state.data_ptr();
    linear_fwd_cpu(p, q.scalar_type());
  }
  return {out.to(q_in.scalar_type()), state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_bwd_cpu_op(
    const at::Tensor& dout_in, const std::optional<at::Tensor>& grad_state_in,
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& initial_state_in, const std::optional<at::Tensor>& cu_seqlens,
    c10::string_view feature_map, bool causal, bool normalize) {
  const FeatureMap fmap = check_linear_inputs(q_in, k_in, v_in, initial_state_in, cu_seqlens,
                                              std::string(feature_map), normalize);
  check_linear_grads(dout_in, grad_state_in, q_in, v_in, cu_seqlens, normalize);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  const at::Tensor dout = cpu_compute(dout_in);
  const auto initial_state = contiguous_opt(initial_state_in);
  const auto grad_state = contiguous_opt(grad_state_in);
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  at::Tensor dstate =
      at::empty(linear_state_shape(q, v, cu_seqlens, normalize), q.options());
  if (dstate.numel() > 0) {
    LinearParams p = make_linear_params(q, k, v, initial_state, cu_seqlens, fmap, causal,
                                        normalize);
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
    linear_bwd_cpu(p, q.scalar_type());
  }
  const auto t = q_in.scalar_type();
  return {dq.to(t), dk.to(t), dv.to(t), dstate};
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using LinearFwdSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, c10::string_view, bool, bool);
using LinearBwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    c10::string_view, bool, bool);

c10::TypedOperatorHandle<LinearFwdSig> linear_fwd_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("adaattn::linear_fwd", "")
                       .typed<LinearFwdSig>();
  return op;
}

// Forward: linear_fwd below autograd; backward: linear_bwd, fed the gradients of both outputs
// (out and the final state). Gradients flow to q, k, v and initial_state.
class LinearAttnFunction : public torch::autograd::Function<LinearAttnFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const std::optional<at::Tensor>& initial_state,
                               const std::optional<at::Tensor>& cu_seqlens,
                               c10::string_view feature_map, bool causal, bool normalize) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, state] =
        linear_fwd_op().call(q, k, v, initial_state, cu_seqlens, feature_map, causal, normalize);
    ctx->save_for_backward({q, k, v, initial_state.value_or(at::Tensor()),
                            cu_seqlens.value_or(at::Tensor())});
    ctx->saved_data["feature_map"] = std::string(feature_map);
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["normalize"] = normalize;
    return {out, state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& v = saved[2];
    const at::Tensor dout = output_grad(grads[0], v);
    static auto bwd = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("adaattn::linear_bwd", "")
                          .typed<LinearBwdSig>();
    const std::string feature_map = ctx->saved_data["feature_map"].toStringRef();
    auto [dq, dk, dv, dstate] =
        bwd.call(dout, saved_optional(grads[1]), saved[0], saved[1], v, saved_optional(saved[3]),
                 saved_optional(saved[4]), feature_map, ctx->saved_data["causal"].toBool(),
                 ctx->saved_data["normalize"].toBool());
    return {dq, dk, dv, saved[3].defined() ? dstate : at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> linear_attn_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,
    c10::string_view feature_map, bool causal, bool normalize) {
  auto res = LinearAttnFunction::apply(q, k, v, initial_state, cu_seqlens, feature_map, causal,
                                       normalize);
  return {res[0], res[1]};
}

// Below autograd (inference mode, or backends reached past the Autograd key).
std::tuple<at::Tensor, at::Tensor> linear_attn_no_grad(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens,
    c10::string_view feature_map, bool causal, bool normalize) {
  return linear_fwd_op().call(q, k, v, initial_state, cu_seqlens, feature_map, causal, normalize);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adaattn, m) {
  m.def(
      "linear_attn(Tensor q, Tensor k, Tensor v, Tensor? initial_state=None, "
      "Tensor? cu_seqlens=None, str feature_map=\"elu\", bool causal=True, bool normalize=True) "
      "-> (Tensor out, Tensor state)");
  m.def(
      "linear_fwd(Tensor q, Tensor k, Tensor v, Tensor? initial_state, Tensor? cu_seqlens, "
      "str feature_map, bool causal, bool normalize) -> (Tensor out, Tensor state)");
  m.def(
      "linear_bwd(Tensor grad_out, Tensor? grad_state, Tensor q, Tensor k, Tensor v, "
      "Tensor? initial_state, Tensor? cu_seqlens, str feature_map, bool causal, bool normalize) "
      "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_initial_state)");
}

TORCH_LIBRARY_IMPL(adaattn, CPU, m) {
  m.impl("linear_fwd", &linear_fwd_cpu_op);
  m.impl("linear_bwd", &linear_bwd_cpu_op);
}

TORCH_LIBRARY_IMPL(adaattn, Autograd, m) { m.impl("linear_attn", &linear_attn_autograd); }

TORCH_LIBRARY_IMPL(adaattn, CompositeExplicitAutograd, m) {
  m.impl("linear_attn", &linear_attn_no_grad);
}

}  // namespace adaattn
