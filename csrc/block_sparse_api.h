// Launchers of the block-sparse family (spec 3.3), one per device path. Each takes fully
// validated parameters (block_sparse_ops.h) whose outputs are allocated and writes every output
// element. The mask lives in AttnParams' block-sparse section (core/params.h, read through
// core/block_sparse.h); causal is window_left = -1, window_right = 0 as in the flash family.
#pragma once

#include <c10/core/ScalarType.h>

#include "core/params.h"

namespace adaattn {

// CPU, fp32 or fp64 (the op upcasts fp16/bf16). Tiled, O(L) extra memory, parallel over batch x
// heads x row tiles, deterministic. Forward visits the listed key blocks of each query block
// (block_kv_*) and writes out and lse (out = 0, lse = -inf for a row that sees no key).
// Backward reads out and dout, recomputes each row's log-sum-exp over the same listed blocks
// while it accumulates dq (it does not read the float32 lse), then computes dk/dv per key tile
// from the transposed lists (block_q_*), summing over the query heads of the kv head's group.
// Requires block_m and block_n to be multiples of 64 (the CPU tile).
void block_sparse_fwd_cpu(const AttnParams& p, c10::ScalarType dtype);
void block_sparse_bwd_cpu(const AttnParams& p, c10::ScalarType dtype);

}  // namespace adaattn
