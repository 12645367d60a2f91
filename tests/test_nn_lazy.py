"""Tests of adaattn.nn.LazyAttention and examples/train_lazy.py (docs/ops.md; rules: accuracy.py).

The module must compute ``adaattn.reference.lazy_attn`` with its own ``tau`` and ``bias``, send
gradients to both, and keep them float32, also under autocast. Bars as in tests/accuracy.py: float64
inputs within ``rtol 1e-9`` of the float64 reference, float32 tensors (and the float32 parameter
gradients) within a relative error of 1e-5, bfloat16 ``err(ours) <= 2 * err(reference in
bfloat16) + 1e-5``. The example is smoke-run for a few steps on the CPU.
"""
import dataclasses
import importlib.util
import os
import sys

import pytest
import torch

import adaattn
from adaattn import reference
from adaattn.nn import LazyAttention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ("out", "dq", "dk", "dv", "dtau", "dbias")

# (B, Hq, Hkv, Lq, Lk, D, W, seqlens, transposed)
CASES = [
    (2, 4, 4, 33, 33, 16, 8, None, False),        # bias table shorter than the sequence
    (2, 4, 2, 17, 40, 32, 64, None, True),        # GQA, Lq < Lk, (B, L, H, D) inputs
    (3, 2, 1, 20, 20, 16, 5, (0, 11, 20), False),  # right padding, an empty sequence
]


def _module(heads, window, device="cpu"):
    """A LazyAttention whose tau (both signs) and bias are random, so that swapped heads or
    distances show; tau around -0.5 keeps both clipped and kept weights in play."""
    attn = LazyAttention(heads, window=window, tau_init=-0.5).to(device)
    with torch.no_grad():
        attn.tau.add_(0.5 * torch.randn(heads, device=device))
        attn.bias.normal_(0.0, 0.5)
    return attn


def _qkv(b, hq, hkv, lq, lk, d, dtype, device="cpu", transposed=False):
    def make(h, length):
        if transposed:
            return torch.randn(b, length, h, d, dtype=dtype, device=device).transpose(1, 2)
        return torch.randn(b, h, length, d, dtype=dtype, device=device)
    return make(hq, lq), make(hkv, lk), make(hkv, lk)


def _reference(q, k, v, tau, bias, seqlens, dout, dtype):
    """Reference ``(out, dq, dk, dv, dtau, dbias)`` with q/k/v in ``dtype``, tau/bias as given."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    tau, bias = (t.detach().requires_grad_() for t in (tau, bias))
    out, _ = reference.lazy_attn(q, k, v, tau, bias, seqlens=seqlens)
    return (out,) + torch.autograd.grad(out, (q, k, v, tau, bias), dout.to(out.dtype))


def _module_results(attn, q, k, v, seqlens, dout):
    """``(out, dq, dk, dv, dtau, dbias)`` of the module, gradients through ``.backward()``."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attn(q, k, v, seqlens)
    (out.double() * dout).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad, attn.tau.grad, attn.bias.grad


def _assert_exact_rule(name, actual, expected):
    """float64 tensors: ``rtol 1e-9``; float32 ones: relative error ``<= 1e-5``."""
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    if actual.dtype == torch.float64:
        torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-12, msg=name)
    else:
        assert actual.dtype == torch.float32, f"{name}: dtype {actual.dtype}"
        rel = ((actual.double() - expected).norm() / expected.norm()).item()
        assert rel <= 1e-5, f"{name}: relative error {rel:.2e} > 1e-5"


def _assert_low_precision_rule(name, ours, ref_low, ref64):
    """flash-attn's rule: ``err(ours) <= 2 * err(ref_low) + 1e-5`` (max abs error vs fp64)."""
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    err = (ours.double() - ref64).abs().max().item()
    base = (ref_low.double() - ref64).abs().max().item()
    assert err <= 2 * base + 1e-5, f"{name}: max error {err:.3e} > 2 * {base:.3e} + 1e-5"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference_with_own_parameters(case, dtype):
    b, hq, hkv, lq, lk, d, w, lens, transposed = case
    attn = _module(hq, w)
    q, k, v = _qkv(b, hq, hkv, lq, lk, d, dtype, transposed=transposed)
    seqlens = None if lens is None else torch.tensor(lens, dtype=torch.int32)
    dout = torch.randn(b, hq, lq, d, dtype=dtype).double()
    ours = _module_results(attn, q, k, v, seqlens, dout)
    expected = _reference(q, k, v, attn.tau.double(), attn.bias.double(), seqlens, dout,
                          torch.float64)
    assert ours[0].dtype == dtype
    assert attn.tau.grad.dtype == attn.bias.grad.dtype == torch.float32
    assert expected[4].abs().max() > 0 and expected[5].abs().max() > 0  # the case tests them
    for name, a, e in zip(NAMES, ours, expected):
        _assert_exact_rule(name, a, e)


def _spy_on_op(monkeypatch):
    """Replaces adaattn.lazy_attn by a wrapper recording each call's dtypes and autocast state."""
    op, calls = adaattn.lazy_attn, []

    def spy(q, k, v, tau, bias, **kwargs):
        calls.append({"qkv": {q.dtype, k.dtype, v.dtype}, "tau": tau.dtype, "bias": bias.dtype,
                      "autocast": torch.is_autocast_enabled(q.device.type)})
        return op(q, k, v, tau, bias, **kwargs)

    monkeypatch.setattr(adaattn, "lazy_attn", spy)
    return calls


