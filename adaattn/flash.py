"""Exact softmax attention (flash attention), forward and backward on CPU and CUDA."""
import numbers
from typing import Optional, Tuple, Union

import torch

from ._ops import ops

Window = Tuple[int, int]


def _window_pair(window) -> Window:
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window)):
        raise ValueError(f"adaattn: window must be a pair of ints (left, right), got {window!r}")
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(
            f"adaattn: window entries must be >= 0 or -1 (unbounded), got {tuple(window)}")
    return left, right


# The softcap defaults are the int 0 (off): torch.compile(dynamic=True) turns a float default into
# a graph input and then restarts its analysis to specialise it; an int default stays a constant.
def _softcap_value(softcap) -> float:
    """softcap as a float (the op checks that it is finite and >= 0)."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise ValueError(f"adaattn: softcap must be a float >= 0 (0 = off), got {softcap!r}")
    return float(softcap)


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
               softmax_scale: Optional[float] = None, window: Window = (-1, -1),
               seqlens: Optional[torch.Tensor] = None, return_lse: bool = False,
               deterministic: bool = False, softcap: float = 0
               ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact softmax attention with O(L) memory (tiled, online softmax, recomputing backward).

    Args:
        q: ``[B, Hq, Lq, D]``. Any strides with a contiguous last dim, e.g. a ``(B, L, H, D)``
            tensor passed as ``.transpose(1, 2)`` (no copy is made).
        k: ``[B, Hkv, Lk, D]`` with ``Hq % Hkv == 0`` (GQA/MQA: query head ``h`` reads kv head
            ``h // (Hq // Hkv)``).
        v: ``[B, Hkv, Lk, Dv]``; the value head dim may differ from ``D`` (CUDA fp16/bf16:
            the compiled ``(D, Dv)`` pairs are listed in csrc/cuda/tc/generate.py; other dims
            up to 128 run zero-padded to the cheapest pair that covers them).
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

    Returns:
        ``out [B, Hq, Lq, Dv]`` (dtype of q), and ``lse`` when ``return_lse``.
    """
    left, right = _window_pair(window)
    out, lse = ops.flash_attn(q, k, v, seqlens, softmax_scale, bool(causal), left, right,
                              bool(deterministic), None, None, _softcap_value(softcap))
    return (out, lse) if return_lse else out


def flash_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, *,
                      causal: bool = False, softmax_scale: Optional[float] = None,
                      window: Window = (-1, -1), return_lse: bool = False,
                      deterministic: bool = False, softcap: float = 0
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
        return_lse: also return the float32 log-sum-exp ``[Hq, Tq]``.

    ``cu_seqlens`` values are validated on the CPU; on CUDA that would cost a device sync, so it
    happens only with ``ADAATTN_CHECK_INPUTS=1``; either way the kernels clamp them to the
    tensors, so a malformed one never reads out of bounds.

    Returns:
        ``out [Tq, Hq, Dv]``, and ``lse [Hq, Tq]`` when ``return_lse``.
    """
    del max_seqlen_q, max_seqlen_k
    left, right = _window_pair(window)
    out, lse = ops.flash_attn(q, k, v, None, softmax_scale, bool(causal), left, right,
                              bool(deterministic), cu_seqlens_q, cu_seqlens_k,
                              _softcap_value(softcap))
    return (out, lse) if return_lse else out
