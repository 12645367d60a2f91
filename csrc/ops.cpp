// Op schemas (the single TORCH_LIBRARY of adaattn), argument validation, the CPU kernels'
// registration and the C++ autograd functions registered at the Autograd key, for the flash and
// lazy families. The linear family's implementations live in linear.cpp.
#include <torch/autograd.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <limits>

#include "autograd_util.h"
#include "core/seq.h"
#include "attention_api.h"
#include "flash_ops.h"
#include "lazy_ops.h"

namespace adaattn {

namespace {

void check_qkv_tensor(const at::Tensor& t, const char* name, bool packed) {
  TORCH_CHECK(t.dim() == (packed ? 3 : 4), "adaattn: ", name, " must have ",
              packed ? "3 dims [T, H, D] (packed, with cu_seqlens)" : "4 dims [B, H, L, D]",
              ", got ", t.dim(), " dims (shape ", t.sizes(), ")");
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), "adaattn: ", name,
              " must be a floating tensor (float16, bfloat16, float32, float64), got ",
              t.scalar_type());
  TORCH_CHECK(t.size(-1) == 0 || t.stride(-1) == 1, "adaattn: ", name,
              " must have a contiguous last dim (stride(-1) == 1), got strides ", t.strides(),
              "; call .contiguous() on it");
}

// Values of a cu_seqlens tensor; reading a CUDA one synchronises, so it is checked there only
// on request (ADAATTN_CHECK_INPUTS=1). The kernels clamp it either way.
void check_cu_seqlens_values(const at::Tensor& cu, const char* name, int64_t total) {
  const char* env = std::getenv("ADAATTN_CHECK_INPUTS");
  const bool requested = env != nullptr && std::strcmp(env, "1") == 0;
  if (!cu.device().is_cpu() && !requested) return;
  const at::Tensor host = cu.device().is_cpu() ? cu : cu.cpu();
  const int* c = host.data_ptr<int>();
  const int64_t n = host.size(0);
  TORCH_CHECK(c[0] == 0, "adaattn: ", name, " must start at 0, got ", c[0]);
  for (int64_t i = 1; i < n; ++i) {
    TORCH_CHECK(c[i] >= c[i - 1], "adaattn: ", name, " must be non-decreasing, got ", c[i - 1],
                " then ", c[i], " at index ", i);
  }
  TORCH_CHECK(c[n - 1] == total, "adaattn: ", name, " must end at the packed length ", total,
              ", got ", c[n - 1]);
}

void check_seq_args(const at::Tensor& q, const at::Tensor& k,
                    const std::optional<at::Tensor>& seqlens,
                    const std::optional<at::Tensor>& cu_seqlens_q,
                    const std::optional<at::Tensor>& cu_seqlens_k) {
  TORCH_CHECK(cu_seqlens_q.has_value() == cu_seqlens_k.has_value(),
              "adaattn: cu_seqlens_q and cu_seqlens_k must be given together");
  if (!cu_seqlens_q.has_value()) return;
  TORCH_CHECK(!seqlens.has_value(),
              "adaattn: seqlens (padded batches) and cu_seqlens (packed batches) exclude each "
              "other");
  const std::pair<const at::Tensor*, const char*> args[] = {{&*cu_seqlens_q, "cu_seqlens_q"},
                                                            {&*cu_seqlens_k, "cu_seqlens_k"}};
  for (const auto& [c, name] : args) {
    TORCH_CHECK(c->scalar_type() == at::kInt, "adaattn: ", name, " must be int32, got ",
                c->scalar_type());
    TORCH_CHECK(c->dim() == 1 && c->size(0) >= 1, "adaattn: ", name,
                " must have shape [N + 1] (N >= 0 sequences), got ", c->sizes());
    TORCH_CHECK(c->is_contiguous(), "adaattn: ", name, " must be contiguous");
    TORCH_CHECK(c->device() == q.device(), "adaattn: ", name, " must be on q's device ",
                q.device(), ", got ", c->device());
  }
  TORCH_CHECK(cu_seqlens_q->size(0) == cu_seqlens_k->size(0),
              "adaattn: cu_seqlens_q and cu_seqlens_k must have the same length N + 1, got ",
              cu_seqlens_q->size(0), " and ", cu_seqlens_k->size(0));
  TORCH_CHECK(cu_seqlens_q->size(0) - 1 <= std::numeric_limits<int>::max(),
              "adaattn: too many sequences for int32");
  check_cu_seqlens_values(*cu_seqlens_q, "cu_seqlens_q", q.size(0));
  check_cu_seqlens_values(*cu_seqlens_k, "cu_seqlens_k", k.size(0));
}

}  // namespace

