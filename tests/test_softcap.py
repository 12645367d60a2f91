"""Tests of the softcap score modifier (docs/ops.md): ``s <- softcap * tanh(s / softcap)`` after
scaling, before masking, on flash_attn, flash_attn_varlen and block_sparse_attn.

Ground truth is ``adaattn.reference`` with ``softcap`` run in float64. Bars (accuracy.py), as in
test_flash.py: float64 ``gradcheck``; float32 relative error ``<= 1e-5`` for out, lse, dq, dk,
dv; float16/bfloat16 ``err(ours) <= 2 * err(reference in the same dtype) + 1e-5``. Each accuracy
case also checks that the cap changes the reference's output (so that it tests the cap).
Every test runs with NaN-poisoned allocations (conftest.py); CUDA cases carry the ``cuda`` marker
and skip at run time without a GPU.
"""
import math

import pytest
import torch

import adaattn
from adaattn import reference

import test_block_sparse as sparse_tests
import test_flash as flash_tests
import test_varlen as varlen_tests
from accuracy import FP32_RTOL, LOW_PRECISION, assert_low_precision_rule, assert_rel_close

NAMES = ("out", "lse", "dq", "dk", "dv")
CAP = 1.0  # about the size of the scaled scores of N(0, 1) inputs: tanh bends most of them


def _grads(out, lse, inputs, dout):
    return (out, lse) + torch.autograd.grad(out, inputs, dout)


def _leaves(tensors, dtype):
    return tuple(t.detach().to(dtype).requires_grad_() for t in tensors)


class Dense:
    """adaattn.flash_attn on a test_flash.Case (GQA, causal, window, seqlens, transposed)."""

    def __init__(self, case, dtype, device, requires_grad=True):
        self.case = case
        self.q, self.k, self.v, self.seqlens, self.dout = flash_tests.make_inputs(
            case, dtype, device, requires_grad)

    def call(self, q, k, v, softcap, return_lse=False):
        c = self.case
        return adaattn.flash_attn(q, k, v, causal=c.causal, softmax_scale=c.scale,
                                  window=c.window, seqlens=self.seqlens, return_lse=return_lse,
                                  softcap=softcap)

    def reference(self, q, k, v, softcap):
        c = self.case
        return reference.flash_attn(q, k, v, causal=c.causal, softmax_scale=c.scale,
                                    window=c.window, seqlens=self.seqlens, softcap=softcap)


class Packed:
    """adaattn.flash_attn_varlen on a test_varlen.Problem (zero-length sequences, Tq != Tk)."""

    def __init__(self, spec, dtype, device, requires_grad=True):
        self.p = varlen_tests.Problem(**spec, dtype=dtype, device=device)
        self.q, self.k, self.v = (t if requires_grad else t.detach()
                                  for t in (self.p.q, self.p.k, self.p.v))
        self.dout = self.p.dout

    def call(self, q, k, v, softcap, return_lse=False):
        p = self.p
        return adaattn.flash_attn_varlen(q, k, v, p.cu_q, p.cu_k, causal=p.causal,
                                         window=p.window, return_lse=return_lse, softcap=softcap)

    def reference(self, q, k, v, softcap):
        p = self.p
        return reference.flash_attn_varlen(q, k, v, p.cu_q, p.cu_k, causal=p.causal,
                                           window=p.window, softcap=softcap)


class Sparse:
    """adaattn.block_sparse_attn on a test_block_sparse.Case (random layouts, GQA, causal)."""

    def __init__(self, case, dtype, device, requires_grad=True):
        self.case = case
        self.q, self.k, self.v, self.mask, self.dout = sparse_tests.make_inputs(
            case, dtype, device, requires_grad)

    def call(self, q, k, v, softcap, return_lse=False):
        c = self.case
        return adaattn.block_sparse_attn(q, k, v, self.mask, causal=c.causal,
                                         softmax_scale=c.scale, return_lse=return_lse,
                                         softcap=softcap)

    def reference(self, q, k, v, softcap):
        c = self.case
        return reference.block_sparse_attn(q, k, v, self.mask, causal=c.causal,
                                           softmax_scale=c.scale, softcap=softcap)


