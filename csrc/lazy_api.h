// Launchers of the lazy family (spec 3.2), one per device path. Each takes fully validated
// parameters (see lazy_ops.h) whose outputs are allocated and writes every output element:
// forward: out, lse (and p.stats when non-null); backward: dq, dk, dv, and dtau/dbias when
// p.dtau is non-null (p.delta and p.row_g are caller-provided [B, Hq, Lq] scratch).
#pragma once

#include <c10/core/ScalarType.h>

#include "core/params.h"

namespace adaattn {

// CPU, fp32 or fp64 (the op upcasts fp16/bf16). Tiled, O(L) extra memory, parallel over B x H.
void lazy_fwd_cpu(const AttnParams& p, c10::ScalarType dtype);
void lazy_bwd_cpu(const AttnParams& p, c10::ScalarType dtype);

#ifdef ADAATTN_WITH_CUDA
// CUDA exact path (fp32/fp64) and tensor-core path (fp16/bf16, head dims in tc_head_dims()).
void lazy_fwd_exact_cuda(const AttnParams& p, c10::ScalarType dtype);
void lazy_bwd_exact_cuda(const AttnParams& p, c10::ScalarType dtype);
void lazy_fwd_tc_cuda(const AttnParams& p, c10::ScalarType dtype);
void lazy_bwd_tc_cuda(const AttnParams& p, c10::ScalarType dtype);
#endif

}  // namespace adaattn
