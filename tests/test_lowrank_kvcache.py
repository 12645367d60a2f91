"""Tests of low-rank KV-cache decoding: adaattn.low_rank_attn_with_kvcache and
adaattn.LowRankKVCache.

The cache holds the projected keys ``k U [.., R]`` and full-width values; a decode step projects
its queries and new keys with the same per-(sequence, kv head) basis ``U`` and attends at width R
with the full head dim's softmax scale. So a prefill followed by decode steps must give, for
every step, the last Lq rows of ``adaattn.low_rank_attn`` on the whole sequence so far (causal
or not, GQA, Lq = 1 and Lq > 1, a contiguous cache and a paged one filled through
LowRankKVCache, ragged lengths). The bases come from ``adaattn.rank_plan`` on the prefill of
planted low-rank inputs (tests/test_rank.py's), or are fixed orthonormal ones of a chosen R.

Bars (tests/accuracy.py): float64 at 1e-12 relative (lse, float32, at 1e-6); float16/bfloat16
``err(ours) <= 2 * err(reference.low_rank_attn in the same dtype) + 1e-5`` against float64.
CUDA cases skip at run time without a GPU; on CUDA fp16/bf16, (R, Dv) = (64, 64) runs the
split-KV decode kernel and (32, 128) the prefill kernels on the cache.
"""
import pytest
import torch

import adaattn
from adaattn import reference

from accuracy import LOW_PRECISION, assert_low_precision_rule, assert_rel_close
from conftest import DEVICES
from test_low_rank import orthonormal_basis
from test_rank import planted

FP64_RTOL = 1e-12
LSE_RTOL = 1e-6

# Cache lengths before the first decode step (ragged, one empty-ish) and the Lq of each step.
PREFILL = (9, 16, 4)
STEPS = (1, 3, 1, 2)


def sequence(hq, hkv, dim, dim_v, device, dtype):
    """q_all [B, Hq, T, D], k_all [B, Hkv, T, D] (planted rank 8), v_all [B, Hkv, T, Dv]."""
    total = max(PREFILL) + sum(STEPS)
    q, k = planted(len(PREFILL), hq, hkv, total, dim, 8, 0.05, "cpu")
    v = torch.randn(len(PREFILL), hkv, total, dim_v, dtype=torch.float64)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def expected_rows(q, k, v, basis, end, len_q, causal, fn):
    """Per sequence b: the last ``len_q`` rows of ``fn`` (low_rank_attn) on its first
    ``end[b]`` positions; ``(out [B, Hq, Lq, Dv], lse [B, Hq, Lq])``."""
    outs, lses = [], []
    for b, e in enumerate(end):
        out, lse = fn(q[b:b + 1, :, :e], k[b:b + 1, :, :e], v[b:b + 1, :, :e], basis[b:b + 1],
                      causal=causal)
        outs.append(out[:, :, e - len_q:e])
        lses.append(lse[:, :, e - len_q:e])
    return torch.cat(outs), torch.cat(lses)


def ours_low_rank(q, k, v, basis, causal):
    return adaattn.low_rank_attn(q, k, v, basis, causal=causal, return_lse=True)


