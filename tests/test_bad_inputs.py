"""Bad and edge inputs to every op: a table of cases, each either a clear error or the correct
result (issue 37's corpus).

* ``BAD``: the call raises the exception class of the policy (``TypeError`` for a wrong type or
  dtype, ``ValueError`` for a wrong value, shape or layout, ``RuntimeError`` for a device
  mismatch) with a message that starts ``adaattn.<op>: `` and names the argument.
* The fake kernels raise exactly what the real ones do: every case that reads no tensor value
  runs again on meta tensors (the Meta kernels) and under ``FakeTensorMode`` (what
  ``torch.compile`` traces with), and must give the same exception and message.
* Value checks (seqlens, cu_seqlens, mask indices, cache lengths) run on the CPU, and on CUDA
  with ``ADAATTN_CHECK_INPUTS=1``.
* ``GOOD``: legal edge inputs (empty batches, zero-length sequences, rows without keys, NaN and
  Inf) give the reference's result.
"""
import dataclasses
import re
from typing import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import adaattn
from adaattn import reference
from adaattn.nn import FlashSelfAttention, LazyAttention, LinearAttention


F32, F64, I32, I64 = torch.float32, torch.float64, torch.int32, torch.int64
F16, BF16 = torch.float16, torch.bfloat16
NAN, INF = float("nan"), float("inf")


# ---- Inputs ----------------------------------------------------------------------------------

def rand(dev, *shape, dtype=F32):
    return torch.randn(*shape, dtype=dtype, device=dev)


def gram(q, k):
    return torch.ops.adaattn.sym_gram(q, k)


def ints(dev, values, dtype=I32):
    return torch.tensor(values, dtype=dtype, device=dev)


def qkv(dev, b=1, hq=2, hkv=2, lq=8, lk=8, d=16, dv=None, dtype=F32):
    return (rand(dev, b, hq, lq, d, dtype=dtype), rand(dev, b, hkv, lk, d, dtype=dtype),
            rand(dev, b, hkv, lk, d if dv is None else dv, dtype=dtype))


def packed(dev, t=8, hq=2, hkv=2, d=16):
    return rand(dev, t, hq, d), rand(dev, t, hkv, d), rand(dev, t, hkv, d)


def lazy_params(dev, h=2, w=4):
    return torch.zeros(h, device=dev), torch.zeros(h, w, device=dev)


def mask(dev, nq=1, nkv=1, block=128):
    return adaattn.BlockSparseMask.from_dense(
        torch.ones(1, 1, nq, nkv, dtype=torch.bool, device=dev), block)


def cache(dev, b=2, hq=4, hkv=2, lq=1, lmax=32, d=16, dtype=F32):
    """q, k_cache, v_cache, new k, new v, cache_seqlens (5 and 29 cached tokens)."""
    return (rand(dev, b, hq, lq, d, dtype=dtype), rand(dev, b, hkv, lmax, d, dtype=dtype),
            rand(dev, b, hkv, lmax, d, dtype=dtype), rand(dev, b, hkv, lq, d, dtype=dtype),
            rand(dev, b, hkv, lq, d, dtype=dtype), ints(dev, [5, 29][:b]))


def other(dev):
    """A device other than `dev` for device-mix cases."""
    return "meta" if dev != "meta" else "cpu"


# ---- Bad inputs ------------------------------------------------------------------------------

@dataclasses.dataclass
class Bad:
    name: str
    op: str  # the message starts "adaattn.<op>: "
    error: type
    match: str  # regex the rest of the message matches: it names the argument
    call: Callable[[str], object]  # call(device)
    values: bool = False  # a check of tensor values (none on fakes; CUDA: on request)
    mixed: bool = False  # mixes devices (meta with the test's device)
    module: bool = False  # calls an nn module (FakeTensorMode cannot move its parameters)


def fa(dev, **kw):
    q, k, v = qkv(dev)
    return adaattn.flash_attn(q, k, v, **kw)


def fa_args(q=None, k=None, v=None, **kw):
    return lambda dev: adaattn.flash_attn(q(dev) if q else rand(dev, 1, 2, 8, 16),
                                          k(dev) if k else rand(dev, 1, 2, 8, 16),
                                          v(dev) if v else rand(dev, 1, 2, 8, 16), **kw)


def varlen(dev, cu_q=None, cu_k=None, **kw):
    q, k, v = packed(dev)
    cu = ints(dev, [0, 3, 8])
    return adaattn.flash_attn_varlen(q, k, v, cu if cu_q is None else cu_q(dev),
                                     cu if cu_k is None else cu_k(dev), **kw)


def lazy(dev, q=None, k=None, v=None, tau=None, bias=None, **kw):
    qq, kk, vv = qkv(dev)
    t, b = lazy_params(dev)
    return adaattn.lazy_attn(q(dev) if q else qq, k(dev) if k else kk, v(dev) if v else vv,
                             tau(dev) if tau else t, bias(dev) if bias else b, **kw)


def lazy_varlen(dev, cu=None, q=None, **kw):
    qq, k, v = packed(dev)
    t, b = lazy_params(dev)
    return adaattn.lazy_attn_varlen(q(dev) if q else qq, k, v,
                                    ints(dev, [0, 3, 8]) if cu is None else cu(dev), t, b, **kw)


def sparse(dev, m=None, q=None, k=None, **kw):
    qq, kk, v = qkv(dev, lq=100, lk=100)
    return adaattn.block_sparse_attn(q(dev) if q else qq, k(dev) if k else kk, v,
                                     mask(dev) if m is None else m(dev), **kw)


def sparse_op(dev, num=None, idx=None, block_m=128, block_n=128, **kw):
    q, k, v = qkv(dev, lq=100, lk=100)
    mk = mask(dev)
    return torch.ops.adaattn.block_sparse_fwd(
        q, k, v, mk.kv_num_blocks if num is None else num(dev),
        mk.kv_indices if idx is None else idx(dev), block_m, block_n, None, False, **kw)


def linear(dev, q=None, k=None, v=None, **kw):
    qq, kk, vv = (rand(dev, 1, 2, 8, 16) for _ in range(3))
    return adaattn.linear_attn(q(dev) if q else qq, k(dev) if k else kk, v(dev) if v else vv,
                               **kw)


def linear_packed(dev, cu, **kw):
    q = rand(dev, 8, 2, 16)
    return adaattn.linear_attn(q, q, q, cu_seqlens=cu(dev), **kw)


def low_rank(dev, basis=None, q=None, **kw):
    qq, k, v = qkv(dev)
    return adaattn.low_rank_attn(q(dev) if q else qq, k, v,
                                 rand(dev, 1, 2, 16, 4) if basis is None else basis(dev), **kw)


def plan(dev, q=None, k=None, **kw):
    qq, kk, _ = qkv(dev, d=32)
    return adaattn.rank_plan(q(dev) if q else qq, k(dev) if k else kk, **kw)


def adaptive(dev, v=None, q=None, **kw):
    qq, k, vv = qkv(dev, d=32)
    return adaattn.adaptive_rank_attn(q(dev) if q else qq, k, v(dev) if v else vv, **kw)


def decode(dev, change=None, lazy_op=False, **kw):
    q, k_cache, v_cache, k, v, lens = cache(dev)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    kw.setdefault("cache_seqlens", lens)
    if change:
        args.update(change(dev, args))
    if lazy_op:
        tau, bias = lazy_params(dev, h=4)
        return adaattn.lazy_attn_with_kvcache(args["q"], args["k_cache"], args["v_cache"],
                                              args["k"], args["v"], kw.pop("tau", tau),
                                              kw.pop("bias", bias), **kw)
    return adaattn.flash_attn_with_kvcache(args["q"], args["k_cache"], args["v_cache"],
                                           args["k"], args["v"], **kw)


