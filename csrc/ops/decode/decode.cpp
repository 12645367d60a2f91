// The KV-cache (decode) ops: flash and lazy attention of a few new query rows against a cache
// that this call first appends the new keys and values to, in place. Schemas, validation, the
// CPU registration (reference speed: a paged cache is gathered, fp16/bf16 computed in fp32);
// the CUDA registration is decode_cuda.cpp. Inference only: no autograd kernel.
#include <torch/library.h>

#include <limits>

#include "../../attention_api.h"
#include "../../core/seq.h"
#include "../common/checks.h"
#include "../lazy/lazy_ops.h"
#include "decode_ops.h"

namespace adaattn {

namespace {

void check_cache_operand(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.dim() == 4, "adaattn: ", name,
              " must have 4 dims ([B, Hkv, L, D], or paged [num_pages, Hkv, page_size, D]), got ",
              t.dim(), " dims (shape ", t.sizes(), ")");
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "adaattn: ", name, " must have q's dtype ",
              q.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == q.device(), "adaattn: ", name, " must be on q's device ", q.device(),
              ", got ", t.device());
  TORCH_CHECK(t.size(-1) == 0 || t.stride(-1) == 1, "adaattn: ", name,
              " must have a contiguous last dim (stride(-1) == 1), got strides ", t.strides());
}

void check_index_tensor(const at::Tensor& t, const char* name, const char* shape,
                        const at::Tensor& q) {
  TORCH_CHECK(t.scalar_type() == at::kInt, "adaattn: ", name, " must be int32, got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == q.device(), "adaattn: ", name, " must be on q's device ",
              q.device(), ", got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "adaattn: ", name, " ", shape,
              " must be contiguous; call .contiguous() on it");
}

}  // namespace

KvCacheShape check_kvcache_inputs(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const std::optional<at::Tensor>& k,
                                  const std::optional<at::Tensor>& v,
                                  const at::Tensor& cache_seqlens,
                                  const std::optional<at::Tensor>& block_table) {
  TORCH_CHECK(q.dim() == 4, "adaattn: q must have 4 dims [B, Hq, Lq, D], got ", q.dim(),
              " dims (shape ", q.sizes(), ")");
  TORCH_CHECK(at::isFloatingType(q.scalar_type()),
              "adaattn: q must be a floating tensor (float16, bfloat16, float32, float64), got ",
              q.scalar_type());
  TORCH_CHECK(q.size(-1) == 0 || q.stride(-1) == 1,
              "adaattn: q must have a contiguous last dim (stride(-1) == 1), got strides ",
              q.strides());
  check_cache_operand(k_cache, "k_cache", q);
  check_cache_operand(v_cache, "v_cache", q);
  TORCH_CHECK(k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3),
              "adaattn: k_cache and v_cache must agree in all but the last dim, got k_cache ",
              k_cache.sizes(), ", v_cache ", v_cache.sizes());
  const int64_t batch = q.size(0), heads_kv = k_cache.size(1), len_q = q.size(2);
  TORCH_CHECK(heads_kv > 0 && q.size(1) % heads_kv == 0,
              "adaattn: the number of query heads (q.size(1) = ", q.size(1),
              ") must be a multiple of the number of kv heads (k_cache.size(1) = ", heads_kv, ")");
  TORCH_CHECK(k_cache.size(3) == q.size(3), "adaattn: head dim mismatch: q has D = ", q.size(3),
              ", k_cache has D = ", k_cache.size(3));
  TORCH_CHECK(q.size(3) > 0 && q.size(3) <= 256, "adaattn: head dim D must be in [1, 256], got ",
              q.size(3));
  TORCH_CHECK(v_cache.size(3) > 0 && v_cache.size(3) <= 256,
              "adaattn: v_cache's head dim Dv must be in [1, 256], got ", v_cache.size(3));

  check_index_tensor(cache_seqlens, "cache_seqlens", "[B]", q);
  TORCH_CHECK(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == batch,
              "adaattn: cache_seqlens must have shape [B] = [", batch, "], got ",
              cache_seqlens.sizes());

  KvCacheShape shape{block_table.has_value(), k_cache.size(2), 0, 0};
  if (shape.paged) {
    const at::Tensor& bt = *block_table;
    check_index_tensor(bt, "block_table", "[B, max_pages]", q);
    TORCH_CHECK(bt.dim() == 2 && bt.size(0) == batch,
                "adaattn: block_table must have shape [B, max_pages] with B = ", batch, ", got ",
                bt.sizes());
    shape.page_size = k_cache.size(2);
    shape.num_pages = k_cache.size(0);
    shape.capacity = bt.size(1) * shape.page_size;
    TORCH_CHECK(shape.page_size > 0, "adaattn: k_cache's page_size (dim 2) must be positive");
  } else {
    TORCH_CHECK(k_cache.size(0) == batch, "adaattn: k_cache must have q's batch size ", batch,
                " in dim 0 (or pass block_table for a paged cache), got ", k_cache.sizes());
  }
  const int64_t int_max = std::numeric_limits<int>::max();
  TORCH_CHECK(shape.capacity <= int_max && len_q <= int_max && batch <= int_max &&
                  shape.num_pages <= int_max,
              "adaattn: cache sizes and lengths must fit in int32");

  TORCH_CHECK(k.has_value() == v.has_value(),
              "adaattn: the new keys k and values v must be given together (or neither)");
  if (k.has_value()) {
    const std::vector<int64_t> k_shape = {batch, heads_kv, len_q, q.size(3)};
    const std::vector<int64_t> v_shape = {batch, heads_kv, len_q, v_cache.size(3)};
    check_cache_operand(*k, "k", q);
    check_cache_operand(*v, "v", q);
    TORCH_CHECK(k->sizes() == at::IntArrayRef(k_shape),
                "adaattn: k (new keys) must have shape [B, Hkv, Lq, D] = ",
                at::IntArrayRef(k_shape), ", got ", k->sizes());
    TORCH_CHECK(v->sizes() == at::IntArrayRef(v_shape),
                "adaattn: v (new values) must have shape [B, Hkv, Lq, Dv] = ",
                at::IntArrayRef(v_shape), ", got ", v->sizes());
  }
  return shape;
}

