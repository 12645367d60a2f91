"""Tests of the rank-planning half of adaptive-rank attention (docs/ops.md):
adaattn.rank_plan, adaattn.rank_error_bound, adaattn.rank_error_estimate, adaptive_rank_attn(max_error=) and
adaattn.nn.AdaptiveRankAttention (the attention itself: tests/test_low_rank.py).

* rank_plan (both methods) finds a planted rank, returns orthonormal, zero-padded bases, is
  deterministic, and energy = 1.0 keeps all D directions (float64 inputs take the float64 eigh
  path, float32 and bfloat16 ones the sym_eig ops). The sketch planner decides by itself on
  planted inputs, matches the exact ranks within one multiple (never below) on planted,
  random and decaying spectra, and its subspace holds the target energy.
* The error bound holds on random, planted and adversarial inputs (causal, GQA, Lq != Lk,
  peaked softmax, non-orthonormal bases), and is within 30x of the actual error on planted
  rank-32 inputs at energy 0.99 and 0.999; the estimate is within 2x there.
* shifted_cholesky_info (adaptive_rank_attn's full-rank certificate) agrees with the spectrum
  of its inputs, reports LAPACK's failing index, rejects bad input, passes opcheck.
"""
import pytest
import torch

import adaattn
from adaattn import rank as rank_mod
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


@pytest.mark.parametrize("method", ["sketch", "exact"])
@pytest.mark.parametrize("dtype", PLAN_DTYPES, ids=str)
@pytest.mark.parametrize("rank", [16, 32, 48])
def test_finds_planted_rank(device, rank, dtype, method):
    q, k = planted(2, 4, 2, 256, 128, rank, 0.01, device, dtype)
    plan = adaattn.rank_plan(q, k, energy=0.99, method=method)
    assert plan.ranks.dtype == torch.int32 and plan.ranks.shape == (2, 2)
    assert (plan.ranks == rank).all(), plan.ranks
    assert plan.basis.shape == (2, 2, 128, rank) and plan.basis.dtype == torch.float32
    assert plan.eigenvalues.shape == (2, 2, 128)


@pytest.mark.parametrize("method", ["sketch", "exact"])
@pytest.mark.parametrize("dtype", PLAN_DTYPES, ids=str)
def test_basis_orthonormal_padded_and_deterministic(device, dtype, method):
    q, k = planted(2, 4, 1, 200, 64, 16, 0.3, device, dtype)
    plan = adaattn.rank_plan(q, k, energy=0.9, min_rank=16, multiple=16, method=method)
    again = adaattn.rank_plan(q, k, energy=0.9, min_rank=16, multiple=16, method=method)
    for a, b in zip(plan, again):
        assert torch.equal(a, b)
    assert (plan.eigenvalues[..., :-1] >= plan.eigenvalues[..., 1:]).all() or \
        method == "sketch"  # past the sketch: the remaining trace spread evenly
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
    bound = adaattn.rank_error_bound(q, k, v, basis, causal=causal)
    assert bound.shape == (2, 4) and bound.dtype == torch.float32
    assert (error <= bound.double() * (1 + 1e-5) + 1e-9).all(), (error, bound)
    assert (error > 0).any()


def decaying(b, h, length, dim, ell, gen):
    """q, k [B, H, L, D] float64 with singular values exp(-i / ell) (examples/adaptive_rank.py's
    spectra) plus 1% noise."""
    spectrum = torch.exp(-torch.arange(dim, dtype=torch.float64) / ell)
    basis = torch.linalg.qr(torch.randn(b, h, dim, dim, generator=gen, dtype=torch.float64))[0]

    def draw():
        x = (torch.randn(b, h, length, dim, generator=gen, dtype=torch.float64) * spectrum) @ \
            basis.mT
        return x + 0.01 * torch.randn(x.shape, generator=gen, dtype=torch.float64)

    return draw(), draw()