void check_flash_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& seqlens,
                        const std::optional<at::Tensor>& cu_seqlens_q,
                        const std::optional<at::Tensor>& cu_seqlens_k) {
  const bool packed = cu_seqlens_q.has_value() || cu_seqlens_k.has_value();
  check_qkv_tensor(q, "q", packed);
  check_qkv_tensor(k, "k", packed);
  check_qkv_tensor(v, "v", packed);
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "adaattn: q, k and v must have the same dtype, got q ", q.scalar_type(), ", k ",
              k.scalar_type(), ", v ", v.scalar_type());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(),
              "adaattn: q, k and v must be on the same device, got q on ", q.device(), ", k on ",
              k.device(), ", v on ", v.device());
  TORCH_CHECK(packed || (k.size(0) == q.size(0) && v.size(0) == q.size(0)),
              "adaattn: batch size mismatch: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(v.sizes().slice(0, v.dim() - 1) == k.sizes().slice(0, k.dim() - 1),
              "adaattn: k and v must have the same heads and length, got k ", k.sizes(), ", v ",
              v.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "adaattn: the number of query heads (q.size(1) = ", q.size(1),
              ") must be a multiple of the number of kv heads (k.size(1) = ", k.size(1), ")");
  TORCH_CHECK(k.size(-1) == q.size(-1), "adaattn: head dim mismatch: q has D = ", q.size(-1),
              ", k has D = ", k.size(-1));
  TORCH_CHECK(q.size(-1) > 0 && q.size(-1) <= 256,
              "adaattn: head dim D must be in [1, 256], got ", q.size(-1));
  TORCH_CHECK(v.size(-1) > 0 && v.size(-1) <= 256,
              "adaattn: v's head dim Dv = v.size(-1) must be in [1, 256], got ", v.size(-1));
  const int64_t int_max = std::numeric_limits<int>::max();
  const int64_t len_dim = packed ? 0 : 2;
  TORCH_CHECK(q.size(len_dim) <= int_max && k.size(len_dim) <= int_max && q.size(0) <= int_max,
              "adaattn: sequence lengths and batch must fit in int32");
  check_seq_args(q, k, seqlens, cu_seqlens_q, cu_seqlens_k);
  if (seqlens.has_value()) {
    const at::Tensor& s = *seqlens;
    TORCH_CHECK(s.scalar_type() == at::kInt, "adaattn: seqlens must be int32, got ",
                s.scalar_type());
    TORCH_CHECK(s.dim() == 1 && s.size(0) == q.size(0), "adaattn: seqlens must have shape [B] = [",
                q.size(0), "], got ", s.sizes());
    TORCH_CHECK(s.device() == q.device(), "adaattn: seqlens must be on ", q.device(), ", got ",
                s.device());
  }
}

std::vector<int64_t> out_shape(const at::Tensor& q, const at::Tensor& v) {
  std::vector<int64_t> shape = q.sizes().vec();
  shape.back() = v.size(-1);
  return shape;
}

std::vector<int64_t> lse_shape(const at::Tensor& q, bool packed) {
  if (packed) return {q.size(1), q.size(0)};
  return {q.size(0), q.size(1), q.size(2)};
}

void check_flash_bwd_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& v,
                            const at::Tensor& out, const at::Tensor& lse, bool packed) {
  const std::vector<int64_t> shape = out_shape(q, v);
  TORCH_CHECK(dout.sizes() == at::IntArrayRef(shape) && out.sizes() == at::IntArrayRef(shape),
              "adaattn: grad_out and out must have q's shape with v's head dim ",
              at::IntArrayRef(shape), ", got ", dout.sizes(), " and ", out.sizes());
  TORCH_CHECK(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "adaattn: grad_out and out must have q's dtype ", q.scalar_type());
  TORCH_CHECK(dout.stride(-1) == 1 || dout.sym_numel() == 0,
              "adaattn: grad_out must have a contiguous last dim");
  TORCH_CHECK(out.stride(-1) == 1 || out.sym_numel() == 0,
              "adaattn: out must have a contiguous last dim");
  const std::vector<int64_t> expected = lse_shape(q, packed);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.sizes() == at::IntArrayRef(expected),
              "adaattn: lse must be float32 ", packed ? "[Hq, Tq]" : "[B, Hq, Lq]", " = ",
              at::IntArrayRef(expected), ", got ", lse.scalar_type(), " ", lse.sizes());
  TORCH_CHECK(lse.is_contiguous(), "adaattn: lse must be contiguous");
  TORCH_CHECK(dout.device() == q.device() && out.device() == q.device() &&
                  lse.device() == q.device(),
              "adaattn: grad_out, out and lse must be on q's device ", q.device());
}

