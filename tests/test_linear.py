"""Tests of adaattn.linear_attn (docs/ops.md; rules: accuracy.py).

Ground truth is ``adaattn.reference.linear_attn`` (materialised causal mask) in float64, itself
checked against the step-by-step ``reference.linear_attn_recurrent``; gradients of the ground
truth come from autograd through it. Bars: float64 ``gradcheck`` of q, k, v and initial_state
(through both outputs, out and the final state) and ~1e-10 agreement with the reference;
float32 relative error ``<= 1e-5``; float16/bfloat16 ``err(ours) <= 2 * err(reference in the same
dtype) + 1e-5``. The identity feature map with ``normalize`` divides by ``q . z``, which random
inputs can bring arbitrarily close to 0: those cases use positive inputs (``Case.positive``) so
that the comparison is well conditioned. Every test runs with NaN-poisoned allocations
(conftest.py); CUDA cases carry the ``cuda`` marker and skip at run time without a GPU.
"""
import dataclasses
from typing import Optional, Tuple

import pytest
import torch

import adaattn
from adaattn import reference

FMAPS = ("elu", "relu", "identity")
FP32_RTOL = 1e-5
CHUNK = 64


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem: dense ``[B, H, T, D]`` (``lens`` None) or packed with sequence lengths
    ``lens``; ``dv`` is the value width."""

    b: int = 1
    h: int = 2
    t: int = 17
    d: int = 8
    dv: int = 8
    fmap: str = "elu"
    causal: bool = True
    normalize: bool = True
    lens: Optional[Tuple[int, ...]] = None
    transposed: bool = False
    state: bool = False

    @property
    def positive(self):
        return self.fmap == "identity" and self.normalize

    @property
    def seqs(self):
        return self.b if self.lens is None else len(self.lens)

    def __str__(self):
        shape = (f"b{self.b}t{self.t}" if self.lens is None
                 else "seq" + "_".join(map(str, self.lens)))
        parts = [shape, f"h{self.h}d{self.d}x{self.dv}", self.fmap,
                 "causal" if self.causal else "full", "norm" if self.normalize else "raw"]
        if self.transposed:
            parts.append("T")
        if self.state:
            parts.append("s0")
        return "-".join(parts)


def _draw(case: Case, width: int, dtype, device):
    """Seeded CPU draw in float64 (identical across devices), laid out as the case asks."""
    if case.lens is not None:
        x = torch.randn(sum(case.lens), case.h, width, dtype=torch.float64)
    elif case.transposed:
        x = torch.randn(case.b, case.t, case.h, width, dtype=torch.float64).transpose(1, 2)
    else:
        x = torch.randn(case.b, case.h, case.t, width, dtype=torch.float64)
    if case.positive:
        x = x.abs() + 0.1
    return x.to(device, dtype).detach()


def make_inputs(case: Case, dtype, device, requires_grad=True):
    """Leaf ``q, k, v``, ``initial_state`` (None unless case.state; positive, in the state
    dtype), ``cu_seqlens`` (None when dense) and the output gradients ``dout, dstate``."""
    q, k, v = (_draw(case, w, dtype, device) for w in (case.d, case.d, case.dv))
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    state_shape = (case.seqs, case.h, case.d, case.dv + int(case.normalize))
    s0 = None
    if case.state:
        s0 = torch.rand(state_shape, dtype=torch.float64).to(device, state_dtype)
    cu = None
    if case.lens is not None:
        bounds = torch.tensor((0,) + case.lens, dtype=torch.int64).cumsum(0)
        cu = bounds.to(device=device, dtype=torch.int32)
    dout = torch.randn(v.shape, dtype=torch.float64).to(device, dtype)
    dstate = torch.randn(state_shape, dtype=torch.float64).to(device, state_dtype)
    if requires_grad:
        for t in (q, k, v) + ((s0,) if s0 is not None else ()):
            t.requires_grad_()
    return q, k, v, s0, cu, dout, dstate


def _kwargs(case: Case, cu):
    return dict(feature_map=case.fmap, causal=case.causal, normalize=case.normalize,
                cu_seqlens=cu)


def run_ours(case: Case, q, k, v, s0, cu, dout, dstate):
    """``(out, state, dq, dk, dv[, ds0])`` from adaattn.linear_attn, backward through both."""
    out, state = adaattn.linear_attn(q, k, v, initial_state=s0, return_state=True,
                                     **_kwargs(case, cu))
    assert out.shape == v.shape and out.dtype == q.dtype and out.device == q.device
    assert state.shape == dstate.shape and state.dtype == dstate.dtype
    leaves = (q, k, v) + ((s0,) if s0 is not None else ())
    grads = torch.autograd.grad((out, state), leaves, (dout, dstate))
    for g, x in zip(grads, leaves):
        assert g.shape == x.shape and g.dtype == x.dtype
    return (out, state) + tuple(grads)


def run_reference(case: Case, q, k, v, s0, cu, dout, dstate, fn=reference.linear_attn,
                  dtype=torch.float64):
    """The same through ``fn`` (a reference) on detached copies in ``dtype``, grads by autograd."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    leaves = (q, k, v)
    if s0 is not None:
        s0 = s0.detach().to(torch.float64 if dtype == torch.float64 else torch.float32)
        s0.requires_grad_()
        leaves += (s0,)
    out, state = fn(q, k, v, initial_state=s0, **_kwargs(case, cu))
    grads = torch.autograd.grad((out, state), leaves, (dout.to(dtype), dstate.to(state.dtype)))
    return (out, state) + tuple(grads)


