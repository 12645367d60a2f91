// The attention core's op-side inputs, shared by the flash, lazy, block-sparse and low-rank
// families and by their CPU and CUDA registrations: validation of q/k/v, seqlens and cu_seqlens,
// option resolution, output shapes and AttnParams construction (attention_inputs.h).
#include <ATen/ATen.h>

#include <algorithm>
#include <limits>

#include "attention_inputs.h"
#include "../../core/seq.h"
#include "checks.h"

namespace adaattn {

namespace {

void check_qkv_tensor(const char* op, const at::Tensor& t, const char* name, bool packed) {
  ADAATTN_CHECK_VALUE(t.dim() == (packed ? 3 : 4), name, " must have ",
                      packed ? "3 dims [T, H, D] (packed, with cu_seqlens)" : "4 dims [B, H, L, D]",
                      ", got ", t.dim(), " dims (shape ", t.sizes(), ")");
  ADAATTN_CHECK_TYPE(at::isFloatingType(t.scalar_type()), name,
                     " must be a floating tensor (float16, bfloat16, float32, float64), got ",
                     t.scalar_type());
  ADAATTN_CHECK_VALUE(t.size(-1) == 0 || t.stride(-1) == 1, name,
                      " must have a contiguous last dim (stride(-1) == 1), got strides ",
                      t.strides(), "; call .contiguous() on it");
}

void check_seq_args(const char* op, const at::Tensor& q, const at::Tensor& k,
                    const std::optional<at::Tensor>& seqlens,
                    const std::optional<at::Tensor>& cu_seqlens_q,
                    const std::optional<at::Tensor>& cu_seqlens_k, const char* cu_name_q,
                    const char* cu_name_k) {
  ADAATTN_CHECK_VALUE(cu_seqlens_q.has_value() == cu_seqlens_k.has_value(),
                      "cu_seqlens_q and cu_seqlens_k must be given together");
  if (!cu_seqlens_q.has_value()) return;
  ADAATTN_CHECK_VALUE(!seqlens.has_value(),
                      "seqlens (padded batches) and cu_seqlens (packed batches) exclude each "
                      "other");
  check_cu_seqlens_tensor(op, *cu_seqlens_q, cu_name_q, q);
  check_cu_seqlens_tensor(op, *cu_seqlens_k, cu_name_k, q);
  ADAATTN_CHECK_VALUE(cu_seqlens_q->size(0) == cu_seqlens_k->size(0),
                      "cu_seqlens_q and cu_seqlens_k must have the same length N + 1, got ",
                      cu_seqlens_q->size(0), " and ", cu_seqlens_k->size(0));
  ADAATTN_CHECK_VALUE(cu_seqlens_q->size(0) - 1 <= std::numeric_limits<int>::max(),
                      "too many sequences for int32");
  check_cu_seqlens_values(op, *cu_seqlens_q, cu_name_q, q.size(0), "the packed length ");
  check_cu_seqlens_values(op, *cu_seqlens_k, cu_name_k, k.size(0), "the packed length ");
}

// seqlens int32 [B] on q's device; its values (where check_values_of) in [0, max(Lq, Lk)].
void check_seqlens(const char* op, const at::Tensor& s, const at::Tensor& q,
                   const at::Tensor& k) {
  ADAATTN_CHECK_TYPE(s.scalar_type() == at::kInt, "seqlens must be int32, got ",
                     s.scalar_type());
  ADAATTN_CHECK_VALUE(s.dim() == 1 && s.size(0) == q.size(0), "seqlens must have shape [B] = [",
                      q.size(0), "], got ", s.sizes());
  ADAATTN_CHECK_DEVICE(s.device() == q.device(), "seqlens must be on ", q.device(), ", got ",
                       s.device());
  if (!check_values_of(s)) return;
  const int64_t len = std::max(q.size(2), k.size(2));
  const at::Tensor host = s.cpu().contiguous();
  const int* values = host.data_ptr<int>();
  for (int64_t b = 0; b < host.size(0); ++b) {
    ADAATTN_CHECK_VALUE(values[b] >= 0 && values[b] <= len, "seqlens[", b, "] = ", values[b],
                        " is out of range [0, max(Lq, Lk) = ", len, "]");
  }
}

}  // namespace

void check_flash_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const std::optional<at::Tensor>& seqlens,
                        const std::optional<at::Tensor>& cu_seqlens_q,
                        const std::optional<at::Tensor>& cu_seqlens_k, const char* cu_name_q,
                        const char* cu_name_k) {
  const bool packed = cu_seqlens_q.has_value() || cu_seqlens_k.has_value();
  check_qkv_tensor(op, q, "q", packed);
  check_qkv_tensor(op, k, "k", packed);
  check_qkv_tensor(op, v, "v", packed);
  ADAATTN_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                     "q, k and v must have the same dtype, got q ", q.scalar_type(), ", k ",
                     k.scalar_type(), ", v ", v.scalar_type());
  ADAATTN_CHECK_DEVICE(k.device() == q.device() && v.device() == q.device(),
                       "q, k and v must be on the same device, got q on ", q.device(), ", k on ",
                       k.device(), ", v on ", v.device());
  ADAATTN_CHECK_VALUE(packed || (k.size(0) == q.size(0) && v.size(0) == q.size(0)),
                      "batch size mismatch: q ", q.sizes(), ", k ", k.sizes(), ", v ",
                      v.sizes());
  ADAATTN_CHECK_VALUE(v.sizes().slice(0, v.dim() - 1) == k.sizes().slice(0, k.dim() - 1),
                      "k and v must have the same heads and length, got k ", k.sizes(), ", v ",
                      v.sizes());
  ADAATTN_CHECK_VALUE(k.size(1) > 0 && q.size(1) % k.size(1) == 0,
                      "the number of query heads (q.size(1) = ", q.size(1),
                      ") must be a multiple of the number of kv heads (k.size(1) = ", k.size(1),
                      ")");
  ADAATTN_CHECK_VALUE(k.size(-1) == q.size(-1), "head dim mismatch: q has D = ", q.size(-1),
                      ", k has D = ", k.size(-1));
  ADAATTN_CHECK_VALUE(q.size(-1) > 0 && q.size(-1) <= 256,
                      "head dim D = q.size(-1) must be in [1, 256], got ", q.size(-1));
  ADAATTN_CHECK_VALUE(v.size(-1) > 0 && v.size(-1) <= 256,
                      "v's head dim Dv = v.size(-1) must be in [1, 256], got ", v.size(-1));
  const int64_t int_max = std::numeric_limits<int>::max();
  const int64_t len_dim = packed ? 0 : 2;
  ADAATTN_CHECK_VALUE(
      q.size(len_dim) <= int_max && k.size(len_dim) <= int_max && q.size(0) <= int_max,
      "sequence lengths and batch of q and k must fit in int32");
  check_seq_args(op, q, k, seqlens, cu_seqlens_q, cu_seqlens_k, cu_name_q, cu_name_k);
  if (seqlens.has_value()) check_seqlens(op, *seqlens, q, k);
}

