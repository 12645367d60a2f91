"""Tests of the composed score variants (docs/ops.md): ``alibi_slopes``, learnable ``sinks`` and
learnable ``rel_bias`` on flash_attn, flash_attn_varlen and block_sparse_attn, alone, together
and with softcap (order: scale -> softcap -> alibi + rel_bias -> mask -> softmax with sinks).

Ground truth is ``adaattn.reference`` in float64. Bars (accuracy.py), as in test_softcap.py: float64
``gradcheck`` for q, k, v and for sinks and rel_bias; float32 relative error ``<= 1e-5`` for
out, lse, dq, dk, dv, dsinks, drel_bias; float16/bfloat16 ``err(ours) <= 2 * err(reference in
the same dtype) + 1e-5``. Each accuracy case also checks that the variant changes the
reference's output (so that it tests the variant). CUDA cases carry the ``cuda`` marker and skip
at run time without a GPU.
"""
import pytest
import torch

import adaattn
from adaattn import reference

import test_block_sparse as sparse_tests
import test_flash as flash_tests
import test_varlen as varlen_tests
from accuracy import FP32_RTOL, LOW_PRECISION, assert_low_precision_rule, assert_rel_close

FC, SC = flash_tests.Case, sparse_tests.Case
NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks", "drel_bias")

# Variant name -> the keyword arguments it adds (built per problem by _mods).
VARIANTS = ("alibi", "alibi_batch", "sinks", "rel_bias", "rel_bias_long", "softcap_alibi_batch",
            "all")


def _mods(variant, heads, batch, device, requires_grad=True):
    """Seeded float32 variant tensors for ``heads`` query heads and ``batch`` entries (packed:
    sequences). Slopes up to 0.3, sinks around 3 and unit-size table entries move the softmax
    of N(0, 1) inputs visibly."""
    g = torch.Generator().manual_seed(1234)

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).float().to(device)

    mods = {}
    if variant in ("alibi", "all"):
        mods["alibi_slopes"] = (torch.rand(heads, generator=g, dtype=torch.float64) * 0.3
                                ).float().to(device)
    if variant in ("alibi_batch", "softcap_alibi_batch"):
        mods["alibi_slopes"] = (torch.rand(batch, heads, generator=g, dtype=torch.float64) * 0.3
                                ).float().to(device)
    if variant in ("sinks", "all"):
        # Centred at 3 (e^3 ~ 20 keys of score 0): a sink's share of a 1000-key row stays
        # visible, and short rows still give it to their keys.
        mods["sinks"] = draw(heads) + 3.0
    if variant in ("rel_bias", "all"):
        mods["rel_bias"] = draw(heads, 16)
    if variant == "rel_bias_long":  # a table longer than every sequence
        mods["rel_bias"] = draw(heads, 300, scale=0.5)
    if variant in ("softcap_alibi_batch", "all"):
        # The softcap's derivative is read from the capped score: the added terms must not
        # enter it.
        mods["softcap"] = 2.0
    if requires_grad:
        for name in ("sinks", "rel_bias"):
            if name in mods:
                mods[name].requires_grad_()
    return mods


def _learnable(mods):
    return [mods[n] for n in ("sinks", "rel_bias") if n in mods]


def _cast_mods(mods, dtype):
    """The reference's copies: leaves of ``dtype`` (float64 or the low precision one)."""
    out = {}
    for name, value in mods.items():
        if isinstance(value, torch.Tensor):
            t = value.detach().to(dtype)
            out[name] = t.requires_grad_() if name in ("sinks", "rel_bias") else t
        else:
            out[name] = value
    return out


class Dense:
    """adaattn.flash_attn on a test_flash.Case (GQA, causal, window, seqlens, transposed)."""

    def __init__(self, case, dtype, device, variant, requires_grad=True):
        self.case = case
        self.q, self.k, self.v, self.seqlens, self.dout = flash_tests.make_inputs(
            case, dtype, device, requires_grad)
        self.mods = _mods(variant, case.hq, case.b, device, requires_grad)

    def call(self, q, k, v, mods, return_lse=False):
        c = self.case
        return adaattn.flash_attn(q, k, v, causal=c.causal, softmax_scale=c.scale,
                                  window=c.window, seqlens=self.seqlens, return_lse=return_lse,
                                  **mods)

    def reference(self, q, k, v, mods):
        c = self.case
        return reference.flash_attn(q, k, v, causal=c.causal, softmax_scale=c.scale,
                                    window=c.window, seqlens=self.seqlens, **mods)