def run_decode(q, k, v, basis, causal, paged, rank=None):
    """Prefill then STEPS through low_rank_attn_with_kvcache; yields ``(end, lq, out, lse)`` per
    step. ``basis [B, Hkv, D, r]``; the paged cache is a LowRankKVCache of width ``rank``
    (default r), the contiguous one a dense ``[B, Hkv, Lmax, r]`` tensor filled with ``k U``."""
    batch, hkv, total, dim = k.shape
    dim_v = v.shape[-1]
    ids = list(range(batch))
    if paged:
        cache = adaattn.LowRankKVCache(
            3 * batch * total // 4 + 8, 4, hkv, dim, rank or basis.shape[-1], dim_v,
            max_batch=batch + 1, max_pages_per_seq=-(-total // 4), dtype=q.dtype,
            device=q.device)
        # An occupied first row, so that sequence ids and block-table rows are not 0 .. B-1.
        cache.allocate()
        ids = [cache.allocate() for _ in range(batch)]
        cache.set_basis(ids, basis)
        for i, (s, p) in enumerate(zip(ids, PREFILL)):
            cache.append([s], k[i:i + 1, :, :p], v[i:i + 1, :, :p])
    else:
        u = basis.to(q.dtype)
        k_cache = torch.zeros(batch, hkv, total, basis.shape[-1], dtype=q.dtype, device=q.device)
        v_cache = torch.zeros(batch, hkv, total, dim_v, dtype=q.dtype, device=q.device)
        for i, p in enumerate(PREFILL):
            k_cache[i, :, :p] = torch.matmul(k[i, :, :p], u[i])
            v_cache[i, :, :p] = v[i, :, :p]
        seqlens = torch.tensor(PREFILL, dtype=torch.int32, device=q.device)
    lengths = list(PREFILL)
    for lq in STEPS:
        rows = [torch.arange(p, p + lq) for p in lengths]
        pick = lambda t: torch.stack([t[i, :, r] for i, r in enumerate(rows)])  # noqa: E731
        q_step, k_step, v_step = pick(q), pick(k), pick(v)
        if paged:
            cache.reserve(ids, lq)
            out, lse = adaattn.low_rank_attn_with_kvcache(
                q_step, cache.k_pages, cache.v_pages, cache.basis[ids], k_step, v_step,
                cache_seqlens=cache.seqlens[ids], block_table=cache.block_table[ids],
                causal=causal, return_lse=True)
            cache.advance(ids, lq)
        else:
            out, lse = adaattn.low_rank_attn_with_kvcache(
                q_step, k_cache, v_cache, basis, k_step, v_step, cache_seqlens=seqlens,
                causal=causal, return_lse=True)
            seqlens += lq
        lengths = [p + lq for p in lengths]
        yield lengths, lq, out, lse


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)], ids=["mha", "gqa"])
def test_decode_equals_low_rank_attn_fp64(device, paged, causal, heads):
    hq, hkv = heads
    q, k, v = sequence(hq, hkv, 32, 24, device, torch.float64)
    plan = adaattn.rank_plan(q[:, :, :min(PREFILL)], k[:, :, :min(PREFILL)], energy=0.99,
                             min_rank=8, multiple=8)
    assert plan.basis.shape[-1] < 32  # a real projection, not the identity
    steps = 0
    for end, lq, out, lse in run_decode(q, k, v, plan.basis, causal, paged):
        exp_out, exp_lse = expected_rows(q, k, v, plan.basis, end, lq, causal, ours_low_rank)
        assert_rel_close("out", out, exp_out, FP64_RTOL)
        assert_rel_close("lse", lse, exp_lse, LSE_RTOL)
        steps += 1
    assert steps == len(STEPS)


def test_decode_cache_narrower_plan_is_zero_padded():
    """A plan of rank r stored in a cache of width R > r (set_basis pads with zero columns)
    attends exactly as rank r."""
    q, k, v = sequence(4, 2, 32, 32, "cpu", torch.float64)
    basis = orthonormal_basis(3, 2, 32, 8, "cpu", torch.float32)
    for end, lq, out, lse in run_decode(q, k, v, basis, True, True, rank=16):
        exp_out, exp_lse = expected_rows(q, k, v, basis, end, lq, True, ours_low_rank)
        assert_rel_close("out", out, exp_out, FP64_RTOL)
        assert_rel_close("lse", lse, exp_lse, LSE_RTOL)


def test_full_basis_equals_full_cache_decode():
    """R = D with the identity basis is flash_attn_with_kvcache on the unprojected cache."""
    q, k, v = sequence(4, 2, 16, 16, "cpu", torch.float64)
    eye = torch.eye(16, dtype=torch.float64).expand(3, 2, 16, 16)
    seqlens = torch.tensor(PREFILL, dtype=torch.int32)
    q_step = q[:, :, 20:22]
    low = adaattn.low_rank_attn_with_kvcache(q_step, k.clone(), v.clone(), eye,
                                             cache_seqlens=seqlens)
    full = adaattn.flash_attn_with_kvcache(q_step, k.clone(), v.clone(), cache_seqlens=seqlens)
    torch.testing.assert_close(low, full, atol=1e-14, rtol=0)


