"""The input classes of issue 32's accuracy bars, shared by tests/test_precision.py and
benchmarks/fp8_accuracy.py. Every tensor is bf16-representable (the kernel's inputs are bf16),
float32, ``[B, H, L, D]``, drawn on the CPU from a generator seeded with ``seed``.

* ``normal``: q, k, v ~ N(0, 1).
* ``peaky``: queries correlated with keys, as in trained models: query row ``i`` is
  ``a * k[j(i)] + N(0, 1)`` for a random visible key ``j(i)`` (``j <= i`` when causal), ``a``
  chosen so the matching score exceeds the others by ``ln(L) + 2`` (``a |k|^2 / sqrt(D)``),
  which gives the matching key most of the row's weight (about 0.8 when all L keys are
  visible).
* ``outlier``: ``peaky``, then 4 outlier channels of K scaled by 8 and a per-(head, channel)
  offset ~ N(0, 3^2) added to every key.
* ``sink``: an attention sink: N(0, 1) q, k, v, then every query gets a shared component
  ``sqrt(D) u`` (``u`` a random unit vector) and key 0 becomes ``(ln(L) + 2) u``, so key 0 scores
  ``ln(L) + 2`` above the rest and holds about 0.7 of every row's weight, the other keys
  sharing the rest thinly (each ~1e-4 or less of the row's largest probability); V gets per-(head,
  channel) offsets ~ N(0, 1) (as trained models' values have), so the thin tail adds up to a
  visible share of the output. No bar in the issue; it is where an 8-bit P with a fixed absolute
  step loses the tail.
* ``x4``: ``normal`` with q and k scaled by 4 (logits 16x: the heads ``"auto"`` must send to
  bf16).
"""
import math

import torch

CLASSES = ("normal", "peaky", "outlier", "sink", "x4")
# The bars vs float64: (max relative L2 error, min cosine similarity).
BARS = {"normal": (6e-2, 0.998), "peaky": (3e-2, 0.9995), "outlier": (3e-2, 0.9995)}
OUTLIER_CHANNELS = 4
OUTLIER_GAIN = 8.0
OFFSET_STD = 3.0


def _peaky_q(k0: torch.Tensor, causal: bool, generator: torch.Generator) -> torch.Tensor:
    b, h, length, dim = k0.shape
    rows = torch.arange(length)
    # Random visible key per row: uniform in [0, i] when causal, [0, L) otherwise.
    limit = (rows + 1) if causal else torch.full((length,), length)
    pick = (torch.rand(b, h, length, generator=generator) * limit).long().clamp(max=length - 1)
    target = torch.gather(k0, 2, pick.unsqueeze(-1).expand(-1, -1, -1, dim))
    margin = math.log(length) + 2.0
    gain = margin * math.sqrt(dim) / k0.square().sum(-1).mean().clamp(min=1e-6)
    return gain * target + torch.randn(b, h, length, dim, generator=generator)


def make_inputs(kind: str, b: int, h: int, length: int, dim: int, *, causal: bool = False,
                seed: int = 0):
    """``(q, k, v)`` of class ``kind`` (module docstring), float32 holding bf16 values."""
    gen = torch.Generator().manual_seed(seed)

    def randn():
        return torch.randn(b, h, length, dim, generator=gen)

    if kind in ("normal", "x4"):
        q, k = randn(), randn()
        if kind == "x4":
            q, k = 4 * q, 4 * k
    elif kind == "sink":
        q, k = randn(), randn()
        u = torch.randn(b, h, 1, dim, generator=gen)
        u = u / u.norm(dim=-1, keepdim=True)
        q = q + math.sqrt(dim) * u
        k[:, :, :1] = (math.log(length) + 2.0) * u
    elif kind in ("peaky", "outlier"):
        k = randn()
        q = _peaky_q(k, causal, gen)
        if kind == "outlier":
            channels = torch.randperm(dim, generator=gen)[:OUTLIER_CHANNELS]
            k[..., channels] *= OUTLIER_GAIN
            k = k + OFFSET_STD * torch.randn(b, h, 1, dim, generator=gen)
    else:
        raise ValueError(f"unknown input class {kind!r}")
    v = randn()
    if kind == "sink":
        v = v + torch.randn(b, h, 1, dim, generator=gen)
    return tuple(t.bfloat16().float() for t in (q, k, v))