FlashOptions resolve_flash_options(const at::Tensor& q, std::optional<double> softmax_scale,
                                   bool causal, int64_t window_left, int64_t window_right,
                                   bool deterministic, double softcap) {
  TORCH_CHECK(window_left >= -1 && window_right >= -1,
              "adaattn: window must be (left, right) with each >= 0 or -1 (unbounded), got (",
              window_left, ", ", window_right, ")");
  const int64_t int_max = std::numeric_limits<int>::max();
  TORCH_CHECK(window_left <= int_max && window_right <= int_max,
              "adaattn: window entries must fit in int32");
  const double scale =
      softmax_scale.has_value() ? *softmax_scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  TORCH_CHECK(std::isfinite(scale), "adaattn: softmax_scale must be finite, got ", scale);
  // The tensor-core kernels read softcap as float32: it must stay finite there, and a positive
  // value nonzero (the exact paths take it as given).
  const float cap = static_cast<float>(softcap);
  TORCH_CHECK(softcap >= 0 && std::isfinite(cap) && (softcap == 0 || cap > 0),
              "adaattn: softcap must be 0 (off) or a positive finite float32 value, got ",
              softcap);
  return {scale, static_cast<int>(window_left), causal ? 0 : static_cast<int>(window_right),
          deterministic, softcap};
}

namespace {

// (batch, head, row) strides of a dense [B, H, L, D] or packed [T, H, D] operand.
std::tuple<int64_t, int64_t, int64_t> bhr_strides(const at::Tensor& t, bool packed) {
  if (packed) return {0, t.stride(1), t.stride(0)};
  return {t.stride(0), t.stride(1), t.stride(2)};
}

}  // namespace

AttnParams make_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& seqlens,
                       const std::optional<at::Tensor>& cu_seqlens_q,
                       const std::optional<at::Tensor>& cu_seqlens_k, const FlashOptions& opt) {
  const bool packed = cu_seqlens_q.has_value();
  AttnParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  std::tie(p.q_batch_stride, p.q_head_stride, p.q_row_stride) = bhr_strides(q, packed);
  std::tie(p.k_batch_stride, p.k_head_stride, p.k_row_stride) = bhr_strides(k, packed);
  std::tie(p.v_batch_stride, p.v_head_stride, p.v_row_stride) = bhr_strides(v, packed);
  p.batch = static_cast<int>(packed ? cu_seqlens_q->size(0) - 1 : q.size(0));
  p.heads_q = static_cast<int>(q.size(1));
  p.heads_kv = static_cast<int>(k.size(1));
  p.len_q = static_cast<int>(packed ? q.size(0) : q.size(2));
  p.len_k = static_cast<int>(packed ? k.size(0) : k.size(2));
  p.head_dim = static_cast<int>(q.size(-1));
  p.head_dim_v = static_cast<int>(v.size(-1));
  p.cu_seqlens_q = packed ? cu_seqlens_q->data_ptr<int>() : nullptr;
  p.cu_seqlens_k = packed ? cu_seqlens_k->data_ptr<int>() : nullptr;
  p.seqlens = seqlens.has_value() ? seqlens->data_ptr<int>() : nullptr;
  p.window_left = opt.window_left;
  p.window_right = opt.window_right;
  p.scale = opt.scale;
  p.scale_log2 = static_cast<float>(opt.scale * M_LOG2E);
  p.deterministic = opt.deterministic;
  p.softcap = opt.softcap;
  return p;
}

void set_fwd_outputs(AttnParams& p, at::Tensor& out, at::Tensor& lse) {
  p.out = out.data_ptr();
  std::tie(p.o_batch_stride, p.o_head_stride, p.o_row_stride) =
      bhr_strides(out, is_packed(p));
  p.lse = lse.data_ptr<float>();
}