def paged(dev, table, **kw):
    q, _, _, k, v, lens = cache(dev)
    pages = rand(dev, 8, 2, 8, 16)
    return adaattn.flash_attn_with_kvcache(q, pages, pages.clone(), k, v, cache_seqlens=lens,
                                           block_table=table(dev), **kw)


def flash_bwd(dev, change):
    q, k, v = qkv(dev)
    out, lse = torch.ops.adaattn.flash_fwd(q, k, v, None, None, False, -1, -1)
    args = dict(grad_out=torch.ones_like(out), out=out, lse=lse)
    args.update(change(args))
    return torch.ops.adaattn.flash_bwd(args["grad_out"], q, k, v, args["out"], args["lse"],
                                       None, None, False, -1, -1, False)


FA, FV, LA, LV = "flash_attn", "flash_attn_varlen", "lazy_attn", "lazy_attn_varlen"
BS, LIN, LR, KV, LKV = ("block_sparse_attn", "linear_attn", "low_rank_attn",
                        "flash_attn_with_kvcache", "lazy_attn_with_kvcache")
T, V, R = TypeError, ValueError, RuntimeError

BAD = [
    # flash_attn: tensors
    Bad("q_not_tensor", FA, T, r"\bq\b must be a tensor", fa_args(q=lambda d: [[1.0]])),
    Bad("q_rank", FA, V, r"\bq\b must have 4 dims", fa_args(q=lambda d: rand(d, 2, 8, 16))),
    Bad("k_rank5", FA, V, r"\bk\b must have 4 dims", fa_args(k=lambda d: rand(d, 1, 1, 2, 8, 16))),
    Bad("k_integer", FA, T, r"\bk\b must be a floating tensor.*Int",
        fa_args(k=lambda d: ints(d, [[[[1] * 16] * 8] * 2]))),
    Bad("q_complex", FA, T, r"\bq\b must be a floating tensor",
        fa_args(q=lambda d: rand(d, 1, 2, 8, 16, dtype=torch.complex64))),
    Bad("v_strided_last_dim", FA, V, r"\bv\b must have a contiguous last dim",
        fa_args(v=lambda d: rand(d, 1, 2, 16, 8).transpose(2, 3))),
    Bad("dtype_mix", FA, T, r"q, k and v must have the same dtype, got q Float, k Double",
        fa_args(k=lambda d: rand(d, 1, 2, 8, 16, dtype=F64))),
    Bad("device_mix_k", FA, R, r"same device, got q on \S+, k on meta",
        lambda d: fa_args(k=lambda _: rand(other(d), 1, 2, 8, 16))(d), mixed=True),
    Bad("device_mix_v", FA, R, r"same device.*v on meta",
        lambda d: fa_args(v=lambda _: rand(other(d), 1, 2, 8, 16))(d), mixed=True),
    Bad("batch_mismatch", FA, V, r"batch size mismatch",
        fa_args(k=lambda d: rand(d, 2, 2, 8, 16), v=lambda d: rand(d, 2, 2, 8, 16))),
    Bad("kv_length_mismatch", FA, V, r"\bk\b and \bv\b must have the same heads and length",
        fa_args(v=lambda d: rand(d, 1, 2, 7, 16))),
    Bad("heads_not_multiple", FA, V, r"multiple of the number of kv heads \(k.size\(1\) = 3\)",
        fa_args(q=lambda d: rand(d, 1, 4, 8, 16), k=lambda d: rand(d, 1, 3, 8, 16),
                v=lambda d: rand(d, 1, 3, 8, 16))),
    Bad("zero_kv_heads", FA, V, r"kv heads \(k.size\(1\) = 0\)",
        fa_args(k=lambda d: rand(d, 1, 0, 8, 16), v=lambda d: rand(d, 1, 0, 8, 16))),
    Bad("head_dim_mismatch", FA, V, r"head dim mismatch: q has D = 16, k has D = 8",
        fa_args(k=lambda d: rand(d, 1, 2, 8, 8))),
    Bad("head_dim_257", FA, V, r"head dim D = q.size\(-1\) must be in \[1, 256\], got 257",
        lambda d: adaattn.flash_attn(*qkv(d, d=257))),
    Bad("head_dim_0", FA, V, r"head dim D = q.size\(-1\) must be in \[1, 256\], got 0",
        lambda d: adaattn.flash_attn(*qkv(d, d=0))),
    Bad("v_head_dim_0", FA, V, r"v's head dim Dv = v.size\(-1\) must be in \[1, 256\], got 0",
        fa_args(v=lambda d: rand(d, 1, 2, 8, 0))),
    # flash_attn: seqlens
    Bad("seqlens_int64", FA, T, r"seqlens must be int32, got Long",
        lambda d: fa(d, seqlens=ints(d, [8], I64))),
    Bad("seqlens_shape", FA, V, r"seqlens must have shape \[B\] = \[1\]",
        lambda d: fa(d, seqlens=ints(d, [8, 8]))),
    Bad("seqlens_not_tensor", FA, T, r"seqlens must be a tensor or None",
        lambda d: fa(d, seqlens=[8])),
    Bad("seqlens_device", FA, R, r"seqlens must be on \S+, got meta",
        lambda d: fa(d, seqlens=ints(other(d), [8])), mixed=True),
    Bad("seqlens_negative", FA, V, r"seqlens\[0\] = -1 is out of range \[0, max\(Lq, Lk\) = 8\]",
        lambda d: fa(d, seqlens=ints(d, [-1])), values=True),
    Bad("seqlens_past_length", FA, V, r"seqlens\[0\] = 9 is out of range",
        lambda d: fa(d, seqlens=ints(d, [9])), values=True),
    # flash_attn: scalars
    Bad("causal_str", FA, T, r"causal must be a bool, got str 'no'", lambda d: fa(d, causal="no")),
    Bad("causal_int", FA, T, r"causal must be a bool, got int", lambda d: fa(d, causal=1)),
    Bad("deterministic_none", FA, T, r"deterministic must be a bool",
        lambda d: fa(d, deterministic=None)),
    Bad("return_lse_str", FA, T, r"return_lse must be a bool", lambda d: fa(d, return_lse="y")),
    Bad("window_scalar", FA, T, r"window must be a pair of ints", lambda d: fa(d, window=4)),
    Bad("window_float", FA, T, r"window must be a pair of ints", lambda d: fa(d, window=(1.5, 0))),
    Bad("window_bool", FA, T, r"window must be a pair of ints",
        lambda d: fa(d, window=(True, 0))),
    Bad("window_triple", FA, V, r"window must be a pair of ints", lambda d: fa(d, window=(1, 2, 3))),
    Bad("window_below_minus_one", FA, V, r"window entries must be >= 0 or -1",
        lambda d: fa(d, window=(-2, 0))),
    Bad("op_window_below_minus_one", FA, V, r"window must be \(left, right\).*got \(-3, 0\)",
        lambda d: torch.ops.adaattn.flash_fwd(*qkv(d), None, None, False, -3, 0)),
    Bad("op_window_int32", FA, V, r"window entries must fit in int32",
        lambda d: torch.ops.adaattn.flash_fwd(*qkv(d), None, None, False, 2 ** 31, 0)),
    Bad("scale_inf", FA, V, r"softmax_scale must be finite, got inf",
        lambda d: fa(d, softmax_scale=INF)),
    Bad("scale_nan", FA, V, r"softmax_scale must be finite, got nan",
        lambda d: fa(d, softmax_scale=NAN)),
    Bad("scale_str", FA, T, r"softmax_scale must be a float or None",
        lambda d: fa(d, softmax_scale="0.1")),
    Bad("softcap_negative", FA, V, r"softcap must be 0 \(off\) or a positive finite float32 "
        r"value, got -1", lambda d: fa(d, softcap=-1.0)),
    Bad("softcap_overflow", FA, V, r"softcap must be 0.*got 1e\+39",
        lambda d: fa(d, softcap=1e39)),
    Bad("softcap_underflow", FA, V, r"softcap must be 0.*got 1e-60",
        lambda d: fa(d, softcap=1e-60)),
    Bad("softcap_str", FA, T, r"softcap must be a float >= 0", lambda d: fa(d, softcap="1")),
    # flash backward op
    Bad("bwd_lse_dtype", FA, T, r"lse must be float32, got Double",
        lambda d: flash_bwd(d, lambda a: dict(lse=a["lse"].double()))),
    Bad("bwd_lse_shape", FA, V, r"lse must have shape \[B, Hq, Lq\] = \[1, 2, 8\]",
        lambda d: flash_bwd(d, lambda a: dict(lse=a["lse"][..., :4]))),
    Bad("bwd_lse_strided", FA, V, r"lse must be contiguous",
        lambda d: flash_bwd(d, lambda a: dict(lse=a["lse"].transpose(1, 2).contiguous()
                                              .transpose(1, 2)))),
    Bad("bwd_grad_out_shape", FA, V, r"grad_out and out must have q's shape",
        lambda d: flash_bwd(d, lambda a: dict(grad_out=a["grad_out"][:, :1]))),
    Bad("bwd_grad_out_dtype", FA, T, r"grad_out and out must have q's dtype Float",
        lambda d: flash_bwd(d, lambda a: dict(grad_out=a["grad_out"].double()))),
    # flash_attn_varlen
    Bad("varlen_dense_q", FV, V, r"\bq\b must have 3 dims \[T, H, D\]",
        lambda d: adaattn.flash_attn_varlen(rand(d, 1, 8, 2, 16), *packed(d)[1:],
                                            ints(d, [0, 8]), ints(d, [0, 8]))),
    Bad("cu_int64", FV, T, r"cu_seqlens_q must be int32, got Long",
        lambda d: varlen(d, cu_q=lambda d: ints(d, [0, 3, 8], I64))),
    Bad("cu_k_rank2", FV, V, r"cu_seqlens_k must have shape \[N \+ 1\]",
        lambda d: varlen(d, cu_k=lambda d: ints(d, [[0, 3, 8]]))),
    Bad("cu_empty", FV, V, r"cu_seqlens_q must have shape \[N \+ 1\]",
        lambda d: varlen(d, cu_q=lambda d: ints(d, []))),
    Bad("cu_strided", FV, V, r"cu_seqlens_q must be contiguous",
        lambda d: varlen(d, cu_q=lambda d: ints(d, [0, 9, 3, 9, 8])[::2])),
    Bad("cu_length_mismatch", FV, V, r"cu_seqlens_q and cu_seqlens_k must have the same length",
        lambda d: varlen(d, cu_k=lambda d: ints(d, [0, 8]))),
    Bad("cu_not_tensor", FV, T, r"cu_seqlens_k must be a tensor",
        lambda d: varlen(d, cu_k=lambda d: [0, 3, 8])),
    Bad("cu_device", FV, R, r"cu_seqlens_q must be on q's device \S+, got meta",
        lambda d: varlen(d, cu_q=lambda _: ints(other(d), [0, 3, 8])), mixed=True),
    Bad("cu_not_from_zero", FV, V, r"cu_seqlens_q must start at 0, got 1",
        lambda d: varlen(d, cu_q=lambda d: ints(d, [1, 3, 8])), values=True),
    Bad("cu_decreasing", FV, V, r"cu_seqlens_k must be non-decreasing, got 5 then 3 at index 2",
        lambda d: varlen(d, cu_q=lambda d: ints(d, [0, 1, 2, 8]),
                         cu_k=lambda d: ints(d, [0, 5, 3, 8])), values=True),
    Bad("cu_wrong_end", FV, V, r"cu_seqlens_q must end at the packed length 8, got 7",
        lambda d: varlen(d, cu_q=lambda d: ints(d, [0, 3, 7])), values=True),
    Bad("cu_q_only", FV, V, r"cu_seqlens_q and cu_seqlens_k must be given together",
        lambda d: torch.ops.adaattn.flash_attn(*packed(d), None, None, False, -1, -1, False,
                                               ints(d, [0, 8]), None)),
    Bad("cu_with_seqlens", FV, V, r"seqlens \(padded batches\) and cu_seqlens .*exclude",
        lambda d: torch.ops.adaattn.flash_attn(*packed(d), ints(d, [8]), None, False, -1, -1,
                                               False, ints(d, [0, 8]), ints(d, [0, 8]))),
    Bad("varlen_causal_str", FV, T, r"causal must be a bool", lambda d: varlen(d, causal="yes")),
    Bad("varlen_window", FV, V, r"window entries", lambda d: varlen(d, window=(0, -5))),
    # lazy_attn
    Bad("lazy_tau_float64", LA, T, r"tau must be float32, got Double",
        lambda d: lazy(d, tau=lambda d: torch.zeros(2, dtype=F64, device=d))),
    Bad("lazy_tau_shape", LA, V, r"tau must have shape \[Hq\] = \[2\], got \[3\]",
        lambda d: lazy(d, tau=lambda d: torch.zeros(3, device=d))),
    Bad("lazy_tau_strided", LA, V, r"tau must be contiguous",
        lambda d: lazy(d, tau=lambda d: torch.zeros(4, device=d)[::2])),
    Bad("lazy_tau_not_tensor", LA, T, r"tau must be a tensor", lambda d: lazy(d, tau=lambda d: 0.1)),
    Bad("lazy_bias_integer", LA, T, r"bias must be float32, got Int",
        lambda d: lazy(d, bias=lambda d: ints(d, [[0] * 4] * 2))),
    Bad("lazy_bias_empty_window", LA, V, r"bias must have shape \[Hq, W\] = \[2, W\] with W >= 1",
        lambda d: lazy(d, bias=lambda d: torch.zeros(2, 0, device=d))),
    Bad("lazy_bias_heads", LA, V, r"bias must have shape \[Hq, W\]",
        lambda d: lazy(d, bias=lambda d: torch.zeros(3, 4, device=d))),
    Bad("lazy_bias_strided", LA, V, r"bias must be contiguous",
        lambda d: lazy(d, bias=lambda d: torch.zeros(4, 2, device=d).t())),
    Bad("lazy_bias_device", LA, R, r"bias must be on q's device \S+, got meta",
        lambda d: lazy(d, bias=lambda _: torch.zeros(2, 4, device=other(d))), mixed=True),
    Bad("lazy_dv", LA, V, r"lazy attention needs v with q's head dim \(Dv == D\), got 8 and 16",
        lambda d: lazy(d, v=lambda d: rand(d, 1, 2, 8, 8))),
    Bad("lazy_lq_gt_lk", LA, V, r"Lq <= Lk.*Lq = q.size\(2\) = 9 > Lk = k.size\(2\) = 8",
        lambda d: lazy(d, q=lambda d: rand(d, 1, 2, 9, 16))),
    Bad("lazy_q_integer", LA, T, r"\bq\b must be a floating tensor",
        lambda d: lazy(d, q=lambda d: torch.zeros(1, 2, 8, 16, dtype=I64, device=d))),
    Bad("lazy_scale_nan", LA, V, r"softmax_scale must be finite",
        lambda d: lazy(d, softmax_scale=NAN)),
    Bad("lazy_return_stats_str", LA, T, r"return_stats must be a bool",
        lambda d: lazy(d, return_stats="y")),
    Bad("lazy_return_lse_int", LA, T, r"return_lse must be a bool",
        lambda d: lazy(d, return_lse=0)),
    Bad("lazy_seqlens_past_length", LA, V, r"seqlens\[0\] = 10 is out of range",
        lambda d: lazy(d, seqlens=ints(d, [10])), values=True),
    # lazy_attn_varlen
    Bad("lazy_varlen_rows", LV, V, r"same number of rows T, got q.size\(0\) = 9, k.size\(0\) = 8",
        lambda d: lazy_varlen(d, q=lambda d: rand(d, 9, 2, 16))),
    Bad("lazy_varlen_cu_int64", LV, T, r"\bcu_seqlens must be int32",
        lambda d: lazy_varlen(d, cu=lambda d: ints(d, [0, 3, 8], I64))),
    Bad("lazy_varlen_cu_end", LV, V, r"\bcu_seqlens must end at the packed length 8, got 6",
        lambda d: lazy_varlen(d, cu=lambda d: ints(d, [0, 3, 6])), values=True),
    Bad("lazy_varlen_return_lse", LV, T, r"return_lse must be a bool",
        lambda d: lazy_varlen(d, return_lse="no")),
    # block_sparse_attn
    Bad("sparse_mask_not_mask", BS, T, r"block_mask must be an adaattn.BlockSparseMask, got Tensor",
        lambda d: sparse(d, m=lambda d: torch.ones(1, 1, 1, 1, dtype=torch.bool, device=d))),
    Bad("sparse_mask_grid", BS, V, r"block_mask has 1 x 1 blocks of 64x64",
        lambda d: sparse(d, m=lambda d: mask(d, block=64))),
    Bad("sparse_q_integer", BS, T, r"\bq\b must be a floating tensor",
        lambda d: sparse(d, q=lambda d: torch.zeros(1, 2, 100, 16, dtype=I32, device=d))),
    Bad("sparse_heads", BS, V, r"multiple of the number of kv heads",
        lambda d: sparse(d, q=lambda d: rand(d, 1, 3, 100, 16))),
    Bad("sparse_causal_str", BS, T, r"causal must be a bool", lambda d: sparse(d, causal="no")),
    Bad("sparse_bwd_mode_unknown", BS, V, r"bwd_mode must be one of 'auto', 'atomic', 'two_pass'",
        lambda d: sparse(d, bwd_mode="fast")),
    Bad("sparse_bwd_mode_none", BS, T, r"bwd_mode must be a str",
        lambda d: sparse(d, bwd_mode=None)),
    Bad("sparse_deterministic_atomic", BS, V, r"deterministic=True contradicts bwd_mode='atomic'",
        lambda d: sparse(d, deterministic=True, bwd_mode="atomic")),
    Bad("sparse_softcap", BS, V, r"softcap must be 0", lambda d: sparse(d, softcap=-2.0)),
    Bad("sparse_op_block_m", BS, V, r"block_m must be 64 or 128, got 32",
        lambda d: sparse_op(d, block_m=32)),
    Bad("sparse_op_num_int64", BS, T, r"kv_num_blocks must be int32, got Long",
        lambda d: sparse_op(d, num=lambda d: ints(d, [[[1]]], I64))),
    Bad("sparse_op_num_shape", BS, V, r"kv_num_blocks must have shape \[B or 1, Hq or 1, nQ",
        lambda d: sparse_op(d, num=lambda d: ints(d, [[[1, 1]]]))),
    Bad("sparse_op_idx_shape", BS, V, r"kv_indices must have shape \[1, 1, nQ = ceil",
        lambda d: sparse_op(d, idx=lambda d: ints(d, [[[[0, 0]]]]))),
    Bad("sparse_op_idx_device", BS, R, r"kv_indices must be on q's device \S+, got meta",
        lambda d: sparse_op(d, idx=lambda _: ints(other(d), [[[[0]]]])), mixed=True),
    Bad("sparse_count_high", BS, V, r"kv_num_blocks\[0, 0, 0\] = 2 is out of range \[0, 1\]",
        lambda d: sparse_op(d, num=lambda d: ints(d, [[[2]]])), values=True),
    Bad("sparse_index_negative", BS, V, r"kv_indices\[0, 0, 0, 0\] = -1 is out of range",
        lambda d: sparse_op(d, idx=lambda d: ints(d, [[[[-1]]]])), values=True),
    Bad("sparse_index_twice", BS, V, r"kv_indices\[0, 0, 0\] lists block 0 twice",
        lambda d: torch.ops.adaattn.block_sparse_fwd(
            *qkv(d, lq=100, lk=200), ints(d, [[[2]]]), ints(d, [[[[0, 0]]]]), 128, 128, None,
            False), values=True),
    Bad("mask_num_int64", "BlockSparseMask", T, r"kv_num_blocks must be int32",
        lambda d: adaattn.BlockSparseMask(ints(d, [[[1]]], I64), ints(d, [[[[0]]]]))),
    Bad("mask_idx_rank", "BlockSparseMask", V, r"kv_indices must have 4 dims",
        lambda d: adaattn.BlockSparseMask(ints(d, [[[1]]]), ints(d, [[[0]]]))),
    Bad("mask_idx_leading", "BlockSparseMask", V, r"kv_indices .* must start with kv_num_blocks'",
        lambda d: adaattn.BlockSparseMask(ints(d, [[[1]]]), ints(d, [[[[0]], [[0]]]]))),
    Bad("mask_block_32", "BlockSparseMask", V, r"block_size entries must be 64 or 128, got \(32",
        lambda d: mask(d, block=32)),
    Bad("mask_block_str", "BlockSparseMask", T, r"block_size must be an int or a pair of ints",
        lambda d: mask(d, block="64")),
    Bad("mask_causal_str", "BlockSparseMask", T, r"causal must be a bool",
        lambda d: adaattn.BlockSparseMask(ints(d, [[[1]]]), ints(d, [[[[0]]]]), causal="y")),
    Bad("mask_layout_int", "BlockSparseMask.from_dense", T, r"layout must be a bool tensor",
        lambda d: adaattn.BlockSparseMask.from_dense(ints(d, [[[[1]]]]))),
    Bad("mask_layout_rank", "BlockSparseMask.from_dense", V, r"layout must have 4 dims",
        lambda d: adaattn.BlockSparseMask.from_dense(torch.ones(1, 1, 1, dtype=torch.bool,
                                                                device=d))),
    # linear_attn
    Bad("linear_feature_map", LIN, V, r"feature_map must be one of 'elu', 'relu', 'identity', got "
        r"'softmax'", lambda d: linear(d, feature_map="softmax")),
    Bad("linear_feature_map_type", LIN, T, r"feature_map must be a str, got int",
        lambda d: linear(d, feature_map=3)),
    Bad("linear_causal_str", LIN, T, r"causal must be a bool", lambda d: linear(d, causal="yes")),
    Bad("linear_normalize_none", LIN, T, r"normalize must be a bool",
        lambda d: linear(d, normalize=None)),
    Bad("linear_return_state_int", LIN, T, r"return_state must be a bool",
        lambda d: linear(d, return_state=1)),
    Bad("linear_k_shape", LIN, V, r"\bk\b must have q's shape",
        lambda d: linear(d, k=lambda d: rand(d, 1, 1, 8, 16))),
    Bad("linear_v_shape", LIN, V, r"\bv\b must have q's shape except for its last dim",
        lambda d: linear(d, v=lambda d: rand(d, 1, 2, 7, 16))),
    Bad("linear_q_integer", LIN, T, r"\bq\b must be a floating tensor",
        lambda d: linear(d, q=lambda d: torch.zeros(1, 2, 8, 16, dtype=I32, device=d))),
    Bad("linear_dtype_mix", LIN, T, r"q, k and v must have the same dtype",
        lambda d: linear(d, v=lambda d: rand(d, 1, 2, 8, 16, dtype=F64))),
    Bad("linear_device_mix", LIN, R, r"same device.*k on meta",
        lambda d: linear(d, k=lambda _: rand(other(d), 1, 2, 8, 16)), mixed=True),
    Bad("linear_head_dim", LIN, V, r"head dim D = q.size\(-1\) must be in \[1, 256\], got 300",
        lambda d: adaattn.linear_attn(*(rand(d, 1, 1, 4, 300) for _ in range(3)))),
    Bad("linear_state_dtype", LIN, T, r"initial_state must be a Float tensor.*got Double",
        lambda d: linear(d, initial_state=rand(d, 1, 2, 16, 17, dtype=F64))),
    Bad("linear_state_shape", LIN, V, r"initial_state must be a Float tensor of shape "
        r"\[N, H, D, Dv \+ 1\] = \[1, 2, 16, 17\]",
        lambda d: linear(d, initial_state=rand(d, 1, 2, 16, 16))),
    Bad("linear_state_device", LIN, R, r"initial_state must be on q's device",
        lambda d: linear(d, initial_state=rand(other(d), 1, 2, 16, 17)), mixed=True),
    Bad("linear_cu_int64", LIN, T, r"cu_seqlens must be int32",
        lambda d: linear_packed(d, lambda d: ints(d, [0, 8], I64))),
    Bad("linear_cu_values", LIN, V, r"cu_seqlens must be non-decreasing",
        lambda d: linear_packed(d, lambda d: ints(d, [0, 5, 3, 8])), values=True),
    Bad("linear_cu_end", LIN, V, r"cu_seqlens must end at T = q.size\(0\) = 8, got 7",
        lambda d: linear_packed(d, lambda d: ints(d, [0, 7])), values=True),
    # low_rank_attn
    Bad("low_rank_rank0", LR, V, r"basis must have rank R = basis.size\(3\) >= 1, got 0",
        lambda d: low_rank(d, basis=lambda d: rand(d, 1, 2, 16, 0))),
    Bad("low_rank_basis_shape", LR, V, r"basis must be \[B, Hkv, D, R\] = \[1, 2, 16, R\]",
        lambda d: low_rank(d, basis=lambda d: rand(d, 1, 2, 8, 4))),
    Bad("low_rank_basis_dtype", LR, T, r"basis must be float32 or q's dtype Float, got Int",
        lambda d: low_rank(d, basis=lambda d: torch.zeros(1, 2, 16, 4, dtype=I32, device=d))),
    Bad("low_rank_basis_device", LR, R, r"basis must be on q's device",
        lambda d: low_rank(d, basis=lambda _: rand(other(d), 1, 2, 16, 4)), mixed=True),
    Bad("low_rank_q_rank", LR, V, r"\bq\b must have 4 dims",
        lambda d: low_rank(d, q=lambda d: rand(d, 2, 8, 16))),
    Bad("low_rank_causal_str", LR, T, r"causal must be a bool",
        lambda d: low_rank(d, causal="no")),
    Bad("low_rank_scale_inf", LR, V, r"softmax_scale must be finite",
        lambda d: low_rank(d, softmax_scale=INF)),
    # rank_plan, adaptive_rank_attn, rank_error_bound
    Bad("plan_nan", "rank_plan", V, r"q and k must be finite",
        lambda d: plan(d, q=lambda d: rand(d, 1, 2, 8, 32) * NAN), values=True),
    Bad("plan_inf", "rank_plan", V, r"q and k must be finite",
        lambda d: plan(d, k=lambda d: rand(d, 1, 2, 8, 32).index_fill(2, ints(d, [3], I64), INF)),
        values=True),
    Bad("plan_overflow", "rank_plan", V, r"q and k must be finite",
        lambda d: plan(d, k=lambda d: rand(d, 1, 2, 8, 32) * 1e30), values=True),
    Bad("plan_energy_zero", "rank_plan", V, r"energy must be in \(0, 1\], got 0",
        lambda d: plan(d, energy=0.0)),
    Bad("plan_energy_str", "rank_plan", T, r"energy must be a float",
        lambda d: plan(d, energy="high")),
    Bad("plan_min_rank_zero", "rank_plan", V, r"min_rank and multiple must be positive",
        lambda d: plan(d, min_rank=0)),
    Bad("plan_multiple_float", "rank_plan", T, r"multiple must be an int",
        lambda d: plan(d, multiple=16.0)),
    Bad("plan_q_rank", "rank_plan", V, r"q and k must be \[B, H, L, D\]",
        lambda d: plan(d, q=lambda d: rand(d, 2, 8, 32))),
    Bad("plan_heads", "rank_plan", V, r"q's heads \(3\) must be a multiple of k's \(2\)",
        lambda d: plan(d, q=lambda d: rand(d, 1, 3, 8, 32))),
    Bad("plan_device_mix", "rank_plan", R, r"q and k must be on one device",
        lambda d: plan(d, k=lambda _: rand(other(d), 1, 2, 8, 32)), mixed=True),
    Bad("adaptive_nan", "adaptive_rank_attn", V, r"q and k must be finite",
        lambda d: adaptive(d, q=lambda d: rand(d, 1, 2, 8, 32) * NAN, energy=0.5), values=True),
    Bad("adaptive_causal_str", "adaptive_rank_attn", T, r"causal must be a bool",
        lambda d: adaptive(d, causal="no")),
    Bad("adaptive_v_dtype", "adaptive_rank_attn", T, r"q, k and v must have the same dtype",
        lambda d: adaptive(d, v=lambda d: rand(d, 1, 2, 8, 32, dtype=F64))),
    Bad("adaptive_return_plan_str", "adaptive_rank_attn", T, r"return_plan must be a bool",
        lambda d: adaptive(d, return_plan="y")),
    Bad("error_bound_basis", "rank_error_bound", V, r"basis must be \[B, Hkv, D, R\]",
        lambda d: adaattn.rank_error_bound(*qkv(d), rand(d, 1, 2, 15, 4))),
    # flash_attn_with_kvcache
    Bad("kv_q_rank", KV, V, r"\bq\b must have 4 dims \[B, Hq, Lq, D\]",
        lambda d: decode(d, lambda d, a: dict(q=a["q"][0]))),
    Bad("kv_q_integer", KV, T, r"\bq\b must be a floating tensor",
        lambda d: decode(d, lambda d, a: dict(q=torch.zeros(2, 4, 1, 16, dtype=I32, device=d)))),
    Bad("kv_k_cache_dtype", KV, T, r"k_cache must have q's dtype Float, got Double",
        lambda d: decode(d, lambda d, a: dict(k_cache=a["k_cache"].double()))),
    Bad("kv_v_cache_rank", KV, V, r"v_cache must have 4 dims",
        lambda d: decode(d, lambda d, a: dict(v_cache=a["v_cache"][0]))),
    Bad("kv_k_cache_strided", KV, V, r"k_cache must have a contiguous last dim",
        lambda d: decode(d, lambda d, a: dict(k_cache=rand(d, 2, 2, 32, 32)[..., ::2]))),
    Bad("kv_cache_device", KV, R, r"v_cache must be on q's device",
        lambda d: decode(d, lambda _, a: dict(v_cache=a["v_cache"].to(other(d)))), mixed=True),
    Bad("kv_caches_disagree", KV, V, r"k_cache and v_cache must agree",
        lambda d: decode(d, lambda d, a: dict(v_cache=a["v_cache"][:, :, :16]))),
    Bad("kv_heads", KV, V, r"kv heads \(k_cache.size\(1\) = 3\)",
        lambda d: decode(d, lambda d, a: dict(k_cache=rand(d, 2, 3, 32, 16),
                                              v_cache=rand(d, 2, 3, 32, 16)))),
    Bad("kv_batch", KV, V, r"k_cache must have q's batch size 2",
        lambda d: decode(d, lambda d, a: dict(k_cache=a["k_cache"][:1],
                                              v_cache=a["v_cache"][:1]))),
    Bad("kv_seqlens_int64", KV, T, r"cache_seqlens must be int32, got Long",
        lambda d: decode(d, cache_seqlens=ints(d, [5, 29], I64))),
    Bad("kv_seqlens_shape", KV, V, r"cache_seqlens must have shape \[B\] = \[2\]",
        lambda d: decode(d, cache_seqlens=ints(d, [5]))),
    Bad("kv_seqlens_missing", KV, T, r"cache_seqlens must be a tensor",
        lambda d: decode(d, cache_seqlens=None)),
    Bad("kv_seqlens_past_cache", KV, V, r"cache_seqlens\[1\] = 32 leaves no room",
        lambda d: decode(d, cache_seqlens=ints(d, [5, 32])), values=True),
    Bad("kv_seqlens_negative", KV, V, r"cache_seqlens\[0\] = -1",
        lambda d: decode(d, cache_seqlens=ints(d, [-1, 3])), values=True),
    Bad("kv_k_without_v", KV, V, r"the new keys k and values v must be given together",
        lambda d: decode(d, lambda d, a: dict(v=None))),
    Bad("kv_k_shape", KV, V, r"k \(new keys\) must have shape \[B, Hkv, Lq, D\]",
        lambda d: decode(d, lambda d, a: dict(k=a["k"][:, :1]))),
    Bad("kv_num_splits_negative", KV, V, r"num_splits must be >= 0 \(0 = automatic\), got -1",
        lambda d: decode(d, num_splits=-1)),
    Bad("kv_num_splits_float", KV, T, r"num_splits must be an int",
        lambda d: decode(d, num_splits=1.5)),
    Bad("kv_causal_str", KV, T, r"causal must be a bool", lambda d: decode(d, causal="no")),
    Bad("kv_window", KV, V, r"window entries", lambda d: decode(d, window=(-3, 0))),
    Bad("kv_block_table_int64", KV, T, r"block_table must be int32",
        lambda d: paged(d, lambda d: ints(d, [[0, 1, 2, 3], [4, 5, 6, 7]], I64))),
    Bad("kv_block_table_batch", KV, V, r"block_table must have shape \[B, max_pages\] with B = 2",
        lambda d: paged(d, lambda d: ints(d, [[0, 1, 2, 3]]))),
    Bad("kv_block_table_entry", KV, V, r"block_table\[1, 0\] = 8 is out of range \[0, "
        r"num_pages = 8\)", lambda d: paged(d, lambda d: ints(d, [[0, 1, 2, 3], [8, 5, 6, 7]])),
        values=True),
    Bad("kv_alibi_shape", KV, V, r"alibi_slopes must have shape \[Hq\] = \[4\] or \[B, Hq\]",
        lambda d: decode(d, alibi_slopes=torch.zeros(3, device=d))),
    Bad("kv_sinks_dtype", KV, T, r"sinks must be float32, got Double",
        lambda d: decode(d, sinks=torch.zeros(4, dtype=F64, device=d))),
    Bad("kv_rel_bias_shape", KV, V, r"rel_bias must have shape \[Hq, W\]",
        lambda d: decode(d, rel_bias=torch.zeros(2, 8, device=d))),
    Bad("kv_sinks_list", KV, T, r"sinks must be a tensor",
        lambda d: decode(d, sinks=[0.0] * 4)),
    # lazy_attn_with_kvcache
    Bad("lkv_tau_shape", LKV, V, r"tau must have shape \[Hq\] = \[4\]",
        lambda d: decode(d, lazy_op=True, tau=torch.zeros(2, device=d))),
    Bad("lkv_bias_dtype", LKV, T, r"bias must be float32, got Double",
        lambda d: decode(d, lazy_op=True, bias=torch.zeros(4, 4, dtype=F64, device=d))),
    Bad("lkv_dv", LKV, V, r"lazy attention needs v_cache with q's head dim",
        lambda d: decode(d, lambda d, a: dict(v_cache=rand(d, 2, 2, 32, 8),
                                              v=rand(d, 2, 2, 1, 8)), lazy_op=True)),
    Bad("lkv_num_splits_str", LKV, T, r"num_splits must be an int",
        lambda d: decode(d, lazy_op=True, num_splits="2")),
    Bad("lkv_return_lse_str", LKV, T, r"return_lse must be a bool",
        lambda d: decode(d, lazy_op=True, return_lse="yes")),
    # nn modules and the KV cache helper
    Bad("nn_flash_embed_divisible", "nn.FlashSelfAttention", V,
        r"embed_dim \(30\) must be divisible by num_heads \(4\)",
        lambda d: FlashSelfAttention(30, 4)),
    Bad("nn_flash_heads_zero", "nn.FlashSelfAttention", V, r"num_heads must be positive",
        lambda d: FlashSelfAttention(32, 0)),
    Bad("nn_flash_kv_heads", "nn.FlashSelfAttention", V,
        r"num_heads \(8\) must be a multiple of num_kv_heads \(3\)",
        lambda d: FlashSelfAttention(64, 8, 3)),
    Bad("nn_flash_causal_str", "nn.FlashSelfAttention", T, r"causal must be a bool",
        lambda d: FlashSelfAttention(32, 4, causal="no")),
    Bad("nn_flash_window_float", "nn.FlashSelfAttention", T, r"window must be a pair of ints",
        lambda d: FlashSelfAttention(32, 4, window=(0.5, 1))),
    Bad("nn_flash_embed_float", "nn.FlashSelfAttention", T, r"embed_dim must be an int",
        lambda d: FlashSelfAttention(32.0, 4)),
    Bad("nn_flash_packed_x", "nn.FlashSelfAttention", V, r"packed input is x \[T, E\]",
        lambda d: FlashSelfAttention(32, 4).to(d)(rand(d, 1, 8, 32),
                                                  cu_seqlens=ints(d, [0, 8])), module=True),
    Bad("nn_lazy_heads_zero", "nn.LazyAttention", V, r"num_heads must be positive",
        lambda d: LazyAttention(0)),
    Bad("nn_lazy_window_float", "nn.LazyAttention", T, r"window must be an int",
        lambda d: LazyAttention(4, window=1.5)),
    Bad("nn_lazy_tau_init_str", "nn.LazyAttention", T, r"tau_init must be a float",
        lambda d: LazyAttention(4, tau_init="x")),
    Bad("nn_lazy_q_heads", "nn.LazyAttention", V, r"q must be \[B, 4, Lq, D\]",
        lambda d: LazyAttention(4).to(d)(*qkv(d)), module=True),
    Bad("nn_lazy_seqlens_and_cu", "nn.LazyAttention", V, r"seqlens .* and cu_seqlens .* exclude",
        lambda d: LazyAttention(2).to(d)(*packed(d), seqlens=ints(d, [8]),
                                         cu_seqlens=ints(d, [0, 8])), module=True),
    Bad("nn_linear_feature_map", "nn.LinearAttention", V, r"feature_map must be one of",
        lambda d: LinearAttention("softmax")),
    Bad("nn_linear_feature_map_type", "nn.LinearAttention", T, r"feature_map must be a str",
        lambda d: LinearAttention(None)),
    Bad("nn_linear_causal_int", "nn.LinearAttention", T, r"causal must be a bool",
        lambda d: LinearAttention(causal=1)),
    Bad("kvcache_page_size", "KVCache", V, r"page_size must be positive",
        lambda d: adaattn.KVCache(4, 0, 2, 16, max_batch=2, max_pages_per_seq=2, device=d)),
    Bad("kvcache_num_pages_float", "KVCache", T, r"num_pages must be an int",
        lambda d: adaattn.KVCache(4.0, 8, 2, 16, max_batch=2, max_pages_per_seq=2, device=d)),
    # linear-algebra ops
    Bad("sym_eig_double", "sym_eig", T, r"a must be float32, got Double",
        lambda d: torch.ops.adaattn.sym_eig(torch.eye(4, dtype=F64, device=d)[None])),
    Bad("sym_eig_square", "sym_eig", V, r"a must be square",
        lambda d: torch.ops.adaattn.sym_eig(torch.zeros(2, 4, 5, device=d))),
    Bad("sym_eig_top_energy", "sym_eig_top", V, r"energy must be in \(0, 1\], got 2",
        lambda d: torch.ops.adaattn.sym_eig_top(torch.eye(4, device=d)[None], 2.0, 16, 16)),
    Bad("sketch_width", "sym_sketch_top", V, r"P = omega.size\(1\) must be in \[1, min\(D, 64\)\]",
        lambda d: torch.ops.adaattn.sym_sketch_top(torch.eye(4, device=d)[None],
                                                   torch.zeros(4, 5, device=d), 0.9, 1, 1, 1,
                                                   0, 1e-3)),
    Bad("sketch_iters", "sym_sketch_top", V, r"power_iters must be in \[0, 8\], got -1",
        lambda d: torch.ops.adaattn.sym_sketch_top(torch.eye(4, device=d)[None],
                                                   torch.zeros(4, 2, device=d), 0.9, 1, 1, -1,
                                                   0, 1e-3)),
    Bad("gram_float32", "sym_gram", T, r"q must be float16 or bfloat16, got Float",
        lambda d: gram(rand(d, 2, 4, 8), rand(d, 2, 4, 8))),
    Bad("gram_dim", "sym_gram", V, r"D = q.size\(2\) must be a multiple of 8 in \[8, 128\], got 12",
        lambda d: gram(rand(d, 2, 4, 12, dtype=BF16), rand(d, 2, 4, 12, dtype=BF16))),
    Bad("gram_batch", "sym_gram", V, r"must agree in N and D",
        lambda d: gram(rand(d, 2, 4, 8, dtype=BF16), rand(d, 3, 4, 8, dtype=BF16))),
    Bad("gram_k_dtype", "sym_gram", T, r"k must have q's dtype",
        lambda d: gram(rand(d, 2, 4, 8, dtype=BF16), rand(d, 2, 4, 8, dtype=F16))),
    Bad("gram_row_stride", "sym_gram", V, r"k must have row and batch strides that are multiples",
        lambda d: gram(rand(d, 2, 4, 8, dtype=BF16), rand(d, 2, 4, 12, dtype=BF16)[..., :8])),
    Bad("cholesky_shift", "shifted_cholesky_info", V, r"rel_shift must be finite, got inf",
        lambda d: torch.ops.adaattn.shifted_cholesky_info(torch.eye(4, device=d)[None], INF)),
]