class Packed:
    """adaattn.flash_attn_varlen on a test_varlen.Problem (zero-length sequences, Tq != Tk)."""

    def __init__(self, spec, dtype, device, variant, requires_grad=True):
        self.p = varlen_tests.Problem(**spec, dtype=dtype, device=device)
        self.q, self.k, self.v = (t if requires_grad else t.detach()
                                  for t in (self.p.q, self.p.k, self.p.v))
        self.dout = self.p.dout
        self.mods = _mods(variant, self.q.shape[1], len(self.p.lens_q), device, requires_grad)

    def call(self, q, k, v, mods, return_lse=False):
        p = self.p
        return adaattn.flash_attn_varlen(q, k, v, p.cu_q, p.cu_k, causal=p.causal,
                                         window=p.window, return_lse=return_lse, **mods)

    def reference(self, q, k, v, mods):
        p = self.p
        return reference.flash_attn_varlen(q, k, v, p.cu_q, p.cu_k, causal=p.causal,
                                           window=p.window, **mods)


class Sparse:
    """adaattn.block_sparse_attn on a test_block_sparse.Case (random layouts, GQA, causal)."""

    def __init__(self, case, dtype, device, variant, requires_grad=True):
        self.case = case
        self.q, self.k, self.v, self.mask, self.dout = sparse_tests.make_inputs(
            case, dtype, device, requires_grad)
        self.mods = _mods(variant, case.hq, case.b, device, requires_grad)

    def call(self, q, k, v, mods, return_lse=False):
        c = self.case
        return adaattn.block_sparse_attn(q, k, v, self.mask, causal=c.causal,
                                         softmax_scale=c.scale, return_lse=return_lse, **mods)

    def reference(self, q, k, v, mods):
        c = self.case
        return reference.block_sparse_attn(q, k, v, self.mask, causal=c.causal,
                                           softmax_scale=c.scale, **mods)


def _grads(out, lse, inputs, learnable, dout):
    """(out, lse, dq, dk, dv, dsinks or None, drel_bias or None)."""
    grads = torch.autograd.grad(out, list(inputs) + [t for t in learnable if t is not None],
                                dout)
    dq, dk, dv = grads[:3]
    rest = iter(grads[3:])
    extra = [next(rest) if t is not None else None for t in learnable]
    return (out, lse, dq, dk, dv, *extra)


def _named_learnable(mods):
    return [mods.get("sinks"), mods.get("rel_bias")]


def _run_ours(problem):
    out, lse = problem.call(problem.q, problem.k, problem.v, problem.mods, return_lse=True)
    assert out.shape[:-1] == problem.q.shape[:-1] and out.dtype == problem.q.dtype
    assert lse.dtype == torch.float32
    return _grads(out, lse, (problem.q, problem.k, problem.v), _named_learnable(problem.mods),
                  problem.dout)


def _run_reference(problem, dtype):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (problem.q, problem.k, problem.v))
    mods = _cast_mods(problem.mods, dtype)
    out, lse = problem.reference(q, k, v, mods)
    return _grads(out, lse, (q, k, v), _named_learnable(mods), problem.dout.to(dtype))


def _assert_variant_matters(problem):
    """The variant's float64 reference output differs from plain attention's far beyond the
    fp32 bar: a kernel that ignored it would fail the case."""
    q, k, v = (t.detach().double() for t in (problem.q, problem.k, problem.v))
    with_mods = problem.reference(q, k, v, _cast_mods(problem.mods, torch.float64))[0]
    plain = problem.reference(q, k, v, {})[0]
    diff = torch.linalg.vector_norm(with_mods - plain).item()
    assert diff > 100 * FP32_RTOL * torch.linalg.vector_norm(plain).item()


def _compare(ours, ref, check):
    for name, a, e in zip(NAMES, ours, ref):
        assert (a is None) == (e is None), name
        if a is not None:
            check(name, a, e)


def _param(family, spec, variant, marks=()):
    return pytest.param(family, spec, variant, id=f"{family.__name__}-{variant}-{spec}",
                        marks=marks)


# --------------------------------------------------------------------------------------------
# float64: gradcheck of q, k, v and of the learnable sinks and rel_bias
# --------------------------------------------------------------------------------------------

