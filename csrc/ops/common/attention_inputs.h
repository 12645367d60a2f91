// Device-independent halves of the attention-core ops (flash, lazy, block-sparse, low-rank):
// argument validation, output shapes and AttnParams construction. The CPU and CUDA registrations
// wrap these with their launchers.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "../../core/params.h"
#include "../../variants/table.h"

namespace adaattn {

// softmax_scale, or the default D^-1/2 of the query/key head dim D (the caller's D, not a
// padded one).
inline double softmax_scale_or_default(std::optional<double> softmax_scale, int64_t head_dim) {
  return softmax_scale.has_value() ? *softmax_scale
                                   : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

// Everything the mask and the math need, resolved from the op's arguments.
struct FlashOptions {
  double scale;
  int window_left;
  int window_right;
  BwdMode bwd_mode;  // the backward's dQ form (params.h); flash_attn: deterministic -> kTwoPass
  double softcap;  // score modifier s <- softcap * tanh(s / softcap); 0 = off
};

// Validates window, scale (default D^-1/2 of q's D) and softcap (finite, >= 0). Every check
// here raises as common/checks.h says, naming `op` (the public name of the op called) and the
// argument.
FlashOptions resolve_flash_options(const char* op, const at::Tensor& q,
                                   std::optional<double> softmax_scale, bool causal,
                                   int64_t window_left, int64_t window_right, BwdMode bwd_mode,
                                   double softcap);

// The composed variant's tensors (variants/composed.h, sinks.h): alibi_slopes [Hq] or [B, Hq],
// sinks [Hq], rel_bias [Hq, W], each float32 on q's device or absent; held contiguous here so
// that AttnParams may point into them. B is the batch (packed: the number of sequences).
struct ScoreTensors {
  at::Tensor alibi_slopes, sinks, rel_bias;  // undefined when absent

  // Validates them (naming each) against q; `batch` is B.
  ScoreTensors(const char* op, const at::Tensor& q, int64_t batch,
               const std::optional<at::Tensor>& alibi_slopes,
               const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& rel_bias);
  bool any() const { return alibi_slopes.defined() || sinks.defined() || rel_bias.defined(); }
  // Points p at them (and at their gradients' outputs when given: [Hq] and [Hq, W] float32).
  void set(AttnParams& p, at::Tensor* dsinks = nullptr, at::Tensor* drel_bias = nullptr) const;
  // The gradients' outputs of the backward ops: zeros shaped as the tensor when it is given
  // and `wanted`, else an empty [0] float32 tensor.
  at::Tensor grad_like(const at::Tensor& t, bool wanted, const at::Tensor& q) const;
};

// The batch entries a variant tensor's B counts: q's B, or the packed sequences.
inline int64_t batch_entries(const at::Tensor& q, const std::optional<at::Tensor>& cu_seqlens_q) {
  return cu_seqlens_q.has_value() ? cu_seqlens_q->size(0) - 1 : q.size(0);
}

// The public name of a flash call, for errors: packed calls are flash_attn_varlen's.
inline const char* flash_op_name(const std::optional<at::Tensor>& cu_seqlens_q,
                                 const std::optional<at::Tensor>& cu_seqlens_k) {
  return cu_seqlens_q.has_value() || cu_seqlens_k.has_value() ? "flash_attn_varlen"
                                                              : "flash_attn";
}

// flash_attn's deterministic flag: the two-pass backward, else atomic dQ where the kernels have it.
inline BwdMode flash_bwd_mode(bool deterministic) {
  return deterministic ? BwdMode::kTwoPass : BwdMode::kAtomic;
}

// The softmax-family variant (variants/table.h) that the options select.
inline VariantId softmax_variant(const FlashOptions& opt) { return softmax_variant(opt.softcap); }
inline VariantId softmax_variant(const FlashOptions& opt, const ScoreTensors& t) {
  return softmax_variant(opt.softcap, t.any());
}

// Validates q, k, v, seqlens and the packed layout's cu_seqlens (names the offending argument on
// failure). Dense q/k/v are [B, H, L, D]; with cu_seqlens_q/k they are packed [T, H, D].
// v may have its own head dim Dv (out then has it too).
// The values of seqlens (in [0, max(Lq, Lk)]) and cu_seqlens are checked on the CPU, and on
// CUDA only with ADAATTN_CHECK_INPUTS=1 (it costs a device sync); the kernels clamp them so a
// bad one never reads out of bounds. cu_name_q/k: the cu_seqlens arguments as the op calls
// them (lazy attention's one cu_seqlens is both).
void check_flash_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const std::optional<at::Tensor>& seqlens,
                        const std::optional<at::Tensor>& cu_seqlens_q,
                        const std::optional<at::Tensor>& cu_seqlens_k,
                        const char* cu_name_q = "cu_seqlens_q",
                        const char* cu_name_k = "cu_seqlens_k");

// Nothing for a kernel to do: no query rows, or a packed batch of zero sequences.
inline bool no_rows(const at::Tensor& q, const std::optional<at::Tensor>& cu_seqlens_q) {
  return q.numel() == 0 || (cu_seqlens_q.has_value() && cu_seqlens_q->size(0) == 1);
}

// Shape of out: q's with v's head dim ([B, Hq, Lq, Dv], packed [Tq, Hq, Dv]).
std::vector<int64_t> out_shape(const at::Tensor& q, const at::Tensor& v);

// A new tensor of `like`'s sizes but last dim `last`, in `like`'s order of dims 1 and 2: for a
// [B, H, L, D] view of [B, L, H, D] storage (x.transpose(1, 2), as flash-attn's and HF's
// tensors reach the ops) it is a view of new [B, L, H, last] storage, so the caller's transpose
// back and reshape cost no copy (as SDPA's outputs); contiguous for every other layout. The
// fake kernels (adaattn/_ops.py, _following) apply the same rule.
at::Tensor empty_following(const at::Tensor& like, int64_t last, const at::TensorOptions& options);

// Shape of lse: [B, Hq, Lq], packed [Hq, Tq].
std::vector<int64_t> lse_shape(const at::Tensor& q, bool packed);

// Validates dout/out/lse against q and v for the backward op.
void check_flash_bwd_inputs(const char* op, const at::Tensor& dout, const at::Tensor& q,
                            const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                            bool packed);

// Fills sizes, strides, pointers and mask/math fields shared by forward and backward.
AttnParams make_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& seqlens,
                       const std::optional<at::Tensor>& cu_seqlens_q,
                       const std::optional<at::Tensor>& cu_seqlens_k, const FlashOptions& opt);

void set_fwd_outputs(AttnParams& p, at::Tensor& out, at::Tensor& lse);
void set_bwd_tensors(AttnParams& p, const at::Tensor& dout, const at::Tensor& out,
                     const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                     at::Tensor& delta);

}  // namespace adaattn
