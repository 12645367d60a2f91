"""Tests of the 8-bit (float8_e4m3fn) paged KV cache: adaattn.KVCache(dtype=torch.float8_e4m3fn)
quantising on append, and adaattn.flash_attn_with_kvcache reading it with k_scale/v_scale.

A cached value means ``e4m3 value * scale[page, kv head]``. The CPU op (and a CUDA call that
no 8-bit kernel takes) computes on that product rounded to q's dtype (``dequantized``), so it
equals the op on the dequantised cache exactly. The CUDA decode kernel multiplies the stored
e4m3 values themselves (in f16, exact) and applies the scales outside the products, so it is
checked with the 2x rule: its error against the float64 op on the exact products is at most
twice the 16-bit op's on the dequantised cache. Quantisation error itself is bounded by e4m3's
rounding: 3 mantissa bits, relative error <= 2^-4, and 2^-10 * scale in the subnormal range.
Every test runs with NaN-poisoned allocations (conftest.py); CUDA cases skip at run time without
a GPU.
"""
import pytest
import torch

import adaattn
from adaattn._ops import ops

E4M3 = torch.float8_e4m3fn


def dequantized(pool: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pool's values as the ops compute on them: e4m3 * scale (float32), rounded to dtype."""
    return (pool.float() * scale[:, :, None, None]).to(dtype)


def quantisation_bound(x: torch.Tensor, scale: torch.Tensor, roundings: int = 1) -> torch.Tensor:
    """|error| allowed for x stored at `scale` ([...] broadcast to x) after `roundings`."""
    return roundings * (2.0 ** -4 * x.abs() + 2.0 ** -10 * scale)


def make_cache(page_size=16, heads_kv=2, head_dim=8, num_pages=24, device="cpu", max_batch=4):
    return adaattn.KVCache(num_pages, page_size, heads_kv, head_dim, max_batch=max_batch,
                           max_pages_per_seq=8, dtype=E4M3, device=device)


def stored(cache: adaattn.KVCache, seq: int, which: str = "k") -> torch.Tensor:
    """Sequence `seq`'s dequantised float32 rows [Hkv, L, D], from the host's page list."""
    pool = cache.k_pages if which == "k" else cache.v_pages
    scale = cache.k_scale if which == "k" else cache.v_scale
    pages = torch.tensor(cache._pages[seq], dtype=torch.long)
    rows = dequantized(pool, scale, torch.float32)[pages]  # [P, Hkv, page, D]
    return rows.transpose(0, 1).flatten(1, 2)[:, :cache.length(seq)]


def page_scales(cache: adaattn.KVCache, seq: int, which: str = "k") -> torch.Tensor:
    """[Hkv, L]: the scale each of sequence `seq`'s positions is stored at."""
    scale = cache.k_scale if which == "k" else cache.v_scale
    pages = torch.tensor(cache._pages[seq], dtype=torch.long)
    return scale[pages].t().repeat_interleave(cache.page_size, 1)[:, :cache.length(seq)]


def test_append_quantises_per_page_and_head():
    torch.manual_seed(0)
    cache = make_cache()
    seqs = [cache.allocate(), cache.allocate()]
    k = torch.randn(2, 2, 37, 8) * torch.tensor([1.0, 30.0]).view(1, 2, 1, 1)  # heads differ
    v = torch.randn(2, 2, 37, 8)
    k[1, 0, 5, 3] = 0.0  # exact zeros stay zero
    cache.append(seqs, k, v)
    for i, s in enumerate(seqs):
        for which, x in (("k", k), ("v", v)):
            got, scales = stored(cache, s, which), page_scales(cache, s, which)
            err = (got - x[i]).abs()
            assert (err <= quantisation_bound(x[i], scales[..., None])).all(), which
            # scale = the page's largest magnitude / 448, per kv head
            for p, page in enumerate(cache._pages[s]):
                rows = x[i][:, p * 16:(p + 1) * 16]
                expected = rows.abs().amax(dim=(1, 2)) / 448
                pool_scale = cache.k_scale if which == "k" else cache.v_scale
                torch.testing.assert_close(pool_scale[page], expected, rtol=0, atol=0)
    assert stored(cache, seqs[1])[0, 5, 3] == 0


def test_append_rescales_a_page_when_new_tokens_exceed_it():
    torch.manual_seed(1)
    cache = make_cache()
    s = cache.allocate()
    small = torch.randn(1, 2, 5, 8) * 0.01
    cache.append([s], small, small)
    page = cache._pages[s][0]
    before = cache.k_scale[page].clone()
    big = torch.randn(1, 2, 3, 8) * 50.0
    cache.append([s], big, big)
    assert (cache.k_scale[page] > before).all()
    both = torch.cat([small, big], dim=2)[0]
    got, scales = stored(cache, s), page_scales(cache, s)
    # earlier tokens were rounded twice (at the old scale, then the new one)
    assert ((got - both).abs() <= quantisation_bound(both, scales[..., None], 2)).all()
    # the new tokens once
    assert ((got[:, 5:] - both[:, 5:]).abs()
            <= quantisation_bound(both[:, 5:], scales[:, 5:, None])).all()


def test_reused_pages_restart_their_scales_and_fork_copies_them():
    torch.manual_seed(2)
    cache = make_cache(num_pages=2, max_batch=3)
    a = cache.allocate()
    cache.append([a], torch.full((1, 2, 3, 8), 100.0), torch.full((1, 2, 3, 8), 100.0))
    cache.free(a)
    b = cache.allocate()
    x = torch.randn(1, 2, 4, 8) * 0.1
    cache.append([b], x, x)
    torch.testing.assert_close(cache.k_scale[cache._pages[b][0]],
                               x[0].abs().amax(dim=(1, 2)) / 448, rtol=0, atol=0)
    c = cache.fork(b)
    torch.testing.assert_close(stored(cache, c), stored(cache, b), rtol=0, atol=0)
    torch.testing.assert_close(stored(cache, c, "v"), stored(cache, b, "v"), rtol=0, atol=0)


def _problem(device, dtype, batch=3, heads_q=8, heads_kv=2, head_dim=64, page_size=64,
             lengths=(0, 70, 190), len_q=1, seed=3, value_dim=None):
    """An 8-bit cache holding `lengths` tokens per sequence (plus the Lq rows of this step),
    with pages handed out interleaved across sequences, and the step's queries. With
    `value_dim`: a LowRankKVCache whose keys (full width 128, random orthonormal bases) are
    stored at width `head_dim`, and queries of that width (already projected)."""
    torch.manual_seed(seed)
    max_pages = -(-(max(lengths) + len_q) // page_size)
    shape = dict(max_batch=batch, max_pages_per_seq=max_pages, dtype=E4M3, device=device)
    full_dim = head_dim
    if value_dim is None:
        cache = adaattn.KVCache(batch * max_pages, page_size, heads_kv, head_dim, **shape)
        ids = [cache.allocate() for _ in range(batch)]
    else:
        full_dim = 128
        cache = adaattn.LowRankKVCache(batch * max_pages, page_size, heads_kv, full_dim,
                                       head_dim, value_dim, **shape)
        ids = [cache.allocate() for _ in range(batch)]
        basis = torch.randn(batch, heads_kv, full_dim, head_dim, device=device)
        cache.set_basis(ids, torch.linalg.qr(basis)[0])
    for step in range(max(lengths) + len_q):  # one token at a time: interleaved pages
        grow = [s for s, n in zip(ids, lengths) if step < n + len_q]
        k = torch.randn(len(grow), heads_kv, 1, full_dim, device=device) * 3
        v = torch.randn(len(grow), heads_kv, 1, value_dim or head_dim, device=device)
        cache.append(grow, k, v)
    q = torch.randn(batch, heads_q, len_q, head_dim, device=device).to(dtype)
    return cache, ids, q


def _decode(cache, ids, q, fp8, **kw):
    table = cache.block_table[ids]
    seqlens = cache.seqlens[ids]
    if fp8:
        return adaattn.flash_attn_with_kvcache(q, cache.k_pages, cache.v_pages,
                                               cache_seqlens=seqlens, block_table=table,
                                               k_scale=cache.k_scale, v_scale=cache.v_scale,
                                               return_lse=True, **kw)
    k16 = dequantized(cache.k_pages, cache.k_scale, q.dtype)
    v16 = dequantized(cache.v_pages, cache.v_scale, q.dtype)
    return adaattn.flash_attn_with_kvcache(q, k16, v16, cache_seqlens=seqlens, block_table=table,
                                           return_lse=True, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("kw", [{}, {"window": (40, 0)}, {"softcap": 5.0}], ids=str)
def test_cpu_op_equals_the_op_on_the_dequantised_cache(dtype, kw):
    cache, ids, q = _problem("cpu", dtype, len_q=2)
    out, lse = _decode(cache, ids, q, True, **kw)
    ref_out, ref_lse = _decode(cache, ids, q, False, **kw)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    assert out.dtype == dtype and lse.dtype == torch.float32


@pytest.mark.parametrize("device,dtype", [
    ("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda)],
    ids=str)
@pytest.mark.parametrize("which", ["k", "v"])
def test_nan_reaches_the_rows_that_attend_it(device, dtype, which):
    """A NaN key or value makes its page's scale NaN: the rows that attend that page get NaN
    (as with a 16-bit cache's NaN), never zeros; rows of other sequences are untouched."""
    cache, ids, q = _problem(device, dtype, batch=2, lengths=(10, 70))
    s = ids[0]
    nan = torch.full((1, 2, 1, 64), float("nan"), device=device)
    zero = torch.zeros(1, 2, 1, 64, device=device)
    cache.append([s], *((nan, zero) if which == "k" else (zero, nan)))
    out, lse = _decode(cache, ids, q, True)
    assert torch.isnan(out[0]).all()
    if which == "k":
        assert torch.isnan(lse[0]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


def test_empty_batch_and_empty_cache():
    cache, ids, q = _problem("cpu", torch.float32, batch=2, lengths=(3, 5))
    out, lse = adaattn.flash_attn_with_kvcache(
        q[:0], cache.k_pages, cache.v_pages, cache_seqlens=cache.seqlens[ids][:0],
        block_table=cache.block_table[ids][:0], k_scale=cache.k_scale, v_scale=cache.v_scale,
        return_lse=True)
    assert out.shape == (0, 8, 1, 64) and lse.shape == (0, 8, 1)
    empty = make_cache(head_dim=64)
    e = empty.allocate()
    out, lse = adaattn.flash_attn_with_kvcache(
        q[:1], empty.k_pages, empty.v_pages, cache_seqlens=empty.seqlens[[e]],
        block_table=empty.block_table[[e]], k_scale=empty.k_scale, v_scale=empty.v_scale,
        return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()  # no key: out 0, lse -inf


@pytest.mark.parametrize("device,dtype", [
    ("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda)],
    ids=str)
def test_low_rank_key_cache_in_8_bits(device, dtype):
    """LowRankKVCache(dtype=float8_e4m3fn): projected keys k U (float32 basis) and values are
    quantised on append; low_rank_attn_with_kvcache with the scales equals it on the
    dequantised pools (on CUDA through the 16-bit copy of the table's pages: exactly too)."""
    torch.manual_seed(4)
    heads_kv, head_dim, rank = 2, 64, 32
    cache = adaattn.LowRankKVCache(12, 16, heads_kv, head_dim, rank, 128, max_batch=2,
                                   max_pages_per_seq=6, dtype=E4M3, device=device)
    assert cache.basis.dtype == torch.float32
    ids = [cache.allocate(), cache.allocate()]
    basis = torch.linalg.qr(torch.randn(2, heads_kv, head_dim, rank, device=device))[0]
    cache.set_basis(ids, basis)
    keys = []
    for s, length in zip(ids, (20, 45)):
        k = torch.randn(1, heads_kv, length, head_dim, device=device) * 2
        cache.append([s], k, torch.randn(1, heads_kv, length, 128, device=device))
        keys.append(k[0] @ basis[s])
    for s, projected in zip(ids, keys):
        got, scales = stored(cache, s), page_scales(cache, s)
        assert ((got - projected).abs() <= quantisation_bound(projected, scales[..., None])).all()
    q = torch.randn(2, 8, 1, head_dim, device=device).to(dtype)
    common = dict(cache_seqlens=cache.seqlens[ids], block_table=cache.block_table[ids],
                  return_lse=True)
    out, lse = adaattn.low_rank_attn_with_kvcache(
        q, cache.k_pages, cache.v_pages, cache.basis[ids], k_scale=cache.k_scale,
        v_scale=cache.v_scale, **common)
    ref_out, ref_lse = adaattn.low_rank_attn_with_kvcache(
        q, dequantized(cache.k_pages, cache.k_scale, dtype),
        dequantized(cache.v_pages, cache.v_scale, dtype), cache.basis[ids], **common)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_decode_step(backend):
    cache, ids, q = _problem("cpu", torch.float32, batch=2, lengths=(10, 70))

    def step(q, k_pages, v_pages, seqlens, table, k_scale, v_scale):
        return adaattn.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens,
                                               block_table=table, k_scale=k_scale,
                                               v_scale=v_scale)
    args = (q, cache.k_pages, cache.v_pages, cache.seqlens[ids], cache.block_table[ids],
            cache.k_scale, cache.v_scale)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(*args), step(*args), rtol=0, atol=0)


def test_opcheck_cpu():
    """The fake kernel and the autograd registration; opcheck's schema test compares tensors
    with arithmetic that torch 2.11 does not implement for float8_e4m3fn on the CPU."""
    cache, ids, q = _problem("cpu", torch.float32)
    torch.library.opcheck(ops.flash_attn_with_kvcache.default, (
        q, cache.k_pages, cache.v_pages, None, None, cache.seqlens[ids], cache.block_table[ids],
        None, True, -1, -1, 0.0, 0, cache.k_scale, cache.v_scale),
        test_utils=("test_faketensor", "test_autograd_registration"))


def _decode_exact(cache, ids, q, **kw):
    """The op in float64 on the CPU on the exact products e4m3 * scale: (out, lse)."""
    def exact(pool, scale):
        return (pool.double() * scale.double()[:, :, None, None]).cpu()
    out, lse = adaattn.flash_attn_with_kvcache(
        q.double().cpu(), exact(cache.k_pages, cache.k_scale), exact(cache.v_pages, cache.v_scale),
        cache_seqlens=cache.seqlens[ids].cpu(), block_table=cache.block_table[ids].cpu(),
        return_lse=True, **kw)
    return out, lse


def _check_two_x_rule(cache, ids, q, **kw):
    """The 8-bit op's error against the exact float64 op at most twice (plus 1e-6) the 16-bit
    op's on the dequantised cache, for out and lse; returns (8-bit, 16-bit) results."""
    out, lse = _decode(cache, ids, q, True, **kw)
    peer_out, peer_lse = _decode(cache, ids, q, False, **kw)
    exact_out, exact_lse = _decode_exact(cache, ids, q, **kw)
    for got, peer, exact in ((out, peer_out, exact_out), (lse, peer_lse, exact_lse)):
        got, peer, exact = got.cpu().double(), peer.cpu().double(), exact.double()
        finite = torch.isfinite(exact)
        assert torch.equal(got[~finite], exact[~finite])  # rows without keys: lse -inf
        err = (got - exact)[finite].abs().max().item()
        peer_err = (peer - exact)[finite].abs().max().item()
        assert err <= 2 * peer_err + 1e-6, (err, peer_err)
    return (out, lse), (peer_out, peer_lse)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size,len_q,heads_q,kw,direct", [
    (64, 1, 8, {}, True), (128, 4, 8, {}, True), (64, 1, 32, {"window": (100, 0)}, True),
    (64, 3, 2, {}, True), (64, 1, 8, {"num_splits": 3}, True),
    # no 8-bit kernel: a dequantised copy on the 16-bit paths (pages of 32 keys, softcap,
    # 32 rows per kv head)
    (32, 1, 8, {}, False), (64, 1, 8, {"softcap": 5.0}, False), (64, 1, 64, {}, False),
], ids=str)
def test_cuda_against_the_exact_op(dtype, head_dim, page_size, len_q, heads_q, kw, direct):
    cache, ids, q = _problem("cuda", dtype, heads_q=heads_q, head_dim=head_dim,
                             page_size=page_size, lengths=(0, 70, 250), len_q=len_q)
    (out, lse), (peer_out, peer_lse) = _check_two_x_rule(cache, ids, q, **kw)
    if not direct:  # the 16-bit path on the dequantised copy: the peer's own computation
        torch.testing.assert_close(out, peer_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, peer_lse, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rank", [32, 64])
@pytest.mark.parametrize("page_size,len_q,heads_q,kw", [
    (64, 1, 8, {}), (128, 4, 8, {}), (64, 1, 16, {"window": (100, 0)}),
    (64, 1, 8, {"num_splits": 3}), (64, 3, 2, {"causal": True}),
], ids=str)
def test_cuda_low_rank_keys_against_the_exact_op(dtype, rank, page_size, len_q, heads_q, kw):
    """Keys stored at rank R < Dv = 128 (a LowRankKVCache's pools) in the 8-bit kernel."""
    cache, ids, q = _problem("cuda", dtype, heads_q=heads_q, head_dim=rank, value_dim=128,
                             page_size=page_size, lengths=(0, 70, 250), len_q=len_q)
    assert cache.k_pages.shape[-1] == rank and cache.v_pages.shape[-1] == 128
    _check_two_x_rule(cache, ids, q, **kw)


def _low_rank_pools(cache, pools, dtype):
    """(k_pool, v_pool, (k_scale, v_scale)) of `cache`: its 8-bit pools and scales, or
    ("16bit") the pools dequantised to `dtype` without scales."""
    if pools == "8bit":
        return cache.k_pages, cache.v_pages, (cache.k_scale, cache.v_scale)
    return (dequantized(cache.k_pages, cache.k_scale, dtype),
            dequantized(cache.v_pages, cache.v_scale, dtype), (None, None))


def _decode_full_width_q(q, pools, seqlens, table, q_basis):
    """The decode op (out, lse) on low-rank pools ``(k_pool, v_pool, scales)`` with a full-width
    q [.., 128] projected by ``q_basis`` (None: q is already projected)."""
    k_pool, v_pool, scales = pools
    return ops.flash_attn_with_kvcache.default(
        q, k_pool, v_pool, None, None, seqlens, table, 128 ** -0.5, True, -1, -1, 0.0, 0,
        *scales, None, None, None, q_basis)


def _project(q, basis, dtype):
    """q U [B, Hq, Lq, R] in `dtype`: query head h takes kv head h // (Hq / Hkv)'s basis."""
    batch, heads_q, len_q, dim = q.shape
    heads_kv = basis.shape[1]
    grouped = q.to(dtype).reshape(batch, heads_kv, heads_q // heads_kv * len_q, dim)
    return (grouped @ basis.to(dtype)).reshape(batch, heads_q, len_q, basis.shape[-1])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rank", [32, 64])
@pytest.mark.parametrize("pools", ["8bit", "16bit"])
@pytest.mark.parametrize("len_q,heads_q", [(1, 8), (3, 2), (1, 32), (6, 8)], ids=str)
def test_cuda_low_rank_query_projected_by_the_kernel(dtype, rank, pools, len_q, heads_q):
    """A full-width q [.., 128] with the LowRankKVCache's bases (the op's q_basis): the 8-bit
    decode kernel projects q itself where it reads the pools (at most 16 rows per kv head: GQA 4
    and 16 at Lq = 1, GQA 1 at Lq = 3); 24 rows and 16-bit pools take the projection ahead. Errors
    against float64 (q U and the attention of the exact pool values) at most twice (plus
    1e-6) those of the query projected ahead (float32 product rounded to q's dtype)."""
    cache, ids, _ = _problem("cuda", dtype, heads_q=heads_q, head_dim=rank, value_dim=128,
                             page_size=64, lengths=(0, 70, 250), len_q=len_q)
    q = torch.randn(3, heads_q, len_q, 128, device="cuda").to(dtype)
    basis = cache.basis[ids]
    table, seqlens = cache.block_table[ids], cache.seqlens[ids]
    k_pool, v_pool, scales = _low_rank_pools(cache, pools, dtype)

    def run(q_arg, q_basis):
        return _decode_full_width_q(q_arg, (k_pool, v_pool, scales), seqlens, table, q_basis)

    got = run(q, basis)
    # A strided basis (a QR's Q, column-major) takes the same path: bit for bit the same.
    strided = run(q, basis.transpose(-1, -2).contiguous().transpose(-1, -2))
    for mine, same in zip(got, strided):
        assert torch.equal(mine, same)
    ahead = run(_project(q, basis, torch.float32).to(dtype), None)
    exact_pools = [(pool.double() * scale.double()[:, :, None, None]).cpu()
                   for pool, scale in ((cache.k_pages, cache.k_scale),
                                       (cache.v_pages, cache.v_scale))]
    if pools == "16bit":
        exact_pools = [k_pool.double().cpu(), v_pool.double().cpu()]
    exact = ops.flash_attn_with_kvcache.default(
        _project(q.double(), basis.double(), torch.float64).cpu(), *exact_pools, None, None,
        seqlens.cpu(), table.cpu(), 128 ** -0.5, True, -1, -1, 0.0, 0)
    for mine, peer, ref in zip(got, ahead, exact):
        mine, peer = mine.cpu().double(), peer.cpu().double()
        finite = torch.isfinite(ref)
        assert torch.equal(mine[~finite], ref[~finite].double())
        err = (mine - ref)[finite].abs().max().item()
        peer_err = (peer - ref)[finite].abs().max().item()
        assert err <= 2 * peer_err + 1e-6, (err, peer_err)


@pytest.mark.cuda
@pytest.mark.parametrize("pools", ["8bit", "16bit"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=str)
def test_cuda_low_rank_query_not_finite(pools, bad):
    """A NaN or inf in one entry of a full-width q (projected by the 8-bit kernel itself, or
    ahead for 16-bit pools) makes exactly that query row's output and lse NaN, as on the CPU;
    every other row is bit for bit the clean call's."""
    cache, ids, _ = _problem("cuda", torch.bfloat16, heads_q=8, head_dim=32, value_dim=128,
                             page_size=64, lengths=(0, 70, 250))
    q = torch.randn(3, 8, 1, 128, device="cuda").to(torch.bfloat16)
    pool_args = _low_rank_pools(cache, pools, torch.bfloat16)

    def run(q_arg):
        return _decode_full_width_q(q_arg, pool_args, cache.seqlens[ids], cache.block_table[ids],
                                    cache.basis[ids])

    bad_q = q.clone()
    bad_q[2, 5, 0, 17] = bad
    (out, lse), (clean_out, clean_lse) = run(bad_q), run(q)
    assert torch.isnan(out[2, 5]).all() and torch.isnan(lse[2, 5]).all()
    keep = torch.ones(3, 8, dtype=torch.bool, device="cuda")
    keep[2, 5] = False
    assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep])


@pytest.mark.cuda
def test_cuda_query_rows_of_very_different_magnitudes():
    """The kernel converts each bf16 query row to f16 at its own power-of-two scale: rows of
    magnitude 1e-12..1e8 (outside f16's range both ways) in one CTA keep the 2x rule."""
    cache, ids, q = _problem("cuda", torch.bfloat16, batch=2, heads_q=8, head_dim=128,
                             lengths=(70, 250))
    magnitudes = torch.tensor([1e-12, 1e-6, 1.0, 1e4, 1e8, 3e-3, 7.0, 1e6], device="cuda")
    q = (q.float() * magnitudes[None, :, None, None]).to(torch.bfloat16)
    _check_two_x_rule(cache, ids, q)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_pages_of_very_different_scales(dtype):
    """Page scales spanning 10^-4..10^3 within one sequence (the kernel rebases its value
    scale up and down) and a page of zeros (scale 0)."""
    torch.manual_seed(5)
    cache = adaattn.KVCache(16, 64, 2, 128, max_batch=2, max_pages_per_seq=8, dtype=E4M3,
                            device="cuda")
    ids = [cache.allocate(), cache.allocate()]
    for magnitude in (1e-4, 1e3, 0.0, 1.0, 1e-3, 30.0):
        k = torch.randn(2, 2, 64, 128, device="cuda")
        cache.append(ids, k * (magnitude ** 0.5 if magnitude else 0.0), k * magnitude)
    q = torch.randn(2, 8, 1, 128, device="cuda").to(dtype)
    (out, _), _ = _check_two_x_rule(cache, ids, q)
    assert torch.isfinite(out).all()


@pytest.mark.cuda
@pytest.mark.parametrize("page_size,heads_q,kw,direct", [
    (64, 8, {}, True), (128, 16, {"window": (100, 0)}, True),
    (32, 8, {}, False), (64, 8, {"softcap": 5.0}, False), (64, 64, {}, False),
], ids=str)
@pytest.mark.parametrize("head_dim,value_dim", [(128, None), (32, 128)], ids=str)
def test_cuda_which_path_reads_the_8bit_cache(page_size, heads_q, kw, direct, head_dim,
                                              value_dim, monkeypatch):
    """The decode kernel reads an eligible 8-bit cache as it is (no elementwise dequantising
    kernels run); other calls dequantise a copy first. Narrow keys (32 of Dv = 128) alike."""
    # the poisoned allocations' fill kernels would count as elementwise kernels here
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", False)
    cache, ids, q = _problem("cuda", torch.bfloat16, heads_q=heads_q, head_dim=head_dim,
                             value_dim=value_dim, page_size=page_size, lengths=(10, 300))
    table, seqlens = cache.block_table[ids], cache.seqlens[ids]  # indexing kernels: not here

    def call():
        return adaattn.flash_attn_with_kvcache(q, cache.k_pages, cache.v_pages,
                                               cache_seqlens=seqlens, block_table=table,
                                               k_scale=cache.k_scale, v_scale=cache.v_scale, **kw)
    call()  # warm-up
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("decode_fp8_kernel" in n for n in names) == direct, names
    assert any("elementwise" in n for n in names) != direct, names


def _bad(kind):
    cache, ids, q = _problem("cpu", torch.float32, batch=2, lengths=(3, 5))
    table, lens = cache.block_table[ids], cache.seqlens[ids]
    kp, vp, ks, vs = cache.k_pages, cache.v_pages, cache.k_scale, cache.v_scale
    call = adaattn.flash_attn_with_kvcache
    k_new = torch.randn(2, 2, 1, 64)
    if kind == "missing scale":
        return lambda: call(q, kp, vp, cache_seqlens=lens, block_table=table, k_scale=ks)
    if kind == "scale dtype":
        return lambda: call(q, kp, vp, cache_seqlens=lens, block_table=table, k_scale=ks,
                            v_scale=vs.double())
    if kind == "scale shape":
        return lambda: call(q, kp, vp, cache_seqlens=lens, block_table=table, k_scale=ks[:1],
                            v_scale=vs)
    if kind == "contiguous":
        return lambda: call(q, kp[:2], vp[:2], cache_seqlens=lens, k_scale=ks, v_scale=vs)
    if kind == "append":
        return lambda: call(q, kp, vp, k_new, k_new, cache_seqlens=lens, block_table=table,
                            k_scale=ks, v_scale=vs)
    if kind == "mixed caches":
        return lambda: call(q, kp, vp.float(), cache_seqlens=lens, block_table=table,
                            k_scale=ks, v_scale=vs)
    if kind == "scales without 8-bit cache":
        return lambda: call(q, kp.float(), vp.float(), cache_seqlens=lens, block_table=table,
                            k_scale=ks, v_scale=vs)
    if kind == "lazy":
        tau, bias = torch.full((8,), -1.0), torch.zeros(8, 4)
        return lambda: adaattn.lazy_attn_with_kvcache(q, kp, vp, None, None, tau, bias,
                                                      cache_seqlens=lens, block_table=table)
    if kind == "table out of range":  # checked before the copy of the call's pages replaces it
        bad_table = table.clone()
        bad_table[1, 0] = kp.shape[0]
        return lambda: call(q, kp, vp, cache_seqlens=lens, block_table=bad_table, k_scale=ks,
                            v_scale=vs)
    raise AssertionError(kind)


BAD = {
    "missing scale": (ValueError, r"flash_attn_with_kvcache: v_scale \(float32 \[num_pages, Hkv\]\)"
                                  r" is required"),
    "scale dtype": (TypeError, r"flash_attn_with_kvcache: v_scale must be float32, got Double"),
    "scale shape": (ValueError, r"flash_attn_with_kvcache: k_scale must have shape "
                                r"\[num_pages, Hkv\] = \[2, 2\], got \[1, 2\]"),
    "contiguous": (ValueError, r"flash_attn_with_kvcache: an 8-bit \(float8_e4m3fn\) cache must "
                               r"be paged"),
    "append": (ValueError, r"flash_attn_with_kvcache: new keys k and values v cannot be appended"),
    "mixed caches": (TypeError, r"flash_attn_with_kvcache: v_cache must be float8_e4m3fn"),
    "scales without 8-bit cache": (ValueError, r"flash_attn_with_kvcache: k_scale and v_scale "
                                               r"belong to an 8-bit"),
    "lazy": (TypeError, r"lazy_attn_with_kvcache: k_cache must have q's dtype Float, got "
                        r"Float8_e4m3fn"),
    "table out of range": (ValueError, r"flash_attn_with_kvcache: block_table\[1, 0\] = 2 is out "
                                       r"of range \[0, num_pages = 2\)"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_inputs(kind):
    cls, text = BAD[kind]
    with pytest.raises(cls, match=text):
        _bad(kind)()


@pytest.mark.parametrize("kind", [k for k in BAD if k not in ("contiguous", "table out of range")])
def test_bad_inputs_fake_kernel(kind):
    """The fake (meta) kernel that torch.compile traces raises the same errors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    cls, text = BAD[kind]
    with pytest.raises(cls, match=text):
        with FakeTensorMode(allow_non_fake_inputs=True):
            _bad(kind)()