GRADCHECK_SPECS = [
    (Dense, FC(b=2, hq=4, hkv=2, lq=5, lk=7, d=3, causal=True, seqlens=(3, 7))),
    (Dense, FC(lq=6, lk=4, d=3, causal=True)),  # the first two rows see no key
    (Dense, FC(hq=2, hkv=1, lq=4, lk=6, d=3, window=(2, 1), transposed=True, scale=0.7)),
    (Packed, dict(lens_q=[3, 0, 5, 1], lens_k=[4, 2, 5, 3], hq=2, hkv=1, d=3)),
    (Sparse, SC(hq=2, hkv=1, lq=70, lk=80, d=2, density=0.5, causal=True)),
]
GRADCHECK_CASES = [_param(f, s, v) for v in ("alibi_batch", "sinks", "rel_bias", "all")
                   for f, s in GRADCHECK_SPECS
                   if not (f is Sparse and v in ("alibi_batch", "rel_bias"))]


@pytest.mark.parametrize("family,spec,variant", GRADCHECK_CASES)
def test_gradcheck_fp64(device, family, spec, variant):
    """q, k, v at gradcheck's default step; sinks and rel_bias (float32 by design, which cannot
    resolve a 1e-6 step) over float64 copies cast to float32 inside, with a 1e-3 step (as
    test_lazy.py checks tau and bias)."""
    problem = family(spec, torch.float64, device, variant)
    fixed = {n: (t.detach() if isinstance(t, torch.Tensor) else t)
             for n, t in problem.mods.items()}
    ref = problem.reference(*(t.detach() for t in (problem.q, problem.k, problem.v)),
                            _cast_mods(problem.mods, torch.float64))[0]
    assert_rel_close("out", problem.call(problem.q, problem.k, problem.v, fixed).detach(), ref,
                     1e-12)
    assert torch.autograd.gradcheck(lambda q, k, v: problem.call(q, k, v, fixed),
                                    (problem.q, problem.k, problem.v))
    names = [n for n in ("sinks", "rel_bias") if n in problem.mods]
    if not names:
        return
    q, k, v = (t.detach() for t in (problem.q, problem.k, problem.v))

    def fn(*params):
        return problem.call(q, k, v, dict(fixed, **{n: t.float() for n, t in zip(names, params)}))

    params = tuple(problem.mods[n].detach().double().requires_grad_() for n in names)
    assert torch.autograd.gradcheck(fn, params, eps=1e-3)


# --------------------------------------------------------------------------------------------
# float32: relative error <= 1e-5 against float64, every variant x family
# --------------------------------------------------------------------------------------------

ACCURACY_SPECS = [
    (Dense, FC(lq=1, lk=17, d=32)),
    (Dense, FC(b=2, lq=17, lk=17, d=32, causal=True)),
    (Dense, FC(hq=4, hkv=2, lq=97, lk=97, d=32)),  # GQA
    (Dense, FC(hq=4, hkv=1, lq=97, lk=128, d=32, causal=True)),
    (Dense, FC(lq=97, lk=128, d=32, window=(32, 8))),
    (Dense, FC(b=3, hq=2, lq=97, lk=97, d=32, causal=True, seqlens=(0, 50, 97))),
    (Dense, FC(b=2, hq=4, hkv=2, lq=97, lk=128, d=32, causal=True, window=(40, -1),
               transposed=True, scale=0.2)),  # all combined
    (Packed, dict(lens_q=[17, 0, 1, 97])),
    (Packed, dict(lens_q=[3, 40, 0, 9], lens_k=[10, 40, 6, 2])),
    (Packed, dict(lens_q=[97, 17], causal=False, window=(16, 3), transposed=True)),
    (Sparse, SC(b=2, hq=4, hkv=2, lq=97, lk=130, d=32, density=0.5, mask_h=True,
                causal=True)),
    (Sparse, SC(lq=17, lk=97, d=32, density=1.0, causal=True)),
]
ACCURACY_CASES = [_param(f, s, v) for v in VARIANTS for f, s in ACCURACY_SPECS
                  if not (v.endswith("alibi_batch") and f is Dense and s.b == 1)]


