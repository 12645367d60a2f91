"""Tests of low-rank attention (docs/ops.md) and of the flash kernels' separate value head dim
(Dv != D) that it runs on.

* adaattn.low_rank_attn: fp64 gradcheck of q, k, v and basis (CPU, CUDA exact path); fp32
  against float64 (1e-5 relative); fp16/bf16 within 2x the reference's own error for the output
  and all four gradients, at ranks that hit each tensor-core width (32, 64, 128) and ranks padded
  up to one; opcheck; torch.compile(fullgraph=True) matches eager; bad input.
* energy = 1.0 reproduces flash_attn; rotating the basis inside its span changes nothing;
  adaptive_rank_attn plans and runs at the planned rank (flash_attn itself when R = D).
* adaattn.flash_attn with Dv != D: gradcheck, the low-precision rule for every tensor-core
  (D, Dv) pair, clear errors for unsupported pairs and for lazy attention.
"""
import pytest
import torch

import adaattn
from adaattn import reference
from accuracy import FP32_RTOL, LOW_PRECISION, assert_low_precision_rule, assert_rel_close
from conftest import DEVICES
from test_rank import planted

CUDA = [pytest.param("cuda", marks=pytest.mark.cuda)]


def orthonormal_basis(b, hkv, dim, rank, device, dtype=torch.float64):
    return torch.linalg.qr(torch.randn(b, hkv, dim, rank, dtype=torch.float64))[0].to(
        device, dtype)


def grads(fn, inputs, grad_out):
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out, lse = fn(*inputs)
    out.backward(grad_out)
    return [out, lse] + [x.grad for x in inputs]


# ---------------------------------------------------------------------------------------------
# low_rank_attn
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)])
def test_gradcheck_low_rank(device, causal, heads):
    hq, hkv = heads
    q = torch.randn(1, hq, 7, 8, dtype=torch.float64, device=device, requires_grad=True)
    k = torch.randn(1, hkv, 11, 8, dtype=torch.float64, device=device, requires_grad=True)
    v = torch.randn(1, hkv, 11, 5, dtype=torch.float64, device=device, requires_grad=True)
    u = torch.randn(1, hkv, 8, 3, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *x: adaattn.low_rank_attn(*x, causal=causal), (q, k, v, u))


@pytest.mark.parametrize("device", DEVICES)
def test_low_rank_fp32(device):
    q, k = planted(2, 4, 2, 97, 64, 16, 0.1, "cpu")
    v = torch.randn(2, 2, 97, 64, dtype=torch.float64)
    u = orthonormal_basis(2, 2, 64, 16, "cpu")
    g = torch.randn(2, 4, 97, 64, dtype=torch.float64)
    expected = grads(lambda *x: reference.low_rank_attn(*x, causal=True), (q, k, v, u), g)
    ours = grads(lambda *x: adaattn.low_rank_attn(*x, causal=True, return_lse=True),
                 [t.to(device, torch.float32) for t in (q, k, v, u)], g.to(device, torch.float32))
    for name, a, e in zip(("out", "lse", "dq", "dk", "dv", "dbasis"), ours, expected):
        assert_rel_close(name, a, e, FP32_RTOL)


# (D, Dv, R, Lq, Lk): R padded to 32 (16, 20), exact widths 32 / 64, 48 padded to 64, and ranks
# above 64 that run at the full width 128.
LOW_PRECISION_CASES = [
    (128, 128, 16, 97, 128), (128, 128, 32, 128, 128), (128, 128, 48, 1000, 1025),
    (128, 128, 64, 17, 300), (128, 128, 100, 128, 97), (64, 64, 20, 97, 200),
    (64, 64, 32, 128, 128), (64, 64, 64, 1, 64),
]


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", LOW_PRECISION_CASES)
def test_low_rank_low_precision(device, dtype, causal, case):
    dim, dim_v, rank, len_q, len_k = case
    q = torch.randn(2, 4, len_q, dim, dtype=torch.float64)
    k = torch.randn(2, 2, len_k, dim, dtype=torch.float64)
    v = torch.randn(2, 2, len_k, dim_v, dtype=torch.float64)
    u = orthonormal_basis(2, 2, dim, rank, "cpu", torch.float32)
    g = torch.randn(2, 4, len_q, dim_v, dtype=torch.float64)
    ref64 = grads(lambda *x: reference.low_rank_attn(*x, causal=causal),
                  [t.to(device, torch.float64) for t in (q, k, v, u)], g.to(device))
    low = [t.to(device, dtype) for t in (q, k, v)] + [u.to(device)]
    ref_low = grads(lambda *x: reference.low_rank_attn(*x, causal=causal), low,
                    g.to(device, dtype))
    ours = grads(lambda *x: adaattn.low_rank_attn(*x, causal=causal, return_lse=True), low,
                 g.to(device, dtype))
    for name, a, r, e in zip(("out", "lse", "dq", "dk", "dv", "dbasis"), ours, ref_low, ref64):
        assert a.dtype == r.dtype, name
        assert_low_precision_rule(name, a, r, e)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_full_energy_equals_flash_attention(device, causal):
    q, k = planted(1, 4, 2, 100, 32, 8, 0.5, device)
    v = torch.randn(1, 2, 100, 32, dtype=torch.float64, device=device)
    plan = adaattn.rank_plan(q, k, energy=1.0)
    assert (plan.ranks == 32).all()
    low = adaattn.low_rank_attn(q, k, v, plan.basis.double(), causal=causal)
    full = adaattn.flash_attn(q, k, v, causal=causal)
    torch.testing.assert_close(low, full, atol=1e-5, rtol=0)  # the basis is float32
    adaptive = adaattn.adaptive_rank_attn(q, k, v, energy=1.0, causal=causal)
    assert torch.equal(adaptive, full)


