// Launchers of the attention core, one per device path, each over the compiled variants
// (variants/table.h). Each takes fully validated parameters whose outputs are allocated and
// writes every output element: forward out and lse (and p.stats when the variant counts and it
// is non-null); backward dq, dk, dv and, where asked, the variant's parameter gradients.
#pragma once

#include <c10/core/ScalarType.h>

#include <utility>

#ifdef ADAATTN_WITH_CUDA
#include <ATen/core/Tensor.h>
#endif

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
// (D' + Dv'): the pair itself where it is compiled, else the one whose kernels other head dims
// run on (tc_masks_head_dims; TcLayout); {0, 0} when none covers them.
std::pair<int, int> tc_kernel_head_dims(VariantId variant, int head_dim, int head_dim_v);
// Whether (D, Dv) without a kernel of its own runs on that pair's kernels as it is (multiples
// of 8 under a pair of at most 128 columns: the kernels mask the columns past the caller's);
// other dims are zero-padded to it.
bool tc_masks_head_dims(VariantId variant, int head_dim, int head_dim_v);

// Decode against a KV cache (p.cache_seqlens set, p.block_table for a paged cache): the
// split-KV kernel for fp16/bf16, where decode_tc_supported. Key splits of each (sequence, kv
// head) write partial results to o_part [splits, B, Hq, Lq, Dv] and lse_part [splits, B, Hq, Lq]
// (float32, unused with one split), merged by a second kernel. Current stream, no host sync.
// fp8_cache: an e4m3 paged cache (p.k_cache_scale set), which has kernels for plain softmax at
// the same head dims (D = Dv in {64, 128}; low-rank keys D in {32, 64} with Dv = 128) with
// pages of a power of two >= kDecodeFp8MinPage keys and at most kDecodeFp8MaxRows query rows
// per kv head (group * Lq: one row warp per CTA).
constexpr int kDecodeFp8MinPage = 64;
constexpr int kDecodeFp8MaxRows = 16;
bool decode_tc_supported(VariantId variant, int head_dim, int head_dim_v, bool fp8_cache = false);
// Whether the 8-bit decode kernel projects a full-width q [.., full_dim] itself
// (AttnParams::q_basis) for keys of width head_dim < head_dim_v (a low-rank key cache): `rows`
// (Hq / Hkv * Lq) query rows per kv head in one row warp, and full_dim a multiple of 8 per slice
// of its threads. The 16-bit kernel takes q U from a GEMM ahead: projecting in each of its split
// CTAs was slower in CUDA graphs (docs/lab/decode.md).
bool decode_projects_query(int head_dim, int head_dim_v, int64_t rows, int64_t full_dim);
// The split count: `requested` if > 0 (capped at the key tiles and 128), else chosen from the
// grid the shapes give and the SMs and occupancy of the current device.
int decode_num_splits(VariantId variant, const AttnParams& p, c10::ScalarType dtype,
                      int64_t requested);
// A non-normalised variant's lse pass may cache its scores for the weight pass (instead of
// reading K again) where they take fewer bytes: the row stride of that float32 scratch
// [B, Hkv, Hq / Hkv * Lq, stride], or 0 when it is not used.
int64_t decode_score_cache_stride(VariantId variant, const AttnParams& p, c10::ScalarType dtype);
// p.k_new / p.v_new (or null): rows the kernel writes into the cache before it attends them.
void attention_decode_tc_cuda(VariantId variant, const AttnParams& p, int num_splits,
                              float* o_part, float* lse_part, float* scores,
                              int64_t scores_stride, c10::ScalarType dtype);

// Writes p's new rows (k_new, v_new) into its cache, for the kernels other than the decode
// kernel (which writes them itself).
void kvcache_append_cuda(const AttnParams& p, c10::ScalarType dtype);

// precision="fp8" (cuda/attention_q8.cu, tc/fwd_q8_sm90.h). The pre-pass's operands of the
// 8-bit forward from fp16/bf16 q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] (last
// dims contiguous, 16-byte aligned rows), (D, Dv) in {(64, 64), (128, 128)}.
struct Q8Operands {
  at::Tensor q;        // int8 [B, Hq, Lq, D]: Q rotated, per 64-row block scaled
  at::Tensor k;        // int8 [B, Hkv, Lk, D]: K smoothed, rotated, per 128-key block scaled
  at::Tensor vt;       // float8_e4m3fn [B, Hkv, Dv, 128 * ceil(Lk / 128)]: V^T, keys permuted
  at::Tensor q_scale;  // float32 [B, Hq, ceil(Lq / 64)]
  at::Tensor k_scale;  // float32 [B, Hkv, ceil(Lk / 128)]
  at::Tensor v_scale;  // float32 [B, Hkv, Dv]
  // With `stats`: per block (tile) and channel, the sums of the rotated (smoothed) values'
  // squares and of their squared rounding errors: float32 [B, Hq, ceil(Lq / 64), 2, D],
  // [B, Hkv, ceil(Lk / 128), 2, D], [B, Hkv, ceil(Lk / 128), 2, Dv] (precision="auto").
  at::Tensor q_stats, k_stats, v_stats;
};
Q8Operands quantize_q8_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            bool stats);
// bool [B, Hq]: the heads the 8-bit forward runs (one small kernel, no host work per head):
// finite scales of q's head and its kv head's k and v, and with fp8_tol (ops from a pre-pass
// with stats) an estimated error within it, adaattn.precision.estimate_precision_error's
// model on the pre-pass's statistics; scale: the softmax scale.
at::Tensor choose_q8_heads_cuda(const Q8Operands& ops, std::optional<double> fp8_tol,
                                int64_t len_q, int64_t len_k, double scale);
// The 8-bit forward: p's q, k, v and scales point at a Q8Operands (strides in bytes), out is
// out_dtype (fp16/bf16). Needs an sm_90 device (q8_forward_available).
void attention_fwd_q8_cuda(const AttnParams& p, c10::ScalarType out_dtype);
bool q8_forward_available();
#endif

}  // namespace adaattn