# (device, D, Dv, R): CPU; on CUDA (R, Dv) = (32, 128) and (64, 128) run the decode kernel,
# which projects q itself (at most 16 rows per kv head: every step here); (64, 64) the decode
# kernel on q projected ahead; R = 16 the prefill kernels, zero-padded to 32.
LOW_PRECISION_CASES = [
    ("cpu", 32, 24, 8),
    pytest.param("cuda", 128, 128, 32, marks=pytest.mark.cuda),
    pytest.param("cuda", 128, 128, 64, marks=pytest.mark.cuda),
    pytest.param("cuda", 128, 64, 64, marks=pytest.mark.cuda),
    pytest.param("cuda", 64, 64, 16, marks=pytest.mark.cuda),
]


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("device,dim,dim_v,rank", LOW_PRECISION_CASES)
def test_decode_low_precision(device, dim, dim_v, rank, heads, paged, dtype):
    hq, hkv = heads
    q, k, v = sequence(hq, hkv, dim, dim_v, device, torch.float64)
    basis = orthonormal_basis(3, hkv, dim, rank, device, torch.float32)
    low = [t.to(dtype) for t in (q, k, v)]
    for end, lq, out, lse in run_decode(*low, basis, True, paged):
        assert out.dtype == dtype
        ref64 = expected_rows(q, k, v, basis.double(), end, lq, True, reference.low_rank_attn)
        ref_low = expected_rows(*low, basis, end, lq, True, reference.low_rank_attn)
        for name, a, r, e in zip(("out", "lse"), (out, lse), ref_low, ref64):
            assert_low_precision_rule(name, a, r, e)


# ---------------------------------------------------------------------------------------------
# LowRankKVCache bookkeeping and bad inputs
# ---------------------------------------------------------------------------------------------

def test_fork_copies_the_basis():
    q, k, v = sequence(2, 2, 16, 16, "cpu", torch.float64)
    cache = adaattn.LowRankKVCache(16, 4, 2, 16, 8, max_batch=3, max_pages_per_seq=8,
                                   dtype=torch.float64)
    src = cache.allocate()
    cache.set_basis([src], orthonormal_basis(1, 2, 16, 8, "cpu"))
    cache.append([src], k[:1, :, :10], v[:1, :, :10])
    dst = cache.fork(src)
    assert torch.equal(cache.basis[dst], cache.basis[src])
    ids = [src, dst]
    cache.reserve(ids, 1)
    out = adaattn.low_rank_attn_with_kvcache(
        q[:1, :, 10:11].expand(2, -1, -1, -1), cache.k_pages, cache.v_pages, cache.basis[ids],
        k[:1, :, 10:11].expand(2, -1, -1, -1).contiguous(),
        v[:1, :, 10:11].expand(2, -1, -1, -1).contiguous(),
        cache_seqlens=cache.seqlens[ids], block_table=cache.block_table[ids])
    assert torch.equal(out[0], out[1])
    cache.free(dst)
    with pytest.raises(RuntimeError, match="set_basis"):
        cache.append([cache.allocate()], k[:1, :, :2], v[:1, :, :2])


