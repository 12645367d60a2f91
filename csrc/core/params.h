// Kernel parameters of every attention kernel (CPU and CUDA), in layers: the operands and sizes
// every pass reads, the mask, the forward outputs, the backward tensors, and the arguments of
// the variant (variants/). Plain data only: AttnParams is passed by value to CUDA kernels, and
// its fields are reached by their plain names (p.q, p.lse, p.dq, p.softcap, ...).
#pragma once

#include <cstdint>

namespace adaattn {

// Strides are in elements; the last dim of every tensor is contiguous (stride 1).
struct QkvParams {
  const void* q;  // [B, Hq, Lq, D]
  const void* k;  // [B, Hkv, Lk, D]
  const void* v;  // [B, Hkv, Lk, Dv]
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;

  int batch;       // B
  int heads_q;     // Hq
  int heads_kv;    // Hkv; Hq % Hkv == 0, query head h reads kv head h / (Hq / Hkv)
  int len_q;       // Lq
  int len_k;       // Lk
  int head_dim;    // D, of q and k
  int head_dim_v;  // Dv, of v and out

  // Packed layout (see seq.h); null for the dense layout. q/out/dout/dq are [Tq, Hq, D] and
  // k/v/dk/dv [Tk, Hkv, D] (batch strides 0); batch is the number of sequences N, len_q/len_k
  // are Tq/Tk, and lse/delta/row_g are [Hq, Tq].
  const int* cu_seqlens_q;  // [N + 1] int32: sequence b owns rows [cu[b], cu[b + 1]) of q
  const int* cu_seqlens_k;  // [N + 1] int32, for k/v

  double scale;      // multiplies q.k (double so the fp64 exact path is not rounded to fp32)
  float scale_log2;  // scale * log2(e), for exp2-based softmax
};

// The mask policy's inputs (mask.h, block_sparse.h): element (i, j) is attended iff j is inside
// key_range(p, lens, i) and, with block lists, block (i / block_m, j / block_n) is listed.
struct MaskParams {
  const int* seqlens;  // [B] int32 or null: rows/keys at or past seqlens[b] are padding
  int window_left;     // -1 = unbounded; keys j >= diag - window_left
  int window_right;    // -1 = unbounded; keys j <= diag + window_right (causal => 0)

  // Block lists (BCSR rows), or null: the first `num` entries of an index row are the listed
  // blocks; the helpers of block_sparse.h clamp counts to the row length and skip out-of-range
  // indices. Batch/head strides are in elements and 0 for a mask dim of size 1 (broadcast over
  // B or Hq); the last dim(s) are contiguous.
  const int* block_kv_num;  // [Bm, Hm, nQ] int32: key blocks listed for query block mb
  const int* block_kv_idx;  // [Bm, Hm, nQ, nKV] int32: their indices (forward, backward dq)
  const int* block_q_num;   // [Bm, Hm, nKV] int32: query blocks listing key block nb
  const int* block_q_idx;   // [Bm, Hm, nKV, nQ] int32: their indices (backward dk/dv)
  int64_t block_kv_num_batch_stride, block_kv_num_head_stride;
  int64_t block_kv_idx_batch_stride, block_kv_idx_head_stride;
  int64_t block_q_num_batch_stride, block_q_num_head_stride;
  int64_t block_q_idx_batch_stride, block_q_idx_head_stride;
  int block_m;    // BM, query rows per block (64 or 128)
  int block_n;    // BN, keys per block (64 or 128)
  int block_nq;   // nQ = ceil(Lq / BM): query blocks; max of block_q_num, length of a q_idx row
  int block_nkv;  // nKV = ceil(Lk / BN): key blocks; max of block_kv_num, length of a kv_idx row

  // CTA order of the tensor-core kernels (seq.h tile_item): the tiles of this many units
  // ((head, batch) pairs; heads with packed sequences) interleave, heaviest first; 0 or 1:
  // head-major. Set per launch (launch.h in_cta_order), at most the launch's unit count.
  int interleave_pairs;