def sketch_cases():
    gen = torch.Generator().manual_seed(3)
    for rank, noise in ((16, 0.01), (32, 0.05), (32, 0.2), (48, 0.01)):
        yield f"planted{rank}-{noise}", *planted(1, 2, 2, 256, 128, rank, noise, "cpu")
    yield "random", torch.randn(1, 2, 256, 128, generator=gen, dtype=torch.float64), \
        torch.randn(1, 2, 256, 128, generator=gen, dtype=torch.float64)
    for ell in (2, 4, 8, 16):
        yield f"decay{ell}", *decaying(1, 2, 256, 128, ell, gen)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_sketch_ranks_match_exact(device, dtype):
    """Within one multiple of the exact ranks and never below them, on planted, random and
    decaying spectra at every energy; the sketch decides by itself on every planted input."""
    decided = 0
    for name, q, k in sketch_cases():
        q, k = q.to(device, dtype), k.to(device, dtype)
        for energy in (0.9, 0.99, 0.999):
            sketch = adaattn.rank_plan(q, k, energy=energy, method="sketch")
            exact = adaattn.rank_plan(q, k, energy=energy, method="exact")
            diff = sketch.ranks - exact.ranks
            assert ((diff >= 0) & (diff <= 16)).all(), (name, energy, sketch.ranks, exact.ranks)
            gram, is_exact = rank_mod._plan_gram(q, k, q.shape[1] // k.shape[1])
            *_, summary = rank_mod._sketch_from_gram(gram, is_exact, energy, 16, 16, 64, 1)
            ok = int(summary[1]) == 0
            if name.startswith("planted") and energy <= 0.99 and not name.endswith("0.2"):
                assert ok, (name, energy)
            decided += ok
    assert decided >= 12


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_sketch_rank_deficient(device, dtype):
    """Gram matrices of rank < min_rank (an exact rank-4 subspace, a single row): the sketch
    decides, and the kept columns are still orthonormal."""
    basis = torch.linalg.qr(torch.randn(128, 4, dtype=torch.float64))[0]
    exact4 = [(torch.randn(1, 2, 64, 4, dtype=torch.float64) @ basis.T) for _ in range(2)]
    single = [torch.randn(1, 2, 1, 128, dtype=torch.float64) for _ in range(2)]
    for q, k in (exact4, single):
        q, k = q.to(device, dtype), k.to(device, dtype)
        gram, is_exact = rank_mod._plan_gram(q, k, 1)
        *_, summary = rank_mod._sketch_from_gram(gram, is_exact, 0.9, 16, 16, 64, 1)
        assert summary[1] == 0
        plan = adaattn.rank_plan(q, k, energy=0.9)
        assert (plan.ranks == 16).all()
        u = plan.basis.double()
        torch.testing.assert_close(u.mT @ u, torch.eye(16, dtype=torch.float64, device=device)
                                   .expand(1, 2, 16, 16),
                                   atol=64 * torch.finfo(torch.float32).eps, rtol=0)


def test_sketch_no_host_sync(device):
    """The sketch itself queues no host synchronisation on CUDA (rank_plan's one documented read
    of the width comes after it)."""
    if device == "cpu":
        pytest.skip("CUDA only")
    q, k = planted(2, 4, 2, 256, 128, 32, 0.05, device, torch.bfloat16)
    gram, exact = rank_mod._plan_gram(q, k, 2)
    rank_mod._sketch_from_gram(gram, exact, 0.99, 16, 16, 64, 1)  # warm-up (test matrix)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        *_, summary = rank_mod._sketch_from_gram(gram, exact, 0.99, 16, 16, 64, 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert summary[1] == 0


def test_sketch_holds_energy(device):
    """The sketched subspace holds at least `energy` of the trace of G (its captured energy is
    the sum of the kept Ritz values)."""
    gen = torch.Generator().manual_seed(5)
    q, k = decaying(2, 2, 256, 128, 8, gen)
    q, k = q.to(device), k.to(device)
    for energy in (0.9, 0.95, 0.99):
        plan = adaattn.rank_plan(q, k, energy=energy, method="sketch")
        gram = q.mT @ q + k.mT @ k
        u = exact_basis(plan).to(device)
        kept = (u.mT @ gram @ u).diagonal(dim1=-2, dim2=-1).sum(-1)
        total = gram.diagonal(dim1=-2, dim2=-1).sum(-1)
        assert (kept >= energy * total * (1 - 1e-5)).all(), (kept / total, energy)


def errors(q, k, v, basis, causal):
    """Actual ||O - O_low||_F per (b, query head), float64 reference."""
    low, _ = reference.low_rank_attn(q, k, v, basis.double(), causal=causal)
    full, _ = reference.flash_attn(q, k, v, causal=causal)
    return torch.linalg.matrix_norm(low - full, ord="fro")


def adversarial_cases(device):
    """(q, k, v, basis, causal): peaked softmax, non-orthonormal and tiny bases, GQA, Lq != Lk,
    v with a large common offset, single rows."""
    gen = torch.Generator().manual_seed(7)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(device)

    shapes = ((4, 1, 17, 97, 32), (4, 2, 97, 17, 64), (2, 2, 64, 64, 32), (4, 4, 1, 33, 32),
              (8, 2, 100, 128, 64))
    for i, (hq, hkv, lq, lk, dim) in enumerate(shapes):
        for scale in (0.3, 3.0, 8.0):
            rank = (1, 4, 16)[i % 3]
            q, k = rnd(1, hq, lq, dim, scale=scale), rnd(1, hkv, lk, dim, scale=scale)
            v = rnd(1, hkv, lk, dim) + 5.0 * (i % 2)
            basis = rnd(1, hkv, dim, rank, scale=(0.1, 1.0, 3.0)[i % 3])
            yield q, k, v, basis, bool(i % 2)


def test_error_bound_adversarial(device):
    for q, k, v, basis, causal in adversarial_cases(device):
        error = errors(q, k, v, basis, causal)
        bound = adaattn.rank_error_bound(q, k, v, basis, causal=causal).double()
        assert (error <= bound).all(), (error, bound)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("energy", [0.9, 0.95, 0.99, 0.999])
def test_error_bound_and_estimate_tight(device, energy, causal):
    """Planted rank 32, B=1, H=4, L=512, D=128, float64 (the issue's configuration): the bound is
    never below the actual error and within 30x of it at energy 0.99 and 0.999 (measured
    2.9-3.1x at every energy, 3-13x on random inputs); the sampled estimate is within 2x
    (measured 0.94-1.10x)."""
    q, k = planted(1, 4, 4, 512, 128, 32, 0.05, device)
    v = torch.randn(1, 4, 512, 128, dtype=torch.float64, device=device)
    plan = adaattn.rank_plan(q, k, energy=energy)
    error = errors(q, k, v, plan.basis, causal)
    bound = adaattn.rank_error_bound(q, k, v, plan.basis, causal=causal).double()
    estimate = adaattn.rank_error_estimate(q, k, v, plan.basis, causal=causal).double()
    assert (error <= bound).all()
    if energy >= 0.99:
        assert (bound <= 30 * error).all(), bound / error
        assert ((estimate <= 2 * error) & (error <= 2 * estimate)).all(), estimate / error


def test_error_estimate_all_rows_is_exact(device):
    q, k = planted(2, 4, 2, 64, 32, 8, 0.1, device)
    v = torch.randn(2, 2, 64, 32, dtype=torch.float64, device=device)
    plan = adaattn.rank_plan(q, k, energy=0.9, min_rank=8, multiple=8)
    for causal in (False, True):
        error = errors(q, k, v, plan.basis, causal)
        estimate = adaattn.rank_error_estimate(q, k, v, plan.basis, causal=causal, samples=64)
        torch.testing.assert_close(estimate.double(), error, rtol=1e-6, atol=0)
        full, _ = reference.flash_attn(q, k, v, causal=causal)
        rel = adaattn.rank_error_estimate(q, k, v, plan.basis, causal=causal, samples=64,
                                          relative=True)
        torch.testing.assert_close(rel.double(), error / torch.linalg.matrix_norm(full),
                                   rtol=1e-6, atol=0)
    again = adaattn.rank_error_estimate(q, k, v, plan.basis, samples=16)
    assert torch.equal(again, adaattn.rank_error_estimate(q, k, v, plan.basis, samples=16))


@pytest.mark.parametrize("causal", [False, True])
def test_adaptive_rank_max_error(device, causal):
    """With every row sampled the estimate is exact: the realised relative error is within
    max_error, and a smaller target never gives a smaller rank."""
    q, k = planted(2, 4, 2, 128, 64, 16, 0.05, device, torch.float32)
    v = torch.randn(2, 2, 128, 64, device=device)
    full, _ = reference.flash_attn(q.double(), k.double(), v.double(), causal=causal)
    previous = None
    for target in (0.3, 0.03, 3e-3, 3e-4, 1e-6):
        out, plan = adaattn.adaptive_rank_attn(q, k, v, max_error=target, causal=causal,
                                               samples=128, return_plan=True)
        rel = torch.linalg.matrix_norm(out.double() - full) / torch.linalg.matrix_norm(full)
        assert (rel <= target * 1.01 + 1e-6).all(), (target, rel, plan.ranks)
        assert plan.basis.shape[-1] == int(plan.ranks.max())
        if previous is not None:
            assert (plan.ranks >= previous).all()
        previous = plan.ranks
    assert (previous == 64).all()


def test_module_reuses_plan(device):
    q, k = planted(2, 4, 2, 128, 64, 16, 0.05, device, torch.float32)
    v = torch.randn(2, 2, 128, 64, device=device)
    module = adaattn.nn.AdaptiveRankAttention(replan_every=3, check_every=1)
    outs = [module(q, k, v) for _ in range(3)]
    assert module.plans_made == 1 and (module.plan.ranks == 16).all()
    torch.testing.assert_close(outs[0], adaattn.low_rank_attn(q, k, v, module.plan.basis))
    module(q, k, v)
    assert module.plans_made == 2  # replan_every
    q2, k2 = torch.randn_like(q), torch.randn_like(k)
    module(q2, k2, v)
    assert module.plans_made == 3  # the estimate drifted
    assert module.plan.basis.shape[-1] == 64  # full rank: flash_attn
    torch.testing.assert_close(module(q2, k2, v), adaattn.flash_attn(q2, k2, v))
    module(q2[:1], k2[:1], v[:1])
    assert module.plans_made == 4  # another batch size
    module.replan()
    module(q2[:1], k2[:1], v[:1])
    assert module.plans_made == 5
    # A plan handed to another layer is used as is, and its first drift check is the reference.
    first = adaattn.nn.AdaptiveRankAttention(replan_every=10, check_every=1)
    first(q, k, v)
    other = adaattn.nn.AdaptiveRankAttention(replan_every=10, check_every=1)
    other.plan = first.plan
    for _ in range(3):
        torch.testing.assert_close(other(q, k, v), first(q, k, v))
    assert other.plans_made == 0


def test_plan_under_autocast(device):
    """The Gram step ignores autocast (its float32 GEMMs would run in bfloat16): rank_plan under
    autocast equals rank_plan outside it, and the module (which casts q, k, v to the autocast
    dtype) plans as on the cast inputs and attends in that dtype."""
    q, k = planted(2, 4, 2, 128, 64, 16, 0.05, device, torch.float32)
    v = torch.randn(2, 2, 128, 64, device=device)
    module = adaattn.nn.AdaptiveRankAttention(0.9)
    with torch.autocast(device, dtype=torch.bfloat16):
        plan = adaattn.rank_plan(q, k, energy=0.9)
        out = module(q, k, v)
    for a, b in zip(plan, adaattn.rank_plan(q, k, energy=0.9)):
        assert torch.equal(a, b)
    for a, b in zip(module.plan, adaattn.rank_plan(q.bfloat16(), k.bfloat16(), energy=0.9)):
        assert torch.equal(a, b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, adaattn.low_rank_attn(q.bfloat16(), k.bfloat16(),
                                                          v.bfloat16(), module.plan.basis))


def test_module_max_error_and_gradients(device):
    q, k = planted(1, 2, 1, 12, 16, 4, 0.05, device)
    v = torch.randn(1, 1, 12, 16, dtype=torch.float64, device=device)
    module = adaattn.nn.AdaptiveRankAttention(max_error=0.05, min_rank=4, multiple=4,
                                              causal=True, replan_every=10 ** 6)
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    module(*inputs)
    assert module.plans_made == 1 and module.plan.basis.shape[-1] < 16
    assert torch.autograd.gradcheck(lambda a, b, c: module(a, b, c), inputs, fast_mode=True)
    assert module.plans_made == 1


def test_bad_input_revised():
    q = torch.randn(1, 4, 8, 16)
    u = torch.zeros(1, 4, 16, 4)
    with pytest.raises(ValueError, match=r"^adaattn\.rank_plan: method must be"):
        adaattn.rank_plan(q, q, method="fast")
    with pytest.raises(TypeError, match=r"^adaattn\.rank_plan: method must be a str"):
        adaattn.rank_plan(q, q, method=1)
    with pytest.raises(ValueError, match=r"^adaattn\.rank_error_estimate: samples must be"):
        adaattn.rank_error_estimate(q, q, q, u, samples=0)
    with pytest.raises(ValueError, match=r"^adaattn\.rank_error_estimate: v must be"):
        adaattn.rank_error_estimate(q, q, q[:, :, :4], u)
    with pytest.raises(TypeError, match=r"^adaattn\.rank_error_bound: causal must be"):
        adaattn.rank_error_bound(q, q, q, u, causal=1)
    with pytest.raises(ValueError, match=r"^adaattn\.adaptive_rank_attn: max_error must be"):
        adaattn.adaptive_rank_attn(q, q, q, max_error=0.0)
    with pytest.raises(ValueError, match=r"^adaattn\.nn\.AdaptiveRankAttention: drift must"):
        adaattn.nn.AdaptiveRankAttention(drift=1.0)
    with pytest.raises(ValueError, match=r"^adaattn\.nn\.AdaptiveRankAttention: replan_every"):
        adaattn.nn.AdaptiveRankAttention(replan_every=0)


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


@pytest.mark.parametrize("method", ["sketch", "exact"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_non_finite_entry(device, method, bad):
    """A single NaN or inf entry in bf16 q or k (the sym_gram path, whose finiteness is read from
    the Gram matrix's diagonal sum) is an error naming q and k, never a plan."""
    q = torch.randn(1, 4, 64, 128, device=device).bfloat16()
    k = torch.randn(1, 2, 64, 128, device=device).bfloat16()
    for x, name in ((q, "q"), (k, "k")):
        x2 = x.clone()
        x2[0, 1, 7, 3] = bad
        args = (x2, k) if name == "q" else (q, x2)
        with pytest.raises(ValueError, match=r"^adaattn\.rank_plan: q and k must be finite"):
            adaattn.rank_plan(*args, energy=0.9, method=method)


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
