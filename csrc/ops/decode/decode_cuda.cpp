// CUDA registration of the KV-cache ops. The decode kernel writes the new rows into the cache
// itself (append_kernel does ahead of the other kernels); fp16/bf16 at the
// decode kernel's head dims (D == Dv in {64, 128}; D in {32, 64} with Dv = 128) go to the
// split-KV kernel, reading a paged cache through its block table. Everything else
// (float32/float64, other head dims) runs the prefill kernels of the attention core on the cache
// (a paged one gathered first).
// Launches on the current stream; no host synchronisation, no allocation whose size depends on
// values (CUDA-graph safe).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "../../attention_api.h"
#include "../common/cuda_inputs.h"
#include "../lazy/lazy_ops.h"
#include "decode_ops.h"

namespace adaattn {
namespace {

using OptTensor = std::optional<at::Tensor>;

// cp.async reads 16-byte chunks: base and strides (but the last dim's) multiples of 16 bytes.
bool chunk_aligned(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.stride(d) * t.element_size() % 16 != 0) return false;
  }
  return true;
}

void set_cache_layout(AttnParams& p, const OptTensor& block_table, const KvCacheShape& shape) {
  if (!shape.paged) return;
  p.block_table = block_table->data_ptr<int>();
  p.block_table_stride = block_table->size(1);
  p.page_size = static_cast<int>(shape.page_size);
  p.page_shift = (shape.page_size & (shape.page_size - 1)) == 0
                     ? __builtin_ctzll(static_cast<unsigned long long>(shape.page_size))
                     : -1;
  p.num_pages = static_cast<int>(shape.num_pages);
  p.len_k = static_cast<int>(shape.capacity);
}

// The rows k [B, Hkv, Lq, D] and v [B, Hkv, Lq, Dv] that the kernels write into the cache.
void set_new_rows(AttnParams& p, const at::Tensor& k, const at::Tensor& v) {
  p.k_new = k.data_ptr();
  p.v_new = v.data_ptr();
  p.k_new_batch_stride = k.stride(0);
  p.k_new_head_stride = k.stride(1);
  p.k_new_row_stride = k.stride(2);
  p.v_new_batch_stride = v.stride(0);
  p.v_new_head_stride = v.stride(1);
  p.v_new_row_stride = v.stride(2);
}

