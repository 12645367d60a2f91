// The non-inline part of include/adaattn/adaattn.h (the CMake library only: Python reaches the
// ops through torch.ops). Defining find_op here makes every user of the header depend on
// libadaattn, whose static initialisers register the ops.
#include "adaattn/adaattn.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>

#ifndef ADAATTN_VERSION
#error "ADAATTN_VERSION must be defined by the build (CMakeLists.txt reads adaattn/__init__.py)"
#endif

namespace adaattn {

namespace {

// Mean listed keys per query row up to which bwd_mode "auto" takes the two-pass backward
// (adaattn/block_sparse.py's _TWO_PASS_MAX_KEYS_PER_ROW).
constexpr double kTwoPassMaxKeysPerRow = 6 * 128;

}  // namespace

const char* version() { return ADAATTN_VERSION; }

std::string build_info() {
  static const auto op = detail::typed_op<std::string()>("build_info");
  return op.call();
}

namespace detail {

c10::OperatorHandle find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow((std::string("adaattn::") + name).c_str(),
                                                        "");
}

}  // namespace detail

BlockSparseMask BlockSparseMask::from_dense(const at::Tensor& layout, int64_t block_m,
                                            int64_t block_n) {
  TORCH_CHECK_TYPE(layout.scalar_type() == at::kBool,
                   "adaattn.BlockSparseMask.from_dense: layout must be a bool tensor, got ",
                   layout.scalar_type());
  TORCH_CHECK_VALUE(layout.dim() == 4,
                    "adaattn.BlockSparseMask.from_dense: layout must be [B|1, H|1, nQ, nKV], got ",
                    layout.dim(), " dims");
  // BCSR lists as adaattn.BlockSparseMask builds them: counts, then each row's listed columns
  // first in ascending order (a stable sort of "not listed").
  const auto lists = [](const at::Tensor& dense) {
    const at::Tensor counts = dense.sum({-1}, /*keepdim=*/false, at::kInt);
    // std::optional<bool> spelled out: a plain `true` would pick sort(dim, descending).
    const at::Tensor order = std::get<1>(
        dense.logical_not().to(at::kByte).sort(std::optional<bool>(true), /*dim=*/-1));
    return std::make_pair(counts, order.to(at::kInt));
  };
  BlockSparseMask mask;
  std::tie(mask.kv_num_blocks, mask.kv_indices) = lists(layout);
  std::tie(mask.q_num_blocks, mask.q_indices) = lists(layout.transpose(-1, -2));
  mask.block_m = block_m;
  mask.block_n = block_n;
  const int64_t rows = mask.kv_num_blocks.numel();
  mask.keys_per_row =
      rows == 0 ? 0.0
                : static_cast<double>(mask.kv_num_blocks.sum(at::kLong).item<int64_t>()) *
                      static_cast<double>(block_n) / static_cast<double>(rows);
  return mask;
}

std::tuple<at::Tensor, at::Tensor> block_sparse_attn_with_lse(const at::Tensor& q,
                                                              const at::Tensor& k,
                                                              const at::Tensor& v,
                                                              const BlockSparseMask& mask,
                                                              const BlockSparseOptions& opts) {
  std::string mode = opts.bwd_mode;
  TORCH_CHECK_VALUE(mode == "auto" || mode == "atomic" || mode == "two_pass",
                    "adaattn.block_sparse_attn: bwd_mode must be one of 'auto', 'atomic', "
                    "'two_pass', got '", mode, "'");
  TORCH_CHECK_VALUE(!(mode == "atomic" && opts.deterministic),
                    "adaattn.block_sparse_attn: deterministic=true contradicts "
                    "bwd_mode='atomic' (atomic dq accumulation is not bit-reproducible); pass "
                    "bwd_mode='two_pass' or 'auto'");
  if (mode == "auto") {
    mode = opts.deterministic || mask.keys_per_row <= kTwoPassMaxKeysPerRow ? "two_pass"
                                                                            : "atomic";
  }
  using Sig = std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
      std::optional<double>, bool, c10::string_view, double, const detail::OptTensor&,
      const detail::OptTensor&, const detail::OptTensor&);
  static const auto op = detail::typed_op<Sig>("block_sparse_attn");
  return op.call(q, k, v, mask.kv_num_blocks, mask.kv_indices, mask.q_num_blocks, mask.q_indices,
                 mask.block_m, mask.block_n, opts.softmax_scale, opts.causal, mode,
                 opts.softcap, opts.alibi_slopes, opts.sinks, opts.rel_bias);
}

at::Tensor lazy_attn_with_kvcache(const at::Tensor& q, at::Tensor k_cache, at::Tensor v_cache,
                                  const detail::OptTensor& k, const detail::OptTensor& v,
                                  const at::Tensor& tau, const at::Tensor& bias,
                                  const at::Tensor& cache_seqlens, const KVCacheOptions& opts) {
  TORCH_CHECK_VALUE(opts.causal && opts.window_left == -1 && opts.window_right == -1 &&
                        opts.softcap == 0.0 && !opts.k_scale.has_value() &&
                        !opts.v_scale.has_value() && !opts.alibi_slopes.has_value() &&
                        !opts.sinks.has_value() && !opts.rel_bias.has_value(),
                    "adaattn.lazy_attn_with_kvcache: opts.causal, window_left, window_right, "
                    "softcap, k_scale, v_scale, alibi_slopes, sinks and rel_bias apply to "
                    "flash_attn_with_kvcache only (lazy attention is causal, unwindowed and "
                    "uncapped, with its own bias, on a 16-bit or wider cache); leave them at "
                    "their defaults");
  using Sig = std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, at::Tensor&, at::Tensor&, const detail::OptTensor&,
      const detail::OptTensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const detail::OptTensor&, std::optional<double>, int64_t);
  static const auto op = detail::typed_op<Sig>("lazy_attn_with_kvcache");
  return std::get<0>(op.call(q, k_cache, v_cache, k, v, tau, bias, cache_seqlens,
                             opts.block_table, opts.softmax_scale, opts.num_splits));
}

}  // namespace adaattn
