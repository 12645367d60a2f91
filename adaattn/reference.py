"""Pure-PyTorch reference implementations (the ground truth for tests; O(L^2) memory)."""
from typing import Optional, Tuple

import torch


def flash_key_mask(len_q: int, len_k: int, *, causal: bool = False, window=(-1, -1),
                   seqlens: Optional[torch.Tensor] = None, batch: int = 1,
                   device=None) -> torch.Tensor:
    """Boolean ``[B, 1, Lq, Lk]`` mask, True where query row r may attend key c.

    Causal and window limits are relative to the bottom-right diagonal ``r + Lk - Lq``;
    with ``seqlens`` keys and rows at or past ``seqlens[b]`` are padding.
    """
    left, right = window
    if causal:
        right = 0
    rows = torch.arange(len_q, device=device).view(-1, 1)
    cols = torch.arange(len_k, device=device).view(1, -1)
    diag = rows + (len_k - len_q)
    mask = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= cols >= diag - left
    if right >= 0:
        mask &= cols <= diag + right
    mask = mask.view(1, 1, len_q, len_k).expand(batch, 1, len_q, len_k)
    if seqlens is not None:
        s = seqlens.to(device=device, dtype=torch.long).view(-1, 1, 1, 1)
        mask = mask & (cols.view(1, 1, 1, -1) < s) & (rows.view(1, 1, -1, 1) < s)
    return mask


