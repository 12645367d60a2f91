"""The lazy-attention reference (docs/ops.md): its autograd gradients equal the closed-form
backward that fused kernels implement, and it reduces to causal softmax attention."""
import pytest
import torch

from adaattn import reference

CASES = [
    # (B, Hq, Hkv, Lq, Lk, D, W, tau, seqlens)
    (2, 4, 4, 17, 17, 16, 7, -1.0, None),
    (2, 4, 2, 13, 29, 8, 1, -1.0, None),
    (1, 4, 1, 33, 33, 16, 512, 0.5, None),
    (3, 2, 2, 20, 20, 8, 5, -0.3, [0, 11, 20]),
]


def _inputs(b, hq, hkv, lq, lk, d, w, tau, seqlens):
    q = torch.randn(b, hq, lq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hkv, lk, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, lk, d, dtype=torch.float64, requires_grad=True)
    taus = (tau + 0.1 * torch.randn(hq, dtype=torch.float64)).requires_grad_()
    bias = (0.5 * torch.randn(hq, w, dtype=torch.float64)).requires_grad_()
    lens = None if seqlens is None else torch.tensor(seqlens, dtype=torch.int32)
    return q, k, v, taus, bias, lens


@pytest.mark.parametrize("case", CASES, ids=str)
def test_closed_form_backward_matches_autograd(case):
    q, k, v, tau, bias, lens = _inputs(*case)
    out, _ = reference.lazy_attn(q, k, v, tau, bias, seqlens=lens)
    grad = torch.randn_like(out)
    expected = torch.autograd.grad(out, (q, k, v, tau, bias), grad)
    got = reference.lazy_attn_backward(grad, q.detach(), k.detach(), v.detach(), tau.detach(),
                                       bias.detach(), seqlens=lens)
    for name, a, e in zip(("dq", "dk", "dv", "dtau", "dbias"), got, expected):
        assert a.shape == e.shape, name
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12, msg=name)


def test_elastic_weights_are_clipped_not_renormalised():
    q, k, v, tau, bias, _ = _inputs(1, 2, 2, 40, 40, 8, 4, -1.0, None)
    out, _ = reference.lazy_attn(q, k, v, tau, bias)
    ones_v = torch.ones_like(v)
    row_mass, _ = reference.lazy_attn(q, k, ones_v, tau, bias)
    # With tau < 0 some weights are clipped to zero, so rows sum to less than one.
    assert (row_mass[..., 0] < 1 - 1e-6).any()
    assert torch.isfinite(out).all()


def test_zero_tau_and_bias_is_causal_softmax_attention():
    q, k, v, _, _, _ = _inputs(2, 4, 2, 19, 23, 16, 3, 0.0, None)
    tau = torch.zeros(4, dtype=torch.float64)
    bias = torch.zeros(4, 3, dtype=torch.float64)
    out, lse = reference.lazy_attn(q, k, v, tau, bias)
    ref_out, ref_lse = reference.flash_attn(q, k, v, causal=True)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