def _raised(call, *args):
    try:
        call(*args)
    except Exception as e:  # noqa: BLE001 - the test compares whatever was raised
        return e
    return None


@pytest.mark.parametrize("case", BAD, ids=lambda c: c.name)
def test_bad_input(case, device, monkeypatch):
    """The exception class of the policy, a message starting adaattn.<op>: that names the
    argument. CUDA checks values only on request (a device sync): the cases ask for it."""
    if case.values:
        monkeypatch.setenv("ADAATTN_CHECK_INPUTS", "1")
    error = _raised(case.call, device)
    assert type(error) is case.error, f"{type(error).__name__}: {error}"
    message = str(error)
    assert message.startswith(f"adaattn.{case.op}: "), message
    assert re.search(case.match, message), message


FAKE_CASES = [c for c in BAD if not c.values and not c.mixed]


@pytest.mark.parametrize("case", FAKE_CASES, ids=lambda c: c.name)
def test_bad_input_meta_raises_the_same(case):
    """On meta tensors the fake (Meta) kernels raise what the CPU kernels raise."""
    real, fake = _raised(case.call, "cpu"), _raised(case.call, "meta")
    assert type(fake) is type(real) and str(fake) == str(real), (real, fake)


@pytest.mark.parametrize("case", [c for c in FAKE_CASES if not c.module], ids=lambda c: c.name)
def test_bad_input_fake_mode_raises_the_same(case):
    """Under FakeTensorMode (torch.compile's tracing) the fake kernels raise what the CPU kernels
    raise."""
    real = _raised(case.call, "cpu")
    with FakeTensorMode():
        fake = _raised(case.call, "cpu")
    assert type(fake) is type(real) and str(fake) == str(real), (real, fake)


