"""Attention against a KV cache (inference decode): flash and lazy attention of a few new query
rows, with the new keys and values appended to the cache in place first."""
from typing import Optional, Tuple, Union

import torch

from . import _checks as C
from ._ops import ops

_Tensor = torch.Tensor


def _tensors(*values) -> bool:
    for value in values:
        if not isinstance(value, _Tensor):
            return False
    return True


def _optional_tensors(*values) -> bool:
    for value in values:
        if value is not None and not isinstance(value, _Tensor):
            return False
    return True


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                            *, cache_seqlens: torch.Tensor,
                            block_table: Optional[torch.Tensor] = None, causal: bool = True,
                            window=(-1, -1), softmax_scale: Optional[float] = None,
                            softcap: float = 0.0, return_lse: bool = False, num_splits: int = 0,
                            k_scale: Optional[torch.Tensor] = None,
                            v_scale: Optional[torch.Tensor] = None,
                            alibi_slopes: Optional[torch.Tensor] = None,
                            sinks: Optional[torch.Tensor] = None,
                            rel_bias: Optional[torch.Tensor] = None
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
        alibi_slopes: float32 ``[Hq]`` or ``[B, Hq]``: ``s <- s - slope * |i - j|`` with ``i``
            the row's position above (flash-attn's ALiBi).
        sinks: float32 ``[Hq]`` attention sinks (gpt-oss): logit ``sinks[h]`` joins every row's
            softmax denominator and attends to nothing (a row that sees no key gets
            ``lse = sinks[h]``, ``out = 0``).
        rel_bias: float32 ``[Hq, W]``: ``s <- s + rel_bias[h, i - j]`` for ``0 <= i - j < W``.
            The three as in :func:`flash_attn` on the whole sequence (order ``scale -> softcap
            -> alibi + rel_bias -> mask -> softmax with sinks``); contiguous copies are taken.
            The CUDA decode kernel takes them at its head dims (not with an 8-bit cache: such
            calls run on its dequantised pages).
        return_lse: also return the float32 log-sum-exp ``[B, Hq, Lq]`` (``-inf``: the row
            sees no key and ``out`` is 0).
        num_splits: key splits per (sequence, kv head) of the CUDA decode kernel, whose partial
            results are merged through their lse; 0 chooses from the shapes and the SM count.
        k_scale, v_scale: float32 ``[num_pages, Hkv]``, the scales of an 8-bit paged cache
            (``k_cache``/``v_cache`` float8_e4m3fn, as :class:`adaattn.KVCache` with
            ``dtype=torch.float8_e4m3fn`` keeps them): a cached value means value * the scale
            of its page and kv head. Such a cache is appended to by ``KVCache.append`` (which
            quantises), not here (``k = v = None``). The CUDA decode kernel reads it as it is
            (plain softmax, fp16/bf16 q, D = Dv in {64, 128} or D in {32, 64} with Dv = 128,
            pages of a power of two >= 64 keys, at most 16 query rows per kv head),
            multiplying the stored values in f16 and applying the scales outside the
            products; other calls run on a copy of the table's pages dequantised to q's dtype.

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
    # A decode step's host time is on its critical path (single calls wait for it): the common
    # arguments are checked inline, the helpers (which build the messages) run only off that path.
    op = "flash_attn_with_kvcache"
    if not (_tensors(q, k_cache, v_cache, cache_seqlens)
            and _optional_tensors(k, v, block_table, k_scale, v_scale, alibi_slopes, sinks,
                                  rel_bias)):
        C.tensors(op, q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens)
        C.optional_tensors(op, k=k, v=v, block_table=block_table, k_scale=k_scale,
                           v_scale=v_scale, alibi_slopes=alibi_slopes, sinks=sinks,
                           rel_bias=rel_bias)
    if return_lse is not True and return_lse is not False:
        C.boolean(op, "return_lse", return_lse)
    if causal is not True and causal is not False:
        C.boolean(op, "causal", causal)
    left, right = C.window_pair(op, window)
    if softmax_scale is not None:
        softmax_scale = C.optional_float(op, "softmax_scale", softmax_scale)
    if type(softcap) is not float:
        softcap = C.softcap_value(op, softcap)
    if type(num_splits) is not int or num_splits < 0:
        C.num_splits_value(op, num_splits)
    out, lse = ops.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                           softmax_scale, causal, left, right, softcap,
                                           num_splits, k_scale, v_scale, alibi_slopes, sinks,
                                           rel_bias)
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
    if not (_tensors(q, k_cache, v_cache, tau, bias, cache_seqlens)
            and _optional_tensors(k, v, block_table)):
        C.tensors(op, q=q, k_cache=k_cache, v_cache=v_cache, tau=tau, bias=bias,
                  cache_seqlens=cache_seqlens)
        C.optional_tensors(op, k=k, v=v, block_table=block_table)
    if return_lse is not True and return_lse is not False:
        C.boolean(op, "return_lse", return_lse)
    if softmax_scale is not None:
        softmax_scale = C.optional_float(op, "softmax_scale", softmax_scale)
    if type(num_splits) is not int or num_splits < 0:
        C.num_splits_value(op, num_splits)
    out, lse = ops.lazy_attn_with_kvcache(q, k_cache, v_cache, k, v, tau, bias, cache_seqlens,
                                          block_table, softmax_scale, num_splits)
    return (out, lse) if return_lse else out


