// precision="fp8": the schema of the 8-bit forward (flash_attn(..., precision="fp8"|"auto")).
// fp8_tol (precision="auto"; None: every head 8-bit) runs 8-bit only the heads whose
// estimated error (adaattn.precision.estimate_precision_error, from statistics the quantising
// pre-pass gathers) is at most fp8_tol; a head whose q, or whose kv head's k or v, holds a NaN
// or Inf runs the 16-bit forward (8-bit operands cannot carry them). The returned head_fp8
// (bool [B, Hq]) says which heads ran 8-bit.
// Inference only (no autograd kernel: adaattn.flash_attn refuses fp8 with requires_grad). The
// CUDA registration is precision_cuda.cpp; the CPU kernel is the emulation of the same scheme,
// adaattn.precision.fp8_attention_emulated, registered from Python (adaattn/_ops.py), so that
// the scheme has one CPU definition.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(adaattn, m) {
  m.def(
      "flash_fwd_fp8(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, bool causal=False, "
      "int window_left=-1, int window_right=-1, float? fp8_tol=None) -> (Tensor out, "
      "Tensor lse, Tensor head_fp8)");
}