@pytest.mark.parametrize("name", ["heads_not_multiple", "seqlens_int64", "lazy_tau_shape",
                                  "linear_state_shape", "sparse_op_num_shape"])
def test_bad_input_compiled(name):
    """Compiled code reports the same error while tracing (fullgraph)."""
    case = next(c for c in BAD if c.name == name)
    torch._dynamo.reset()
    error = _raised(torch.compile(case.call, backend="aot_eager", fullgraph=True), "cpu")
    assert error is not None and f"adaattn.{case.op}: " in str(error), error
    assert re.search(case.match, str(error)), error


# ---- Legal edge inputs -----------------------------------------------------------------------

def _close(a, b, tol=1e-6):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol, equal_nan=True)


def _nan_rows(x):
    return torch.isnan(x).any(-1)


def good_flash(dev, b=1, hq=2, hkv=2, lq=8, lk=8, d=16, dv=None, dtype=F64, **kw):
    q, k, v = qkv(dev, b, hq, hkv, lq, lk, d, dv, dtype)
    out, lse = adaattn.flash_attn(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = reference.flash_attn(q, k, v, **kw)
    _close(out, ref_out)
    _close(lse, ref_lse)


def good_empty_batch(dev):
    q, k, v = qkv(dev, b=0)
    out, lse = adaattn.flash_attn(q, k, v, return_lse=True)
    assert out.shape == (0, 2, 8, 16) and lse.shape == (0, 2, 8)


def good_no_keys(dev):
    q, k, v = qkv(dev, lk=0)
    out, lse = adaattn.flash_attn(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -INF).all())


