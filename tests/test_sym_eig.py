"""Tests of torch.ops.adaattn.sym_eig, the batched symmetric eigensolver behind rank_plan.

Every result is checked in float64 against the input: eigenvectors orthonormal to 64 float32
epsilons, A U = U diag(w) to 1e-5 ||A||_F, eigenvalues equal to torch.linalg.eigh's (float64) to
1e-5 ||A||_F, descending, each column's entry of largest magnitude positive. Inputs: random
symmetric matrices, Gram matrices with a planted rank-8 spectrum plus noise, repeated eigenvalues
(identity, zeros, clusters, a large near-degenerate cluster under a planted rank-32 spectrum),
tridiagonal inputs with zero and tiny couplings, D from 1 to 128 (the CUDA kernel) and one D > 128
(CUDA: the float64 eigh path), an empty batch. Also determinism (bitwise, and independent of the batch position),
CUDA agreeing with CPU, errors naming `a`, and torch.library.opcheck.

sym_eig_top (rank_plan's op): sym_eig's eigenvalues, the rank of rank_plan's rule, the first
`rank` eigenvectors to the same bounds and the other columns 0, on planted, clustered, indefinite
and special inputs, with the same determinism, CUDA/CPU, error and opcheck tests.
"""
import pytest
import torch

import adaattn  # noqa: F401  (loads the op library)

EPS32 = torch.finfo(torch.float32).eps
DIMS = [1, 2, 17, 32, 64, 100, 128, 160]


def sym_eig(a):
    return torch.ops.adaattn.sym_eig(a)


def random_symmetric(n, dim, device):
    x = torch.randn(n, dim, dim, dtype=torch.float64)
    return (x + x.mT).float().to(device)


def planted_gram(n, dim, device, rank=8, noise=0.01, length=512):
    """X^T X for X = (rank-`rank` signal with well-separated scales) + noise."""
    basis = torch.linalg.qr(torch.randn(n, dim, dim, dtype=torch.float64))[0][..., :rank]
    scales = torch.linspace(10, 3, rank, dtype=torch.float64)
    x = torch.randn(n, length, rank, dtype=torch.float64) * scales @ basis.mT
    x = x + noise * torch.randn(n, length, dim, dtype=torch.float64)
    return (x.mT @ x).float().to(device)


def with_spectrum(values, device):
    """Q diag(values) Q^T for a random orthogonal Q, one matrix per row of `values`."""
    q = torch.linalg.qr(torch.randn(values.shape[0], values.shape[1], values.shape[1],
                                    dtype=torch.float64))[0]
    return ((q * values.double().unsqueeze(-2)) @ q.mT).float().to(device)


def check(a, w, v, columns=None):
    """The decomposition's accuracy and conventions, in float64 (of the first `columns`
    eigenvectors, all by default)."""
    n, dim = a.shape[0], a.shape[-1]
    assert w.shape == (n, dim) and v.shape == (n, dim, dim)
    assert w.dtype == torch.float32 and v.dtype == torch.float32
    assert w.device == a.device and v.device == a.device
    assert torch.isfinite(w).all() and torch.isfinite(v).all()
    a64, w64, v64 = a.double().cpu(), w.double().cpu(), v.double().cpu()
    ref = torch.linalg.eigvalsh(a64.tril() + a64.tril(-1).mT).flip(-1)
    norm = torch.linalg.matrix_norm(a64).clamp(min=torch.finfo(torch.float64).tiny)
    error = (w64 - ref).abs().amax(-1)
    assert (error <= 1e-5 * norm).all(), (error / norm).max()
    assert (w[:, :-1] >= w[:, 1:]).all()
    c = dim if columns is None else columns
    v, v64, w64 = v[..., :c], v64[..., :c], w64[:, :c]
    eye = torch.eye(c, dtype=torch.float64).expand(n, c, c)
    torch.testing.assert_close(v64.mT @ v64, eye, atol=64 * EPS32, rtol=0)
    residual = (a64 @ v64 - v64 * w64.unsqueeze(-2)).abs().amax((-1, -2))
    assert (residual <= 1e-5 * norm).all(), (residual / norm).max()
    largest = v.gather(-2, v.abs().argmax(-2, keepdim=True))  # first row on ties
    assert (largest > 0).all()


@pytest.mark.parametrize("dim", DIMS)
def test_random_symmetric(device, dim):
    a = random_symmetric(3, dim, device)
    check(a, *sym_eig(a))


