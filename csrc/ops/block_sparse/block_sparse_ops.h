// Device-independent halves of the block-sparse ops: validation of the BCSR mask and
// AttnParams construction, shared by the CPU registration (block_sparse.cpp) and a CUDA one.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <optional>

#include "../../core/params.h"
#include "../common/attention_inputs.h"

namespace adaattn {

// The mask tensors of one call. kv_* is the forward index; q_* the transposed one (backward),
// undefined where an op does not take it.
struct BlockSparseMaskTensors {
  at::Tensor kv_num_blocks;  // int32 [Bm, Hm, nQ], Bm in {1, B}, Hm in {1, Hq}
  at::Tensor kv_indices;     // int32 [Bm, Hm, nQ, nKV]
  at::Tensor q_num_blocks;   // int32 [Bm, Hm, nKV]
  at::Tensor q_indices;      // int32 [Bm, Hm, nKV, nQ]
};

// Validates q, k, v (as flash_attn does), the block size (64 or 128 each) and the shapes,
// dtypes and devices of the mask tensors (nQ = ceil(Lq / block_m), nKV = ceil(Lk / block_n));
// errors name the argument. Reads no tensor values.
void check_block_sparse_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const BlockSparseMaskTensors& mask, int64_t block_m,
                               int64_t block_n);

// Checks the values of the mask tensors where check_values_of (CPU; CUDA with
// ADAATTN_CHECK_INPUTS=1: a host sync): counts in [0, row length], listed indices in range and
// distinct within a list, and, when the transposed index is given, that it lists exactly the
// blocks of the forward index.
void check_block_sparse_mask_values(const BlockSparseMaskTensors& mask);

// Contiguous copies where needed: the kernels read each list's entries with unit stride.
BlockSparseMaskTensors contiguous_mask(const BlockSparseMaskTensors& mask);

// The op's bwd_mode argument: "atomic" or "two_pass" (adaattn.block_sparse_attn resolves its
// "auto" before calling the op); the error names the argument.
BwdMode parse_bwd_mode(c10::string_view bwd_mode);

// The options of a block-sparse call: causal as window (-1, 0), no other window.
FlashOptions block_sparse_options(const at::Tensor& q, std::optional<double> softmax_scale,
                                  bool causal, BwdMode bwd_mode, double softcap);

// Sets the flash fields (make_params, no seqlens) and the block-sparse section from contiguous
// mask tensors (undefined q_* leave the transposed pointers null).
AttnParams make_block_sparse_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const BlockSparseMaskTensors& mask, int64_t block_m,
                                    int64_t block_n, const FlashOptions& opt);

}  // namespace adaattn