  // Explicit positions (dense calls without seqlens: a block of a sequence sharded over ranks):
  // query row r sits at position q_position0 + r and key j at k_position0 + j of the sequence.
  // Otherwise rows are bottom-right aligned (seq.h).
  bool explicit_positions;
  int q_position0, k_position0;
};

// What a forward of a transform with an lse pass (not kNormalized) computes. kGiven and kOnly
// split it over the key blocks of a sharded sequence: the lse of each block first (kOnly, merged
// by the caller), then each block's share of the output against the merged lse (kGiven); a
// non-normalised transform's output is the plain sum of those shares.
enum class LsePass : uint8_t {
  kCompute,  // the lse pass, then the weights: out and lse
  kOnly,     // the lse pass alone: lse (out is not written)
  kGiven,    // the weights against p.lse, which the call reads: out (lse is not written)
};

struct FwdParams {
  void* out;   // [B, Hq, Lq, Dv]
  float* lse;  // [B, Hq, Lq] (packed: [Hq, Tq]) contiguous, natural log; -inf: row sees no key
  int64_t o_batch_stride, o_head_stride, o_row_stride;
  LsePass lse_pass;
};

// How the tensor-core backward forms dQ (launch.h decides per GPU, head dims and variant).
// kAtomic: the dK/dV CTAs add their dS K into a float32 accumulator with atomics, in an order
// that varies between runs, where the kernel configuration has that form; kTwoPass: dQ in a
// pass of its own, no order-dependent accumulation, for the variants that have one. The CPU and
// the exact CUDA kernels are deterministic in either mode.
enum class BwdMode : uint8_t { kAtomic, kTwoPass };

struct BwdParams {
  const void* dout;  // [B, Hq, Lq, Dv]
  int64_t do_batch_stride, do_head_stride, do_row_stride;
  void* dq;  // [B, Hq, Lq, D]
  void* dk;  // [B, Hkv, Lk, D]
  void* dv;  // [B, Hkv, Lk, Dv]
  int64_t dq_batch_stride, dq_head_stride, dq_row_stride;
  int64_t dk_batch_stride, dk_head_stride, dk_row_stride;
  int64_t dv_batch_stride, dv_head_stride, dv_row_stride;
  float* delta;  // lse-shaped scratch: the backward row term Delta_i (variant.h)
  // Tensor-core backward: float32 dQ accumulator, [rows in lse order, D] (dense [B, Hq, Lq, D],
  // packed [Hq, Tq, D]), zeroed by the launcher. The dK/dV CTAs add their dS K into it with
  // atomics and a last pass writes dq = scale * dq_accum. Null: the two-pass backward.
  float* dq_accum;
  BwdMode bwd_mode;
  // A non-normalised transform's backward row pass (Delta_i and G_i, sums over the row's keys),
  // split like LsePass over the key blocks of a sharded sequence: kOnly writes this block's
  // shares of p.delta and p.row_g (nothing else), kGiven reads the caller's sums of them and
  // computes dq, dk, dv and the modifier's table gradient (not the transform's, which is a
  // plain sum of row_g).
  LsePass row_pass;
};

// Arguments of the variants (variants/*.h); each variant reads only its own. A variant with
// learnable parameters gets their gradients' outputs and scratch here too.
struct VariantParams {
  // Softcap score modifier (variants/softcap.h): s <- softcap * tanh(s / softcap); 0 = off.
  // Double so that the fp64 exact path is not rounded to fp32.
  double softcap;

  // Relative-bias score modifier (variants/rel_bias.h): s += bias[h, i - j], 0 <= i - j < W.
  const float* bias;     // [Hq, bias_window] float32, contiguous
  int bias_window;       // W >= 1
  float* dbias;          // [Hq, W] float32 output, or null: no bias gradient
  // Tensor-core backward scratch for a deterministic dbias: per-CTA partial sums, zeroed by the
  // launcher (layout [Hq, key tile slots (seq.h tile_slots), min(W, Lk)]).
  float* dbias_partial;

  // ALiBi in the composed modifier (variants/composed.h): s -= slope[b, h] * |i - j|.
  const float* alibi_slopes;     // [B, Hq] or [Hq] float32, contiguous, or null: off
  int64_t alibi_batch_stride;    // Hq for [B, Hq], 0 for [Hq]

