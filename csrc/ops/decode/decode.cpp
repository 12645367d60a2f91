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

void check_cache_operand(const char* op, const at::Tensor& t, const char* name,
                         const at::Tensor& q, bool fp8_cache = false) {
  ADAATTN_CHECK_VALUE(t.dim() == 4, name,
                      " must have 4 dims ([B, Hkv, L, D], or paged [num_pages, Hkv, page_size, D])"
                      ", got ", t.dim(), " dims (shape ", t.sizes(), ")");
  if (fp8_cache) {
    ADAATTN_CHECK_TYPE(t.scalar_type() == at::kFloat8_e4m3fn, name,
                       " must be float8_e4m3fn as the other cache operand, got ",
                       t.scalar_type());
  } else {
    ADAATTN_CHECK_TYPE(t.scalar_type() == q.scalar_type(), name, " must have q's dtype ",
                       q.scalar_type(), ", got ", t.scalar_type());
  }
  ADAATTN_CHECK_DEVICE(t.device() == q.device(), name, " must be on q's device ", q.device(),
                       ", got ", t.device());
  ADAATTN_CHECK_VALUE(t.size(-1) == 0 || t.stride(-1) == 1, name,
                      " must have a contiguous last dim (stride(-1) == 1), got strides ",
                      t.strides());
}

void check_index_tensor(const char* op, const at::Tensor& t, const char* name, const char* shape,
                        const at::Tensor& q) {
  ADAATTN_CHECK_TYPE(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  ADAATTN_CHECK_DEVICE(t.device() == q.device(), name, " must be on q's device ", q.device(),
                       ", got ", t.device());
  ADAATTN_CHECK_VALUE(t.is_contiguous(), name, " ", shape,
                      " must be contiguous; call .contiguous() on it");
}

}  // namespace

