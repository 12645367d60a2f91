"""Tests of the rank-planning half of adaptive-rank attention (spec §3.4): adaattn.rank_plan and
adaattn.rank_error_bound (the attention itself: tests/test_low_rank.py).

* rank_plan finds a planted rank, returns orthonormal, zero-padded bases and descending
  eigenvalues, is deterministic, and energy = 1.0 keeps all D directions (float64 inputs take
  the float64 eigh path, float32 and bfloat16 ones the sym_eig op).
* The error bound holds on random and on planted low-rank inputs, causal and not.
* shifted_cholesky_info (adaptive_rank_attn's full-rank certificate) agrees with the spectrum
  of its inputs, reports LAPACK's failing index, rejects bad input, passes opcheck.
"""
import pytest
import torch

import adaattn
from adaattn import reference


def planted(b, hq, hkv, length, dim, rank, noise, device, dtype=torch.float64):
    """q [B, Hq, L, D] and k [B, Hkv, L, D] living near one rank-`rank` subspace per kv head."""
    group = hq // hkv
    basis = torch.linalg.qr(torch.randn(b, hkv, dim, rank, dtype=torch.float64))[0]
    q = torch.randn(b, hq, length, rank, dtype=torch.float64) @ basis.repeat_interleave(
        group, dim=1).transpose(-1, -2)
    k = torch.randn(b, hkv, length, rank, dtype=torch.float64) @ basis.transpose(-1, -2)
    q = q + noise * torch.randn_like(q)
    k = k + noise * torch.randn_like(k)
    return q.to(device, dtype), k.to(device, dtype)


PLAN_DTYPES = [torch.float64, torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", PLAN_DTYPES, ids=str)
@pytest.mark.parametrize("rank", [16, 32, 48])
def test_finds_planted_rank(device, rank, dtype):
    q, k = planted(2, 4, 2, 256, 128, rank, 0.01, device, dtype)
    plan = adaattn.rank_plan(q, k, energy=0.99)
    assert plan.ranks.dtype == torch.int32 and plan.ranks.shape == (2, 2)
    assert (plan.ranks == rank).all(), plan.ranks
    assert plan.basis.shape == (2, 2, 128, rank) and plan.basis.dtype == torch.float32
    assert plan.eigenvalues.shape == (2, 2, 128)


@pytest.mark.parametrize("dtype", PLAN_DTYPES, ids=str)
def test_basis_orthonormal_padded_and_deterministic(device, dtype):
    q, k = planted(2, 4, 1, 200, 64, 16, 0.3, device, dtype)
    plan = adaattn.rank_plan(q, k, energy=0.9, min_rank=16, multiple=16)
    again = adaattn.rank_plan(q, k, energy=0.9, min_rank=16, multiple=16)
    for a, b in zip(plan, again):
        assert torch.equal(a, b)
    assert (plan.eigenvalues[..., :-1] >= plan.eigenvalues[..., 1:]).all()
    width = plan.basis.shape[-1]
    for bi in range(2):
        r = int(plan.ranks[bi, 0])
        assert r % 16 == 0 and 16 <= r <= 64
        u = plan.basis[bi, 0].double()
        # Orthonormal up to rounding each entry to float32.
        torch.testing.assert_close(u[:, :r].T @ u[:, :r], torch.eye(r, dtype=torch.float64,
                                                                    device=device),
                                   atol=64 * torch.finfo(torch.float32).eps, rtol=0)
        assert (u[:, r:width] == 0).all()


@pytest.mark.parametrize("plan_dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_full_energy_equals_flash_attention(device, causal, plan_dtype):
    q, k = planted(1, 4, 2, 100, 32, 8, 0.5, device)
    v = torch.randn(1, 2, 100, 32, dtype=torch.float64, device=device)
    plan = adaattn.rank_plan(q.to(plan_dtype), k.to(plan_dtype), energy=1.0)
    assert (plan.ranks == 32).all()
    low, _ = reference.low_rank_attn(q, k, v, plan.basis.double(), causal=causal)
    full, _ = reference.flash_attn(q, k, v, causal=causal)
    torch.testing.assert_close(low, full, atol=1e-5, rtol=0)  # the basis is float32


def exact_basis(plan):
    """The plan's subspaces with float64-orthonormal columns (QR of each head's first `rank`
    columns), zero-padded like the plan: the bound assumes an exact projector."""
    basis = torch.zeros_like(plan.basis, dtype=torch.float64)
    for b in range(basis.shape[0]):
        for h in range(basis.shape[1]):
            r = int(plan.ranks[b, h])
            basis[b, h, :, :r] = torch.linalg.qr(plan.basis[b, h, :, :r].double())[0]
    return basis


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["random", "planted"])
@pytest.mark.parametrize("energy", [0.5, 0.9, 0.99])
def test_error_bound_holds(device, kind, energy, causal):
    if kind == "random":
        q = torch.randn(2, 4, 128, 64, dtype=torch.float64, device=device)
        k = torch.randn(2, 2, 128, 64, dtype=torch.float64, device=device)
    else:
        q, k = planted(2, 4, 2, 128, 64, 16, 0.05, device)
    v = torch.randn(2, 2, 128, 64, dtype=torch.float64, device=device)
    basis = exact_basis(adaattn.rank_plan(q, k, energy=energy, min_rank=8, multiple=8))
    low, _ = reference.low_rank_attn(q, k, v, basis, causal=causal)
    full, _ = reference.flash_attn(q, k, v, causal=causal)
    error = torch.linalg.matrix_norm(low - full, ord="fro")  # [B, Hq]
    bound = adaattn.rank_error_bound(q, k, v, basis)
    assert bound.shape == (2, 4) and bound.dtype == torch.float32
    assert (error <= bound.double() * (1 + 1e-5) + 1e-9).all(), (error, bound)
    assert (error > 0).any()


def test_bad_input():
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError, match=r"^adaattn\.rank_plan: .*multiple of k's"):
        adaattn.rank_plan(q, torch.randn(1, 3, 8, 16))
    with pytest.raises(ValueError, match=r"^adaattn\.rank_plan: energy must be in \(0, 1\]"):
        adaattn.rank_plan(q, q, energy=0.0)
    with pytest.raises(ValueError, match=r"^adaattn\.rank_plan: .*must be \[B, H, L, D\]"):
        adaattn.rank_plan(q[0], q[0])
    with pytest.raises(ValueError, match=r"^adaattn\.rank_error_bound: basis must be"):
        adaattn.rank_error_bound(q, q, q, torch.zeros(1, 4, 15, 4))
    with pytest.raises(ValueError, match=r"^adaattn\.rank_plan: q and k must be finite"):
        adaattn.rank_plan(q * float("nan"), q)