def good_seqlens(dev, values):
    q, k, v = qkv(dev, b=len(values), dtype=F64)
    seqlens = ints(dev, values)
    out, lse = adaattn.flash_attn(q, k, v, seqlens=seqlens, return_lse=True)
    ref_out, ref_lse = reference.flash_attn(q, k, v, seqlens=seqlens)
    _close(out, ref_out)
    _close(lse, ref_lse)


def good_varlen(dev, bounds_q, bounds_k, causal=False):
    tq, tk = bounds_q[-1], bounds_k[-1]
    q, k, v = rand(dev, tq, 2, 16, dtype=F64), rand(dev, tk, 2, 16, dtype=F64), \
        rand(dev, tk, 2, 16, dtype=F64)
    cu_q, cu_k = ints(dev, bounds_q), ints(dev, bounds_k)
    out, lse = adaattn.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
    ref_out, ref_lse = reference.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=causal)
    _close(out, ref_out)
    _close(lse, ref_lse)


def good_nan_flash(dev, where, value, causal=False):
    q, k, v = qkv(dev, dtype=F64)
    dict(q=q, k=k, v=v)[where][0, 0, 3, 2] = value
    out, lse = adaattn.flash_attn(q, k, v, causal=causal, return_lse=True)
    ref_out, ref_lse = reference.flash_attn(q, k, v, causal=causal)
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse))
    assert torch.equal(_nan_rows(out), _nan_rows(ref_out))
    assert _nan_rows(out).any() or value == -INF


