"""Tests of KV-cache decoding: adaattn.flash_attn_with_kvcache, adaattn.lazy_attn_with_kvcache,
their references (adaattn.reference) and the paged adaattn.KVCache helper.

Semantics tested (flash-attn's ``flash_attn_with_kvcache``, in the ``[B, H, L, D]`` layout): with
new ``k, v [B, Hkv, Lq, D]`` the op first writes them in place at cache positions
``cache_seqlens[b] + r`` and then attends keys ``[0, cache_seqlens[b] + Lq)`` with query row r at
position ``cache_seqlens[b] + r``; with ``k = v = None`` it attends ``[0, cache_seqlens[b])`` with
row r at ``cache_seqlens[b] - Lq + r``. Causal masks and windows are relative to that position;
lazy attention uses it as its ``i``. ``cache_seqlens`` is not advanced. Paged caches are
``[num_pages, Hkv, page_size, D]``: position j of batch b is slot ``j % page_size`` of page
``block_table[b, j // page_size]``.

Every problem is built from a logical dense sequence (``k_seq [B, Hkv, Lmax, D]``) that is laid
out in shuffled pages for paged cases, so the checks against ``adaattn.flash_attn`` /
``adaattn.lazy_attn`` on the full sequence (the last Lq rows of a prefill must equal the decode
rows) do not go through the reference's own gather. The updated caches must equal
``reference.kvcache_append`` exactly: the new keys land in their slots and nothing else changes.

Bars (tests/accuracy.py): float64 on the CPU against the float64 reference at 1e-12 relative
(lse, float32 by design, at 1e-6); float32 at 1e-5; float16/bfloat16 ``err(ours) <= 2 *
err(reference in the same dtype) + 1e-5`` (the same-dtype lazy reference is ``upcast=False``).
Every test runs with NaN-poisoned allocations (conftest.py); CUDA cases skip at run time without
a GPU.
"""
import dataclasses
from typing import Optional, Tuple

import pytest
import torch

import adaattn
from adaattn import reference

from accuracy import FP32_RTOL, LOW_PRECISION, assert_low_precision_rule, assert_rel_close, randn

FP64_RTOL = 1e-12
LSE_RTOL = 1e-6  # lse is float32 whatever the inputs


