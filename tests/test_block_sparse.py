"""Tests of adaattn.block_sparse_attn and adaattn.BlockSparseMask (docs/ops.md; rules: accuracy.py).

Ground truth is ``adaattn.reference.block_sparse_attn`` (softmax attention under the equivalent
element mask) run in float64. Bars, as in test_flash.py:
* float64: ``torch.autograd.gradcheck`` of q, k, v (and the forward against the reference);
* float32: relative error ``||a - b|| / ||b|| <= 1e-5`` for out, lse, dq, dk, dv;
* float16/bfloat16: ``err(ours) <= 2 * err(reference in the same dtype) + 1e-5`` with
  ``err = max |x - x_float64|``, for out, lse, dq, dk, dv.
Layouts are random at densities 0, 0.1, 0.5 and 1, shared by the batch and heads or per batch
and/or per query head. Every test runs with NaN-poisoned allocations (see conftest.py). CUDA cases
carry the ``cuda`` marker and skip at run time without a GPU.
"""
import dataclasses
import math
import warnings
from typing import Optional, Tuple

import pytest
import torch

import adaattn
from adaattn import BlockSparseMask, reference

from accuracy import FP32_RTOL, LOW_PRECISION, assert_low_precision_rule, assert_rel_close, randn

NAMES = ("out", "lse", "dq", "dk", "dv")


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem: shapes, block layout (density, per-batch/per-head) and options."""

    b: int = 1
    hq: int = 2
    hkv: int = 2
    lq: int = 130
    lk: int = 130
    d: int = 32
    block: Tuple[int, int] = (64, 64)
    density: float = 0.5
    mask_b: bool = False  # one layout per batch entry (else broadcast over B)
    mask_h: bool = False  # one layout per query head (else broadcast over Hq)
    causal: bool = False
    transposed: bool = False
    scale: Optional[float] = None

    def __str__(self):
        parts = [f"b{self.b}h{self.hq}x{self.hkv}", f"l{self.lq}x{self.lk}", f"d{self.d}",
                 f"blk{self.block[0]}x{self.block[1]}", f"p{self.density}"]
        if self.mask_b:
            parts.append("perB")
        if self.mask_h:
            parts.append("perH")
        if self.causal:
            parts.append("causal")
        if self.transposed:
            parts.append("T")
        if self.scale is not None:
            parts.append(f"scale{self.scale}")
        return "-".join(parts)




def random_layout(case: Case) -> torch.Tensor:
    """Seeded CPU bool layout ``[B|1, H|1, nQ, nKV]`` with about ``density`` of its blocks set
    (density 0 and 1 give the empty and the full layout exactly)."""
    shape = (case.b if case.mask_b else 1, case.hq if case.mask_h else 1,
             math.ceil(case.lq / case.block[0]), math.ceil(case.lk / case.block[1]))
    return torch.rand(shape) < case.density


def make_inputs(case: Case, dtype, device, requires_grad=True):
    """Returns leaf ``q, k, v``, the ``BlockSparseMask`` on ``device`` and ``dout``."""
    q = randn(case.b, case.hq, case.lq, case.d, dtype, device, case.transposed)
    k = randn(case.b, case.hkv, case.lk, case.d, dtype, device, case.transposed)
    v = randn(case.b, case.hkv, case.lk, case.d, dtype, device, case.transposed)
    dout = randn(case.b, case.hq, case.lq, case.d, dtype, device, case.transposed)
    mask = BlockSparseMask.from_dense(random_layout(case).to(device), case.block)
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_()
    return q, k, v, mask, dout


def run_ours(case: Case, q, k, v, mask, dout, deterministic=False, bwd_mode="auto"):
    """``(out, lse, dq, dk, dv)`` from adaattn.block_sparse_attn."""
    out, lse = adaattn.block_sparse_attn(q, k, v, mask, causal=case.causal,
                                         softmax_scale=case.scale, return_lse=True,
                                         deterministic=deterministic, bwd_mode=bwd_mode)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
    return (out, lse) + tuple(grads)


def run_reference(case: Case, q, k, v, mask, dout, dtype):
    """``(out, lse, dq, dk, dv)`` from the materialised reference computed in ``dtype``."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = reference.block_sparse_attn(q, k, v, mask, causal=case.causal,
                                           softmax_scale=case.scale)
    grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    return (out, lse) + tuple(grads)










# --------------------------------------------------------------------------------------------
# float64: gradcheck
# --------------------------------------------------------------------------------------------

GRADCHECK_CASES = [
    Case(lq=130, lk=130, d=4, density=0.5),
    Case(lq=70, lk=150, d=4, density=0.5, causal=True),
    Case(lq=150, lk=70, d=3, density=1.0, causal=True),  # rows before the diagonal see no key
    Case(b=2, hq=4, hkv=2, lq=129, lk=65, d=3, density=0.5, mask_b=True, mask_h=True),
    Case(b=2, hkv=1, lq=100, lk=140, d=4, block=(128, 64), density=0.5, transposed=True,
         scale=0.7),
]


@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=str)
def test_gradcheck_fp64(device, case):
    q, k, v, mask, _ = make_inputs(case, torch.float64, device)

    def fn(q, k, v):
        return adaattn.block_sparse_attn(q, k, v, mask, causal=case.causal,
                                         softmax_scale=case.scale)

    ref_out, _ = reference.block_sparse_attn(q.detach(), k.detach(), v.detach(), mask,
                                             causal=case.causal, softmax_scale=case.scale)
    assert_rel_close("out", fn(q, k, v).detach(), ref_out, FP32_RTOL)
    assert torch.autograd.gradcheck(fn, (q, k, v))


