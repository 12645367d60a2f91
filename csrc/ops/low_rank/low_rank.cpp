// Low-rank attention: exact softmax attention on the scores of q and k projected onto
// a per-(batch, kv head) basis U [B, Hkv, D, R], with v at full width.
//
// The projection is one batched GEMM per operand (at::matmul), not fused into the attention
// kernel: every query tile would have to re-project every key tile it visits (as much work as
// the rank-R scores themselves), while the GEMM reads q and k once and is memory-bound and cheap.
// The attention is adaattn::flash_attn with head dims (D, Dv) = (R', Dv): its QK^T runs at R',
// R padded with zero columns to a compiled tensor-core width (32, 64, 128) on CUDA fp16/bf16.
// The op is CompositeImplicitAutograd, so autograd differentiates the GEMMs (dq = dq' U^T,
// dU = q^T dq' + k^T dk') and flash_attn's own backward.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../../attention_api.h"
#include "../common/attention_inputs.h"
#include "../common/checks.h"

namespace adaattn {
namespace {

constexpr const char* op = "low_rank_attn";

// Width R' >= rank of the projected scores for the kernel that will run.
int64_t projected_width(const at::Tensor& q, int64_t rank, int64_t dim_v) {
#ifdef ADAATTN_WITH_CUDA
  if (q.is_cuda() && (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16)) {
    // flash_attn runs Dv on its kernel's; the scores' width R' must be a kernel's own.
    for (const int width : {32, 64, 128}) {
      const int kernel_width =
          tc_kernel_head_dims(VariantId::kPlain, width, static_cast<int>(dim_v)).first;
      if (width >= rank && kernel_width == width) return width;
    }
    TORCH_CHECK(false, "adaattn.low_rank_attn: no tensor-core kernel for rank R = ", rank,
                " with value head dim Dv = ", dim_v, "; supported (R padded, Dv): ",
                tc_head_dims(VariantId::kPlain));
  }
#endif
  return rank;
}

std::tuple<at::Tensor, at::Tensor> low_rank_attn(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, const at::Tensor& basis,
                                                 bool causal,
                                                 std::optional<double> softmax_scale) {
  // Validated here, so that errors name this op (the projected flash_attn call then passes).
  check_flash_inputs(op, q, k, v, std::nullopt, std::nullopt, std::nullopt);
  resolve_flash_options(op, q, softmax_scale, causal, -1, -1, BwdMode::kTwoPass, 0.0);
  const int64_t batch = q.size(0), heads_q = q.size(1), heads_kv = k.size(1), dim = q.size(3);
  ADAATTN_CHECK_VALUE(basis.dim() == 4 && basis.size(0) == batch && basis.size(1) == heads_kv &&
                          basis.size(2) == dim,
                      "basis must be [B, Hkv, D, R] = [", batch, ", ", heads_kv, ", ", dim,
                      ", R], got ", basis.sizes());
  ADAATTN_CHECK_VALUE(basis.size(3) >= 1, "basis must have rank R = basis.size(3) >= 1, got ",
                      basis.size(3));
  ADAATTN_CHECK_TYPE(basis.scalar_type() == at::kFloat || basis.scalar_type() == q.scalar_type(),
                     "basis must be float32 or q's dtype ", q.scalar_type(), ", got ",
                     basis.scalar_type());
  ADAATTN_CHECK_DEVICE(basis.device() == q.device(), "basis must be on q's device ", q.device(),
                       ", got ", basis.device());
  const int64_t rank = basis.size(3);
  const int64_t width = projected_width(q, rank, v.size(3));
  const at::Tensor u =
      at::constant_pad_nd(basis, {0, width - rank}).to(q.scalar_type());  // [B, Hkv, D, R']
  const int64_t group = heads_q / heads_kv;
  // Query heads of one kv head share its basis: [B, Hkv, G, Lq, D] @ [B, Hkv, 1, D, R'].
  const at::Tensor q_proj =
      at::matmul(q.unflatten(1, {heads_kv, group}), u.unsqueeze(2)).flatten(1, 2);
  const at::Tensor k_proj = at::matmul(k, u);
  const double scale = softmax_scale_or_default(softmax_scale, dim);
  static auto flash = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("adaattn::flash_attn", "")
                          .typed<std::tuple<at::Tensor, at::Tensor>(
                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&, std::optional<double>, bool,
                              int64_t, int64_t, bool, const std::optional<at::Tensor>&,
                              const std::optional<at::Tensor>&, double,
                              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                              const std::optional<at::Tensor>&)>();
  return flash.call(q_proj, k_proj, v, std::nullopt, scale, causal, -1, -1, false, std::nullopt,
                    std::nullopt, /*softcap=*/0.0, std::nullopt, std::nullopt, std::nullopt);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adaattn, m) {
  m.def(
      "low_rank_attn(Tensor q, Tensor k, Tensor v, Tensor basis, bool causal=False, "
      "float? softmax_scale=None) -> (Tensor out, Tensor lse)");
}

TORCH_LIBRARY_IMPL(adaattn, CompositeImplicitAutograd, m) {
  m.impl("low_rank_attn", &low_rank_attn);
}

}  // namespace adaattn