def good_nan_varlen(dev):
    q, k, v = packed(dev)
    k[5, 0, 3] = NAN  # sequence 1 (rows 3..7), kv head 0
    cu = ints(dev, [0, 3, 8])
    out = adaattn.flash_attn_varlen(q, k, v, cu, cu)
    assert not torch.isnan(out[:3]).any() and torch.isnan(out[3:, 0]).all()
    assert not torch.isnan(out[:, 1]).any()


def good_lazy(dev, lq=8, lk=8, seqlens=None):
    q, k, v = qkv(dev, lq=lq, lk=lk, dtype=F64)
    tau, bias = torch.tensor([-0.5, 0.2], device=dev), 0.1 * torch.randn(2, 4, device=dev)
    out, lse = adaattn.lazy_attn(q, k, v, tau, bias, seqlens=seqlens, return_lse=True)
    ref_out, ref_lse = reference.lazy_attn(q, k, v, tau, bias, seqlens=seqlens)
    _close(out, ref_out)
    _close(lse, ref_lse)


def good_nan_lazy(dev):
    q, k, v = qkv(dev, dtype=F64)
    q[0, 1, 5, 0] = NAN
    out = adaattn.lazy_attn(q, k, v, *lazy_params(dev))
    rows = _nan_rows(out)
    assert rows[0, 1, 5] and rows.sum() == 1