void set_bwd_tensors(AttnParams& p, const at::Tensor& dout, const at::Tensor& out,
                     const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                     at::Tensor& delta) {
  const bool packed = is_packed(p);
  p.out = const_cast<void*>(out.data_ptr());
  std::tie(p.o_batch_stride, p.o_head_stride, p.o_row_stride) = bhr_strides(out, packed);
  p.lse = const_cast<float*>(lse.data_ptr<float>());
  p.dout = dout.data_ptr();
  std::tie(p.do_batch_stride, p.do_head_stride, p.do_row_stride) =
      bhr_strides(dout, packed);
  p.dq = dq.data_ptr();
  std::tie(p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride) =
      bhr_strides(dq, packed);
  p.dk = dk.data_ptr();
  std::tie(p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride) =
      bhr_strides(dk, packed);
  p.dv = dv.data_ptr();
  std::tie(p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride) =
      bhr_strides(dv, packed);
  p.delta = delta.data_ptr<float>();
}

void check_lazy_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& tau, const at::Tensor& bias,
                       const std::optional<at::Tensor>& seqlens,
                       const std::optional<at::Tensor>& cu_seqlens) {
  if (cu_seqlens.has_value() && q.dim() == 3 && k.dim() == 3) {
    TORCH_CHECK(q.size(0) == k.size(0),
                "adaattn: packed lazy attention is self-attention over one cu_seqlens: q and k "
                "must have the same number of rows T, got q.size(0) = ", q.size(0),
                ", k.size(0) = ", k.size(0));
  }
  check_flash_inputs(q, k, v, seqlens, cu_seqlens, cu_seqlens);
  TORCH_CHECK(v.size(-1) == q.size(-1),
              "adaattn: lazy attention needs v with q's head dim (Dv == D), got ", v.size(-1),
              " and ", q.size(-1));
  if (!cu_seqlens.has_value()) {
    TORCH_CHECK(q.size(2) <= k.size(2),
                "adaattn: lazy attention needs Lq <= Lk (query row r sits at position r + Lk - "
                "Lq), got Lq = q.size(2) = ", q.size(2), " > Lk = k.size(2) = ", k.size(2));
  }
  const int64_t heads = q.size(1);
  TORCH_CHECK(tau.scalar_type() == at::kFloat && tau.dim() == 1 && tau.size(0) == heads,
              "adaattn: tau must be a float32 tensor of shape [Hq] = [", heads, "], got ",
              tau.scalar_type(), " ", tau.sizes());
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.dim() == 2 && bias.size(0) == heads &&
                  bias.size(1) >= 1,
              "adaattn: bias must be a float32 tensor of shape [Hq, W] = [", heads,
              ", W] with W >= 1, got ", bias.scalar_type(), " ", bias.sizes());
  TORCH_CHECK(bias.size(1) <= std::numeric_limits<int>::max(),
              "adaattn: the bias window W = bias.size(1) must fit in int32, got ", bias.size(1));
  TORCH_CHECK(tau.is_contiguous(), "adaattn: tau must be contiguous; call .contiguous() on it");
  TORCH_CHECK(bias.is_contiguous(), "adaattn: bias must be contiguous; call .contiguous() on it");
  TORCH_CHECK(tau.device() == q.device(), "adaattn: tau must be on q's device ", q.device(),
              ", got ", tau.device());
  TORCH_CHECK(bias.device() == q.device(), "adaattn: bias must be on q's device ", q.device(),
              ", got ", bias.device());
}

AttnParams make_lazy_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& tau, const at::Tensor& bias,
                            const std::optional<at::Tensor>& seqlens,
                            const std::optional<at::Tensor>& cu_seqlens,
                            std::optional<double> softmax_scale) {
  // Causal, bottom-right aligned: window (-1, 0). The kernels are deterministic by construction.
  const FlashOptions opt = resolve_flash_options(q, softmax_scale, /*causal=*/true,
                                                 /*window_left=*/-1, /*window_right=*/0,
                                                 /*deterministic=*/true, /*softcap=*/0.0);
  AttnParams p = make_params(q, k, v, seqlens, cu_seqlens, cu_seqlens, opt);
  p.tau = tau.data_ptr<float>();
  p.bias = bias.data_ptr<float>();
  p.bias_window = static_cast<int>(bias.size(1));
  return p;
}

