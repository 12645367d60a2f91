"""The argument checks of the ops in Python, for what runs without the C++ kernels.

The fake (meta) kernels (``_ops.py``) run instead of the C++ kernels under ``torch.compile``,
``torch.export``, ``FakeTensorMode`` and on meta tensors; they call the ``check_*`` functions
here, which mirror the C++ checks of each family (``csrc/ops/**``, ``ADAATTN_CHECK_*``): the same
checks in the same order, the same exception class and the same message, so that a fake kernel
raises exactly what the real one would. ``tests/test_bad_inputs.py`` runs every bad input
through both. Tensor values are not read (fake tensors have none): those checks stay with the
kernels. The Python wrappers check their own arguments' types here too (``boolean`` etc.).

Exception policy: ``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong value,
shape or layout, ``RuntimeError`` for a device mismatch; every message starts
``adaattn.<op>: `` and names the argument.
"""
import math
import numbers
import struct

import torch

# c10's names of the dtypes, as the C++ messages print them.
_DTYPE_NAMES = {
    torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
    torch.float64: "Double", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int",
    torch.int64: "Long", torch.uint8: "Byte", torch.bool: "Bool",
    torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
    torch.float8_e4m3fn: "Float8_e4m3fn",
}
_INT32_MAX = 2 ** 31 - 1


def _dtype(x) -> str:
    dtype = x.dtype if isinstance(x, torch.Tensor) else x
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


class _List:
    """``[a, b, ...]`` as C++ prints a shape, formatted only if a message is built (the checks
    run on every call and pass)."""

    __slots__ = ("values",)

    def __init__(self, values):
        self.values = values

    def __str__(self) -> str:
        return "[" + ", ".join(str(v) for v in self.values) + "]"


def _list(values) -> _List:
    return _List(values)


def _num(x) -> str:
    """A double as C++'s ostream prints it."""
    return f"{x:g}"