@pytest.mark.parametrize("dim", [17, 64, 128, 160])
def test_planted_gram(device, dim):
    a = planted_gram(2, dim, device)
    w, v = sym_eig(a)
    check(a, w, v)
    # The planted directions are well separated: they match eigh's eigenvectors (same sign
    # convention) one by one.
    _, ref = torch.linalg.eigh(a.double().cpu())
    ref = ref.flip(-1)[..., :8]
    ref = ref * ref.gather(-2, ref.abs().argmax(-2, keepdim=True)).sign()
    torch.testing.assert_close(v[..., :8].double().cpu(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dim", [5, 17, 128])
def test_identity_and_zeros(device, dim):
    a = torch.stack([torch.eye(dim), torch.zeros(dim, dim), 3 * torch.eye(dim)]).to(device)
    w, v = sym_eig(a)
    check(a, w, v)
    # Nothing to rotate: the basis stays the identity, in index order (ties keep it).
    assert torch.equal(w.cpu(), torch.tensor([1.0, 0.0, 3.0]).repeat_interleave(dim).view(3, dim))
    assert torch.equal(v.cpu(), torch.eye(dim).expand(3, dim, dim))


@pytest.mark.parametrize("dim", [16, 64, 128])
def test_clusters(device, dim):
    """Repeated eigenvalues: the eigenvectors of a cluster are any basis of its eigenspace, so
    the check is A U = U diag(w) plus the projector onto each cluster."""
    levels = torch.tensor([5.0, 2.0, 1.0, 0.0])
    values = levels.repeat_interleave(dim // 4).expand(2, dim)
    a = with_spectrum(values, device)
    w, v = sym_eig(a)
    check(a, w, v)
    torch.testing.assert_close(w.cpu(), values, atol=1e-5 * dim, rtol=0)
    _, ref = torch.linalg.eigh(a.double().cpu())
    ref = ref.flip(-1)
    v64 = v.double().cpu()
    for c in range(4):
        part = slice(c * dim // 4, (c + 1) * dim // 4)
        torch.testing.assert_close(v64[..., part] @ v64[..., part].mT,
                                   ref[..., part] @ ref[..., part].mT, atol=1e-5, rtol=0)


def test_graded_and_scaled(device):
    """Eigenvalues over 8 decades, and matrices near the float32 range's ends (the norms are
    summed in double)."""
    values = torch.logspace(4, -4, 64).expand(2, 64)
    a = with_spectrum(values, device)
    check(a, *sym_eig(a))
    for scale in (1e30, 1e-30):
        b = a * scale
        w, v = sym_eig(b)
        check(b, w, v)


@pytest.mark.parametrize("dim", [96, 128])
def test_large_noise_cluster(device, dim):
    """A planted rank-32 Gram matrix plus 1% noise: the other dim - 32 eigenvalues sit within
    float32 resolution of ||A|| of each other (one cluster for the inverse iteration)."""
    a = planted_gram(2, dim, device, rank=32, noise=0.01)
    check(a, *sym_eig(a))


@pytest.mark.parametrize("dim", [24, 100, 128])
def test_repeated_eigenvalues(device, dim):
    """Exactly repeated eigenvalues inside one unreduced tridiagonal block and over several."""
    values = torch.cat([torch.full((dim // 2,), 2.0), torch.full((dim - dim // 2,), -1.0)])
    a = with_spectrum(values.expand(2, dim), device)
    w, v = sym_eig(a)
    check(a, w, v)
    torch.testing.assert_close(w.cpu(), values.expand(2, dim), atol=1e-5 * dim, rtol=0)


@pytest.mark.parametrize("dim", [2, 3, 50, 127, 128])
def test_tridiagonal_input(device, dim):
    """Already tridiagonal (every reflector is the identity), with tiny and zero couplings."""
    d = torch.randn(2, dim, dtype=torch.float64)
    e = torch.randn(2, dim - 1, dtype=torch.float64)
    e[:, ::7] = 0.0
    e[:, 3::11] = 1e-9
    a = torch.diag_embed(d) + torch.diag_embed(e, 1) + torch.diag_embed(e, -1)
    check(a.float().to(device), *sym_eig(a.float().to(device)))


def test_wilkinson_like(device):
    """W+ style matrix: pairs of eigenvalues closer than float32 resolution in one block."""
    dim = 41
    d = (torch.arange(dim) - dim // 2).abs().double()
    a = torch.diag_embed(d) + torch.diag_embed(torch.ones(dim - 1), 1) + \
        torch.diag_embed(torch.ones(dim - 1), -1)
    check(a[None].float().to(device), *sym_eig(a[None].float().to(device)))


@pytest.mark.parametrize("dim", [5, 33, 77, 113])
def test_psd_gram_odd_dims(device, dim):
    """Random Gram matrices with D not a multiple of 16, and the same with a rank-deficient X."""
    x = torch.randn(2, 3 * dim, dim, dtype=torch.float64)
    check((x.mT @ x).float().to(device), *sym_eig((x.mT @ x).float().to(device)))
    x = torch.randn(2, dim // 2 + 1, dim, dtype=torch.float64)
    check((x.mT @ x).float().to(device), *sym_eig((x.mT @ x).float().to(device)))


def test_empty_batch(device):
    for dim in (1, 128, 160):
        w, v = sym_eig(torch.empty(0, dim, dim, device=device))
        assert w.shape == (0, dim) and v.shape == (0, dim, dim)


@pytest.mark.parametrize("dim", [17, 128, 160])
def test_deterministic(device, dim):
    a = planted_gram(4, dim, device)
    w, v = sym_eig(a)
    w2, v2 = sym_eig(a)
    assert torch.equal(w, w2) and torch.equal(v, v2)
    # Each matrix is solved on its own: its position in the batch does not matter.
    w3, v3 = sym_eig(a.flip(0).contiguous())
    assert torch.equal(w3.flip(0), w) and torch.equal(v3.flip(0), v)


@pytest.mark.cuda
@pytest.mark.parametrize("dim", [17, 64, 128, 160])
def test_cuda_matches_cpu(dim):
    a = planted_gram(3, dim, "cpu")
    w, v = sym_eig(a)
    wc, vc = sym_eig(a.cuda())
    check(a.cuda(), wc, vc)
    norm = torch.linalg.matrix_norm(a.double()).max()
    torch.testing.assert_close(wc.cpu().double(), w.double(), atol=1e-5 * norm, rtol=0)
    torch.testing.assert_close(vc.cpu()[..., :8], v[..., :8], atol=1e-5, rtol=0)


def test_bad_input():
    with pytest.raises(TypeError, match=r"^adaattn\.sym_eig: a must be float32"):
        sym_eig(torch.eye(4, dtype=torch.float64)[None])
    with pytest.raises(ValueError, match=r"^adaattn\.sym_eig: a must have 3 dims \[N, D, D\]"):
        sym_eig(torch.eye(4))
    with pytest.raises(ValueError, match=r"^adaattn\.sym_eig: a must be square"):
        sym_eig(torch.zeros(2, 4, 5))
    with pytest.raises(ValueError,
                       match=r"^adaattn\.sym_eig: D = a.size\(1\) must be in \[1, 256\]"):
        sym_eig(torch.zeros(2, 0, 0))
    with pytest.raises(ValueError,
                       match=r"^adaattn\.sym_eig: D = a.size\(1\) must be in \[1, 256\]"):
        sym_eig(torch.zeros(1, 257, 257))
    with pytest.raises(ValueError, match=r"^adaattn\.sym_eig: a must be contiguous"):
        sym_eig(torch.zeros(2, 4, 4).mT)


@pytest.mark.parametrize("dim", [17, 128])
def test_opcheck(device, dim):
    a = random_symmetric(2, dim, device)
    torch.library.opcheck(torch.ops.adaattn.sym_eig.default, (a,))


# sym_eig_top: rank_plan's op (the eigenvalues, the rank, the first `rank` eigenvectors).

def sym_eig_top(a, energy, min_rank=16, multiple=16):
    return torch.ops.adaattn.sym_eig_top(a, energy, min_rank, multiple)


def expected_ranks(w, energy, min_rank, multiple):
    """rank_plan's rule (docs/ops.md) in float64 on descending eigenvalues w [N, D]."""
    dim = w.shape[-1]
    if energy >= 1.0:
        return torch.full(w.shape[:1], dim, dtype=torch.int32)
    values = w.double().cpu().clamp(min=0)
    reached = values.cumsum(-1) >= energy * values.sum(-1, keepdim=True)
    first = (dim + 1 - reached.sum(-1)).clamp(max=dim).clamp(min=min_rank)
    return ((first + multiple - 1) // multiple * multiple).clamp(max=dim).to(torch.int32)


def check_top(a, w, v, ranks, energy, min_rank, multiple):
    """sym_eig's eigenvalues, the rule's ranks, accurate first `rank` columns, zeros after."""
    n, dim = a.shape[0], a.shape[-1]
    assert ranks.shape == (n,) and ranks.dtype == torch.int32 and ranks.device == a.device
    w_full, v_full = sym_eig(a)
    assert torch.equal(w, w_full)
    assert torch.equal(ranks.cpu(), expected_ranks(w, energy, min_rank, multiple))
    for i in range(n):
        r = int(ranks[i])
        assert (v[i, :, r:] == 0).all()
        check(a[i:i + 1, :, :], w[i:i + 1], v[i:i + 1], columns=r)
    return w_full, v_full


@pytest.mark.parametrize("dim", [17, 64, 128, 160])
@pytest.mark.parametrize("energy", [0.5, 0.9, 0.99, 1.0])
def test_top_planted(device, dim, energy):
    a = planted_gram(3, dim, device)
    w, v, ranks = sym_eig_top(a, energy, 4, 4)
    _, v_full = check_top(a, w, v, ranks, energy, 4, 4)
    # The planted directions are well separated: the same vectors as sym_eig's.
    r = min(int(ranks.min()), 8)
    torch.testing.assert_close(v[..., :r], v_full[..., :r], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dim", [32, 128])
def test_top_large_noise_cluster(device, dim):
    """Rank 32 planted over a noise cluster, min_rank and multiple as in rank_plan; rank 1 rounding
    into the cluster (multiple 48) and min_rank past D."""
    a = planted_gram(2, dim, device, rank=32, noise=0.01)
    for energy, min_rank, multiple in [(0.99, 16, 16), (0.99, 1, 48), (0.5, 1000, 1), (0.9, 1, 1)]:
        check_top(a, *sym_eig_top(a, energy, min_rank, multiple), energy, min_rank, multiple)


def test_top_random_and_special(device):
    """Indefinite inputs (negative eigenvalues count as 0), zeros and the identity."""
    a = torch.cat([random_symmetric(2, 64, device), torch.zeros(1, 64, 64, device=device),
                   torch.eye(64, device=device)[None]])
    check_top(a, *sym_eig_top(a, 0.9, 1, 1), 0.9, 1, 1)


@pytest.mark.parametrize("dim", [17, 128, 160])
def test_top_deterministic(device, dim):
    a = planted_gram(4, dim, device)
    out = sym_eig_top(a, 0.99, 16, 16)
    again = sym_eig_top(a, 0.99, 16, 16)
    flipped = sym_eig_top(a.flip(0).contiguous(), 0.99, 16, 16)
    for x, y, z in zip(out, again, flipped):
        assert torch.equal(x, y) and torch.equal(z.flip(0), x)


@pytest.mark.cuda
@pytest.mark.parametrize("dim", [17, 64, 128, 160])
def test_top_cuda_matches_cpu(dim):
    a = planted_gram(3, dim, "cpu")
    w, v, ranks = sym_eig_top(a, 0.99, 4, 4)
    wc, vc, rc = sym_eig_top(a.cuda(), 0.99, 4, 4)
    check_top(a.cuda(), wc, vc, rc, 0.99, 4, 4)
    norm = torch.linalg.matrix_norm(a.double()).max()
    torch.testing.assert_close(wc.cpu().double(), w.double(), atol=1e-5 * norm, rtol=0)
    assert torch.equal(rc.cpu(), ranks)
    torch.testing.assert_close(vc.cpu()[..., :8], v[..., :8], atol=1e-5, rtol=0)


def test_top_bad_input():
    a = torch.eye(4)[None]
    with pytest.raises(ValueError, match=r"^adaattn\.sym_eig_top: energy must be in \(0, 1\]"):
        sym_eig_top(a, 0.0)
    with pytest.raises(ValueError, match=r"^adaattn\.sym_eig_top: energy must be in \(0, 1\]"):
        sym_eig_top(a, 1.5)
    with pytest.raises(ValueError,
                       match=r"^adaattn\.sym_eig_top: min_rank and multiple must be positive"):
        sym_eig_top(a, 0.9, 0, 16)
    with pytest.raises(TypeError, match=r"^adaattn\.sym_eig_top: a must be float32"):
        sym_eig_top(a.double(), 0.9)


def test_top_empty_batch(device):
    for dim in (1, 128, 160):
        w, v, ranks = sym_eig_top(torch.empty(0, dim, dim, device=device), 0.9)
        assert w.shape == (0, dim) and v.shape == (0, dim, dim) and ranks.shape == (0,)


@pytest.mark.parametrize("dim", [17, 128])
def test_top_opcheck(device, dim):
    a = planted_gram(2, dim, device)
    torch.library.opcheck(torch.ops.adaattn.sym_eig_top.default, (a, 0.9, 16, 16))
