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


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
               softmax_scale: Optional[float] = None, window=(-1, -1),
               seqlens: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Materialised softmax attention. q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]``.

    Returns ``(out [B, Hq, Lq, D], lse [B, Hq, Lq] float32)``; rows that see no key give
    ``out = 0``, ``lse = -inf`` and zero gradients. Computes in q's dtype.
    """
    batch, heads_q, len_q, dim = q.shape
    heads_kv, len_k = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    scale = dim ** -0.5 if softmax_scale is None else softmax_scale
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    mask = flash_key_mask(len_q, len_k, causal=causal, window=window, seqlens=seqlens,
                          batch=batch, device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    seen = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(seen, lse, torch.zeros_like(lse)).unsqueeze(-1))
    probs = probs.masked_fill(~mask, 0.0)
    out = torch.matmul(probs, v)
    return out, lse.float()


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
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    seen = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(seen, lse, torch.zeros_like(lse)).unsqueeze(-1))
    probs = probs.masked_fill(~mask, 0.0)
    shift = (tau.to(compute).view(1, -1, 1, 1) / (pos + 1).to(compute).view(1, 1, -1, 1))
    return qc, kc, vc, scale, mask, lse, probs, shift, dist, in_table


def lazy_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tau: torch.Tensor,
              bias: torch.Tensor, *, softmax_scale: Optional[float] = None,
              seqlens: Optional[torch.Tensor] = None,
              upcast: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Lazy attention (spec §3.2), materialised: causal, elastic softmax with learnable shift.

    q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]`` (``Lq <= Lk``; query row r has position
    ``i = r + Lk - Lq``), tau ``[Hq]``, bias ``[Hq, W]``. For keys ``j <= i``::

        s_ij = scale * q_i.k_j + (bias[h, i - j] if i - j < W else 0)
        a_ij = max(0, softmax_j(s_ij) + tau_h / (i + 1)),   o_i = sum_j a_ij v_j

    computed in at least fp32, without renormalisation. Returns ``(out, lse)``: out in q's dtype,
    lse float32 ``[B, Hq, Lq]`` of the scores (``-inf`` and ``out = 0`` for rows that see no key).

    ``upcast=False`` is the eager implementation a user would write in q's dtype (scores,
    softmax and ``A V`` rounded to it; only the elastic step in float32, as the spec requires):
    the same-dtype reference of the low-precision test rule (spec §4).
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
    """The closed-form gradients of spec §3.2 (what fused kernels implement), materialised.

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
