"""NaN and Inf inputs reach the outputs as the reference's do, on every softmax op and path.

The semantics: a NaN or +inf score makes its row's softmax undefined, so the row's out and lse
are NaN and every gradient that depends on the row is non-finite; a -inf score weighs 0, like a
masked key (a row whose every visible score is -inf gives out 0 and lse -inf, as a row with
nothing to attend); a non-finite value reaches the rows that attend it; rows that never see a
bad value are unaffected, and so is anything read past a sequence's end (padding, unlisted
blocks, the cache past ``cache_seqlens``).

The expectation is ``adaattn.reference`` run row by row over each row's visible keys: the dense
reference computes ``P V`` (and its gradients) over masked entries too, where a zero weight times
a NaN value is NaN. CPU and the exact CUDA kernels (float32/float64) must equal it: the same NaN
and inf entries of out and lse, the same non-finite entries of every gradient, the finite entries
close. The tensor cores multiply whole tiles, so there a non-finite q or v entry also reaches the
masked neighbours of its tile (0 * NaN in the MMA, as in flash-attn and the dense reference): the
non-finite entries lie between the row-wise reference's and the dense reference's.
"""
import itertools

import pytest
import torch

import adaattn
from adaattn import reference

from conftest import DEVICES

INF, NAN = float("inf"), float("nan")
VALUES = {"nan": NAN, "inf": INF, "-inf": -INF}
HQ, HKV = 4, 2  # GQA: kv head 0 serves query heads 0 and 1
BAD_ROW = 3  # the query row / key that holds the bad value (inside every problem)