def rel_err(a, e):
    a, e = a.detach().double().cpu(), e.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite values"
    norm = torch.linalg.vector_norm(e).item()
    diff = torch.linalg.vector_norm(a - e).item()
    return diff / norm if norm else diff


def assert_all_close(ours, ref, rtol, names=("out", "state", "dq", "dk", "dv", "ds0")):
    for name, a, e in zip(names, ours, ref):
        err = rel_err(a, e)
        assert err <= rtol, f"{name}: relative error {err:.3e} > {rtol}"


# --------------------------------------------------------------------------------------------
# The two references agree
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fmap", FMAPS)
def test_references_agree(fmap, causal, normalize):
    for case in (Case(b=2, t=23, d=5, dv=3, fmap=fmap, causal=causal, normalize=normalize,
                      state=True),
                 Case(lens=(0, 1, 9, 0, 12), d=4, dv=6, fmap=fmap, causal=causal,
                      normalize=normalize, state=True)):
        inputs = make_inputs(case, torch.float64, "cpu")
        quad = run_reference(case, *inputs)
        rec = run_reference(case, *inputs, fn=reference.linear_attn_recurrent)
        assert_all_close(quad, rec, 1e-12)


def test_reference_matches_spec_formula():
    """o_t = phi(q_t) S_t / (phi(q_t) . z_t) written out row by row for one head."""
    q, k, v = (torch.randn(1, 1, 6, 3, dtype=torch.float64) for _ in range(3))
    out, _ = reference.linear_attn(q, k, v)
    phi = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
    for t in range(6):
        s = sum(phi(k[0, 0, j])[:, None] * v[0, 0, j][None, :] for j in range(t + 1))
        z = sum(phi(k[0, 0, j]) for j in range(t + 1))
        expect = phi(q[0, 0, t]) @ s / (phi(q[0, 0, t]) @ z)
        torch.testing.assert_close(out[0, 0, t], expect, rtol=1e-13, atol=1e-13)


# --------------------------------------------------------------------------------------------
# float64: gradcheck, and the op against the reference
# --------------------------------------------------------------------------------------------

GRADCHECK_CASES = [
    Case(t=5, d=4, dv=3, state=True),
    Case(t=70, h=1, d=3, dv=2, state=True),  # crosses a chunk boundary
    Case(t=70, h=1, d=3, dv=2, causal=False, state=True),
    Case(t=6, d=3, dv=4, fmap="relu", state=True),
    Case(t=6, d=3, dv=4, fmap="relu", normalize=False, causal=False),
    Case(t=6, d=3, dv=2, fmap="identity", state=True),
    Case(t=6, d=3, dv=2, fmap="identity", normalize=False, state=True),
    Case(b=2, t=5, d=3, dv=3, normalize=False, transposed=True),
    Case(lens=(0, 1, 5, 0, 3), d=3, dv=2, state=True),
    Case(lens=(2, 0, 4), d=3, dv=3, causal=False, fmap="relu", state=True),
    Case(t=1, d=2, dv=2),
]