namespace {

bool is_low_precision(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// CPU kernels run in fp32/fp64; fp16/bf16 inputs are computed in fp32 and cast back.
at::Tensor cpu_compute(const at::Tensor& t) {
  return is_low_precision(t.scalar_type()) ? t.to(at::kFloat) : t;
}

std::tuple<at::Tensor, at::Tensor> flash_fwd_cpu_op(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& seqlens, std::optional<double> softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, double softcap) {
  check_flash_inputs(q_in, k_in, v_in, seqlens, cu_seqlens_q, cu_seqlens_k);
  const FlashOptions opt = resolve_flash_options(q_in, softmax_scale, causal, window_left,
                                                 window_right, false, softcap);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  const bool packed = cu_seqlens_q.has_value();
  at::Tensor out = at::empty(out_shape(q, v), q.options());
  at::Tensor lse = at::empty(lse_shape(q, packed), q.options().dtype(at::kFloat));
  if (no_rows(q, cu_seqlens_q)) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
  } else {
    AttnParams p = make_params(q, k, v, seqlens, cu_seqlens_q, cu_seqlens_k, opt);
    set_fwd_outputs(p, out, lse);
    attention_fwd_cpu(softmax_variant(p), p, q.scalar_type());
  }
  return {out.to(q_in.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_bwd_cpu_op(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse,
    const std::optional<at::Tensor>& seqlens, std::optional<double> softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, bool deterministic,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
    double softcap) {
  check_flash_inputs(q_in, k_in, v_in, seqlens, cu_seqlens_q, cu_seqlens_k);
  check_flash_bwd_inputs(dout_in, q_in, v_in, out_in, lse, cu_seqlens_q.has_value());
  const FlashOptions opt = resolve_flash_options(q_in, softmax_scale, causal, window_left,
                                                 window_right, deterministic, softcap);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  const at::Tensor out = cpu_compute(out_in), dout = cpu_compute(dout_in);
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  at::Tensor delta = at::empty(lse.sizes(), lse.options());
  if (!no_rows(q, cu_seqlens_q) && k.numel() > 0) {
    AttnParams p = make_params(q, k, v, seqlens, cu_seqlens_q, cu_seqlens_k, opt);
    set_bwd_tensors(p, dout, out, lse, dq, dk, dv, delta);
    attention_bwd_cpu(softmax_variant(p), p, q.scalar_type());
  } else {
    dq.zero_();
    dk.zero_();
    dv.zero_();
  }
  const auto t = q_in.scalar_type();
  return {dq.to(t), dk.to(t), dv.to(t)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lazy_fwd_cpu_op(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& tau,
    const at::Tensor& bias, const std::optional<at::Tensor>& seqlens,
    std::optional<double> softmax_scale, bool return_stats,
    const std::optional<at::Tensor>& cu_seqlens) {
  check_lazy_inputs(q_in, k_in, v_in, tau, bias, seqlens, cu_seqlens);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  at::Tensor out = at::empty(out_shape(q, v), q.options());
  at::Tensor lse = at::empty(lse_shape(q, cu_seqlens.has_value()), q.options().dtype(at::kFloat));
  at::Tensor stats = at::zeros({return_stats ? 4 : 0}, q.options().dtype(at::kLong));
  if (no_rows(q, cu_seqlens)) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
  } else {
    AttnParams p = make_lazy_params(q, k, v, tau, bias, seqlens, cu_seqlens, softmax_scale);
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
  check_lazy_inputs(q_in, k_in, v_in, tau, bias, seqlens, cu_seqlens);
  check_flash_bwd_inputs(dout_in, q_in, v_in, out_in, lse, cu_seqlens.has_value());
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
    AttnParams p = make_lazy_params(q, k, v, tau, bias, seqlens, cu_seqlens, softmax_scale);
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

using FlashFwdSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
    std::optional<double>, bool, int64_t, int64_t, const OptTensor&, const OptTensor&, double);
using FlashBwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const OptTensor&, std::optional<double>, bool, int64_t, int64_t, bool,
    const OptTensor&, const OptTensor&, double);

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
                               double softcap) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = flash_fwd_op().call(q, k, v, seqlens, softmax_scale, causal, window_left,
                                          window_right, cu_seqlens_q, cu_seqlens_k, softcap);
    ctx->save_for_backward({q, k, v, out, lse, seqlens.value_or(at::Tensor()),
                            cu_seqlens_q.value_or(at::Tensor()),
                            cu_seqlens_k.value_or(at::Tensor())});
    save_scale(ctx, softmax_scale);
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["window_right"] = window_right;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->saved_data["softcap"] = softcap;
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
    auto [dq, dk, dv] = bwd.call(
        dout, saved[0], saved[1], saved[2], out, saved[4], saved_optional(saved[5]), scale,
        ctx->saved_data["causal"].toBool(), ctx->saved_data["window_left"].toInt(),
        ctx->saved_data["window_right"].toInt(), ctx->saved_data["deterministic"].toBool(),
        saved_optional(saved[6]), saved_optional(saved[7]), ctx->saved_data["softcap"].toDouble());
    return {dq,           dk,           dv,           at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> flash_attn_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& seqlens,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    bool deterministic, const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
    double softcap) {
  auto res = FlashAttnFunction::apply(q, k, v, seqlens, softmax_scale, causal, window_left,
                                      window_right, deterministic, cu_seqlens_q, cu_seqlens_k,
                                      softcap);
  return {res[0], res[1]};
}

// Below autograd (inference mode, or backends reached past the Autograd key).
std::tuple<at::Tensor, at::Tensor> flash_attn_no_grad(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& seqlens,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    bool /*deterministic*/, const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
    double softcap) {
  return flash_fwd_op().call(q, k, v, seqlens, softmax_scale, causal, window_left, window_right,
                             cu_seqlens_q, cu_seqlens_k, softcap);
}

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

// Dense and packed calls share each family's ops: cu_seqlens (packed) are optional trailing
// arguments, and with them q/k/v are [T, H, D] and lse is [Hq, T].
TORCH_LIBRARY(adaattn, m) {
  m.def(
      "flash_attn(Tensor q, Tensor k, Tensor v, Tensor? seqlens=None, float? softmax_scale=None, "
      "bool causal=False, int window_left=-1, int window_right=-1, bool deterministic=False, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, float softcap=0.0) -> (Tensor out, "
      "Tensor lse)");
  m.def(
      "flash_fwd(Tensor q, Tensor k, Tensor v, Tensor? seqlens, float? softmax_scale, bool causal, "
      "int window_left, int window_right, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
      "float softcap=0.0) -> (Tensor out, Tensor lse)");
  m.def(
      "flash_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? seqlens, float? softmax_scale, bool causal, int window_left, int window_right, "
      "bool deterministic, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
      "float softcap=0.0) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
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
  m.def(
      "block_sparse_attn(Tensor q, Tensor k, Tensor v, Tensor kv_num_blocks, Tensor kv_indices, "
      "Tensor q_num_blocks, Tensor q_indices, int block_m=128, int block_n=128, "
      "float? softmax_scale=None, bool causal=False, bool deterministic=False, "
      "float softcap=0.0) -> (Tensor out, Tensor lse)");
  m.def(
      "block_sparse_fwd(Tensor q, Tensor k, Tensor v, Tensor kv_num_blocks, Tensor kv_indices, "
      "int block_m, int block_n, float? softmax_scale, bool causal, float softcap=0.0) -> "
      "(Tensor out, Tensor lse)");
  m.def(
      "block_sparse_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor kv_num_blocks, Tensor kv_indices, Tensor q_num_blocks, Tensor q_indices, "
      "int block_m, int block_n, float? softmax_scale, bool causal, bool deterministic=False, "
      "float softcap=0.0) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  m.def(
      "low_rank_attn(Tensor q, Tensor k, Tensor v, Tensor basis, bool causal=False, "
      "float? softmax_scale=None) -> (Tensor out, Tensor lse)");
  m.def("sym_eig(Tensor a) -> (Tensor eigenvalues, Tensor eigenvectors)");
  m.def(
      "sym_eig_top(Tensor a, float energy, int min_rank, int multiple) -> (Tensor eigenvalues, "
      "Tensor eigenvectors, Tensor ranks)");
  m.def("shifted_cholesky_info(Tensor a, float rel_shift) -> Tensor");
}

TORCH_LIBRARY_IMPL(adaattn, CPU, m) {
  m.impl("flash_fwd", &flash_fwd_cpu_op);
  m.impl("flash_bwd", &flash_bwd_cpu_op);
  m.impl("lazy_fwd", &lazy_fwd_cpu_op);
  m.impl("lazy_bwd", &lazy_bwd_cpu_op);
}

TORCH_LIBRARY_IMPL(adaattn, Autograd, m) {
  m.impl("flash_attn", &flash_attn_autograd);
  m.impl("lazy_attn", &lazy_attn_autograd);
}

TORCH_LIBRARY_IMPL(adaattn, CompositeExplicitAutograd, m) {
  m.impl("flash_attn", &flash_attn_no_grad);
  m.impl("lazy_attn", &lazy_attn_no_grad);
}

}  // namespace adaattn