def good_sparse_empty(dev):
    q, k, v = qkv(dev, lq=100, lk=100)
    m = adaattn.BlockSparseMask.from_dense(torch.zeros(1, 1, 1, 1, dtype=torch.bool,
                                                       device=dev))
    out, lse = adaattn.block_sparse_attn(q, k, v, m, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -INF).all())


def good_sparse_full(dev, causal):
    q, k, v = qkv(dev, lq=100, lk=100, dtype=F64)
    out = adaattn.block_sparse_attn(q, k, v, mask(dev), causal=causal)
    _close(out, adaattn.flash_attn(q, k, v, causal=causal))


def good_sparse_nan_unlisted(dev):
    q, k, v = qkv(dev, lq=256, lk=256)
    layout = torch.tensor([[True, False], [False, True]], device=dev).view(1, 1, 2, 2)
    k[0, :, 200] = NAN
    out = adaattn.block_sparse_attn(q, k, v, adaattn.BlockSparseMask.from_dense(layout))
    assert torch.isfinite(out[:, :, :128]).all() and torch.isnan(out[:, :, 128:]).all()


def good_linear(dev, bounds):
    t = bounds[-1]
    q, k, v = (rand(dev, t, 2, 16, dtype=F64) for _ in range(3))
    cu = ints(dev, bounds)
    out, state = adaattn.linear_attn(q, k, v, cu_seqlens=cu, return_state=True)
    ref_out, ref_state = reference.linear_attn(q, k, v, cu_seqlens=cu)
    _close(out, ref_out)
    _close(state, ref_state)