@pytest.mark.parametrize("device", DEVICES)
def test_output_invariant_to_rotating_the_basis(device):
    q, k = planted(1, 2, 1, 90, 64, 16, 0.1, device)
    v = torch.randn(1, 1, 90, 64, dtype=torch.float64, device=device)
    u = orthonormal_basis(1, 1, 64, 16, device)
    rot = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64))[0].to(device)
    out, lse = adaattn.low_rank_attn(q, k, v, u, return_lse=True)
    out_rot, lse_rot = adaattn.low_rank_attn(q, k, v, u @ rot, return_lse=True)
    torch.testing.assert_close(out_rot, out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse_rot, lse, atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_adaptive_rank_runs_at_the_planned_rank(device):
    q, k = planted(2, 4, 2, 128, 64, 16, 0.01, device)
    v = torch.randn(2, 2, 128, 64, dtype=torch.float64, device=device)
    out, plan = adaattn.adaptive_rank_attn(q, k, v, energy=0.99, causal=True, return_plan=True)
    assert (plan.ranks == 16).all() and plan.basis.shape[-1] == 16
    expected, _ = reference.low_rank_attn(q, k, v, plan.basis.double(), causal=True)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_adaptive_rank_full_rank_shortcut(device):
    """Full-rank inputs skip the eigendecomposition, and only when the plan would keep every
    direction: over spectra from flat to steep, the certificate never claims rank D for a plan
    with a smaller rank, and it does fire on isotropic q, k."""
    from adaattn.rank import _check_plan_args, _full_rank_flag, _plan_gram
    fired = 0
    for decay in (0.0, 0.005, 0.01, 0.02, 0.05, 0.1):
        for energy in (0.9, 0.99, 0.999):
            scale = torch.exp(-decay * torch.arange(64, dtype=torch.float32))
            q = (torch.randn(2, 4, 256, 64) * scale).to(device)
            k = (torch.randn(2, 2, 256, 64) * scale).to(device)
            gram, exact = _plan_gram(q, k, _check_plan_args("rank_plan", q, k, energy, 16, 16))
            flag = _full_rank_flag(gram, energy, 16, 16)
            certified = flag is None or bool(flag)
            plan = adaattn.rank_plan(q, k, energy=energy)
            if certified:
                fired += 1
                assert (plan.ranks == 64).all(), (decay, energy, plan.ranks)
    assert fired > 0
    q, k, v = (torch.randn(2, 4, 256, 64, device=device) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    torch.testing.assert_close(adaattn.adaptive_rank_attn(q, k, v, causal=True),
                               adaattn.flash_attn(q, k, v, causal=True), atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_low_rank(device):
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    q = torch.randn(1, 4, 33, 64, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, 2, 40, 64, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, 2, 40, 64, device=device, dtype=dtype, requires_grad=True)
    u = torch.randn(1, 2, 64, 16, device=device, dtype=torch.float32, requires_grad=True)
    torch.library.opcheck(torch.ops.adaattn.low_rank_attn.default, (q, k, v, u),
                          {"causal": True})


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32),
                                          pytest.param("cuda", torch.bfloat16,
                                                       marks=pytest.mark.cuda)])