void check_kvcache_values(const at::Tensor& cache_seqlens,
                          const std::optional<at::Tensor>& block_table, const KvCacheShape& shape,
                          int64_t appended) {
  const at::Tensor lens = cache_seqlens.cpu();
  const int* len = lens.data_ptr<int>();
  at::Tensor table;
  if (shape.paged) table = block_table->cpu();
  for (int64_t b = 0; b < lens.size(0); ++b) {
    TORCH_CHECK(len[b] >= 0 && len[b] + appended <= shape.capacity, "adaattn: cache_seqlens[", b,
                "] = ", len[b], " leaves no room for the ", appended,
                " new tokens: cache_seqlens + Lq must be in [0, ", shape.capacity,
                "] (the cache's capacity", shape.paged ? ", max_pages * page_size)" : ")");
    if (!shape.paged) continue;
    const int64_t used = (len[b] + appended + shape.page_size - 1) / shape.page_size;
    const int* row = table.data_ptr<int>() + b * table.size(1);
    for (int64_t i = 0; i < used; ++i) {
      TORCH_CHECK(row[i] >= 0 && row[i] < shape.num_pages, "adaattn: block_table[", b, ", ", i,
                  "] = ", row[i], " is out of range [0, num_pages = ", shape.num_pages, ")");
    }
  }
}

AttnParams make_kvcache_params(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                               int64_t appended, const FlashOptions& opt) {
  AttnParams p = make_params(q, k_cache, v_cache, std::nullopt, std::nullopt, std::nullopt, opt);
  p.cache_seqlens = cache_seqlens.data_ptr<int>();
  p.cache_appended = static_cast<int>(appended);
  return p;
}

at::Tensor gather_pages(const at::Tensor& cache, const at::Tensor& block_table) {
  const int64_t batch = block_table.size(0), pages = block_table.size(1);
  const at::Tensor index = block_table.clamp(0, std::max<int64_t>(cache.size(0) - 1, 0))
                               .to(at::kLong)
                               .flatten();
  return cache.index_select(0, index)
      .view({batch, pages, cache.size(1), cache.size(2), cache.size(3)})
      .permute({0, 2, 1, 3, 4})
      .reshape({batch, cache.size(1), pages * cache.size(2), cache.size(3)});
}