@pytest.mark.parametrize("family,spec,variant", ACCURACY_CASES)
def test_fp32_matches_reference(device, family, spec, variant):
    problem = family(spec, torch.float32, device, variant)
    if not (family is Dense and spec.lk == 17 and spec.lq == 1 and variant == "rel_bias_long"):
        _assert_variant_matters(problem)
    _compare(_run_ours(problem), _run_reference(problem, torch.float64),
             lambda name, a, e: assert_rel_close(name, a, e, FP32_RTOL))


def _check_low_precision(problem, dtype):
    _assert_variant_matters(problem)
    ours = _run_ours(problem)
    ref64 = _run_reference(problem, torch.float64)
    ref_low = _run_reference(problem, dtype)
    for name, a, lo, e in zip(NAMES, ours, ref_low, ref64):
        if a is None:
            continue
        if name in ("dsinks", "drel_bias"):
            # Parameter gradients are float32 in every dtype: the low-precision reference
            # (which sums in its own dtype) sets the bar.
            assert_low_precision_rule(name, a, lo.float(), e)
        else:
            assert_low_precision_rule(name, a, lo, e)


LOW_PRECISION_CPU_CASES = [
    _param(Dense, FC(b=2, hq=4, hkv=2, lq=97, lk=128, d=64, causal=True), "all"),
    _param(Packed, dict(lens_q=[17, 0, 97], d=64, window=(32, -1), causal=False), "all"),
    _param(Sparse, SC(b=2, hq=4, hkv=2, lq=130, lk=200, d=64, density=0.5, causal=True), "all"),
]


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("family,spec,variant", LOW_PRECISION_CPU_CASES)
def test_low_precision_cpu(family, spec, variant, dtype):
    _check_low_precision(family(spec, dtype, "cpu", variant), dtype)


def _low_precision_cuda_grid():
    """Every variant x {dense, GQA, causal, window, seqlens, packed, block-sparse, all combined}
    at D in {64, 128} and the awkward lengths."""
    specs = [
        (Dense, FC(b=2, hq=8, hkv=8, lq=1025, lk=1025, d=128)),
        (Dense, FC(b=2, hq=8, hkv=2, lq=1025, lk=1025, d=128, causal=True)),  # GQA, causal
        (Dense, FC(b=2, hq=8, hkv=1, lq=97, lk=1000, d=64, causal=True)),
        (Dense, FC(b=2, hq=8, hkv=2, lq=1025, lk=1025, d=128, window=(64, 0))),
        (Dense, FC(b=4, hq=4, hkv=2, lq=1025, lk=1025, d=128, causal=True,
                   seqlens=(0, 1, 500, 1025))),
        (Dense, FC(b=2, hq=8, hkv=2, lq=1000, lk=1025, d=128, causal=True, window=(200, -1),
                   transposed=True)),  # all combined
        (Dense, FC(b=2, hq=4, hkv=2, lq=17, lk=17, d=64)),
        (Dense, FC(b=2, hq=4, hkv=2, lq=1, lk=97, d=64)),
        (Packed, dict(lens_q=[17, 0, 1, 1000, 97], hq=8, hkv=2, d=64)),
        (Packed, dict(lens_q=[300, 0, 128], lens_k=[500, 7, 128], hq=4, hkv=4, d=128,
                      causal=False, window=(64, 16))),
        (Sparse, SC(b=2, hq=8, hkv=2, lq=1025, lk=1000, d=128, block=(128, 128), density=0.5,
                    mask_h=True, causal=True)),
        (Sparse, SC(b=2, hq=4, hkv=4, lq=97, lk=300, d=64, block=(128, 128), density=0.5,
                    mask_b=True)),
    ]
    return [_param(f, s, v) for v in VARIANTS for f, s in specs]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("family,spec,variant", _low_precision_cuda_grid())
def test_low_precision_cuda(family, spec, variant, dtype):
    _check_low_precision(family(spec, dtype, "cuda", variant), dtype)


# --------------------------------------------------------------------------------------------
# Semantics: sinks and ALiBi against hand-built equivalents
# --------------------------------------------------------------------------------------------