  // Attention sinks (variants/sinks.h): a per-head logit in each row's softmax denominator.
  const float* sinks;  // [Hq] float32, or null: off
  float* dsinks;       // [Hq] float32 output, or null: no sink gradient

  // Elastic transform (variants/elastic.h): a = max(0, p + tau_h / (i + 1)).
  const float* tau;  // [Hq] float32
  float* row_g;      // lse-shaped scratch: G_i / (i + 1), G_i = sum_j M_ij dA_ij (dtau's terms)
  float* dtau;       // [Hq] float32 output, or null: no tau gradient
  // Forward statistics, or null: int64 counters {zero weights, attended weights, skipped key
  // tiles, visited key tiles} of the weight pass (a tile is skipped when all its a_ij are 0).
  int64_t* stats;
};

// Attention against a KV cache (decode): q's Lq rows are the newest tokens of each sequence.
// Entry b attends keys [0, cache_seqlens[b] + cache_appended) of k/v (len_k = the cache
// capacity Lmax), and query row r sits at position cache_seqlens[b] + cache_appended - Lq + r
// (bottom-right aligned, seq.h). Null cache_seqlens: not a decode call.
struct KvCacheParams {
  const int* cache_seqlens;  // [B] int32: tokens in the cache before this call's appends
  int cache_appended;        // tokens this call appended (Lq, or 0 when it appended none)
  // The rows this call appends, k_new [B, Hkv, Lq, D] and v_new [B, Hkv, Lq, Dv] in the cache's
  // dtype (strides in elements), written at positions cache_seqlens[b] + r (rows past the cache
  // are dropped) by the decode kernel itself, or by append_kernel ahead of the prefill
  // kernels. Null: the cache already holds them (or there are none).
  const void* k_new;
  const void* v_new;
  int64_t k_new_batch_stride, k_new_head_stride, k_new_row_stride;
  int64_t v_new_batch_stride, v_new_head_stride, v_new_row_stride;
  // Paged cache (read by the decode kernel only; the other kernels get a gathered copy): k/v are
  // [num_pages, Hkv, page_size, D] (k/v batch strides are page strides) and key j of entry b
  // lives in page block_table[b * block_table_stride + j / page_size], slot j % page_size.
  // Null: k/v are [B, Hkv, Lmax, D].
  const int* block_table;
  int64_t block_table_stride;
  int page_size;
  int page_shift;  // log2(page_size) for a power of two, else -1
  int num_pages;
  // An 8-bit paged cache (e4m3 k/v, decode kernel only; the other kernels get a dequantised
  // copy): key j of page `block` and kv head h is k[...] * k_cache_scale[block * Hkv + h], the
  // same for v. Null: k/v hold q's dtype.
  const float* k_cache_scale;  // [num_pages, Hkv] float32
  const float* v_cache_scale;  // [num_pages, Hkv] float32
  // A low-rank key cache (keys k U of width D < Dv) whose decode kernel projects the query
  // itself: q is [B, Hq, Lq, q_full_dim] at full width and the rows attended are q U rounded to
  // q's dtype, U = q_basis [B, Hkv, q_full_dim, D] (contiguous; float32 where q_basis_f32, else
  // q's dtype). Null: q is at width D.
  const void* q_basis;
  bool q_basis_f32;
  int q_full_dim;
};

// The 8-bit forward (precision="fp8", cuda/tc/fwd_q8_sm90.h): q and k are int8, v is e4m3 V^T
// (rows are channels), each with float32 scales from the pre-pass (cuda/attention_q8.cu).
struct QuantParams {
  const float* q_scale;  // [B, Hq, q_scale_blocks]: one per 64 query rows
  const float* k_scale;  // [B, Hkv, k_scale_blocks]: one per 128 keys
  const float* v_scale;  // [B, Hkv, Dv]: one per channel
  int q_scale_blocks;
  int k_scale_blocks;
  // [B, Hq] uint8, or null: 1 where the 8-bit kernel computes the head, 0 where the 16-bit
  // forward does (both are launched over every head and skip the others' heads).
  const uint8_t* head_q8;
};
struct AttnParams : QkvParams, MaskParams, FwdParams, BwdParams, VariantParams, KvCacheParams,
                    QuantParams {};

}  // namespace adaattn
