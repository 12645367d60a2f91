"""The correctness rules of the tests, shared by the attention test modules.

* float32: relative error ``||a - b|| / ||b|| <= FP32_RTOL`` against float64
  (:func:`assert_rel_close`);
* float16/bfloat16: ``err(ours) <= 2 * err(reference in the same dtype) + 1e-5`` with
  ``err = max |x - x_float64|`` (flash-attn's rule, :func:`assert_low_precision_rule`).
Both check that ``lse`` is ``-inf`` exactly where the reference's is and that nothing is NaN.
"""
import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
FP32_RTOL = 1e-5


def randn(b, h, length, d, dtype, device, transposed):
    """Seeded CPU draw (identical across devices), optionally as a (B, L, H, D) transposed view."""
    if transposed:
        t = torch.randn(b, length, h, d, dtype=torch.float64).to(device, dtype).transpose(1, 2)
    else:
        t = torch.randn(b, h, length, d, dtype=torch.float64).to(device, dtype)
    return t.detach()


def split_lse(name, actual, expected):
    """Checks that ``-inf`` (no key seen) sits exactly where the reference has it, no NaN/+inf
    anywhere; returns the finite entries of both."""
    actual = actual.double()
    expected = expected.double().to(actual.device)
    assert not torch.isnan(actual).any(), f"{name}: NaN"
    if name != "lse":
        assert torch.isfinite(actual).all(), f"{name}: non-finite values"
        return actual, expected
    assert not torch.isposinf(actual).any(), f"{name}: +inf"
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected)), (
        f"{name}: -inf pattern differs from the reference")
    finite = torch.isfinite(expected)
    return actual[finite], expected[finite]


def assert_rel_close(name, actual, expected, rtol):
    """``||actual - expected|| <= rtol * ||expected||`` (finite entries; lse -inf pattern exact;
    an all-zero reference requires exact zeros)."""
    a, e = split_lse(name, actual, expected)
    diff = torch.linalg.vector_norm(a - e).item()
    norm = torch.linalg.vector_norm(e).item()
    detail = (f"relative error {diff / norm:.3e}" if norm
              else f"expected zeros, error norm {diff:.3e}")
    assert diff <= rtol * norm, f"{name}: {detail} > {rtol}"


def max_abs_err(a, e):
    return (a - e).abs().max().item() if a.numel() else 0.0


def assert_low_precision_rule(name, ours, ref_low, ref64):
    """flash-attn's rule: ``err(ours) <= 2 * err(ref_low) + 1e-5`` against float64."""
    a, e = split_lse(name, ours, ref64)
    lo, _ = split_lse(name, ref_low.to(ours.device), ref64)
    err, base = max_abs_err(a, e), max_abs_err(lo, e)
    assert err <= 2 * base + 1e-5, f"{name}: max error {err:.3e} > 2 * {base:.3e} + 1e-5"
