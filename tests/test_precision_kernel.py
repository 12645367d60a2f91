"""flash_attn(precision="fp8" | "auto") (docs/ops.md; issue 32): the op, its CPU kernel (the
emulation of adaattn.precision) and the 8-bit Hopper kernel.

* CUDA (sm_90 only): the kernel's output and lse against the emulation of the same scheme on the
  same inputs (float32, CUDA), on every shape class (L 1/17/97/128/1025, Lq != Lk, GQA 1/2/8,
  causal, windows, D 64/128, transposed inputs), and against float64 within the issue's bars
  beside the bf16 kernel; heads holding NaN/Inf and the heads "auto" leaves at bf16 equal the
  bf16 forward's; empty shapes.
* CPU: the op is the emulation (out in q's dtype, lse, heads), opcheck, torch.compile.
* Both: refusals (gradients wanted, options the 8-bit forward does not take, fp8_tol without
  "auto", bad head dims on CUDA).
"""
import pytest
import torch

import adaattn
from adaattn import precision as P
from adaattn import reference
from conftest import cuda_available
from precision_inputs import BARS, make_inputs


def sm90():
    return cuda_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not sm90(), reason="the 8-bit kernel needs an sm_90 GPU")


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def inputs(b, hq, hkv, len_q, len_k, dim, device, dtype=torch.bfloat16, seed=0, kind="normal",
           causal=False):
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        q = torch.randn(b, hq, len_q, dim, generator=gen)
        k = torch.randn(b, hkv, len_k, dim, generator=gen)
        v = torch.randn(b, hkv, len_k, dim, generator=gen)
    else:
        q, k, v = make_inputs(kind, b, hq, max(len_q, len_k), dim, causal=causal, seed=seed)
        q, k, v = q[:, :, :len_q], k[:, :hkv, :len_k], v[:, :hkv, :len_k]
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def emulated(q, k, v, **kw):
    return P.fp8_attention_emulated(q, k, v, return_lse=True, **kw)


def fp8(q, k, v, **kw):
    with torch.no_grad():
        return adaattn.flash_attn(q, k, v, precision="fp8", return_lse=True,
                                  return_precision=True, **kw)


# The kernel differs from the emulation by rounding alone: an int8 code or an e4m3 P that lands
# on the other side of a rounding boundary (K's mean summed in another order; exp2 against
# exp), and the 8-bit products' reduced-precision accumulation. One int8 step of one K channel
# moves a score by up to sq * sk * 127 * scale (~1e-2 on these inputs), which a row that sees
# a single key shows in its lse unaveraged.
KERNEL_VS_EMULATION = 5e-3
LSE_VS_EMULATION = 2e-2


def check_against_emulation(q, k, v, **kw):
    out, lse, heads = fp8(q, k, v, **kw)
    causal = kw.get("causal", False)
    window = kw.get("window", (-1, -1))
    e_out, e_lse, e_heads = emulated(q.float(), k.float(), v.float(), causal=causal,
                                     window=window)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert torch.equal(heads.cpu(), e_heads.cpu())
    if e_out.norm() > 0:
        assert rel_err(out, e_out) < KERNEL_VS_EMULATION
    else:
        assert (out == 0).all()
    seen = e_lse > -float("inf")
    assert torch.equal(seen, lse > -float("inf"))
    if seen.any():
        assert (lse[seen] - e_lse[seen]).abs().max().item() < LSE_VS_EMULATION


@needs_sm90
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("len_q,len_k", [(1, 1), (17, 17), (97, 97), (128, 128), (1025, 1025),
                                         (97, 300), (300, 97), (1, 1025)])
def test_kernel_equals_emulation(dim, causal, len_q, len_k):
    q, k, v = inputs(2, 4, 2, len_q, len_k, dim, "cuda", seed=len_q + len_k)
    check_against_emulation(q, k, v, causal=causal)


