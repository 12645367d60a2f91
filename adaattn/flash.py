"""Exact softmax attention (flash attention), forward and backward on CPU and CUDA."""
from typing import Optional, Tuple, Union

import torch

from . import _checks as C
from ._ops import ops

Window = Tuple[int, int]

# The softcap defaults are the int 0 (off): torch.compile(dynamic=True) turns a float default into
# a graph input and then restarts its analysis to specialise it; an int default stays a constant.


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
               softmax_scale: Optional[float] = None, window: Window = (-1, -1),
               seqlens: Optional[torch.Tensor] = None, return_lse: bool = False,
               deterministic: bool = False, softcap: float = 0,
               alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
               rel_bias: Optional[torch.Tensor] = None, precision: str = "bf16",
               fp8_tol: Optional[float] = None, return_precision: bool = False):
    """Exact softmax attention with O(L) memory (tiled, online softmax, recomputing backward).

    Args:
        q: ``[B, Hq, Lq, D]``. Any strides with a contiguous last dim, e.g. a ``(B, L, H, D)``
            tensor passed as ``.transpose(1, 2)`` (no copy is made).
        k: ``[B, Hkv, Lk, D]`` with ``Hq % Hkv == 0`` (GQA/MQA: query head ``h`` reads kv head
            ``h // (Hq // Hkv)``).
        v: ``[B, Hkv, Lk, Dv]``; the value head dim may differ from ``D`` (CUDA fp16/bf16:
            the compiled ``(D, Dv)`` pairs are listed in csrc/cuda/tc/generate.py; other dims
            up to 256 run on the cheapest pair that covers them).
        causal: query row ``r`` sees key ``c`` iff ``c <= r + (Lk - Lq)`` (bottom-right aligned).
        softmax_scale: multiplies ``q @ k^T``; defaults to ``D ** -0.5``.
        window: ``(left, right)`` sliding window around the same diagonal; ``-1`` = unbounded.
        seqlens: optional int32 ``[B]`` for right-padded batches: keys and query rows at or
            past ``seqlens[b]`` are padding (padding rows give 0).
        return_lse: also return the float32 log-sum-exp ``[B, Hq, Lq]`` (``-inf`` for a row
            that sees no key; such rows give ``out = 0``).
        deterministic: backward without order-dependent accumulation (bit-reproducible).
            With ``False``, the CUDA fp16/bf16 backward on Hopper (every head dim) and
            elsewhere at ``Dv = 64`` adds each key tile's share of dq with float32 atomics
            (faster end to end; the summation order varies between runs); ``True`` recomputes
            the scores in a separate dq pass instead. Every other kernel (CPU, fp32/fp64,
            ``Dv = 128`` before Hopper) is always deterministic.
        softcap: score soft-capping (Gemma 2): ``s <- softcap * tanh(s / softcap)`` on the
            scaled scores ``s = softmax_scale * q @ k^T`` ``[B, Hq, Lq, Lk]``, before masking;
            ``0`` = off. Must be finite and ``>= 0``. ``lse`` is then that of the capped scores.
        alibi_slopes: float32 ``[Hq]`` or ``[B, Hq]`` (flash-attn's ALiBi):
            ``s <- s - slope[b, h] * |i - j|`` with ``i = r + Lk - Lq`` the query's position
            (bottom-right aligned) and ``j`` the key's, after softcap, before masking. No
            gradient.
        sinks: float32 ``[Hq]`` learnable attention sinks (gpt-oss): logit ``sinks[h]`` joins
            every row's softmax denominator and attends to nothing, so
            ``lse = log(exp(sinks[h]) + sum_j exp(s_ij))`` (a row that sees no key gets
            ``lse = sinks[h]``, ``out = 0``). Differentiable.
        rel_bias: float32 ``[Hq, W]`` learnable relative-position bias:
            ``s <- s + rel_bias[h, i - j]`` for ``0 <= i - j < W`` (positions as for ALiBi),
            added with ALiBi after softcap. Differentiable.
            The three compose with each other, softcap, GQA, windows, causal and padding, on
            the tensor cores in float16/bfloat16 as without them.
        precision: ``"bf16"`` (default: the operands' own precision), ``"fp8"`` or ``"auto"``
            (forward only, for inference and prefill: refused when a gradient is wanted).
            ``"fp8"`` runs every head on 8-bit operands (adaattn.precision's default scheme:
            K smoothed, Q and K Hadamard-rotated and int8 per 128-row block, P and V e4m3; on
            CUDA the Hopper kernel, on the CPU its emulation
            :func:`adaattn.precision.fp8_attention_emulated`); ``"auto"`` only the heads whose
            estimated error (:func:`adaattn.precision.choose_precision`) is within ``fp8_tol``,
            the others at the operands' precision. A head holding NaN/Inf always runs at the
            operands' precision. Dense float16/bfloat16 inputs, ``D = Dv`` in {64, 128}, with
            causal/window/GQA; not with seqlens, softcap, alibi_slopes, sinks or rel_bias.
        fp8_tol: ``"auto"``'s tolerance (estimated relative L2 error per head); default
            :data:`adaattn.precision.FP8_TOL`.
        return_precision: also return the bool ``[B, Hq]`` of the heads that ran 8-bit (last).

    Returns:
        ``out [B, Hq, Lq, Dv]`` (dtype of q), and ``lse`` when ``return_lse``, and the heads
        that ran 8-bit when ``return_precision``.

    Non-finite inputs propagate as in ``adaattn.reference``: a NaN or ``+inf`` score makes its
    row's ``out`` and ``lse`` NaN, a ``-inf`` score weighs 0 (docs/ops.md).

    Raises:
        TypeError: an argument of the wrong type (a flag that is not a bool, a window that is not
            a pair of ints) or a tensor of the wrong dtype (q, k, v not floating or not of one
            dtype, seqlens not int32).
        ValueError: a wrong shape, layout or value (ranks, ``Hq % Hkv``, head dims, window
            entries, softmax_scale not finite, softcap < 0, seqlens outside ``[0, max(Lq, Lk)]``
            (checked on the CPU, and on CUDA with ``ADAATTN_CHECK_INPUTS=1``); alibi_slopes, sinks
            or rel_bias not of shape ``[Hq]`` / ``[B, Hq]``, ``[Hq]``, ``[Hq, W]``); TypeError
            also for those three not float32.
        RuntimeError: tensors on different devices; a head dim the CUDA fp16/bf16 kernels do not
            support.
        Every message starts ``adaattn.flash_attn:`` and names the argument.
    """
    op = "flash_attn"
    C.tensors(op, q=q, k=k, v=v)
    C.optional_tensors(op, seqlens=seqlens, alibi_slopes=alibi_slopes, sinks=sinks,
                       rel_bias=rel_bias)
    return_lse = C.boolean(op, "return_lse", return_lse)
    return_precision = C.boolean(op, "return_precision", return_precision)
    left, right = C.window_pair(op, window)
    scale = C.optional_float(op, "softmax_scale", softmax_scale)
    causal = C.boolean(op, "causal", causal)
    softcap = C.softcap_value(op, softcap)
    if precision not in ("bf16", "fp8", "auto"):
        C.fail(ValueError, op, "precision must be 'bf16', 'fp8' or 'auto', got ", repr(precision))
    if precision != "bf16":
        from .precision import low_precision_forward
        out, lse, head_fp8 = low_precision_forward(
            op, q, k, v, precision=precision, fp8_tol=fp8_tol, causal=causal, scale=scale,
            window=(left, right), seqlens=seqlens, softcap=softcap, alibi_slopes=alibi_slopes,
            sinks=sinks, rel_bias=rel_bias)
    else:
        out, lse = ops.flash_attn(q, k, v, seqlens, scale, causal, left, right,
                                  C.boolean(op, "deterministic", deterministic), None, None,
                                  softcap, alibi_slopes, sinks, rel_bias)
        head_fp8 = None
    result = (out, lse) if return_lse else (out,)
    if return_precision:
        if head_fp8 is None:
            head_fp8 = torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device)
        result = result + (head_fp8,)
    return result[0] if len(result) == 1 else result


