"""Tests of torch.ops.adaattn.sym_sketch_top, rank_plan(method="sketch")'s op (the algorithm:
csrc/ops/linalg/sym_sketch.cpp).

Against the same steps in float64 torch ops (adaattn.rank._sketch_from_gram on a float64 Gram
matrix): the same ranks and decisions, Rayleigh quotients to 1e-5 of the trace, the same kept
subspace (projectors to 1e-4). Every result: kept columns orthonormal to 64 float32 epsilons, the
other columns 0, the quotients equal to u^T A u, the values summing to the trace, the kept
columns holding `energy` of the trace when decided, ranks never below sym_eig_top's (the exact
rule). Inputs: planted spectra with a gap, decaying spectra, exactly low-rank and zero matrices,
D and P off the kernel's padded sizes. Also determinism (bitwise, independent of the batch
position), CUDA agreeing with CPU, errors naming the argument, an empty batch and opcheck.
"""
import pytest
import torch

import adaattn  # noqa: F401  (loads the op library)
from adaattn import rank as rank_mod

EPS32 = torch.finfo(torch.float32).eps
SHAPES = [(128, 64), (100, 56), (64, 40), (17, 9)]  # (D, P)


def omega(dim, width, device):
    return rank_mod._test_matrix(dim, width, torch.device(device), torch.float32)


def sketch(a, width, energy, min_rank=16, multiple=16, power_iters=1, oversample=8):
    return torch.ops.adaattn.sym_sketch_top(a, omega(a.shape[-1], width, a.device), energy,
                                            min_rank, multiple, power_iters, oversample, 1e-3)


def with_spectrum(values, seed=0):
    """float32 Q diag(values) Q^T for random orthogonal Q, one matrix per row of `values`."""
    gen = torch.Generator().manual_seed(seed)
    n, dim = values.shape
    q = torch.linalg.qr(torch.randn(n, dim, dim, generator=gen, dtype=torch.float64))[0]
    return ((q * values.double().unsqueeze(-2)) @ q.mT).float()


def planted(n, dim, rank, noise=1e-4, seed=0):
    """Rank `rank` with decaying scales over a flat noise floor."""
    signal = torch.linspace(100, 10, rank, dtype=torch.float64)
    floor = torch.full((dim - rank,), noise * 100, dtype=torch.float64)
    return with_spectrum(torch.cat([signal, floor]).expand(n, dim), seed)


def decaying(n, dim, ell, seed=0):
    return with_spectrum(torch.exp(-torch.arange(dim, dtype=torch.float64) / ell).expand(n, dim),
                         seed)


def check(a, values, basis, ranks, decided, summary, energy):
    """Shapes, orthonormal kept columns, zeros after, quotients, the energy held and the
    summary (largest rank, heads not decided, heads not finite)."""
    n, dim = a.shape[:2]
    width = basis.shape[-1]
    assert values.shape == (n, dim) and basis.shape == (n, dim, width)
    assert ranks.shape == (n,) and ranks.dtype == torch.int32
    assert decided.shape == (n,) and decided.dtype == torch.bool
    assert summary.shape == (3,) and summary.dtype == torch.int32
    assert torch.isfinite(values).all() and torch.isfinite(basis).all()
    a64 = a.double().cpu()
    a64 = a64.tril() + a64.tril(-1).mT
    trace = a64.diagonal(dim1=-2, dim2=-1).sum(-1)
    assert summary.tolist() == [int(ranks.max()) if n else 0, int((~decided).sum()),
                                int((~torch.isfinite(trace)).sum())]
    for i in range(n):
        r = int(ranks[i])
        u = basis[i].double().cpu()
        assert (u[:, r:] == 0).all()
        u = u[:, :r]
        if float(trace[i]) == 0.0:  # nothing to sketch: zero columns, never decided
            assert (u == 0).all() and not bool(decided[i])
            continue
        torch.testing.assert_close(u.mT @ u, torch.eye(r, dtype=torch.float64), atol=64 * EPS32,
                                   rtol=0)
        quotients = ((a64[i] @ u) * u).sum(0)
        scale = max(float(trace[i]), 1e-30)
        torch.testing.assert_close(values[i, :r].double().cpu(), quotients, atol=1e-5 * scale,
                                   rtol=0)
        assert abs(float(values[i].double().sum()) - float(trace[i])) <= 1e-5 * scale
        if bool(decided[i]):
            assert float(quotients.sum()) >= energy * float(trace[i]) * (1 - 1e-5)