// k_scale/v_scale: an 8-bit cache that the decode kernel reads as it is (the caller has
// checked that one applies: fp8_decode_kernel). q_basis: a low-rank key cache's (checked),
// q at full width: the 8-bit decode kernel projects q itself where decode_projects_query, else
// q U is computed here first.
std::tuple<at::Tensor, at::Tensor> kvcache_attn_cuda(
    const char* op, const at::Tensor& q_arg, at::Tensor& k_cache, at::Tensor& v_cache,
    const OptTensor& k, const OptTensor& v, const at::Tensor& cache_seqlens,
    const OptTensor& block_table, const KvCacheShape& shape, const FlashOptions& opt,
    VariantId variant, int64_t num_splits, const at::Tensor* tau, const at::Tensor* bias,
    const ScoreTensors* mods = nullptr, const at::Tensor* k_scale = nullptr,
    const at::Tensor* v_scale = nullptr, const at::Tensor* q_basis = nullptr) {
  const c10::cuda::CUDAGuard guard(q_arg.device());
  const int d = static_cast<int>(q_basis != nullptr ? q_basis->size(3) : q_arg.size(-1));
  const int dv = static_cast<int>(v_cache.size(-1));
  const bool fp8 = k_scale != nullptr;
  const bool decode_kernel =
      fp8 || (use_tensor_cores(q_arg.scalar_type()) && decode_tc_supported(variant, d, dv) &&
              chunk_aligned(k_cache) && chunk_aligned(v_cache));
  const bool projects_query =
      q_basis != nullptr && fp8 &&
      decode_projects_query(d, dv, q_arg.size(1) / k_cache.size(1) * q_arg.size(2),
                            q_arg.size(3));
  // The kernel reads U [D, R] row by row; a strided basis (rank_plan's eigenvectors, a QR's Q)
  // costs one small copy instead of the projection GEMM and its casts.
  const at::Tensor kernel_basis = projects_query ? q_basis->contiguous() : at::Tensor();
  const at::Tensor q_in = q_basis != nullptr && !projects_query
                              ? project_query(q_arg, *q_basis, k_cache.size(1))
                              : q_arg;
  const int64_t appended = k.has_value() ? q_in.size(2) : 0;
  check_kvcache_values(op, cache_seqlens, block_table, shape, appended);
  const bool append = k.has_value() && k->numel() > 0 && shape.capacity > 0;
  // The kernels other than the decode kernel read the cache after the rows are in.
  auto append_first = [&] {
    if (!append) return;
    // The cache operands as the decode kernel reads them: cache_row() for paged caches.
    AttnParams a = make_kvcache_params(q_in, k_cache, v_cache, cache_seqlens, appended, opt);
    a.head_dim = static_cast<int>(k_cache.size(-1));  // the key rows' width (q's may be wider)
    set_cache_layout(a, block_table, shape);
    set_new_rows(a, *k, *v);
    kvcache_append_cuda(a, q_in.scalar_type());
  };

  const auto lse_options = q_in.options().dtype(at::kFloat);
  at::Tensor out = at::empty(out_shape(q_in, v_cache), q_in.options());
  at::Tensor lse = at::empty(lse_shape(q_in, false), lse_options);
  if (q_in.numel() == 0 || shape.capacity == 0) {
    append_first();
    out.zero_();
    fill_keyless_lse(lse, mods);
    return {out, lse};
  }

  if (decode_kernel) {
    const at::Tensor q = tc_aligned(q_in);
    AttnParams p = make_kvcache_params(q, k_cache, v_cache, cache_seqlens, appended, opt);
    set_cache_layout(p, block_table, shape);
    if (projects_query) {
      p.head_dim = d;
      p.q_basis = kernel_basis.data_ptr();
      p.q_basis_f32 = kernel_basis.scalar_type() == at::kFloat;
      p.q_full_dim = static_cast<int>(q.size(3));
    }
    if (fp8) {
      p.k_cache_scale = k_scale->data_ptr<float>();
      p.v_cache_scale = v_scale->data_ptr<float>();
    }
    if (append) set_new_rows(p, *k, *v);
    set_lazy_params(p, tau, bias);
    if (mods != nullptr) mods->set(p);
    set_fwd_outputs(p, out, lse);
    const int splits = decode_num_splits(variant, p, q.scalar_type(), num_splits);
    // The splits' partial outputs [splits, B, Hq, Lq, Dv] and their lse [splits, B, Hq, Lq] in one
    // allocation (each costs host time on every decode step).
    at::Tensor parts;
    float* o_part = nullptr;
    float* lse_part = nullptr;
    if (splits > 1) {
      const int64_t partials = splits * q.size(0) * q.size(1) * q.size(2);
      parts = at::empty({partials * (v_cache.size(-1) + 1)}, lse_options);
      o_part = parts.data_ptr<float>();
      lse_part = o_part + partials * v_cache.size(-1);
    }
    const int64_t scores_stride = decode_score_cache_stride(variant, p, q.scalar_type());
    at::Tensor scores;
    if (scores_stride > 0) {
      scores = at::empty({q.size(0), k_cache.size(1), q.size(1) / k_cache.size(1) * q.size(2),
                          scores_stride},
                         lse_options);
    }
    attention_decode_tc_cuda(variant, p, splits, o_part, lse_part,
                             scores_stride > 0 ? scores.data_ptr<float>() : nullptr,
                             scores_stride, q.scalar_type());
    return {out, lse};
  }
  append_first();

  // The prefill kernels on a [B, Hkv, L, D] cache (head dims padded where fp16/bf16 need it).
  const TcLayout layout = tc_layout(op, q_in, v_cache, variant);
  const at::Tensor kc = shape.paged ? gather_pages(k_cache, *block_table) : k_cache;
  const at::Tensor vc = shape.paged ? gather_pages(v_cache, *block_table) : v_cache;
  const at::Tensor q = layout.qk(q_in), kq = layout.qk(kc), vq = layout.vo(vc);
  at::Tensor kernel_out = at::empty(out_shape(q, vq), q.options());
  // opt's default scale is already the caller's D^-1/2, not the padded D's.
  AttnParams p = make_kvcache_params(q, kq, vq, cache_seqlens, appended, opt);
  set_lazy_params(p, tau, bias);
  if (mods != nullptr) mods->set(p);
  set_fwd_outputs(p, kernel_out, lse);
  if (layout.tc) {
    attention_fwd_tc_cuda(variant, p, q.scalar_type());
  } else {
    attention_fwd_exact_cuda(variant, p, q.scalar_type());
  }
  return {layout.crop(kernel_out, layout.head_dim_v), lse};
}

