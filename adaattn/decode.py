"""Attention against a KV cache (inference decode): flash and lazy attention of a few new query
rows, with the new keys and values appended to the cache in place first."""
from typing import Optional, Tuple, Union

import torch

from . import _checks as C
from ._ops import ops


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                            *, cache_seqlens: torch.Tensor,
                            block_table: Optional[torch.Tensor] = None, causal: bool = True,
                            window=(-1, -1), softmax_scale: Optional[float] = None,
                            softcap: float = 0, return_lse: bool = False, num_splits: int = 0
                            ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Softmax attention of new query rows against a KV cache (flash-attn's semantics).

    With ``k``/``v`` given, they are first written **in place** into the cache at positions
    ``cache_seqlens[b] .. cache_seqlens[b] + Lq - 1``; sequence ``b`` then attends keys
    ``[0, cache_seqlens[b] + Lq)`` and query row ``r`` sits at position ``cache_seqlens[b] + r``.
    Without them the cache already holds the new tokens: keys ``[0, cache_seqlens[b])``, row
    ``r`` at position ``cache_seqlens[b] - Lq + r``. Causal and window limits are relative to a
    row's position (bottom-right aligned, as :func:`flash_attn`). ``cache_seqlens`` is not
    advanced. No gradients (inference).

    Args:
        q: ``[B, Hq, Lq, D]``, any strides with a contiguous last dim (flash-attn's
            ``[B, L, H, D]`` storage passes as ``.transpose(1, 2)``).
        k_cache: ``[B, Hkv, Lmax, D]``, or paged ``[num_pages, Hkv, page_size, D]`` with
            ``block_table``; q's dtype, contiguous last dim, ``Hq % Hkv == 0``.
        v_cache: like ``k_cache`` with head dim ``Dv``.
        k, v: new keys ``[B, Hkv, Lq, D]`` and values ``[B, Hkv, Lq, Dv]``, or None.
        cache_seqlens: int32 ``[B]``: tokens in the cache before this call. On CPU the op checks
            ``0 <= cache_seqlens[b]`` and ``cache_seqlens[b] + Lq <= Lmax`` (with k/v); on
            CUDA the kernels clamp to the cache instead (no host sync), and
            ``ADAATTN_CHECK_INPUTS=1`` checks there too.
        block_table: int32 ``[B, max_pages]``: key position ``j`` of sequence ``b`` lives in page
            ``block_table[b, j // page_size]``, slot ``j % page_size``; ``Lmax`` is then
            ``max_pages * page_size``.
        causal, window: as :func:`flash_attn` (``window = (left, right)``, -1 unbounded).
        softmax_scale: multiplies ``q @ k^T``; defaults to ``D ** -0.5``.
        softcap: ``s <- softcap * tanh(s / softcap)`` after scaling; 0 = off.
        return_lse: also return the float32 log-sum-exp ``[B, Hq, Lq]`` (``-inf``: the row
            sees no key and ``out`` is 0).
        num_splits: key splits per (sequence, kv head) of the CUDA decode kernel, whose partial
            results are merged through their lse; 0 chooses from the shapes and the SM count.

    Returns:
        ``out [B, Hq, Lq, Dv]`` (q's dtype), or ``(out, lse)`` with ``return_lse``.

    Raises:
        TypeError: a flag that is not a bool, num_splits not an int, window not a pair of ints;
            q not floating, caches or k/v not of q's dtype, cache_seqlens or block_table not
            int32.
        ValueError: a wrong shape, layout or value (ranks, ``Hq % Hkv``, head dims, cache and
            k/v shapes, window entries, num_splits < 0; cache_seqlens or block_table entries
            out of range (CPU; CUDA with ``ADAATTN_CHECK_INPUTS=1``, which otherwise clamps)).
        RuntimeError: tensors on different devices.
        Every message starts ``adaattn.flash_attn_with_kvcache:`` and names the argument.
    """
    op = "flash_attn_with_kvcache"
    C.tensors(op, q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens)
    C.optional_tensors(op, k=k, v=v, block_table=block_table)
    return_lse = C.boolean(op, "return_lse", return_lse)
    left, right = C.window_pair(op, window)
    out, lse = ops.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                           C.optional_float(op, "softmax_scale", softmax_scale),
                                           C.boolean(op, "causal", causal), left, right,
                                           C.softcap_value(op, softcap),
                                           C.num_splits_value(op, num_splits))
    return (out, lse) if return_lse else out


def lazy_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                           tau: torch.Tensor, bias: torch.Tensor, *,
                           cache_seqlens: torch.Tensor,
                           block_table: Optional[torch.Tensor] = None,
                           softmax_scale: Optional[float] = None, return_lse: bool = False,
                           num_splits: int = 0
                           ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Lazy attention (see :func:`lazy_attn`) of new query rows against a KV cache.

    The cache, ``k``/``v`` appending and positions are those of :func:`flash_attn_with_kvcache`
    (causal): row ``r`` at position ``i = cache_seqlens[b] + r`` (with ``k``/``v``) gets
    ``s_ij = scale * q.k_j + bias[h, i - j]`` (``0 <= i - j < W``) and weights
    ``a_ij = max(0, softmax_j(s_ij) + tau[h] / (i + 1))``, exactly as the last rows of
    :func:`lazy_attn` on the whole sequence. No gradients (inference).

    Args:
        q: ``[B, Hq, Lq, D]``; k_cache, v_cache: ``[B, Hkv, Lmax, D]`` or paged
            ``[num_pages, Hkv, page_size, D]`` (``Dv == D``).
        k, v: new ``[B, Hkv, Lq, D]``, or None.
        tau: float32 ``[Hq]``; bias: float32 ``[Hq, W]``; contiguous, on q's device.
        cache_seqlens, block_table, softmax_scale, return_lse, num_splits: as
            :func:`flash_attn_with_kvcache`.

    Returns:
        ``out [B, Hq, Lq, D]``, or ``(out, lse)`` with ``return_lse``.

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`flash_attn_with_kvcache` (and for
            tau/bias as :func:`lazy_attn`), the message starting
            ``adaattn.lazy_attn_with_kvcache:``.
    """
    op = "lazy_attn_with_kvcache"
    C.tensors(op, q=q, k_cache=k_cache, v_cache=v_cache, tau=tau, bias=bias,
              cache_seqlens=cache_seqlens)
    C.optional_tensors(op, k=k, v=v, block_table=block_table)
    return_lse = C.boolean(op, "return_lse", return_lse)
    out, lse = ops.lazy_attn_with_kvcache(q, k_cache, v_cache, k, v, tau, bias, cache_seqlens,
                                          block_table,
                                          C.optional_float(op, "softmax_scale", softmax_scale),
                                          C.num_splits_value(op, num_splits))
    return (out, lse) if return_lse else out
