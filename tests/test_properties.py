"""Property-based tests (hypothesis): random shapes, strides, GQA ratios, windows, padding and
dtypes for flash_attn, lazy_attn and the varlen ops against ``adaattn.reference`` on the CPU.

The reference runs in float64 on the same (rounded) inputs; float64 results must agree to
1e-10, float32 ones within FP32_RTOL relative error (tests/accuracy.py), outputs and gradients.
Examples are derandomized (the same draws in every run) so a failure reproduces.
"""
import pytest
import torch

import adaattn
from adaattn import reference

from accuracy import FP32_RTOL, assert_rel_close

hypothesis = pytest.importorskip("hypothesis", reason="pip install -r requirements-dev.txt")
st = hypothesis.strategies

SETTINGS = hypothesis.settings(max_examples=100, deadline=None, derandomize=True,
                               suppress_health_check=[hypothesis.HealthCheck.too_slow])
TOL = {torch.float64: 1e-10, torch.float32: FP32_RTOL}


def _operand(draw, shape, dtype, transposed):
    """A leaf of `shape` [B, H, L, D] drawn from a seed; a (B, L, H, D) storage viewed as
    .transpose(1, 2) when `transposed` (strides of a projection's output, no copy)."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    b, h, length, d = shape
    if transposed:
        t = torch.randn(b, length, h, d, generator=gen, dtype=torch.float64).transpose(1, 2)
    else:
        t = torch.randn(b, h, length, d, generator=gen, dtype=torch.float64)
    return t.to(dtype).requires_grad_(True)


def _check(name, ours, expected, grads, expected_grads, dtype):
    assert_rel_close(name, ours, expected, TOL[dtype])
    for g_name, a, e in zip(("dq", "dk", "dv", "dtau", "dbias"), grads, expected_grads):
        assert_rel_close(f"{name} {g_name}", a, e, 1e-5 if g_name in ("dtau", "dbias")
                         else TOL[dtype])


@st.composite
def flash_problems(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    b, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    hq = hkv * draw(st.sampled_from([1, 2, 4]))
    lq, lk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    d, dv = draw(st.integers(1, 48)), draw(st.integers(1, 48))
    transposed = draw(st.booleans())
    q = _operand(draw, (b, hq, lq, d), dtype, transposed)
    k = _operand(draw, (b, hkv, lk, d), dtype, transposed)
    v = _operand(draw, (b, hkv, lk, dv), dtype, transposed)
    kw = dict(causal=draw(st.booleans()),
              window=(draw(st.integers(-1, 12)), draw(st.integers(-1, 12))),
              softcap=draw(st.sampled_from([0.0, 2.5])))
    if draw(st.booleans()):
        kw["seqlens"] = torch.tensor(draw(st.lists(st.integers(0, max(lq, lk)), min_size=b,
                                                   max_size=b)), dtype=torch.int32)
    return q, k, v, kw


@SETTINGS
@hypothesis.given(flash_problems())
def test_flash_attn_matches_reference(problem):
    q, k, v, kw = problem
    out, lse = adaattn.flash_attn(q, k, v, return_lse=True, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref_out, ref_lse = reference.flash_attn(*leaves, **kw)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.double())
    _check("out", out, ref_out, grads, ref_grads, q.dtype)
    assert_rel_close("lse", lse, ref_lse, 1e-5)


@st.composite
def lazy_problems(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    b, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    hq = hkv * draw(st.sampled_from([1, 2]))
    lk = draw(st.integers(1, 40))
    lq = draw(st.integers(1, lk))
    d = draw(st.integers(1, 40))
    transposed = draw(st.booleans())
    q = _operand(draw, (b, hq, lq, d), dtype, transposed)
    k = _operand(draw, (b, hkv, lk, d), dtype, transposed)
    v = _operand(draw, (b, hkv, lk, d), dtype, transposed)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    tau = (draw(st.sampled_from([-1.0, 0.5])) * torch.rand(hq, generator=gen)).requires_grad_()
    bias = (0.3 * torch.randn(hq, draw(st.integers(1, 16)), generator=gen)).requires_grad_()
    return q, k, v, tau, bias


@SETTINGS
@hypothesis.given(lazy_problems())
def test_lazy_attn_matches_reference(problem):
    q, k, v, tau, bias = problem
    out, lse = adaattn.lazy_attn(q, k, v, tau, bias, return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, tau, bias), dout)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    params = [t.detach().requires_grad_(True) for t in (tau, bias)]
    ref_out, ref_lse = reference.lazy_attn(*leaves, *params)
    ref_grads = torch.autograd.grad(ref_out, leaves + params, dout.double())
    _check("out", out, ref_out, grads, ref_grads, q.dtype)
    assert_rel_close("lse", lse, ref_lse, 1e-5)


@st.composite
def packed_problems(draw, self_attention=False):
    """Packed sequences (zero lengths included) of one query and one key length each (the same
    with `self_attention`)."""
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    n = draw(st.integers(0, 4))
    lens_q = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    lens_k = lens_q if self_attention else draw(st.lists(st.integers(0, 20), min_size=n,
                                                          max_size=n))
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.sampled_from([1, 2, 4]))
    d = draw(st.integers(1, 40))
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = _operand(draw, (1, hq, int(cu_q[-1]), d), dtype, True)[0].transpose(0, 1)
    k = _operand(draw, (1, hkv, int(cu_k[-1]), d), dtype, True)[0].transpose(0, 1)
    v = _operand(draw, (1, hkv, int(cu_k[-1]), d), dtype, True)[0].transpose(0, 1)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    tau, bias = -torch.rand(hq, generator=gen), 0.3 * torch.randn(hq, 5, generator=gen)
    return q, k, v, cu_q, cu_k, draw(st.booleans()), tau, bias


@SETTINGS
@hypothesis.given(packed_problems())
def test_flash_attn_varlen_matches_reference(problem):
    q, k, v, cu_q, cu_k, causal, _, _ = problem
    out, lse = adaattn.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
    ref_out, ref_lse = reference.flash_attn_varlen(*(t.detach().double() for t in (q, k, v)),
                                                   cu_q, cu_k, causal=causal)
    assert_rel_close("out", out, ref_out, TOL[q.dtype])
    assert_rel_close("lse", lse, ref_lse, 1e-5)


@SETTINGS
@hypothesis.given(packed_problems(self_attention=True))
def test_lazy_attn_varlen_matches_reference(problem):
    q, k, v, cu_q, _, _, tau, bias = problem
    out, lse = adaattn.lazy_attn_varlen(q, k, v, cu_q, tau, bias, return_lse=True)
    ref_out, ref_lse = reference.lazy_attn_varlen(*(t.detach().double() for t in (q, k, v)),
                                                  cu_q, tau, bias)
    assert_rel_close("out", out, ref_out, TOL[q.dtype])
    assert_rel_close("lse", lse, ref_lse, 1e-5)
