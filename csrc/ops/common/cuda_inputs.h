// Input preparation shared by the CUDA op registrations: which path a dtype takes, alignment and
// head-dim padding of tensor-core operands, and the head-dim check.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <utility>

#include "../../attention_api.h"
#include "attention_inputs.h"

namespace adaattn {

inline bool use_tensor_cores(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// cp.async moves 16-byte chunks: base pointers and every stride but the last dim's must be
// multiples of 8 elements. Other layouts are copied once (rare: odd strides or a misaligned
// storage offset).
inline at::Tensor tc_aligned(const at::Tensor& t) {
  auto ok = [](const at::Tensor& x) {
    if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) return false;
    for (int64_t d = 0; d + 1 < x.dim(); ++d) {
      if (x.stride(d) % 8 != 0) return false;
    }
    return true;
  };
  if (ok(t)) return t;
  at::Tensor c = t.contiguous();
  return ok(c) ? c : c.clone();
}

// How one call's operands reach the kernels. fp16/bf16 go to the tensor cores: q, k (width D)
// and v, out, dout (width Dv) aligned for cp.async. Where (D, Dv) has no kernel of its own, the
// kernels of the compiled pair that covers it (tc_kernel_head_dims) run: on the operands as they
// are where tc_masks_head_dims (multiples of 8 under a pair of at most 128 columns: the loads
// zero-fill the columns past the caller's, the stores skip them), else zero-padded to that pair,
// whose zero columns add nothing to q.k or to P V, and crop() drops the padding of outputs and
// gradients. fp32/fp64 operands pass through unchanged.
struct TcLayout {
  bool tc;
  int64_t head_dim, head_dim_v;      // the caller's D, Dv
  int64_t kernel_dim, kernel_dim_v;  // the operands' widths as the kernels get them (>= D, Dv)

  at::Tensor qk(const at::Tensor& t) const { return operand(t, kernel_dim); }
  at::Tensor vo(const at::Tensor& t) const { return operand(t, kernel_dim_v); }
  // An output of kernel width back to the caller's, in t's layout (empty_following).
  at::Tensor crop(const at::Tensor& t, int64_t width) const {
    if (t.size(-1) == width) return t;
    return empty_following(t, width, t.options()).copy_(t.narrow(-1, 0, width));
  }
  // The default scale D^-1/2 is the caller's D, not the padded one.
  std::optional<double> scale(std::optional<double> softmax_scale) const {
    if (softmax_scale.has_value() || kernel_dim == head_dim) return softmax_scale;
    return softmax_scale_or_default(softmax_scale, head_dim);
  }

 private:
  at::Tensor operand(const at::Tensor& t, int64_t width) const {
    if (!tc) return t;
    const int64_t pad = width - t.size(-1);
    const at::Tensor padded = pad == 0 ? t : at::constant_pad_nd(t, {0, pad}, 0);
    return padded.numel() > 0 ? tc_aligned(padded) : padded;
  }
};

// Refuses fp16/bf16 head dims that no compiled pair of `variant` covers (naming the op and the
// supported set: a RuntimeError, a limit of this device's kernels), then chooses the layout.
inline TcLayout tc_layout(const char* op, const at::Tensor& q, const at::Tensor& v,
                          VariantId variant) {
  const int64_t d = q.size(-1), dv = v.size(-1);
  if (!use_tensor_cores(q.scalar_type())) return {false, d, dv, d, dv};
  const std::pair<int, int> kernel =
      d > 0 && dv > 0 ? tc_kernel_head_dims(variant, static_cast<int>(d), static_cast<int>(dv))
                      : std::pair<int, int>{0, 0};
  TORCH_CHECK(kernel.first > 0, "adaattn.", op, ": head dims D = q.size(-1) = ", d,
              ", Dv = v.size(-1) = ", dv, " are not supported for ", q.scalar_type(),
              " on CUDA; supported (D, Dv): ", tc_head_dims(variant),
              " (float32/float64 accept any D, Dv <= 256)");
  if (tc_masks_head_dims(variant, static_cast<int>(d), static_cast<int>(dv))) {
    return {true, d, dv, d, dv};
  }
  return {true, d, dv, kernel.first, kernel.second};
}

}  // namespace adaattn