@dataclasses.dataclass(frozen=True)
class Case:
    """One decode problem. ``seqlens`` are the cache lengths before the step (default: ragged,
    0 .. Lmax - Lq); ``page_size=None`` is a contiguous cache, else ``Lmax / page_size`` pages per
    sequence, shuffled over a pool with spare pages."""

    b: int = 3
    hq: int = 4
    hkv: int = 4
    lq: int = 1
    lmax: int = 64
    d: int = 32
    seqlens: Optional[Tuple[int, ...]] = None
    page_size: Optional[int] = None
    new_kv: bool = True
    causal: bool = True
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    scale: Optional[float] = None
    transposed: bool = False
    w: int = 16  # lazy bias window
    tau: float = -0.5
    num_splits: int = 0
    # Score variants of flash attention: ALiBi slopes per head ("head", [Hq]) or per sequence
    # and head ("batch", [B, Hq]); attention sinks; a relative-bias table of width rel_w.
    alibi: str = ""
    sinks: bool = False
    rel_w: int = 0

    def __post_init__(self):
        if self.seqlens is None:
            top = self.lmax - (self.lq if self.new_kv else 0)
            spread = [0, top] + [(top * (i + 1)) // self.b for i in range(self.b - 2)]
            object.__setattr__(self, "seqlens", tuple(spread[:self.b]))
        assert len(self.seqlens) == self.b

    def __str__(self):
        parts = [f"b{self.b}h{self.hq}x{self.hkv}", f"lq{self.lq}", f"lmax{self.lmax}",
                 f"d{self.d}", "seq" + "_".join(map(str, self.seqlens))]
        if self.page_size:
            parts.append(f"page{self.page_size}")
        if not self.new_kv:
            parts.append("nokv")
        if not self.causal:
            parts.append("noncausal")
        if self.window != (-1, -1):
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        if self.transposed:
            parts.append("T")
        if self.num_splits:
            parts.append(f"splits{self.num_splits}")
        if self.alibi:
            parts.append(f"alibi_{self.alibi}")
        if self.sinks:
            parts.append("sinks")
        if self.rel_w:
            parts.append(f"relbias{self.rel_w}")
        return "-".join(parts)

    def has_score_variant(self) -> bool:
        return bool(self.alibi) or self.sinks or bool(self.rel_w)


class Problem:
    """Inputs of a Case: ``q``, new ``k``/``v`` (or None), the caches as the op sees them
    (``k_cache``, ``v_cache``, ``block_table``), ``cache_seqlens``, lazy ``tau``/``bias``, and the
    logical sequences ``k_seq``/``v_seq [B, Hkv, Lmax, D]`` the caches hold."""

    def __init__(self, case: Case, dtype, device):
        c = self.case = case
        self.q = randn(c.b, c.hq, c.lq, c.d, dtype, device, c.transposed)
        self.k = self.v = None
        if c.new_kv:
            self.k = randn(c.b, c.hkv, c.lq, c.d, dtype, device, c.transposed)
            self.v = randn(c.b, c.hkv, c.lq, c.d, dtype, device, c.transposed)
        self.k_seq = randn(c.b, c.hkv, c.lmax, c.d, dtype, device, False)
        self.v_seq = randn(c.b, c.hkv, c.lmax, c.d, dtype, device, False)
        self.cache_seqlens = torch.tensor(c.seqlens, dtype=torch.int32, device=device)
        self.tau = (c.tau * (1 + 0.1 * torch.randn(c.hq, dtype=torch.float64))).float().to(device)
        self.bias = (0.5 * torch.randn(c.hq, c.w, dtype=torch.float64)).float().to(device)
        # ALiBi's geometric slopes (shuffled over heads; per sequence, scaled by 1 + b / 4), sinks
        # around the scores' own scale (a few rows' lse), and a table as lazy attention's bias.
        self.score_kwargs = {}
        if c.alibi:
            slopes = 2.0 ** (-8.0 * (torch.randperm(c.hq, dtype=torch.float64) + 1) / c.hq)
            if c.alibi == "batch":
                slopes = slopes * (1 + torch.arange(c.b, dtype=torch.float64).view(-1, 1) / 4)
            self.score_kwargs["alibi_slopes"] = slopes.float().to(device)
        if c.sinks:
            self.score_kwargs["sinks"] = (1.5 * torch.randn(c.hq, dtype=torch.float64)
                                          + 2.0).float().to(device)
        if c.rel_w:
            self.score_kwargs["rel_bias"] = (0.5 * torch.randn(c.hq, c.rel_w, dtype=torch.float64)
                                             ).float().to(device)
        if c.page_size is None:
            self.block_table = None
            self.k_cache = self._layout(self.k_seq)
            self.v_cache = self._layout(self.v_seq)
            return
        pages = c.lmax // c.page_size
        num_pages = c.b * pages + 3  # spare pages hold random keys no sequence owns
        perm = torch.randperm(num_pages)[:c.b * pages].view(c.b, pages)
        self.block_table = perm.to(device, torch.int32)
        self.k_cache = self._paged(self.k_seq, perm, num_pages)
        self.v_cache = self._paged(self.v_seq, perm, num_pages)

    def _layout(self, t):
        """flash-attn's ``(B, L, H, D)`` storage viewed as ``[B, H, L, D]`` when transposed."""
        return t.transpose(1, 2).contiguous().transpose(1, 2) if self.case.transposed else t

    def _paged(self, seq, perm, num_pages):
        c = self.case
        pool = randn(num_pages, c.hkv, c.page_size, c.d, seq.dtype, seq.device, c.transposed)
        chunks = seq.unflatten(2, (-1, c.page_size)).transpose(1, 2)  # [B, pages, Hkv, S, D]
        pool[perm.to(seq.device)] = chunks
        return pool

    def cast(self, dtype) -> "Problem":
        """A copy with q, k, v and the caches in ``dtype`` (indices, tau and bias unchanged)."""
        other = object.__new__(Problem)
        other.__dict__.update(self.__dict__)
        for name in ("q", "k", "v", "k_seq", "v_seq", "k_cache", "v_cache"):
            t = getattr(self, name)
            setattr(other, name, None if t is None else t.to(dtype))
        return other

    def kwargs(self, lazy):
        c = self.case
        kw = dict(cache_seqlens=self.cache_seqlens, block_table=self.block_table,
                  softmax_scale=c.scale, return_lse=True, num_splits=c.num_splits)
        if not lazy:
            kw.update(causal=c.causal, window=c.window, softcap=c.softcap, **self.score_kwargs)
        return kw

    def args(self, lazy, k_cache, v_cache):
        extra = (self.tau, self.bias) if lazy else ()
        return (self.q, k_cache, v_cache, self.k, self.v) + extra

    def run(self, lazy):
        """``(out, lse, k_cache, v_cache)`` of the op, on copies of the caches."""
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        op = adaattn.lazy_attn_with_kvcache if lazy else adaattn.flash_attn_with_kvcache
        out, lse = op(*self.args(lazy, k_cache, v_cache), **self.kwargs(lazy))
        c = self.case
        assert out.shape == (c.b, c.hq, c.lq, c.d) and out.dtype == self.q.dtype
        assert lse.shape == (c.b, c.hq, c.lq) and lse.dtype == torch.float32
        return out, lse, k_cache, v_cache

    def run_reference(self, lazy, upcast=True):
        """``(out, lse, k_cache, v_cache)`` of the reference (caches from kvcache_append)."""
        fn = reference.lazy_attn_with_kvcache if lazy else reference.flash_attn_with_kvcache
        kw = self.kwargs(lazy)
        if lazy:
            kw["upcast"] = upcast
        out, lse = fn(*self.args(lazy, self.k_cache, self.v_cache), **kw)
        return (out, lse) + self.appended()

    def appended(self):
        """The caches after the step: ``reference.kvcache_append`` of the new keys."""
        return reference.kvcache_append(self.k_cache, self.v_cache, self.k, self.v,
                                        self.cache_seqlens, self.block_table)

    def full_sequence(self, b):
        """Batch b's attended keys and values ``[1, Hkv, L_b, D]`` from the logical sequence."""
        length = self.case.seqlens[b]
        keys, values = self.k_seq[b:b + 1, :, :length], self.v_seq[b:b + 1, :, :length]
        if self.k is not None:
            keys = torch.cat([keys, self.k[b:b + 1]], dim=2)
            values = torch.cat([values, self.v[b:b + 1]], dim=2)
        return keys, values

    def prefill_rows(self, b, lazy):
        """``(out, lse)`` of batch b's query rows from adaattn.flash_attn / lazy_attn run on
        the whole sequence: the decode rows are appended to random earlier query rows (a
        prefill whose last Lq rows are this step's). Without enough keys for that (k = None,
        fewer cached keys than Lq) the rows are attended directly, bottom-right aligned."""
        c = self.case
        keys, values = self.full_sequence(b)
        q = self.q[b:b + 1]
        earlier = keys.shape[2] - c.lq
        if earlier > 0:
            prefix = torch.randn(1, c.hq, earlier, c.d, dtype=torch.float64).to(q)
            q = torch.cat([prefix, q], dim=2)
        if lazy:
            out, lse = adaattn.lazy_attn(q, keys, values, self.tau, self.bias,
                                         softmax_scale=c.scale, return_lse=True)
        else:
            out, lse = adaattn.flash_attn(q, keys, values, causal=c.causal, window=c.window,
                                          softmax_scale=c.scale, softcap=c.softcap,
                                          return_lse=True, **self.batch_score_kwargs(b))
        return out[:, :, -c.lq:], lse[:, :, -c.lq:]

    def batch_score_kwargs(self, b):
        """The score variants' arguments for sequence b alone (per-sequence slopes sliced)."""
        kw = dict(self.score_kwargs)
        slopes = kw.get("alibi_slopes")
        if slopes is not None and slopes.dim() == 2:
            kw["alibi_slopes"] = slopes[b:b + 1]
        return kw


def flash_only(case: Case) -> bool:
    """Options lazy attention does not have: windows, softcap, non-causal, score variants."""
    return (case.window != (-1, -1) or bool(case.softcap) or not case.causal
            or case.has_score_variant())


def with_variants(cases):
    """(case, lazy) pairs: flash for every case, lazy where the case's options allow it."""
    return [pytest.param(case, lazy, id=f"{case}-{'lazy' if lazy else 'flash'}")
            for case in cases for lazy in (False, True) if not (lazy and flash_only(case))]


def assert_caches_equal(ours, expected):
    for name, a, e in zip(("k_cache", "v_cache"), ours, expected):
        assert torch.equal(a, e), (f"{name}: differs from reference.kvcache_append (wrong slots "
                                   "written, or something else overwritten)")


# --------------------------------------------------------------------------------------------
# The references against the dense references on the full sequence (no op needed)
# --------------------------------------------------------------------------------------------

REFERENCE_CASES = [
    Case(lq=1, page_size=16),
    Case(hq=8, hkv=2, lq=3, lmax=48),
    Case(hq=8, hkv=1, lq=16, lmax=64, page_size=16, transposed=True),
    Case(b=2, lq=3, lmax=32, seqlens=(1, 32), new_kv=False),
    Case(lq=3, lmax=64, window=(5, 0), page_size=32),
    Case(lq=3, lmax=48, causal=False, window=(4, 2), softcap=1.0, scale=0.3),
    Case(hq=8, hkv=2, lq=3, lmax=48, page_size=16, alibi="batch", sinks=True, rel_w=5),
]


@pytest.mark.parametrize("case,lazy", with_variants(REFERENCE_CASES))
def test_reference_matches_full_sequence(case, lazy):
    p = Problem(case, torch.float64, "cpu")
    inputs = [t for t in (p.q, p.k, p.v, p.k_cache, p.v_cache) if t is not None]
    before = [t.clone() for t in inputs]
    out, lse, k_cache, v_cache = p.run_reference(lazy)
    for t, saved in zip(inputs, before):
        assert torch.equal(t, saved), "the reference modified an input"
    for b in range(case.b):
        keys, values = p.full_sequence(b)
        length = keys.shape[2]
        assert torch.equal(reference.kvcache_gather(k_cache, p.block_table)[b:b + 1, :, :length],
                           keys)
        assert torch.equal(reference.kvcache_gather(v_cache, p.block_table)[b:b + 1, :, :length],
                           values)
        q = p.q[b:b + 1]
        if length > case.lq:
            q = torch.cat([torch.randn(1, case.hq, length - case.lq, case.d,
                                       dtype=torch.float64), q], dim=2)
        if lazy:
            ref_out, ref_lse = reference.lazy_attn(q, keys, values, p.tau, p.bias,
                                                   softmax_scale=case.scale)
        else:
            ref_out, ref_lse = reference.flash_attn(q, keys, values, causal=case.causal,
                                                    window=case.window, softmax_scale=case.scale,
                                                    softcap=case.softcap,
                                                    **p.batch_score_kwargs(b))
        assert_rel_close("out", out[b:b + 1], ref_out[:, :, -case.lq:], FP64_RTOL)
        assert_rel_close("lse", lse[b:b + 1], ref_lse[:, :, -case.lq:], LSE_RTOL)
    # Outside the appended slots the caches are the inputs'.
    untouched_k, untouched_v = reference.kvcache_append(p.k_cache, p.v_cache, None, None,
                                                        p.cache_seqlens, p.block_table)
    assert torch.equal(untouched_k, p.k_cache) and torch.equal(untouched_v, p.v_cache)
    if p.k is not None:
        changed = (k_cache != p.k_cache).any(-1).sum().item()
        assert changed == case.b * case.hkv * case.lq, "slots other than the new ones changed"


def test_reference_append_past_the_cache_raises():
    p = Problem(Case(b=1, lq=3, lmax=16, seqlens=(14,), page_size=8), torch.float64, "cpu")
    with pytest.raises((IndexError, RuntimeError)):
        reference.kvcache_append(p.k_cache, p.v_cache, p.k, p.v, p.cache_seqlens, p.block_table)


# --------------------------------------------------------------------------------------------
# float64 on the CPU: the op against the reference, and against the full-sequence kernels
# --------------------------------------------------------------------------------------------

FP64_CASES = [
    # Lq in {1, 3, 16}, ragged lengths from 0 to Lmax - Lq, GQA 1/4/8, contiguous and paged.
    Case(lq=1, lmax=64),
    Case(hq=8, hkv=2, lq=3, lmax=80),
    Case(b=4, hq=8, hkv=1, lq=16, lmax=96),
    Case(lq=1, lmax=64, page_size=16),
    Case(hq=8, hkv=2, lq=3, lmax=128, page_size=64),
    Case(b=4, hq=8, hkv=1, lq=16, lmax=512, page_size=256, d=16),
    Case(b=2, hq=4, hkv=1, lq=16, lmax=256, page_size=16, seqlens=(240, 7)),
    # Window, non-causal, softcap, scale, transposed storage.
    Case(hq=8, hkv=2, lq=3, lmax=96, window=(8, 0), page_size=16),
    Case(lq=16, lmax=96, causal=False),
    Case(lq=3, lmax=96, causal=False, window=(10, 2)),
    Case(hq=8, hkv=2, lq=3, lmax=64, softcap=1.0, page_size=16),
    Case(b=2, lq=1, lmax=64, scale=0.3, transposed=True),
    Case(hq=8, hkv=4, lq=3, lmax=128, page_size=64, transposed=True),
    # k = v = None: the cache already holds the new tokens; rows before position 0 see no key.
    Case(lq=1, lmax=64, new_kv=False, seqlens=(0, 64, 33)),
    Case(hq=8, hkv=2, lq=3, lmax=64, new_kv=False, seqlens=(2, 64, 3), page_size=16),
    Case(lq=16, lmax=64, new_kv=False, seqlens=(16, 40, 64), window=(4, 0)),
    # ALiBi, sinks and a relative-bias table, alone and together (with softcap, windows,
    # non-causal rows, k = None).
    Case(hq=8, hkv=2, lq=1, lmax=64, alibi="head"),
    Case(b=4, hq=8, hkv=1, lq=16, lmax=96, page_size=16, alibi="batch", causal=False),
    Case(hq=8, hkv=2, lq=3, lmax=80, sinks=True),
    Case(lq=1, lmax=64, new_kv=False, seqlens=(0, 64, 33), sinks=True, page_size=16),
    Case(hq=8, hkv=2, lq=3, lmax=96, rel_w=7, window=(8, 0)),
    Case(hq=8, hkv=4, lq=3, lmax=128, page_size=64, softcap=1.0, alibi="head", sinks=True,
         rel_w=40, transposed=True),
]

# Lazy attention is causal and attends its bias to the absolute position; ``k = None`` cases keep
# every row at a position >= 0 (adaattn.lazy_attn takes no query before the first key).
LAZY_FP64_CASES = [
    Case(lq=1, lmax=64, w=8, tau=-1.0),
    Case(hq=8, hkv=2, lq=3, lmax=80, w=512, tau=0.5),
    Case(b=4, hq=8, hkv=1, lq=16, lmax=96, w=7, tau=-0.3),
    Case(lq=1, lmax=64, page_size=16, w=16, tau=-1.0),
    Case(hq=8, hkv=2, lq=3, lmax=128, page_size=64, w=40, tau=-0.2, transposed=True),
    Case(b=4, hq=8, hkv=1, lq=16, lmax=512, page_size=256, d=16, w=300, tau=-1.0),
    Case(b=2, hq=4, hkv=1, lq=16, lmax=256, page_size=16, seqlens=(240, 7), w=5, tau=0.2),
    Case(b=2, lq=1, lmax=64, scale=0.3, w=1, tau=-0.5),
    Case(hq=8, hkv=2, lq=3, lmax=64, new_kv=False, seqlens=(3, 64, 20), page_size=16, w=9),
]


def _check_fp64(case, lazy):
    p = Problem(case, torch.float64, "cpu")
    out, lse, k_cache, v_cache = p.run(lazy)
    ref = p.run_reference(lazy)
    assert_rel_close("out", out, ref[0], FP64_RTOL)
    assert_rel_close("lse", lse, ref[1], LSE_RTOL)
    assert_caches_equal((k_cache, v_cache), ref[2:])
    for b in range(case.b):
        full_out, full_lse = p.prefill_rows(b, lazy)
        assert_rel_close("out", out[b:b + 1], full_out, FP64_RTOL)
        assert_rel_close("lse", lse[b:b + 1], full_lse, LSE_RTOL)


@pytest.mark.parametrize("case", FP64_CASES, ids=str)
def test_flash_fp64_cpu(case):
    _check_fp64(case, lazy=False)


@pytest.mark.parametrize("case", LAZY_FP64_CASES, ids=str)
def test_lazy_fp64_cpu(case):
    _check_fp64(case, lazy=True)


@pytest.mark.parametrize("lazy", [False, True], ids=["flash", "lazy"])
def test_rows_without_keys(lazy):
    """k = None with fewer cached keys than query rows: the rows before position 0 (all of them
    for an empty cache) give out 0 and lse -inf, exactly, and the others the reference's."""
    p = Problem(Case(b=2, lq=3, lmax=16, new_kv=False, seqlens=(0, 1)), torch.float64, "cpu")
    out, lse, _, _ = p.run(lazy)
    empty = torch.tensor([[True, True, True], [True, True, False]])[:, None].expand_as(lse)
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[~empty]).all()
    ref = p.run_reference(lazy)
    assert_rel_close("out", out, ref[0], FP64_RTOL)
    assert_rel_close("lse", lse, ref[1], LSE_RTOL)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("lmax", [0, 128])