namespace {

using OptTensor = std::optional<at::Tensor>;

// Writes k/v [B, Hkv, Lq, D] at positions cache_seqlens[b] + r (values checked before).
void append_cpu(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k,
                const at::Tensor& v, const at::Tensor& cache_seqlens,
                const OptTensor& block_table, const KvCacheShape& shape) {
  const int* len = cache_seqlens.data_ptr<int>();
  const int64_t len_q = k.size(2);
  for (int64_t b = 0; b < k.size(0); ++b) {
    if (!shape.paged) {
      k_cache.select(0, b).narrow(1, len[b], len_q).copy_(k.select(0, b));
      v_cache.select(0, b).narrow(1, len[b], len_q).copy_(v.select(0, b));
      continue;
    }
    const int* pages = block_table->data_ptr<int>() + b * block_table->size(1);
    for (int64_t r = 0; r < len_q; ++r) {
      const int64_t pos = len[b] + r;
      const int64_t page = pages[pos / shape.page_size], slot = pos % shape.page_size;
      k_cache.select(0, page).select(1, slot).copy_(k.select(0, b).select(1, r));
      v_cache.select(0, page).select(1, slot).copy_(v.select(0, b).select(1, r));
    }
  }
}

// Appends, then attends with `variant` (tau/bias set for the lazy one).
std::tuple<at::Tensor, at::Tensor> kvcache_attn_cpu(
    const at::Tensor& q_in, at::Tensor& k_cache, at::Tensor& v_cache, const OptTensor& k,
    const OptTensor& v, const at::Tensor& cache_seqlens, const OptTensor& block_table,
    const KvCacheShape& shape, const FlashOptions& opt, VariantId variant,
    const at::Tensor* tau, const at::Tensor* bias) {
  const int64_t appended = k.has_value() ? q_in.size(2) : 0;
  check_kvcache_values(cache_seqlens, block_table, shape, appended);
  if (k.has_value()) append_cpu(k_cache, v_cache, *k, *v, cache_seqlens, block_table, shape);
  const at::Tensor q = cpu_compute(q_in);
  const at::Tensor kc = cpu_compute(shape.paged ? gather_pages(k_cache, *block_table) : k_cache);
  const at::Tensor vc = cpu_compute(shape.paged ? gather_pages(v_cache, *block_table) : v_cache);
  at::Tensor out = at::empty(out_shape(q, vc), q.options());
  at::Tensor lse = at::empty(lse_shape(q, false), q.options().dtype(at::kFloat));
  if (q.numel() == 0 || kc.size(2) == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
  } else {
    AttnParams p = make_kvcache_params(q, kc, vc, cache_seqlens, appended, opt);
    if (tau != nullptr) {
      p.tau = tau->data_ptr<float>();
      p.bias = bias->data_ptr<float>();
      p.bias_window = static_cast<int>(bias->size(1));
    }
    set_fwd_outputs(p, out, lse);
    attention_fwd_cpu(variant, p, q.scalar_type());
  }
  return {out.to(q_in.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor> flash_kvcache_cpu_op(
    const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache, const OptTensor& k,
    const OptTensor& v, const at::Tensor& cache_seqlens, const OptTensor& block_table,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    double softcap, int64_t num_splits) {
  const KvCacheShape shape =
      check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, block_table);
  TORCH_CHECK(num_splits >= 0, "adaattn: num_splits must be >= 0 (0 = automatic), got ",
              num_splits);
  const FlashOptions opt = resolve_flash_options(q, softmax_scale, causal, window_left,
                                                 window_right, false, softcap);
  return kvcache_attn_cpu(q, k_cache, v_cache, k, v, cache_seqlens, block_table, shape, opt,
                          softmax_variant(opt), nullptr, nullptr);
}

std::tuple<at::Tensor, at::Tensor> lazy_kvcache_cpu_op(
    const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache, const OptTensor& k,
    const OptTensor& v, const at::Tensor& tau, const at::Tensor& bias,
    const at::Tensor& cache_seqlens, const OptTensor& block_table,
    std::optional<double> softmax_scale, int64_t num_splits) {
  const KvCacheShape shape =
      check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, block_table);
  check_lazy_kvcache_args(q, v_cache, tau, bias, num_splits);
  const FlashOptions opt = lazy_options(q, softmax_scale);
  return kvcache_attn_cpu(q, k_cache, v_cache, k, v, cache_seqlens, block_table, shape, opt,
                          VariantId::kLazy, &tau, &bias);
}

}  // namespace

void check_lazy_kvcache_args(const at::Tensor& q, const at::Tensor& v_cache,
                             const at::Tensor& tau, const at::Tensor& bias, int64_t num_splits) {
  TORCH_CHECK(v_cache.size(-1) == q.size(-1),
              "adaattn: lazy attention needs v_cache with q's head dim (Dv == D), got ",
              v_cache.size(-1), " and ", q.size(-1));
  check_lazy_params(q, tau, bias);
  TORCH_CHECK(num_splits >= 0, "adaattn: num_splits must be >= 0 (0 = automatic), got ",
              num_splits);
}

TORCH_LIBRARY_FRAGMENT(adaattn, m) {
  m.def(
      "flash_attn_with_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, "
      "Tensor? v, Tensor cache_seqlens, Tensor? block_table=None, float? softmax_scale=None, "
      "bool causal=True, int window_left=-1, int window_right=-1, float softcap=0.0, "
      "int num_splits=0) -> (Tensor out, Tensor lse)");
  m.def(
      "lazy_attn_with_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, "
      "Tensor? v, Tensor tau, Tensor bias, Tensor cache_seqlens, Tensor? block_table=None, "
      "float? softmax_scale=None, int num_splits=0) -> (Tensor out, Tensor lse)");
}

TORCH_LIBRARY_IMPL(adaattn, CPU, m) {
  m.impl("flash_attn_with_kvcache", &flash_kvcache_cpu_op);
  m.impl("lazy_attn_with_kvcache", &lazy_kvcache_cpu_op);
}

}  // namespace adaattn