@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=str)
def test_gradcheck_fp64(device, case):
    q, k, v, s0, cu, _, _ = make_inputs(case, torch.float64, device)
    leaves = (q, k, v) + ((s0,) if s0 is not None else ())

    def fn(q, k, v, s0=None):
        return adaattn.linear_attn(q, k, v, initial_state=s0, return_state=True,
                                   **_kwargs(case, cu))

    assert torch.autograd.gradcheck(fn, leaves)


FP64_CASES = (
    [Case(t=t, d=16, dv=16, causal=c, state=True) for t in (1, 17, 97, 128, 1000)
     for c in (True, False)]
    + [Case(b=2, t=97, d=8, dv=12, fmap=f, causal=c, normalize=n)
       for f in FMAPS for c in (True, False) for n in (True, False)]
    + [Case(b=2, h=3, t=130, d=32, dv=16, transposed=True, state=True),
       Case(lens=(0, 1, 64, 65, 0, 200, 1), d=8, dv=8, state=True),
       Case(lens=(130, 3), d=8, dv=4, causal=False, fmap="relu", normalize=False, state=True)]
)


@pytest.mark.parametrize("case", FP64_CASES, ids=str)
def test_fp64_matches_reference(device, case):
    inputs = make_inputs(case, torch.float64, device)
    assert_all_close(run_ours(case, *inputs), run_reference(case, *inputs), 1e-10)


FP32_CASES = [
    Case(b=2, t=1000, d=32, dv=32, state=True),
    Case(b=2, t=1000, d=32, dv=32, causal=False),
    Case(t=300, d=64, dv=64, fmap="relu", normalize=False, transposed=True),
    Case(lens=(0, 1, 17, 300, 5), d=16, dv=24, state=True),
]


@pytest.mark.parametrize("case", FP32_CASES, ids=str)
def test_fp32_matches_reference(device, case):
    inputs = make_inputs(case, torch.float32, device)
    assert_all_close(run_ours(case, *inputs), run_reference(case, *inputs), FP32_RTOL)


# --------------------------------------------------------------------------------------------
# float16 / bfloat16 (computed in float32, so far on both devices)
# --------------------------------------------------------------------------------------------

def chunked_reference(q, k, v, *, feature_map="elu", causal=True, normalize=True,
                      cu_seqlens=None, initial_state=None):
    """Causal dense linear attention in chunks of 64 with plain torch ops (memory O(T C)), for
    lengths where the quadratic reference does not fit; checked against it below."""
    assert causal and cu_seqlens is None
    qf, kf, va, s0 = reference._linear_prepare(q, k, v, feature_map, normalize, initial_state)
    b, h, t, d = q.shape
    pad = (-t) % CHUNK
    qf, kf, va = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (qf, kf, va))
    n = (t + pad) // CHUNK
    qc, kc, vc = (x.reshape(b, h, n, CHUNK, x.shape[-1]) for x in (qf, kf, va))
    chunk_states = torch.matmul(kc.transpose(-1, -2), vc)  # [b, h, n, d, e]
    before = torch.cumsum(chunk_states, dim=2) - chunk_states + s0.unsqueeze(2)
    mask = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    scores = torch.matmul(qc, kc.transpose(-1, -2)).masked_fill(~mask, 0)
    u = torch.matmul(scores, vc) + torch.matmul(qc, before)
    u = u.reshape(b, h, n * CHUNK, -1)[:, :, :t]
    state = s0 + chunk_states.sum(dim=2)
    return reference._linear_output(u, normalize), state.to(reference._linear_state_dtype(q))


def test_chunked_reference_matches_quadratic():
    case = Case(b=2, t=200, d=8, dv=5, state=True)
    inputs = make_inputs(case, torch.float64, "cpu")
    ref = run_reference(case, *inputs)
    assert_all_close(run_reference(case, *inputs, fn=chunked_reference), ref, 1e-12)


