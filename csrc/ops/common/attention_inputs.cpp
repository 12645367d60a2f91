// The attention core's op-side inputs, shared by the flash, lazy, block-sparse and low-rank
// families and by their CPU and CUDA registrations: validation of q/k/v, seqlens and cu_seqlens,
// option resolution, output shapes and AttnParams construction (attention_inputs.h).
#include <ATen/ATen.h>

#include <limits>

#include "attention_inputs.h"
#include "../../core/seq.h"
#include "checks.h"

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
  check_cu_seqlens_tensor(*cu_seqlens_q, "cu_seqlens_q", q);
  check_cu_seqlens_tensor(*cu_seqlens_k, "cu_seqlens_k", q);
  TORCH_CHECK(cu_seqlens_q->size(0) == cu_seqlens_k->size(0),
              "adaattn: cu_seqlens_q and cu_seqlens_k must have the same length N + 1, got ",
              cu_seqlens_q->size(0), " and ", cu_seqlens_k->size(0));
  TORCH_CHECK(cu_seqlens_q->size(0) - 1 <= std::numeric_limits<int>::max(),
              "adaattn: too many sequences for int32");
  check_cu_seqlens_values(*cu_seqlens_q, "cu_seqlens_q", q.size(0), "the packed length ");
  check_cu_seqlens_values(*cu_seqlens_k, "cu_seqlens_k", k.size(0), "the packed length ");
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
                                   BwdMode bwd_mode, double softcap) {
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