def test_sink_is_a_zero_value_key(device):
    """A sink is a key of score sinks[h] and value 0: plain attention over k and v with one
    such key prepended gives the same out and lse."""
    case = FC(b=2, hq=2, hkv=2, lq=9, lk=13, d=8)
    q, k, v, _, _ = flash_tests.make_inputs(case, torch.float64, device, False)
    sinks = torch.tensor([0.5, -1.0], device=device)
    out, lse = adaattn.flash_attn(q, k, v, sinks=sinks, return_lse=True)
    scale = case.d ** -0.5
    # A key whose score is sinks[h] for every row needs a per-head key: build it in the scores.
    scores = torch.cat([sinks.double().view(1, -1, 1, 1).expand(2, 2, 9, 1),
                        q @ k.transpose(-1, -2) * scale], dim=-1)
    probs = scores.softmax(-1)
    v0 = torch.cat([torch.zeros_like(v[:, :, :1]), v], dim=2)
    assert_rel_close("out", out, probs @ v0, FP32_RTOL)
    assert_rel_close("lse", lse, scores.logsumexp(-1), FP32_RTOL)


def test_row_without_keys_has_sink_lse(device):
    """With sinks, a row that sees no key has lse = sinks[h] and out = 0."""
    case = FC(lq=6, lk=4, d=8, causal=True)  # rows 0 and 1 see no key
    q, k, v, _, _ = flash_tests.make_inputs(case, torch.float32, device, False)
    sinks = torch.tensor([0.25, -2.0], device=device)
    out, lse = adaattn.flash_attn(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert (out[:, :, :2] == 0).all()
    assert torch.equal(lse[0, :, :2], sinks.view(2, 1).expand(2, 2))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_row_without_keys_has_sink_lse_tensor_cores(dtype, d):
    """The tensor-core forward starts each row's softmax from its sink: rows that see no key
    (a whole 128-row tile of them, and a tile that also holds rows with keys) get lse =
    sinks[h] (up to the float32 rounding of the log2-domain state) and out = 0, and rows with
    keys give the sink its share of the denominator."""
    case = FC(b=2, hq=2, hkv=2, lq=200, lk=4, d=d, causal=True)  # rows 0..195 see no key
    q, k, v, _, _ = flash_tests.make_inputs(case, dtype, "cuda", False)
    sinks = torch.tensor([0.25, -2.0], device="cuda")
    out, lse = adaattn.flash_attn(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert (out[:, :, :196] == 0).all()
    torch.testing.assert_close(lse[:, :, :196], sinks.view(1, 2, 1).expand(2, 2, 196),
                               rtol=1e-6, atol=0)
    ref64 = reference.flash_attn(q.double(), k.double(), v.double(), causal=True,
                                 sinks=sinks.double())
    ref_low = reference.flash_attn(q, k, v, causal=True, sinks=sinks.to(dtype))
    for name, a, lo, e in zip(("out", "lse"), (out, lse), ref_low, ref64):
        assert_low_precision_rule(name, a[:, :, 196:], lo[:, :, 196:], e[:, :, 196:])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_deterministic_backward_cuda(dtype):
    """deterministic=True with every modifier: two backward runs give bit-identical gradients,
    dsinks and drel_bias included (the tensor-core kernels take the two-pass dQ path)."""
    case = FC(b=2, hq=8, hkv=2, lq=1000, lk=1025, d=128, causal=True)
    problem = Dense(case, dtype, "cuda", "all")

    def run():
        out = adaattn.flash_attn(problem.q, problem.k, problem.v, causal=True,
                                 deterministic=True, **problem.mods)
        learnable = _named_learnable(problem.mods)
        inputs = [problem.q, problem.k, problem.v] + [t for t in learnable if t is not None]
        return torch.autograd.grad(out, inputs, problem.dout)

    first, second = run(), run()
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"gradient {i} differs between two runs"


def test_alibi_matches_an_explicit_bias(device):
    """ALiBi equals softmax over scores minus slope * |i - j| with bottom-right aligned i."""
    case = FC(hq=2, hkv=1, lq=5, lk=9, d=8)
    q, k, v, _, _ = flash_tests.make_inputs(case, torch.float64, device, False)
    slopes = torch.tensor([0.5, 0.125], device=device)
    out = adaattn.flash_attn(q, k, v, alibi_slopes=slopes)
    i = torch.arange(5, device=device).view(-1, 1) + 4
    j = torch.arange(9, device=device).view(1, -1)
    kk = k.repeat_interleave(2, dim=1)
    vv = v.repeat_interleave(2, dim=1)
    scores = q @ kk.transpose(-1, -2) * 8 ** -0.5 - slopes.double().view(1, 2, 1, 1) * (i - j).abs()
    assert_rel_close("out", out, scores.softmax(-1) @ vv, FP32_RTOL)


# --------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------

def _small(family, device):
    if family is Dense:
        return Dense(FC(b=2, hq=2, lq=8, lk=8, d=16), torch.float32, device, "all", False)
    if family is Packed:
        return Packed(dict(lens_q=[3, 5], hq=2, hkv=1, d=16), torch.float32, device, "all",
                      False)
    return Sparse(SC(b=2, hq=2, lq=70, lk=70, d=16), torch.float32, device, "all", False)


BAD_VALUES = [
    ("alibi_slopes", lambda m: m["alibi_slopes"].double(), TypeError, "alibi_slopes must be float32"),
    ("alibi_slopes", lambda m: m["alibi_slopes"][:1], ValueError, r"alibi_slopes must have shape \[Hq\]"),
    ("alibi_slopes", lambda m: m["alibi_slopes"].view(1, 1, -1), ValueError, "alibi_slopes must have shape"),
    ("alibi_slopes", lambda m: m["alibi_slopes"].expand(3, 2), ValueError,
     r"alibi_slopes must have shape \[Hq\] = \[2\] or \[B, Hq\] = \[2, 2\]"),
    ("sinks", lambda m: m["sinks"].half(), TypeError, "sinks must be float32"),
    ("sinks", lambda m: m["sinks"].view(1, 2), ValueError, r"sinks must have shape \[Hq\] = \[2\]"),
    ("rel_bias", lambda m: m["rel_bias"].double(), TypeError, "rel_bias must be float32"),
    ("rel_bias", lambda m: m["rel_bias"][:, :0], ValueError, r"rel_bias must have shape \[Hq, W\]"),
    ("rel_bias", lambda m: m["rel_bias"][0], ValueError, r"rel_bias must have shape \[Hq, W\]"),
    ("sinks", lambda m: [0.0, 1.0], TypeError, "sinks must be a tensor or None"),
]


@pytest.mark.parametrize("name,change,cls,message", BAD_VALUES,
                         ids=[f"{v[0]}-{i}" for i, v in enumerate(BAD_VALUES)])
@pytest.mark.parametrize("family", [Dense, Packed, Sparse], ids=lambda f: f.__name__)
def test_bad_variant_tensors(family, name, change, cls, message):
    problem = _small(family, "cpu")
    mods = dict(problem.mods, **{name: change(problem.mods)})
    with pytest.raises(cls, match=rf"^adaattn\.\w+: {message}"):
        problem.call(problem.q, problem.k, problem.v, mods)
    # The fake kernels raise the same while tracing on meta tensors.
    if isinstance(mods[name], torch.Tensor):
        meta = {n: (t.to("meta") if isinstance(t, torch.Tensor) else t) for n, t in mods.items()}
        q, k, v = (t.to("meta") for t in (problem.q, problem.k, problem.v))
        if family is not Dense:
            return  # cu_seqlens / masks would need meta copies too; the dense case covers it
        with pytest.raises(cls, match=rf"^adaattn\.\w+: {message}"):
            adaattn.flash_attn(q, k, v, seqlens=None, **meta)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["alibi_slopes", "sinks", "rel_bias"])
def test_variant_tensor_on_wrong_device(name):
    problem = _small(Dense, "cuda")
    mods = dict(problem.mods, **{name: problem.mods[name].cpu()})
    with pytest.raises(RuntimeError, match=rf"^adaattn\.flash_attn: {name} must be on cuda"):
        problem.call(problem.q, problem.k, problem.v, mods)


# --------------------------------------------------------------------------------------------
# Registration: opcheck, torch.compile
# --------------------------------------------------------------------------------------------

OPCHECK_UTILS = flash_tests.OPCHECK_UTILS
NO_GRAD_UTILS = tuple(u for u in OPCHECK_UTILS if u != "test_autograd_registration")


def _opcheck_dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def _opcheck_backend(op, args, kwargs):
    torch.library.opcheck(op, args, kwargs, test_utils=NO_GRAD_UTILS)
    grad_args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor)
                      and a.is_floating_point() else a for a in args)
    torch.library.opcheck(op, grad_args, kwargs, test_utils=("test_autograd_registration",))