@pytest.mark.parametrize("device,dtype", [
    pytest.param("cpu", torch.float64, id="cpu-fp64"),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda, id="cuda-bf16"),
])
def test_rows_without_keys_take_the_sink(device, dtype, lmax, num_splits):
    """With sinks, a row that sees no key (before position 0, or an empty cache) has only its
    sink in the denominator: out 0 exactly and lse = sinks[h]; the sink joins the other rows'
    lse once, whether one CTA finishes the row or the split merge does."""
    case = Case(b=3, hq=8, hkv=2, lq=3, lmax=lmax, d=64, new_kv=False, sinks=True,
                seqlens=(0, 1, lmax) if lmax else (0, 0, 0), num_splits=num_splits)
    p = Problem(case, dtype, device)
    out, lse, _, _ = p.run(lazy=False)
    empty = torch.zeros_like(lse, dtype=torch.bool)
    empty[0] = True
    empty[1, :, :2] = True
    if not lmax:
        empty[:] = True
    sink = p.score_kwargs["sinks"].view(1, -1, 1).expand_as(lse)
    assert (out[empty.unsqueeze(-1).expand_as(out)] == 0).all()
    assert_rel_close("lse", lse[empty], sink[empty], LSE_RTOL)
    ref64 = p.cast(torch.float64).run_reference(lazy=False)
    if dtype == torch.float64:
        assert_rel_close("out", out, ref64[0], FP64_RTOL)
        assert_rel_close("lse", lse, ref64[1], LSE_RTOL)
    else:
        ref_low = p.run_reference(lazy=False)
        assert_low_precision_rule("out", out, ref_low[0], ref64[0])
        assert_low_precision_rule("lse", lse, ref_low[1], ref64[1])


