"""Tests of torch.ops.adaattn.sym_gram, G = q^T q + k^T k per batch entry in float32 (the op:
csrc/ops/linalg/sym_gram.cpp; the CUDA kernel: csrc/cuda/sym_gram.cu).

Against float64 products of the same 16-bit values: every entry within the float32 summation
bound R eps32 (|q|^T |q| + |k|^T |k|)_ij (R the rows summed). Exactly symmetric. Inputs: head
dims on and off the kernel's 64 / 128 tiles, row counts off its 64-row chunks, no q or k rows,
strided batches (query heads of a key head), one head with many rows (many splits) and many
heads (one split). Also CUDA agreeing with CPU, determinism, both CUDA tile forms on Hopper
(wgmma, and mma.sync with ADAATTN_DISABLE_SM90=1), rank_plan's Gram step on it, and opcheck. Bad inputs: tests/test_bad_inputs.py.
"""
import pytest
import torch

import adaattn  # noqa: F401  (loads the op library)
from adaattn import rank as rank_mod

EPS32 = torch.finfo(torch.float32).eps
DTYPES = [torch.bfloat16, torch.float16]


def rows(n, r, d, dtype, device, scale=1.0):
    return (torch.randn(n, r, d, device=device) * scale).to(dtype)


def check_gram(g, q, k):
    """g against float64 products of q and k's values, within the float32 summation bound."""
    n, d = q.shape[0], q.shape[2]
    assert g.shape == (n, d, d) and g.dtype == torch.float32
    assert torch.equal(g, g.mT), "not exactly symmetric"
    q64, k64 = q.double().cpu(), k.double().cpu()
    ref = q64.mT @ q64 + k64.mT @ k64
    bound = q64.abs().mT @ q64.abs() + k64.abs().mT @ k64.abs()
    summed = max(q.shape[1] + k.shape[1], 1)
    err = (g.double().cpu() - ref).abs()
    assert (err <= summed * EPS32 * bound + 1e-30).all(), (err / bound.clamp(min=1e-30)).max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [8, 64, 72, 128])
@pytest.mark.parametrize("rq, rk", [(256, 256), (100, 37), (0, 70), (5, 0), (0, 0)])
def test_against_float64(device, dtype, d, rq, rk):
    q, k = rows(3, rq, d, dtype, device), rows(3, rk, d, dtype, device, 2.0)
    check_gram(torch.ops.adaattn.sym_gram(q, k), q, k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_batches(device, dtype):
    """A key head with its group of query heads: q [B, H, L, D] viewed as [B * Hkv, G * L, D],
    and batch strides past the rows (a slice of a larger cache)."""
    q4 = rows(2, 4 * 96, 64, dtype, device).reshape(2, 4, 96, 64)
    q = q4.reshape(2 * 2, 2 * 96, 64)
    cache = rows(4, 300, 64, dtype, device)
    k = cache[:, :200]
    assert not k.is_contiguous()
    check_gram(torch.ops.adaattn.sym_gram(q, k), q, k)


@pytest.mark.parametrize("n, r", [(1, 8192), (300, 64)])
def test_split_counts(device, n, r):
    """One head with many row chunks (split over the GPU) and more heads than a wave of CTAs."""
    q, k = rows(n, r, 128, torch.bfloat16, device), rows(n, r // 2, 128, torch.bfloat16, device)
    check_gram(torch.ops.adaattn.sym_gram(q, k), q, k)


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_matches_cpu_and_is_deterministic(d):
    q, k = rows(4, 1000, d, torch.bfloat16, "cpu"), rows(4, 777, d, torch.bfloat16, "cpu")
    cpu = torch.ops.adaattn.sym_gram(q, k)
    cuda = torch.ops.adaattn.sym_gram(q.cuda(), k.cuda())
    assert torch.equal(cuda, torch.ops.adaattn.sym_gram(q.cuda(), k.cuda()))
    scale = (q.double().abs().mT @ q.double().abs() + k.double().abs().mT @ k.double().abs())
    assert ((cuda.cpu().double() - cpu.double()).abs() <= 2 * 1777 * EPS32 * scale).all()


@pytest.mark.cuda
@pytest.mark.parametrize("d", [72, 128])
@pytest.mark.parametrize("rq, rk", [(1000, 777), (100, 37), (0, 70)])
def test_mma_sync_tiles_on_hopper(monkeypatch, d, rq, rk):
    """On a Hopper GPU the D > 64 Gram runs the wgmma tiles; ADAATTN_DISABLE_SM90=1 selects the
    mma.sync tiles that other GPUs run. Both within the bound, each deterministic."""
    q, k = rows(3, rq, d, torch.bfloat16, "cuda"), rows(3, rk, d, torch.bfloat16, "cuda", 2.0)
    for disable in ("0", "1"):
        monkeypatch.setenv("ADAATTN_DISABLE_SM90", disable)
        g = torch.ops.adaattn.sym_gram(q, k)
        check_gram(g, q, k)
        assert torch.equal(g, torch.ops.adaattn.sym_gram(q, k))


def test_rank_plan_gram_step(device):
    """rank_plan's Gram of bf16 [B, H, L, D] q and [B, Hkv, L, D] k is sym_gram's."""
    q = torch.randn(2, 4, 80, 64, device=device).bfloat16()
    k = torch.randn(2, 2, 80, 64, device=device).bfloat16()
    gram, exact = rank_mod._plan_gram(q, k, 2)
    assert not exact
    expected = torch.ops.adaattn.sym_gram(q.reshape(4, 160, 64), k.reshape(4, 80, 64))
    assert torch.equal(gram.reshape(4, 64, 64), expected)


@pytest.mark.parametrize("d", [64, 128])
def test_non_finite_propagates(device, d):
    """A NaN or inf row entry reaches its diagonal entry of G (never a silent finite value)."""
    q, k = rows(2, 100, d, torch.bfloat16, device), rows(2, 70, d, torch.bfloat16, device)
    q[0, 5, 3] = float("nan")
    k[1, 9, 11] = float("inf")
    g = torch.ops.adaattn.sym_gram(q, k).cpu()
    assert torch.isnan(g[0, 3, 3]) and torch.isinf(g[1, 11, 11])
    assert torch.isfinite(g[0].diagonal()[torch.arange(d) != 3]).all()


@pytest.mark.parametrize("d", [16, 128])
def test_opcheck(device, d):
    q, k = rows(2, 70, d, torch.bfloat16, device), rows(2, 33, d, torch.bfloat16, device)
    torch.library.opcheck(torch.ops.adaattn.sym_gram.default, (q, k))
