"""Low-precision (FP8 / INT8) attention: the quantisation scheme, its CPU/CUDA emulation and the
per-head error estimate that picks fp8 or bf16 (docs/ops.md).

The Hopper kernel computes ``softmax(scale * Q K^T) V`` from 8-bit operands. Everything here is
plain PyTorch (CPU or CUDA tensors) and pins down what that kernel computes, so tests can check
the scheme on CI and the kernel against :func:`fp8_attention_emulated`:

1. Pre-pass (one read of Q, K, V): optionally :func:`smooth_k` (subtract K's per-channel mean over
   the sequence; every score of a query row moves by the same ``q . mean``, so the softmax is
   unchanged) and :func:`hadamard_rotate` of Q and K (``(Q H)(K H)^T = Q K^T``; spreads outlier
   channels over all channels). Then :func:`quantize`: Q per 64-row block per (batch, head), K
   per 128-key block per (batch, kv head), V per channel (``[B, Hkv, Dv]`` scales over the whole
   sequence) or per 128-key block. 8-bit wgmma needs both operands K-major in shared memory, so
   the pre-pass writes V transposed (``[B, Hkv, Dv, Lk]``); the values and scales are those of
   :func:`quantize` on ``v``.
2. Main loop, per 128-key tile: ``S = (Qq Kq^T) * (sq * sk) * scale`` (fp32 accumulation; s32
   for int8 operands, exact), online softmax ``m_t = max(m_{t-1}, rowmax S)``, ``P = exp(S - m_t)``
   in fp32 (so ``0 <= P <= 1``), ``l`` accumulated from the fp32 ``P``; P is quantised with the
   fixed per-row scale ``p_scale`` (``Pq = round(P * p_scale)``, 448 for e4m3 uses its whole
   range) and ``acc = acc * exp(m_{t-1} - m_t) + Pq Vq``; finally
   ``out = acc * sv / (p_scale * l)``.

A scheme is a :class:`QuantScheme`; :data:`SCHEMES` names the measured ones and
:data:`DEFAULT_SCHEME` is the one the kernel implements (docs/lab/fp8-schemes.md has the
measurements behind the choice and behind :data:`FP8_TOL`).

Layout as the rest of adaattn: q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lk, D]``, v ``[B, Hkv, Lk, Dv]``,
``Hq % Hkv == 0`` (query head ``h`` reads kv head ``h // (Hq // Hkv)``); causal masks bottom-right
aligned. FP8 is for inference: nothing here is meant to be differentiated.
"""
import math
from typing import NamedTuple, Optional, Tuple, Union

import torch

from . import _checks as C

FORMATS = ("e4m3", "int8", "bf16")
# Largest magnitude each 8-bit format stores (e4m3fn has no infinity; casting past 448 gives
# NaN, so values are clamped first, as the kernel's satfinite conversion does).
_FORMAT_MAX = {"e4m3": 448.0, "int8": 127.0}
# The format P takes for each P/V format: int8 V pairs with unsigned 8-bit P (P >= 0; wgmma
# multiplies u8 by s8).
_P_FORMAT = {"e4m3": "e4m3", "int8": "u8", "bf16": "bf16"}
_P_MAX = {"e4m3": 448.0, "u8": 255.0, "bf16": math.inf}
# Mantissa bits of the float formats, for the error model of estimate_precision_error.
_MANTISSA_BITS = {"e4m3": 3, "bf16": 7}


class QuantScheme(NamedTuple):
    """How each operand of the attention is quantised.

    Attributes:
        qk: format of Q and K: ``"e4m3"`` (float8_e4m3fn), ``"int8"`` (symmetric, round to
            nearest even) or ``"bf16"``.
        pv: format of P and V: ``"e4m3"``, ``"bf16"`` or ``"int8"`` (V int8, P unsigned 8-bit
            with ``p_scale = 255``: ``u8 x s8 -> s32`` wgmma, converted to float32 per key
            tile).
        smooth_k: subtract K's per-channel mean over the sequence before quantising.
        hadamard: rotate Q and K by the normalised Hadamard matrix (:func:`hadamard_rotate`).
        v_granularity: ``"channel"`` (one scale per (batch, kv head, channel)) or ``"block"``
            (one per (batch, kv head, 128-key block)).
        p_scale: fixed per-row scale of P (``Pq = round(P * p_scale)``), at most the largest
            value of P's format (448 e4m3, 255 u8); 1 for bf16.
        block_q: rows of Q per scale and per kernel tile.
        block_k: keys of K (and V with ``"block"``) per scale, and the kernel's key tile over
            which P is quantised with one running row max.
    """

    qk: str = "e4m3"
    pv: str = "e4m3"
    smooth_k: bool = True
    hadamard: bool = False
    v_granularity: str = "channel"
    p_scale: float = 448.0
    block_q: int = 128
    block_k: int = 128