@pytest.mark.parametrize("sink", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_sink_cpu(sink):
    """A NaN or +inf sink makes its head's rows NaN, as the reference's softmax does; a -inf sink
    is no sink. The other heads are untouched (float64, CPU)."""
    p = Problem(Case(hq=8, hkv=2, lq=3, lmax=64, sinks=True, alibi="head"), torch.float64, "cpu")
    p.score_kwargs["sinks"] = p.score_kwargs["sinks"].clone()
    p.score_kwargs["sinks"][3] = sink
    out, lse, _, _ = p.run(lazy=False)
    ref = p.run_reference(lazy=False)
    assert torch.equal(out.isnan(), ref[0].isnan()) and torch.equal(lse.isnan(), ref[1].isnan())
    assert out[:, 3].isnan().all() == (sink != float("-inf"))
    assert not out[:, :3].isnan().any() and not out[:, 4:].isnan().any()
    finite = ~ref[0].isnan()
    assert_rel_close("out", out[finite], ref[0][finite], FP64_RTOL)


# --------------------------------------------------------------------------------------------
# float32 (CPU and CUDA) and float16/bfloat16 (2x rule)
# --------------------------------------------------------------------------------------------

FP32_CASES = [
    Case(hq=8, hkv=2, lq=1, lmax=256, d=64, page_size=16),
    Case(b=2, hq=8, hkv=1, lq=16, lmax=320, d=128, page_size=64, seqlens=(304, 33)),
    Case(hq=4, hkv=4, lq=3, lmax=200, d=64, window=(32, 0), softcap=2.0, transposed=True),
    Case(hq=8, hkv=2, lq=1, lmax=256, d=64, page_size=16, alibi="batch", sinks=True, rel_w=20),
]


@pytest.mark.parametrize("case,lazy", with_variants(FP32_CASES))
def test_fp32(device, case, lazy):
    p = Problem(case, torch.float32, device)
    out, lse, k_cache, v_cache = p.run(lazy)
    ref = p.cast(torch.float64).run_reference(lazy)
    assert_rel_close("out", out, ref[0], FP32_RTOL)
    assert_rel_close("lse", lse, ref[1], FP32_RTOL)
    assert_caches_equal((k_cache, v_cache), p.appended())


def _check_low_precision(case, dtype, device, lazy):
    p = Problem(case, dtype, device)
    out, lse, k_cache, v_cache = p.run(lazy)
    ref64 = p.cast(torch.float64).run_reference(lazy)
    ref_low = p.run_reference(lazy, upcast=False)
    assert_low_precision_rule("out", out, ref_low[0], ref64[0])
    assert_low_precision_rule("lse", lse, ref_low[1], ref64[1])
    assert_caches_equal((k_cache, v_cache), ref_low[2:])


LOW_PRECISION_CPU_CASES = [
    Case(hq=8, hkv=2, lq=3, lmax=128, d=64, page_size=16),
    Case(b=2, hq=8, hkv=1, lq=16, lmax=96, d=32, transposed=True),
    Case(hq=8, hkv=2, lq=3, lmax=128, d=64, alibi="head", sinks=True, rel_w=9),
]


@pytest.mark.parametrize("lazy", [False, True], ids=["flash", "lazy"])
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("case", LOW_PRECISION_CPU_CASES, ids=str)
def test_low_precision_cpu(case, dtype, lazy):
    _check_low_precision(case, dtype, "cpu", lazy)


def _low_precision_cuda_grid():
    """Lq x page layout x D, with the GQA ratio rotating; then windows, softcap, k = None,
    transposed storage and forced split counts (the split-KV combine)."""
    heads = [(32, 8), (8, 8), (8, 1)]  # GQA 4, 1, 8
    cases = []
    for lq in (1, 3, 16):
        for page_size in (None, 16, 64, 256):
            for d in (64, 128):
                hq, hkv = heads[len(cases) % len(heads)]
                cases.append(Case(b=4, hq=hq, hkv=hkv, lq=lq, lmax=1024, d=d,
                                  page_size=page_size))
    cases += [
        Case(b=4, hq=8, hkv=2, lq=1, lmax=2048, d=128, window=(256, 0), page_size=64),
        Case(b=4, hq=8, hkv=2, lq=16, lmax=1024, d=128, window=(100, 0)),
        Case(b=3, hq=8, hkv=2, lq=3, lmax=512, d=64, causal=False, window=(64, 4)),
        Case(b=4, hq=8, hkv=2, lq=1, lmax=1024, d=128, softcap=5.0, page_size=16),
        Case(b=3, hq=8, hkv=1, lq=3, lmax=1024, d=128, new_kv=False, seqlens=(2, 1024, 517),
             page_size=64),
        Case(b=2, hq=32, hkv=8, lq=1, lmax=4096, d=128, transposed=True),
        Case(b=2, hq=32, hkv=8, lq=16, lmax=4096, d=128, page_size=64, transposed=True),
        Case(b=1, hq=32, hkv=8, lq=1, lmax=16384, d=128, seqlens=(16383,), page_size=256),
        Case(b=3, hq=8, hkv=2, lq=1, lmax=8192, d=128, num_splits=1),
        Case(b=3, hq=8, hkv=2, lq=3, lmax=8192, d=128, num_splits=7, page_size=64),
        # One split over 512 pages; pages whose size is not a power of two.
        Case(b=2, hq=8, hkv=2, lq=1, lmax=8192, d=128, num_splits=1, page_size=16),
        # One split with GQA 1 and 8, Lq = 3, D = 64, ragged lengths (lazy: its lse and weight
        # passes then run as one kernel).
        Case(b=3, hq=8, hkv=1, lq=1, lmax=2048, d=64, num_splits=1, page_size=64,
             seqlens=(0, 2047, 700)),
        Case(b=2, hq=16, hkv=4, lq=3, lmax=1000, d=128, num_splits=1, page_size=40,
             seqlens=(997, 0)),
        Case(b=4, hq=8, hkv=8, lq=1, lmax=4096, d=128, num_splits=1, page_size=256,
             new_kv=False, seqlens=(4096, 1, 3000, 64)),
        Case(b=2, hq=32, hkv=8, lq=1, lmax=4800, d=128, seqlens=(4799, 1000), page_size=48),
        Case(b=2, hq=8, hkv=2, lq=1, lmax=1000, d=96, seqlens=(999, 517)),
        # ALiBi, sinks and the relative-bias table: one and several splits, 16 and 64 rows per
        # kv head (the combine kernel adds a sink once), GQA 8 at D = 64 as gpt-oss, ragged.
        Case(b=4, hq=32, hkv=8, lq=1, lmax=2048, d=128, page_size=64, alibi="head"),
        Case(b=3, hq=8, hkv=2, lq=3, lmax=4096, d=128, alibi="batch", num_splits=5,
             seqlens=(4093, 0, 1500)),
        Case(b=3, hq=64, hkv=8, lq=1, lmax=2048, d=64, sinks=True, num_splits=1,
             seqlens=(0, 2047, 700), page_size=64),
        Case(b=3, hq=64, hkv=8, lq=1, lmax=8192, d=64, sinks=True, num_splits=6,
             seqlens=(0, 8191, 3000)),
        Case(b=2, hq=64, hkv=8, lq=1, lmax=4096, d=64, sinks=True, window=(128, 0),
             page_size=16),
        Case(b=2, hq=32, hkv=8, lq=16, lmax=2048, d=128, alibi="head", sinks=True, rel_w=64,
             page_size=64, num_splits=3),
        Case(b=2, hq=16, hkv=4, lq=3, lmax=1000, d=128, softcap=5.0, sinks=True, rel_w=300,
             num_splits=1),
        Case(b=2, hq=8, hkv=2, lq=1, lmax=1000, d=96, alibi="head", sinks=True,
             seqlens=(999, 517)),
        # D = 256 (Gemma): no decode kernel, the prefill kernels on the cache (lazy too)
        Case(b=2, hq=8, hkv=2, lq=1, lmax=1024, d=256, softcap=5.0, seqlens=(999, 517),
             page_size=64),
        Case(b=2, hq=16, hkv=8, lq=16, lmax=1024, d=256, window=(512, 0)),
        Case(b=2, hq=8, hkv=2, lq=3, lmax=1024, d=256, seqlens=(999, 517), page_size=64),
    ]
    return cases


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("case,lazy", with_variants(_low_precision_cuda_grid()))
def test_low_precision_cuda(case, lazy, dtype):
    _check_low_precision(case, dtype, "cuda", lazy)


@pytest.mark.cuda
@pytest.mark.parametrize("case,lazy", with_variants([
    Case(b=3, hq=32, hkv=8, lq=16, lmax=1024, d=128, page_size=64),
    Case(b=2, hq=16, hkv=2, lq=16, lmax=512, d=64, window=(100, 0)),
    Case(b=2, hq=16, hkv=4, lq=5, lmax=700, d=128, seqlens=(695, 0), softcap=3.0),
    Case(b=2, hq=16, hkv=4, lq=5, lmax=700, d=128, seqlens=(695, 0), alibi="batch", sinks=True,
         num_splits=2),
]))
def test_many_rows_without_sm90_cuda(case, lazy, monkeypatch):
    """More than 16 query rows per kv head run a wgmma kernel on Hopper GPUs;
    ADAATTN_DISABLE_SM90=1 selects the mma.sync kernel that other GPUs run."""
    monkeypatch.setenv("ADAATTN_DISABLE_SM90", "1")
    _check_low_precision(case, torch.bfloat16, "cuda", lazy)


def _poison_unused(p: Problem, cache: torch.Tensor) -> torch.Tensor:
    """A copy of ``cache`` with NaN in every slot past each sequence's last attended position
    and in every page no sequence owns."""
    c = p.case
    poisoned = cache.clone()
    for b, length in enumerate(c.seqlens):
        start = length + (c.lq if c.new_kv else 0)
        if p.block_table is None:
            poisoned[b, :, start:] = float("nan")
            continue
        for j in range(start, c.lmax):
            poisoned[p.block_table[b, j // c.page_size], :, j % c.page_size] = float("nan")
    if p.block_table is not None:
        spare = torch.ones(cache.shape[0], dtype=torch.bool)
        spare[p.block_table.flatten().long().cpu()] = False
        poisoned[spare.to(cache.device)] = float("nan")
    return poisoned


@pytest.mark.parametrize("page_size", [None, 64])
@pytest.mark.parametrize("lazy", [False, True], ids=["flash", "lazy"])
@pytest.mark.parametrize("device,dtype", [
    pytest.param("cpu", torch.float64, id="cpu-fp64"),
    pytest.param("cuda", torch.float64, marks=pytest.mark.cuda, id="cuda-fp64"),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda, id="cuda-bf16"),
])
def test_garbage_past_the_sequence_is_never_read(device, dtype, lazy, page_size):
    """Cache slots past each sequence (and pages no sequence owns) hold NaN, as freshly
    allocated or recycled pages may: the results must be those of a clean cache, bit for bit."""
    case = Case(b=3, hq=8, hkv=2, lq=3, lmax=256, d=64, page_size=page_size,
                seqlens=(0, 100, 253), w=32)
    p = Problem(case, dtype, device)
    clean = p.run(lazy)
    dirty = p.cast(dtype)
    dirty.k_cache, dirty.v_cache = _poison_unused(p, p.k_cache), _poison_unused(p, p.v_cache)
    assert torch.isnan(dirty.k_cache).any()
    out, lse, k_cache, v_cache = dirty.run(lazy)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert torch.equal(out, clean[0]) and torch.equal(lse, clean[1])
    for ours, expected in zip((k_cache, v_cache), dirty.appended()):
        assert torch.equal(ours.nan_to_num(7.0), expected.nan_to_num(7.0))


def test_empty_batch(device):
    p = Problem(Case(b=0, seqlens=()), torch.float32, device)
    for lazy in (False, True):
        out, lse, k_cache, _ = p.run(lazy)
        assert out.numel() == 0 and lse.numel() == 0 and torch.equal(k_cache, p.k_cache)


# --------------------------------------------------------------------------------------------
# Bad input (CPU): a clear error naming the argument
# --------------------------------------------------------------------------------------------

def _bad_call(kind):
    lazy = kind.startswith("lazy_")
    paged = "page" in kind or "block_table" in kind
    p = Problem(Case(b=2, hq=4, hkv=2, lq=3, lmax=32, d=16, page_size=8 if paged else None,
                     seqlens=(5, 29)), torch.float32, "cpu")
    q, k_cache, v_cache, k, v = p.q, p.k_cache, p.v_cache, p.k, p.v
    kw = dict(cache_seqlens=p.cache_seqlens, block_table=p.block_table)
    seqlens, table = p.cache_seqlens, p.block_table
    if kind in ("seqlens_past_cache", "seqlens_past_pages", "lazy_seqlens_past_cache"):
        kw["cache_seqlens"] = torch.tensor([5, 30], dtype=torch.int32)  # 30 + 3 > 32
    elif kind == "seqlens_past_cache_without_new_keys":
        k = v = None
        kw["cache_seqlens"] = torch.tensor([5, 33], dtype=torch.int32)
    elif kind == "seqlens_negative":
        kw["cache_seqlens"] = torch.tensor([-1, 5], dtype=torch.int32)
    elif kind == "seqlens_int64":
        kw["cache_seqlens"] = seqlens.long()
    elif kind == "seqlens_float":
        kw["cache_seqlens"] = seqlens.float()
    elif kind == "seqlens_shape":
        kw["cache_seqlens"] = torch.tensor([5, 5, 5], dtype=torch.int32)
    elif kind == "block_table_entry_past_pool":
        table = table.clone()
        table[1, 0] = k_cache.shape[0]
        kw["block_table"] = table
    elif kind == "block_table_entry_negative":
        table = table.clone()
        table[1, 2] = -1  # a page batch 1 uses (positions 16..23)
        kw["block_table"] = table
    elif kind == "block_table_int64":
        kw["block_table"] = table.long()
    elif kind == "block_table_rank":
        kw["block_table"] = table.flatten()
    elif kind == "block_table_batch":
        kw["block_table"] = torch.cat([table, table])
    elif kind == "page_pools_differ":
        v_cache = v_cache[:-1]
    elif kind == "k_cache_dtype":
        k_cache = k_cache.double()
    elif kind == "v_cache_dtype":
        v_cache = v_cache.double()
    elif kind == "k_dtype":
        k = k.double()
    elif kind == "k_cache_rank":
        k_cache = k_cache[0]
    elif kind == "k_cache_strided_last_dim":
        k_cache = torch.randn(2, 2, 32, 32)[..., ::2]
    elif kind == "v_cache_heads":
        v_cache = v_cache[:, :1]
    elif kind == "v_cache_length":
        v_cache = v_cache[:, :, :16]
    elif kind == "k_cache_batch":
        k_cache, v_cache = k_cache[:1], v_cache[:1]
    elif kind == "head_dim_mismatch":
        q = q[..., :8]
    elif kind == "heads_not_multiple":
        q = torch.randn(2, 3, 3, 16)
    elif kind == "k_without_v":
        v = None
    elif kind == "k_length":
        k, v = k[:, :, :2], v[:, :, :2]
    elif kind == "k_heads":
        k, v = k[:, :1], v[:, :1]
    elif kind == "window":
        kw["window"] = (-2, 0)
    elif kind == "lazy_tau_shape":
        p.tau = p.tau[:2]
    elif kind == "lazy_bias_dtype":
        p.bias = p.bias.double()
    else:
        raise AssertionError(kind)
    if lazy:
        return adaattn.lazy_attn_with_kvcache(q, k_cache, v_cache, k, v, p.tau, p.bias, **kw)
    return adaattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)


# kind -> (exception, regex the message must match: it names the argument and what was
# expected). Messages start "adaattn.flash_attn_with_kvcache: " (lazy_* kinds:
# "adaattn.lazy_attn_with_kvcache: ").
BAD_INPUTS = {
    "seqlens_past_cache": (ValueError, r"cache_seqlens"),
    "seqlens_past_pages": (ValueError, r"cache_seqlens"),
    "lazy_seqlens_past_cache": (ValueError, r"cache_seqlens"),
    "seqlens_past_cache_without_new_keys": (ValueError, r"cache_seqlens"),
    "seqlens_negative": (ValueError, r"cache_seqlens"),
    "seqlens_int64": (TypeError, r"cache_seqlens.*int32"),
    "seqlens_float": (TypeError, r"cache_seqlens.*int32"),
    "seqlens_shape": (ValueError, r"cache_seqlens"),
    "block_table_entry_past_pool": (ValueError, r"block_table"),
    "block_table_entry_negative": (ValueError, r"block_table"),
    "block_table_int64": (TypeError, r"block_table.*int32"),
    "block_table_rank": (ValueError, r"block_table"),
    "block_table_batch": (ValueError, r"block_table"),
    "page_pools_differ": (ValueError, r"v_cache"),
    "k_cache_dtype": (TypeError, r"k_cache"),
    "v_cache_dtype": (TypeError, r"v_cache"),
    "k_dtype": (TypeError, r"\bk\b"),
    "k_cache_rank": (ValueError, r"k_cache"),
    "k_cache_strided_last_dim": (ValueError, r"k_cache.*contiguous"),
    "v_cache_heads": (ValueError, r"v_cache"),
    "v_cache_length": (ValueError, r"v_cache"),
    "k_cache_batch": (ValueError, r"k_cache|batch"),
    "head_dim_mismatch": (ValueError, r"head dim"),
    "heads_not_multiple": (ValueError, r"heads.*multiple|multiple.*heads"),
    "k_without_v": (ValueError, r"\bv\b"),
    "k_length": (ValueError, r"\bk\b"),
    "k_heads": (ValueError, r"\bk\b"),
    "window": (ValueError, r"window"),
    "lazy_tau_shape": (ValueError, r"\btau\b"),
    "lazy_bias_dtype": (TypeError, r"\bbias\b"),
}


@pytest.mark.parametrize("kind", list(BAD_INPUTS))
def test_bad_input(kind):
    error, message = BAD_INPUTS[kind]
    op = "lazy_attn_with_kvcache" if kind.startswith("lazy") else "flash_attn_with_kvcache"
    with pytest.raises(error, match=rf"^adaattn\.{op}: .*(" + message + ")"):
        _bad_call(kind)


# --------------------------------------------------------------------------------------------
# Registration: opcheck, torch.compile of a decode step (CPU)
# --------------------------------------------------------------------------------------------

OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
OPCHECK_CASES = [
    Case(b=2, hq=4, hkv=2, lq=3, lmax=64, d=32, page_size=16, seqlens=(5, 61)),
    Case(b=2, hq=4, hkv=4, lq=1, lmax=48, d=32, seqlens=(0, 30), window=(8, 0), softcap=2.0,
         scale=0.2, transposed=True),
    Case(b=2, hq=4, hkv=1, lq=3, lmax=48, d=32, seqlens=(3, 48), new_kv=False, page_size=16),
    Case(b=2, hq=4, hkv=2, lq=3, lmax=64, d=32, page_size=16, seqlens=(5, 61), alibi="batch",
         sinks=True, rel_w=6),
]


@pytest.mark.parametrize("lazy", [False, True], ids=["flash", "lazy"])
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck(case, lazy):
    """The schemas declare the in-place cache writes; fake kernels and AOT dispatch agree with
    the CPU kernel. No autograd test: the ops are inference-only."""
    p = Problem(case, torch.float32, "cpu")
    if lazy:
        op = torch.ops.adaattn.lazy_attn_with_kvcache.default
        args = (p.q, p.k_cache, p.v_cache, p.k, p.v, p.tau, p.bias, p.cache_seqlens,
                p.block_table, case.scale, case.num_splits)
    else:
        op = torch.ops.adaattn.flash_attn_with_kvcache.default
        args = (p.q, p.k_cache, p.v_cache, p.k, p.v, p.cache_seqlens, p.block_table, case.scale,
                case.causal, case.window[0], case.window[1], case.softcap, case.num_splits)
        if case.has_score_variant():
            sc = p.score_kwargs
            args += (None, None, sc.get("alibi_slopes"), sc.get("sinks"), sc.get("rel_bias"))
    torch.library.opcheck(op, args, test_utils=OPCHECK_UTILS)


class DecodeStep(torch.nn.Module):
    """One attention layer's decode step: projections of the new tokens ``x [B, Lq, E]``, the
    cached attention (writing the new keys into the paged cache), the output projection."""

    def __init__(self, lazy, dim=128, heads=4, kv_heads=2, window=16):
        super().__init__()
        self.lazy = lazy
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q_proj = torch.nn.Linear(dim, dim)
        self.kv_proj = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o_proj = torch.nn.Linear(dim, dim)
        self.tau = torch.nn.Parameter(torch.full((heads,), -0.5))
        self.bias = torch.nn.Parameter(0.5 * torch.randn(heads, window))

    def forward(self, x, k_cache, v_cache, cache_seqlens, block_table):
        b, length, _ = x.shape
        q = self.q_proj(x).view(b, length, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(x).view(b, length, 2, self.kv_heads, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.lazy:
            out = adaattn.lazy_attn_with_kvcache(q, k_cache, v_cache, k, v, self.tau, self.bias,
                                                 cache_seqlens=cache_seqlens,
                                                 block_table=block_table)
        else:
            out = adaattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                                  cache_seqlens=cache_seqlens,
                                                  block_table=block_table)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))