def with_spectrum(values, device):
    """float32 Q diag(values) Q^T for a random orthogonal Q, one matrix per row of `values`."""
    q = torch.linalg.qr(torch.randn(values.shape[0], values.shape[1], values.shape[1],
                                    dtype=torch.float64))[0]
    return ((q * values.double().unsqueeze(-2)) @ q.mT).float().to(device)


@pytest.mark.parametrize("dim", [1, 17, 128, 160])
def test_shifted_cholesky_info(device, dim):
    """info = 0 exactly when A - rel_shift * trace(A) I is positive definite (spectra 10% clear
    of the shift either way), LAPACK's failing index on a diagonal input, NaN fails."""
    n = 6
    values = torch.rand(n, dim, dtype=torch.float64) + 1.0
    a = with_spectrum(values, device)
    trace = values.sum(-1)
    low = values.min(-1).values / trace  # rel_shift at which the smallest eigenvalue reaches 0
    ok = torch.ops.adaattn.shifted_cholesky_info(a, float(low.min() * 0.9))
    assert ok.dtype == torch.int32 and ok.shape == (n,) and ok.device == a.device
    assert (ok == 0).all(), ok
    bad = torch.ops.adaattn.shifted_cholesky_info(a, float(low.max() * 1.1))
    assert (bad > 0).all() and (bad <= dim).all(), bad
    diag = torch.diag_embed(torch.linspace(1.0, 2.0, dim)).unsqueeze(0).to(device)
    diag[0, dim // 2, dim // 2] = -1.0
    assert torch.ops.adaattn.shifted_cholesky_info(diag, 0.0).tolist() == [dim // 2 + 1]
    if device == "cpu" or dim <= 128:  # CUDA at D > 128 reports cuSOLVER's info
        diag[0, 0, 0] = float("nan")
        assert torch.ops.adaattn.shifted_cholesky_info(diag, 0.0).tolist() == [1]
    empty = torch.ops.adaattn.shifted_cholesky_info(a[:0], 0.1)
    assert empty.shape == (0,)


def test_shifted_cholesky_info_bad_input(device):
    a = torch.eye(4, device=device).expand(2, 4, 4)
    prefix = r"^adaattn\.shifted_cholesky_info: "
    with pytest.raises(TypeError, match=prefix + "a must be float32"):
        torch.ops.adaattn.shifted_cholesky_info(a.double(), 0.1)
    with pytest.raises(ValueError, match=prefix + r"a must be \[N, D, D\]"):
        torch.ops.adaattn.shifted_cholesky_info(a[:, :3], 0.1)
    with pytest.raises(ValueError, match=prefix + "a must be contiguous"):
        torch.ops.adaattn.shifted_cholesky_info(a, 0.1)
    with pytest.raises(ValueError, match=prefix + "rel_shift must be finite"):
        torch.ops.adaattn.shifted_cholesky_info(a.contiguous(), float("inf"))


def test_opcheck_shifted_cholesky_info(device):
    a = with_spectrum(torch.rand(3, 33, dtype=torch.float64) + 1.0, device)
    torch.library.opcheck(torch.ops.adaattn.shifted_cholesky_info.default, (a, 0.01))