KvCacheShape check_kvcache_inputs(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const std::optional<at::Tensor>& k,
                                  const std::optional<at::Tensor>& v,
                                  const at::Tensor& cache_seqlens,
                                  const std::optional<at::Tensor>& block_table,
                                  int64_t num_splits, bool fp8_cache) {
  ADAATTN_CHECK_VALUE(q.dim() == 4, "q must have 4 dims [B, Hq, Lq, D], got ", q.dim(),
                      " dims (shape ", q.sizes(), ")");
  ADAATTN_CHECK_TYPE(at::isFloatingType(q.scalar_type()),
                     "q must be a floating tensor (float16, bfloat16, float32, float64), got ",
                     q.scalar_type());
  ADAATTN_CHECK_VALUE(q.size(-1) == 0 || q.stride(-1) == 1,
                      "q must have a contiguous last dim (stride(-1) == 1), got strides ",
                      q.strides());
  check_cache_operand(op, k_cache, "k_cache", q, fp8_cache);
  check_cache_operand(op, v_cache, "v_cache", q, fp8_cache);
  ADAATTN_CHECK_VALUE(k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3),
                      "k_cache and v_cache must agree in all but the last dim, got k_cache ",
                      k_cache.sizes(), ", v_cache ", v_cache.sizes());
  const int64_t batch = q.size(0), heads_kv = k_cache.size(1), len_q = q.size(2);
  ADAATTN_CHECK_VALUE(heads_kv > 0 && q.size(1) % heads_kv == 0,
                      "the number of query heads (q.size(1) = ", q.size(1),
                      ") must be a multiple of the number of kv heads (k_cache.size(1) = ",
                      heads_kv, ")");
  ADAATTN_CHECK_VALUE(k_cache.size(3) == q.size(3), "head dim mismatch: q has D = ", q.size(3),
                      ", k_cache has D = ", k_cache.size(3));
  ADAATTN_CHECK_VALUE(q.size(3) > 0 && q.size(3) <= 256,
                      "head dim D = q.size(-1) must be in [1, 256], got ", q.size(3));
  ADAATTN_CHECK_VALUE(v_cache.size(3) > 0 && v_cache.size(3) <= 256,
                      "v_cache's head dim Dv must be in [1, 256], got ", v_cache.size(3));

  check_index_tensor(op, cache_seqlens, "cache_seqlens", "[B]", q);
  ADAATTN_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == batch,
                      "cache_seqlens must have shape [B] = [", batch, "], got ",
                      cache_seqlens.sizes());

  KvCacheShape shape{block_table.has_value(), k_cache.size(2), 0, 0};
  if (shape.paged) {
    const at::Tensor& bt = *block_table;
    check_index_tensor(op, bt, "block_table", "[B, max_pages]", q);
    ADAATTN_CHECK_VALUE(bt.dim() == 2 && bt.size(0) == batch,
                        "block_table must have shape [B, max_pages] with B = ", batch, ", got ",
                        bt.sizes());
    shape.page_size = k_cache.size(2);
    shape.num_pages = k_cache.size(0);
    shape.capacity = bt.size(1) * shape.page_size;
    ADAATTN_CHECK_VALUE(shape.page_size > 0, "k_cache's page_size (dim 2) must be positive");
  } else {
    ADAATTN_CHECK_VALUE(k_cache.size(0) == batch, "k_cache must have q's batch size ", batch,
                        " in dim 0 (or pass block_table for a paged cache), got ",
                        k_cache.sizes());
  }
  const int64_t int_max = std::numeric_limits<int>::max();
  ADAATTN_CHECK_VALUE(shape.capacity <= int_max && len_q <= int_max && batch <= int_max &&
                          shape.num_pages <= int_max,
                      "cache sizes and lengths must fit in int32");

  ADAATTN_CHECK_VALUE(k.has_value() == v.has_value(),
                      "the new keys k and values v must be given together (or neither)");
  if (k.has_value()) {
    const std::vector<int64_t> k_shape = {batch, heads_kv, len_q, q.size(3)};
    const std::vector<int64_t> v_shape = {batch, heads_kv, len_q, v_cache.size(3)};
    check_cache_operand(op, *k, "k", q);
    check_cache_operand(op, *v, "v", q);
    ADAATTN_CHECK_VALUE(k->sizes() == at::IntArrayRef(k_shape),
                        "k (new keys) must have shape [B, Hkv, Lq, D] = ",
                        at::IntArrayRef(k_shape), ", got ", k->sizes());
    ADAATTN_CHECK_VALUE(v->sizes() == at::IntArrayRef(v_shape),
                        "v (new values) must have shape [B, Hkv, Lq, Dv] = ",
                        at::IntArrayRef(v_shape), ", got ", v->sizes());
  }
  ADAATTN_CHECK_VALUE(num_splits >= 0, "num_splits must be >= 0 (0 = automatic), got ",
                      num_splits);
  return shape;
}

void check_kvcache_values(const char* op, const at::Tensor& cache_seqlens,
                          const std::optional<at::Tensor>& block_table, const KvCacheShape& shape,
                          int64_t appended) {
  if (!check_values_of(cache_seqlens)) return;
  const at::Tensor lens = cache_seqlens.cpu();
  const int* len = lens.data_ptr<int>();
  at::Tensor table;
  if (shape.paged) table = block_table->cpu();
  for (int64_t b = 0; b < lens.size(0); ++b) {
    ADAATTN_CHECK_VALUE(len[b] >= 0 && len[b] + appended <= shape.capacity, "cache_seqlens[", b,
                        "] = ", len[b], " leaves no room for the ", appended,
                        " new tokens: cache_seqlens + Lq must be in [0, ", shape.capacity,
                        "] (the cache's capacity",
                        shape.paged ? ", max_pages * page_size)" : ")");
    if (!shape.paged) continue;
    const int64_t used = (len[b] + appended + shape.page_size - 1) / shape.page_size;
    const int* row = table.data_ptr<int>() + b * table.size(1);
    for (int64_t i = 0; i < used; ++i) {
      ADAATTN_CHECK_VALUE(row[i] >= 0 && row[i] < shape.num_pages, "block_table[", b, ", ", i,
                          "] = ", row[i], " is out of range [0, num_pages = ", shape.num_pages,
                          ")");
    }
  }
}

