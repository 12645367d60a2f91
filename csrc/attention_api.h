// Launchers of the attention core, one per device path, each over the compiled variants
// (variants/table.h). Each takes fully validated parameters whose outputs are allocated and
// writes every output element: forward out and lse (and p.stats when the variant counts and it
// is non-null); backward dq, dk, dv and, where asked, the variant's parameter gradients.
#pragma once

#include <c10/core/ScalarType.h>

#include <utility>

#include "core/params.h"
#include "variants/table.h"

namespace adaattn {

// CPU, fp32 or fp64 (the ops upcast fp16/bf16). Tiled, O(L) extra memory, parallel over
// batch x heads. With block lists set, only the listed blocks are visited (block sizes must be
// multiples of the 64-row CPU tile).
void attention_fwd_cpu(VariantId variant, const AttnParams& p, c10::ScalarType dtype);
void attention_bwd_cpu(VariantId variant, const AttnParams& p, c10::ScalarType dtype);

#ifdef ADAATTN_WITH_CUDA
// CUDA exact path, fp32 or fp64 scalar arithmetic (validation and gradcheck). Current stream.
void attention_fwd_exact_cuda(VariantId variant, const AttnParams& p, c10::ScalarType dtype);
void attention_bwd_exact_cuda(VariantId variant, const AttnParams& p, c10::ScalarType dtype);

// CUDA tensor-core path, fp16 or bf16 with fp32 accumulation. Current stream.
void attention_fwd_tc_cuda(VariantId variant, const AttnParams& p, c10::ScalarType dtype);
void attention_bwd_tc_cuda(VariantId variant, const AttnParams& p, c10::ScalarType dtype);
// The (D, Dv) pairs with a tensor-core kernel for `variant`, for error messages.
const char* tc_head_dims(VariantId variant);
// The compiled pair (D', Dv') >= (D, Dv) of `variant` with the least work per score
// (D' + Dv'): the pair itself where it is compiled, else the one other head dims run on
// zero-padded; {0, 0} when none covers them.
std::pair<int, int> tc_kernel_head_dims(VariantId variant, int head_dim, int head_dim_v);

// Decode against a KV cache (p.cache_seqlens set, p.block_table for a paged cache): the
// split-KV kernel for fp16/bf16, where decode_tc_supported. Key splits of each (sequence, kv
// head) write partial results to o_part [splits, B, Hq, Lq, Dv] and lse_part [splits, B, Hq, Lq]
// (float32, unused with one split), merged by a second kernel. Current stream, no host sync.
bool decode_tc_supported(VariantId variant, int head_dim, int head_dim_v);
// The split count: `requested` if > 0 (capped at the key tiles and 128), else chosen from the
// grid the shapes give and the SMs and occupancy of the current device.
int decode_num_splits(VariantId variant, const AttnParams& p, c10::ScalarType dtype,
                      int64_t requested);
// A non-normalised variant's lse pass may cache its scores for the weight pass (instead of
// reading K again) where they take fewer bytes: the row stride of that float32 scratch
// [B, Hkv, Hq / Hkv * Lq, stride], or 0 when it is not used.
int64_t decode_score_cache_stride(VariantId variant, const AttnParams& p, c10::ScalarType dtype);
void attention_decode_tc_cuda(VariantId variant, const AttnParams& p, int num_splits,
                              float* o_part, float* lse_part, float* scores,
                              int64_t scores_stride, c10::ScalarType dtype);

// Writes the new rows k [B, Hkv, Lq, D] and v [B, Hkv, Lq, Dv] into the cache of p (contiguous
// or paged) at positions cache_seqlens[b] + r; rows that fall outside the cache are dropped.
// Any dtype; strides in elements, last dims contiguous.
struct KvAppendParams {
  const void* k;
  const void* v;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
};
void kvcache_append_cuda(const AttnParams& p, const KvAppendParams& a, c10::ScalarType dtype);
#endif

}  // namespace adaattn