std::vector<int64_t> out_shape(const at::Tensor& q, const at::Tensor& v) {
  std::vector<int64_t> shape = q.sizes().vec();
  shape.back() = v.size(-1);
  return shape;
}

at::Tensor empty_following(const at::Tensor& like, int64_t last,
                           const at::TensorOptions& options) {
  std::vector<int64_t> shape = like.sizes().vec();
  shape.back() = last;
  if (like.dim() != 4 || like.stride(1) >= like.stride(2)) return at::empty(shape, options);
  return at::empty({shape[0], shape[2], shape[1], shape[3]}, options).transpose(1, 2);
}

std::vector<int64_t> lse_shape(const at::Tensor& q, bool packed) {
  if (packed) return {q.size(1), q.size(0)};
  return {q.size(0), q.size(1), q.size(2)};
}

void check_flash_bwd_inputs(const char* op, const at::Tensor& dout, const at::Tensor& q,
                            const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                            bool packed) {
  const std::vector<int64_t> shape = out_shape(q, v);
  ADAATTN_CHECK_VALUE(dout.sizes() == at::IntArrayRef(shape) &&
                          out.sizes() == at::IntArrayRef(shape),
                      "grad_out and out must have q's shape with v's head dim ",
                      at::IntArrayRef(shape), ", got ", dout.sizes(), " and ", out.sizes());
  ADAATTN_CHECK_TYPE(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
                     "grad_out and out must have q's dtype ", q.scalar_type());
  ADAATTN_CHECK_VALUE(dout.stride(-1) == 1 || dout.sym_numel() == 0,
                      "grad_out must have a contiguous last dim");
  ADAATTN_CHECK_VALUE(out.stride(-1) == 1 || out.sym_numel() == 0,
                      "out must have a contiguous last dim");
  const std::vector<int64_t> expected = lse_shape(q, packed);
  ADAATTN_CHECK_TYPE(lse.scalar_type() == at::kFloat, "lse must be float32, got ",
                     lse.scalar_type());
  ADAATTN_CHECK_VALUE(lse.sizes() == at::IntArrayRef(expected), "lse must have shape ",
                      packed ? "[Hq, Tq]" : "[B, Hq, Lq]", " = ", at::IntArrayRef(expected),
                      ", got ", lse.sizes());
  ADAATTN_CHECK_VALUE(lse.is_contiguous(), "lse must be contiguous");
  ADAATTN_CHECK_DEVICE(dout.device() == q.device() && out.device() == q.device() &&
                           lse.device() == q.device(),
                       "grad_out, out and lse must be on q's device ", q.device());
}