def _float32(x: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def type_name(value) -> str:
    """The type of an argument as a message names it (a tensor of any subclass is a Tensor)."""
    return "Tensor" if isinstance(value, torch.Tensor) else type(value).__name__


def fail(cls, op: str, *parts) -> None:
    raise cls(f"adaattn.{op}: " + "".join(str(p) for p in parts))


def check(cond, cls, op: str, *parts) -> None:
    if not cond:
        fail(cls, op, *parts)


# ---- Python argument types -------------------------------------------------------------------

def boolean(op: str, name: str, value) -> bool:
    """A flag: a bool, nothing else (no truthiness: causal="no" is an error)."""
    # The messages are built only on failure: the wrappers run these on every call.
    if value is not True and value is not False:
        fail(TypeError, op, name, " must be a bool, got ", type_name(value), " ", repr(value))
    return value


def _is_real(value) -> bool:
    return type(value) is float or (isinstance(value, numbers.Real)
                                    and not isinstance(value, bool))


def optional_float(op: str, name: str, value):
    if value is None:
        return None
    if not _is_real(value):
        fail(TypeError, op, name, " must be a float or None, got ", type_name(value), " ",
             repr(value))
    return float(value)


def real(op: str, name: str, value) -> float:
    if not _is_real(value):
        fail(TypeError, op, name, " must be a float, got ", type_name(value), " ", repr(value))
    return float(value)


def _is_int(value) -> bool:
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


def integer(op: str, name: str, value) -> int:
    if not _is_int(value):
        fail(TypeError, op, name, " must be an int, got ", type_name(value), " ", repr(value))
    return value


def tensor(op: str, name: str, value, optional: bool = False):
    if not (isinstance(value, torch.Tensor) or (optional and value is None)):
        fail(TypeError, op, name, " must be a tensor", " or None" if optional else "", ", got ",
             type_name(value))
    return value


def tensors(op: str, **named) -> None:
    for name, value in named.items():
        if not isinstance(value, torch.Tensor):
            tensor(op, name, value)


def optional_tensors(op: str, **named) -> None:
    for name, value in named.items():
        if value is not None and not isinstance(value, torch.Tensor):
            tensor(op, name, value, optional=True)


def window_pair(op: str, window):
    """``window=(left, right)``, two ints each >= -1."""
    if not (isinstance(window, (tuple, list)) and all(_is_int(w) for w in window)):
        fail(TypeError, op, "window must be a pair of ints (left, right), got ", repr(window))
    if len(window) != 2:
        fail(ValueError, op, "window must be a pair of ints (left, right), got ", repr(window))
    left, right = window
    if left < -1 or right < -1:
        fail(ValueError, op, "window entries must be >= 0 or -1 (unbounded), got ",
             repr(tuple(window)))
    return left, right


def softcap_value(op: str, softcap) -> float:
    """softcap as a float (the op checks that it is finite and >= 0)."""
    if not _is_real(softcap):
        fail(TypeError, op, "softcap must be a float >= 0 (0 = off), got ", repr(softcap))
    return float(softcap)


def num_splits_value(op: str, num_splits) -> int:
    integer(op, "num_splits", num_splits)
    if num_splits < 0:
        fail(ValueError, op, "num_splits must be >= 0 (0 = automatic), got ", num_splits)
    return num_splits


# ---- The attention core (csrc/ops/common/attention_inputs.cpp, checks.cpp) --------------------

def flash_op_name(cu_seqlens_q, cu_seqlens_k) -> str:
    return "flash_attn_varlen" if cu_seqlens_q is not None or cu_seqlens_k is not None \
        else "flash_attn"


def lazy_op_name(cu_seqlens) -> str:
    return "lazy_attn_varlen" if cu_seqlens is not None else "lazy_attn"


def _qkv_tensor(op, t, name, packed):
    check(t.dim() == (3 if packed else 4), ValueError, op, name, " must have ",
          "3 dims [T, H, D] (packed, with cu_seqlens)" if packed else "4 dims [B, H, L, D]",
          ", got ", t.dim(), " dims (shape ", _list(t.shape), ")")
    check(t.dtype.is_floating_point, TypeError, op, name,
          " must be a floating tensor (float16, bfloat16, float32, float64), got ", _dtype(t))
    check(t.shape[-1] == 0 or t.stride(-1) == 1, ValueError, op, name,
          " must have a contiguous last dim (stride(-1) == 1), got strides ", _list(t.stride()),
          "; call .contiguous() on it")


def cu_seqlens_tensor(op, cu, name, q):
    check(cu.dtype == torch.int32, TypeError, op, name, " must be int32, got ", _dtype(cu))
    check(cu.dim() == 1 and cu.shape[0] >= 1, ValueError, op, name,
          " must have shape [N + 1] (N >= 0 sequences), got ", _list(cu.shape))
    check(cu.is_contiguous(), ValueError, op, name, " must be contiguous")
    check(cu.device == q.device, RuntimeError, op, name, " must be on q's device ", q.device,
          ", got ", cu.device)


def _seq_args(op, q, seqlens, cu_q, cu_k, cu_names):
    check((cu_q is None) == (cu_k is None), ValueError, op,
          "cu_seqlens_q and cu_seqlens_k must be given together")
    if cu_q is None:
        return
    check(seqlens is None, ValueError, op,
          "seqlens (padded batches) and cu_seqlens (packed batches) exclude each other")
    cu_seqlens_tensor(op, cu_q, cu_names[0], q)
    cu_seqlens_tensor(op, cu_k, cu_names[1], q)
    check(cu_q.shape[0] == cu_k.shape[0], ValueError, op,
          "cu_seqlens_q and cu_seqlens_k must have the same length N + 1, got ", cu_q.shape[0],
          " and ", cu_k.shape[0])
    check(cu_q.shape[0] - 1 <= _INT32_MAX, ValueError, op, "too many sequences for int32")


def check_flash_inputs(op, q, k, v, seqlens=None, cu_q=None, cu_k=None,
                       cu_names=("cu_seqlens_q", "cu_seqlens_k")):
    packed = cu_q is not None or cu_k is not None
    _qkv_tensor(op, q, "q", packed)
    _qkv_tensor(op, k, "k", packed)
    _qkv_tensor(op, v, "v", packed)
    check(k.dtype == q.dtype and v.dtype == q.dtype, TypeError, op,
          "q, k and v must have the same dtype, got q ", _dtype(q), ", k ", _dtype(k), ", v ",
          _dtype(v))
    check(k.device == q.device and v.device == q.device, RuntimeError, op,
          "q, k and v must be on the same device, got q on ", q.device, ", k on ", k.device,
          ", v on ", v.device)
    check(packed or (k.shape[0] == q.shape[0] and v.shape[0] == q.shape[0]), ValueError, op,
          "batch size mismatch: q ", _list(q.shape), ", k ", _list(k.shape), ", v ",
          _list(v.shape))
    check(v.shape[:-1] == k.shape[:-1], ValueError, op,
          "k and v must have the same heads and length, got k ", _list(k.shape), ", v ",
          _list(v.shape))
    check(k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0, ValueError, op,
          "the number of query heads (q.size(1) = ", q.shape[1],
          ") must be a multiple of the number of kv heads (k.size(1) = ", k.shape[1], ")")
    check(k.shape[-1] == q.shape[-1], ValueError, op, "head dim mismatch: q has D = ",
          q.shape[-1], ", k has D = ", k.shape[-1])
    check(0 < q.shape[-1] <= 256, ValueError, op, "head dim D = q.size(-1) must be in [1, 256], "
          "got ", q.shape[-1])
    check(0 < v.shape[-1] <= 256, ValueError, op, "v's head dim Dv = v.size(-1) must be in "
          "[1, 256], got ", v.shape[-1])
    length = 0 if packed else 2
    check(q.shape[length] <= _INT32_MAX and k.shape[length] <= _INT32_MAX
          and q.shape[0] <= _INT32_MAX, ValueError, op,
          "sequence lengths and batch of q and k must fit in int32")
    _seq_args(op, q, seqlens, cu_q, cu_k, cu_names)
    if seqlens is not None:
        check(seqlens.dtype == torch.int32, TypeError, op, "seqlens must be int32, got ",
              _dtype(seqlens))
        check(seqlens.dim() == 1 and seqlens.shape[0] == q.shape[0], ValueError, op,
              "seqlens must have shape [B] = [", q.shape[0], "], got ", _list(seqlens.shape))
        check(seqlens.device == q.device, RuntimeError, op, "seqlens must be on ", q.device,
              ", got ", seqlens.device)


def check_flash_options(op, softmax_scale, window_left, window_right, softcap):
    check(window_left >= -1 and window_right >= -1, ValueError, op,
          "window must be (left, right) with each >= 0 or -1 (unbounded), got (", window_left,
          ", ", window_right, ")")
    check(window_left <= _INT32_MAX and window_right <= _INT32_MAX, ValueError, op,
          "window entries must fit in int32")
    check(softmax_scale is None or math.isfinite(softmax_scale), ValueError, op,
          "softmax_scale must be finite, got ", _num(softmax_scale or 0.0))
    cap = _float32(softcap)
    check(softcap >= 0 and math.isfinite(cap) and (softcap == 0 or cap > 0), ValueError, op,
          "softcap must be 0 (off) or a positive finite float32 value, got ", _num(softcap))


def check_score_tensors(op, q, batch, alibi_slopes, sinks, rel_bias):
    """The composed variant's tensors (ScoreTensors in attention_inputs.cpp): float32 on q's
    device; alibi_slopes ``[Hq]`` or ``[B, Hq]`` (``batch`` = B, packed: the sequences), sinks
    ``[Hq]``, rel_bias ``[Hq, W]`` with ``W >= 1``."""
    heads = q.shape[1] if q.dim() >= 2 else 0

    def common(t, name):
        check(t.dtype == torch.float32, TypeError, op, name, " must be float32, got ", _dtype(t))
        check(t.device == q.device, RuntimeError, op, name, " must be on ", q.device, ", got ",
              t.device)

    if alibi_slopes is not None:
        t = alibi_slopes
        check((t.dim() == 1 and t.shape[0] == heads)
              or (t.dim() == 2 and t.shape[0] == batch and t.shape[1] == heads), ValueError, op,
              "alibi_slopes must have shape [Hq] = [", heads, "] or [B, Hq] = [", batch, ", ",
              heads, "], got ", _list(t.shape))
        common(t, "alibi_slopes")
    if sinks is not None:
        check(sinks.dim() == 1 and sinks.shape[0] == heads, ValueError, op,
              "sinks must have shape [Hq] = [", heads, "], got ", _list(sinks.shape))
        common(sinks, "sinks")
    if rel_bias is not None:
        t = rel_bias
        check(t.dim() == 2 and t.shape[0] == heads and 1 <= t.shape[1] <= _INT32_MAX, ValueError,
              op, "rel_bias must have shape [Hq, W] = [", heads, ", W] with W >= 1, got ",
              _list(t.shape))
        common(t, "rel_bias")


def flash_batch(q, cu_seqlens_q) -> int:
    """B of a variant tensor ``[B, Hq]``: q's batch, or the packed sequences."""
    return cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None else q.shape[0]


def param_grad_fake(t, wanted, q):
    """The backward ops' gradient of sinks / rel_bias: t's shape when given and wanted, else
    an empty float32 ``[0]``."""
    if t is not None and wanted:
        return torch.empty_like(t, memory_format=torch.contiguous_format)
    return q.new_empty((0,), dtype=torch.float32)


def check_flash_bwd_inputs(op, dout, q, v, out, lse, packed):
    shape = [*q.shape[:-1], v.shape[-1]]
    check(list(dout.shape) == shape and list(out.shape) == shape, ValueError, op,
          "grad_out and out must have q's shape with v's head dim ", _list(shape), ", got ",
          _list(dout.shape), " and ", _list(out.shape))
    check(dout.dtype == q.dtype and out.dtype == q.dtype, TypeError, op,
          "grad_out and out must have q's dtype ", _dtype(q))
    check(dout.stride(-1) == 1 or dout.numel() == 0, ValueError, op,
          "grad_out must have a contiguous last dim")
    check(out.stride(-1) == 1 or out.numel() == 0, ValueError, op,
          "out must have a contiguous last dim")
    expected = [q.shape[1], q.shape[0]] if packed else list(q.shape[:3])
    check(lse.dtype == torch.float32, TypeError, op, "lse must be float32, got ", _dtype(lse))
    check(list(lse.shape) == expected, ValueError, op, "lse must have shape ",
          "[Hq, Tq]" if packed else "[B, Hq, Lq]", " = ", _list(expected), ", got ",
          _list(lse.shape))
    check(lse.is_contiguous(), ValueError, op, "lse must be contiguous")
    check(dout.device == q.device and out.device == q.device and lse.device == q.device,
          RuntimeError, op, "grad_out, out and lse must be on q's device ", q.device)


# ---- Lazy attention (csrc/ops/lazy/lazy.cpp) --------------------------------------------------

def check_lazy_params(op, q, tau, bias):
    heads = q.shape[1]
    check(tau.dtype == torch.float32, TypeError, op, "tau must be float32, got ", _dtype(tau))
    check(tau.dim() == 1 and tau.shape[0] == heads, ValueError, op, "tau must have shape [Hq] = [",
          heads, "], got ", _list(tau.shape))
    check(bias.dtype == torch.float32, TypeError, op, "bias must be float32, got ", _dtype(bias))
    check(bias.dim() == 2 and bias.shape[0] == heads and bias.shape[1] >= 1, ValueError, op,
          "bias must have shape [Hq, W] = [", heads, ", W] with W >= 1, got ", _list(bias.shape))
    check(bias.shape[1] <= _INT32_MAX, ValueError, op,
          "the bias window W = bias.size(1) must fit in int32, got ", bias.shape[1])
    check(tau.is_contiguous(), ValueError, op, "tau must be contiguous; call .contiguous() on it")
    check(bias.is_contiguous(), ValueError, op,
          "bias must be contiguous; call .contiguous() on it")
    check(tau.device == q.device, RuntimeError, op, "tau must be on q's device ", q.device,
          ", got ", tau.device)
    check(bias.device == q.device, RuntimeError, op, "bias must be on q's device ", q.device,
          ", got ", bias.device)


def check_lazy_inputs(op, q, k, v, tau, bias, seqlens, cu_seqlens, softmax_scale):
    if cu_seqlens is not None and q.dim() == 3 and k.dim() == 3:
        check(q.shape[0] == k.shape[0], ValueError, op,
              "packed lazy attention is self-attention over one cu_seqlens: q and k must have "
              "the same number of rows T, got q.size(0) = ", q.shape[0], ", k.size(0) = ",
              k.shape[0])
    check_flash_inputs(op, q, k, v, seqlens, cu_seqlens, cu_seqlens,
                       ("cu_seqlens", "cu_seqlens"))
    check(v.shape[-1] == q.shape[-1], ValueError, op,
          "lazy attention needs v with q's head dim (Dv == D), got ", v.shape[-1], " and ",
          q.shape[-1])
    if cu_seqlens is None:
        check(q.shape[2] <= k.shape[2], ValueError, op,
              "lazy attention needs Lq <= Lk (query row r sits at position r + Lk - Lq), got "
              "Lq = q.size(2) = ", q.shape[2], " > Lk = k.size(2) = ", k.shape[2])
    check_lazy_params(op, q, tau, bias)
    check_flash_options(op, softmax_scale, -1, 0, 0.0)


# ---- Block-sparse attention (csrc/ops/block_sparse/block_sparse.cpp) --------------------------

BLOCK_SPARSE = "block_sparse_attn"


def _index_pair(num, idx, num_name, idx_name, q, rows, cols, rows_text, cols_text):
    op = BLOCK_SPARSE
    for t, name in ((num, num_name), (idx, idx_name)):
        check(t.dtype == torch.int32, TypeError, op, name, " must be int32, got ", _dtype(t))
        check(t.device == q.device, RuntimeError, op, name, " must be on q's device ", q.device,
              ", got ", t.device)
    batch, heads = q.shape[0], q.shape[1]
    check(num.dim() == 3 and num.shape[0] in (1, batch) and num.shape[1] in (1, heads)
          and num.shape[2] == rows, ValueError, op, num_name, " must have shape [B or 1, Hq or 1, ",
          rows_text, "] = [", batch, " or 1, ", heads, " or 1, ", rows, "], got ",
          _list(num.shape))
    lead = list(num.shape[:2])
    check(idx.dim() == 4 and list(idx.shape) == [*lead, rows, cols], ValueError, op, idx_name,
          " must have shape [", lead[0], ", ", lead[1], ", ", rows_text, ", ", cols_text,
          "] = [", lead[0], ", ", lead[1], ", ", rows, ", ", cols, "] (", num_name,
          "'s leading dims), got ", _list(idx.shape))


def check_block_sparse_inputs(q, k, v, kv_num, kv_idx, q_num, q_idx, block_m, block_n):
    op = BLOCK_SPARSE
    check_flash_inputs(op, q, k, v)
    for size, name in ((block_m, "block_m"), (block_n, "block_n")):
        check(size in (64, 128), ValueError, op, name, " must be 64 or 128, got ", size)
    nq, nkv = -(-q.shape[2] // block_m), -(-k.shape[2] // block_n)
    _index_pair(kv_num, kv_idx, "kv_num_blocks", "kv_indices", q, nq, nkv,
                "nQ = ceil(Lq / block_m)", "nKV = ceil(Lk / block_n)")
    if q_num is not None:
        _index_pair(q_num, q_idx, "q_num_blocks", "q_indices", q, nkv, nq,
                    "nKV = ceil(Lk / block_n)", "nQ = ceil(Lq / block_m)")
        check(q_num.shape[:2] == kv_num.shape[:2], ValueError, op,
              "q_num_blocks must have kv_num_blocks' leading dims ", _list(kv_num.shape[:2]),
              ", got ", _list(q_num.shape))


def check_bwd_mode(bwd_mode):
    check(bwd_mode in ("atomic", "two_pass"), ValueError, BLOCK_SPARSE,
          "bwd_mode must be 'atomic' or 'two_pass', got '", bwd_mode, "'")


# ---- Linear attention (csrc/ops/linear/linear.cpp) --------------------------------------------

LINEAR = "linear_attn"


def _linear_state_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def linear_state_shape(q, v, cu_seqlens, normalize):
    seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return [seqs, q.shape[1], q.shape[-1], v.shape[-1] + int(normalize)]


def _linear_state(s, name, q, v, cu_seqlens, normalize):
    op = LINEAR
    dtype = _linear_state_dtype(q)
    check(s.dtype == dtype, TypeError, op, name, " must be a ", _dtype(dtype),
          " tensor (the state dtype of ", _dtype(q), " inputs), got ", _dtype(s))
    shape = linear_state_shape(q, v, cu_seqlens, normalize)
    check(list(s.shape) == shape, ValueError, op, name, " must be a ", _dtype(dtype),
          " tensor of shape [N, H, D, Dv", " + 1" if normalize else "", "] = ", _list(shape),
          " (normalize=True: the last column is the normaliser z)" if normalize else "",
          ", got ", _list(s.shape))
    check(s.device == q.device, RuntimeError, op, name, " must be on q's device ", q.device,
          ", got ", s.device)


def _linear_tensor(t, name, packed):
    op = LINEAR
    check(t.dim() == (3 if packed else 4), ValueError, op, name, " must have ",
          "3 dims [T, H, *] (packed, with cu_seqlens)" if packed
          else "4 dims [B, H, T, *] (dense, without cu_seqlens)",
          ", got ", t.dim(), " dims (shape ", _list(t.shape), ")")
    check(t.dtype.is_floating_point, TypeError, op, name,
          " must be a floating tensor (float16, bfloat16, float32, float64), got ", _dtype(t))
    check(t.numel() == 0 or t.stride(-1) == 1, ValueError, op, name,
          " must have a contiguous last dim (stride(-1) == 1), got strides ", _list(t.stride()),
          "; call .contiguous() on it")


def check_linear_inputs(q, k, v, initial_state, cu_seqlens, feature_map, normalize):
    op = LINEAR
    check(feature_map in ("elu", "relu", "identity"), ValueError, op,
          "feature_map must be one of 'elu', 'relu', 'identity', got '", feature_map, "'")
    packed = cu_seqlens is not None
    if packed:
        cu_seqlens_tensor(op, cu_seqlens, "cu_seqlens", q)
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _linear_tensor(t, name, packed)
    check(k.dtype == q.dtype and v.dtype == q.dtype, TypeError, op,
          "q, k and v must have the same dtype, got q ", _dtype(q), ", k ", _dtype(k), ", v ",
          _dtype(v))
    check(k.device == q.device and v.device == q.device, RuntimeError, op,
          "q, k and v must be on the same device, got q on ", q.device, ", k on ", k.device,
          ", v on ", v.device)
    check(k.shape == q.shape, ValueError, op, "k must have q's shape ", _list(q.shape),
          " (linear attention takes as many kv heads as query heads and keys of the queries' "
          "length), got ", _list(k.shape))
    check(v.shape[:-1] == q.shape[:-1], ValueError, op,
          "v must have q's shape except for its last dim (Dv), got v ", _list(v.shape),
          " and q ", _list(q.shape))
    check(1 <= q.shape[-1] <= 256, ValueError, op,
          "head dim D = q.size(-1) must be in [1, 256], got ", q.shape[-1])
    check(1 <= v.shape[-1] <= 256, ValueError, op,
          "value dim Dv = v.size(-1) must be in [1, 256], got ", v.shape[-1])
    check(q.shape[0] <= _INT32_MAX and q.shape[1] <= _INT32_MAX
          and (packed or q.shape[2] <= _INT32_MAX), ValueError, op,
          "batch, heads and sequence length must fit in int32")
    check(not packed or cu_seqlens.shape[0] - 1 <= _INT32_MAX, ValueError, op,
          "the number of sequences must fit in int32")
    if initial_state is not None:
        _linear_state(initial_state, "initial_state", q, v, cu_seqlens, normalize)


def check_linear_grads(grad_out, grad_state, q, v, cu_seqlens, normalize):
    op = LINEAR
    check(grad_out.shape == v.shape, ValueError, op, "grad_out must have out's shape ",
          _list(v.shape), ", got ", _list(grad_out.shape))
    check(grad_out.dtype == q.dtype, TypeError, op, "grad_out must have q's dtype ", _dtype(q),
          ", got ", _dtype(grad_out))
    check(grad_out.numel() == 0 or grad_out.stride(-1) == 1, ValueError, op,
          "grad_out must have a contiguous last dim")
    check(grad_out.device == q.device, RuntimeError, op, "grad_out must be on q's device ",
          q.device, ", got ", grad_out.device)
    if grad_state is not None:
        _linear_state(grad_state, "grad_state", q, v, cu_seqlens, normalize)


# ---- KV-cache decode (csrc/ops/decode/decode.cpp) ---------------------------------------------

def _cache_operand(op, t, name, q, fp8_cache=False):
    check(t.dim() == 4, ValueError, op, name,
          " must have 4 dims ([B, Hkv, L, D], or paged [num_pages, Hkv, page_size, D]), got ",
          t.dim(), " dims (shape ", _list(t.shape), ")")
    if fp8_cache:
        check(t.dtype == torch.float8_e4m3fn, TypeError, op, name,
              " must be float8_e4m3fn as the other cache operand, got ", _dtype(t))
    else:
        check(t.dtype == q.dtype, TypeError, op, name, " must have q's dtype ", _dtype(q),
              ", got ", _dtype(t))
    check(t.device == q.device, RuntimeError, op, name, " must be on q's device ", q.device,
          ", got ", t.device)
    check(t.shape[-1] == 0 or t.stride(-1) == 1, ValueError, op, name,
          " must have a contiguous last dim (stride(-1) == 1), got strides ", _list(t.stride()))


def _index_tensor(op, t, name, shape, q):
    check(t.dtype == torch.int32, TypeError, op, name, " must be int32, got ", _dtype(t))
    check(t.device == q.device, RuntimeError, op, name, " must be on q's device ", q.device,
          ", got ", t.device)
    check(t.is_contiguous(), ValueError, op, name, " ", shape,
          " must be contiguous; call .contiguous() on it")


def is_fp8_cache(k_cache, v_cache):
    """Whether either cache operand is 8-bit (float8_e4m3fn), as the C++ op decides."""
    return torch.float8_e4m3fn in (k_cache.dtype, v_cache.dtype)


def check_fp8_cache(op, q, k_cache, k, block_table, k_scale, v_scale, fp8_cache):
    """An 8-bit cache: paged, float32 [num_pages, Hkv] scales, nothing appended in the op."""
    if not fp8_cache:
        check(k_scale is None and v_scale is None, ValueError, op,
              "k_scale and v_scale belong to an 8-bit (float8_e4m3fn) cache; the caches have "
              "dtype ", _dtype(k_cache))
        return
    check(block_table is not None, ValueError, op,
          "an 8-bit (float8_e4m3fn) cache must be paged (pass block_table; "
          "adaattn.KVCache(dtype=torch.float8_e4m3fn) keeps one)")
    check(k is None, ValueError, op,
          "new keys k and values v cannot be appended to an 8-bit cache inside the op; quantise "
          "them into it first (adaattn.KVCache.append) and pass k = v = None")
    shape = [k_cache.shape[0], k_cache.shape[1]]
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        check(t is not None, ValueError, op, name,
              " (float32 [num_pages, Hkv]) is required with an 8-bit cache")
        check(t.dtype == torch.float32, TypeError, op, name, " must be float32, got ", _dtype(t))
        check(t.device == q.device, RuntimeError, op, name, " must be on q's device ", q.device,
              ", got ", t.device)
        check(list(t.shape) == shape, ValueError, op, name, " must have shape [num_pages, Hkv] "
              "= ", _list(shape), ", got ", _list(t.shape))
        check(t.is_contiguous(), ValueError, op, name,
              " must be contiguous; call .contiguous() on it")


def check_query_basis(op, q, k_cache, basis, name="q_basis"):
    """A low-rank key cache's basis (decode_ops.h's check_query_basis; `name` as the caller
    calls it): U [B, Hkv, D, R] of q [B, Hq, Lq, D], float32 or q's dtype, on q's device,
    1 <= R <= D, and k_cache.size(-1) == R. Checks q's and k_cache's dims first."""
    check(q.dim() == 4, ValueError, op, "q must be [B, Hq, Lq, D], got shape ", _list(q.shape))
    check(k_cache.dim() == 4, ValueError, op, "k_cache must be [B, Hkv, Lmax, R] or paged "
          "[num_pages, Hkv, page_size, R], got shape ", _list(k_cache.shape))
    check(basis.dtype == torch.float32 or basis.dtype == q.dtype, TypeError, op,
          name, " must be float32 or q's dtype ", _dtype(q), ", got ", _dtype(basis))
    check(basis.device == q.device, RuntimeError, op, name, " must be on q's device ", q.device,
          ", got ", basis.device)
    check(basis.dim() == 4 and (basis.shape[0], basis.shape[1], basis.shape[2]) ==
          (q.shape[0], k_cache.shape[1], q.shape[3]), ValueError, op,
          name, " must be [B, Hkv, D, R] = [", q.shape[0], ", ", k_cache.shape[1], ", ",
          q.shape[3], ", R], got ", _list(basis.shape))
    check(1 <= basis.shape[3] <= q.shape[3], ValueError, op, name, "'s rank R = ", name,
          ".size(3) must be in [1, D = ", q.shape[3], "], got ", basis.shape[3])
    check(k_cache.shape[3] == basis.shape[3], ValueError, op, "k_cache holds the projected keys "
          "k U: its head dim k_cache.size(-1) = ", k_cache.shape[3], " must be ", name,
          "'s rank R = ", basis.shape[3])


def check_kvcache_inputs(op, q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits,
                         fp8_cache=False):
    check(q.dim() == 4, ValueError, op, "q must have 4 dims [B, Hq, Lq, D], got ", q.dim(),
          " dims (shape ", _list(q.shape), ")")
    check(q.dtype.is_floating_point, TypeError, op,
          "q must be a floating tensor (float16, bfloat16, float32, float64), got ", _dtype(q))
    check(q.shape[-1] == 0 or q.stride(-1) == 1, ValueError, op,
          "q must have a contiguous last dim (stride(-1) == 1), got strides ", _list(q.stride()))
    _cache_operand(op, k_cache, "k_cache", q, fp8_cache)
    _cache_operand(op, v_cache, "v_cache", q, fp8_cache)
    check(k_cache.shape[:3] == v_cache.shape[:3], ValueError, op,
          "k_cache and v_cache must agree in all but the last dim, got k_cache ",
          _list(k_cache.shape), ", v_cache ", _list(v_cache.shape))
    batch, heads_kv, len_q = q.shape[0], k_cache.shape[1], q.shape[2]
    check(heads_kv > 0 and q.shape[1] % heads_kv == 0, ValueError, op,
          "the number of query heads (q.size(1) = ", q.shape[1],
          ") must be a multiple of the number of kv heads (k_cache.size(1) = ", heads_kv, ")")
    check(k_cache.shape[3] == q.shape[3], ValueError, op, "head dim mismatch: q has D = ",
          q.shape[3], ", k_cache has D = ", k_cache.shape[3])
    check(0 < q.shape[3] <= 256, ValueError, op,
          "head dim D = q.size(-1) must be in [1, 256], got ", q.shape[3])
    check(0 < v_cache.shape[3] <= 256, ValueError, op,
          "v_cache's head dim Dv must be in [1, 256], got ", v_cache.shape[3])
    _index_tensor(op, cache_seqlens, "cache_seqlens", "[B]", q)
    check(cache_seqlens.dim() == 1 and cache_seqlens.shape[0] == batch, ValueError, op,
          "cache_seqlens must have shape [B] = [", batch, "], got ", _list(cache_seqlens.shape))
    capacity, num_pages = k_cache.shape[2], 0
    if block_table is not None:
        _index_tensor(op, block_table, "block_table", "[B, max_pages]", q)
        check(block_table.dim() == 2 and block_table.shape[0] == batch, ValueError, op,
              "block_table must have shape [B, max_pages] with B = ", batch, ", got ",
              _list(block_table.shape))
        num_pages = k_cache.shape[0]
        capacity = block_table.shape[1] * k_cache.shape[2]
        check(k_cache.shape[2] > 0, ValueError, op, "k_cache's page_size (dim 2) must be positive")
    else:
        check(k_cache.shape[0] == batch, ValueError, op, "k_cache must have q's batch size ",
              batch, " in dim 0 (or pass block_table for a paged cache), got ",
              _list(k_cache.shape))
    check(capacity <= _INT32_MAX and len_q <= _INT32_MAX and batch <= _INT32_MAX
          and num_pages <= _INT32_MAX, ValueError, op,
          "cache sizes and lengths must fit in int32")
    check((k is None) == (v is None), ValueError, op,
          "the new keys k and values v must be given together (or neither)")
    if k is not None:
        k_shape = [batch, heads_kv, len_q, q.shape[3]]
        v_shape = [batch, heads_kv, len_q, v_cache.shape[3]]
        _cache_operand(op, k, "k", q)
        _cache_operand(op, v, "v", q)
        check(list(k.shape) == k_shape, ValueError, op,
              "k (new keys) must have shape [B, Hkv, Lq, D] = ", _list(k_shape), ", got ",
              _list(k.shape))
        check(list(v.shape) == v_shape, ValueError, op,
              "v (new values) must have shape [B, Hkv, Lq, Dv] = ", _list(v_shape), ", got ",
              _list(v.shape))
    check(num_splits >= 0, ValueError, op, "num_splits must be >= 0 (0 = automatic), got ",
          num_splits)


def check_lazy_kvcache_args(op, q, v_cache, tau, bias):
    check(v_cache.shape[-1] == q.shape[-1], ValueError, op,
          "lazy attention needs v_cache with q's head dim (Dv == D), got ", v_cache.shape[-1],
          " and ", q.shape[-1])
    check_lazy_params(op, q, tau, bias)


# ---- Linear algebra (csrc/ops/linalg) ---------------------------------------------------------

def check_sym_eig_input(op, a):
    check(a.dtype == torch.float32, TypeError, op, "a must be float32, got ", _dtype(a))
    check(a.dim() == 3, ValueError, op, "a must have 3 dims [N, D, D], got ", a.dim(),
          " dims (shape ", _list(a.shape), ")")
    check(a.shape[1] == a.shape[2], ValueError, op, "a must be square [N, D, D], got shape ",
          _list(a.shape))
    check(1 <= a.shape[1] <= 256, ValueError, op, "D = a.size(1) must be in [1, 256], got ",
          a.shape[1])
    check(a.shape[0] <= _INT32_MAX, ValueError, op,
          "the batch N = a.size(0) must fit in int32, got ", a.shape[0])
    check(a.is_contiguous(), ValueError, op, "a must be contiguous; call .contiguous() on it")


def check_sym_eig_top_args(energy, min_rank, multiple):
    op = "sym_eig_top"
    check(0.0 < energy <= 1.0, ValueError, op, "energy must be in (0, 1], got ", _num(energy))
    check(min_rank >= 1 and multiple >= 1, ValueError, op,
          "min_rank and multiple must be positive, got ", min_rank, ", ", multiple)


def check_matrix_batch(op, a, max_dim):
    """a: float32 [N, D, D], contiguous, N within int32, D >= 1 and, when max_dim > 0,
    D <= max_dim (csrc/ops/linalg/matrix_checks.h)."""
    check(a.dtype == torch.float32, TypeError, op, "a must be float32, got ", _dtype(a))
    check(a.dim() == 3 and a.shape[1] == a.shape[2], ValueError, op,
          "a must be [N, D, D], got shape ", _list(a.shape))
    if max_dim > 0:
        check(1 <= a.shape[1] <= max_dim, ValueError, op, "D = a.size(1) must be in [1, ",
              max_dim, "], got ", a.shape[1])
    else:
        check(a.shape[1] >= 1, ValueError, op, "D = a.size(1) must be >= 1")
    check(a.shape[0] <= _INT32_MAX, ValueError, op,
          "the batch N = a.size(0) must fit in int32, got ", a.shape[0])
    check(a.is_contiguous(), ValueError, op, "a must be contiguous; call .contiguous() on it")


def check_sym_sketch_args(a, omega, energy, min_rank, multiple, power_iters, oversample,
                          rel_shift):
    op = "sym_sketch_top"
    check_matrix_batch(op, a, 128)
    check(omega.dtype == torch.float32, TypeError, op, "omega must be float32, got ",
          _dtype(omega))
    check(omega.dim() == 2 and omega.shape[0] == a.shape[1], ValueError, op,
          "omega must be [D, P] with D = ", a.shape[1], ", got shape ", _list(omega.shape))
    check(1 <= omega.shape[1] <= min(a.shape[1], 64), ValueError, op,
          "P = omega.size(1) must be in [1, min(D, 64)], got ", omega.shape[1])
    check(omega.is_contiguous(), ValueError, op, "omega must be contiguous")
    check(omega.device == a.device, RuntimeError, op, "omega must be on a's device ", a.device,
          ", got ", omega.device)
    check(0.0 < energy <= 1.0, ValueError, op, "energy must be in (0, 1], got ", _num(energy))
    check(min_rank >= 1 and multiple >= 1, ValueError, op,
          "min_rank and multiple must be positive, got ", min_rank, ", ", multiple)
    check(0 <= power_iters <= 8, ValueError, op, "power_iters must be in [0, 8], got ",
          power_iters)
    check(oversample >= 0, ValueError, op, "oversample must be >= 0, got ", oversample)
    check(math.isfinite(rel_shift) and rel_shift >= 0.0, ValueError, op,
          "rel_shift must be finite and >= 0, got ", _num(rel_shift))


def check_sym_gram_args(q, k):
    """q [N, Rq, D], k [N, Rk, D] for sym_gram (csrc/ops/linalg/sym_gram.cpp); the 16-byte
    alignment of the data is checked by the kernels alone (fake tensors have no data)."""
    op = "sym_gram"
    for name, x in (("q", q), ("k", k)):
        check(x.dtype in (torch.float16, torch.bfloat16), TypeError, op, name,
              " must be float16 or bfloat16, got ", _dtype(x))
        check(x.dim() == 3, ValueError, op, name, " must be [N, R, D], got shape ",
              _list(x.shape))
        check(x.shape[2] <= 1 or x.stride(2) == 1, ValueError, op, name,
              " must have contiguous rows (stride(2) == 1), got strides ", _list(x.stride()))
    check(k.dtype == q.dtype, TypeError, op, "k must have q's dtype ", _dtype(q), ", got ",
          _dtype(k))
    check(k.device == q.device, RuntimeError, op, "k must be on q's device ", q.device, ", got ",
          k.device)
    check(k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2], ValueError, op,
          "q [N, Rq, D] and k [N, Rk, D] must agree in N and D, got shapes ", _list(q.shape),
          " and ", _list(k.shape))
    d = q.shape[2]
    check(8 <= d <= 128 and d % 8 == 0, ValueError, op,
          "D = q.size(2) must be a multiple of 8 in [8, 128], got ", d)
    check(q.shape[0] <= _INT32_MAX, ValueError, op,
          "the batch N = q.size(0) must fit in int32, got ", q.shape[0])
    for name, x in (("q", q), ("k", k)):
        check(x.stride(1) % 8 == 0 and x.stride(0) % 8 == 0, ValueError, op, name,
              " must have row and batch strides that are multiples of 8 and 16-byte aligned "
              "data; call .contiguous() on it (strides ", _list(x.stride()), ")")


def check_shifted_cholesky_input(a, rel_shift):
    op = "shifted_cholesky_info"
    check_matrix_batch(op, a, 0)
    check(math.isfinite(rel_shift), ValueError, op, "rel_shift must be finite, got ",
          _num(rel_shift))