def _run_ours(problem, softcap):
    out, lse = problem.call(problem.q, problem.k, problem.v, softcap, return_lse=True)
    assert out.shape[:-1] == problem.q.shape[:-1] and out.dtype == problem.q.dtype
    assert lse.dtype == torch.float32
    return _grads(out, lse, (problem.q, problem.k, problem.v), problem.dout)


def _run_reference(problem, softcap, dtype):
    q, k, v = _leaves((problem.q, problem.k, problem.v), dtype)
    out, lse = problem.reference(q, k, v, softcap)
    return _grads(out, lse, (q, k, v), problem.dout.to(dtype))


def _assert_cap_matters(problem):
    """The capped float64 reference output differs from the uncapped one far beyond the fp32
    bar: a kernel that ignored softcap would fail the case."""
    q, k, v = (t.detach().double() for t in (problem.q, problem.k, problem.v))
    capped, plain = problem.reference(q, k, v, CAP)[0], problem.reference(q, k, v, 0.0)[0]
    diff = torch.linalg.vector_norm(capped - plain).item()
    assert diff > 100 * FP32_RTOL * torch.linalg.vector_norm(plain).item()


def _param(family, spec, marks=()):
    return pytest.param(family, spec, id=f"{family.__name__}-{spec}", marks=marks)


# --------------------------------------------------------------------------------------------
# float64: gradcheck
# --------------------------------------------------------------------------------------------

FC, SC = flash_tests.Case, sparse_tests.Case
GRADCHECK_CASES = [
    _param(Dense, FC(lq=5, lk=7, d=4, causal=True)),
    _param(Dense, FC(lq=6, lk=4, d=4, causal=True)),  # the first two rows see no key
    _param(Dense, FC(hq=4, hkv=2, lq=4, lk=6, d=3, window=(2, 1))),
    _param(Dense, FC(b=3, lq=5, lk=5, d=4, causal=True, seqlens=(0, 3, 5))),
    _param(Dense, FC(b=2, hkv=1, lq=5, lk=4, d=4, transposed=True, scale=0.7)),
    _param(Packed, dict(lens_q=[3, 0, 5, 1], lens_k=[4, 2, 5, 3], hq=2, hkv=1, d=4)),
    _param(Sparse, SC(hq=2, hkv=1, lq=70, lk=100, d=3, density=0.5, causal=True)),
]


@pytest.mark.parametrize("family,spec", GRADCHECK_CASES)
def test_gradcheck_fp64(device, family, spec):
    problem = family(spec, torch.float64, device)
    ref = _run_reference(problem, 0.5, torch.float64)
    assert_rel_close("out", problem.call(problem.q, problem.k, problem.v, 0.5).detach(), ref[0],
                     FP32_RTOL)
    assert torch.autograd.gradcheck(lambda q, k, v: problem.call(q, k, v, 0.5),
                                    (problem.q, problem.k, problem.v))


# --------------------------------------------------------------------------------------------
# float32: relative error <= 1e-5 against float64
# --------------------------------------------------------------------------------------------

ACCURACY_CASES = [
    _param(Dense, FC(lq=1, lk=17, d=64)),
    _param(Dense, FC(b=2, lq=17, lk=17, d=32, causal=True)),
    _param(Dense, FC(hq=4, hkv=2, lq=97, lk=97, d=64)),
    _param(Dense, FC(hq=8, hkv=1, lq=97, lk=128, d=32, causal=True)),
    _param(Dense, FC(lq=128, lk=17, d=32, causal=True)),  # rows before the diagonal see no key
    _param(Dense, FC(lq=97, lk=128, d=64, window=(32, 8))),
    _param(Dense, FC(b=3, lq=97, lk=97, d=64, causal=True, seqlens=(0, 50, 97))),
    _param(Dense, FC(b=2, hq=4, hkv=2, lq=97, lk=128, d=64, causal=True, transposed=True,
                     scale=0.2)),
    _param(Packed, dict(lens_q=[17, 0, 1, 97])),
    _param(Packed, dict(lens_q=[3, 40, 0, 9], lens_k=[10, 40, 6, 2])),
    _param(Packed, dict(lens_q=[97, 17], causal=False, window=(16, 3), transposed=True)),
    _param(Packed, dict(lens_q=[65, 1], hq=8, hkv=1, d=64)),
    _param(Sparse, SC(b=2, hq=4, hkv=2, lq=97, lk=130, d=32, density=0.5, mask_h=True,
                      causal=True)),
    _param(Sparse, SC(b=2, hq=2, hkv=1, lq=257, lk=257, d=64, block=(128, 128), density=0.5,
                      mask_b=True)),
    _param(Sparse, SC(lq=1, lk=200, d=32, block=(64, 128), density=1.0)),
    _param(Sparse, SC(lq=17, lk=97, d=32, density=1.0, causal=True)),
]