def _softcap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` after scaling, before masking (docs/ops.md); 0: off."""
    return softcap * torch.tanh(scores / softcap) if softcap > 0 else scores


def _positional(scores: torch.Tensor, alibi_slopes: Optional[torch.Tensor],
                rel_bias: Optional[torch.Tensor]) -> torch.Tensor:
    """ALiBi and the relative-bias table on ``scores [B, Hq, Lq, Lk]`` (docs/ops.md; after softcap,
    before masking): ``- slope[b, h] |i - j| + rel_bias[h, i - j]`` (``0 <= i - j < W``), with
    ``i = r + Lk - Lq`` the query's bottom-right aligned position and ``j`` the key's."""
    if alibi_slopes is None and rel_bias is None:
        return scores
    len_q, len_k = scores.shape[-2:]
    dist = (torch.arange(len_q, device=scores.device).view(-1, 1) + (len_k - len_q)
            - torch.arange(len_k, device=scores.device).view(1, -1))
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(scores.dtype)
        slopes = slopes.view(1, -1, 1, 1) if slopes.dim() == 1 else slopes.view(
            slopes.shape[0], -1, 1, 1)
        scores = scores - slopes * dist.abs().to(scores.dtype)
    if rel_bias is not None:
        width = rel_bias.shape[1]
        inside = (dist >= 0) & (dist < width)
        table = rel_bias.to(scores.dtype)[:, dist.clamp(0, width - 1)]  # [Hq, Lq, Lk]
        scores = scores + torch.where(inside, table, torch.zeros_like(table))
    return scores


def _softmax_sinks(scores: torch.Tensor, mask: torch.Tensor,
                   sinks: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`_softmax` with attention sinks: ``sinks [Hq]`` joins every row's denominator as a
    key of value zero that is never masked (a row without keys gets ``lse = sinks[h]``)."""
    if sinks is None:
        return _softmax(scores, mask)
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    lse, probs = _softmax(torch.cat([scores, sink], dim=-1),
                          torch.cat([mask.expand(scores.shape), torch.ones_like(sink, dtype=torch.bool)],
                                    dim=-1))
    return lse, probs[..., :-1]


def _softmax(scores: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(lse, probs)`` of ``scores [..., Lk]`` over the keys where ``mask`` is True.

    A row that sees no key (or whose every visible score is ``-inf``) gives ``lse = -inf``, zero
    probabilities and zero gradients (logsumexp's own gradient there would be
    ``exp(-inf + inf) = NaN``). A NaN or ``+inf`` score leaves the row's softmax undefined: its
    lse and every visible probability are NaN (as SDPA's softmax gives), never a silent zero row.
    """
    scores = scores.masked_fill(~mask, float("-inf"))
    empty = (scores == float("-inf")).all(-1)
    lse = torch.logsumexp(scores.masked_fill(empty.unsqueeze(-1), 0.0), dim=-1)
    lse = lse.masked_fill(empty, float("-inf"))
    lse = torch.where(lse == float("inf"), float("nan"), lse)
    probs = torch.exp(scores - torch.where(lse == float("-inf"), 0.0, lse).unsqueeze(-1))
    return lse, probs.masked_fill(~mask, 0.0)


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
               softmax_scale: Optional[float] = None, window=(-1, -1),
               seqlens: Optional[torch.Tensor] = None,
               softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
               sinks: Optional[torch.Tensor] = None,
               rel_bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Materialised softmax attention. q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lk, D]``, v
    ``[B, Hkv, Lk, Dv]``; ``softcap > 0`` caps the scaled scores to ``(-softcap, softcap)``;
    ``alibi_slopes [Hq] | [B, Hq]``, ``rel_bias [Hq, W]`` and ``sinks [Hq]`` as in
    ``adaattn.flash_attn`` (differentiable in sinks and rel_bias).

    Returns ``(out [B, Hq, Lq, Dv], lse [B, Hq, Lq] float32)``; rows that see no key give
    ``out = 0``, ``lse = -inf`` and zero gradients. Computes in q's dtype.
    """
    batch, heads_q, len_q, dim = q.shape
    heads_kv, len_k = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    scale = dim ** -0.5 if softmax_scale is None else softmax_scale
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = _softcap(torch.matmul(q, k.transpose(-1, -2)) * scale, softcap)
    scores = _positional(scores, alibi_slopes, rel_bias)
    mask = flash_key_mask(len_q, len_k, causal=causal, window=window, seqlens=seqlens,
                          batch=batch, device=q.device)
    lse, probs = _softmax_sinks(scores, mask, sinks)
    out = torch.matmul(probs, v)
    return out, lse.float()


def low_rank_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, basis: torch.Tensor, *,
                  causal: bool = False,
                  softmax_scale: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention on projected scores ``s = scale * (q U)(k U)^T`` (docs/ops.md), v at full
    width. q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lk, D]``, v ``[B, Hkv, Lk, Dv]``, basis
    ``U [B, Hkv, D, R]`` (query head ``h`` uses its kv head's basis); ``scale`` defaults to
    ``D ** -0.5`` (of the full D).
    Returns ``(out [B, Hq, Lq, Dv], lse [B, Hq, Lq] float32)``; differentiable in every input."""
    group = q.shape[1] // k.shape[1]
    u = basis.to(q.dtype)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return flash_attn(q @ u.repeat_interleave(group, dim=1), k @ u, v, causal=causal,
                      softmax_scale=scale)


def block_sparse_key_mask(block_mask, len_q: int, len_k: int, *,
                          causal: bool = False) -> torch.Tensor:
    """Boolean ``[B|1, H|1, Lq, Lk]`` element mask of an ``adaattn.BlockSparseMask``: True where
    the element's block is listed and, with ``causal`` (or ``block_mask.causal``), key
    ``c <= r + Lk - Lq``."""
    bm, bn = block_mask.block_size
    layout = block_mask.to_dense()
    mask = layout.repeat_interleave(bm, dim=-2)[..., :len_q, :]
    mask = mask.repeat_interleave(bn, dim=-1)[..., :len_k]
    if causal or block_mask.causal:
        mask = mask & flash_key_mask(len_q, len_k, causal=True, device=mask.device)
    return mask


def block_sparse_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, *,
                      causal: bool = False, softmax_scale: Optional[float] = None,
                      softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                      sinks: Optional[torch.Tensor] = None,
                      rel_bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Materialised block-sparse attention: softmax attention under ``block_sparse_key_mask``
    (``softcap > 0``: on the capped scaled scores, as :func:`flash_attn`).

    q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]``, block_mask an ``adaattn.BlockSparseMask`` of
    ``ceil(Lq / BM) x ceil(Lk / BN)`` blocks. Returns ``(out [B, Hq, Lq, D], lse [B, Hq, Lq]
    float32)``; rows that see no key give ``out = 0``, ``lse = -inf`` and zero gradients.
    Computes in q's dtype.
    """
    heads_q, len_q, dim = q.shape[1:]
    heads_kv, len_k = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    scale = dim ** -0.5 if softmax_scale is None else softmax_scale
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = _positional(_softcap(torch.matmul(q, k.transpose(-1, -2)) * scale, softcap),
                         alibi_slopes, rel_bias)
    mask = block_sparse_key_mask(block_mask, len_q, len_k, causal=causal).to(q.device)
    lse, probs = _softmax_sinks(scores, mask, sinks)
    return torch.matmul(probs, v), lse.float()


def _lazy_parts(q, k, v, tau, bias, softmax_scale, seqlens):
    """Shared by lazy_attn and lazy_attn_backward: scores, mask, probabilities, weights."""
    batch, heads_q, len_q, dim = q.shape
    heads_kv, len_k = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    compute = torch.promote_types(q.dtype, torch.float32)
    scale = dim ** -0.5 if softmax_scale is None else softmax_scale
    qc = q.to(compute)
    kc = k.repeat_interleave(group, dim=1).to(compute)
    vc = v.repeat_interleave(group, dim=1).to(compute)
    pos = torch.arange(len_q, device=q.device).view(-1, 1) + (len_k - len_q)
    dist = pos - torch.arange(len_k, device=q.device).view(1, -1)  # i - j
    window = bias.shape[1]
    in_table = (dist >= 0) & (dist < window)
    bias_ij = bias.to(compute)[:, dist.clamp(0, window - 1)] * in_table  # [Hq, Lq, Lk]
    mask = flash_key_mask(len_q, len_k, causal=True, seqlens=seqlens, batch=batch,
                          device=q.device)
    scores = torch.matmul(qc, kc.transpose(-1, -2)) * scale + bias_ij
    lse, probs = _softmax(scores, mask)
    shift = (tau.to(compute).view(1, -1, 1, 1) / (pos + 1).to(compute).view(1, 1, -1, 1))
    return qc, kc, vc, scale, mask, lse, probs, shift, dist, in_table


def lazy_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tau: torch.Tensor,
              bias: torch.Tensor, *, softmax_scale: Optional[float] = None,
              seqlens: Optional[torch.Tensor] = None,
              upcast: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Lazy attention (docs/ops.md), materialised: causal, elastic softmax with learnable shift.

    q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]`` (``Lq <= Lk``; query row r has position
    ``i = r + Lk - Lq``), tau ``[Hq]``, bias ``[Hq, W]``. For keys ``j <= i``::

        s_ij = scale * q_i.k_j + (bias[h, i - j] if i - j < W else 0)
        a_ij = max(0, softmax_j(s_ij) + tau_h / (i + 1)),   o_i = sum_j a_ij v_j

    computed in at least fp32, without renormalisation. Returns ``(out, lse)``: out in q's dtype,
    lse float32 ``[B, Hq, Lq]`` of the scores (``-inf`` and ``out = 0`` for rows that see no key).

    ``upcast=False`` is the eager implementation a user would write in q's dtype (scores,
    softmax and ``A V`` rounded to it; only the elastic step in float32, as the spec requires):
    the same-dtype reference of the low-precision test rule (tests/accuracy.py).
    """
    if not upcast:
        return _lazy_attn_same_dtype(q, k, v, tau, bias, softmax_scale, seqlens)
    _, _, vc, _, mask, lse, probs, shift, _, _ = _lazy_parts(q, k, v, tau, bias, softmax_scale,
                                                           seqlens)
    weights = torch.clamp(probs + shift, min=0.0).masked_fill(~mask, 0.0)
    return torch.matmul(weights, vc).to(q.dtype), lse.float()


def _lazy_attn_same_dtype(q, k, v, tau, bias, softmax_scale, seqlens):
    dtype = q.dtype
    batch, heads_q, len_q, dim = q.shape
    heads_kv, len_k = k.shape[1], k.shape[2]
    scale = dim ** -0.5 if softmax_scale is None else softmax_scale
    k = k.repeat_interleave(heads_q // heads_kv, dim=1)
    v = v.repeat_interleave(heads_q // heads_kv, dim=1)
    pos = torch.arange(len_q, device=q.device).view(-1, 1) + (len_k - len_q)
    dist = pos - torch.arange(len_k, device=q.device).view(1, -1)
    window = bias.shape[1]
    bias_ij = bias[:, dist.clamp(0, window - 1)] * ((dist >= 0) & (dist < window))
    mask = flash_key_mask(len_q, len_k, causal=True, seqlens=seqlens, batch=batch,
                          device=q.device)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale + bias_ij.to(dtype)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1).masked_fill(~mask, 0.0)  # rows without keys: 0
    shift = tau.view(1, -1, 1, 1) / (pos + 1).to(torch.float32).view(1, 1, -1, 1)
    weights = torch.clamp(probs.float() + shift, min=0.0).masked_fill(~mask, 0.0).to(dtype)
    return torch.matmul(weights, v), lse.float()


def lazy_attn_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, tau: torch.Tensor, bias: torch.Tensor, *,
                       softmax_scale: Optional[float] = None,
                       seqlens: Optional[torch.Tensor] = None):
    """The closed-form gradients of lazy attention (docs/ops.md), materialised: what the fused
    kernels implement.

    With ``M_ij = [p_ij + tau_h/(i+1) > 0]``, ``dA = g v^T``, ``G_i = sum_j M_ij dA_ij`` and
    ``Delta_i = g_i.o_i - tau_h/(i+1) * G_i``: ``dS = p * (M dA - Delta)``,
    ``dq = scale dS k``, ``dk = scale dS^T q``, ``dv = A^T g``, ``dtau_h = sum G_i / (i+1)``,
    ``dbias[h, d] = sum_{i-j=d} dS_ij``. Returns ``(dq, dk, dv, dtau, dbias)`` in the compute
    dtype (dk/dv reduced over each GQA group; dtau/dbias in float32 or wider).
    """
    qc, kc, vc, scale, mask, _, probs, shift, dist, in_table = _lazy_parts(
        q, k, v, tau, bias, softmax_scale, seqlens)
    heads_kv = k.shape[1]
    group = q.shape[1] // heads_kv
    g = grad_out.to(qc.dtype)
    live = ((probs + shift) > 0) & mask
    weights = torch.where(live, probs + shift, torch.zeros_like(probs))
    out = torch.matmul(weights, vc)
    d_weights = torch.matmul(g, vc.transpose(-1, -2))
    row_g = (d_weights * live).sum(-1, keepdim=True)
    delta = (g * out).sum(-1, keepdim=True) - shift * row_g
    d_scores = probs * (d_weights * live - delta)
    dq = scale * torch.matmul(d_scores, kc)
    dk = scale * torch.matmul(d_scores.transpose(-1, -2), qc)
    dv = torch.matmul(weights.transpose(-1, -2), g)
    dk = dk.unflatten(1, (heads_kv, group)).sum(2)
    dv = dv.unflatten(1, (heads_kv, group)).sum(2)
    pos = shift.new_tensor(range(q.shape[2])).view(1, 1, -1, 1) + (k.shape[2] - q.shape[2])
    dtau = (row_g / (pos + 1)).sum(dim=(0, 2, 3))
    window = bias.shape[1]
    per_head = (d_scores * in_table).sum(0)  # [Hq, Lq, Lk]
    dbias = per_head.new_zeros(bias.shape[0], window)
    dbias.index_add_(1, dist.clamp(0, window - 1)[in_table].flatten(),
                     per_head[:, in_table].reshape(bias.shape[0], -1))
    return dq, dk, dv, dtau, dbias


_FEATURE_MAPS = {
    "elu": lambda x: torch.nn.functional.elu(x) + 1,
    "relu": torch.relu,
    "identity": lambda x: x,
}


def _packed_per_sequence(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, indexed=False):
    """Runs ``fn(q_n, k_n, v_n) -> (out_n [1, Hq, Lq_n, D], lse_n [1, Hq, Lq_n])`` on every packed
    sequence (``[T, H, D]`` slices moved to ``[1, H, L, D]``; ``indexed``: ``fn(q_n, k_n, v_n,
    n)``) and packs the results back: ``(out [Tq, Hq, D], lse [Hq, Tq])``."""
    bounds_q = cu_seqlens_q.tolist()
    bounds_k = cu_seqlens_k.tolist()
    outs, lses = [], []
    for n in range(len(bounds_q) - 1):
        sq = slice(bounds_q[n], bounds_q[n + 1])
        sk = slice(bounds_k[n], bounds_k[n + 1])
        args = (q[sq].transpose(0, 1).unsqueeze(0), k[sk].transpose(0, 1).unsqueeze(0),
                v[sk].transpose(0, 1).unsqueeze(0))
        out, lse = fn(*args, n) if indexed else fn(*args)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    if not outs:
        return q.new_zeros(q.shape), q.new_full((q.shape[1], q.shape[0]), float("-inf"),
                                                dtype=torch.float32)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def flash_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *,
                      causal: bool = False, softmax_scale: Optional[float] = None,
                      window=(-1, -1), softcap: float = 0.0,
                      alibi_slopes: Optional[torch.Tensor] = None,
                      sinks: Optional[torch.Tensor] = None,
                      rel_bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed flash attention as one :func:`flash_attn` call per sequence. q ``[Tq, Hq, D]``,
    k/v ``[Tk, Hkv, D]``, cu_seqlens int32 ``[N + 1]``; alibi_slopes ``[Hq]`` or ``[N, Hq]``.
    Returns ``(out [Tq, Hq, D], lse [Hq, Tq] float32)``."""
    def slopes(n):
        if alibi_slopes is None or alibi_slopes.dim() == 1:
            return alibi_slopes
        return alibi_slopes[n]

    return _packed_per_sequence(
        lambda qn, kn, vn, n: flash_attn(qn, kn, vn, causal=causal, softmax_scale=softmax_scale,
                                         window=window, softcap=softcap, alibi_slopes=slopes(n),
                                         sinks=sinks, rel_bias=rel_bias),
        q, k, v, cu_seqlens_q, cu_seqlens_k, indexed=True)


def lazy_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     tau: torch.Tensor, bias: torch.Tensor, *,
                     softmax_scale: Optional[float] = None,
                     upcast: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed lazy attention as one :func:`lazy_attn` call per sequence (positions restart at 0
    in every sequence). q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``, cu_seqlens int32 ``[N + 1]``.
    Returns ``(out [T, Hq, D], lse [Hq, T] float32)``."""
    return _packed_per_sequence(
        lambda qn, kn, vn: lazy_attn(qn, kn, vn, tau, bias, softmax_scale=softmax_scale,
                                     upcast=upcast),
        q, k, v, cu_seqlens, cu_seqlens)


def _page_table(k_cache: torch.Tensor, block_table: Optional[torch.Tensor]) -> torch.Tensor:
    """int64 ``[B, max_pages]`` page indices of a cache: a contiguous cache ``[B, Hkv, Lmax, D]``
    is read as B pages of Lmax slots, batch b owning page b."""
    if block_table is not None:
        return block_table.long()
    batch = k_cache.shape[0]
    return torch.arange(batch, device=k_cache.device).view(batch, 1)


def kvcache_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
                   v: Optional[torch.Tensor], cache_seqlens: torch.Tensor,
                   block_table: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches with ``k, v [B, Hkv, Lq, D]`` written at key positions
    ``cache_seqlens[b] + r`` (``r < Lq``) of each batch; the inputs are not modified.

    Caches are ``[B, Hkv, Lmax, D]`` (v: ``Dv``), or paged ``[num_pages, Hkv, page_size, D]`` with
    int32 ``block_table [B, max_pages]``: position j of batch b is slot ``j % page_size`` of page
    ``block_table[b, j // page_size]``. ``k = v = None`` returns plain copies. A position past
    the cache (or past ``max_pages`` pages) raises an index error.
    """
    k_new, v_new = k_cache.clone(), v_cache.clone()
    if k is None:
        return k_new, v_new
    page_size = k_cache.shape[2]
    pos = cache_seqlens.long().view(-1, 1) + torch.arange(k.shape[2], device=k_cache.device)
    pages = _page_table(k_cache, block_table).gather(1, pos // page_size)  # [B, Lq]
    slots = pos % page_size
    k_new[pages, :, slots] = k.transpose(1, 2).to(k_new.dtype)  # [B, Lq, Hkv, D] rows
    v_new[pages, :, slots] = v.transpose(1, 2).to(v_new.dtype)
    return k_new, v_new


def kvcache_gather(cache: torch.Tensor, block_table: Optional[torch.Tensor] = None
                   ) -> torch.Tensor:
    """A cache as dense ``[B, Hkv, L, D]`` keys (or values): itself when contiguous, else the
    pages of ``block_table [B, max_pages]`` in order, ``L = max_pages * page_size``."""
    if block_table is None:
        return cache
    pages = cache[block_table.long()]  # [B, max_pages, Hkv, page_size, D]
    return pages.transpose(1, 2).flatten(2, 3)


def _kvcache_per_batch(fn, q, k_cache, v_cache, k, v, cache_seqlens, block_table):
    """Appends ``k, v``, then runs ``fn(b, q_b [1, Hq, Lq, D], k_b [1, Hkv, L_b, D], v_b)`` on the
    ``L_b = cache_seqlens[b] (+ Lq when k is given)`` cached keys of every batch; returns
    ``(out [B, Hq, Lq, Dv], lse [B, Hq, Lq] float32)``."""
    k_full, v_full = kvcache_append(k_cache, v_cache, k, v, cache_seqlens, block_table)
    keys = kvcache_gather(k_full, block_table)
    values = kvcache_gather(v_full, block_table)
    new = 0 if k is None else q.shape[2]
    outs, lses = [], []
    for b, length in enumerate(cache_seqlens.tolist()):
        out, lse = fn(b, q[b:b + 1], keys[b:b + 1, :, :length + new],
                      values[b:b + 1, :, :length + new])
        outs.append(out)
        lses.append(lse)
    if not outs:
        return (q.new_zeros((*q.shape[:3], v_cache.shape[-1])),
                q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32))
    return torch.cat(outs), torch.cat(lses)


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                            *, cache_seqlens: torch.Tensor,
                            block_table: Optional[torch.Tensor] = None, causal: bool = True,
                            window=(-1, -1), softmax_scale: Optional[float] = None,
                            softcap: float = 0.0, return_lse: bool = False, num_splits: int = 0,
                            alibi_slopes: Optional[torch.Tensor] = None,
                            sinks: Optional[torch.Tensor] = None,
                            rel_bias: Optional[torch.Tensor] = None):
    """Decoding against a KV cache (flash-attn's ``flash_attn_with_kvcache`` in the
    ``[B, H, L, D]`` layout), as :func:`flash_attn` on each batch's cached keys; the inputs,
    caches included, are not modified (the updated caches are :func:`kvcache_append`'s).

    q ``[B, Hq, Lq, D]``; caches and ``block_table`` as in :func:`kvcache_append`;
    ``cache_seqlens`` int32 ``[B]``. With ``k, v [B, Hkv, Lq, D]`` the keys of batch b are
    positions ``[0, cache_seqlens[b] + Lq)`` after the append and query row r sits at position
    ``cache_seqlens[b] + r``; with ``k = v = None`` they are ``[0, cache_seqlens[b])`` and row r
    sits at ``cache_seqlens[b] - Lq + r`` (rows at negative positions see no key when causal).
    ``causal``/``window`` are relative to that position (bottom-right aligned), as are
    ``alibi_slopes`` (``[Hq]`` or ``[B, Hq]``), ``sinks`` and ``rel_bias`` (:func:`flash_attn`'s).
    ``num_splits`` only schedules the fused kernel; it is accepted here for the same signature.

    Returns ``out [B, Hq, Lq, Dv]`` (q's dtype; computed in it), and ``lse [B, Hq, Lq]`` float32
    when ``return_lse``.
    """
    del num_splits

    def attend(b, qb, kb, vb):
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b:b + 1]
        return flash_attn(qb, kb, vb, causal=causal, softmax_scale=softmax_scale, window=window,
                          softcap=softcap, alibi_slopes=slopes, sinks=sinks, rel_bias=rel_bias)

    out, lse = _kvcache_per_batch(attend, q, k_cache, v_cache, k, v, cache_seqlens, block_table)
    return (out, lse) if return_lse else out


def lazy_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                           tau: torch.Tensor, bias: torch.Tensor, *, cache_seqlens: torch.Tensor,
                           block_table: Optional[torch.Tensor] = None,
                           softmax_scale: Optional[float] = None, return_lse: bool = False,
                           num_splits: int = 0, upcast: bool = True):
    """Lazy attention of the new query rows against a KV cache, as :func:`lazy_attn` on each
    batch's cached keys: row r at absolute position ``i = cache_seqlens[b] + r`` (with k) or
    ``cache_seqlens[b] - Lq + r`` (k = v = None), the shift ``tau[h] / (i + 1)`` and bias
    ``bias[h, i - j]`` of that position. Shapes and positions as :func:`flash_attn_with_kvcache`
    (causal), tau float32 ``[Hq]``, bias float32 ``[Hq, W]``; ``upcast`` as in
    :func:`lazy_attn`. The inputs are not modified.

    Returns ``out [B, Hq, Lq, D]``, and ``lse [B, Hq, Lq]`` float32 when ``return_lse``.
    """
    del num_splits
    out, lse = _kvcache_per_batch(
        lambda b, qb, kb, vb: lazy_attn(qb, kb, vb, tau, bias, softmax_scale=softmax_scale,
                                     upcast=upcast),
        q, k_cache, v_cache, k, v, cache_seqlens, block_table)
    return (out, lse) if return_lse else out


def _linear_prepare(q, k, v, feature_map, normalize, initial_state):
    """phi(q), phi(k), [v | 1] and the initial state (zeros when absent) in q's dtype, for one
    dense batch ``[B, H, T, *]``."""
    if feature_map not in _FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {sorted(_FEATURE_MAPS)}, got {feature_map!r}")
    phi = _FEATURE_MAPS[feature_map]
    qf, kf = phi(q), phi(k)
    va = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1) if normalize else v
    batch, heads, _, dim = q.shape
    if initial_state is None:
        s0 = q.new_zeros(batch, heads, dim, va.shape[-1])
    else:
        s0 = initial_state.to(q.dtype)
    return qf, kf, va, s0


def _linear_output(u, normalize):
    """``u[..., :Dv] / u[..., Dv]`` (0 where the normaliser is 0), or ``u`` itself."""
    if not normalize:
        return u
    den = u[..., -1:]
    zero = den == 0
    inv = torch.where(zero, torch.zeros_like(den), 1 / torch.where(zero, torch.ones_like(den), den))
    return u[..., :-1] * inv


def _linear_state_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _linear_per_sequence(fn, q, k, v, cu_seqlens, initial_state, normalize):
    """Runs the dense ``fn`` on every sequence of a packed batch (``[T, H, *]``) and reassembles
    ``(out [T, H, Dv], state [N, H, D, E])``."""
    bounds = cu_seqlens.tolist()
    heads, dim, dim_v = q.shape[1], q.shape[2], v.shape[2]
    outs, states = [], []
    for n in range(len(bounds) - 1):
        a, b = bounds[n], bounds[n + 1]
        dense = [t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        s0 = None if initial_state is None else initial_state[n:n + 1]
        out, state = fn(*dense, s0)
        outs.append(out[0].transpose(0, 1))
        states.append(state)
    out = torch.cat(outs, dim=0) if outs else v.new_zeros(0, heads, dim_v)
    state = (torch.cat(states, dim=0) if states else
             q.new_zeros(0, heads, dim, dim_v + int(normalize), dtype=_linear_state_dtype(q)))
    return out, state


def linear_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, feature_map: str = "elu",
                causal: bool = True, normalize: bool = True,
                cu_seqlens: Optional[torch.Tensor] = None,
                initial_state: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Materialised (quadratic) linear attention, the ground truth of ``adaattn.linear_attn``.

    With ``phi`` the feature map, ``va = [v | 1]`` when ``normalize`` (else ``v``) and ``S0`` the
    initial state (zeros when absent)::

        u = (phi(q) phi(k)^T o M) va + phi(q) S0      (M: causal lower triangle incl. the
                                                       diagonal, or all ones)
        out = u[..., :Dv] / u[..., Dv]  (0 where that is 0)  if normalize, else u
        state = S0 + phi(k)^T va

    Args:
        q, k: ``[B, H, T, D]`` (packed: ``[T, H, D]`` with ``cu_seqlens``).
        v: ``[B, H, T, Dv]`` (packed: ``[T, H, Dv]``).
        feature_map: ``"elu"`` (elu + 1), ``"relu"`` or ``"identity"``.
        cu_seqlens: int32 ``[N + 1]`` sequence boundaries of packed inputs.
        initial_state: ``[B or N, H, D, Dv + normalize]`` (the last column is the normaliser
            ``z`` when ``normalize``).

    Returns:
        ``(out [B, H, T, Dv] | [T, H, Dv]`` in q's dtype, ``state [B or N, H, D, Dv + normalize]``
        float32, float64 for float64 inputs``)``. Computes in q's dtype.
    """
    def dense(q, k, v, s0):
        qf, kf, va, s0 = _linear_prepare(q, k, v, feature_map, normalize, s0)
        scores = torch.matmul(qf, kf.transpose(-1, -2))
        if causal:
            length = q.shape[2]
            mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~mask, 0)
        u = torch.matmul(scores, va) + torch.matmul(qf, s0)
        state = s0 + torch.matmul(kf.transpose(-1, -2), va)
        return _linear_output(u, normalize), state.to(_linear_state_dtype(q))

    if cu_seqlens is not None:
        return _linear_per_sequence(dense, q, k, v, cu_seqlens, initial_state, normalize)
    return dense(q, k, v, initial_state)


def linear_attn_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                          feature_map: str = "elu", causal: bool = True, normalize: bool = True,
                          cu_seqlens: Optional[torch.Tensor] = None,
                          initial_state: Optional[torch.Tensor] = None
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step-by-step linear attention (the RNN form), same arguments, shapes and results as
    :func:`linear_attn`: for t = 0, 1, ...: ``S += phi(k_t)^T va_t``, then ``u_t = phi(q_t) S``
    (causal). Non-causal: ``S`` is first summed over every step, then ``u_t = phi(q_t) S``.
    """
    def dense(q, k, v, s0):
        qf, kf, va, state = _linear_prepare(q, k, v, feature_map, normalize, s0)
        length = q.shape[2]
        if not causal:
            for t in range(length):
                state = state + kf[:, :, t, :, None] * va[:, :, t, None, :]
        rows = []
        for t in range(length):
            if causal:
                state = state + kf[:, :, t, :, None] * va[:, :, t, None, :]
            rows.append(torch.einsum("bhd,bhde->bhe", qf[:, :, t], state))
        u = torch.stack(rows, dim=2) if rows else va.new_zeros(va.shape)
        return _linear_output(u, normalize), state.to(_linear_state_dtype(q))

    if cu_seqlens is not None:
        return _linear_per_sequence(dense, q, k, v, cu_seqlens, initial_state, normalize)
    return dense(q, k, v, initial_state)