def assert_low_precision_rule(ours, ref_low, ref64,
                              names=("out", "state", "dq", "dk", "dv", "ds0")):
    """flash-attn's rule: ``err(ours) <= 2 * err(ref_low) + 1e-5`` (max abs error vs float64)."""
    for name, a, lo, e in zip(names, ours, ref_low, ref64):
        a, lo, e = (x.detach().double().cpu() for x in (a, lo, e))
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        err = (a - e).abs().max().item()
        base = (lo - e).abs().max().item()
        assert err <= 2 * base + 1e-5, f"{name}: max error {err:.3e} > 2 * {base:.3e} + 1e-5"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_cpu(dtype):
    case = Case(b=2, t=150, d=16, dv=16, state=True)
    inputs = make_inputs(case, dtype, "cpu")
    ours = run_ours(case, *inputs)
    low = run_reference(case, *inputs, dtype=dtype)
    assert_low_precision_rule(ours, low, run_reference(case, *inputs))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_low_precision_long_cuda(dtype):
    """T = 16384: the normaliser z grows to ~T; it is kept in float32, so nothing overflows and
    the bf16 output stays within the 2x rule (the same-dtype reference is the quadratic one)."""
    case = Case(b=1, h=2, t=16384, d=64, dv=64)
    inputs = make_inputs(case, dtype, "cuda")
    ours = run_ours(case, *inputs)
    ref64 = run_reference(case, *inputs, fn=chunked_reference)
    low = run_reference(case, *inputs, dtype=dtype)
    assert_low_precision_rule(ours, low, ref64)