def projector(basis, r):
    u = basis[..., :r].double().cpu()
    return u @ u.mT


@pytest.mark.parametrize("dim, width", SHAPES)
@pytest.mark.parametrize("energy", [0.9, 0.99])
def test_matches_float64_steps(device, dim, width, energy):
    rank = max(1, width // 4)
    a = planted(3, dim, rank).to(device)
    out = sketch(a, width, energy, 4, 4)
    check(a, *out, energy)
    values, basis, ranks, decided, _ = out
    ref_values, ref_basis, ref_ranks, _ = rank_mod._sketch_from_gram(
        a.double()[None], True, energy, 4, 4, width, 1)
    ref_ranks = ref_ranks[0].cpu()
    trace = a.double().diagonal(dim1=-2, dim2=-1).sum(-1).cpu()
    for i in torch.nonzero(ranks.cpu() != ref_ranks).flatten().tolist():
        # Only where a prefix sum of the reference lies within rounding of the target.
        prefix = ref_values[0, i, :width].double().cpu().cumsum(0)
        margin = (prefix - energy * trace[i]).abs().min()
        assert margin <= 1e-5 * trace[i], (i, ranks, ref_ranks)
    assert torch.equal(decided.cpu(), (ranks.cpu() + 8 <= width))
    torch.testing.assert_close(values.double().cpu(), ref_values[0].double().cpu(),
                               atol=1e-5 * float(trace.max()), rtol=0)
    for i in range(3):
        r = min(int(ranks[i]), int(ref_ranks[i]))
        torch.testing.assert_close(projector(basis[i], r), projector(ref_basis[0, i], r),
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("ell", [2, 4, 8, 16])
def test_never_below_exact_rule(device, ell):
    a = decaying(4, 128, ell, seed=ell).to(device)
    for energy in (0.9, 0.95, 0.99):
        out = sketch(a, 64, energy)
        check(a, *out, energy)
        _, _, ranks, decided, _ = out
        _, _, exact = torch.ops.adaattn.sym_eig_top(a, energy, 16, 16)
        below = decided & (ranks < exact)
        assert not below.any(), (energy, ranks, exact)
        # Within one multiple on these spectra.
        assert ((ranks - exact)[decided] <= 16).all(), (energy, ranks, exact)


def test_low_rank_and_zero(device):
    """An exact rank-4 matrix decides min_rank with an orthonormal basis; a zero matrix is
    never decided and gives zeros, not NaN."""
    values = torch.zeros(2, 128, dtype=torch.float64)
    values[0, :4] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    a = with_spectrum(values).to(device)
    out = sketch(a, 64, 0.9)
    check(a, *out, 0.9)
    _, basis, ranks, decided, summary = out
    assert ranks.tolist() == [16, 16] and decided.tolist() == [True, False]
    assert summary.tolist() == [16, 1, 0]
    assert (basis[1] == 0).all()


def test_summary_counts_non_finite(device):
    """A NaN or inf entry in a matrix's lower triangle reaches its trace (as in a Gram matrix,
    where it reaches the diagonal): the summary counts those matrices, and they are not
    decided."""
    a = planted(4, 64, 8).to(device)
    a[1, 5, 5] = float("nan")
    a[2, 7, 7] = float("inf")
    _, _, _, decided, summary = sketch(a, 32, 0.9, 4, 4)
    assert summary[1:].tolist() == [2, 2] and decided.tolist() == [True, False, False, True]


@pytest.mark.parametrize("dim, width", SHAPES)
def test_deterministic(device, dim, width):
    a = planted(4, dim, max(1, width // 4), seed=1).to(device)
    out = sketch(a, width, 0.99, 4, 4)
    again = sketch(a, width, 0.99, 4, 4)
    flipped = sketch(a.flip(0).contiguous(), width, 0.99, 4, 4)
    for x, y, z in zip(out[:4], again, flipped):
        assert torch.equal(x, y) and torch.equal(z.flip(0), x)
    assert torch.equal(out[4], again[4]) and torch.equal(out[4], flipped[4])


@pytest.mark.cuda
@pytest.mark.parametrize("dim, width", SHAPES)
def test_cuda_matches_cpu(dim, width):
    a = torch.cat([planted(2, dim, max(1, width // 4), seed=2), decaying(2, dim, 4, seed=3)])
    cpu = sketch(a, width, 0.95, 4, 4)
    cuda = sketch(a.cuda(), width, 0.95, 4, 4)
    check(a.cuda(), *cuda, 0.95)
    assert torch.equal(cuda[2].cpu(), cpu[2]) and torch.equal(cuda[3].cpu(), cpu[3])
    assert torch.equal(cuda[4].cpu(), cpu[4])
    trace = a.double().diagonal(dim1=-2, dim2=-1).sum(-1).max()
    torch.testing.assert_close(cuda[0].cpu().double(), cpu[0].double(), atol=1e-5 * trace,
                               rtol=0)
    for i in range(a.shape[0]):
        r = int(cpu[2][i])
        if i < 2:  # a gap under the kept subspace: it is well determined
            torch.testing.assert_close(projector(cuda[1][i], r), projector(cpu[1][i], r),
                                       atol=1e-4, rtol=0)


def test_bad_input(device):
    a = torch.eye(8, device=device)[None]
    om = omega(8, 4, device)
    op = torch.ops.adaattn.sym_sketch_top
    with pytest.raises(TypeError, match=r"^adaattn\.sym_sketch_top: a must be float32"):
        op(a.double(), om, 0.9, 1, 1, 1, 0, 1e-3)
    with pytest.raises(ValueError, match=r"^adaattn\.sym_sketch_top: a must be \[N, D, D\]"):
        op(a[:, :4], om, 0.9, 1, 1, 1, 0, 1e-3)
    with pytest.raises(ValueError, match=r"^adaattn\.sym_sketch_top: D = a.size\(1\) must be"):
        op(torch.eye(130, device=device)[None], omega(130, 4, device), 0.9, 1, 1, 1, 0, 1e-3)
    with pytest.raises(TypeError, match=r"^adaattn\.sym_sketch_top: omega must be float32"):
        op(a, om.double(), 0.9, 1, 1, 1, 0, 1e-3)
    with pytest.raises(ValueError, match=r"^adaattn\.sym_sketch_top: omega must be \[D, P\]"):
        op(a, omega(7, 4, device), 0.9, 1, 1, 1, 0, 1e-3)
    with pytest.raises(ValueError, match=r"^adaattn\.sym_sketch_top: P = omega.size\(1\)"):
        op(a, torch.zeros(8, 9, device=device), 0.9, 1, 1, 1, 0, 1e-3)
    with pytest.raises(ValueError, match=r"^adaattn\.sym_sketch_top: energy must be in"):
        op(a, om, 1.5, 1, 1, 1, 0, 1e-3)
    with pytest.raises(ValueError, match=r"^adaattn\.sym_sketch_top: min_rank and multiple"):
        op(a, om, 0.9, 0, 1, 1, 0, 1e-3)
    with pytest.raises(ValueError, match=r"^adaattn\.sym_sketch_top: power_iters must be"):
        op(a, om, 0.9, 1, 1, 9, 0, 1e-3)
    with pytest.raises(ValueError, match=r"^adaattn\.sym_sketch_top: oversample must be"):
        op(a, om, 0.9, 1, 1, 1, -1, 1e-3)
    with pytest.raises(ValueError, match=r"^adaattn\.sym_sketch_top: rel_shift must be"):
        op(a, om, 0.9, 1, 1, 1, 0, float("nan"))
    if device != "cpu":
        with pytest.raises(RuntimeError, match=r"^adaattn\.sym_sketch_top: omega must be on"):
            op(a, om.cpu(), 0.9, 1, 1, 1, 0, 1e-3)


def test_empty_batch(device):
    values, basis, ranks, decided, summary = sketch(torch.empty(0, 128, 128, device=device),
                                                    64, 0.9)
    assert values.shape == (0, 128) and basis.shape == (0, 128, 64)
    assert ranks.shape == (0,) and decided.shape == (0,)
    assert summary.tolist() == [0, 0, 0]


@pytest.mark.parametrize("dim, width", [(128, 64), (17, 9)])
def test_opcheck(device, dim, width):
    a = planted(2, dim, max(1, width // 4)).to(device)
    torch.library.opcheck(torch.ops.adaattn.sym_sketch_top.default,
                          (a, omega(dim, width, device), 0.9, 4, 4, 1, 8, 1e-3))