SCHEMES = {
    "bf16": QuantScheme(qk="bf16", pv="bf16", smooth_k=False, p_scale=1.0),
    "e4m3": QuantScheme(qk="e4m3", pv="e4m3", smooth_k=False),
    "e4m3-p1": QuantScheme(qk="e4m3", pv="e4m3", smooth_k=False, p_scale=1.0),
    "e4m3-vblock": QuantScheme(qk="e4m3", pv="e4m3", smooth_k=False, v_granularity="block"),
    "e4m3-smooth": QuantScheme(qk="e4m3", pv="e4m3", smooth_k=True),
    "e4m3-smooth-hadamard": QuantScheme(qk="e4m3", pv="e4m3", smooth_k=True, hadamard=True),
    "int8-e4m3": QuantScheme(qk="int8", pv="e4m3", smooth_k=True),
    # Q scales per 64 rows: one per warpgroup of the kernel (the lab table measured 128).
    "int8-e4m3-hadamard": QuantScheme(qk="int8", pv="e4m3", smooth_k=True, hadamard=True,
                                      block_q=64),
    "int8-int8-hadamard": QuantScheme(qk="int8", pv="int8", smooth_k=True, hadamard=True,
                                      p_scale=255.0),
    "int8-bf16": QuantScheme(qk="int8", pv="bf16", smooth_k=True, p_scale=1.0),
    "int8-bf16-hadamard": QuantScheme(qk="int8", pv="bf16", smooth_k=True, hadamard=True,
                                      p_scale=1.0),
}
"""The named schemes measured by benchmarks/fp8_accuracy.py."""

DEFAULT_SCHEME = "int8-e4m3-hadamard"
"""The scheme the Hopper kernel implements (docs/lab/fp8-schemes.md says why)."""

FP8_TOL = 0.06
"""Default ``fp8_tol`` of :func:`choose_precision`: the largest estimated relative L2 error
(vs float64) a head may have and still run fp8. It is the issue's bar for N(0, 1) inputs; the
default scheme's estimate stays under it on every unscaled input class measured (at most 0.060,
outlier channels at D = 64) and is 0.20-0.22 on heads with q, k scaled 4x
(docs/lab/fp8-schemes.md)."""


class Quantized(NamedTuple):
    """Result of :func:`quantize`.

    Attributes:
        data: the quantised values, same shape as the input ``[B, H, L, D]``, dtype
            ``float8_e4m3fn``, ``int8`` or ``bfloat16``.
        scales: float32, ``[B, H, ceil(L / block)]`` (``"block"``) or ``[B, H, D]``
            (``"channel"``); ``x ~= data * scale``.
        granularity: ``"block"`` or ``"channel"``.
        block: rows per scale (``"block"``).
    """

    data: torch.Tensor
    scales: torch.Tensor
    granularity: str
    block: int


def _rank4(op: str, name: str, x) -> torch.Tensor:
    C.tensor(op, name, x)
    if x.dim() != 4:
        C.fail(ValueError, op, name, " must be 4-D [B, H, L, D], got shape ",
               C._list(x.shape))
    if not x.is_floating_point():
        C.fail(TypeError, op, name, " must be floating, got ", C._dtype(x))
    return x


def _fmt(op: str, name: str, value, allowed) -> str:
    if value not in allowed:
        C.fail(ValueError, op, name, " must be one of ", ", ".join(map(repr, allowed)), ", got ",
               repr(value))
    return value