bool is_fp8_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  return k_cache.scalar_type() == at::kFloat8_e4m3fn ||
         v_cache.scalar_type() == at::kFloat8_e4m3fn;
}

void check_fp8_cache(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                     const std::optional<at::Tensor>& k,
                     const std::optional<at::Tensor>& block_table,
                     const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale, bool fp8_cache) {
  if (!fp8_cache) {
    ADAATTN_CHECK_VALUE(!k_scale.has_value() && !v_scale.has_value(),
                        "k_scale and v_scale belong to an 8-bit (float8_e4m3fn) cache; the "
                        "caches have dtype ", k_cache.scalar_type());
    return;
  }
  ADAATTN_CHECK_VALUE(block_table.has_value(),
                      "an 8-bit (float8_e4m3fn) cache must be paged (pass block_table; "
                      "adaattn.KVCache(dtype=torch.float8_e4m3fn) keeps one)");
  ADAATTN_CHECK_VALUE(!k.has_value(),
                      "new keys k and values v cannot be appended to an 8-bit cache inside the "
                      "op; quantise them into it first (adaattn.KVCache.append) and pass "
                      "k = v = None");
  const std::vector<int64_t> shape = {k_cache.size(0), k_cache.size(1)};
  for (const auto& [scale, name] : {std::pair{&k_scale, "k_scale"}, {&v_scale, "v_scale"}}) {
    ADAATTN_CHECK_VALUE(scale->has_value(), name,
                        " (float32 [num_pages, Hkv]) is required with an 8-bit cache");
    const at::Tensor& t = **scale;
    ADAATTN_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be float32, got ",
                       t.scalar_type());
    ADAATTN_CHECK_DEVICE(t.device() == q.device(), name, " must be on q's device ", q.device(),
                         ", got ", t.device());
    ADAATTN_CHECK_VALUE(t.sizes() == at::IntArrayRef(shape), name,
                        " must have shape [num_pages, Hkv] = ", at::IntArrayRef(shape), ", got ",
                        t.sizes());
    ADAATTN_CHECK_VALUE(t.is_contiguous(), name,
                        " must be contiguous; call .contiguous() on it");
  }
}

DequantizedPages dequantize_pages(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& k_scale, const at::Tensor& v_scale,
                                  const at::Tensor& block_table, const KvCacheShape& shape,
                                  c10::ScalarType dtype) {
  const at::Tensor index =
      block_table.clamp(0, std::max<int64_t>(shape.num_pages - 1, 0)).to(at::kLong).flatten();
  auto pages = [&](const at::Tensor& cache, const at::Tensor& scale) {
    // Gathered as bytes (a plain copy on every device and torch version), then converted.
    const at::Tensor bytes = cache.view(at::kByte).index_select(0, index);
    const at::Tensor s = scale.index_select(0, index);
    return (bytes.view(cache.scalar_type()).to(at::kFloat) *
            s.view({s.size(0), s.size(1), 1, 1})).to(dtype);
  };
  KvCacheShape compact = shape;
  compact.num_pages = index.numel();
  return {pages(k_cache, k_scale), pages(v_cache, v_scale),
          at::arange(index.numel(), block_table.options()).view(block_table.sizes()), compact};
}

void check_query_basis(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& basis) {
  ADAATTN_CHECK_VALUE(q.dim() == 4, "q must be [B, Hq, Lq, D], got shape ", q.sizes());
  ADAATTN_CHECK_VALUE(k_cache.dim() == 4, "k_cache must be [B, Hkv, Lmax, R] or paged "
                      "[num_pages, Hkv, page_size, R], got shape ", k_cache.sizes());
  ADAATTN_CHECK_TYPE(basis.scalar_type() == at::kFloat || basis.scalar_type() == q.scalar_type(),
                     "q_basis must be float32 or q's dtype ", q.scalar_type(), ", got ",
                     basis.scalar_type());
  ADAATTN_CHECK_DEVICE(basis.device() == q.device(), "q_basis must be on q's device ",
                       q.device(), ", got ", basis.device());
  ADAATTN_CHECK_VALUE(basis.dim() == 4 && basis.size(0) == q.size(0) &&
                          basis.size(1) == k_cache.size(1) && basis.size(2) == q.size(3),
                      "q_basis must be [B, Hkv, D, R] = [", q.size(0), ", ", k_cache.size(1),
                      ", ", q.size(3), ", R], got ", basis.sizes());
  ADAATTN_CHECK_VALUE(basis.size(3) >= 1 && basis.size(3) <= q.size(3),
                      "q_basis's rank R = q_basis.size(3) must be in [1, D = ", q.size(3),
                      "], got ", basis.size(3));
  ADAATTN_CHECK_VALUE(k_cache.size(3) == basis.size(3), "k_cache holds the projected keys k U: "
                      "its head dim k_cache.size(-1) = ", k_cache.size(3),
                      " must be q_basis's rank R = ", basis.size(3));
}