def good_linear_nan(dev):
    """A NaN value reaches the outputs of the rows at or after it (causal), in its column: the
    reference's masked product also puts it in the earlier rows (0 * NaN)."""
    q, k, v = (rand(dev, 1, 2, 8, 16, dtype=F64) for _ in range(3))
    v[0, 0, 3, 1] = NAN
    out = adaattn.linear_attn(q, k, v)
    expected = torch.zeros_like(out, dtype=torch.bool)
    expected[0, 0, 3:, 1] = True
    assert torch.equal(torch.isnan(out), expected)


def good_low_rank(dev, rank):
    q, k, v = qkv(dev, dtype=F64)
    basis = torch.linalg.qr(rand(dev, 1, 2, 16, 16, dtype=F64))[0][..., :rank]
    out, lse = adaattn.low_rank_attn(q, k, v, basis, causal=True, return_lse=True)
    ref_out, ref_lse = reference.low_rank_attn(q, k, v, basis, causal=True)
    _close(out, ref_out)
    _close(lse, ref_lse)


def good_plan_full(dev):
    q, k, _ = qkv(dev, d=32)
    p = adaattn.rank_plan(q, k, energy=1.0)
    assert bool((p.ranks == 32).all()) and p.basis.shape == (1, 2, 32, 32)


def good_adaptive_energy_one(dev):
    q, k, v = qkv(dev, d=32, dtype=F64)
    _close(adaattn.adaptive_rank_attn(q, k, v, energy=1.0), adaattn.flash_attn(q, k, v))


def good_decode(dev, lazy_op, values):
    q, k_cache, v_cache, k, v, _ = cache(dev, dtype=F64)
    lens = ints(dev, values)
    kw = dict(cache_seqlens=lens, return_lse=True)
    if lazy_op:
        tau, bias = lazy_params(dev, h=4)
        out, lse = adaattn.lazy_attn_with_kvcache(q, k_cache, v_cache, k, v, tau, bias, **kw)
        ref_out, ref_lse = reference.lazy_attn_with_kvcache(q, k_cache, v_cache, k, v, tau, bias,
                                                            **kw)
    else:
        out, lse = adaattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
        ref_out, ref_lse = reference.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
    _close(out, ref_out)
    _close(lse, ref_lse)


def good_decode_nan(dev, where):
    q, k_cache, v_cache, k, v, lens = cache(dev)
    if where == "past":
        k_cache[:, :, 30:] = NAN  # past both sequences (5 + 1 and 29 + 1 keys)
        v_cache[:, :, 30:] = NAN
    else:
        k_cache[0, 0, 2, 0] = NAN  # a key of sequence 0, kv head 0
    out = adaattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens)
    rows = _nan_rows(out)
    if where == "past":
        assert not rows.any()
    else:
        assert rows[0, :2].all() and not rows[0, 2:].any() and not rows[1].any()


GOOD = {
    "flash_gqa8": lambda d: good_flash(d, hq=8, hkv=1),
    "flash_lq_ne_lk": lambda d: good_flash(d, lq=5, lk=11, causal=True),
    "flash_causal_rows_without_keys": lambda d: good_flash(d, lq=11, lk=5, causal=True),
    "flash_window_diagonal": lambda d: good_flash(d, window=(0, 0)),
    "flash_d1": lambda d: good_flash(d, d=1),
    "flash_d256": lambda d: good_flash(d, d=256, lq=3, lk=3),
    "flash_dv_ne_d": lambda d: good_flash(d, dv=8),
    "flash_softcap": lambda d: good_flash(d, softcap=2.0, causal=True),
    "flash_empty_batch": good_empty_batch,
    "flash_no_keys": good_no_keys,
    "flash_seqlens_zero_and_full": lambda d: good_seqlens(d, [0, 8]),
    "flash_nan_k": lambda d: good_nan_flash(d, "k", NAN),
    "flash_nan_q_causal": lambda d: good_nan_flash(d, "q", NAN, causal=True),
    "flash_inf_k": lambda d: good_nan_flash(d, "k", INF),
    "flash_neg_inf_q": lambda d: good_nan_flash(d, "q", -INF),
    "flash_nan_v": lambda d: good_nan_flash(d, "v", NAN),
    "varlen_zero_length_sequences": lambda d: good_varlen(d, [0, 0, 5, 5, 9], [0, 3, 3, 8, 8]),
    "varlen_no_sequences": lambda d: good_varlen(d, [0], [0]),
    "varlen_causal_tq_ne_tk": lambda d: good_varlen(d, [0, 2, 7], [0, 6, 9], causal=True),
    "varlen_nan_one_sequence": good_nan_varlen,
    "lazy_lq_lt_lk": lambda d: good_lazy(d, lq=3, lk=8),
    "lazy_seqlens_zero": lambda d: good_lazy(d, seqlens=ints(d, [0])),
    "lazy_nan_q": good_nan_lazy,
    "sparse_empty_layout": good_sparse_empty,
    "sparse_full_layout": lambda d: good_sparse_full(d, False),
    "sparse_full_layout_causal": lambda d: good_sparse_full(d, True),
    "sparse_nan_in_unlisted_block": good_sparse_nan_unlisted,
    "linear_zero_length_sequences": lambda d: good_linear(d, [0, 0, 5, 5, 9]),
    "linear_nan_v": good_linear_nan,
    "low_rank_rank1": lambda d: good_low_rank(d, 1),
    "low_rank_full": lambda d: good_low_rank(d, 16),
    "plan_energy_one": good_plan_full,
    "adaptive_energy_one": good_adaptive_energy_one,
    "decode_empty_cache": lambda d: good_decode(d, False, [0, 0]),
    "decode_full_cache": lambda d: good_decode(d, False, [31, 3]),
    "lazy_decode_empty_cache": lambda d: good_decode(d, True, [0, 7]),
    "decode_nan_past_sequence": lambda d: good_decode_nan(d, "past"),
    "decode_nan_key": lambda d: good_decode_nan(d, "key"),
}


@pytest.mark.parametrize("name", list(GOOD))
def test_legal_edge_input(name, device):
    GOOD[name](device)