@needs_sm90
@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("window", [(64, 0), (100, 50), (-1, 20)])
def test_kernel_windows_and_gqa(group, window):
    q, k, v = inputs(1, 8, 8 // group, 700, 700, 128, "cuda", seed=group)
    check_against_emulation(q, k, v, window=window)


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_transposed_inputs_and_fp16(dtype):
    q, k, v = inputs(2, 4, 4, 300, 300, 64, "cuda", dtype=dtype, seed=7)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not views[0].is_contiguous()
    check_against_emulation(*views, causal=True)
    a = fp8(q, k, v, causal=True)[0]
    b = fp8(*views, causal=True)[0]
    assert torch.equal(a, b)


@needs_sm90
@pytest.mark.parametrize("kind", ["normal", "peaky", "outlier"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_meets_issue_bars(kind, dim, causal):
    q, k, v = inputs(1, 2, 2, 1024, 1024, dim, "cuda", seed=11, kind=kind, causal=causal)
    ref = reference.flash_attn(q.double(), k.double(), v.double(), causal=causal)[0]
    out = fp8(q, k, v, causal=causal)[0]
    max_err, min_cos = BARS[kind]
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.flatten(), dim=0)
    assert rel_err(out, ref) <= max_err and cos.item() >= min_cos
    bf16 = adaattn.flash_attn(q, k, v, causal=causal)
    assert rel_err(bf16, ref) < rel_err(out, ref)


@needs_sm90
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nonfinite_heads_run_bf16(where, value):
    q, k, v = inputs(2, 4, 2, 200, 200, 128, "cuda", seed=3)
    t = {"q": q, "k": k, "v": v}[where]
    t[1, 1, 50, 7] = value  # q: head (1, 1); k/v: kv head (1, 1) = query heads (1, 2), (1, 3)
    out, lse, heads = fp8(q, k, v, causal=True)
    bad = torch.zeros(2, 4, dtype=torch.bool)
    if where == "q":
        bad[1, 1] = True
    else:
        bad[1, 2:] = True
    assert torch.equal(heads.cpu(), ~bad)
    ref_out, ref_lse = adaattn.flash_attn(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out[bad.cuda()].isnan(), ref_out[bad.cuda()].isnan())
    finite = ~ref_out[bad.cuda()].isnan()
    assert torch.equal(out[bad.cuda()][finite], ref_out[bad.cuda()][finite])
    assert torch.isfinite(out[~bad.cuda()]).all()


@needs_sm90
@pytest.mark.parametrize("kind", ["normal", "outlier"])
@pytest.mark.parametrize("dim", [64, 128])
def test_auto_choice_is_choose_precision(kind, dim):
    # The op's in-pre-pass estimate is estimate_precision_error's model: the same choice on
    # heads whose estimates straddle the tolerance.
    q, k, v = inputs(1, 8, 4, 600, 600, dim, "cuda", seed=dim, kind=kind)
    q[:, ::3] *= 3
    est = P.estimate_precision_error(q, k, v)
    tol = est.median().item()
    with torch.no_grad():
        _, heads = adaattn.flash_attn(q, k, v, precision="auto", fp8_tol=tol,
                                      return_precision=True)
    margin = (est - tol).abs() > 1e-3 * tol  # heads at the tolerance may fall either way
    assert torch.equal(heads[margin].cpu(), (est <= tol)[margin].cpu())


@needs_sm90
def test_auto_runs_scaled_heads_bf16():
    q, k, v = inputs(2, 8, 8, 512, 512, 128, "cuda", seed=5)
    q[:, 4:] *= 4
    k[:, 4:] *= 4
    with torch.no_grad():
        out, heads = adaattn.flash_attn(q, k, v, causal=True, precision="auto",
                                        return_precision=True)
    expect = torch.zeros(2, 8, dtype=torch.bool)
    expect[:, :4] = True
    assert torch.equal(heads.cpu(), expect)
    bf16 = adaattn.flash_attn(q, k, v, causal=True)
    assert torch.equal(out[:, 4:], bf16[:, 4:])
    ref = reference.flash_attn(q.double(), k.double(), v.double(), causal=True)[0]
    for h in range(8):
        assert rel_err(out[:, h], ref[:, h]) <= P.FP8_TOL


@needs_sm90
@pytest.mark.parametrize("shape", [(0, 2, 2, 16, 16), (2, 2, 2, 0, 16), (2, 2, 2, 16, 0)])
def test_kernel_empty_shapes(shape):
    b, hq, hkv, len_q, len_k = shape
    q, k, v = inputs(b, hq, hkv, len_q, len_k, 64, "cuda")
    out, lse, heads = fp8(q, k, v)
    assert out.shape == (b, hq, len_q, 64) and lse.shape == (b, hq, len_q)
    assert (out == 0).all() and (lse == -float("inf")).all()


@needs_sm90
def test_kernel_refuses_other_head_dims():
    q, k, v = inputs(1, 2, 2, 64, 64, 96, "cuda")
    with pytest.raises(ValueError, match="head dims D = Dv in"):
        fp8(q, k, v)


def test_cpu_op_is_the_emulation():
    q, k, v = inputs(1, 4, 2, 200, 150, 64, "cpu", seed=9)
    out, lse, heads = fp8(q, k, v, causal=True)
    e_out, e_lse, e_heads = emulated(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, e_out.to(torch.bfloat16))
    assert torch.equal(lse, e_lse) and torch.equal(heads, e_heads)


def test_cpu_opcheck_and_compile():
    q, k, v = inputs(1, 2, 2, 130, 130, 64, "cpu", seed=2)
    torch.library.opcheck(torch.ops.adaattn.flash_fwd_fp8, (q, k, v, None, True, -1, -1, None))

    @torch.compile(fullgraph=True)
    def f(q, k, v):
        return adaattn.flash_attn(q, k, v, causal=True, precision="fp8")

    with torch.no_grad():
        assert torch.equal(f(q, k, v), adaattn.flash_attn(q, k, v, causal=True, precision="fp8"))


@pytest.mark.parametrize("kwargs,cls,text", [
    (dict(precision="fp16"), ValueError, "precision must be"),
    (dict(precision="fp8", softcap=5.0), ValueError, "does not take softcap"),
    (dict(precision="fp8", fp8_tol=0.1), ValueError, "fp8_tol applies to precision='auto'"),
    (dict(precision="fp8", softmax_scale=-0.1), ValueError, "softmax_scale > 0"),
    (dict(precision="auto", fp8_tol=-1.0), ValueError, "fp8_tol must be finite"),
])
def test_bad_options(kwargs, cls, text):
    q, k, v = inputs(1, 2, 2, 16, 16, 64, "cpu")
    with torch.no_grad(), pytest.raises(cls, match=text):
        adaattn.flash_attn(q, k, v, **kwargs)


def test_refuses_gradients():
    q, k, v = inputs(1, 2, 2, 16, 16, 64, "cpu")
    q.requires_grad_()
    with pytest.raises(RuntimeError, match="forward-only"):
        adaattn.flash_attn(q, k, v, precision="fp8")


def test_refuses_float32():
    q, k, v = inputs(1, 2, 2, 16, 16, 64, "cpu", dtype=torch.float32)
    with torch.no_grad(), pytest.raises(TypeError, match="float16 or bfloat16"):
        adaattn.flash_attn(q, k, v, precision="fp8")


def test_example_runs_and_keeps_large_logit_heads_at_bf16(capsys):
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "adaptive_precision.py"
    spec = importlib.util.spec_from_file_location("adaptive_precision", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--device", "cpu", "--length", "256", "--no-plot"]) == 0
    lines = [l.split() for l in capsys.readouterr().out.splitlines() if l.strip().endswith(
        tuple("0123456789")) and l.split()[0].isdigit()]
    assert len(lines) == 8
    assert all(l[5] == "bf16" for l in lines if l[1] == "x4")
    assert all(l[5] == "fp8" for l in lines if l[1] == "plain")