@pytest.mark.parametrize("family,spec", ACCURACY_CASES)
def test_fp32_matches_reference(device, family, spec):
    problem = family(spec, torch.float32, device)
    _assert_cap_matters(problem)
    ours = _run_ours(problem, CAP)
    ref = _run_reference(problem, CAP, torch.float64)
    for name, a, e in zip(NAMES, ours, ref):
        assert_rel_close(name, a, e, FP32_RTOL)


@pytest.mark.parametrize("family,spec", ACCURACY_CASES[1::3])
def test_large_cap_is_plain_attention(device, family, spec):
    """A cap far above every score leaves them (to float32 rounding): the capped kernels meet
    the float32 bar against the uncapped ones."""
    problem = family(spec, torch.float32, device)
    capped, plain = _run_ours(problem, 1e6), _run_ours(problem, 0.0)
    for name, a, e in zip(NAMES, capped, plain):
        assert_rel_close(name, a, e, FP32_RTOL)


def _check_low_precision(problem, dtype, cap_matters=True):
    if cap_matters:
        _assert_cap_matters(problem)
    ours = _run_ours(problem, CAP)
    ref64 = _run_reference(problem, CAP, torch.float64)
    ref_low = _run_reference(problem, CAP, dtype)
    for name, a, lo, e in zip(NAMES, ours, ref_low, ref64):
        assert_low_precision_rule(name, a, lo, e)


LOW_PRECISION_CPU_CASES = [
    _param(Dense, FC(b=2, hq=4, hkv=2, lq=97, lk=128, d=64, causal=True)),
    _param(Packed, dict(lens_q=[17, 0, 97], d=64, window=(32, -1), causal=False)),
    _param(Sparse, SC(b=2, hq=4, hkv=2, lq=130, lk=200, d=64, density=0.5, causal=True)),
]


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("family,spec", LOW_PRECISION_CPU_CASES)
def test_low_precision_cpu(family, spec, dtype):
    _check_low_precision(family(spec, dtype, "cpu"), dtype)


def _low_precision_cuda_grid():
    """Dense over the awkward lengths x D in {64, 128} x causal (GQA ratios 1/2/8 rotating), then
    windows, seqlens, transposed inputs; packed sequences; block-sparse 128x128 layouts."""
    cases = []
    heads = [(8, 8), (8, 4), (8, 1)]
    for lq, lk in [(1, 1), (17, 17), (97, 97), (128, 128), (1000, 1000), (1025, 1025),
                   (17, 128), (128, 17)]:
        for d in (64, 128):
            for causal in (False, True):
                hq, hkv = heads[len(cases) % 3]
                cases.append(_param(Dense, FC(b=2, hq=hq, hkv=hkv, lq=lq, lk=lk, d=d,
                                              causal=causal)))
    cases += [
        _param(Dense, FC(b=2, hq=8, hkv=2, lq=1025, lk=1025, d=128, window=(64, 0))),
        _param(Dense, FC(b=2, hq=4, hkv=4, lq=1000, lk=1025, d=64, window=(32, 32))),
        _param(Dense, FC(b=4, hq=4, hkv=2, lq=1025, lk=1025, d=128, causal=True,
                         seqlens=(0, 1, 500, 1025))),
        _param(Dense, FC(b=2, hq=8, hkv=2, lq=1000, lk=1025, d=128, causal=True,
                         transposed=True)),
        _param(Dense, FC(b=2, hq=4, hkv=2, lq=97, lk=128, d=96, causal=True)),  # padded D
        _param(Packed, dict(lens_q=[17, 0, 1, 1000, 97], hq=8, hkv=2, d=64)),
        _param(Packed, dict(lens_q=[300, 0, 128], lens_k=[500, 7, 128], hq=4, hkv=4, d=128,
                            causal=False, window=(64, 16))),
        _param(Sparse, SC(b=2, hq=8, hkv=2, lq=1025, lk=1000, d=128, block=(128, 128),
                          density=0.5, mask_h=True, causal=True)),
        _param(Sparse, SC(b=2, hq=4, hkv=4, lq=97, lk=300, d=64, block=(128, 128),
                          density=0.5, mask_b=True)),
        # D = 256 (Gemma 2's softcapped heads): its own kernels, dK/dV in column slices
        _param(Dense, FC(b=2, hq=8, hkv=2, lq=1025, lk=1025, d=256, causal=True)),
        _param(Dense, FC(b=2, hq=4, hkv=4, lq=97, lk=300, d=256, window=(64, 16),
                         transposed=True)),
        _param(Packed, dict(lens_q=[300, 0, 17, 128], hq=8, hkv=2, d=256)),
        _param(Sparse, SC(b=2, hq=4, hkv=2, lq=300, lk=257, d=256, block=(128, 128),
                          density=0.5, mask_h=True, causal=True)),
    ]
    return cases


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("family,spec", _low_precision_cuda_grid())
def test_low_precision_cuda(family, spec, dtype):
    # One key per row: softmax gives it weight 1 whatever the cap, so only the accuracy is
    # checked there.
    one_key = family is Dense and spec.lk == 1
    _check_low_precision(family(spec, dtype, "cuda"), dtype, cap_matters=not one_key)