def _check_low_rank_cache_args(op: str, q: torch.Tensor, k_cache: torch.Tensor,
                               basis: torch.Tensor, k: Optional[torch.Tensor],
                               v: Optional[torch.Tensor]) -> None:
    """The checks of :func:`low_rank_attn_with_kvcache` that the projection needs: the op's
    q_basis checks under the name ``basis``, the GQA grouping and the full-width new keys (the
    rest are :func:`flash_attn_with_kvcache`'s on the projected operands)."""
    C.check_query_basis(op, q, k_cache, basis, "basis")
    batch, heads_q, len_q, dim = q.shape
    heads_kv = k_cache.shape[1]
    C.check(heads_kv > 0 and heads_q % heads_kv == 0, ValueError, op,
            "the number of query heads (q.size(1) = ", heads_q,
            ") must be a multiple of the number of kv heads (k_cache.size(1) = ", heads_kv, ")")
    C.check((k is None) == (v is None), ValueError, op,
            "the new keys k and values v must be given together (or neither)")
    if k is not None:
        C.check(tuple(k.shape) == (batch, heads_kv, len_q, dim), ValueError, op,
                "k (new keys, not projected) must be [B, Hkv, Lq, D] = [", batch, ", ", heads_kv,
                ", ", len_q, ", ", dim, "], got ", tuple(k.shape))
        C.check(k.dtype == q.dtype, TypeError, op, "k must have q's dtype ", q.dtype, ", got ",
                k.dtype)