def test_cache_bad_inputs():
    op = "adaattn.LowRankKVCache"
    with pytest.raises(ValueError, match=f"{op}: rank must be in \\[1, head_dim = 16\\]"):
        adaattn.LowRankKVCache(4, 4, 2, 16, 17, max_batch=1, max_pages_per_seq=1)
    with pytest.raises(TypeError, match=f"{op}: rank must be an int"):
        adaattn.LowRankKVCache(4, 4, 2, 16, 8.0, max_batch=1, max_pages_per_seq=1)
    cache = adaattn.LowRankKVCache(4, 4, 2, 16, 8, max_batch=2, max_pages_per_seq=2)
    s = cache.allocate()
    with pytest.raises(ValueError, match=f"{op}.set_basis: basis must be"):
        cache.set_basis([s], torch.zeros(1, 2, 16, 9))
    with pytest.raises(ValueError, match=f"{op}.set_basis: basis must be"):
        cache.set_basis([s], torch.zeros(1, 2, 8, 8))
    with pytest.raises(TypeError, match=f"{op}.set_basis: basis must be floating"):
        cache.set_basis([s], torch.zeros(1, 2, 16, 8, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=f"{op}.append: sequence 0 has no basis"):
        cache.append([s], torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16))
    cache.set_basis([s], torch.zeros(1, 2, 16, 4))
    with pytest.raises(ValueError, match=f"{op}.append: k must be"):
        cache.append([s], torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 16))
    cache.append([s], torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16))
    with pytest.raises(RuntimeError, match=f"{op}.set_basis: sequence 0 already holds 3 keys"):
        cache.set_basis([s], torch.zeros(1, 2, 16, 4))