@pytest.mark.parametrize("lq", [1, 3])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("lazy", [False, True], ids=["flash", "lazy"])
def test_torch_compile_fullgraph_decode_step(lazy, backend, lq):
    """Compiled (fullgraph) and eager steps give the same output and leave the same caches;
    a second step with other lengths reuses the graph or recompiles, never breaks it."""
    torch._dynamo.reset()
    model = DecodeStep(lazy)
    p = Problem(Case(b=2, hq=4, hkv=2, lq=lq, lmax=64, d=32, page_size=16, seqlens=(7, 40)),
                torch.float32, "cpu")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for seqlens in ((7, 40), (0, 61 - lq)):
        x = torch.randn(2, lq, 128)
        cache_seqlens = torch.tensor(seqlens, dtype=torch.int32)
        results = []
        for fn in (model, compiled):
            k_cache, v_cache = p.k_cache.clone(), p.v_cache.clone()
            with torch.no_grad():
                out = fn(x, k_cache, v_cache, cache_seqlens, p.block_table)
            results.append((out, k_cache, v_cache))
        (out_e, k_e, v_e), (out_c, k_c, v_c) = results
        assert torch.isfinite(out_c).all()
        torch.testing.assert_close(out_c, out_e)
        assert torch.equal(k_c, k_e) and torch.equal(v_c, v_e)
        assert not torch.equal(k_c, p.k_cache), "the compiled step did not write the cache"