def test_opcheck_flash(device):
    case = FC(b=2, hq=4, hkv=2, lq=17, lk=33, d=64, causal=True, window=(8, -1),
              seqlens=(0, 12))
    q, k, v, seqlens, dout = flash_tests.make_inputs(case, _opcheck_dtype(device), device)
    mods = _mods("all", 4, 2, device)
    torch.library.opcheck(torch.ops.adaattn.flash_attn.default,
                          (q, k, v, seqlens, None, True, 8, -1, False), mods,
                          test_utils=OPCHECK_UTILS)
    q, k, v = (t.detach() for t in (q, k, v))
    mods = {n: (t.detach() if isinstance(t, torch.Tensor) else t) for n, t in mods.items()}
    fwd = (q, k, v, seqlens, None, True, 8, -1)
    out, lse = torch.ops.adaattn.flash_fwd(*fwd, **mods)
    _opcheck_backend(torch.ops.adaattn.flash_fwd.default, fwd, mods)
    _opcheck_backend(torch.ops.adaattn.flash_bwd.default,
                     (dout, q, k, v, out, lse) + fwd[3:] + (False,),
                     dict(mods, param_grads=True))


def test_opcheck_varlen(device):
    packed = Packed(dict(lens_q=[17, 0, 40], lens_k=[20, 3, 40], d=64), _opcheck_dtype(device),
                    device, "all")
    p = packed.p
    mods = dict(packed.mods, alibi_slopes=_mods("alibi_batch", 4, 3, device)["alibi_slopes"])
    torch.library.opcheck(torch.ops.adaattn.flash_attn.default,
                          (p.q, p.k, p.v, None, None, True, -1, -1, False, p.cu_q, p.cu_k), mods,
                          test_utils=OPCHECK_UTILS)