# The CUDA tensor-core path (float16/bfloat16, D and Dv in {64, 128}): chunk boundaries, packed
# sequences (zero-length, one row, exactly one chunk), every feature map, causal and not,
# transposed inputs, initial states and sequences longer than the scan's chunk groups; other
# head dims take the exact path.
TC_CASES = [
    Case(b=2, t=200, d=64, dv=64, state=True),
    Case(t=130, d=128, dv=128, state=True),
    Case(t=97, d=64, dv=128, fmap="relu"),
    Case(t=150, d=128, dv=64, fmap="identity", normalize=False, transposed=True, state=True),
    Case(t=65, d=64, dv=64, fmap="identity", state=True),
    Case(b=2, t=100, d=64, dv=64, causal=False, state=True),
    Case(t=70, d=128, dv=64, fmap="relu", causal=False, normalize=False),
    Case(lens=(0, 1, 64, 65, 0, 200, 1), d=64, dv=64, state=True),
    Case(lens=(130, 3, 0), d=64, dv=128, causal=False, state=True),
    Case(t=1, d=64, dv=64),
    # Several groups of the scan's ring (4 chunks each), the last one partial.
    Case(lens=(300, 0, 700), d=64, dv=64, fmap="relu", state=True),
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", TC_CASES, ids=str)
def test_low_precision_tensor_cores_cuda(case, dtype):
    check_low_precision_cuda(case, dtype)


def check_low_precision_cuda(case, dtype):
    """The 2x rule for the output and every gradient of ``case`` on CUDA in ``dtype``."""
    inputs = make_inputs(case, dtype, "cuda")
    ours = run_ours(case, *inputs)
    low = run_reference(case, *inputs, dtype=dtype)
    assert_low_precision_rule(ours, low, run_reference(case, *inputs))


@pytest.mark.cuda
def test_low_precision_scan_groups_cuda():
    """Ten chunks at D = Dv = 128 (elu, normalised, initial state): the scan's ring of 4-chunk
    groups wraps and its last group is partial. bfloat16 only: over 600 rows the float16
    reference's normaliser overflows (ours keeps it in float32)."""
    check_low_precision_cuda(Case(t=600, d=128, dv=128, state=True), torch.bfloat16)


# Walks long enough, on a batch small enough, that the CUDA scan splits them into segments
# (linear_launch.h: one launch sums the segments, a second walks them from those sums): dense,
# packed (sequences in different numbers of segments, an empty one), non-causal, unnormalised,
# all with initial states. bfloat16 only, as above.
SPLIT_SCAN_CASES = [
    Case(t=4133, h=1, d=128, dv=128, state=True),
    Case(lens=(3000, 5, 0, 1300), h=1, d=64, dv=64, fmap="relu", state=True),
    Case(b=2, h=1, t=2500, d=64, dv=128, causal=False, state=True),
    Case(t=3000, h=1, d=128, dv=64, fmap="identity", normalize=False, transposed=True,
         state=True),
]


@pytest.mark.cuda
@pytest.mark.parametrize("case", SPLIT_SCAN_CASES, ids=str)
def test_low_precision_split_scan_cuda(case):
    check_low_precision_cuda(case, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Varlen, state passing, empty inputs, determinism
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
def test_packed_matches_dense_per_sequence(device, causal):
    case = Case(lens=(0, 1, 70, 0, 9, 1), h=3, d=8, dv=5, causal=causal, state=True)
    q, k, v, s0, cu, dout, dstate = make_inputs(case, torch.float64, device)
    ours = run_ours(case, q, k, v, s0, cu, dout, dstate)
    bounds = cu.tolist()
    for n in range(len(case.lens)):
        a, b = bounds[n], bounds[n + 1]
        dense = lambda x: x.detach()[a:b].transpose(0, 1).unsqueeze(0).requires_grad_()  # noqa
        dn = Case(t=b - a, h=3, d=8, dv=5, causal=causal, state=True)
        got = run_ours(dn, dense(q), dense(k), dense(v), s0.detach()[n:n + 1].requires_grad_(),
                       None, dense(dout), dstate[n:n + 1])
        packed = lambda x: x[a:b].transpose(0, 1).unsqueeze(0)  # noqa: E731
        expect = (packed(ours[0]), ours[1][n:n + 1], packed(ours[2]), packed(ours[3]),
                  packed(ours[4]), ours[5][n:n + 1])
        for g, e in zip(got, expect):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_state_resets_per_sequence(device, causal):
    """Perturbing one packed sequence leaves every other sequence's outputs, states and
    gradients bit-identical."""
    case = Case(lens=(5, 0, 70, 1, 8), d=4, dv=3, causal=causal, state=True)
    q, k, v, s0, cu, dout, dstate = make_inputs(case, torch.float32, device)
    base = run_ours(case, q, k, v, s0, cu, dout, dstate)
    a, b = 5, 75  # rows of sequence 2
    with torch.no_grad():
        q2, k2, v2 = (x.detach().clone() for x in (q, k, v))
        for x in (q2, k2, v2):
            x[a:b] += 0.5
    q2, k2, v2 = (x.requires_grad_() for x in (q2, k2, v2))
    moved = run_ours(case, q2, k2, v2, s0, cu, dout, dstate)
    keep = torch.ones(sum(case.lens), dtype=torch.bool, device=device)
    keep[a:b] = False
    keep_seq = torch.tensor([True, True, False, True, True], device=device)
    for i, (x, y) in enumerate(zip(base, moved)):
        sel = keep_seq if i in (1, 5) else keep
        assert torch.equal(x[sel], y[sel]), f"tensor {i} changed outside the perturbed sequence"
        assert not torch.equal(x[~sel], y[~sel]), f"tensor {i}: the perturbation did nothing"


@pytest.mark.parametrize("normalize", [True, False])
def test_state_carries_across_calls(device, normalize):
    """Running T rows in two calls, the first call's final state passed as the second's
    initial state, equals one call (outputs, final state and all gradients)."""
    case = Case(b=2, t=150, d=8, dv=6, normalize=normalize, state=True)
    q, k, v, s0, _, dout, dstate = make_inputs(case, torch.float64, device)
    full = run_ours(case, q, k, v, s0, None, dout, dstate)
    cut = 67
    kw = dict(normalize=normalize, return_state=True)
    out1, mid = adaattn.linear_attn(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut],
                                    initial_state=s0, **kw)
    out2, state = adaattn.linear_attn(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:],
                                      initial_state=mid, **kw)
    out = torch.cat([out1, out2], dim=2)
    grads = torch.autograd.grad((out, state), (q, k, v, s0), (dout, dstate))
    for a, e in zip((out, state) + grads, full):
        torch.testing.assert_close(a, e, rtol=1e-11, atol=1e-11)


def test_state_layout_is_s_then_z():
    """With normalize the state is [S | z]: its last column is sum phi(k); without, it is S."""
    q, k, v = (torch.randn(1, 1, 9, 3, dtype=torch.float64) for _ in range(3))
    _, state = adaattn.linear_attn(q, k, v, return_state=True)
    phi_k = torch.nn.functional.elu(k[0, 0]) + 1
    torch.testing.assert_close(state[0, 0, :, -1], phi_k.sum(0))
    torch.testing.assert_close(state[0, 0, :, :-1], phi_k.T @ v[0, 0])
    _, raw = adaattn.linear_attn(q, k, v, normalize=False, return_state=True)
    torch.testing.assert_close(raw[0, 0], phi_k.T @ v[0, 0])


@pytest.mark.parametrize("t", [1, 17, 97, 128, 1000])
def test_lengths_not_multiple_of_chunk(device, t):
    case = Case(t=t, d=8, dv=8, state=True)
    inputs = make_inputs(case, torch.float64, device)
    assert_all_close(run_ours(case, *inputs), run_reference(case, *inputs), 1e-10)