# --------------------------------------------------------------------------------------------
# Empty inputs
# --------------------------------------------------------------------------------------------

EMPTY_CASES = [
    *[_param(Dense, FC(b=b, hq=hq, hkv=hkv, lq=lq, lk=lk, d=64, causal=causal))
      for b, hq, hkv, lq, lk, d in flash_tests.EMPTY_SHAPES[:5] for causal in (False, True)],
    _param(Packed, dict(lens_q=[0, 4, 0], lens_k=[3, 0, 0])),  # no query, no key, neither
    _param(Packed, dict(lens_q=[])),
    # 128 x 128 blocks: the CUDA tensor cores take no other.
    *[_param(Sparse, SC(b=b, hq=hq, hkv=hkv, lq=lq, lk=lk, d=d, block=(128, 128), density=1.0))
      for b, hq, hkv, lq, lk, d in sparse_tests.EMPTY_SHAPES],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family,spec", EMPTY_CASES)
def test_empty_inputs(device, family, spec, dtype):
    """B = 0, L = 0 and zero-length sequences: empty or zero outputs, lse -inf, zero grads."""
    problem = family(spec, dtype, device)
    out, lse, dq, dk, dv = _run_ours(problem, CAP)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert (out == 0).all() and torch.isneginf(lse).all()
    for g in (dq, dk, dv):
        assert (g == 0).all(), "gradients of an empty problem must be zeros"


# --------------------------------------------------------------------------------------------
# Bad softcap values
# --------------------------------------------------------------------------------------------

BAD_CAPS = [-1.0, -1e-30, math.nan, math.inf, -math.inf, 1e300, 1e-60]


def _small(family, device):
    if family is Dense:
        return Dense(FC(lq=8, lk=8, d=16), torch.float32, device, requires_grad=False)
    if family is Packed:
        return Packed(dict(lens_q=[3, 5], d=16), torch.float32, device, requires_grad=False)
    return Sparse(SC(lq=70, lk=70, d=16), torch.float32, device, requires_grad=False)


@pytest.mark.parametrize("softcap", BAD_CAPS, ids=str)
@pytest.mark.parametrize("family", [Dense, Packed, Sparse], ids=lambda f: f.__name__)
def test_bad_softcap_value(device, family, softcap):
    """Negative, non-finite, or out of float32's range (overflowing to inf, or a positive value
    rounding to 0, which would silently turn the cap off): a ValueError naming softcap."""
    problem = _small(family, device)
    with pytest.raises(ValueError, match=r"^adaattn\.\w+: softcap must be 0 \(off\) or a "
                                         r"positive finite"):
        problem.call(problem.q, problem.k, problem.v, softcap)


@pytest.mark.parametrize("softcap", ["1.0", None, True, [1.0]], ids=repr)
@pytest.mark.parametrize("family", [Dense, Packed, Sparse], ids=lambda f: f.__name__)
def test_bad_softcap_type(family, softcap):
    problem = _small(family, "cpu")
    with pytest.raises(TypeError, match=r"^adaattn\.\w+: softcap must be a float"):
        problem.call(problem.q, problem.k, problem.v, softcap)


def test_bad_softcap_backend_ops(device):
    """The forward and backward ops check softcap themselves (the autograd-less entry points)."""
    q, k, v = flash_tests._qkv(device)
    out, lse = torch.ops.adaattn.flash_fwd(q, k, v, None, None, False, -1, -1)
    with pytest.raises(ValueError, match=r"^adaattn\.flash_attn: softcap"):
        torch.ops.adaattn.flash_fwd(q, k, v, None, None, False, -1, -1, softcap=-2.0)
    with pytest.raises(ValueError, match=r"^adaattn\.flash_attn: softcap"):
        torch.ops.adaattn.flash_bwd(torch.ones_like(out), q, k, v, out, lse, None, None, False,
                                    -1, -1, False, softcap=math.nan)
    problem = _small(Sparse, device)
    mask = problem.mask
    args = (problem.q, problem.k, problem.v, mask.kv_num_blocks, mask.kv_indices, 64, 64, None,
            False)
    out, lse = torch.ops.adaattn.block_sparse_fwd(*args)
    with pytest.raises(ValueError, match=r"^adaattn\.block_sparse_attn: softcap"):
        torch.ops.adaattn.block_sparse_fwd(*args, softcap=math.inf)
    with pytest.raises(ValueError, match=r"^adaattn\.block_sparse_attn: softcap"):
        torch.ops.adaattn.block_sparse_bwd(torch.ones_like(out), problem.q, problem.k, problem.v,
                                           out, lse, mask.kv_num_blocks, mask.kv_indices,
                                           *mask.transposed(), 64, 64, None, False, "two_pass",
                                           softcap=-1.0)


# --------------------------------------------------------------------------------------------
# Registration: opcheck, torch.compile
# --------------------------------------------------------------------------------------------

OPCHECK_UTILS = flash_tests.OPCHECK_UTILS
NO_GRAD_UTILS = tuple(u for u in OPCHECK_UTILS if u != "test_autograd_registration")


def _opcheck_dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def _opcheck_backend(op, args, kwargs):
    """opcheck of an autograd-less backend op (test_autograd_registration on requires-grad
    copies, as in test_flash.py)."""
    torch.library.opcheck(op, args, kwargs, test_utils=NO_GRAD_UTILS)
    grad_args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor)
                      and a.is_floating_point() else a for a in args)
    torch.library.opcheck(op, grad_args, kwargs, test_utils=("test_autograd_registration",))


