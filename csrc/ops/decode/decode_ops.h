// Device-independent halves of the KV-cache (decode) ops: validation of the cache, its
// sequence lengths and block table, and AttnParams construction. The CPU registration is
// decode.cpp, the CUDA one decode_cuda.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "../../core/params.h"
#include "../common/attention_inputs.h"

namespace adaattn {

// The cache as the op was given it.
struct KvCacheShape {
  bool paged;
  int64_t capacity;   // Lmax: positions a sequence may hold (paged: max_pages * page_size)
  int64_t page_size;  // paged only
  int64_t num_pages;  // paged only
};

// Validates q [B, Hq, Lq, D], the caches ([B, Hkv, Lmax, D|Dv], or paged [num_pages, Hkv,
// page_size, D|Dv] with block_table int32 [B, max_pages]), cache_seqlens int32 [B], and the
// optional new k [B, Hkv, Lq, D] / v [B, Hkv, Lq, Dv] (both or neither), and num_splits >= 0.
// Dtypes, devices, shapes and contiguous last dims; errors name `op` and the argument
// (common/checks.h). Values are not read here. fp8_cache: the caches must be float8_e4m3fn
// (is_fp8_cache; check_fp8_cache checks the rest), else q's dtype.
KvCacheShape check_kvcache_inputs(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const std::optional<at::Tensor>& k,
                                  const std::optional<at::Tensor>& v,
                                  const at::Tensor& cache_seqlens,
                                  const std::optional<at::Tensor>& block_table,
                                  int64_t num_splits, bool fp8_cache = false);

// Whether either cache operand is 8-bit (float8_e4m3fn): an 8-bit cache, which the flash op
// alone takes.
bool is_fp8_cache(const at::Tensor& k_cache, const at::Tensor& v_cache);

// An 8-bit cache (fp8_cache): paged, with k_scale and v_scale float32 [num_pages, Hkv]
// (contiguous, on q's device: cached value * its page's and kv head's scale) and no new k/v to
// append (adaattn.KVCache.append quantises them). Without one, scales are an error.
void check_fp8_cache(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                     const std::optional<at::Tensor>& k,
                     const std::optional<at::Tensor>& block_table,
                     const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale, bool fp8_cache);

// The pages of an 8-bit cache [num_pages, Hkv, page_size, D|Dv] that block_table [B, max_pages]
// names (entries clamped into the pool), times their scales [num_pages, Hkv] and rounded to
// dtype, as a pool of B * max_pages pages that `block_table` (arange, int32) and `shape` describe:
// what the 16-bit paths attend for a call no 8-bit kernel takes (the CPU op, other CUDA
// kernels). Only the call's pages are converted, however large the pool.
struct DequantizedPages {
  at::Tensor k_cache, v_cache, block_table;
  KvCacheShape shape;
};
DequantizedPages dequantize_pages(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& k_scale, const at::Tensor& v_scale,
                                  const at::Tensor& block_table, const KvCacheShape& shape,
                                  c10::ScalarType dtype);

// Values of cache_seqlens (>= 0, room for the `appended` new tokens) and of the block-table
// entries that the sequences use (in [0, num_pages)). Reads them, so on CUDA it runs only with
// ADAATTN_CHECK_INPUTS=1 (a device sync, check_values_of); the kernels clamp either way.
void check_kvcache_values(const char* op, const at::Tensor& cache_seqlens,
                          const std::optional<at::Tensor>& block_table, const KvCacheShape& shape,
                          int64_t appended);

// Params for attending q against caches laid out as [B, Hkv, L, D] (contiguous, or a gathered
// copy of a paged cache): the decode fields set, outputs unset.
AttnParams make_kvcache_params(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                               int64_t appended, const FlashOptions& opt);

// The lazy op's own arguments: Dv == D and tau/bias (check_lazy_params).
void check_lazy_kvcache_args(const char* op, const at::Tensor& q, const at::Tensor& v_cache,
                             const at::Tensor& tau, const at::Tensor& bias);

// A low-rank key cache's basis (the KV-cache op's q_basis): U [B, Hkv, D, R] of q's [B, Hq,
// Lq, D], float32 or q's dtype, on q's device, 1 <= R <= D, R = k_cache.size(-1) (the cache holds
// the projected keys k U). Checks q's and k_cache's dims first.
void check_query_basis(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& basis);

// q U [B, Hq, Lq, R] in q's dtype, the product in the wider of q's and the basis's dtypes: query
// head h takes the basis of kv head h / (Hq / heads_kv), one batched product per (sequence,
// kv head). The attended rows of a full-width q against a low-rank key cache.
at::Tensor project_query(const at::Tensor& q, const at::Tensor& basis, int64_t heads_kv);

// The lazy variant's tau/bias in p (null tau: a softmax variant, nothing to set).
void set_lazy_params(AttnParams& p, const at::Tensor* tau, const at::Tensor* bias);

// The lse [B, Hq, Lq] of rows that see no key: -inf, or the head's sink where mods has sinks.
void fill_keyless_lse(at::Tensor& lse, const ScoreTensors* mods);

// A paged cache [num_pages, Hkv, page_size, D] gathered into [B, Hkv, max_pages * page_size, D]
// through block_table (entries clamped into range: positions past a sequence's length are never
// attended, so what their pages hold does not matter).
at::Tensor gather_pages(const at::Tensor& cache, const at::Tensor& block_table);

}  // namespace adaattn