# --------------------------------------------------------------------------------------------
# float32: relative error <= 1e-5 against float64
# --------------------------------------------------------------------------------------------

DENSITIES = (0.0, 0.1, 0.5, 1.0)

FP32_CASES = [
    # Every density, with and without causal, GQA 2, per-head layouts, Lq != Lk.
    *[Case(b=2, hq=4, hkv=2, lq=300, lk=400, d=32, density=p, mask_h=True, causal=c)
      for p in DENSITIES for c in (False, True)],
    *[Case(b=2, hq=2, hkv=1, lq=257, lk=257, d=64, block=(128, 128), density=p, mask_b=True)
      for p in DENSITIES],
    Case(lq=1, lk=1025, d=32, block=(64, 128), density=0.5),
    Case(hq=8, hkv=1, lq=200, lk=97, d=96, block=(128, 64), density=0.5, causal=True),
    Case(b=2, hq=4, hkv=4, lq=97, lk=300, d=64, density=0.1, mask_b=True, mask_h=True,
         transposed=True),
    Case(lq=65, lk=129, d=5, density=0.5, scale=0.3),
]


def _check_fp32(case, device):
    q, k, v, mask, dout = make_inputs(case, torch.float32, device)
    ours = run_ours(case, q, k, v, mask, dout)
    ref = run_reference(case, q, k, v, mask, dout, torch.float64)
    for name, a, e in zip(NAMES, ours, ref):
        assert_rel_close(name, a, e, FP32_RTOL)


@pytest.mark.parametrize("case", FP32_CASES, ids=str)
def test_fp32_matches_reference(device, case):
    _check_fp32(case, device)


FP32_CUDA_GRID = [
    Case(b=2, hq=4, hkv=hkv, lq=length, lk=length, d=d, block=block, density=p, causal=causal,
         mask_h=True)
    for length in (97, 1000, 1025)
    for d, hkv in ((64, 2), (128, 4))
    for block in ((128, 128), (64, 64))
    for p in DENSITIES
    for causal in (False, True)
]


@pytest.mark.cuda
@pytest.mark.parametrize("case", FP32_CUDA_GRID, ids=str)
def test_fp32_cuda_grid(case):
    _check_fp32(case, "cuda")


def test_full_layout_equals_flash_attn(device):
    """Density 1 is flash attention. On the CPU both kernels visit the same tiles in the same
    order, so the results are bitwise equal; elsewhere they meet the fp32 bar against each
    other."""
    case = Case(b=2, hq=4, hkv=2, lq=200, lk=300, d=32, block=(128, 64), density=1.0,
                causal=True)
    q, k, v, mask, dout = make_inputs(case, torch.float32, device)
    ours = run_ours(case, q, k, v, mask, dout)
    out, lse = adaattn.flash_attn(q, k, v, causal=True, return_lse=True)
    flash = (out, lse) + torch.autograd.grad(out, (q, k, v), dout)
    for name, a, e in zip(NAMES, ours, flash):
        if device == "cpu":
            assert torch.equal(a, e), f"{name} differs from flash_attn"
        else:
            assert_rel_close(name, a, e, FP32_RTOL)


# --------------------------------------------------------------------------------------------
# float16 / bfloat16: err(ours) <= 2 * err(reference in the same dtype) + 1e-5
# --------------------------------------------------------------------------------------------

def _check_low_precision(case, dtype, device):
    q, k, v, mask, dout = make_inputs(case, dtype, device)
    ours = run_ours(case, q, k, v, mask, dout)
    ref64 = run_reference(case, q, k, v, mask, dout, torch.float64)
    ref_low = run_reference(case, q, k, v, mask, dout, dtype)
    for name, a, lo, e in zip(NAMES, ours, ref_low, ref64):
        assert_low_precision_rule(name, a, lo, e)


LOW_PRECISION_CPU_CASES = [
    Case(b=2, hq=4, hkv=2, lq=200, lk=257, d=64, density=0.5, mask_h=True, causal=True),
    Case(b=2, hq=2, hkv=1, lq=257, lk=129, d=32, block=(128, 64), density=0.1, mask_b=True,
         transposed=True),
]


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("case", LOW_PRECISION_CPU_CASES, ids=str)
def test_low_precision_cpu(case, dtype):
    _check_low_precision(case, dtype, "cpu")


def _low_precision_cuda_grid():
    """Sequence pairs x D in {64, 128} x densities x causal, GQA ratio rotating over 1, 2, 8,
    layouts alternating shared / per batch / per head; then transposed inputs and 64x64 blocks."""
    cases = []
    gqa = [(8, 8), (8, 4), (8, 1)]
    for lq, lk in [(128, 128), (1000, 1000), (1025, 1025), (1, 1025), (1025, 1000)]:
        for d in (64, 128):
            for p in DENSITIES:
                for causal in (False, True):
                    hq, hkv = gqa[len(cases) % 3]
                    cases.append(Case(b=2, hq=hq, hkv=hkv, lq=lq, lk=lk, d=d, block=(128, 128),
                                      density=p, causal=causal, mask_b=len(cases) % 3 == 1,
                                      mask_h=len(cases) % 3 == 2))
    cases += [
        Case(b=2, hq=8, hkv=2, lq=1000, lk=1025, d=128, block=(128, 128), density=0.5,
             causal=True, transposed=True),
        Case(b=2, hq=4, hkv=4, lq=1025, lk=1025, d=64, block=(128, 128), density=0.1,
             mask_h=True),
        Case(b=2, hq=4, hkv=1, lq=1025, lk=1025, d=64, block=(128, 128), density=0.5,
             causal=True, mask_b=True),
        # head dims without a kernel of their own, on (128, 128) and (32, 64)
        Case(b=2, hq=4, hkv=2, lq=300, lk=400, d=96, block=(128, 128), density=0.5,
             causal=True, mask_h=True),
        Case(b=2, hq=4, hkv=4, lq=1000, lk=1025, d=32, block=(128, 128), density=0.25),
    ]
    return cases


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("case", _low_precision_cuda_grid(), ids=str)
def test_low_precision_cuda(case, dtype):
    _check_low_precision(case, dtype, "cuda")