@pytest.mark.cuda
@pytest.mark.parametrize("lq", [1, 16])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged64"])
@pytest.mark.parametrize("num_splits", [0, 5])
@pytest.mark.parametrize("lazy", [False, True], ids=["flash", "lazy"])
def test_cuda_graph_decode_steps(lazy, num_splits, paged, lq):
    """Four decode steps captured in one CUDA graph (each appends Lq tokens at ``cache_seqlens``,
    attends, then advances ``cache_seqlens`` in place) give the eager steps' outputs and caches
    bit for bit, and the eager steps meet the 2x rule against the references run step by step:
    every step's kernels read the rows it appended (new keys at 3x the cache's scale, so a stale
    slot shows) and what the steps before it wrote. Lq = 1: the decode kernel writes the rows;
    Lq = 16: append_kernel does, ahead of it."""
    b, hq, hkv, d, lmax, steps, page = 2, 8, 2, 128, 1024, 4, 64
    dev, dt = "cuda", torch.bfloat16

    def draw(*shape):
        return torch.randn(*shape, dtype=torch.float64).to(dev, dt)

    k_seq, v_seq = draw(b, hkv, lmax, d), draw(b, hkv, lmax, d)
    block_table = None
    k0, v0 = k_seq, v_seq
    if paged:
        pages = lmax // page
        perm = torch.randperm(b * pages, device=dev)
        block_table = perm.view(b, pages).to(torch.int32)
        k0, v0 = (x.unflatten(2, (pages, page)).transpose(1, 2).flatten(0, 1)[perm.argsort()]
                  for x in (k_seq, v_seq))
    q = draw(steps, b, hq, lq, d)
    k_new, v_new = 3 * draw(steps, b, hkv, lq, d), draw(steps, b, hkv, lq, d)
    tau = torch.full((hq,), -0.5, device=dev)
    bias = 0.1 * torch.randn(hq, 16, device=dev)
    start = torch.tensor([300, 777], dtype=torch.int32, device=dev)

    def run_steps(module, k_cache, v_cache, seqlens, outs, **kw):
        fn = module.lazy_attn_with_kvcache if lazy else module.flash_attn_with_kvcache
        extra = (tau, bias) if lazy else ()
        for s in range(steps):
            qs, ks, vs = (x[s].to(k_cache.dtype) for x in (q, k_new, v_new))
            out = fn(qs, k_cache, v_cache, ks, vs, *extra, cache_seqlens=seqlens,
                     block_table=block_table, **kw)
            if module is reference:
                k_cache, v_cache = reference.kvcache_append(k_cache, v_cache, ks, vs, seqlens,
                                                            block_table)
                seqlens = seqlens + lq
            else:
                seqlens.add_(lq)
            outs[s].copy_(out)
        return k_cache, v_cache

    eager = torch.empty(steps, b, hq, lq, d, dtype=dt, device=dev)
    k_eager, v_eager = run_steps(adaattn, k0.clone(), v0.clone(), start.clone(), eager,
                                 num_splits=num_splits)
    k_graph, v_graph, seqlens = k0.clone(), v0.clone(), start.clone()
    graphed = torch.empty_like(eager)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        run_steps(adaattn, k_graph, v_graph, seqlens, graphed, num_splits=num_splits)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed, eager)
    assert torch.equal(k_graph, k_eager) and torch.equal(v_graph, v_eager)
    assert seqlens.tolist() == [300 + steps * lq, 777 + steps * lq]

    refs = []
    for dtype in (dt, torch.float64):
        outs = torch.empty(steps, b, hq, lq, d, dtype=dtype, device=dev)
        kw = dict(upcast=dtype == torch.float64) if lazy else {}
        k_ref, v_ref = run_steps(reference, k0.to(dtype), v0.to(dtype), start.clone(), outs, **kw)
        refs.append(outs)
        if dtype == dt:
            assert torch.equal(k_ref, k_eager) and torch.equal(v_ref, v_eager)
    for s in range(steps):
        assert_low_precision_rule(f"step {s}", eager[s], refs[0][s], refs[1][s])


