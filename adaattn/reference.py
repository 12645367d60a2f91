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