def _round(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` (a float32 temporary, already multiplied by the float32 reciprocal of its scale, as
    the kernel's pre-pass forms it; overwritten) rounded to ``fmt``, stored in ``fmt``."""
    if fmt == "e4m3":
        return x.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    if fmt == "int8":
        return x.round_().clamp_(-127.0, 127.0).to(torch.int8)
    if fmt == "u8":
        return x.round_().clamp_(0.0, 255.0).to(torch.uint8)
    return x.to(torch.bfloat16)


def _safe_scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """``amax / max(fmt)``; 1 where the block is all zeros (nothing to scale, avoids 0 / 0)."""
    if fmt == "bf16":
        return torch.ones_like(amax)
    scale = amax / _FORMAT_MAX[fmt]
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize(x: torch.Tensor, fmt: str = "e4m3", *, granularity: str = "block",
             block: int = 128) -> Quantized:
    """Symmetric scaled quantisation of ``x [B, H, L, D]``.

    Args:
        x: floating ``[B, H, L, D]`` (computed in float32).
        fmt: ``"e4m3"`` (scale = amax / 448, values clamped to +-448 and rounded to nearest even
            in float8_e4m3fn), ``"int8"`` (scale = amax / 127, round to nearest even, clamp to
            +-127) or ``"bf16"`` (scale 1, plain rounding).
        granularity: ``"block"``: one scale per (b, h, block of ``block`` rows along L) over all
            D (Q and K, and V per key block); ``"channel"``: one per (b, h, channel of D) over
            all L (V).
        block: rows per scale for ``"block"``; the last block may be partial.

    Returns:
        :class:`Quantized`; ``|dequantize(q) - x| <= scale / 2`` for int8 and
        ``<= max(|x| / 16, scale * 2**-10)`` for e4m3, element-wise (an all-zero block gets
        scale 1).

    Raises:
        TypeError: x not a floating tensor. ValueError: x not 4-D, an unknown fmt or
            granularity, block < 1. Messages start ``adaattn.quantize:``.
    """
    op = "quantize"
    _rank4(op, "x", x)
    _fmt(op, "fmt", fmt, FORMATS)
    _fmt(op, "granularity", granularity, ("block", "channel"))
    block = C.integer(op, "block", block)
    C.check(block >= 1, ValueError, op, "block must be >= 1, got ", block)
    xf = x.float()
    b, h, length, dim = xf.shape
    if granularity == "channel":
        scales = _safe_scale(xf.abs().amax(2) if length else xf.new_zeros(b, h, dim), fmt)
        return Quantized(_round(xf * scales.reciprocal().unsqueeze(2), fmt), scales, granularity,
                         block)
    nblocks = -(-length // block)
    padded = torch.nn.functional.pad(xf, (0, 0, 0, nblocks * block - length))
    amax = padded.view(b, h, nblocks, block * dim).abs().amax(-1) if nblocks else \
        xf.new_zeros(b, h, 0)
    scales = _safe_scale(amax, fmt)
    per_row = scales.reciprocal().repeat_interleave(block, dim=2)[:, :, :length].unsqueeze(-1)
    return Quantized(_round(xf * per_row, fmt), scales, granularity, block)


def dequantize(qx: Quantized) -> torch.Tensor:
    """float32 ``data * scale`` of a :class:`Quantized`, shape ``[B, H, L, D]``."""
    data = qx.data.float()
    if qx.granularity == "channel":
        return data * qx.scales.unsqueeze(2)
    per_row = qx.scales.repeat_interleave(qx.block, dim=2)[:, :, :data.shape[2]]
    return data * per_row.unsqueeze(-1)


def smooth_k(k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Subtracts K's per-channel mean over the sequence (SageAttention's K smoothing).

    Every score of query row ``i`` moves by the same ``q_i . mean``, so the softmax, masked or
    not, is unchanged; the quantised K no longer spends its range on a shared offset.

    Args:
        k: floating ``[B, Hkv, Lk, D]``.

    Returns:
        ``(k - mean, mean)``: float32 ``[B, Hkv, Lk, D]`` and ``[B, Hkv, D]`` (0 where
        ``Lk = 0``); float64 input stays float64.

    Raises:
        TypeError, ValueError: as :func:`quantize` (``adaattn.smooth_k:``, argument ``k``).
    """
    _rank4("smooth_k", "k", k)
    kf = k if k.dtype == torch.float64 else k.float()
    mean = kf.mean(2) if k.shape[2] else kf.new_zeros(k.shape[0], k.shape[1], k.shape[3])
    return kf - mean.unsqueeze(2), mean


_HADAMARD = {}


def hadamard_matrix(dim: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """The normalised (orthogonal, symmetric) Sylvester Hadamard matrix ``[dim, dim]``.

    Raises:
        ValueError: dim not a power of 2 (``adaattn.hadamard_matrix:``, argument ``dim``).
    """
    dim = C.integer("hadamard_matrix", "dim", dim)
    C.check(dim >= 1 and dim & (dim - 1) == 0, ValueError, "hadamard_matrix",
            "dim must be a power of 2, got ", dim)
    key = (dim, str(device), dtype)
    mat = _HADAMARD.get(key)
    if mat is None:
        mat = torch.ones(1, 1, dtype=torch.float64)
        while mat.shape[0] < dim:
            mat = torch.cat([torch.cat([mat, mat], 1), torch.cat([mat, -mat], 1)], 0)
        mat = (mat / math.sqrt(dim)).to(device=device, dtype=dtype)
        _HADAMARD[key] = mat
    return mat


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ R`` over the last dim with ``R`` block-diagonal, each block the
    :func:`hadamard_matrix` of the largest power of 2 dividing D (all of D when D is a power of
    2; D = 96: three blocks of 32; odd D: the identity). ``R`` is orthogonal, so
    ``rotate(q) @ rotate(k)^T == q @ k^T``; float32 (float64 stays float64).

    Args:
        x: floating ``[B, H, L, D]``.

    Raises:
        TypeError, ValueError: as :func:`quantize` (``adaattn.hadamard_rotate:``, argument
            ``x``).
    """
    _rank4("hadamard_rotate", "x", x)
    xf = x if x.dtype == torch.float64 else x.float()
    dim = x.shape[-1]
    if dim == 0:
        return xf
    block = dim & -dim
    # The fast Walsh-Hadamard butterfly over index bits 1, 2, 4, ... of each block, then the
    # norm: the kernel's pre-pass forms the same sums in the same order (so the int8 codes
    # agree), and it is O(D log D) per row instead of a D x D product.
    y = xf.reshape(-1, block)
    half = 1
    while half < block:
        pairs = y.view(-1, block // (2 * half), 2, half)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]),
                        dim=2).view(-1, block)
        half *= 2
    norm = torch.tensor(1.0 / math.sqrt(block), dtype=xf.dtype, device=xf.device)
    return (y * norm).view(xf.shape)


def _scheme(op: str, scheme) -> QuantScheme:
    if isinstance(scheme, QuantScheme):
        s = scheme
        _fmt(op, "scheme.qk", s.qk, FORMATS)
        _fmt(op, "scheme.pv", s.pv, FORMATS)
        _fmt(op, "scheme.v_granularity", s.v_granularity, ("channel", "block"))
        C.check(s.block_q >= 1 and s.block_k >= 1, ValueError, op,
                "scheme.block_q and scheme.block_k must be >= 1, got ", s.block_q, ", ", s.block_k)
        top = _P_MAX[_P_FORMAT[s.pv]]
        C.check(math.isfinite(s.p_scale) and 0 < s.p_scale <= top, ValueError, op,
                "scheme.p_scale must be finite, > 0 and <= ", top, " for pv=", repr(s.pv),
                ", got ", s.p_scale)
        return s
    if not isinstance(scheme, str):
        C.fail(TypeError, op, "scheme must be a str or QuantScheme, got ", C.type_name(scheme))
    if scheme not in SCHEMES:
        C.fail(ValueError, op, "scheme must be one of ", ", ".join(map(repr, SCHEMES)), ", got ",
               repr(scheme))
    return SCHEMES[scheme]


def _check_qkv(op: str, q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if v is None and name == "v":
            continue
        _rank4(op, name, t)
    b, hq, _, dim = q.shape
    for name, t in (("k", k), ("v", v)):
        if t is None:
            continue
        C.check(t.shape[0] == b, ValueError, op, name, " must have batch ", b, " (q's), got ",
                t.shape[0])
        C.check(t.shape[1] >= 1 and hq % t.shape[1] == 0, ValueError, op,
                "q's heads (", hq, ") must be a multiple of ", name, "'s heads (", t.shape[1], ")")
        C.check(t.device == q.device, RuntimeError, op, name, " must be on q's device ",
                q.device, ", got ", t.device)
    C.check(k.shape[3] == dim, ValueError, op, "k's head dim must be q's (", dim, "), got ",
            k.shape[3])
    if v is not None:
        C.check(v.shape[1] == k.shape[1] and v.shape[2] == k.shape[2], ValueError, op,
                "v must have k's heads and length ", C._list(k.shape[1:3]), ", got ",
                C._list(v.shape[1:3]))


def _prepare_qk(q, k, s: QuantScheme) -> Tuple[torch.Tensor, torch.Tensor]:
    """q, k (float32) after the scheme's smoothing and rotation."""
    qf = q.float()
    kf = smooth_k(k)[0] if s.smooth_k else k.float()
    if s.hadamard:
        qf, kf = hadamard_rotate(qf), hadamard_rotate(kf)
    return qf, kf


def _quantize_operands(q, k, v, s: QuantScheme):
    """The pre-pass: dequantised (float32) Q, K, V as the kernel's GEMMs see them."""
    qf, kf = _prepare_qk(q, k, s)
    qd = dequantize(quantize(qf, s.qk, block=s.block_q))
    kd = dequantize(quantize(kf, s.qk, block=s.block_k))
    vd = dequantize(quantize(v.float(), s.pv, granularity=s.v_granularity, block=s.block_k))
    return qd, kd, vd


def _tiled_attention(qd, kd, vd, causal: bool, scale: float, s: QuantScheme,
                     window: Tuple[int, int] = (-1, -1)) -> Tuple[torch.Tensor, torch.Tensor]:
    """The kernel's main loop on dequantised operands (float32), all key tiles at once.

    The running max after tile t is the cumulative max of the tile maxima, so P of tile t is
    ``exp(S - m_t)`` exactly as the kernel forms it before quantising; the kernel's rescaling
    ``acc * exp(m_{t-1} - m_t)`` telescopes to weighting tile t by ``exp(m_t - m_last)``, which
    is applied here before the PV product (equal up to float32 rounding order). Returns
    ``(out, lse)``: lse is the natural-log log-sum-exp of the scaled scores (``-inf``: no key).
    """
    group = qd.shape[1] // kd.shape[1]
    kd = kd.repeat_interleave(group, dim=1)
    vd = vd.repeat_interleave(group, dim=1)
    b, h, len_q, _ = qd.shape
    len_k = kd.shape[2]
    # In place where possible: the scores are the only L x L tensor, and the CPU emulation of
    # long sequences is bound by passes over it.
    scores = torch.matmul(qd, kd.transpose(-1, -2)).mul_(scale)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= 0 or right >= 0:
        rows = torch.arange(len_q, device=qd.device).view(-1, 1) + (len_k - len_q)
        keys = torch.arange(len_k, device=qd.device)
        hidden = torch.zeros(len_q, len_k, dtype=torch.bool, device=qd.device)
        if right >= 0:
            hidden |= keys > rows + right
        if left >= 0:
            hidden |= keys < rows - left
        scores.masked_fill_(hidden, -math.inf)
    tiles = -(-len_k // s.block_k)
    if tiles * s.block_k != len_k:
        scores = torch.nn.functional.pad(scores, (0, tiles * s.block_k - len_k), value=-math.inf)
    tiled = scores.view(b, h, len_q, tiles, s.block_k)
    running = torch.cummax(tiled.amax(-1), dim=-1).values  # [B, H, Lq, tiles]
    # A tile before the row's first visible key has m = -inf and P = 0.
    m = torch.where(running == -math.inf, torch.zeros_like(running), running)
    probs = tiled.sub_(m.unsqueeze(-1)).exp_()
    rescale = torch.exp(m - m[..., -1:])
    denom = (probs.sum(-1) * rescale).sum(-1, keepdim=True)
    pq = _round(probs.mul_(s.p_scale), _P_FORMAT[s.pv]).float()
    pq.mul_((rescale / s.p_scale).unsqueeze(-1))
    pq = pq.view(b, h, len_q, tiles * s.block_k)[..., :len_k]
    out = (pq @ vd) / denom
    m_last = m[..., -1] if tiles else torch.zeros_like(denom[..., 0])
    lse = torch.where(denom[..., 0] != 0, m_last + denom[..., 0].log(),
                      torch.full_like(denom[..., 0], -math.inf))
    # A row that sees no key gives 0 (as adaattn.flash_attn), not 0 / 0; a NaN row stays NaN.
    return torch.where(denom != 0, out, torch.zeros_like(out)), lse


def _nonfinite_heads(q, k, v) -> torch.Tensor:
    """bool ``[B, Hq]``: the query head's q, or its kv head's k or v, holds a NaN or Inf."""
    group = q.shape[1] // k.shape[1]
    bad_q = ~torch.isfinite(q).flatten(2).all(-1)
    bad_kv = ~(torch.isfinite(k).flatten(2).all(-1) & torch.isfinite(v).flatten(2).all(-1))
    return bad_q | bad_kv.repeat_interleave(group, dim=1)


def fp8_attention_emulated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                           causal: bool = False, scale: Optional[float] = None,
                           scheme: Union[str, QuantScheme] = DEFAULT_SCHEME,
                           window: Tuple[int, int] = (-1, -1),
                           head_fp8: Optional[torch.Tensor] = None, return_lse: bool = False,
                           chunk: int = 8):
    """Attention computed the way the FP8 kernel does, on CPU or CUDA: the pre-pass quantisation
    of Q, K, V, the per-tile quantisation of P, float32 everything else (module docstring).

    Args:
        q: floating ``[B, Hq, Lq, D]``.
        k: ``[B, Hkv, Lk, D]``, ``Hq % Hkv == 0``.
        v: ``[B, Hkv, Lk, Dv]``.
        causal: bottom-right aligned causal mask.
        scale: multiplies ``q @ k^T``; defaults to ``D ** -0.5``.
        scheme: a name in :data:`SCHEMES` or a :class:`QuantScheme`.
        window: ``(left, right)`` sliding window as :func:`adaattn.flash_attn`'s.
        head_fp8: bool ``[B, Hq]`` or None (every head): the heads to run on ``scheme``; the
            others run the ``"bf16"`` scheme.
        return_lse: also return the float32 lse ``[B, Hq, Lq]`` (natural log, ``-inf``: no key)
            and the bool ``[B, Hq]`` of the heads that ran ``scheme``.
        chunk: (batch x query head) pairs per step: the scores of a chunk are materialised
            (``chunk * Lq * Lk`` floats).

    Returns:
        float32 ``out [B, Hq, Lq, Dv]`` (rows that see no key: 0), or ``(out, lse, head_fp8)``
        with ``return_lse``. A head whose q, or whose kv head's k or v, holds a NaN or Inf runs
        the ``"bf16"`` scheme, so those values reach exactly the rows and entries they reach in
        :func:`adaattn.flash_attn`.

    Raises:
        TypeError: a non-tensor or non-floating q/k/v, scheme not a str or QuantScheme, a flag
            not a bool, head_fp8 not bool. ValueError: ranks, batch, heads, head dims, an
            unknown scheme name or format, a non-finite scale, a window entry < -1, head_fp8
            not ``[B, Hq]``. RuntimeError: tensors on different devices. Messages start
            ``adaattn.fp8_attention_emulated:`` and name the argument.
    """
    op = "fp8_attention_emulated"
    _check_qkv(op, q, k, v)
    causal = C.boolean(op, "causal", causal)
    return_lse = C.boolean(op, "return_lse", return_lse)
    s = _scheme(op, scheme)
    scale = _scale(op, scale, q)
    window = _window(op, window)
    chunk = C.integer(op, "chunk", chunk)
    C.check(chunk >= 1, ValueError, op, "chunk must be >= 1, got ", chunk)
    b, hq, len_q, _ = q.shape
    if head_fp8 is not None:
        C.tensor(op, "head_fp8", head_fp8)
        if head_fp8.dtype != torch.bool:
            C.fail(TypeError, op, "head_fp8 must be bool, got ", C._dtype(head_fp8))
        C.check(tuple(head_fp8.shape) == (b, hq), ValueError, op, "head_fp8 must have shape ",
                C._list((b, hq)), ", got ", C._list(head_fp8.shape))
    qd, kd, vd = _quantize_operands(q, k, v, s)
    # 8-bit operands cannot hold NaN/Inf and a non-finite value would set its block's scale: a
    # head that holds one runs the bf16 scheme (the kernel's pre-pass sees a non-finite block
    # amax and sends the head to bf16), so NaN/Inf reach exactly the rows flash_attn's reach.
    use_bf16 = _nonfinite_heads(q, k, v)
    if head_fp8 is not None:
        use_bf16 = use_bf16 | ~head_fp8.to(use_bf16.device)
    fallback = _quantize_operands(q, k, v, SCHEMES["bf16"]) if bool(use_bf16.any()) else None
    hkv = k.shape[1]
    group = hq // hkv
    out = qd.new_empty(b, hq, len_q, v.shape[3])
    lse = qd.new_empty(b, hq, len_q)
    # Chunks of whole kv-head groups so K/V are not expanded to Hq for the whole tensor.
    heads = max(1, chunk // group) * group
    for bi in range(b):
        for h0 in range(0, hq, heads):
            h1 = min(hq, h0 + heads)
            kv = slice(h0 // group, h1 // group)
            rows = (slice(bi, bi + 1), slice(h0, h1))
            out[rows], lse[rows] = _tiled_attention(
                qd[rows], kd[bi:bi + 1, kv], vd[bi:bi + 1, kv], causal, scale, s, window)
            bad = use_bf16[bi, h0:h1]
            if fallback is not None and bool(bad.any()):
                fq, fk, fv = fallback
                exact, exact_lse = _tiled_attention(fq[rows], fk[bi:bi + 1, kv], fv[bi:bi + 1, kv],
                                                    causal, scale, SCHEMES["bf16"], window)
                out[rows] = torch.where(bad.view(1, -1, 1, 1), exact, out[rows])
                lse[rows] = torch.where(bad.view(1, -1, 1), exact_lse, lse[rows])
    if return_lse:
        return out, lse, ~use_bf16
    return out


def _window(op: str, window) -> Tuple[int, int]:
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        C.fail(TypeError, op, "window must be a pair (left, right) of ints, got ", repr(window))
    left, right = (C.integer(op, "window", w) for w in window)
    C.check(left >= -1 and right >= -1, ValueError, op, "window entries must be >= -1, got ",
            C._list((left, right)))
    return left, right


def _scale(op: str, scale, q) -> float:
    scale = C.optional_float(op, "scale", scale)
    if scale is None:
        return q.shape[-1] ** -0.5 if q.shape[-1] else 1.0
    C.check(math.isfinite(scale), ValueError, op, "scale must be finite, got ", C._num(scale))
    return scale


def _relative_rounding_variance(fmt: str) -> float:
    """Mean of ``((r(x) - x) / x)^2`` for round-to-nearest with the format's mantissa bits and
    log-uniform mantissas: ``2^(-2m) / 12 * (3 / (8 ln 2))``."""
    return 4.0 ** -_MANTISSA_BITS[fmt] / 12.0 * (3.0 / (8.0 * math.log(2.0)))


def _estimable(op: str, s: QuantScheme) -> None:
    # The model's P term is a relative rounding error, which holds while P's scale keeps the
    # small probabilities in the format's range. u8 P's error is absolute and e4m3 P below the
    # full scale underflows: both depend on the size of each probability, i.e. on the scores.
    C.check(s.pv != "int8", ValueError, op,
            "scheme.pv='int8' has no estimate (P's unsigned 8-bit error depends on the scores)")
    C.check(s.pv != "e4m3" or s.p_scale == _P_MAX["e4m3"], ValueError, op,
            "scheme.p_scale must be 448 for an estimate with pv='e4m3' (below it, P's underflow "
            "depends on the scores), got ", s.p_scale)


def estimate_precision_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                             scale: Optional[float] = None,
                             scheme: Union[str, QuantScheme] = DEFAULT_SCHEME) -> torch.Tensor:
    """Cheap per-(batch, query head) estimate of the scheme's relative L2 output error vs
    float64, from statistics the quantising pre-pass can accumulate in the same read.

    Per channel ``c`` the pre-pass sums, over the sequence, the squared values of (smoothed,
    rotated) Q and the variance of K over the keys, and the squared quantisation errors
    ``(dequantize(quantize(x)) - x)^2`` of Q, K and V: ``O(L D)`` work, no scores. The model:
    a score ``s_ij`` is perturbed by ``scale * (dq_i . k_j + q_i . dk_j)``; a perturbation
    shared by a whole row cancels in the softmax, so K enters through its variance over the
    keys, and with independent errors the score noise has variance

        ``sigma_s^2 = scale^2 * sum_c (E[dq_c^2] Var[k_c] + E[q_c^2] E[dk_c^2])``.

    A score error ``d s_ij`` moves the output by ``sum_j p_ij d s_ij (v_j - o_i)``, of relative
    size about ``sigma_s`` when the values vary like noise around the output (the worst case:
    peaked softmax rows and values with a shared mean both give less). P and V add their
    relative rounding errors ``eps_p`` (the format's mean relative rounding error, P being
    quantised with a fixed scale into the format's normal range) and
    ``eps_v^2 = sum_c E[dv_c^2] / sum_c E[v_c^2]``:

        ``estimate = sqrt(sigma_s^2 + eps_p^2 + eps_v^2)``.

    It ignores the softmax's peakedness, so it overestimates heads with large, peaked logits
    (q, k scaled 4x: 3-4x their actual error; docs/lab/fp8-schemes.md) and tracks the
    error of unpeaked heads; overestimating only sends a head to bf16.

    Args:
        q: floating ``[B, Hq, Lq, D]``.
        k: ``[B, Hkv, Lk, D]``, ``Hq % Hkv == 0``.
        v: ``[B, Hkv, Lk, Dv]``.
        scale: as in :func:`fp8_attention_emulated`.
        scheme: a name in :data:`SCHEMES` or a :class:`QuantScheme`.

    Returns:
        float32 ``[B, Hq]``; NaN for a head whose q, k or v holds a NaN or Inf (it runs bf16).

    Raises:
        As :func:`fp8_attention_emulated` (``adaattn.estimate_precision_error:``), and
        ValueError for a scheme with ``pv="int8"``, or ``pv="e4m3"`` with ``p_scale != 448``
        (their P error depends on the scores).
    """
    op = "estimate_precision_error"
    _check_qkv(op, q, k, v)
    s = _scheme(op, scheme)
    _estimable(op, s)
    scale = _scale(op, scale, q)
    qf, kf = _prepare_qk(q, k, s)
    group = q.shape[1] // k.shape[1]
    qerr = dequantize(quantize(qf, s.qk, block=s.block_q)) - qf
    kerr = dequantize(quantize(kf, s.qk, block=s.block_k)) - kf
    vf = v.float()
    verr = dequantize(quantize(vf, s.pv, granularity=s.v_granularity, block=s.block_k)) - vf

    def mean_sq(x):  # [B, H, D]: per-channel mean square over the sequence (0 if empty)
        return x.square().mean(2) if x.shape[2] else x.new_zeros(x.shape[0], x.shape[1],
                                                                   x.shape[3])

    k_var = kf.var(2, correction=0) if k.shape[2] else mean_sq(kf)
    sigma_s2 = scale ** 2 * ((mean_sq(qerr) * k_var.repeat_interleave(group, 1)).sum(-1)
                             + (mean_sq(qf) * mean_sq(kerr).repeat_interleave(group, 1)).sum(-1))
    v_energy = mean_sq(vf).sum(-1)
    eps_v2 = torch.where(v_energy > 0, mean_sq(verr).sum(-1) / v_energy,
                         torch.zeros_like(v_energy)).repeat_interleave(group, 1)
    eps_p2 = _relative_rounding_variance(s.pv)
    err = (sigma_s2 + eps_p2 + eps_v2).sqrt()
    # No 8-bit error for a head holding NaN/Inf: it runs bf16 (fp8_attention_emulated).
    return err.masked_fill(_nonfinite_heads(q, k, v), math.nan)


def choose_precision(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                     fp8_tol: float = FP8_TOL, scale: Optional[float] = None,
                     scheme: Union[str, QuantScheme] = DEFAULT_SCHEME) -> torch.Tensor:
    """Per-(batch, query head) choice of ``precision="auto"``: fp8 where
    :func:`estimate_precision_error` is at most ``fp8_tol``, bf16 elsewhere.

    Args:
        q, k, v, scale, scheme: as in :func:`estimate_precision_error`.
        fp8_tol: largest estimated relative L2 error allowed for fp8 (default :data:`FP8_TOL`);
            finite and >= 0.

    Returns:
        bool ``[B, Hq]``: True = fp8, False = bf16.

    Raises:
        As :func:`estimate_precision_error`, and fp8_tol not a float, negative or not finite
        (``adaattn.choose_precision:``).
    """
    op = "choose_precision"
    tol = C.real(op, "fp8_tol", fp8_tol)
    C.check(math.isfinite(tol) and tol >= 0, ValueError, op,
            "fp8_tol must be finite and >= 0, got ", C._num(tol))
    _check_qkv(op, q, k, v)
    _estimable(op, _scheme(op, scheme))
    _scale(op, scale, q)
    return estimate_precision_error(q, k, v, scale=scale, scheme=scheme) <= tol


def low_precision_forward(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                          precision: str, fp8_tol: Optional[float], causal: bool,
                          scale: Optional[float], window: Tuple[int, int], seqlens=None,
                          softcap: float = 0, alibi_slopes=None, sinks=None, rel_bias=None):
    """:func:`adaattn.flash_attn`'s ``precision="fp8"`` / ``"auto"`` path (arguments already
    validated as flash_attn's): ``(out [B, Hq, Lq, Dv], lse [B, Hq, Lq], head_fp8 [B, Hq])``,
    head_fp8 the bool of the heads that ran 8-bit.

    Raises:
        ValueError: an option the 8-bit forward does not take, softmax_scale <= 0, fp8_tol
            without "auto" (or not finite and >= 0); CUDA head dims other than D = Dv in
            {64, 128} (from the op). TypeError: q not float16/bfloat16. RuntimeError: a
            gradient wanted (the 8-bit forward is for inference); CUDA without sm_90.
    """
    others = [name for name, value in (("seqlens", seqlens), ("alibi_slopes", alibi_slopes),
                                       ("sinks", sinks), ("rel_bias", rel_bias))
              if value is not None]
    if softcap:
        others.append("softcap")
    if others:
        C.fail(ValueError, op, "precision=", repr(precision), " does not take ",
               ", ".join(others), "; use precision='bf16' with them")
    if scale is not None and not scale > 0:
        C.fail(ValueError, op, "precision=", repr(precision), " needs softmax_scale > 0, got ",
               C._num(scale))
    if q.dtype not in (torch.float16, torch.bfloat16):
        C.fail(TypeError, op, "precision=", repr(precision),
               " takes float16 or bfloat16 q, k, v, got ", C._dtype(q))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        C.fail(RuntimeError, op, "precision=", repr(precision), " is forward-only (inference "
               "and prefill): call it under torch.no_grad() / torch.inference_mode(), or train "
               "with precision='bf16'")
    tol = None
    if precision == "auto":
        tol = FP8_TOL if fp8_tol is None else C.real(op, "fp8_tol", fp8_tol)
        C.check(math.isfinite(tol) and tol >= 0, ValueError, op,
                "fp8_tol must be finite and >= 0, got ", C._num(tol))
    elif fp8_tol is not None:
        C.fail(ValueError, op, "fp8_tol applies to precision='auto', got precision=",
               repr(precision))
    from ._ops import ops
    # "auto": the op estimates each head's error (estimate_precision_error's model) from
    # statistics its pre-pass gathers while quantising, so the choice costs no extra pass.
    return ops.flash_fwd_fp8(q, k, v, scale, causal, window[0], window[1], tol)