at::Tensor project_query(const at::Tensor& q, const at::Tensor& basis, int64_t heads_kv) {
  const at::ScalarType dtype = at::promote_types(basis.scalar_type(), q.scalar_type());
  const int64_t batch = q.size(0), heads_q = q.size(1), len_q = q.size(2);
  const at::Tensor grouped = q.reshape({batch, heads_kv, heads_q / heads_kv * len_q, q.size(3)});
  return at::matmul(grouped.to(dtype), basis.to(dtype))
      .view({batch, heads_q, len_q, basis.size(3)})
      .to(q.scalar_type());
}

AttnParams make_kvcache_params(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                               int64_t appended, const FlashOptions& opt) {
  AttnParams p = make_params(q, k_cache, v_cache, std::nullopt, std::nullopt, std::nullopt, opt);
  p.cache_seqlens = cache_seqlens.data_ptr<int>();
  p.cache_appended = static_cast<int>(appended);
  return p;
}

void set_lazy_params(AttnParams& p, const at::Tensor* tau, const at::Tensor* bias) {
  if (tau == nullptr) return;
  p.tau = tau->data_ptr<float>();
  p.bias = bias->data_ptr<float>();
  p.bias_window = static_cast<int>(bias->size(1));
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

void fill_keyless_lse(at::Tensor& lse, const ScoreTensors* mods) {
  if (mods != nullptr && mods->sinks.defined()) {
    // A row that sees no key has only its sink in the denominator.
    lse.copy_(mods->sinks.view({1, -1, 1}).expand_as(lse));
  } else {
    lse.fill_(-std::numeric_limits<float>::infinity());
  }
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
    const char* op, const at::Tensor& q_in, at::Tensor& k_cache, at::Tensor& v_cache,
    const OptTensor& k, const OptTensor& v, const at::Tensor& cache_seqlens,
    const OptTensor& block_table, const KvCacheShape& shape, const FlashOptions& opt,
    VariantId variant, const at::Tensor* tau, const at::Tensor* bias,
    const ScoreTensors* mods = nullptr) {
  const int64_t appended = k.has_value() ? q_in.size(2) : 0;
  check_kvcache_values(op, cache_seqlens, block_table, shape, appended);
  if (k.has_value()) append_cpu(k_cache, v_cache, *k, *v, cache_seqlens, block_table, shape);
  const at::Tensor q = cpu_compute(q_in);
  const at::Tensor kc = cpu_compute(shape.paged ? gather_pages(k_cache, *block_table) : k_cache);
  const at::Tensor vc = cpu_compute(shape.paged ? gather_pages(v_cache, *block_table) : v_cache);
  at::Tensor out = at::empty(out_shape(q, vc), q.options());
  at::Tensor lse = at::empty(lse_shape(q, false), q.options().dtype(at::kFloat));
  if (q.numel() == 0 || kc.size(2) == 0) {
    out.zero_();
    fill_keyless_lse(lse, mods);
  } else {
    AttnParams p = make_kvcache_params(q, kc, vc, cache_seqlens, appended, opt);
    set_lazy_params(p, tau, bias);
    if (mods != nullptr) mods->set(p);
    set_fwd_outputs(p, out, lse);
    attention_fwd_cpu(variant, p, q.scalar_type());
  }
  return {out.to(q_in.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor> flash_kvcache_cpu_op(
    const at::Tensor& q_full, at::Tensor& k_cache, at::Tensor& v_cache, const OptTensor& k,
    const OptTensor& v, const at::Tensor& cache_seqlens, const OptTensor& block_table,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    double softcap, int64_t num_splits, const OptTensor& k_scale, const OptTensor& v_scale,
    const OptTensor& alibi_slopes, const OptTensor& sinks, const OptTensor& rel_bias,
    const OptTensor& q_basis) {
  constexpr const char* op = "flash_attn_with_kvcache";
  if (q_basis.has_value()) check_query_basis(op, q_full, k_cache, *q_basis);
  // A low-rank key cache attends q U; the default scale is the full head dim's.
  const at::Tensor q =
      q_basis.has_value() ? project_query(q_full, *q_basis, k_cache.size(1)) : q_full;
  const bool fp8 = is_fp8_cache(k_cache, v_cache);
  const KvCacheShape shape = check_kvcache_inputs(op, q, k_cache, v_cache, k, v, cache_seqlens,
                                                  block_table, num_splits, fp8);
  check_fp8_cache(op, q, k_cache, k, block_table, k_scale, v_scale, fp8);
  const FlashOptions opt = resolve_flash_options(op, q_full, softmax_scale, causal, window_left,
                                                 window_right, BwdMode::kAtomic, softcap);
  const ScoreTensors mods(op, q, q.size(0), alibi_slopes, sinks, rel_bias);
  const VariantId variant = softmax_variant(opt, mods);
  if (fp8) {
    // The table's values are checked before the copy's table replaces it.
    check_kvcache_values(op, cache_seqlens, block_table, shape, 0);
    DequantizedPages d = dequantize_pages(k_cache, v_cache, *k_scale, *v_scale, *block_table,
                                          shape, q.scalar_type());
    return kvcache_attn_cpu(op, q, d.k_cache, d.v_cache, k, v, cache_seqlens, d.block_table,
                            d.shape, opt, variant, nullptr, nullptr, &mods);
  }
  return kvcache_attn_cpu(op, q, k_cache, v_cache, k, v, cache_seqlens, block_table, shape, opt,
                          variant, nullptr, nullptr, &mods);
}

std::tuple<at::Tensor, at::Tensor> lazy_kvcache_cpu_op(
    const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache, const OptTensor& k,
    const OptTensor& v, const at::Tensor& tau, const at::Tensor& bias,
    const at::Tensor& cache_seqlens, const OptTensor& block_table,
    std::optional<double> softmax_scale, int64_t num_splits) {
  constexpr const char* op = "lazy_attn_with_kvcache";
  const KvCacheShape shape =
      check_kvcache_inputs(op, q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits);
  check_lazy_kvcache_args(op, q, v_cache, tau, bias);
  const FlashOptions opt = lazy_options(op, q, softmax_scale);
  return kvcache_attn_cpu(op, q, k_cache, v_cache, k, v, cache_seqlens, block_table, shape, opt,
                          VariantId::kLazy, &tau, &bias);
}

}  // namespace

void check_lazy_kvcache_args(const char* op, const at::Tensor& q, const at::Tensor& v_cache,
                             const at::Tensor& tau, const at::Tensor& bias) {
  ADAATTN_CHECK_VALUE(v_cache.size(-1) == q.size(-1),
                      "lazy attention needs v_cache with q's head dim (Dv == D), got ",
                      v_cache.size(-1), " and ", q.size(-1));
  check_lazy_params(op, q, tau, bias);
}

TORCH_LIBRARY_FRAGMENT(adaattn, m) {
  m.def(
      "flash_attn_with_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, "
      "Tensor? v, Tensor cache_seqlens, Tensor? block_table=None, float? softmax_scale=None, "
      "bool causal=True, int window_left=-1, int window_right=-1, float softcap=0.0, "
      "int num_splits=0, Tensor? k_scale=None, Tensor? v_scale=None, "
      "Tensor? alibi_slopes=None, Tensor? sinks=None, Tensor? rel_bias=None, "
      "Tensor? q_basis=None) -> (Tensor out, Tensor lse)");
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