def test_opcheck_flash(device):
    cap = {"softcap": CAP}
    case = FC(b=2, hq=4, hkv=2, lq=17, lk=33, d=64, causal=True, window=(8, -1),
              seqlens=(0, 12))
    q, k, v, seqlens, dout = flash_tests.make_inputs(case, _opcheck_dtype(device), device)
    torch.library.opcheck(torch.ops.adaattn.flash_attn.default,
                          (q, k, v, seqlens, None, True, 8, -1, False), cap,
                          test_utils=OPCHECK_UTILS)
    q, k, v = (t.detach() for t in (q, k, v))
    fwd = (q, k, v, seqlens, None, True, 8, -1)
    out, lse = torch.ops.adaattn.flash_fwd(*fwd, **cap)
    _opcheck_backend(torch.ops.adaattn.flash_fwd.default, fwd, cap)
    _opcheck_backend(torch.ops.adaattn.flash_bwd.default,
                     (dout, q, k, v, out, lse) + fwd[3:] + (False,), cap)


def test_opcheck_varlen(device):
    cap = {"softcap": CAP}
    packed = Packed(dict(lens_q=[17, 0, 40], lens_k=[20, 3, 40], d=64), _opcheck_dtype(device),
                    device)
    p = packed.p
    torch.library.opcheck(torch.ops.adaattn.flash_attn.default,
                          (p.q, p.k, p.v, None, None, True, -1, -1, False, p.cu_q, p.cu_k), cap,
                          test_utils=OPCHECK_UTILS)
    q, k, v = (t.detach() for t in (p.q, p.k, p.v))
    fwd = (q, k, v, None, None, True, -1, -1, p.cu_q, p.cu_k)
    out, lse = torch.ops.adaattn.flash_fwd(*fwd, **cap)
    _opcheck_backend(torch.ops.adaattn.flash_fwd.default, fwd, cap)
    _opcheck_backend(torch.ops.adaattn.flash_bwd.default,
                     (p.dout, q, k, v, out, lse, None, None, True, -1, -1, False, p.cu_q,
                      p.cu_k), cap)