def low_rank_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               basis: torch.Tensor, k: Optional[torch.Tensor] = None,
                               v: Optional[torch.Tensor] = None, *, cache_seqlens: torch.Tensor,
                               block_table: Optional[torch.Tensor] = None, causal: bool = True,
                               softmax_scale: Optional[float] = None, return_lse: bool = False,
                               num_splits: int = 0, k_scale: Optional[torch.Tensor] = None,
                               v_scale: Optional[torch.Tensor] = None
                               ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Low-rank attention (:func:`adaattn.low_rank_attn`) of new query rows against a cache of
    projected keys ``k U`` and full-width values.

    Scores are ``s = scale * (q U)(k U)^T`` with ``scale`` defaulting to ``D ** -0.5`` of the full
    head dim D, exactly as :func:`adaattn.low_rank_attn`: the last ``Lq`` rows of
    ``low_rank_attn(q_all, k_all, v_all, basis, causal=True)`` on the whole sequence are this
    op's output. Each cached token costs ``R + Dv`` values instead of ``D + Dv``. ``q`` and the
    new keys ``k`` are projected in the wider of their and the basis's dtypes and rounded to
    theirs (``k`` by a batched GEMM here, ``q`` by the 8-bit decode kernel itself where it reads
    8-bit pools with at most 16 query rows per kv head, else by a GEMM ahead), then
    :func:`flash_attn_with_kvcache` runs at query/key head dim R with the given or default
    full-D scale; positions, appending in place and the causal mask are its. No host
    synchronisation; no gradients (inference).

    On CUDA the split-KV decode kernel runs fp16/bf16 with ``R == Dv in {64, 128}`` and with
    ``R in {32, 64}``, ``Dv = 128``; other ``(R, Dv)`` run the prefill kernels on the cache (a
    paged cache gathered to a dense copy first). At R = 32, Dv = 128 the GPU time is 1.4-1.5x
    (16-bit pools) and 2.3x (8-bit pools) shorter than a full-width bf16 cache's (H200, CUDA
    graphs); with 16-bit pools a single call adds the projection GEMM's host work (docs/ops.md).

    Args:
        q: ``[B, Hq, Lq, D]``, contiguous last dim; query head ``h`` uses the basis of kv head
            ``h // (Hq // Hkv)``.
        k_cache: projected keys ``[B, Hkv, Lmax, R]``, or paged ``[num_pages, Hkv, page_size, R]``
            with ``block_table``; q's dtype.
        v_cache: values ``[B, Hkv, Lmax, Dv]`` or paged ``[num_pages, Hkv, page_size, Dv]``.
        basis: ``U [B, Hkv, D, R]``, float32 or q's dtype, ``1 <= R <= D``: one basis per
            (sequence, kv head), e.g. :func:`adaattn.rank_plan`'s on the prefill (its basis is
            per kv head already: the Gram matrix sums the group's query heads), or
            ``LowRankKVCache.basis[ids]``. The cached keys must have been projected with it.
        k: new keys ``[B, Hkv, Lq, D]`` at full width (projected here, then appended), and v:
            new values ``[B, Hkv, Lq, Dv]``; or both None.
        cache_seqlens, block_table, causal, return_lse, num_splits: as
            :func:`flash_attn_with_kvcache`.
        k_scale, v_scale: the scales of 8-bit (float8_e4m3fn) pools, as
            :func:`flash_attn_with_kvcache` takes them (``LowRankKVCache`` with
            ``dtype=torch.float8_e4m3fn`` keeps them); such pools take no new ``k``/``v`` here.
            On CUDA the decode kernel reads them as they are where
            :func:`flash_attn_with_kvcache`'s does (``R in {32, 64}`` with ``Dv = 128``, or
            ``R == Dv`` in {64, 128}).
        softmax_scale: multiplies ``(q U)(k U)^T``; defaults to ``D ** -0.5`` (full D, not R).

    Returns:
        ``out [B, Hq, Lq, Dv]`` (q's dtype), or ``(out, lse)`` with ``return_lse``.

    Raises:
        TypeError: a tensor argument that is not a tensor; basis neither float32 nor q's dtype;
            k not of q's dtype.
        ValueError: q or k_cache not 4-D, ``Hq % Hkv != 0``, basis not ``[B, Hkv, D, R]`` with
            ``1 <= R <= D``, ``k_cache.size(-1) != R``, k not ``[B, Hkv, Lq, D]``, k without v.
        RuntimeError: basis on another device.
        These messages start ``adaattn.low_rank_attn_with_kvcache:`` and name the argument; the
        remaining checks (cache dtypes and layout, v, cache_seqlens, block_table, flags) are
        :func:`flash_attn_with_kvcache`'s on the projected operands, with its prefix.
    """
    op = "low_rank_attn_with_kvcache"
    C.tensors(op, q=q, k_cache=k_cache, v_cache=v_cache, basis=basis, cache_seqlens=cache_seqlens)
    C.optional_tensors(op, k=k, v=v, block_table=block_table, k_scale=k_scale, v_scale=v_scale)
    _check_low_rank_cache_args(op, q, k_cache, basis, k, v)
    softmax_scale = C.optional_float(op, "softmax_scale", softmax_scale)
    causal = C.boolean(op, "causal", causal)
    return_lse = C.boolean(op, "return_lse", return_lse)
    num_splits = C.num_splits_value(op, num_splits)
    scale = q.shape[3] ** -0.5 if softmax_scale is None else softmax_scale
    k_proj = None
    if k is not None:
        # In the wider of k's and the basis's dtypes, as the op projects q (q_basis).
        dtype = torch.promote_types(basis.dtype, k.dtype)
        u = basis if basis.dtype == dtype else basis.to(dtype)
        k_proj = torch.matmul(k if k.dtype == dtype else k.to(dtype), u)
        k_proj = k_proj if dtype == k.dtype else k_proj.to(k.dtype)
    # The op itself (it checks the projected operands, its messages prefixed with its name):
    # the Python wrapper would repeat the argument checks above. It projects q (q U, in the
    # decode kernel where that reads the cache).
    out, lse = ops.flash_attn_with_kvcache.default(q, k_cache, v_cache, k_proj, v,
                                                   cache_seqlens, block_table, scale, causal, -1,
                                                   -1, 0.0, num_splits, k_scale, v_scale, None,
                                                   None, None, basis)
    return (out, lse) if return_lse else out