@pytest.mark.parametrize("packed", [False, True])
def test_empty_inputs(device, packed):
    if packed:
        q = torch.randn(0, 2, 4, device=device)
        v = torch.randn(0, 2, 3, device=device)
        cu = torch.zeros(1, dtype=torch.int32, device=device)
        out, state = adaattn.linear_attn(q, q, v, cu_seqlens=cu, return_state=True)
        assert out.shape == (0, 2, 3) and state.shape == (0, 2, 4, 4)
        return
    for shape in ((0, 2, 5, 4), (2, 2, 0, 4)):
        q = torch.randn(shape, device=device, requires_grad=True)
        s0 = torch.rand(shape[0], 2, 4, 5, device=device, requires_grad=True)
        out, state = adaattn.linear_attn(q, q, q, initial_state=s0, return_state=True)
        assert out.shape == shape and state.shape == s0.shape
        torch.testing.assert_close(state, s0.detach())  # no rows: the state passes through
        (out.sum() + state.sum()).backward()
        assert torch.isfinite(q.grad).all() and torch.equal(s0.grad, torch.ones_like(s0))


def test_zero_normaliser_gives_zero(device):
    """relu maps an all-negative query to 0, so phi(q).z = 0: the row is 0 and its gradients
    are 0, never NaN."""
    q = torch.randn(1, 1, 5, 4, dtype=torch.float64, device=device)
    q[0, 0, 2] = -q[0, 0, 2].abs() - 0.1
    q.requires_grad_()
    k, v = (torch.randn(1, 1, 5, 4, dtype=torch.float64, device=device, requires_grad=True)
            for _ in range(2))
    out = adaattn.linear_attn(q, k, v, feature_map="relu")
    assert torch.equal(out[0, 0, 2], torch.zeros(4, dtype=torch.float64, device=device))
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    assert torch.equal(q.grad[0, 0, 2], torch.zeros(4, dtype=torch.float64, device=device))


def test_deterministic(device):
    case = Case(lens=(100, 3, 250), h=3, d=16, dv=16, state=True)
    inputs = make_inputs(case, torch.float32, device)
    first = run_ours(case, *inputs)
    second = run_ours(case, *inputs)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

def _bad_call(kind, device):
    q = torch.randn(1, 2, 8, 4, device=device)
    v = torch.randn(1, 2, 8, 3, device=device)
    packed = torch.randn(8, 2, 4, device=device)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    f = adaattn.linear_attn
    if kind == "feature_map":
        return f(q, q, v, feature_map="softmax")
    if kind == "q_rank":
        return f(q[0], q, v)
    if kind == "packed_rank":
        return f(q, q, v, cu_seqlens=cu)
    if kind == "k_shape":
        return f(q, q[:, :1], v)
    if kind == "v_shape":
        return f(q, q, v[:, :, :5])
    if kind == "dtype_mix":
        return f(q, q.double(), v)
    if kind == "integer_q":
        return f(q.long(), q.long(), v.long())
    if kind == "strided_q":
        return f(q.transpose(2, 3), q, v)
    if kind == "head_dim":
        big = torch.randn(1, 1, 2, 257, device=device)
        return f(big, big, big)
    if kind == "cu_seqlens_dtype":
        return f(packed, packed, packed, cu_seqlens=cu.long())
    if kind == "cu_seqlens_shape":
        return f(packed, packed, packed, cu_seqlens=cu.view(1, 3))
    if kind == "cu_seqlens_values":
        return f(packed, packed, packed, cu_seqlens=torch.tensor([0, 5, 3, 8], dtype=torch.int32))
    if kind == "cu_seqlens_end":
        return f(packed, packed, packed, cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32))
    if kind == "initial_state_shape":
        return f(q, q, v, initial_state=torch.zeros(1, 2, 4, 3, device=device))
    if kind == "initial_state_dtype":
        return f(q, q, v, initial_state=torch.zeros(1, 2, 4, 4, device=device,
                                                    dtype=torch.float64))
    if kind == "initial_state_packed":
        return f(packed, packed, packed, cu_seqlens=cu,
                 initial_state=torch.zeros(1, 2, 4, 5, device=device))
    if kind == "bwd_grad_state":
        return torch.ops.adaattn.linear_bwd(v, torch.zeros(1, 2, 4, 3, device=device), q, q, v,
                                            None, None, "elu", True, True)
    if kind == "bwd_grad_out":
        return torch.ops.adaattn.linear_bwd(q, None, q, q, v, None, None, "elu", True, True)
    raise AssertionError(kind)


