"""Tests of the packed (varlen) layout: adaattn.flash_attn_varlen and adaattn.lazy_attn_varlen
(docs/ops.md; issue "variable-length packed batches").

* A packed call equals one dense call per sequence of the same op, bit for bit, for the output,
  lse and every gradient (the kernels tile each sequence exactly as a dense call would); tau/bias
  gradients, which sum over sequences, match the per-sequence sum to float32 rounding.
* Against the float64 reference: fp64 gradcheck, fp32 relative 1e-5, fp16/bf16 the 2x rule.
* Perturbing one sequence leaves every other sequence's output and gradients bit-identical.
* Zero-length sequences, length 1, Tq != Tk per sequence, N = 0; bad cu_seqlens; opcheck;
  torch.compile with dynamic shapes does not recompile when the packing changes.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

import adaattn
from adaattn import reference

from accuracy import FP32_RTOL, LOW_PRECISION, assert_low_precision_rule, assert_rel_close
from test_flash import OPCHECK_UTILS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = pytest.param("cuda", marks=pytest.mark.cuda)


def _cu(lengths, device):
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def _packed(total, heads, d, dtype, device, transposed=False):
    """Seeded ``[T, H, D]`` draw; ``transposed`` gives a non-contiguous ``[H, T, D]`` storage."""
    if transposed:
        t = torch.randn(heads, total, d, dtype=torch.float64).to(device, dtype).transpose(0, 1)
    else:
        t = torch.randn(total, heads, d, dtype=torch.float64).to(device, dtype)
    return t.detach().requires_grad_()


def _dense(t, a, b):
    """Rows ``[a, b)`` of a packed ``[T, H, D]`` tensor as a dense ``[1, H, L, D]`` view."""
    return t[a:b].transpose(0, 1).unsqueeze(0)


class Problem:
    """A packed problem: lengths per sequence (q and k), heads, head dim, dtype, device."""

    def __init__(self, lens_q, lens_k=None, hq=4, hkv=2, d=32, dtype=torch.float32,
                 device="cpu", transposed=False, causal=True, window=(-1, -1)):
        self.lens_q = list(lens_q)
        self.lens_k = list(lens_q if lens_k is None else lens_k)
        self.causal, self.window = causal, window
        self.cu_q, self.cu_k = _cu(self.lens_q, device), _cu(self.lens_k, device)
        tq, tk = sum(self.lens_q), sum(self.lens_k)
        self.q = _packed(tq, hq, d, dtype, device, transposed)
        self.k = _packed(tk, hkv, d, dtype, device, transposed)
        self.v = _packed(tk, hkv, d, dtype, device, transposed)
        self.dout = torch.randn(tq, hq, d, dtype=torch.float64).to(device, dtype)
        self.tau = (torch.randn(hq, dtype=torch.float64) * 2).float().to(device).requires_grad_()
        self.bias = (torch.randn(hq, 7, dtype=torch.float64)).float().to(device).requires_grad_()

    def bounds(self, n):
        a, b = self.cu_q[n].item(), self.cu_q[n + 1].item()
        c, e = self.cu_k[n].item(), self.cu_k[n + 1].item()
        return a, b, c, e


def _flash_packed(p):
    out, lse = adaattn.flash_attn_varlen(p.q, p.k, p.v, p.cu_q, p.cu_k, causal=p.causal,
                                         window=p.window, return_lse=True)
    grads = torch.autograd.grad(out, (p.q, p.k, p.v), p.dout)
    return (out, lse) + grads


def _lazy_packed(p):
    out, lse = adaattn.lazy_attn_varlen(p.q, p.k, p.v, p.cu_q, p.tau, p.bias, return_lse=True)
    grads = torch.autograd.grad(out, (p.q, p.k, p.v, p.tau, p.bias), p.dout)
    return (out, lse) + grads


# --------------------------------------------------------------------------------------------
# Packed == dense per sequence (bit-identical)
# --------------------------------------------------------------------------------------------

EQUIVALENCE = [
    dict(lens_q=[17, 0, 1, 64, 130, 5]),
    dict(lens_q=[3, 40, 0, 9], lens_k=[10, 40, 6, 2]),  # cross attention, Tq != Tk per sequence
    dict(lens_q=[200, 77], causal=False, window=(16, 3), transposed=True),
    dict(lens_q=[65, 129, 1], hq=8, hkv=1, d=64),
]


def _dtypes(device):
    return [torch.float64, torch.float32] + (list(LOW_PRECISION) if device == "cuda" else [])


@pytest.mark.parametrize("kwargs", EQUIVALENCE, ids=str)
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_flash_packed_equals_dense_per_sequence(device, kwargs):
    for dtype in _dtypes(device):
        d = kwargs.get("d", 32) if dtype in (torch.float64, torch.float32) else 64
        p = Problem(**{**kwargs, "d": d}, dtype=dtype, device=device)
        out, lse, dq, dk, dv = _flash_packed(p)
        assert out.shape == p.q.shape and lse.shape == (p.q.shape[1], p.q.shape[0])
        for n in range(len(p.lens_q)):
            a, b, c, e = p.bounds(n)
            qn, kn, vn = (_dense(t.detach(), *r).requires_grad_()
                          for t, r in ((p.q, (a, b)), (p.k, (c, e)), (p.v, (c, e))))
            ref = adaattn.flash_attn(qn, kn, vn, causal=p.causal, window=p.window,
                                     return_lse=True)
            ref_grads = torch.autograd.grad(ref[0], (qn, kn, vn), _dense(p.dout, a, b)) \
                if b > a else (torch.zeros_like(qn), torch.zeros_like(kn), torch.zeros_like(vn))
            got = (_dense(out, a, b), lse[:, a:b].unsqueeze(0), _dense(dq, a, b),
                   _dense(dk, c, e), _dense(dv, c, e))
            for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got,
                                  (ref[0], ref[1]) + tuple(ref_grads)):
                assert torch.equal(x, y), f"{dtype} sequence {n}: {name} differs"


@pytest.mark.parametrize("kwargs", [EQUIVALENCE[0], EQUIVALENCE[3]], ids=str)
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_lazy_packed_equals_dense_per_sequence(device, kwargs):
    for dtype in _dtypes(device):
        d = kwargs.get("d", 32) if dtype in (torch.float64, torch.float32) else 64
        p = Problem(**{**kwargs, "d": d}, dtype=dtype, device=device)
        out, lse, dq, dk, dv, dtau, dbias = _lazy_packed(p)
        dtau_sum, dbias_sum = torch.zeros_like(dtau), torch.zeros_like(dbias)
        for n in range(len(p.lens_q)):
            a, b, _, _ = p.bounds(n)
            if b == a:
                continue
            qn, kn, vn = (_dense(t.detach(), a, b).requires_grad_() for t in (p.q, p.k, p.v))
            ref_out, ref_lse = adaattn.lazy_attn(qn, kn, vn, p.tau, p.bias, return_lse=True)
            grads = torch.autograd.grad(ref_out, (qn, kn, vn, p.tau, p.bias),
                                        _dense(p.dout, a, b))
            dtau_sum += grads[3]
            dbias_sum += grads[4]
            got = (_dense(out, a, b), lse[:, a:b].unsqueeze(0), _dense(dq, a, b),
                   _dense(dk, a, b), _dense(dv, a, b))
            for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got,
                                  (ref_out, ref_lse) + grads[:3]):
                assert torch.equal(x, y), f"{dtype} sequence {n}: {name} differs"
        # Summed over sequences in a different order: equal up to float32 rounding.
        for name, x, y in (("dtau", dtau, dtau_sum), ("dbias", dbias, dbias_sum)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5 * y.abs().max().item(),
                                       msg=lambda m: f"{dtype} {name}: {m}")


# --------------------------------------------------------------------------------------------
# Against the float64 reference
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_flash_varlen_gradcheck_fp64(device):
    p = Problem([3, 0, 5, 1], [4, 2, 5, 3], hq=2, hkv=1, d=4, dtype=torch.float64, device=device)
    cu_q, cu_k = p.cu_q, p.cu_k
    assert torch.autograd.gradcheck(
        lambda q, k, v: adaattn.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=True),
        (p.q, p.k, p.v))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_lazy_varlen_gradcheck_fp64(device):
    p = Problem([4, 0, 6, 1], hq=2, hkv=1, d=4, dtype=torch.float64, device=device)
    # tau > 0 keeps every weight away from the clip's kink, which finite differences of the
    # float32 parameters (step 1e-3) could cross; clipping itself is covered bit-exactly by the
    # packed-equals-dense tests and by tests/test_lazy.py.
    tau = torch.tensor([0.5, 1.3], dtype=torch.float32, device=device)
    bias = p.bias.detach()
    cu = p.cu_q
    assert torch.autograd.gradcheck(
        lambda q, k, v: adaattn.lazy_attn_varlen(q, k, v, cu, tau, bias), (p.q, p.k, p.v))
    q, k, v = (t.detach() for t in (p.q, p.k, p.v))
    params = (tau.double().requires_grad_(), bias.double().requires_grad_())
    assert torch.autograd.gradcheck(
        lambda t, b: adaattn.lazy_attn_varlen(q, k, v, cu, t.float(), b.float()), params,
        eps=1e-3)


def _reference_flash(p, dtype):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (p.q, p.k, p.v))
    out, lse = reference.flash_attn_varlen(q, k, v, p.cu_q, p.cu_k, causal=p.causal,
                                           window=p.window)
    return (out, lse) + torch.autograd.grad(out, (q, k, v), p.dout.to(dtype))


def _reference_lazy(p, dtype):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (p.q, p.k, p.v))
    tau, bias = (t.detach().requires_grad_() for t in (p.tau, p.bias))
    upcast = dtype == torch.float64
    out, lse = reference.lazy_attn_varlen(q, k, v, p.cu_q, tau, bias, upcast=upcast)
    return (out, lse) + torch.autograd.grad(out, (q, k, v, tau, bias), p.dout.to(dtype))


REFERENCE_CASES = [
    dict(lens_q=[100, 0, 1, 257, 33]),
    dict(lens_q=[31, 300, 2], lens_k=[64, 300, 9], hq=8, hkv=2),
]


@pytest.mark.parametrize("kwargs", REFERENCE_CASES, ids=str)
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_flash_varlen_fp32(device, kwargs):
    p = Problem(**kwargs, d=64, dtype=torch.float32, device=device)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), _flash_packed(p),
                          _reference_flash(p, torch.float64)):
        assert_rel_close(name, x, y, FP32_RTOL)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("kwargs", REFERENCE_CASES, ids=str)
def test_flash_varlen_low_precision_cuda(kwargs, d, dtype):
    p = Problem(**kwargs, d=d, dtype=dtype, device="cuda")
    ours = _flash_packed(p)
    low, ref64 = _reference_flash(p, dtype), _reference_flash(p, torch.float64)
    for name, x, lo, y in zip(("out", "lse", "dq", "dk", "dv"), ours, low, ref64):
        assert_low_precision_rule(name, x, lo, y)


LAZY_REFERENCE = dict(lens_q=[100, 0, 1, 257, 33], hq=4, hkv=2)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_lazy_varlen_fp32(device):
    p = Problem(**LAZY_REFERENCE, d=64, dtype=torch.float32, device=device)
    names = ("out", "lse", "dq", "dk", "dv", "dtau", "dbias")
    for name, x, y in zip(names, _lazy_packed(p), _reference_lazy(p, torch.float64)):
        assert_rel_close(name, x, y, FP32_RTOL)


@pytest.mark.cuda
@pytest.mark.parametrize("kernels", ["default", "sm80"])
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_lazy_varlen_low_precision_cuda(d, dtype, kernels, monkeypatch):
    """"sm80" selects the mma.sync kernels on a Hopper GPU (ADAATTN_DISABLE_SM90=1)."""
    if kernels == "sm80":
        monkeypatch.setenv("ADAATTN_DISABLE_SM90", "1")
    p = Problem(**LAZY_REFERENCE, d=d, dtype=dtype, device="cuda")
    names = ("out", "lse", "dq", "dk", "dv", "dtau", "dbias")
    ours = _lazy_packed(p)
    low, ref64 = _reference_lazy(p, dtype), _reference_lazy(p, torch.float64)
    for name, x, lo, y in zip(names, ours, low, ref64):
        assert_low_precision_rule(name, x, lo, y)


# --------------------------------------------------------------------------------------------
# Isolation, edge cases, bad input
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["flash", "lazy"])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_perturbing_one_sequence_leaves_the_others_bit_identical(device, family):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lens = [70, 1, 0, 150, 64]
    run = _flash_packed if family == "flash" else _lazy_packed
    p = Problem(lens, d=64, dtype=dtype, device=device)
    base = run(p)
    a, b, _, _ = p.bounds(3)
    with torch.no_grad():
        for t in (p.q, p.k, p.v):
            t[a:b] += 1.0
        p.dout[a:b] *= -2.0
    moved = run(p)
    # Row-indexed results (out, lse, dq, dk, dv): every row outside sequence 3 is unchanged.
    keep = torch.ones(p.q.shape[0], dtype=torch.bool, device=device)
    keep[a:b] = False
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), base, moved):
        x, y = (x[:, keep] if name == "lse" else x[keep]), (y[:, keep] if name == "lse"
                                                             else y[keep])
        assert torch.equal(x, y), f"{name} of other sequences changed"
        assert not torch.isnan(x).any()


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_no_sequences_and_empty_tensors(device):
    q = torch.zeros(0, 2, 16, device=device, requires_grad=True)
    cu = torch.zeros(1, dtype=torch.int32, device=device)
    out, lse = adaattn.flash_attn_varlen(q, q, q, cu, cu, causal=True, return_lse=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    out.sum().backward()
    assert q.grad.shape == q.shape
    tau = torch.zeros(2, device=device)
    bias = torch.zeros(2, 4, device=device)
    out = adaattn.lazy_attn_varlen(q, q, q, cu, tau, bias)
    assert out.shape == (0, 2, 16)
    # Sequences that all have zero keys: out 0, lse -inf, zero gradients.
    qs = torch.randn(5, 2, 16, device=device, requires_grad=True)
    ks = torch.zeros(0, 2, 16, device=device, requires_grad=True)
    out, lse = adaattn.flash_attn_varlen(qs, ks, ks, _cu([2, 3], device), _cu([0, 0], device),
                                         return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    (dq,) = torch.autograd.grad(out.sum(), (qs,))
    assert torch.equal(dq, torch.zeros_like(dq))


def _bad_cu(kind, device):
    q = torch.randn(6, 2, 16, device=device)
    good = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
    cu = {
        "decreasing": torch.tensor([0, 4, 2, 6], dtype=torch.int32, device=device),
        "not_from_zero": torch.tensor([1, 2, 6], dtype=torch.int32, device=device),
        "wrong_end": torch.tensor([0, 2, 5], dtype=torch.int32, device=device),
        "int64": good.long(),
        "rank2": good.view(1, 3),
        "length_mismatch": torch.tensor([0, 6], dtype=torch.int32, device=device),
    }[kind]
    cu_k = good if kind == "length_mismatch" else cu
    return lambda: adaattn.flash_attn_varlen(q, q, q, cu, cu_k)


BAD_CU = {
    "decreasing": (ValueError, "cu_seqlens_q must be non-decreasing"),
    "not_from_zero": (ValueError, "cu_seqlens_q must start at 0"),
    "wrong_end": (ValueError, "cu_seqlens_q must end at the packed length 6"),
    "int64": (TypeError, "cu_seqlens_q must be int32"),
    "rank2": (ValueError, "cu_seqlens_q must have shape [N + 1]"),
    "length_mismatch": (ValueError, "must have the same length N + 1"),
}


@pytest.mark.parametrize("kind", list(BAD_CU))
def test_bad_cu_seqlens_cpu(kind):
    error, message = BAD_CU[kind]
    with pytest.raises(error, match=r"^adaattn\.flash_attn_varlen: .*" + re.escape(message)):
        _bad_cu(kind, "cpu")()


def test_bad_packed_shapes():
    q = torch.randn(6, 2, 16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError,
                       match=r"^adaattn\.flash_attn_varlen: q must have 3 dims \[T, H, D\]"):
        adaattn.flash_attn_varlen(q.unsqueeze(0), q, q, cu, cu)
    with pytest.raises(ValueError, match=r"^adaattn\.flash_attn_varlen: .*exclude each other"):
        adaattn.ops.flash_attn(q, q, q, torch.tensor([6], dtype=torch.int32), None, False, -1, -1,
                               False, cu, cu)
    with pytest.raises(ValueError, match=r"^adaattn\.lazy_attn_varlen: .*same number of rows T"):
        adaattn.lazy_attn_varlen(q, q[:5], q[:5], cu, torch.zeros(2), torch.zeros(2, 3))


@pytest.mark.cuda
def test_bad_cu_seqlens_cuda():
    """On CUDA values are checked only on request (a sync); without the request a malformed
    cu_seqlens is clamped by the kernels and never faults. The check runs in a fresh process so
    the environment variable is read as a user would set it."""
    for kind in ("decreasing", "wrong_end"):
        out = _bad_cu(kind, "cuda")()
        torch.cuda.synchronize()
        assert out.shape == (6, 2, 16)
    with pytest.raises(RuntimeError,
                       match=r"^adaattn\.flash_attn_varlen: cu_seqlens_q must be on q's device"):
        q = torch.randn(6, 2, 16, device="cuda")
        cu = torch.tensor([0, 6], dtype=torch.int32)
        adaattn.flash_attn_varlen(q, q, q, cu, cu)
    code = ("import torch, adaattn\n"
            "q = torch.randn(6, 2, 16, device='cuda')\n"
            "cu = torch.tensor([0, 4, 2, 6], dtype=torch.int32, device='cuda')\n"
            "try:\n"
            "    adaattn.flash_attn_varlen(q, q, q, cu, cu)\n"
            "except ValueError as e:\n"
            "    print('ERROR', 'non-decreasing' in str(e))\n")
    env = dict(os.environ, ADAATTN_CHECK_INPUTS="1", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert "ERROR True" in res.stdout, res.stdout + res.stderr


# --------------------------------------------------------------------------------------------
# Registration: opcheck, torch.compile with a changing packing, nn modules
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_opcheck_varlen(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    p = Problem([17, 0, 40], [20, 3, 40], d=64, dtype=dtype, device=device)
    torch.library.opcheck(torch.ops.adaattn.flash_attn.default,
                          (p.q, p.k, p.v, None, None, True, -1, -1, False, p.cu_q, p.cu_k),
                          test_utils=OPCHECK_UTILS)
    lazy = Problem([17, 0, 40], d=64, dtype=dtype, device=device)
    torch.library.opcheck(torch.ops.adaattn.lazy_attn.default,
                          (lazy.q, lazy.k, lazy.v, lazy.tau, lazy.bias, None, None, False,
                           lazy.cu_q),
                          test_utils=OPCHECK_UTILS)
    q, k, v = (t.detach() for t in (p.q, p.k, p.v))
    fwd = (q, k, v, None, None, True, -1, -1, p.cu_q, p.cu_k)
    out, lse = torch.ops.adaattn.flash_fwd(*fwd)
    bwd = (p.dout, q, k, v, out, lse, None, None, True, -1, -1, False, p.cu_q, p.cu_k)
    no_grad_utils = tuple(u for u in OPCHECK_UTILS if u != "test_autograd_registration")
    torch.library.opcheck(torch.ops.adaattn.flash_fwd.default, fwd, test_utils=no_grad_utils)
    torch.library.opcheck(torch.ops.adaattn.flash_bwd.default, bwd, test_utils=no_grad_utils)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_compile_new_packing_does_not_recompile(device):
    """A training step compiled with dynamic shapes: three different packings (different token
    counts and numbers of documents) compile one graph, and match eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = adaattn.nn.FlashSelfAttention(256, 4, 2, causal=True).to(device, dtype)
    lazy = adaattn.nn.LazyAttention(4, window=16).to(device)

    def forward(x, cu):
        h = model(x, cu_seqlens=cu)
        t = h.shape[0]
        heads = h.view(t, 4, 64)
        out = lazy(heads, heads[:, ::2], heads[:, 1::2], cu_seqlens=cu)
        return out.float().square().mean()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(forward, backend=counter, fullgraph=True, dynamic=True)
    params = list(model.parameters()) + list(lazy.parameters())
    for lengths in ([40, 88, 7], [5, 60, 61, 30, 2], [123, 9]):
        x = torch.randn(sum(lengths), 256, device=device, dtype=dtype)
        cu = _cu(lengths, device)
        results = []
        for fn in (forward, compiled):
            for p in params:
                p.grad = None
            loss = fn(x, cu)
            loss.backward()
            results.append([loss.detach()] + [p.grad.clone() for p in params])
        for got, want in zip(*results[::-1]):
            torch.testing.assert_close(got, want)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} graphs for 3 packings"


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_nn_modules_accept_packed_input(device):
    dtype = torch.float32
    lengths = [9, 0, 23]
    cu = _cu(lengths, device)
    model = adaattn.nn.FlashSelfAttention(64, 4, causal=True).to(device, dtype)
    x = torch.randn(sum(lengths), 64, device=device, dtype=dtype)
    packed = model(x, cu_seqlens=cu)
    for n in (0, 2):
        a, b = cu[n].item(), cu[n + 1].item()
        torch.testing.assert_close(packed[a:b], model(x[a:b].unsqueeze(0))[0])
    lazy = adaattn.nn.LazyAttention(4, window=8).to(device)
    q = torch.randn(sum(lengths), 4, 16, device=device)
    out = lazy(q, q, q, cu_seqlens=cu)
    a, b = cu[2].item(), cu[3].item()
    dense = lazy(_dense(q, a, b), _dense(q, a, b), _dense(q, a, b))
    torch.testing.assert_close(_dense(out, a, b), dense)
    with pytest.raises(ValueError, match=r"^adaattn\.nn\.LazyAttention: q must be .*packed"):
        lazy(q.unsqueeze(0), q, q, cu_seqlens=cu)
