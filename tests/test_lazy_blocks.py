"""The block ops of ring_lazy_attn (torch.ops.adaattn.lazy_block_lse/out/row_terms/bwd): lazy
attention over a sequence cut into chunks, every causal pair of chunks one call with its own
positions, equals lazy_attn on the whole sequence (also where a key is NaN, and for empty
sequences); schemas and fake kernels (opcheck); bad positions.

The pieces are combined as ring_lazy_attn does (adaattn/distributed.py): block lse merged with
logaddexp, block outputs summed against the merged lse, row terms (Delta, G / (i + 1)) summed,
then each block's gradients against them. The ops take the merged lse and Delta as float32 (as
lazy_attn's lse), so float64 agrees to float32's rounding of them (~1e-7), as ring flash does.
"""
import pytest
import torch

import adaattn

from accuracy import assert_low_precision_rule, assert_rel_close
from adaattn import reference

ops = torch.ops.adaattn
RTOL = {torch.float32: 1e-5, torch.float64: 1e-6}


def _inputs(dtype, device, b=2, hq=4, hkv=2, length=24, d=16, window=7, seed=0):
    g = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(device)
    q, k, v, dout = (draw(b, h, length, d).to(dtype) for h in (hq, hkv, hkv, hq))
    tau = (-0.3 - 0.4 * draw(hq).abs()).float()
    bias = draw(hq, window, scale=0.5).float()
    return q, k, v, dout, tau, bias


