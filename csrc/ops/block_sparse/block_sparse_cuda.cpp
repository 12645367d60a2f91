// CUDA registration of the block-sparse ops: fp16/bf16 go to the flash tensor-core
// kernels, which walk the mask's block lists (tc/tiles.h); fp32/fp64 to the exact kernels, which
// walk them per row (core/block_sparse.h). Mask values are checked only with
// ADAATTN_CHECK_INPUTS=1 (a host sync); otherwise the kernels clamp counts and skip
// out-of-range indices, so a malformed mask never reads out of bounds. Current stream, no host
// synchronisation.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../../attention_api.h"
#include "../common/attention_inputs.h"
#include "../common/cuda_inputs.h"
#include "block_sparse_ops.h"

namespace adaattn {
namespace {

// The tensor-core CTAs own 128 query rows (forward, dQ) and 64 or 128 keys (dK/dV): each must
// lie in one mask block.
constexpr int64_t kTcBlock = 128;

void check_cuda_block_size(const at::Tensor& q, int64_t block_m, int64_t block_n) {
  if (use_tensor_cores(q.scalar_type())) {
    TORCH_CHECK(block_m == kTcBlock && block_n == kTcBlock,
                "adaattn.block_sparse_attn: on CUDA in ", q.scalar_type(), " takes ", kTcBlock,
                "x", kTcBlock, " blocks, got block_m = ", block_m, ", block_n = ", block_n,
                " (float32/float64 and the CPU also take 64)");
  }
}

std::tuple<at::Tensor, at::Tensor> block_sparse_fwd_cuda_op(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& kv_num_blocks, const at::Tensor& kv_indices, int64_t block_m,
    int64_t block_n, std::optional<double> softmax_scale, bool causal, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& rel_bias) {
  BlockSparseMaskTensors mask{kv_num_blocks, kv_indices, {}, {}};
  check_block_sparse_inputs(q_in, k_in, v_in, mask, block_m, block_n);
  // Resolved on the caller's q: the default scale is D^-1/2 of the caller's D, not the padded.
  const FlashOptions opt =
      block_sparse_options(q_in, softmax_scale, causal, BwdMode::kTwoPass, softcap);
  const ScoreTensors mods("block_sparse_attn", q_in, q_in.size(0), alibi_slopes, sinks,
                          rel_bias);
  const VariantId variant = softmax_variant(opt, mods);
  const TcLayout layout = tc_layout("block_sparse_attn", q_in, v_in, variant);
  check_cuda_block_size(q_in, block_m, block_n);
  mask = contiguous_mask(mask);
  check_block_sparse_mask_values(mask);
  const at::Tensor q = layout.qk(q_in);
  const at::Tensor k = layout.qk(k_in);
  const at::Tensor v = layout.vo(v_in);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty(out_shape(q, v), q.options());
  at::Tensor lse = at::empty(lse_shape(q, false), q.options().dtype(at::kFloat));
  if (q.numel() == 0) return {layout.crop(out, layout.head_dim_v), lse};
  AttnParams p = make_block_sparse_params(q, k, v, mask, block_m, block_n, opt);
  mods.set(p);
  set_fwd_outputs(p, out, lse);
  if (use_tensor_cores(q.scalar_type())) {
    attention_fwd_tc_cuda(variant, p, q.scalar_type());
  } else {
    attention_fwd_exact_cuda(variant, p, q.scalar_type());
  }
  return {layout.crop(out, layout.head_dim_v), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_sparse_bwd_cuda_op(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse,
    const at::Tensor& kv_num_blocks, const at::Tensor& kv_indices,
    const at::Tensor& q_num_blocks, const at::Tensor& q_indices, int64_t block_m,
    int64_t block_n, std::optional<double> softmax_scale, bool causal,
    c10::string_view bwd_mode, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& rel_bias,
    bool param_grads) {
  BlockSparseMaskTensors mask{kv_num_blocks, kv_indices, q_num_blocks, q_indices};
  check_block_sparse_inputs(q_in, k_in, v_in, mask, block_m, block_n);
  check_flash_bwd_inputs("block_sparse_attn", dout_in, q_in, v_in, out_in, lse, /*packed=*/false);
  const FlashOptions opt = block_sparse_options(q_in, softmax_scale, causal,
                                                parse_bwd_mode(bwd_mode), softcap);
  const ScoreTensors mods("block_sparse_attn", q_in, q_in.size(0), alibi_slopes, sinks,
                          rel_bias);
  const VariantId variant = softmax_variant(opt, mods);
  at::Tensor dsinks = mods.grad_like(mods.sinks, param_grads, q_in);
  at::Tensor drel_bias = mods.grad_like(mods.rel_bias, param_grads, q_in);
  const TcLayout layout = tc_layout("block_sparse_attn", q_in, v_in, variant);
  check_cuda_block_size(q_in, block_m, block_n);
  mask = contiguous_mask(mask);
  check_block_sparse_mask_values(mask);
  const at::Tensor q = layout.qk(q_in);
  const at::Tensor k = layout.qk(k_in);
  const at::Tensor v = layout.vo(v_in);
  const at::Tensor out = layout.vo(out_in);
  const at::Tensor dout = layout.vo(dout_in);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  if (q.numel() == 0 || k.numel() == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {layout.crop(dq, layout.head_dim), layout.crop(dk, layout.head_dim),
            layout.crop(dv, layout.head_dim_v), dsinks, drel_bias};
  }
  at::Tensor delta = at::empty(lse.sizes(), lse.options());
  AttnParams p = make_block_sparse_params(q, k, v, mask, block_m, block_n, opt);
  mods.set(p, &dsinks, &drel_bias);
  set_bwd_tensors(p, dout, out, lse, dq, dk, dv, delta);
  if (use_tensor_cores(q.scalar_type())) {
    attention_bwd_tc_cuda(variant, p, q.scalar_type());
  } else {
    attention_bwd_exact_cuda(variant, p, q.scalar_type());
  }
  return {layout.crop(dq, layout.head_dim), layout.crop(dk, layout.head_dim),
          layout.crop(dv, layout.head_dim_v), dsinks, drel_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(adaattn, CUDA, m) {
  m.impl("block_sparse_fwd", &block_sparse_fwd_cuda_op);
  m.impl("block_sparse_bwd", &block_sparse_bwd_cuda_op);
}

}  // namespace adaattn