FlashOptions resolve_flash_options(const char* op, const at::Tensor& q,
                                   std::optional<double> softmax_scale, bool causal,
                                   int64_t window_left, int64_t window_right, BwdMode bwd_mode,
                                   double softcap) {
  ADAATTN_CHECK_VALUE(window_left >= -1 && window_right >= -1,
                      "window must be (left, right) with each >= 0 or -1 (unbounded), got (",
                      window_left, ", ", window_right, ")");
  const int64_t int_max = std::numeric_limits<int>::max();
  ADAATTN_CHECK_VALUE(window_left <= int_max && window_right <= int_max,
                      "window entries must fit in int32");
  const double scale = softmax_scale_or_default(softmax_scale, q.size(-1));
  ADAATTN_CHECK_VALUE(std::isfinite(scale), "softmax_scale must be finite, got ", scale);
  // The tensor-core kernels read softcap as float32: it must stay finite there, and a positive
  // value nonzero (the exact paths take it as given).
  const float cap = static_cast<float>(softcap);
  ADAATTN_CHECK_VALUE(softcap >= 0 && std::isfinite(cap) && (softcap == 0 || cap > 0),
                      "softcap must be 0 (off) or a positive finite float32 value, got ",
                      softcap);
  return {scale, static_cast<int>(window_left), causal ? 0 : static_cast<int>(window_right),
          bwd_mode, softcap};
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
  p.bwd_mode = opt.bwd_mode;
  p.softcap = opt.softcap;
  return p;
}

ScoreTensors::ScoreTensors(const char* op, const at::Tensor& q, int64_t batch,
                           const std::optional<at::Tensor>& alibi, const std::optional<at::Tensor>& sinks_in,
                           const std::optional<at::Tensor>& bias) {
  const int64_t heads = q.dim() >= 2 ? q.size(1) : 0;
  auto common = [&](const at::Tensor& t, const char* name) {
    ADAATTN_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be float32, got ",
                       t.scalar_type());
    ADAATTN_CHECK_DEVICE(t.device() == q.device(), name, " must be on ", q.device(), ", got ",
                         t.device());
    return t.contiguous();
  };
  if (alibi.has_value()) {
    const at::Tensor& t = *alibi;
    ADAATTN_CHECK_VALUE((t.dim() == 1 && t.size(0) == heads) ||
                            (t.dim() == 2 && t.size(0) == batch && t.size(1) == heads),
                        "alibi_slopes must have shape [Hq] = [", heads, "] or [B, Hq] = [", batch,
                        ", ", heads, "], got ", t.sizes());
    alibi_slopes = common(t, "alibi_slopes");
  }
  if (sinks_in.has_value()) {
    const at::Tensor& t = *sinks_in;
    ADAATTN_CHECK_VALUE(t.dim() == 1 && t.size(0) == heads, "sinks must have shape [Hq] = [",
                        heads, "], got ", t.sizes());
    sinks = common(t, "sinks");
  }
  if (bias.has_value()) {
    const at::Tensor& t = *bias;
    ADAATTN_CHECK_VALUE(t.dim() == 2 && t.size(0) == heads && t.size(1) >= 1 &&
                            t.size(1) <= std::numeric_limits<int>::max(),
                        "rel_bias must have shape [Hq, W] = [", heads, ", W] with W >= 1, got ",
                        t.sizes());
    rel_bias = common(t, "rel_bias");
  }
}

void ScoreTensors::set(AttnParams& p, at::Tensor* dsinks, at::Tensor* drel_bias) const {
  if (alibi_slopes.defined()) {
    p.alibi_slopes = alibi_slopes.data_ptr<float>();
    p.alibi_batch_stride = alibi_slopes.dim() == 2 ? alibi_slopes.size(1) : 0;
  }
  if (sinks.defined()) {
    p.sinks = sinks.data_ptr<float>();
    if (dsinks != nullptr && dsinks->numel() > 0) p.dsinks = dsinks->data_ptr<float>();
  }
  if (rel_bias.defined()) {
    p.bias = rel_bias.data_ptr<float>();
    p.bias_window = static_cast<int>(rel_bias.size(1));
    if (drel_bias != nullptr && drel_bias->numel() > 0) p.dbias = drel_bias->data_ptr<float>();
  }
}

at::Tensor ScoreTensors::grad_like(const at::Tensor& t, bool wanted, const at::Tensor& q) const {
  if (t.defined() && wanted) return at::zeros_like(t);
  return at::empty({0}, q.options().dtype(at::kFloat));
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

}  // namespace adaattn