# --------------------------------------------------------------------------------------------
# adaattn.KVCache
# --------------------------------------------------------------------------------------------

def _dense(cache: adaattn.KVCache, seq_id: int):
    """Sequence ``seq_id``'s keys and values ``[1, Hkv, L, D]`` gathered from the pages."""
    length = cache.length(seq_id)
    table = cache.block_table[seq_id:seq_id + 1]
    return (reference.kvcache_gather(cache.k_pages, table)[:, :, :length],
            reference.kvcache_gather(cache.v_pages, table)[:, :, :length])


def test_kvcache_allocator():
    cache = adaattn.KVCache(5, 4, 2, 8, max_batch=3, max_pages_per_seq=3, dtype=torch.float64)
    a, b = cache.allocate(), cache.allocate()
    assert (a, b) == (0, 1) and cache.num_free_pages == 5
    cache.reserve([a, b], 5)  # two pages each
    assert cache.num_free_pages == 1 and cache.seqlens.tolist() == [0, 0, 0]
    pages_a = cache.block_table[a, :2].tolist()
    assert len(set(pages_a + cache.block_table[b, :2].tolist())) == 4
    cache.advance([a, b], 5)
    assert cache.seqlens.tolist() == [5, 5, 0] and cache.length(a) == 5
    with pytest.raises(RuntimeError, match="reserve"):
        cache.advance([a], 4)  # 9 positions need a third page
    with pytest.raises(RuntimeError, match="max_pages_per_seq"):
        cache.reserve([a], 8)
    with pytest.raises(RuntimeError, match="pages needed"):
        cache.reserve([a, b], 4)  # a third page each, one page short
    assert cache.num_free_pages == 1, "a refused reserve allocated pages"
    cache.free(a)
    assert cache.num_free_pages == 3 and cache.seqlens.tolist() == [0, 5, 0]
    assert cache.block_table[a].tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="no sequence"):
        cache.length(a)
    assert cache.allocate() == a
    cache.reserve([a], 12)
    assert set(pages_a) <= set(cache.block_table[a].tolist())  # freed pages are reused
    assert cache.num_free_pages == 0
    assert cache.allocate(2) == 2
    with pytest.raises(RuntimeError, match="max_batch"):
        cache.allocate()
    with pytest.raises(RuntimeError, match="in use"):
        cache.allocate(1)