def test_decode_bad_inputs():
    op = "adaattn.low_rank_attn_with_kvcache"
    q = torch.randn(2, 4, 1, 16)
    k_cache, v_cache = torch.zeros(2, 2, 8, 4), torch.zeros(2, 2, 8, 16)
    basis = torch.randn(2, 2, 16, 4)
    seqlens = torch.tensor([3, 5], dtype=torch.int32)

    def call(q=q, k_cache=k_cache, v_cache=v_cache, basis=basis, k=None, v=None):
        return adaattn.low_rank_attn_with_kvcache(q, k_cache, v_cache, basis, k, v,
                                                  cache_seqlens=seqlens)

    call()
    with pytest.raises(TypeError, match=f"{op}: basis must be a tensor"):
        call(basis=[[1.0]])
    with pytest.raises(TypeError, match=f"{op}: basis must be float32 or q's dtype"):
        call(basis=basis.half())
    with pytest.raises(ValueError, match=f"{op}: basis must be \\[B, Hkv, D, R\\]"):
        call(basis=basis[:, :1])
    with pytest.raises(ValueError, match=f"{op}: basis must be \\[B, Hkv, D, R\\]"):
        call(basis=basis[..., :8, :])
    with pytest.raises(ValueError, match=f"{op}: basis's rank R = basis.size\\(3\\) must be in "
                                         f"\\[1, D = 16\\], got 17"):
        call(basis=torch.randn(2, 2, 16, 17), k_cache=torch.zeros(2, 2, 8, 17))
    with pytest.raises(ValueError, match=f"{op}: k_cache holds the projected keys"):
        call(k_cache=torch.zeros(2, 2, 8, 16))
    with pytest.raises(ValueError, match=f"{op}: the number of query heads"):
        call(q=torch.randn(2, 3, 1, 16))
    with pytest.raises(ValueError, match=f"{op}: q must be"):
        call(q=torch.randn(4, 1, 16))
    with pytest.raises(ValueError, match=f"{op}: k \\(new keys, not projected\\) must be"):
        call(k=torch.zeros(2, 2, 1, 4), v=torch.zeros(2, 2, 1, 16))
    with pytest.raises(ValueError, match=f"{op}: the new keys k and values v"):
        call(k=torch.zeros(2, 2, 1, 16))
    with pytest.raises(TypeError, match=f"{op}: k must have q's dtype"):
        call(k=torch.zeros(2, 2, 1, 16, dtype=torch.float64), v=torch.zeros(2, 2, 1, 16))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_decode_step(backend):
    """A compiled (fullgraph) low-rank decode step equals the eager one and appends the same
    projected keys and values to the caches."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    batch, hkv, hq, dim, rank, lmax, lq = 2, 2, 4, 32, 8, 24, 2
    q = torch.randn(batch, hq, lq, dim, generator=gen)
    k_new = torch.randn(batch, hkv, lq, dim, generator=gen)
    v_new = torch.randn(batch, hkv, lq, dim, generator=gen)
    basis = torch.linalg.qr(torch.randn(batch, hkv, dim, dim, generator=gen))[0][..., :rank]
    k_cache = torch.randn(batch, hkv, lmax, rank, generator=gen)
    v_cache = torch.randn(batch, hkv, lmax, dim, generator=gen)
    seqlens = torch.tensor([5, 13], dtype=torch.int32)

    def step(q, k_cache, v_cache, k, v, seqlens):
        return adaattn.low_rank_attn_with_kvcache(q, k_cache, v_cache, basis, k, v,
                                                  cache_seqlens=seqlens)

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    results = []
    for fn in (step, compiled):
        kc, vc = k_cache.clone(), v_cache.clone()
        results.append((fn(q, kc, vc, k_new, v_new, seqlens), kc, vc))
    (out_e, k_e, v_e), (out_c, k_c, v_c) = results
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(k_c, k_e)  # the projection k U may round differently compiled
    assert torch.equal(v_c, v_e)
    assert not torch.equal(k_c, k_cache), "the compiled step did not append to the key cache"


def test_opcheck_query_basis():
    """The KV-cache op with q_basis (a full-width q against projected keys): schema, fake kernel
    and AOT dispatch agree with the CPU kernel, which equals the op on q U."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 3, 16)
    k_cache, v_cache = torch.randn(2, 2, 8, 4), torch.randn(2, 2, 8, 16)
    k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 16)
    basis = torch.randn(2, 2, 16, 4)
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    op = torch.ops.adaattn.flash_attn_with_kvcache.default
    args = (q, k_cache, v_cache, k, v, seqlens, None, 0.25, True, -1, -1, 0.0, 0)
    torch.library.opcheck(op, args + (None,) * 5 + (basis,),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    projected = (q.reshape(2, 2, 6, 16) @ basis).reshape(2, 4, 3, 4)
    k_a, v_a, k_b, v_b = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    got = op(q, k_a, v_a, k, v, seqlens, None, 0.25, True, -1, -1, 0.0, 0, None, None, None,
             None, None, basis)
    want = op(projected, k_b, v_b, k, v, seqlens, None, 0.25, True, -1, -1, 0.0, 0)
    for a, b in zip(got + (k_a, v_a), want + (k_b, v_b)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fake", [False, True], ids=["cpu", "fake"])
def test_query_basis_bad_inputs(fake):
    """The op's q_basis checks, in the CPU kernel and the fake kernel alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    op_name = "adaattn.flash_attn_with_kvcache"
    q = torch.randn(2, 4, 1, 16)
    k_cache, v_cache = torch.zeros(2, 2, 8, 4), torch.zeros(2, 2, 8, 16)
    seqlens = torch.tensor([3, 5], dtype=torch.int32)

    def call(basis, k_cache=k_cache):
        torch.ops.adaattn.flash_attn_with_kvcache.default(
            q, k_cache, v_cache, None, None, seqlens, None, None, True, -1, -1, 0.0, 0, None,
            None, None, None, None, basis)

    cases = [
        (TypeError, "q_basis must be float32 or q's dtype Float, got Half",
         dict(basis=torch.randn(2, 2, 16, 4).half())),
        (ValueError, "q_basis must be \\[B, Hkv, D, R\\] = \\[2, 2, 16, R\\], got "
         "\\[2, 1, 16, 4\\]", dict(basis=torch.randn(2, 1, 16, 4))),
        (ValueError, "q_basis's rank R = q_basis.size\\(3\\) must be in \\[1, D = 16\\], got 17",
         dict(basis=torch.randn(2, 2, 16, 17), k_cache=torch.zeros(2, 2, 8, 17))),
        (ValueError, "k_cache holds the projected keys k U: its head dim k_cache.size\\(-1\\) = 16 "
         "must be q_basis's rank R = 4", dict(basis=torch.randn(2, 2, 16, 4),
                                              k_cache=torch.zeros(2, 2, 8, 16))),
    ]
    for cls, text, kw in cases:
        with pytest.raises(cls, match=f"{op_name}: {text}"):
            if fake:
                with FakeTensorMode(allow_non_fake_inputs=True):
                    call(**kw)
            else:
                call(**kw)
