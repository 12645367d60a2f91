"""``torch.nn`` modules built on the adaattn ops."""
from typing import Optional, Tuple

import torch
from torch import nn

from .flash import flash_attn


class FlashSelfAttention(nn.Module):
    """Multi-head self-attention (GQA-capable) with fused q/k/v projections and flash attention.

    Input ``x [B, L, E]``, output ``[B, L, E]``. Heads are viewed as ``(B, L, H, D)`` and passed
    transposed, so no copy is made for the attention call.

    Args:
        embed_dim: model width ``E``.
        num_heads: query heads ``Hq`` (``E % Hq == 0``, ``D = E // Hq``).
        num_kv_heads: key/value heads ``Hkv`` (defaults to ``Hq``; must divide ``Hq``).
        causal, window: as in :func:`adaattn.flash_attn`.
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: Optional[int] = None, *,
                 causal: bool = False, window: Tuple[int, int] = (-1, -1), bias: bool = False):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.causal = causal
        self.window = tuple(window)
        self.qkv = nn.Linear(embed_dim, (num_heads + 2 * num_kv_heads) * self.head_dim, bias=bias)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, x: torch.Tensor, seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x ``[B, L, E]`` (optional int32 ``seqlens [B]`` for right padding) -> ``[B, L, E]``."""
        batch, length, _ = x.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        q = q.view(batch, length, hq, d).transpose(1, 2)
        k = k.view(batch, length, hkv, d).transpose(1, 2)
        v = v.view(batch, length, hkv, d).transpose(1, 2)
        out = flash_attn(q, k, v, causal=self.causal, window=self.window, seqlens=seqlens)
        return self.proj(out.transpose(1, 2).reshape(batch, length, hq * d))