# --------------------------------------------------------------------------------------------
# Rows without blocks, empty inputs, determinism
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *LOW_PRECISION], ids=str)
def test_rows_without_blocks(device, dtype):
    """Rows of query blocks with no listed block give out 0, lse -inf and dq 0; keys in no listed
    block get dk = dv = 0 exactly; nothing is NaN. The layout differs per head."""
    case = Case(b=2, hq=4, hkv=2, lq=200, lk=150, d=64, block=(128, 128), density=0.5,
                mask_h=True)
    q, k, v, _, dout = make_inputs(case, dtype, device)
    layout = torch.zeros(1, 4, 2, 2, dtype=torch.bool)
    layout[0, 0, 0, 1] = layout[0, 1, 1, 0] = layout[0, 2, 1, 1] = layout[0, 3, 0, 1] = True
    mask = BlockSparseMask.from_dense(layout.to(device), 128)
    out, lse, dq, dk, dv = run_ours(case, q, k, v, mask, dout)
    elements = reference.block_sparse_key_mask(mask, case.lq, case.lk)[0]  # [Hq, Lq, Lk]
    empty_rows = ~elements.any(-1)  # [Hq, Lq]
    # Keys no query head of the group sees: [Hkv, Lk].
    unseen_keys = ~elements.any(-2).view(case.hkv, case.hq // case.hkv, case.lk).any(1)
    assert empty_rows.any() and unseen_keys.any()
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(t).all(), f"{name}: non-finite values"
    assert (out[:, empty_rows] == 0).all() and (dq[:, empty_rows] == 0).all()
    assert torch.isneginf(lse[:, empty_rows]).all() and torch.isfinite(lse[:, ~empty_rows]).all()
    assert (dk[:, unseen_keys] == 0).all() and (dv[:, unseen_keys] == 0).all()
    assert (dk[:, ~unseen_keys] != 0).any()


EMPTY_SHAPES = [  # (B, Hq, Hkv, Lq, Lk, D)
    (0, 2, 2, 5, 7, 64),
    (1, 2, 2, 0, 7, 64),
    (1, 2, 2, 5, 0, 64),
    (2, 4, 2, 0, 0, 64),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_empty_inputs(device, shape, causal):
    b, hq, hkv, lq, lk, d = shape
    case = Case(b=b, hq=hq, hkv=hkv, lq=lq, lk=lk, d=d, density=1.0, causal=causal)
    q, k, v, mask, dout = make_inputs(case, torch.float32, device)
    out, lse, dq, dk, dv = run_ours(case, q, k, v, mask, dout)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    if lk == 0:
        assert (out == 0).all() and torch.isneginf(lse).all()
    for g in (dq, dk, dv):
        assert (g == 0).all(), "gradients of an empty problem must be zeros"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic(device, dtype):
    """Two runs give bit-identical outputs and gradients (GQA 4: dk/dv gather several heads with
    different layouts)."""
    case = Case(b=2, hq=8, hkv=2, lq=300, lk=257, d=64, block=(128, 128), density=0.5,
                mask_h=True, causal=True)
    q, k, v, mask, dout = make_inputs(case, dtype, device)
    first = run_ours(case, q, k, v, mask, dout, deterministic=True)
    second = run_ours(case, q, k, v, mask, dout, deterministic=True)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), f"{name} differs between two runs"


@pytest.mark.cuda
@pytest.mark.parametrize("density,two_pass", [(0.1, True), (1.0, False)])
def test_backward_choice_by_listed_keys(density, two_pass):
    """The mask's mean listed keys per row (9 blocks of 128 at density 1, about 1 at 0.1) picks
    the backward of bwd_mode="auto": two-pass up to 768 keys, atomic dQ above. The count reaches
    the host without a sync; the first call of prefers_two_pass only starts it and answers True
    (two-pass). Both backwards meet the low-precision bar."""
    case = Case(b=2, hq=4, hkv=2, lq=1025, lk=1025, d=64, block=(128, 128), density=density,
                causal=True)
    q, k, v, mask, dout = make_inputs(case, torch.bfloat16, "cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert mask.prefers_two_pass(), "the first call only starts the count"
        adaattn.block_sparse_attn(q, k, v, mask, causal=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert mask.prefers_two_pass() is two_pass
    assert mask.to("cuda").prefers_two_pass() is two_pass, "to() keeps the count"
    ours = run_ours(case, q, k, v, mask, dout)
    ref64 = run_reference(case, q, k, v, mask, dout, torch.float64)
    ref_low = run_reference(case, q, k, v, mask, dout, torch.bfloat16)
    for name, a, lo, e in zip(NAMES, ours, ref_low, ref64):
        assert_low_precision_rule(name, a, lo, e)


BWD_MODES = ("auto", "atomic", "two_pass")


@pytest.mark.parametrize("bwd_mode", BWD_MODES)
def test_bwd_mode_fp32(device, bwd_mode):
    """Every bwd_mode meets the fp32 bar (the CPU and the exact CUDA kernels ignore it)."""
    case = Case(b=2, hq=4, hkv=2, lq=300, lk=400, d=32, density=0.5, mask_h=True, causal=True)
    q, k, v, mask, dout = make_inputs(case, torch.float32, device)
    ours = run_ours(case, q, k, v, mask, dout, bwd_mode=bwd_mode)
    ref = run_reference(case, q, k, v, mask, dout, torch.float64)
    for name, a, e in zip(NAMES, ours, ref):
        assert_rel_close(name, a, e, FP32_RTOL)


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bwd_mode", BWD_MODES)
def test_bwd_mode_low_precision_cuda(bwd_mode, d):
    """The tensor-core backwards of every bwd_mode meet the low-precision bar, at density 1
    (where "auto" takes atomic dQ once the mask's count has reached the host) and at D = 64 and
    128 (before Hopper "atomic" has atomic dQ at Dv = 64 only)."""
    case = Case(b=2, hq=8, hkv=2, lq=1025, lk=1000, d=d, block=(128, 128), density=1.0,
                causal=True)
    q, k, v, mask, dout = make_inputs(case, torch.bfloat16, "cuda")
    mask.prefers_two_pass()
    torch.cuda.synchronize()
    assert not mask.prefers_two_pass(), "1024 listed keys per row: auto takes atomic dQ"
    ours = run_ours(case, q, k, v, mask, dout, bwd_mode=bwd_mode)
    ref64 = run_reference(case, q, k, v, mask, dout, torch.float64)
    ref_low = run_reference(case, q, k, v, mask, dout, torch.bfloat16)
    for name, a, lo, e in zip(NAMES, ours, ref_low, ref64):
        assert_low_precision_rule(name, a, lo, e)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_two_pass_bitwise_reproducible(dtype):
    """bwd_mode="two_pass" without deterministic=True: two runs give bit-identical outputs and
    gradients, on a dense mask for which "auto" takes atomic dQ."""
    case = Case(b=2, hq=8, hkv=2, lq=1025, lk=1025, d=64, block=(128, 128), density=1.0,
                mask_h=True, causal=True)
    q, k, v, mask, dout = make_inputs(case, dtype, "cuda")
    mask.prefers_two_pass()
    torch.cuda.synchronize()
    assert not mask.prefers_two_pass()
    first = run_ours(case, q, k, v, mask, dout, bwd_mode="two_pass")
    second = run_ours(case, q, k, v, mask, dout, bwd_mode="two_pass")
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), f"{name} differs between two runs"


@pytest.mark.parametrize("bwd_mode", ["fast", "", "Atomic", "two-pass", None, 1])
def test_bad_bwd_mode(device, bwd_mode):
    q, k, v = _qkv(device)
    mask = BlockSparseMask.from_dense(_layout(device), 64)
    if isinstance(bwd_mode, str):
        error, message = ValueError, r"bwd_mode must be one of 'auto', 'atomic', 'two_pass', got"
    else:
        error, message = TypeError, r"bwd_mode must be a str, got"
    with pytest.raises(error, match=r"^adaattn\.block_sparse_attn: " + message):
        adaattn.block_sparse_attn(q, k, v, mask, bwd_mode=bwd_mode)


def test_deterministic_contradicts_atomic(device):
    q, k, v = _qkv(device)
    mask = BlockSparseMask.from_dense(_layout(device), 64)
    with pytest.raises(ValueError, match=r"^adaattn\.block_sparse_attn: deterministic=True "
                                         r"contradicts bwd_mode='atomic'"):
        adaattn.block_sparse_attn(q, k, v, mask, deterministic=True, bwd_mode="atomic")


def test_cpu_mask_prefers_two_pass():
    mask = BlockSparseMask.from_dense(torch.ones(1, 1, 4, 4, dtype=torch.bool), 128)
    assert mask.prefers_two_pass() and mask._keys_probe is None


# --------------------------------------------------------------------------------------------
# BlockSparseMask: BCSR form, transposed index, FlexAttention conversion
# --------------------------------------------------------------------------------------------

def test_from_dense_bcsr_and_transposed_index(device):
    """from_dense lists each row's blocks first, ascending; the transposed index is the transpose
    of the layout, lives on the mask's device and is built once (cached)."""
    layout = torch.tensor([[[[1, 0, 1], [0, 0, 0]], [[0, 1, 1], [1, 1, 1]]]], dtype=torch.bool)
    mask = BlockSparseMask.from_dense(layout.to(device), (64, 128))
    assert mask.block_size == (64, 128) and mask.num_blocks == (2, 3) and not mask.causal
    assert mask.kv_num_blocks.dtype == torch.int32 and mask.kv_indices.dtype == torch.int32
    assert mask.kv_num_blocks.cpu().tolist() == [[[2, 0], [2, 3]]]
    indices = mask.kv_indices.cpu()
    assert indices[0, 0, 0, :2].tolist() == [0, 2] and indices[0, 1, 0, :2].tolist() == [1, 2]
    assert indices[0, 1, 1].tolist() == [0, 1, 2]
    assert torch.equal(mask.to_dense().cpu(), layout)
    q_num, q_idx = mask.transposed()
    assert q_num.device == mask.kv_indices.device and q_idx.device == mask.kv_indices.device
    assert q_num.shape == (1, 2, 3) and q_idx.shape == (1, 2, 3, 2)
    assert q_num.cpu().tolist() == [[[1, 0, 1], [1, 2, 2]]]
    assert q_idx[0, 1, 1].cpu().tolist() == [0, 1] and q_idx[0, 0, 2, 0].item() == 0
    assert mask.transposed() is mask.transposed(), "the transposed index must be cached"
    assert mask.q_num_blocks is q_num and mask.q_indices is q_idx


@pytest.mark.cuda
def test_transposed_index_builds_without_host_sync():
    layout = torch.rand(2, 4, 9, 17) < 0.3
    mask = BlockSparseMask.from_dense(layout.cuda(), 128)
    torch.cuda.set_sync_debug_mode("error")
    try:
        q_num, q_idx = mask.transposed()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(BlockSparseMask(q_num, q_idx).to_dense().cpu(), layout.transpose(-1, -2))


def _flex():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    # Eager flex_attention warns that it is not compiled; the reference use here is intended.
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
    return flex


def test_from_flex_round_trip(device):
    """A layout taken to a FlexAttention BlockMask (every block partial, mask_mod None = all
    True) and back is unchanged, per batch and head."""
    flex = _flex()
    layout = torch.rand(2, 3, 4, 5) < 0.5
    mask = BlockSparseMask.from_dense(layout.to(device), (128, 64))
    block_mask = flex.BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices,
                                               BLOCK_SIZE=(128, 64), seq_lengths=(500, 300))
    back = BlockSparseMask.from_flex(block_mask)
    assert back.block_size == (128, 64) and not back.causal
    assert torch.equal(back.to_dense().cpu(), layout)


FLEX_LENGTHS = [(256, 256), (200, 300), (300, 200)]


@pytest.mark.parametrize("lq,lk", FLEX_LENGTHS)
def test_from_flex_causal_matches_flex_attention(device, lq, lk):
    """A bottom-right causal mask_mod converts exactly (causal=True on the mask, partial blocks
    on the diagonal); the op then matches flex_attention and the explicit-causal call."""
    flex = _flex()

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + (lk - lq)

    block_mask = flex.create_block_mask(causal, None, None, lq, lk, device=device,
                                        BLOCK_SIZE=64)
    mask = BlockSparseMask.from_flex(block_mask)
    assert mask.causal
    q = torch.randn(2, 2, lq, 16, dtype=torch.float64, device=device)
    k, v = (torch.randn(2, 2, lk, 16, dtype=torch.float64, device=device) for _ in range(2))
    out = adaattn.block_sparse_attn(q, k, v, mask)
    expected = flex.flex_attention(q, k, v, block_mask=block_mask)
    rows = torch.arange(lq, device=device) + (lk - lq) >= 0  # flex gives NaN-free 0 elsewhere
    assert_rel_close("out", out[:, :, rows], expected[:, :, rows], FP32_RTOL)
    plain = BlockSparseMask(mask.kv_num_blocks, mask.kv_indices, mask.block_size)
    assert torch.equal(adaattn.block_sparse_attn(q, k, v, plain, causal=True), out)


def test_from_flex_block_aligned_masks(device):
    """mask_mods that are constant on every block (documents aligned to blocks, a per-head
    pattern) convert exactly without causal."""
    flex = _flex()
    doc = (torch.arange(256, device=device) // 64) // 2  # two documents of 128 tokens

    def documents(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & ((h == 0) | (kv_idx < 192))

    block_mask = flex.create_block_mask(documents, None, 2, 256, 256, device=device,
                                        BLOCK_SIZE=64)
    mask = BlockSparseMask.from_flex(block_mask)
    assert not mask.causal
    expected = torch.zeros(1, 2, 4, 4, dtype=torch.bool)
    expected[:, :, :2, :2] = expected[:, 0, 2:, 2:] = True
    expected[:, 1, 2:, 2] = True
    assert torch.equal(mask.to_dense().cpu(), expected)
    q, k, v = (torch.randn(1, 2, 256, 16, dtype=torch.float64, device=device) for _ in range(3))
    assert_rel_close("out", adaattn.block_sparse_attn(q, k, v, mask),
                     flex.flex_attention(q, k, v, block_mask=block_mask), FP32_RTOL)


def _refused_mask_mods():
    doc = torch.arange(256) // 50

    def top_left_causal(b, h, q_idx, kv_idx):  # bottom-right only when Lq == Lk
        return q_idx >= kv_idx

    def unaligned_documents(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    def sliding_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 100)

    def causal_with_sink(b, h, q_idx, kv_idx):  # full sink block above the diagonal
        return (kv_idx <= q_idx) | (kv_idx < 64)

    return [(top_left_causal, 200, 256, "causal rule"),
            (unaligned_documents, 256, 256, "causal rule"),
            (sliding_window, 256, 256, "causal rule"),
            (causal_with_sink, 256, 256, "full block outside the causal region")]


@pytest.mark.parametrize("mask_mod,lq,lk,reason", _refused_mask_mods(),
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_from_flex_refuses_inexact(mask_mod, lq, lk, reason):
    flex = _flex()
    block_mask = flex.create_block_mask(mask_mod, None, None, lq, lk, device="cpu",
                                        BLOCK_SIZE=64)
    with pytest.raises(ValueError,
                       match=rf"^adaattn\.BlockSparseMask\.from_flex: .*not be exact.*{reason}"):
        BlockSparseMask.from_flex(block_mask)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

def _qkv(device, lq=130, lk=200, dtype=torch.float32):
    return (torch.randn(2, 4, lq, 16, device=device, dtype=dtype),
            torch.randn(2, 2, lk, 16, device=device, dtype=dtype),
            torch.randn(2, 2, lk, 16, device=device, dtype=dtype))


def _layout(device, b=1, h=1, nq=3, nkv=4):
    return torch.ones(b, h, nq, nkv, dtype=torch.bool, device=device)


def _op_fwd(q, k, v, num, idx, block=64):
    return torch.ops.adaattn.block_sparse_fwd(q, k, v, num, idx, block, block, None, False)


def _bad_call(kind, device):
    q, k, v = _qkv(device)
    mask = BlockSparseMask.from_dense(_layout(device), 64)
    num, idx = mask.kv_num_blocks, mask.kv_indices
    f = adaattn.block_sparse_attn
    if kind == "layout_rows":
        return f(q, k, v, BlockSparseMask.from_dense(_layout(device, nq=2), 64))
    if kind == "layout_cols":
        return f(q, k, v, BlockSparseMask.from_dense(_layout(device, nkv=5), 64))
    if kind == "layout_block_size":  # 3 x 4 blocks fit 64 x 64, not 128 x 128
        return f(q, k, v, BlockSparseMask.from_dense(_layout(device), 128))
    if kind == "op_rows":
        return _op_fwd(q, k, v, num[..., :2], idx[..., :2, :])
    if kind == "op_cols":
        return _op_fwd(q, k, v, num, idx[..., :3])
    if kind == "mask_batch":
        return f(q, k, v, BlockSparseMask.from_dense(_layout(device, b=3), 64))
    if kind == "mask_heads":
        return f(q, k, v, BlockSparseMask.from_dense(_layout(device, h=2), 64))
    if kind == "layout_dtype":
        return BlockSparseMask.from_dense(_layout(device).int(), 64)
    if kind == "layout_rank":
        return BlockSparseMask.from_dense(_layout(device)[0], 64)
    if kind == "num_dtype":
        return BlockSparseMask(num.long(), idx, 64)
    if kind == "indices_dtype":
        return BlockSparseMask(num, idx.long(), 64)
    if kind == "indices_shape":
        return BlockSparseMask(num, idx[:, :, :2], 64)
    if kind == "op_num_dtype":
        return _op_fwd(q, k, v, num.long(), idx)
    if kind == "op_indices_dtype":
        return _op_fwd(q, k, v, num, idx.short())
    if kind == "block_size":
        return BlockSparseMask.from_dense(_layout(device), 32)
    if kind == "op_block_size":
        return torch.ops.adaattn.block_sparse_fwd(q, k, v, num, idx, 32, 64, None, False)
    if kind == "not_a_mask":
        return f(q, k, v, _layout(device))
    if kind == "q_rank":
        return f(q[0], k, v, mask)
    if kind == "dtype_mix":
        return f(q, k.double(), v, mask)
    if kind == "op_bwd_mode":  # "auto" is resolved in Python, never by the op
        return torch.ops.adaattn.block_sparse_attn(q, k, v, num, idx, *mask.transposed(), 64, 64,
                                                   None, False, "auto")
    if kind == "bwd_op_bwd_mode":
        out, lse = _op_fwd(q, k, v, num, idx)
        return torch.ops.adaattn.block_sparse_bwd(torch.ones_like(out), q, k, v, out, lse, num,
                                                  idx, *mask.transposed(), 64, 64, None, False,
                                                  "deterministic")
    if kind == "bwd_transposed_shape":
        out, lse = _op_fwd(q, k, v, num, idx)
        return torch.ops.adaattn.block_sparse_bwd(torch.ones_like(out), q, k, v, out, lse, num,
                                                  idx, num, idx, 64, 64, None, False)
    raise AssertionError(kind)


BSA = "block_sparse_attn"
# kind -> (exception, the op its message starts with "adaattn.<op>: ", regex the message must
# match: it names the argument and what was expected).
BAD_INPUTS = {
    "layout_rows": (ValueError, BSA,
                    r"block_mask has 2 x 4 blocks.*ceil\(Lq / 64\) x ceil\(Lk / 64\) = 3 x 4"),
    "layout_cols": (ValueError, BSA, r"block_mask has 3 x 5 blocks.*= 3 x 4"),
    "layout_block_size": (ValueError, BSA,
                          r"block_mask.*ceil\(Lq / 128\) x ceil\(Lk / 128\) = 2 x 2"),
    "op_rows": (ValueError, BSA, r"kv_num_blocks.*shape.*nQ = ceil\(Lq / block_m\)"),
    "op_cols": (ValueError, BSA, r"kv_indices.*shape.*nKV = ceil\(Lk / block_n\)"),
    "mask_batch": (ValueError, BSA, r"kv_num_blocks.*shape.*\[B or 1"),
    "mask_heads": (ValueError, BSA, r"kv_num_blocks.*shape.*Hq or 1"),
    "layout_dtype": (TypeError, "BlockSparseMask.from_dense", r"layout.*bool"),
    "layout_rank": (ValueError, "BlockSparseMask.from_dense", r"layout.*4 dims"),
    "num_dtype": (TypeError, "BlockSparseMask", r"kv_num_blocks.*int32"),
    "indices_dtype": (TypeError, "BlockSparseMask", r"kv_indices.*int32"),
    "indices_shape": (ValueError, "BlockSparseMask", r"kv_indices.*kv_num_blocks"),
    "op_num_dtype": (TypeError, BSA, r"kv_num_blocks.*int32"),
    "op_indices_dtype": (TypeError, BSA, r"kv_indices.*int32"),
    "block_size": (ValueError, "BlockSparseMask", r"block_size.*64 or 128"),
    "op_block_size": (ValueError, BSA, r"block_m.*64 or 128"),
    "not_a_mask": (TypeError, BSA, r"block_mask.*BlockSparseMask"),
    "q_rank": (ValueError, BSA, r"\bq\b.*4 dims"),
    "dtype_mix": (TypeError, BSA, r"\bk\b.*dtype|dtype.*\bk\b"),
    "bwd_transposed_shape": (ValueError, BSA, r"q_num_blocks.*shape"),
    "op_bwd_mode": (ValueError, BSA, r"bwd_mode must be 'atomic' or 'two_pass', got 'auto'"),
    "bwd_op_bwd_mode": (ValueError, BSA,
                        r"bwd_mode must be 'atomic' or 'two_pass', got 'deterministic'"),
}


@pytest.mark.parametrize("kind", list(BAD_INPUTS))
def test_bad_input(device, kind):
    error, op, message = BAD_INPUTS[kind]
    with pytest.raises(error, match=rf"^adaattn\.{op}: .*(" + message + ")"):
        _bad_call(kind, device)


def _bad_values(kind):
    """Mask tensors (3 x 4 blocks of 64 for Lq = 130, Lk = 200) with one bad value."""
    mask = BlockSparseMask.from_dense(_layout("cpu"), 64)
    num, idx = mask.kv_num_blocks.clone(), mask.kv_indices.clone()
    q_num, q_idx = (t.clone() for t in mask.transposed())
    if kind == "count_high":
        num[0, 0, 1] = 5
    elif kind == "count_negative":
        num[0, 0, 2] = -1
    elif kind == "index_high":
        idx[0, 0, 1, 2] = 4
    elif kind == "index_negative":
        idx[0, 0, 0, 0] = -1
    elif kind == "index_duplicate":
        idx[0, 0, 2, 3] = 1
    elif kind == "transposed_index_high":
        q_idx[0, 0, 3, 0] = 3
    elif kind == "transposed_mismatch":  # key block 3 loses query block 2 in the transpose only
        q_num[0, 0, 3] = 2
    return num, idx, q_num, q_idx


BAD_VALUES = {
    "count_high": r"kv_num_blocks\[0, 0, 1\] = 5 is out of range \[0, 4\]",
    "count_negative": r"kv_num_blocks\[0, 0, 2\] = -1 is out of range",
    "index_high": r"kv_indices\[0, 0, 1, 2\] = 4 is out of range \[0, 4\)",
    "index_negative": r"kv_indices\[0, 0, 0, 0\] = -1 is out of range",
    "index_duplicate": r"kv_indices\[0, 0, 2\] lists block 1 twice",
    "transposed_index_high": r"q_indices\[0, 0, 3, 0\] = 3 is out of range \[0, 3\)",
    "transposed_mismatch": r"q_num_blocks/q_indices are not the transpose.*query 2, key 3",
}


@pytest.mark.parametrize("kind", list(BAD_VALUES))
def test_bad_mask_values_cpu(kind):
    """On CPU tensors the op checks the mask's values (the forward op the forward index, the
    backward op both and their consistency); errors name the tensor and the entry."""
    q, k, v = _qkv("cpu")
    num, idx, q_num, q_idx = _bad_values(kind)
    if kind.startswith("transposed"):
        good = BlockSparseMask.from_dense(_layout("cpu"), 64)
        out, lse = _op_fwd(q, k, v, good.kv_num_blocks, good.kv_indices)
        call = lambda: torch.ops.adaattn.block_sparse_bwd(  # noqa: E731
            torch.ones_like(out), q, k, v, out, lse, num, idx, q_num, q_idx, 64, 64, None, False)
    else:
        call = lambda: _op_fwd(q, k, v, num, idx)  # noqa: E731
    with pytest.raises(ValueError, match=r"^adaattn\.block_sparse_attn: " + BAD_VALUES[kind]):
        call()


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["count_high", "count_negative", "index_high",
                                  "index_negative"])
def test_bad_mask_values_cuda_stay_in_bounds(kind):
    """On CUDA the values are not checked (that would need a host sync): the kernels clamp counts
    and skip out-of-range indices, exactly as BlockSparseMask's transposed index does, so the
    result is that of the mask the tensors describe under those rules and nothing reads out of
    bounds."""
    num, idx, _, _ = _bad_values(kind)
    mask = BlockSparseMask(num.cuda(), idx.cuda(), 64)
    case = Case(b=2, hq=4, hkv=2, lq=130, lk=200, d=16)
    q, k, v, _, dout = make_inputs(case, torch.float32, "cuda")
    ours = run_ours(case, q, k, v, mask, dout)
    ref = run_reference(case, q, k, v, mask, dout, torch.float64)
    for name, a, e in zip(NAMES, ours, ref):
        assert_rel_close(name, a, e, FP32_RTOL)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_cuda_tensor_cores_refuse_64_blocks(dtype):
    """The tensor-core CTAs own 128-row tiles: 64-blocks are refused with a clear error (float32
    and float64 take them on CUDA)."""
    q = torch.randn(2, 4, 130, 64, device="cuda", dtype=dtype)
    k = v = torch.randn(2, 2, 200, 64, device="cuda", dtype=dtype)
    mask = BlockSparseMask.from_dense(_layout("cuda"), 64)
    with pytest.raises(RuntimeError, match=r"^adaattn\.block_sparse_attn: .*takes 128x128 "
                                           r"blocks, got block_m = 64"):
        adaattn.block_sparse_attn(q, k, v, mask)


@pytest.mark.cuda
@pytest.mark.parametrize("which", ["kv_num_blocks", "kv_indices"])
def test_bad_input_device_mix(which):
    q, k, v = _qkv("cuda")
    mask = BlockSparseMask.from_dense(_layout("cuda"), 64)
    num, idx = mask.kv_num_blocks, mask.kv_indices
    if which == "kv_num_blocks":
        num = num.cpu()
    else:
        idx = idx.cpu()
    with pytest.raises(RuntimeError,
                       match=rf"^adaattn\.block_sparse_attn: \b{which}\b.*(device|cuda|cpu)"):
        _op_fwd(q, k, v, num, idx)


# --------------------------------------------------------------------------------------------
# Registration: opcheck, torch.compile
# --------------------------------------------------------------------------------------------

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")
OPCHECK_CASES = [
    Case(b=2, hq=4, hkv=2, lq=100, lk=150, d=64, block=(128, 128), density=0.5, mask_h=True,
         causal=True),
    Case(b=2, lq=150, lk=70, d=64, block=(128, 128), density=0.5, mask_b=True, scale=0.2,
         transposed=True),
    Case(b=2, hq=4, hkv=2, lq=100, lk=150, d=80, block=(128, 128), density=0.5, causal=True),
]


def _opcheck_dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def _mask_args(case, mask):
    return (mask.kv_num_blocks, mask.kv_indices) + mask.transposed()


@pytest.mark.parametrize("bwd_mode", ["atomic", "two_pass"])
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck_block_sparse_attn(device, case, bwd_mode):
    q, k, v, mask, _ = make_inputs(case, _opcheck_dtype(device), device)
    args = (q, k, v) + _mask_args(case, mask) + (*case.block, case.scale, case.causal, bwd_mode)
    torch.library.opcheck(torch.ops.adaattn.block_sparse_attn.default, args,
                          test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck_block_sparse_fwd_bwd(device, case):
    """The backend ops are called without grad; test_autograd_registration runs on
    requires-grad copies of the floating inputs (as in test_flash.py)."""
    q, k, v, mask, dout = make_inputs(case, _opcheck_dtype(device), device,
                                      requires_grad=False)
    tail = (*case.block, case.scale, case.causal)
    fwd_args = (q, k, v, mask.kv_num_blocks, mask.kv_indices) + tail
    out, lse = torch.ops.adaattn.block_sparse_fwd(*fwd_args)
    bwd_args = (dout, q, k, v, out, lse) + _mask_args(case, mask) + tail + ("two_pass",)
    no_grad_utils = tuple(u for u in OPCHECK_UTILS if u != "test_autograd_registration")
    for op, args in ((torch.ops.adaattn.block_sparse_fwd.default, fwd_args),
                     (torch.ops.adaattn.block_sparse_bwd.default, bwd_args)):
        torch.library.opcheck(op, args, test_utils=no_grad_utils)
        grad_args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor)
                          and a.is_floating_point() else a for a in args)
        torch.library.opcheck(op, grad_args, test_utils=("test_autograd_registration",))


class SparseAttention(torch.nn.Module):
    """q/kv/o projections around adaattn.block_sparse_attn (GQA 2), (B, L, H, D) views; the mask
    is a forward input."""

    def __init__(self, dim=256, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q_proj = torch.nn.Linear(dim, dim)
        self.kv_proj = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o_proj = torch.nn.Linear(dim, dim)

    def forward(self, x, mask):
        b, length, _ = x.shape
        q = self.q_proj(x).view(b, length, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(x).view(b, length, 2, self.kv_heads, self.head_dim).unbind(2)
        out = adaattn.block_sparse_attn(q, k.transpose(1, 2), v.transpose(1, 2), mask,
                                        causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))


@pytest.mark.parametrize("device,backend,dtype", [
    pytest.param("cpu", "aot_eager", torch.float32, id="cpu-aot_eager-fp32"),
    pytest.param("cpu", "inductor", torch.float32, id="cpu-inductor-fp32"),
    pytest.param("cuda", "inductor", torch.float32, marks=pytest.mark.cuda,
                 id="cuda-inductor-fp32"),
    pytest.param("cuda", "inductor", torch.bfloat16, marks=pytest.mark.cuda,
                 id="cuda-inductor-bf16"),
])
def test_torch_compile_fullgraph(device, backend, dtype):
    """fullgraph compile with the mask as an input: a fresh mask (its transposed index is built
    inside the graph) and one with the index already cached, against eager."""
    torch._dynamo.reset()
    model = SparseAttention().to(device, dtype)
    x = torch.randn(2, 200, 256, device=device, dtype=dtype)
    layout = torch.rand(2, 4, 2, 2) < 0.5
    params = [x] + list(model.parameters())

    def run(fn, mask):
        x.grad = None
        model.zero_grad(set_to_none=True)
        x.requires_grad_()
        out = fn(x, mask)
        out.backward(torch.ones_like(out))
        return [out.detach()] + [p.grad.detach().clone() for p in params]

    compiled_model = torch.compile(model, backend=backend, fullgraph=True)
    for cached in (False, True):
        mask = BlockSparseMask.from_dense(layout.to(device), 128)
        if cached:
            mask.transposed()
        compiled = run(compiled_model, mask)
        eager = run(model, mask)
        for i, (c, e) in enumerate(zip(compiled, eager)):
            assert torch.isfinite(c).all(), f"tensor {i}: non-finite values"
            torch.testing.assert_close(c, e, msg=lambda m: f"cached={cached} tensor {i}: {m}")


def test_torch_compile_reports_bad_layout():
    """Compiled code skips the Python-level layout check (it cannot be traced with symbolic
    lengths); the op's own shape check names the mask tensor while tracing."""
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, m: adaattn.block_sparse_attn(q, k, v, m),
                       backend="aot_eager", fullgraph=True)
    q, k, v = _qkv("cpu")
    with pytest.raises(RuntimeError, match=r"kv_num_blocks must have shape"):
        fn(q, k, v, BlockSparseMask.from_dense(_layout("cpu", nq=2), 64))


def test_return_lse_flag_and_default_scale(device):
    """return_lse=False returns the output alone; softmax_scale=None means D ** -0.5."""
    q, k, v = _qkv(device)
    mask = BlockSparseMask.from_dense(_layout(device), 64)
    out = adaattn.block_sparse_attn(q, k, v, mask)
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, adaattn.block_sparse_attn(q, k, v, mask, softmax_scale=16 ** -0.5))