def test_opcheck_block_sparse(device):
    case = SC(b=2, hq=4, hkv=2, lq=100, lk=150, d=64, block=(128, 128), density=0.5,
              mask_h=True, causal=True)
    q, k, v, mask, dout = sparse_tests.make_inputs(case, _opcheck_dtype(device), device)
    mods = _mods("all", 4, 2, device)
    torch.library.opcheck(torch.ops.adaattn.block_sparse_attn.default,
                          (q, k, v, mask.kv_num_blocks, mask.kv_indices, *mask.transposed(),
                           128, 128, None, True, "two_pass"), mods, test_utils=OPCHECK_UTILS)


def test_compile_fullgraph(device):
    """torch.compile(fullgraph=True) over flash_attn with every variant, forward and backward,
    matches eager (sinks and rel_bias as parameters)."""
    case = FC(b=2, hq=4, hkv=2, lq=17, lk=33, d=32, causal=True)
    q, k, v, _, dout = flash_tests.make_inputs(case, torch.float32, device)
    mods = _mods("all", 4, 2, device)

    def fn(q, k, v, alibi_slopes, sinks, rel_bias):
        return adaattn.flash_attn(q, k, v, causal=True, softcap=2.0, alibi_slopes=alibi_slopes,
                                  sinks=sinks, rel_bias=rel_bias)

    args = (q, k, v, mods["alibi_slopes"], mods["sinks"], mods["rel_bias"])
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    learn = (q, k, v, mods["sinks"], mods["rel_bias"])
    eager = torch.autograd.grad(fn(*args), learn, dout)
    got = torch.autograd.grad(compiled(*args), learn, dout)
    for a, e in zip(got, eager):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# adaattn.nn
# --------------------------------------------------------------------------------------------

def test_nn_attention_learns_sinks_and_rel_bias():
    torch.manual_seed(0)
    attn = adaattn.nn.FlashAttention(causal=True, num_heads=4, sinks=True, rel_bias_window=8,
                                     alibi_slopes=torch.rand(4) * 0.2)
    q, k, v = (torch.randn(2, 4, 17, 16, requires_grad=True) for _ in range(3))
    out = attn(q, k, v)
    out.square().sum().backward()
    assert attn.sinks.grad is not None and attn.sinks.grad.abs().sum() > 0
    assert attn.rel_bias.grad is not None and attn.rel_bias.grad.abs().sum() > 0
    ref, _ = reference.flash_attn(q, k, v, causal=True, alibi_slopes=attn.alibi_slopes,
                                  sinks=attn.sinks, rel_bias=attn.rel_bias)
    assert_rel_close("out", out, ref, FP32_RTOL)