def _mask(q, k):
    """Every block listed (128 x 128, as the tensor cores take) for q's and k's lengths."""
    blocks = (1, 1, -(-q.shape[2] // 128), -(-k.shape[2] // 128))
    return adaattn.BlockSparseMask.from_dense(torch.ones(blocks, dtype=torch.bool,
                                                         device=q.device))


class Op:
    """ours(q, k, v, causal, extra) -> (out, lse); ref(q, k, v, extra) -> (out, lse) on a
    problem whose rows see every key (the last row's keys when causal: bottom-right aligned);
    extra(device) -> dict of the op's other inputs (learnable ones get gradients)."""

    def __init__(self, ours, ref, extra=lambda device: {}, causal_only=False):
        self.ours, self.ref, self.extra, self.causal_only = ours, ref, extra, causal_only


def _score_variants(device):
    """ALiBi, sinks and a relative-bias table together (float32, on the op's device)."""
    return {"alibi_slopes": torch.tensor([0.2, 0.1, 0.05, 0.3], device=device),
            "sinks": torch.tensor([1.0, -0.5, 0.3, 2.0], device=device),
            "rel_bias": (0.1 * torch.randn(HQ, 6)).to(device)}


def _basis(device):
    return {"basis": torch.linalg.qr(torch.randn(1, HKV, 64, 64, dtype=torch.float64))[0]
            .to(device)}


def _lazy_params(device):
    return {"tau": torch.tensor([-0.5, 0.3, -0.1, 0.2], device=device),
            "bias": (0.1 * torch.randn(HQ, 5)).to(device)}


OPS = {
    "flash": Op(lambda q, k, v, c, x: adaattn.flash_attn(q, k, v, causal=c, return_lse=True),
                lambda q, k, v, x: reference.flash_attn(q, k, v, causal=True)),
    "softcap": Op(lambda q, k, v, c, x: adaattn.flash_attn(q, k, v, causal=c, softcap=3.0,
                                                           return_lse=True),
                  lambda q, k, v, x: reference.flash_attn(q, k, v, causal=True, softcap=3.0)),
    # Positional variants need the row's position, which the row-wise reference keeps only
    # when causal (each row's keys end at its own position).
    "variants": Op(lambda q, k, v, c, x: adaattn.flash_attn(q, k, v, causal=c, softcap=4.0,
                                                            return_lse=True, **x),
                   lambda q, k, v, x: reference.flash_attn(q, k, v, causal=True, softcap=4.0,
                                                           **x),
                   _score_variants, causal_only=True),
    "lazy": Op(lambda q, k, v, c, x: adaattn.lazy_attn(q, k, v, x["tau"], x["bias"],
                                                       return_lse=True),
               lambda q, k, v, x: reference.lazy_attn(q, k, v, x["tau"], x["bias"]),
               _lazy_params, causal_only=True),
    "low_rank": Op(lambda q, k, v, c, x: adaattn.low_rank_attn(
                       q, k, v, x["basis"].to(q.dtype), causal=c, return_lse=True),
                   lambda q, k, v, x: reference.low_rank_attn(q, k, v, x["basis"], causal=True),
                   _basis),
    "block_sparse": Op(lambda q, k, v, c, x: adaattn.block_sparse_attn(
                           q, k, v, _mask(q, k), causal=c, return_lse=True),
                       lambda q, k, v, x: reference.block_sparse_attn(q, k, v, _mask(q, k),
                                                                      causal=True)),
}


def _rowwise(op, q, k, v, causal, extra):
    """The reference on each row's visible keys (rows r of q, keys [0, r] when causal with
    Lq = Lk, else all), as one differentiable (out, lse)."""
    outs, lses = [], []
    for r in range(q.shape[2]):
        keys = r + 1 if causal else k.shape[2]
        out, lse = op.ref(q[:, :, r:r + 1], k[:, :, :keys], v[:, :, :keys], extra)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _lazy_value_reach(op, q, k, v, extra, out):
    """Lazy attention drops a key whose clipped weight is 0 (the kernels skip it, exactly for
    finite values), so a bad value reaches only the rows that give its key a non-zero weight:
    ``out`` (the row-wise reference) there, the reference with the bad value zeroed elsewhere."""
    q, k, v = (t.detach().double() for t in (q, k, v))
    extra = {n: t.detach() for n, t in extra.items()}
    probe = torch.zeros_like(v)
    probe[0, 0, BAD_ROW] = 1
    weight = _rowwise(op, q, k, probe, True, extra)[0][..., :1]
    clean = _rowwise(op, q, k, torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0), True,
                     extra)[0]
    return torch.where(weight != 0, out, clean)


def _run(fn, tensors, extra):
    """(out, lse, grads...) of fn with out.sum() back-propagated to q, k, v and the extras that
    are float32 learnable parameters (lazy's tau and bias)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    params = {n: (t.detach().clone().requires_grad_(True) if n in ("tau", "bias") else t)
              for n, t in extra.items()}
    out, lse = fn(*leaves, params)
    out.float().sum().backward()
    grads = [t.grad for t in leaves] + [params[n].grad for n in ("tau", "bias") if n in params]
    return [out.detach(), lse.detach()] + grads


def _kind(x):
    """0 finite, 1 +-inf, 2 NaN, per element."""
    return torch.where(torch.isnan(x), 2, torch.where(torch.isinf(x), 1, 0))


def _inputs(device, dtype, length, where, value, spread):
    q, k, v = (torch.randn(1, HQ if n == "q" else HKV, length, 64, dtype=torch.float64)
               for n in "qkv")
    bad = dict(q=q, k=k, v=v)[where]
    if spread == "element":
        bad[0, 0, BAD_ROW, 5] = value
    else:
        bad[0, 0, BAD_ROW, :] = value
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


TOL = {torch.float64: 1e-7, torch.float32: 1e-4}
NAMES = ["out", "lse", "dq", "dk", "dv", "dtau", "dbias"]


def _tile_backward_reach(dense):
    """The dense reference's non-finite entries, widened by the tensor-core backward's Delta.

    A row whose forward output is non-finite (on the tensor cores also a row that shares a tile
    with a bad q or v entry, as in the dense reference's forward) has a non-finite Delta_i; the
    backward multiplies it into dS_ij = p_ij (dP_ij - Delta_i) over whole tiles, masked entries
    (p = 0) included, so it reaches the row's dq and the dk of every key of its kv head.
    Autograd through the reference differentiates the masked entries to exact zeros instead."""
    out = dense[0]
    bad_rows = ~torch.isfinite(out).all(-1, keepdim=True)  # [B, Hq, L, 1]
    dense[2] = dense[2].masked_fill(bad_rows, NAN)
    b, hq = out.shape[:2]
    bad_kv_heads = bad_rows.view(b, HKV, hq // HKV, -1).any(-1).any(-1)[..., None, None]
    dense[3] = dense[3].masked_fill(bad_kv_heads, NAN)
    return dense


def _check(op_name, device, dtype, length, where, value, spread, causal):
    op = OPS[op_name]
    q, k, v = _inputs(device, dtype, length, where, VALUES[value], spread)
    extra = op.extra(device)
    ours = _run(lambda q, k, v, x: op.ours(q, k, v, causal, x), (q, k, v), extra)
    ref64 = {n: (t.double() if n == "basis" else t) for n, t in extra.items()}
    expected = _run(lambda q, k, v, x: _rowwise(op, q, k, v, causal, x),
                    [t.double() for t in (q, k, v)], ref64)
    if value == "nan":
        assert torch.isnan(ours[0]).any()
    if op_name == "lazy" and where == "v":
        expected[0] = _lazy_value_reach(op, q, k, v, extra, expected[0])
    exact = dtype in TOL
    if not exact:
        dense = _run(lambda q, k, v, x: op.ref(q, k, v, x) if causal else
                     _rowwise(op, q, k, v, False, x), [t.double() for t in (q, k, v)], ref64)
        dense = _tile_backward_reach(dense)
    for name, a, b in zip(NAMES, ours, expected):
        a, b = a.double(), b.double()
        # Gradients of a non-finite row mix inf and NaN in path-dependent ways: only
        # finiteness is compared there.
        kind_a, kind_b = _kind(a), _kind(b)
        if name not in ("out", "lse") or not exact:
            kind_a, kind_b = kind_a.clamp(max=1), kind_b.clamp(max=1)
        if exact:
            assert torch.equal(kind_a, kind_b), f"{name}: non-finite entries differ"
            finite = kind_a == 0
            # lse, dtau and dbias are float32 whatever the dtype.
            tol = TOL[dtype] if name in ("out", "dq", "dk", "dv") else max(TOL[dtype], 1e-6)
            torch.testing.assert_close(a[finite], b[finite], rtol=tol, atol=tol,
                                       msg=lambda m: f"{name}: {m}")
        else:
            allowed = _kind(dense[NAMES.index(name)].double()).clamp(max=1)
            assert bool((kind_a >= kind_b).all()), f"{name}: a non-finite entry became finite"
            assert bool((kind_a <= allowed).all()), f"{name}: a non-finite entry leaked further"


GRID = [(op, where, value, spread, causal)
        for op, where, value, spread, causal in itertools.product(
            OPS, "qkv", VALUES, ("element", "row"), (False, True))
        if causal or not OPS[op].causal_only]


def _id(case):
    op, where, value, spread, causal = case
    return f"{op}-{where}-{value}-{spread}-{'causal' if causal else 'full'}"


@pytest.mark.parametrize("case", GRID, ids=_id)
def test_nonfinite_input_cpu(case):
    _check(*case[:1], "cpu", torch.float64, 9, *case[1:])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", GRID, ids=_id)
def test_nonfinite_input_cuda(case, dtype):
    # 150 rows: several tensor-core tiles, so rows of other tiles must stay finite.
    _check(*case[:1], "cuda", dtype, 150, *case[1:])


# ---- Garbage that no row reads --------------------------------------------------------------

# (device, dtype): the CPU kernel, the exact CUDA kernel, the tensor cores.
PATHS = [pytest.param("cpu", torch.float64, id="cpu"),
         pytest.param("cuda", torch.float32, id="cuda-fp32", marks=pytest.mark.cuda),
         pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("device, dtype", PATHS)
def test_nan_past_seqlens_is_never_read(device, dtype, deterministic, d):
    """Padding rows and keys (at or past seqlens[b]) may hold anything: the other rows and the
    gradients of real entries do not change, and padding rows give 0 / -inf (the tensor-core
    kernels load padding as zeros, so no masked entry's zero P multiplies what it holds).
    D = 256 takes the wide kernels on CUDA."""
    length, valid = 150, 70
    seqlens = torch.tensor([valid, length], dtype=torch.int32, device=device)
    clean = [torch.randn(2, 2, length, d, dtype=dtype, device=device) for _ in range(3)]
    dirty = [t.clone() for t in clean]
    for t in dirty:
        t[0, :, valid:] = NAN
    dout = torch.randn(2, 2, length, d, dtype=dtype, device=device)
    dout[0, :, valid:] = 0
    results = []
    for tensors in (clean, dirty):
        leaves = [t.clone().requires_grad_(True) for t in tensors]
        out, lse = adaattn.flash_attn(*leaves, causal=True, seqlens=seqlens, return_lse=True,
                                      deterministic=deterministic)
        out.backward(dout)
        results.append([out, lse] + [t.grad[0, :, :valid] for t in leaves] +
                       [t.grad[1] for t in leaves])
    for name, a, b in zip(["out", "lse"] + ["dq", "dk", "dv"] * 2, *results):
        if deterministic or name in ("out", "lse"):
            assert torch.equal(a, b), f"{name} changed with NaN padding"
        else:  # atomic dQ sums in any order
            torch.testing.assert_close(a, b, msg=lambda m: f"{name} changed with NaN padding: {m}")
    out, lse = results[1][:2]
    assert torch.equal(out[0, :, valid:], torch.zeros_like(out[0, :, valid:]))
    assert bool((lse[0, :, valid:] == -INF).all())


@pytest.mark.parametrize("lazy", [False, True], ids=["flash", "lazy"])
@pytest.mark.parametrize("device, dtype", PATHS)
def test_nan_query_propagates_at_head_dim_256(device, dtype, lazy):
    """D = 256 (the wide kernels on CUDA): a NaN in one query element makes that row's output
    and its dq NaN, as the reference's, and leaves every other row's output finite."""
    q, k, v = (torch.randn(1, 2, 150, 256, dtype=dtype, device=device) for _ in range(3))
    q[0, 1, 77, 5] = NAN
    q.requires_grad_(True)
    if lazy:
        tau = torch.tensor([-0.5, 0.3], device=device)
        bias = (0.1 * torch.randn(2, 16)).to(device)
        out = adaattn.lazy_attn(q, k, v, tau, bias)
    else:
        out = adaattn.flash_attn(q, k, v, causal=True)
    out.backward(torch.ones_like(out))
    bad = torch.zeros(out.shape[:-1], dtype=torch.bool, device=device)
    bad[0, 1, 77] = True
    assert bool(torch.isnan(out[bad]).all()), "the NaN query's row is not NaN"
    assert bool(torch.isfinite(out[~bad]).all()), "a NaN reached another row"
    assert bool(torch.isnan(q.grad[bad]).all()), "the NaN query's dq is not NaN"


@pytest.mark.parametrize("device", DEVICES)
def test_nan_in_unlisted_block_is_never_read(device):
    """A NaN key and value in a block the layout does not list reach no row."""
    length = 256
    layout = torch.tensor([[True, False], [True, True]]).view(1, 1, 2, 2)
    mask = adaattn.BlockSparseMask.from_dense(layout, block_size=(128, 128)).to(device)
    q, k, v = (torch.randn(1, 2, length, 64, device=device) for _ in range(3))
    k[0, :, 200] = NAN
    v[0, :, 200] = NAN
    out = adaattn.block_sparse_attn(q, k, v, mask)
    assert torch.isfinite(out[0, :, :128]).all()
    assert torch.isnan(out[0, :, 128:]).all(-1).all()


# ---- Decode ------------------------------------------------------------------------------

@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("where", ["q", "k_cache", "v_cache", "k", "v", "past"])
@pytest.mark.parametrize("lazy", [False, True], ids=["flash", "lazy"])
@pytest.mark.parametrize("device, dtype", PATHS)
def test_nonfinite_decode(device, dtype, lazy, where, value):
    """One decode step (Lq = 1, new k/v appended) of two sequences, the bad value in sequence
    0: the reference's rows; ``past`` puts it in the cache past the sequence, where no row
    reads. On CUDA with several splits (the split merge must carry the NaN too) and with one."""
    lmax, cached = 512, torch.tensor([300, 400], dtype=torch.int32)
    q = torch.randn(2, HQ, 1, 64)
    k_cache, v_cache = torch.randn(2, HKV, lmax, 64), torch.randn(2, HKV, lmax, 64)
    k_new, v_new = torch.randn(2, HKV, 1, 64), torch.randn(2, HKV, 1, 64)
    val = VALUES[value]
    if where == "q":
        q[0, 0, 0, 5] = val
    elif where in ("k_cache", "v_cache"):
        dict(k_cache=k_cache, v_cache=v_cache)[where][0, 0, 100, 5] = val
    elif where in ("k", "v"):
        dict(k=k_new, v=v_new)[where][0, 0, 0, 5] = val
    else:
        k_cache[0, 0, 350:] = NAN
        v_cache[0, 0, 350:] = NAN
    args = [t.to(device=device, dtype=dtype) for t in (q, k_cache, v_cache, k_new, v_new)]
    params = _lazy_params(device)
    kwargs = dict(cache_seqlens=cached.to(device), return_lse=True)
    if lazy:
        ref_out, ref_lse = reference.lazy_attn_with_kvcache(
            *[t.double() for t in args], params["tau"], params["bias"], **kwargs)
    else:
        ref_out, ref_lse = reference.flash_attn_with_kvcache(
            *[t.double() for t in args], **kwargs)
    # CUDA: four splits (the merge carries the bad value) and one (lazy's passes in one kernel).
    for splits in (4, 1) if device == "cuda" else (0,):
        if lazy:
            out, lse = adaattn.lazy_attn_with_kvcache(*args, params["tau"], params["bias"],
                                                      num_splits=splits, **kwargs)
        else:
            out, lse = adaattn.flash_attn_with_kvcache(*args, num_splits=splits, **kwargs)
        for name, a, b in (("out", out, ref_out), ("lse", lse, ref_lse)):
            assert torch.equal(_kind(a.double()).clamp(max=1),
                               _kind(b.double()).clamp(max=1)), name
            if name == "lse" or dtype in TOL:
                assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{name}: NaN entries differ"
            finite = torch.isfinite(b)
            tol = TOL.get(dtype, 3e-2)
            torch.testing.assert_close(a.double()[finite], b.double()[finite], rtol=tol,
                                       atol=tol)


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("where", ["q", "k_cache", "v_cache", "k", "v"])
@pytest.mark.parametrize("lazy", [False, True], ids=["flash", "lazy"])
@pytest.mark.parametrize("device, dtype", PATHS)
def test_nonfinite_decode_many_rows(device, dtype, lazy, where, value):
    """Sixteen new rows per sequence (32 rows per kv head: the wide decode kernels, wgmma on
    Hopper), the bad value in sequence 0 and kv head 0: in q's row 3, in a cached key or value
    every row sees, or in the new token of row 3, which rows 0-2 do not see. The expectation is
    the reference run row by row over each row's keys, where lazy attention drops the keys its
    row weighs 0 (their bad values reach no row); the tensor cores may also carry a bad value to
    the other rows of its tile (0 * NaN), up to the dense reference's rows, but no further."""
    lmax, len_q, bad_row = 512, 16, 3
    cached = torch.tensor([300, 400], dtype=torch.int32)
    q = torch.randn(2, HQ, len_q, 64, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(2, HKV, lmax, 64, dtype=torch.float64) for _ in range(2))
    k_new, v_new = (torch.randn(2, HKV, len_q, 64, dtype=torch.float64) for _ in range(2))
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k_new, v=v_new)
    at = dict(q=(0, 0, bad_row, 5), k_cache=(0, 0, 100, 5), v_cache=(0, 0, 100, 5),
              k=(0, 0, bad_row, 5), v=(0, 0, bad_row, 5))[where]
    params = {name: t.cpu().double() for name, t in _lazy_params("cpu").items()}

    def reference_rows(ts, row_wise):
        """out, lse of the reference in float64: all rows at once (dense), or row_wise: row r
        alone against the cache holding the new tokens up to its own."""
        if not row_wise:
            fn = reference.lazy_attn_with_kvcache if lazy else reference.flash_attn_with_kvcache
            extra = (params["tau"], params["bias"]) if lazy else ()
            return fn(ts["q"], ts["k_cache"], ts["v_cache"], ts["k"], ts["v"], *extra,
                      cache_seqlens=cached, return_lse=True)
        k_full, v_full = ts["k_cache"].clone(), ts["v_cache"].clone()
        for b in range(2):
            span = slice(int(cached[b]), int(cached[b]) + len_q)
            k_full[b, :, span], v_full[b, :, span] = ts["k"][b], ts["v"][b]
        outs, lses = [], []
        for r in range(len_q):
            lens = cached + r + 1
            if lazy:
                o, l = reference.lazy_attn_with_kvcache(
                    ts["q"][:, :, r:r + 1], k_full, v_full, None, None, params["tau"],
                    params["bias"], cache_seqlens=lens, return_lse=True)
            else:
                o, l = reference.flash_attn_with_kvcache(
                    ts["q"][:, :, r:r + 1], k_full, v_full, cache_seqlens=lens, return_lse=True)
            outs.append(o)
            lses.append(l)
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)

    clean_out = reference_rows(tensors, True)[0]
    weighs = None
    if lazy and where in ("v_cache", "v"):
        # The row weighs the key iff its output is non-zero for values one-hot at the key.
        probe = dict(tensors, v_cache=torch.zeros_like(v_cache), v=torch.zeros_like(v_new))
        probe[where][at] = 1
        weighs = reference_rows(probe, True)[0][..., at[-1]:at[-1] + 1] != 0
    tensors[where][at] = VALUES[value]
    rows_out, rows_lse = reference_rows(tensors, True)
    dense_out, dense_lse = reference_rows(tensors, False)
    if weighs is not None:
        # Lazy attention drops a key its row weighs 0: there the row is the clean one.
        assert weighs.any() and not weighs[0, :2].all(), "rows of both kinds"
        rows_out = torch.where(weighs, rows_out, clean_out)

    args = [t.to(device=device, dtype=dtype) for t in (q, k_cache, v_cache, k_new, v_new)]
    kwargs = dict(cache_seqlens=cached.to(device), return_lse=True,
                  num_splits=4 if device == "cuda" else 0)
    if lazy:
        out, lse = adaattn.lazy_attn_with_kvcache(*args, params["tau"].float().to(device),
                                                  params["bias"].float().to(device), **kwargs)
    else:
        out, lse = adaattn.flash_attn_with_kvcache(*args, **kwargs)
    tensor_cores = dtype not in TOL
    for name, ours, row_wise, dense in (("out", out, rows_out, dense_out),
                                        ("lse", lse, rows_lse, dense_lse)):
        ours, row_wise, dense = ours.double().cpu(), row_wise.double(), dense.double()
        bad_ours, bad_rows = ~torch.isfinite(ours), ~torch.isfinite(row_wise)
        if tensor_cores:
            assert bool((bad_ours >= bad_rows).all()), f"{name}: a bad entry became finite"
            assert bool((bad_ours <= ~torch.isfinite(dense)).all()), f"{name}: a bad entry leaked"
        else:
            assert torch.equal(bad_ours, bad_rows), f"{name}: non-finite entries differ"
            assert torch.equal(torch.isnan(ours), torch.isnan(row_wise)), f"{name}: NaN differ"
        finite = ~bad_ours & ~bad_rows
        tol = TOL.get(dtype, 3e-2)
        torch.testing.assert_close(ours[finite], row_wise[finite], rtol=tol, atol=tol)