def test_kvcache_append_and_fork():
    """Ragged prefills land where the block table says; a fork copies its source's positions
    and then grows independently."""
    cache = adaattn.KVCache(12, 4, 2, 8, 6, max_batch=4, max_pages_per_seq=4,
                            dtype=torch.float64)
    ids = [cache.allocate() for _ in range(3)]
    dense = {}
    for seq_id, length in zip(ids, (5, 0, 13)):
        k, v = torch.randn(1, 2, length, 8, dtype=torch.float64), torch.randn(
            1, 2, length, 6, dtype=torch.float64)
        cache.append([seq_id], k, v)
        dense[seq_id] = (k, v)
    k, v = torch.randn(2, 2, 3, 8, dtype=torch.float64), torch.randn(2, 2, 3, 6,
                                                                       dtype=torch.float64)
    cache.append(ids[:2], k, v)  # a batched append at lengths 5 and 0
    for i, seq_id in enumerate(ids[:2]):
        dense[seq_id] = tuple(torch.cat([d, n[i:i + 1]], dim=2) for d, n in zip(dense[seq_id],
                                                                                  (k, v)))
    assert cache.seqlens.tolist() == [8, 3, 13, 0]
    for seq_id in ids:
        for got, expected in zip(_dense(cache, seq_id), dense[seq_id]):
            assert torch.equal(got, expected)

    child = cache.fork(ids[2])
    assert child == 3 and cache.length(child) == 13
    for got, expected in zip(_dense(cache, child), dense[ids[2]]):
        assert torch.equal(got, expected)
    tail = torch.randn(1, 2, 2, 8, dtype=torch.float64), torch.randn(1, 2, 2, 6,
                                                                      dtype=torch.float64)
    cache.append([child], *tail)
    for got, expected in zip(_dense(cache, ids[2]), dense[ids[2]]):
        assert torch.equal(got, expected), "appending to the fork changed its source"
    assert cache.fork(ids[0], dst=ids[1]) == ids[1]  # beam reassignment: row 1 <- row 0
    for got, expected in zip(_dense(cache, ids[1]), dense[ids[0]]):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("lazy", [False, True], ids=["flash", "lazy"])
def test_kvcache_decode_matches_contiguous(device, lazy):
    """Prefill three ragged sequences into an adaattn.KVCache, fork one, then decode steps
    through the op (new keys written into the pages by the op) give the rows of
    adaattn.flash_attn / lazy_attn on each dense sequence."""
    hq, hkv, d = 8, 2, 32
    dtype = torch.float64 if device == "cpu" else torch.float32
    tol = FP64_RTOL if dtype == torch.float64 else FP32_RTOL
    cache = adaattn.KVCache(40, 16, hkv, d, max_batch=4, max_pages_per_seq=8, dtype=dtype,
                            device=device)
    tau = torch.full((hq,), -0.5, device=device)
    bias = 0.5 * torch.randn(hq, 24, device=device)
    dense = {}
    for length in (1, 30, 47):
        seq_id = cache.allocate()
        k, v = (torch.randn(1, hkv, length, d, dtype=dtype, device=device) for _ in range(2))
        cache.append([seq_id], k, v)
        dense[seq_id] = [k, v]
    fork = cache.fork(1)
    dense[fork] = list(dense[1])
    ids = [0, 2, fork, 1]
    for lq in (1, 3, 16, 1):
        q = torch.randn(len(ids), hq, lq, d, dtype=dtype, device=device)
        k, v = (torch.randn(len(ids), hkv, lq, d, dtype=dtype, device=device) for _ in range(2))
        cache.reserve(ids, lq)
        args = (q, cache.k_pages, cache.v_pages, k, v) + ((tau, bias) if lazy else ())
        kw = dict(cache_seqlens=cache.seqlens[ids], block_table=cache.block_table[ids])
        if lazy:
            out = adaattn.lazy_attn_with_kvcache(*args, **kw)
        else:
            out = adaattn.flash_attn_with_kvcache(*args, **kw)
        cache.advance(ids, lq)
        for i, seq_id in enumerate(ids):
            dense[seq_id] = [torch.cat([t, n[i:i + 1]], dim=2) for t, n in zip(dense[seq_id],
                                                                                 (k, v))]
            keys, values = dense[seq_id]
            q_full = torch.cat([torch.randn(1, hq, keys.shape[2] - lq, d, dtype=dtype,
                                            device=device), q[i:i + 1]], dim=2)
            if lazy:
                expected = adaattn.lazy_attn(q_full, keys, values, tau, bias)
            else:
                expected = adaattn.flash_attn(q_full, keys, values, causal=True)
            assert_rel_close("out", out[i:i + 1], expected[:, :, -lq:], tol)
            for got, want in zip(_dense(cache, seq_id), dense[seq_id]):
                assert torch.equal(got.cpu(), want.cpu())