def _check_autocast(device, monkeypatch):
    """bfloat16 autocast: the op gets bfloat16 q/k/v and float32 tau/bias with autocast off; the
    parameters and their gradients stay float32; values follow the low-precision rule."""
    b, hq, hkv, length, d, w = 2, 4, 2, 80, 64, 32
    attn = _module(hq, w, device)
    q, k, v = _qkv(b, hq, hkv, length, length, d, torch.float32, device)  # float32 activations
    # Representable in bfloat16, so that ours and both references see the same gradient.
    dout = torch.randn(b, hq, length, d, dtype=torch.bfloat16, device=device).double()
    calls = _spy_on_op(monkeypatch)
    with torch.autocast(device, dtype=torch.bfloat16):
        ours = _module_results(attn, q, k, v, None, dout)
    assert calls == [{"qkv": {torch.bfloat16}, "tau": torch.float32, "bias": torch.float32,
                      "autocast": False}]
    assert ours[0].dtype == torch.bfloat16
    assert attn.tau.dtype == attn.bias.dtype == torch.float32
    assert attn.tau.grad.dtype == attn.bias.grad.dtype == torch.float32
    # The module computes on q/k/v rounded to bfloat16: the references start from the same.
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    ref64 = _reference(q, k, v, attn.tau.double(), attn.bias.double(), None, dout, torch.float64)
    ref_low = _reference(q, k, v, attn.tau.bfloat16(), attn.bias.bfloat16(), None, dout,
                         torch.bfloat16)
    for name, a, lo, e in zip(NAMES, ours, ref_low, ref64):
        _assert_low_precision_rule(name, a, lo, e)


def test_autocast_cpu_bfloat16(monkeypatch):
    _check_autocast("cpu", monkeypatch)


@pytest.mark.cuda
def test_autocast_cuda_bfloat16(monkeypatch):
    _check_autocast("cuda", monkeypatch)


def test_module_cast_to_bfloat16_still_passes_float32_parameters(monkeypatch):
    attn = _module(2, 16).to(torch.bfloat16)
    q, k, v = _qkv(1, 2, 2, 24, 24, 16, torch.bfloat16)
    calls = _spy_on_op(monkeypatch)
    attn(q, k, v).float().sum().backward()
    assert calls[0]["tau"] == calls[0]["bias"] == torch.float32
    assert attn.tau.grad.abs().max() > 0 and attn.bias.grad.abs().max() > 0


def test_parameters_are_float32_and_initialised():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        attn = LazyAttention(3, window=7, tau_init=-0.25)
    finally:
        torch.set_default_dtype(default)
    assert dict(attn.named_parameters()).keys() == {"tau", "bias"}
    assert attn.tau.dtype == attn.bias.dtype == torch.float32
    assert torch.equal(attn.tau, torch.full((3,), -0.25))
    assert torch.equal(attn.bias, torch.zeros(3, 7))


def test_rejects_head_count_mismatch():
    attn = LazyAttention(4, window=8)
    q, k, v = _qkv(1, 2, 2, 5, 5, 16, torch.float32)
    with pytest.raises(ValueError, match=r"^adaattn\.nn\.LazyAttention: .*num_heads=4"):
        attn(q, k, v)


# --------------------------------------------------------------------------------------------
# examples/train_lazy.py
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def train_lazy():
    path = os.path.join(ROOT, "examples", "train_lazy.py")
    spec = importlib.util.spec_from_file_location("train_lazy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def keep_num_threads():
    """The example's main() sets torch's thread count; later tests get the old one back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_example_trains_deterministically(train_lazy):
    cfg = dataclasses.replace(train_lazy.Config(), steps=3, batch_size=4, context=32, window=16,
                              corpus_lines=50, log_every=1)
    log = []
    first = train_lazy.train(cfg, "cpu", log=log.append)
    assert len(log) == 3 and log[-1].startswith("step     3")
    assert first.losses.shape == (3,) and torch.isfinite(first.losses).all()
    assert first.taus.shape == (4, cfg.layers, cfg.heads)
    assert torch.equal(first.taus[0], torch.full((cfg.layers, cfg.heads), cfg.tau_init))
    assert (first.taus[-1] != first.taus[0]).all()  # every head's tau got a gradient step
    completion = train_lazy.complete(first, train_lazy.PROMPT, 5, "cpu")
    assert len(completion) == 5 and set(completion) <= set(first.chars)
    second = train_lazy.train(cfg, "cpu", log=lambda _: None)
    assert torch.equal(first.losses, second.losses) and torch.equal(first.taus, second.taus)


def test_example_without_matplotlib_says_how_to_install(train_lazy, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(SystemExit, match=r"pip install -r requirements-examples\.txt"):
        train_lazy.main(["--steps", "1", "--device", "cpu"])


def test_example_writes_png(train_lazy, tmp_path, capsys, keep_num_threads):
    pytest.importorskip("matplotlib")
    out = tmp_path / "train.png"
    train_lazy.main(["--steps", "2", "--device", "cpu", "--out", str(out), "--threads", "1"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"saved {out}" in capsys.readouterr().out