# kind -> (exception, regex the message must match: it names the argument and what was
# expected). Errors of the op start "adaattn.linear_attn: ".
BAD_INPUTS = {
    "feature_map": (ValueError,
                    r"feature_map must be one of 'elu', 'relu', 'identity', got 'softmax'"),
    "q_rank": (ValueError, r"\bq\b must have 4 dims \[B, H, T, \*\]"),
    "packed_rank": (ValueError, r"\bq\b must have 3 dims \[T, H, \*\].*cu_seqlens"),
    "k_shape": (ValueError, r"\bk\b must have q's shape"),
    "v_shape": (ValueError, r"\bv\b must have q's shape except for its last dim"),
    "dtype_mix": (TypeError, r"q, k and v must have the same dtype"),
    "integer_q": (TypeError, r"\bq\b must be a floating tensor"),
    "strided_q": (ValueError, r"\bq\b must have a contiguous last dim"),
    "head_dim": (ValueError, r"head dim D = q.size\(-1\) must be in \[1, 256\], got 257"),
    "cu_seqlens_dtype": (TypeError, r"cu_seqlens must be int32"),
    "cu_seqlens_shape": (ValueError, r"cu_seqlens must have shape \[N \+ 1\]"),
    "cu_seqlens_values": (ValueError, r"cu_seqlens must be non-decreasing"),
    "cu_seqlens_end": (ValueError, r"cu_seqlens must end at T = q.size\(0\) = 8, got 7"),
    "initial_state_shape": (ValueError, r"initial_state must be a Float tensor of shape "
                                        r"\[N, H, D, Dv \+ 1\] = \[1, 2, 4, 4\]"),
    "initial_state_dtype": (TypeError, r"initial_state must be a Float tensor.*got Double"),
    "initial_state_packed": (ValueError, r"initial_state must be .*\[2, 2, 4, 5\]"),
    "bwd_grad_state": (ValueError, r"grad_state must be"),
    "bwd_grad_out": (ValueError, r"grad_out must have out's shape"),
}
CPU_ONLY_BAD = ("cu_seqlens_values", "cu_seqlens_end")  # CUDA clamps instead (no host sync)


@pytest.mark.parametrize("kind", list(BAD_INPUTS))
def test_bad_input(device, kind):
    if device == "cuda" and kind in CPU_ONLY_BAD:
        pytest.skip("cu_seqlens values are only checked on the CPU")
    error, message = BAD_INPUTS[kind]
    with pytest.raises(error, match=r"^adaattn\.linear_attn: .*(" + message + ")"):
        _bad_call(kind, device)


@pytest.mark.cuda
@pytest.mark.parametrize("which", ["k", "initial_state", "cu_seqlens"])
def test_bad_input_device_mix(which):
    q = torch.randn(8, 2, 4, device="cuda")
    k = q.cpu() if which == "k" else q
    s0 = torch.zeros(2, 2, 4, 5, device="cpu" if which == "initial_state" else "cuda")
    cu = torch.tensor([0, 3, 8], dtype=torch.int32,
                      device="cpu" if which == "cu_seqlens" else "cuda")
    with pytest.raises(RuntimeError,
                       match=rf"^adaattn\.linear_attn: .*\b{which}\b.*(device|cuda|cpu)"):
        adaattn.linear_attn(q, k, q, cu_seqlens=cu, initial_state=s0)


# --------------------------------------------------------------------------------------------
# Registration: opcheck, torch.compile, nn
# --------------------------------------------------------------------------------------------

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")
OPCHECK_CASES = [
    Case(b=2, t=70, d=16, dv=8, state=True),
    Case(b=2, t=33, d=16, dv=16, causal=False, normalize=False, transposed=True),
    Case(lens=(0, 40, 1, 30), d=16, dv=8, fmap="relu", state=True),
]