def _blockwise(q, k, v, dout, tau, bias, chunk):
    """lazy_attn's out, lse and the five gradients, assembled from the block ops over chunks."""
    length = q.shape[2]
    pairs = [(qc, kc) for qc in range(length // chunk) for kc in range(qc + 1)]

    def rows(t, c):
        return t[:, :, c * chunk:(c + 1) * chunk]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    for qc, kc in pairs:
        part = ops.lazy_block_lse(rows(q, qc), rows(k, kc), tau, bias, None, qc * chunk,
                                  kc * chunk)
        rows(lse, qc).copy_(torch.logaddexp(rows(lse, qc), part.to(acc)))
    lse = lse.float()
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    for qc, kc in pairs:
        rows(out, qc).add_(ops.lazy_block_out(rows(q, qc), rows(k, kc), rows(v, kc), tau, bias,
                                              rows(lse, qc).contiguous(), None, qc * chunk,
                                              kc * chunk))
    delta = torch.zeros(lse.shape, dtype=acc, device=q.device)
    row_g = torch.zeros_like(delta)
    for qc, kc in pairs:
        d_part, g_part = ops.lazy_block_row_terms(rows(dout, qc), rows(q, qc), rows(k, kc),
                                                  rows(v, kc), tau, bias,
                                                  rows(lse, qc).contiguous(), None, qc * chunk,
                                                  kc * chunk)
        rows(delta, qc).add_(d_part)
        rows(row_g, qc).add_(g_part)
    delta = delta.float()
    grads = [torch.zeros(t.shape, dtype=acc, device=q.device) for t in (q, k, v)]
    dbias = torch.zeros_like(bias)
    for qc, kc in pairs:
        dq, dk, dv, db = ops.lazy_block_bwd(rows(dout, qc), rows(q, qc), rows(k, kc), rows(v, kc),
                                            tau, bias, rows(lse, qc).contiguous(),
                                            rows(delta, qc).contiguous(), None, qc * chunk,
                                            kc * chunk, True)
        rows(grads[0], qc).add_(dq)
        rows(grads[1], kc).add_(dk)
        rows(grads[2], kc).add_(dv)
        dbias += db
    dtau = row_g.sum(dim=(0, 2)).float()
    return [out.to(q.dtype), lse] + [t.to(q.dtype) for t in grads] + [dtau, dbias]


def _whole(q, k, v, dout, tau, bias):
    ts = [t.clone().requires_grad_() for t in (q, k, v, tau, bias)]
    out, lse = adaattn.lazy_attn(*ts, return_lse=True)
    out.backward(dout)
    return [out.detach(), lse] + [t.grad for t in ts]


NAMES = ("out", "lse", "dq", "dk", "dv", "dtau", "dbias")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk,window", [(8, 7), (6, 2), (4, 30)])
def test_blocks_equal_lazy_attn_cpu(dtype, chunk, window):
    """Chunks of 4-8 rows; bias windows inside one chunk and past the whole sequence."""
    inputs = _inputs(dtype, "cpu", window=window)
    for name, ours, full in zip(NAMES, _blockwise(*inputs, chunk), _whole(*inputs)):
        assert_rel_close(name, ours, full, RTOL[torch.float32 if name in ("dtau", "dbias")
                                                else dtype])


def test_blocks_nan_key_cpu():
    """A NaN key reaches the same entries through the blocks as through lazy_attn."""
    q, k, v, dout, tau, bias = _inputs(torch.float64, "cpu")
    k = k.clone()
    k[0, 1, 5, 3] = float("nan")
    for name, ours, full in zip(NAMES, _blockwise(q, k, v, dout, tau, bias, 8),
                                _whole(q, k, v, dout, tau, bias)):
        assert torch.isnan(full).any() or name == "dtau", name
        assert torch.equal(torch.isnan(ours), torch.isnan(full)), name
        finite = ~torch.isnan(full)
        assert_rel_close(name, ours[finite], full[finite], RTOL[torch.float32])


def test_blocks_empty_cpu():
    q, k, v, dout, tau, bias = _inputs(torch.float32, "cpu", length=0)
    assert ops.lazy_block_lse(q, k, tau, bias, None, 0, 0).shape == (2, 4, 0)
    lse = torch.empty(2, 4, 0)
    assert ops.lazy_block_out(q, k, v, tau, bias, lse, None, 0, 0).shape == (2, 4, 0, 16)
    delta, row_g = ops.lazy_block_row_terms(dout, q, k, v, tau, bias, lse, None, 0, 0)
    assert delta.shape == row_g.shape == (2, 4, 0)
    dq, dk, dv, dbias = ops.lazy_block_bwd(dout, q, k, v, tau, bias, lse, delta, None, 0, 0, True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert torch.equal(dbias, torch.zeros_like(bias))


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 128])
def test_blocks_low_precision_cuda(d):
    """bf16 on the tensor cores (chunks of 128 and 64 rows: whole and partial tiles) against
    the float64 and bf16 references, flash-attn's 2x rule."""
    q, k, v, dout, tau, bias = _inputs(torch.float64, "cuda", b=2, hq=8, hkv=2, length=384,
                                       d=d, window=150)

    def ref(dtype):
        ts = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        ps = [t.detach().to(torch.float64 if dtype == torch.float64 else t.dtype)
              .requires_grad_() for t in (tau, bias)]
        out, lse = reference.lazy_attn(*ts, *ps, upcast=dtype == torch.float64)
        out.backward(dout.to(dtype))
        return [out, lse] + [t.grad for t in ts + ps]
    hi, lo = ref(torch.float64), ref(torch.bfloat16)
    for chunk in (128, 64):
        ours = _blockwise(*(t.to(torch.bfloat16) for t in (q, k, v, dout)), tau, bias, chunk)
        for name, o, b16, f64 in zip(NAMES, ours, lo, hi):
            assert_low_precision_rule(name, o, b16, f64)


def _opcheck_args(device):
    q, k, v, dout, tau, bias = _inputs(torch.float32, device, length=8)
    lse = ops.lazy_block_lse(q, k, tau, bias, None, 8, 0)
    delta, _ = ops.lazy_block_row_terms(dout, q, k, v, tau, bias, lse, None, 8, 0)
    return {
        "lazy_block_lse": (q, k, tau, bias, None, 8, 0),
        "lazy_block_out": (q, k, v, tau, bias, lse, None, 8, 0),
        "lazy_block_row_terms": (dout, q, k, v, tau, bias, lse, None, 8, 0),
        "lazy_block_bwd": (dout, q, k, v, tau, bias, lse, delta, None, 8, 0, True),
    }


@pytest.mark.parametrize("name", ["lazy_block_lse", "lazy_block_out", "lazy_block_row_terms",
                                  "lazy_block_bwd"])
def test_opcheck_cpu(name):
    torch.library.opcheck(getattr(ops, name).default, _opcheck_args("cpu")[name],
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def test_bad_positions():
    q, k, v, dout, tau, bias = _inputs(torch.float32, "cpu", length=8)
    with pytest.raises(ValueError, match=r"adaattn.lazy_block_lse: q_position must be >= 0"):
        ops.lazy_block_lse(q, k, tau, bias, None, -1, 0)
    with pytest.raises(ValueError, match=r"adaattn.lazy_block_out: k_position must be >= 0"):
        lse = ops.lazy_block_lse(q, k, tau, bias, None, 0, 0)
        ops.lazy_block_out(q, k, v, tau, bias, lse, None, 0, -3)
    with pytest.raises(ValueError, match=r"adaattn.lazy_block_bwd: delta must have shape"):
        ops.lazy_block_bwd(dout, q, k, v, tau, bias, lse, lse[:, :, :4].contiguous(), None, 0, 0,
                           False)