def test_opcheck_block_sparse(device):
    cap = {"softcap": CAP}
    case = SC(b=2, hq=4, hkv=2, lq=100, lk=150, d=64, block=(128, 128), density=0.5,
              mask_h=True, causal=True)
    problem = Sparse(case, _opcheck_dtype(device), device)
    q, k, v, mask = problem.q, problem.k, problem.v, problem.mask
    lists = (mask.kv_num_blocks, mask.kv_indices) + mask.transposed()
    tail = (128, 128, None, True)
    torch.library.opcheck(torch.ops.adaattn.block_sparse_attn.default,
                          (q, k, v) + lists + tail, cap, test_utils=OPCHECK_UTILS)
    q, k, v = (t.detach() for t in (q, k, v))
    fwd = (q, k, v) + lists[:2] + tail
    out, lse = torch.ops.adaattn.block_sparse_fwd(*fwd, **cap)
    _opcheck_backend(torch.ops.adaattn.block_sparse_fwd.default, fwd, cap)
    _opcheck_backend(torch.ops.adaattn.block_sparse_bwd.default,
                     (problem.dout, q, k, v, out, lse) + lists + tail, cap)


COMPILE_PROBLEMS = [
    _param(Dense, FC(b=2, hq=4, hkv=2, lq=33, lk=40, d=64, causal=True, seqlens=(33, 20))),
    _param(Packed, dict(lens_q=[17, 0, 40], lens_k=[20, 3, 40], d=64)),
    _param(Sparse, SC(b=2, hq=4, hkv=2, lq=200, lk=200, d=64, block=(128, 128), density=0.5,
                      mask_h=True, causal=True)),
]


@pytest.mark.parametrize("device,backend,dtype", [
    pytest.param("cpu", "aot_eager", torch.float32, id="cpu-aot_eager-fp32"),
    pytest.param("cuda", "inductor", torch.bfloat16, marks=pytest.mark.cuda,
                 id="cuda-inductor-bf16"),
])
@pytest.mark.parametrize("family,spec", COMPILE_PROBLEMS)
def test_torch_compile_fullgraph(family, spec, device, backend, dtype):
    """fullgraph compile of a step around each op with softcap (scores scaled up so the cap
    bites), forward and backward, against eager."""
    torch._dynamo.reset()
    problem = family(spec, dtype, device)
    weight = torch.tensor(1.5, device=device, dtype=dtype, requires_grad=True)
    inputs = (problem.q, problem.k, problem.v, weight)

    def step(q, k, v, w):
        return problem.call(q * w, k, v, 0.8).float().square().sum()

    results = []
    for fn in (step, torch.compile(step, backend=backend, fullgraph=True)):
        loss = fn(*inputs)
        results.append((loss.detach(),) + torch.autograd.grad(loss, inputs))
    for i, (c, e) in enumerate(zip(*results[::-1])):
        assert torch.isfinite(c).all(), f"tensor {i}: non-finite values"
        torch.testing.assert_close(c, e, msg=lambda m: f"tensor {i}: {m}")


def test_torch_compile_inductor_cpu():
    """The dense model of test_flash.py with softcap under inductor, against eager."""
    torch._dynamo.reset()
    problem = Dense(FC(b=2, hq=4, hkv=2, lq=33, lk=33, d=64, causal=True), torch.float32, "cpu")
    inputs = (problem.q, problem.k, problem.v)

    def step(q, k, v):
        return (problem.call(q.sin() * 3, k, v, 2.0) * 1.5).sum()

    results = []
    for fn in (step, torch.compile(step, backend="inductor", fullgraph=True)):
        loss = fn(*inputs)
        results.append((loss.detach(),) + torch.autograd.grad(loss, inputs))
    for i, (c, e) in enumerate(zip(*results[::-1])):
        torch.testing.assert_close(c, e, msg=lambda m: f"tensor {i}: {m}")