// Whether the decode kernel reads this 8-bit cache as it is: plain softmax at its head dims,
// 16-bit q, at most kDecodeFp8MaxRows rows per kv head, pages of whole tiles, aligned rows.
bool fp8_decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const KvCacheShape& shape, VariantId variant) {
  const int64_t page = shape.page_size;
  return use_tensor_cores(q.scalar_type()) &&
         q.size(1) / k_cache.size(1) * q.size(2) <= kDecodeFp8MaxRows &&
         decode_tc_supported(variant, static_cast<int>(q.size(-1)),
                             static_cast<int>(v_cache.size(-1)), true) &&
         page >= kDecodeFp8MinPage && (page & (page - 1)) == 0 && chunk_aligned(k_cache) &&
         chunk_aligned(v_cache);
}

std::tuple<at::Tensor, at::Tensor> flash_kvcache_cuda_op(
    const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache, const OptTensor& k,
    const OptTensor& v, const at::Tensor& cache_seqlens, const OptTensor& block_table,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    double softcap, int64_t num_splits, const OptTensor& k_scale, const OptTensor& v_scale,
    const OptTensor& alibi_slopes, const OptTensor& sinks, const OptTensor& rel_bias,
    const OptTensor& q_basis) {
  constexpr const char* op = "flash_attn_with_kvcache";
  if (q_basis.has_value()) check_query_basis(op, q, k_cache, *q_basis);
  // The attended rows' shape (a low-rank key cache's q U: R wide) for the checks; the default
  // scale is the full head dim's.
  const at::Tensor q_rows = q_basis.has_value() ? q.narrow(3, 0, q_basis->size(3)) : q;
  const at::Tensor* basis = q_basis.has_value() ? &*q_basis : nullptr;
  const bool fp8 = is_fp8_cache(k_cache, v_cache);
  const KvCacheShape shape = check_kvcache_inputs(op, q_rows, k_cache, v_cache, k, v,
                                                  cache_seqlens, block_table, num_splits, fp8);
  check_fp8_cache(op, q_rows, k_cache, k, block_table, k_scale, v_scale, fp8);
  const FlashOptions opt = resolve_flash_options(op, q, softmax_scale, causal, window_left,
                                                 window_right, BwdMode::kAtomic, softcap);
  const ScoreTensors mods(op, q, q.size(0), alibi_slopes, sinks, rel_bias);
  const VariantId variant = softmax_variant(opt, mods);
  if (fp8 && !fp8_decode_kernel(q_rows, k_cache, v_cache, shape, variant)) {
    // No kernel reads this 8-bit cache: the 16-bit paths on a dequantised copy of its pages
    // (the table's values are checked, where checked at all, before the copy's replaces it).
    const c10::cuda::CUDAGuard guard(q.device());
    check_kvcache_values(op, cache_seqlens, block_table, shape, 0);
    DequantizedPages d = dequantize_pages(k_cache, v_cache, *k_scale, *v_scale, *block_table,
                                          shape, q.scalar_type());
    return kvcache_attn_cuda(op, q, d.k_cache, d.v_cache, k, v, cache_seqlens, d.block_table,
                             d.shape, opt, variant, num_splits, nullptr, nullptr, &mods, nullptr,
                             nullptr, basis);
  }
  return kvcache_attn_cuda(op, q, k_cache, v_cache, k, v, cache_seqlens, block_table, shape, opt,
                           variant, num_splits, nullptr, nullptr, &mods,
                           fp8 ? &*k_scale : nullptr, fp8 ? &*v_scale : nullptr, basis);
}

std::tuple<at::Tensor, at::Tensor> lazy_kvcache_cuda_op(
    const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache, const OptTensor& k,
    const OptTensor& v, const at::Tensor& tau, const at::Tensor& bias,
    const at::Tensor& cache_seqlens, const OptTensor& block_table,
    std::optional<double> softmax_scale, int64_t num_splits) {
  constexpr const char* op = "lazy_attn_with_kvcache";
  const KvCacheShape shape =
      check_kvcache_inputs(op, q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits);
  check_lazy_kvcache_args(op, q, v_cache, tau, bias);
  return kvcache_attn_cuda(op, q, k_cache, v_cache, k, v, cache_seqlens, block_table, shape,
                           lazy_options(op, q, softmax_scale), VariantId::kLazy, num_splits, &tau,
                           &bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(adaattn, CUDA, m) {
  m.impl("flash_attn_with_kvcache", &flash_kvcache_cuda_op);
  m.impl("lazy_attn_with_kvcache", &lazy_kvcache_cuda_op);
}

}  // namespace adaattn