def test_low_rank_torch_compile_fullgraph(device, dtype):
    """A compiled call (basis learnable, as a parameter) matches eager with no graph break."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 4, 40, 64, device=device, dtype=dtype) for _ in range(3))
    u = torch.randn(2, 4, 64, 16, device=device)

    def run(fn):
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v, u)]
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
        return [out.detach()] + [t.grad for t in inputs]

    def attend(q, k, v, u):
        return adaattn.low_rank_attn(q, k, v, u, causal=True) * 2

    eager = run(attend)
    compiled = run(torch.compile(attend, backend="aot_eager", fullgraph=True))
    for i, (c, e) in enumerate(zip(compiled, eager)):
        torch.testing.assert_close(c, e, msg=lambda m: f"tensor {i}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 8), (1, 0)], ids=["empty-batch", "zero-length"])
def test_low_rank_empty_inputs(device, shape):
    """Empty batches and L = 0 give empty results; a rank-0 basis is refused (its scores would
    all be 0: uniform attention whatever q and k)."""
    b, length = shape
    q = torch.randn(b, 4, length, 64, device=device)
    k = torch.randn(b, 2, length, 64, device=device)
    v = torch.randn(b, 2, length, 32, device=device)
    u = torch.randn(b, 2, 64, 16, device=device)
    assert adaattn.low_rank_attn(q, k, v, u).shape == (b, 4, length, 32)
    assert adaattn.adaptive_rank_attn(q, k, v).shape == (b, 4, length, 32)
    q, k = torch.randn(1, 2, 5, 64, device=device), torch.randn(1, 2, 7, 64, device=device)
    v = torch.randn(1, 2, 7, 64, device=device)
    with pytest.raises(ValueError, match=r"^adaattn\.low_rank_attn: basis must have rank "
                                         r"R = basis.size\(3\) >= 1, got 0"):
        adaattn.low_rank_attn(q, k, v, torch.zeros(1, 2, 64, 0, device=device))


def test_low_rank_bad_input():
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"^adaattn\.low_rank_attn: basis must be "
                                         r"\[B, Hkv, D, R\]"):
        adaattn.low_rank_attn(q, k, k, torch.zeros(1, 4, 16, 4))
    with pytest.raises(TypeError, match=r"^adaattn\.low_rank_attn: basis must be float32 or "
                                        r"q's dtype"):
        adaattn.low_rank_attn(q, k, k, torch.zeros(1, 2, 16, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^adaattn\.low_rank_attn: .*multiple of the number "
                                         r"of kv heads"):
        adaattn.low_rank_attn(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16),
                              torch.zeros(1, 3, 16, 4))


# ---------------------------------------------------------------------------------------------
# flash_attn with a value head dim of its own
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_flash_value_dim(device, causal):
    q = torch.randn(1, 4, 9, 6, dtype=torch.float64, device=device, requires_grad=True)
    k = torch.randn(1, 2, 13, 6, dtype=torch.float64, device=device, requires_grad=True)
    v = torch.randn(1, 2, 13, 11, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *x: adaattn.flash_attn(*x, causal=causal), (q, k, v))


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("dims", [(32, 64), (32, 128), (64, 128), (64, 32), (96, 64), (20, 100)])
@pytest.mark.parametrize("shape", [(97, 128, False), (1000, 1025, True), (1, 17, True)])
def test_flash_value_dim_low_precision(device, dtype, dims, shape):
    dim, dim_v = dims
    len_q, len_k, causal = shape
    q = torch.randn(2, 4, len_q, dim, dtype=torch.float64)
    k = torch.randn(2, 2, len_k, dim, dtype=torch.float64)
    v = torch.randn(2, 2, len_k, dim_v, dtype=torch.float64)
    g = torch.randn(2, 4, len_q, dim_v, dtype=torch.float64)
    ref64 = grads(lambda *x: reference.flash_attn(*x, causal=causal),
                  [t.to(device) for t in (q, k, v)], g.to(device))
    low = [t.to(device, dtype) for t in (q, k, v)]
    ref_low = grads(lambda *x: reference.flash_attn(*x, causal=causal), low, g.to(device, dtype))
    ours = grads(lambda *x: adaattn.flash_attn(*x, causal=causal, return_lse=True), low,
                 g.to(device, dtype))
    for name, a, r, e in zip(("out", "lse", "dq", "dk", "dv"), ours, ref_low, ref64):
        assert_low_precision_rule(name, a, r, e)


@pytest.mark.parametrize("device", CUDA)
def test_flash_value_dim_past_the_variants_kernels_refused(device):
    """Every plain (D, Dv) up to 256 has a tensor-core kernel (its own or one covering it); a
    variant whose kernels stop at (128, 128), ALiBi, refuses (64, 160) naming its supported
    pairs."""
    q = torch.randn(1, 2, 8, 64, device=device, dtype=torch.bfloat16)
    v = torch.randn(1, 2, 8, 160, device=device, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"Dv = v.size\(-1\) = 160 .*supported \(D, Dv\)"):
        adaattn.flash_attn(q, q, v, alibi_slopes=torch.ones(2, device=device))


def test_lazy_rejects_value_dim():
    q = torch.randn(1, 2, 8, 16)
    v = torch.randn(1, 2, 8, 32)
    with pytest.raises(ValueError, match=r"^adaattn\.lazy_attn: .*Dv == D"):
        adaattn.lazy_attn(q, q, v, torch.zeros(2), torch.zeros(2, 4))