def _opcheck_dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck_linear_attn(device, case):
    q, k, v, s0, cu, _, _ = make_inputs(case, _opcheck_dtype(device), device)
    torch.library.opcheck(torch.ops.adaattn.linear_attn.default,
                          (q, k, v, s0, cu, case.fmap, case.causal, case.normalize),
                          test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck_linear_fwd_bwd(device, case):
    """The backend ops, without grad (test_autograd_registration runs on requires-grad copies
    and checks that no output of these autograd-less ops claims to require grad)."""
    q, k, v, s0, cu, dout, dstate = make_inputs(case, _opcheck_dtype(device), device,
                                                requires_grad=False)
    opts = (case.fmap, case.causal, case.normalize)
    no_grad_utils = tuple(u for u in OPCHECK_UTILS if u != "test_autograd_registration")
    calls = [(torch.ops.adaattn.linear_fwd.default, (q, k, v, s0, cu) + opts)]
    for ds in (None, dstate):
        calls.append((torch.ops.adaattn.linear_bwd.default, (dout, ds, q, k, v, s0, cu) + opts))
    for op, args in calls:
        torch.library.opcheck(op, args, test_utils=no_grad_utils)
        grad_args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor)
                          and a.is_floating_point() else a for a in args)
        torch.library.opcheck(op, grad_args, test_utils=("test_autograd_registration",))


class TinyLinearBlock(torch.nn.Module):
    """Projections around adaattn.nn.LinearAttention, with (B, L, H, D) -> (B, H, L, D)
    transposed views, plus a packed call carrying a learned initial state."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.o_proj = torch.nn.Linear(dim, dim)
        self.attn = adaattn.nn.LinearAttention(feature_map="elu")
        self.s0 = torch.nn.Parameter(torch.rand(2, heads, self.head_dim, self.head_dim + 1))

    def forward(self, x, cu):
        b, length, _ = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, self.head_dim).unbind(2)
        out = self.attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        flat = [t.reshape(b * length, self.heads, self.head_dim) for t in (q, k, v)]
        packed, state = adaattn.linear_attn(*flat, cu_seqlens=cu, initial_state=self.s0,
                                            return_state=True)
        y = out.transpose(1, 2).reshape(b, length, -1) + packed.view(b, length, -1)
        return self.o_proj(y), state


@pytest.mark.parametrize("device,backend,dtype", [
    pytest.param("cpu", "aot_eager", torch.float32, id="cpu-aot_eager-fp32"),
    pytest.param("cuda", "inductor", torch.float32, marks=pytest.mark.cuda,
                 id="cuda-inductor-fp32"),
    pytest.param("cuda", "inductor", torch.bfloat16, marks=pytest.mark.cuda,
                 id="cuda-inductor-bf16"),
])
def test_torch_compile_fullgraph(device, backend, dtype):
    torch._dynamo.reset()
    model = TinyLinearBlock().to(device)
    for name, p in model.named_parameters():
        if name != "s0":  # the state stays float32
            p.data = p.data.to(dtype)
    x = torch.randn(2, 33, 64, device=device, dtype=dtype)
    cu = torch.tensor([0, 33, 66], dtype=torch.int32, device=device)
    params = [x] + list(model.parameters())

    def run(fn):
        x.grad = None
        model.zero_grad(set_to_none=True)
        x.requires_grad_()
        out, state = fn(x, cu)
        (out.float().sum() + state.sum()).backward()
        return [out.detach(), state.detach()] + [p.grad.detach().clone() for p in params]

    eager = run(model)
    compiled = run(torch.compile(model, backend=backend, fullgraph=True))
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert torch.isfinite(c.double()).all(), f"tensor {i}: non-finite values"
        torch.testing.assert_close(c, e, msg=lambda m: f"tensor {i}: {m}")


def test_nn_module_matches_functional(device):
    mod = adaattn.nn.LinearAttention(feature_map="relu", causal=False, normalize=True)
    assert "relu" in repr(mod)
    q, k, v = (torch.randn(2, 3, 20, 8, dtype=torch.float64, device=device) for _ in range(3))
    expect = adaattn.linear_attn(q, k, v, feature_map="relu", causal=False)
    assert torch.equal(mod(q, k, v), expect)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=device)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    assert torch.equal(mod(*packed, cu_seqlens=cu),
                       adaattn.linear_attn(*packed, feature_map="relu", causal=False,
                                           cu_seqlens=cu))
    with pytest.raises(ValueError, match="feature_map"):
        adaattn.nn.LinearAttention(feature_map="softmax")
