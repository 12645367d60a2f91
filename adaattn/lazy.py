"""Lazy attention (docs/ops.md): causal elastic softmax with a learnable per-head shift ``tau``
and a relative-position ``bias`` table, forward and backward on CPU and CUDA."""
from typing import NamedTuple, Optional, Tuple, Union

import torch

from . import _checks as C
from ._ops import ops


class LazyStats(NamedTuple):
    """Sparsity of the lazy weights seen by the forward's weight pass, as device tensors (no host
    synchronisation; call ``.item()`` to read them).

    Attributes:
        zero_weight_fraction: float32 scalar, clipped (zero) weights / attended weights.
        skipped_block_fraction: float32 scalar, key tiles whose weights were all zero (their
            ``A V`` work was skipped) / key tiles visited, counted per (query tile, key tile)
            pair; tile sizes are the kernel's, so this fraction depends on the device path.
        counts: int64 ``[4]``, the raw counters ``(zero weights, attended weights, skipped
            tiles, visited tiles)``.
    """

    zero_weight_fraction: torch.Tensor
    skipped_block_fraction: torch.Tensor
    counts: torch.Tensor


def _fraction(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return (num.to(torch.float64) / den.clamp(min=1).to(torch.float64)).to(torch.float32)


def lazy_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tau: torch.Tensor,
              bias: torch.Tensor, *, softmax_scale: Optional[float] = None,
              seqlens: Optional[torch.Tensor] = None, return_lse: bool = False,
              return_stats: bool = False
              ) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
    """Lazy attention: causal softmax, shifted by ``tau / (i + 1)`` and clipped at zero.

    For the query at position ``i`` (row ``r`` sits at ``i = r + Lk - Lq``) and keys ``j <= i``::

        s_ij = scale * q_i.k_j + (bias[h, i - j] if i - j < W else 0)
        a_ij = max(0, softmax_j(s_ij) + tau[h] / (i + 1)),   out_i = sum_j a_ij v_j

    with no renormalisation (``tau < 0`` zeroes small weights; the kernels skip key tiles whose
    weights are all zero, which never changes the result). Weights are evaluated in float32
    (float64 for float64 inputs); tiled, O(L) memory, recomputing backward.

    Args:
        q: ``[B, Hq, Lq, D]``. Any strides with a contiguous last dim, e.g. a ``(B, L, H, D)``
            tensor passed as ``.transpose(1, 2)`` (no copy is made).
        k: ``[B, Hkv, Lk, D]`` with ``Lq <= Lk`` and ``Hq % Hkv == 0`` (GQA/MQA: query head ``h``
            reads kv head ``h // (Hq // Hkv)``).
        v: ``[B, Hkv, Lk, D]``.
        tau: float32 ``[Hq]``, contiguous, on q's device.
        bias: float32 ``[Hq, W]`` (``W >= 1``), contiguous, on q's device; distances
            ``i - j >= W`` get no bias but are still attended.
        softmax_scale: multiplies ``q @ k^T`` (never the bias); defaults to ``D ** -0.5``.
        seqlens: optional int32 ``[B]`` for right-padded batches: keys and query rows at or
            past ``seqlens[b]`` are padding (padding rows give 0).
        return_lse: also return the float32 log-sum-exp of the scores ``[B, Hq, Lq]``
            (``-inf`` for a row that sees no key; such rows give ``out = 0``).
        return_stats: also return a :class:`LazyStats` of the forward's weights.

    Returns:
        ``out [B, Hq, Lq, D]`` (dtype of q) alone, or the tuple ``(out[, lse][, stats])`` when
        ``return_lse`` or ``return_stats`` is set. Gradients flow to q, k, v, tau and bias
        (``tau``/``bias`` gradients are float32; the kernels skip that work when neither
        requires grad).

    Raises:
        TypeError: a flag that is not a bool; q, k, v not floating or not of one dtype, tau or
            bias not float32, seqlens not int32.
        ValueError: a wrong shape, layout or value (ranks, ``Hq % Hkv``, ``Dv != D``,
            ``Lq > Lk``, tau/bias shapes, non-contiguous tau/bias, softmax_scale not finite,
            seqlens outside ``[0, Lk]`` (CPU; CUDA with ``ADAATTN_CHECK_INPUTS=1``)).
        RuntimeError: tensors on different devices; a head dim the CUDA fp16/bf16 kernels do not
            support.
        Every message starts ``adaattn.lazy_attn:`` and names the argument.
    """
    op = "lazy_attn"
    C.tensors(op, q=q, k=k, v=v, tau=tau, bias=bias)
    C.optional_tensors(op, seqlens=seqlens)
    return_lse = C.boolean(op, "return_lse", return_lse)
    out, lse, counts = ops.lazy_attn(q, k, v, tau, bias, seqlens,
                                     C.optional_float(op, "softmax_scale", softmax_scale),
                                     C.boolean(op, "return_stats", return_stats))
    return _results(out, lse, counts, return_lse, return_stats)


def lazy_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens: torch.Tensor, tau: torch.Tensor, bias: torch.Tensor,
                     max_seqlen: Optional[int] = None, *, softmax_scale: Optional[float] = None,
                     return_lse: bool = False, return_stats: bool = False
                     ) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
    """Lazy attention over packed variable-length sequences (see :func:`lazy_attn`).

    Sequence ``n`` owns rows ``cu_seqlens[n]:cu_seqlens[n + 1]`` of q, k and v (causal
    self-attention), and the position ``i`` restarts at 0 in every sequence, so the bias
    distance ``i - j`` and the shift ``tau / (i + 1)`` are those of the sequence alone.

    Args:
        q: ``[T, Hq, D]`` (any strides with a contiguous last dim).
        k, v: ``[T, Hkv, D]`` with ``Hq % Hkv == 0``.
        cu_seqlens: int32 ``[N + 1]`` on q's device: 0, non-decreasing, ending at ``T``
            (validated on the CPU, and on CUDA with ``ADAATTN_CHECK_INPUTS=1``; the kernels
            clamp it either way).
        tau: float32 ``[Hq]``; bias: float32 ``[Hq, W]``.
        max_seqlen: accepted and unused (grids are sized from the token count; no host sync).
        softmax_scale, return_stats: as in :func:`lazy_attn`.
        return_lse: also return the float32 log-sum-exp ``[Hq, T]``.

    Returns:
        ``out [T, Hq, D]`` alone, or ``(out[, lse][, stats])``. Gradients flow to q, k, v, tau
        and bias.

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`lazy_attn` (and for cu_seqlens, as
            :func:`flash_attn_varlen`), the message starting ``adaattn.lazy_attn_varlen:``.
    """
    del max_seqlen
    op = "lazy_attn_varlen"
    C.tensors(op, q=q, k=k, v=v, cu_seqlens=cu_seqlens, tau=tau, bias=bias)
    return_lse = C.boolean(op, "return_lse", return_lse)
    out, lse, counts = ops.lazy_attn(q, k, v, tau, bias, None,
                                     C.optional_float(op, "softmax_scale", softmax_scale),
                                     C.boolean(op, "return_stats", return_stats), cu_seqlens)
    return _results(out, lse, counts, return_lse, return_stats)


def _results(out, lse, counts, return_lse, return_stats):
    if not (return_lse or return_stats):
        return out
    result = (out, lse) if return_lse else (out,)
    if return_stats:
        stats = LazyStats(_fraction(counts[0], counts[1]), _fraction(counts[2], counts[3]),
                          counts)
        result += (stats,)
    return result