def flash_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, *,
                      causal: bool = False, softmax_scale: Optional[float] = None,
                      window: Window = (-1, -1), return_lse: bool = False,
                      deterministic: bool = False, softcap: float = 0,
                      alibi_slopes: Optional[torch.Tensor] = None,
                      sinks: Optional[torch.Tensor] = None, rel_bias: Optional[torch.Tensor] = None
                      ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Flash attention over packed variable-length sequences (no padding, no work on padding).

    Sequence ``n`` owns query rows ``cu_seqlens_q[n]:cu_seqlens_q[n + 1]`` and key rows
    ``cu_seqlens_k[n]:cu_seqlens_k[n + 1]``; it attends only to its own keys, with causal and
    window limits bottom-right aligned per sequence (``Tq != Tk`` per sequence works: cross
    attention, decoding against a cache). Zero-length sequences are allowed.

    Args:
        q: ``[Tq, Hq, D]`` (any strides with a contiguous last dim).
        k: ``[Tk, Hkv, D]`` with ``Hq % Hkv == 0``.
        v: ``[Tk, Hkv, Dv]``.
        cu_seqlens_q: int32 ``[N + 1]`` on q's device: 0, non-decreasing, ending at ``Tq``.
        cu_seqlens_k: int32 ``[N + 1]``, ending at ``Tk``.
        max_seqlen_q, max_seqlen_k: accepted for flash-attn compatibility and unused: the
            kernels size their grids from the token count (no host synchronisation, no
            recompilation when the packing changes).
        causal, softmax_scale, window, deterministic: as in :func:`flash_attn`.
        softcap: ``s <- softcap * tanh(s / softcap)`` on each sequence's scaled scores
            ``[Hq, Lq_n, Lk_n]`` before masking, as in :func:`flash_attn`; ``0`` = off.
        alibi_slopes, sinks, rel_bias: as in :func:`flash_attn`, positions counted within each
            sequence; alibi_slopes may be ``[N, Hq]`` (one row per sequence).
        return_lse: also return the float32 log-sum-exp ``[Hq, Tq]``.

    ``cu_seqlens`` values are validated on the CPU; on CUDA that would cost a device sync, so it
    happens only with ``ADAATTN_CHECK_INPUTS=1``; either way the kernels clamp them to the
    tensors, so a malformed one never reads out of bounds.

    Returns:
        ``out [Tq, Hq, Dv]``, and ``lse [Hq, Tq]`` when ``return_lse``.

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`flash_attn` (and for cu_seqlens: not
            int32; not ``[N + 1]``, not starting at 0, decreasing or not ending at ``T``), the
            message starting ``adaattn.flash_attn_varlen:``.
    """
    del max_seqlen_q, max_seqlen_k
    op = "flash_attn_varlen"
    C.tensors(op, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    C.optional_tensors(op, alibi_slopes=alibi_slopes, sinks=sinks, rel_bias=rel_bias)
    return_lse = C.boolean(op, "return_lse", return_lse)
    left, right = C.window_pair(op, window)
    scale = C.optional_float(op, "softmax_scale", softmax_scale)
    out, lse = ops.flash_attn(q, k, v, None, scale, C.boolean(op, "causal", causal), left, right,
                              C.boolean(op, "deterministic", deterministic), cu_seqlens_q,
                              cu_seqlens_k, C.softcap_value(op, softcap), alibi_slopes, sinks,
                              rel_bias)
    return (out, lse) if return_lse else out
