"""Loads the op library and registers the fake (meta) kernels used by torch.compile/export.

Loading the library registers the ops in `torch.ops.adaattn`; it does not initialise CUDA.
Every fake kernel first runs the checks of its real kernels (``_checks.py``: the same exception
and message), so a bad argument fails at trace time, and on meta tensors, as it would at run time.
"""
import glob
import os

import torch

from . import _checks as C

_LIB_DIR = os.path.dirname(os.path.abspath(__file__))


def _load_library():
    candidates = sorted(glob.glob(os.path.join(_LIB_DIR, "_C*.so")))
    if not candidates:
        raise ImportError(
            "adaattn: the compiled op library (adaattn/_C*.so) was not found; build it with "
            "`pip install --no-build-isolation -e .` (see README.md)")
    torch.ops.load_library(candidates[0])


_load_library()
ops = torch.ops.adaattn


def _lse_fake(q, packed):
    """lse: ``[B, Hq, Lq]``, packed ``[Hq, Tq]``."""
    shape = (q.shape[1], q.shape[0]) if packed else q.shape[:3]
    return q.new_empty(shape, dtype=torch.float32)


def _out_fake(q, v):
    """out: q's shape with v's head dim, contiguous."""
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _following(like, last):
    """A new tensor of ``like``'s shape with last dim ``last``, laid out as the flash ops lay out
    their outputs and gradients (csrc/ops/common/attention_inputs.h, empty_following): for a
    ``[B, H, L, D]`` view of ``[B, L, H, D]`` storage, a view of new ``[B, L, H, last]``
    storage; contiguous otherwise."""
    shape = (*like.shape[:-1], last)
    if like.dim() != 4 or like.stride(1) >= like.stride(2):
        return like.new_empty(shape)
    return like.new_empty((shape[0], shape[2], shape[1], shape[3])).transpose(1, 2)


@torch.library.register_fake("adaattn::flash_fwd")
def _flash_fwd_fake(q, k, v, seqlens, softmax_scale, causal, window_left, window_right,
                    cu_seqlens_q=None, cu_seqlens_k=None, softcap=0.0, alibi_slopes=None,
                    sinks=None, rel_bias=None):
    op = C.flash_op_name(cu_seqlens_q, cu_seqlens_k)
    C.check_flash_inputs(op, q, k, v, seqlens, cu_seqlens_q, cu_seqlens_k)
    C.check_flash_options(op, softmax_scale, window_left, window_right, softcap)
    C.check_score_tensors(op, q, C.flash_batch(q, cu_seqlens_q), alibi_slopes, sinks, rel_bias)
    return _following(q, v.shape[-1]), _lse_fake(q, cu_seqlens_q is not None)


@torch.library.register_fake("adaattn::flash_fwd_fp8")
def _flash_fwd_fp8_fake(q, k, v, softmax_scale=None, causal=False, window_left=-1,
                        window_right=-1, fp8_tol=None):
    C.check_flash_inputs("flash_attn", q, k, v, None, None, None)
    C.check_flash_options("flash_attn", softmax_scale, window_left, window_right, 0.0)
    C.check(softmax_scale is None or softmax_scale > 0, ValueError, "flash_attn",
            "precision='fp8' needs softmax_scale > 0, got ", softmax_scale)
    return _out_fake(q, v), _lse_fake(q, False), q.new_empty(q.shape[:2], dtype=torch.bool)


@torch.library.register_kernel("adaattn::flash_fwd_fp8", "cpu")
def _flash_fwd_fp8_cpu(q, k, v, softmax_scale=None, causal=False, window_left=-1,
                       window_right=-1, fp8_tol=None):
    """The CPU kernel of the 8-bit forward: its emulation (one definition of the scheme), with
    the heads chosen by choose_precision when fp8_tol is given."""
    from .precision import choose_precision, fp8_attention_emulated
    C.check_flash_inputs("flash_attn", q, k, v, None, None, None)
    C.check_flash_options("flash_attn", softmax_scale, window_left, window_right, 0.0)
    C.check(softmax_scale is None or softmax_scale > 0, ValueError, "flash_attn",
            "precision='fp8' needs softmax_scale > 0, got ", softmax_scale)
    head_fp8 = None if fp8_tol is None else choose_precision(q, k, v, fp8_tol=fp8_tol,
                                                             scale=softmax_scale)
    out, lse, ran_fp8 = fp8_attention_emulated(
        q, k, v, causal=causal, scale=softmax_scale, window=(window_left, window_right),
        head_fp8=head_fp8, return_lse=True)
    return out.to(q.dtype), lse, ran_fp8


@torch.library.register_fake("adaattn::flash_bwd")
def _flash_bwd_fake(grad_out, q, k, v, out, lse, seqlens, softmax_scale, causal, window_left,
                    window_right, deterministic, cu_seqlens_q=None, cu_seqlens_k=None,
                    softcap=0.0, alibi_slopes=None, sinks=None, rel_bias=None,
                    param_grads=False):
    op = C.flash_op_name(cu_seqlens_q, cu_seqlens_k)
    C.check_flash_inputs(op, q, k, v, seqlens, cu_seqlens_q, cu_seqlens_k)
    C.check_flash_bwd_inputs(op, grad_out, q, v, out, lse, cu_seqlens_q is not None)
    C.check_flash_options(op, softmax_scale, window_left, window_right, softcap)
    C.check_score_tensors(op, q, C.flash_batch(q, cu_seqlens_q), alibi_slopes, sinks, rel_bias)
    return (_following(q, q.shape[-1]), _following(k, k.shape[-1]), _following(v, v.shape[-1]),
            C.param_grad_fake(sinks, param_grads, q), C.param_grad_fake(rel_bias, param_grads, q))


@torch.library.register_fake("adaattn::lazy_fwd")
def _lazy_fwd_fake(q, k, v, tau, bias, seqlens, softmax_scale, return_stats, cu_seqlens=None):
    C.check_lazy_inputs(C.lazy_op_name(cu_seqlens), q, k, v, tau, bias, seqlens, cu_seqlens,
                        softmax_scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    stats = q.new_empty((4 if return_stats else 0,), dtype=torch.int64)
    return out, _lse_fake(q, cu_seqlens is not None), stats


@torch.library.register_fake("adaattn::lazy_bwd")
def _lazy_bwd_fake(grad_out, q, k, v, tau, bias, out, lse, seqlens, softmax_scale, param_grads,
                   cu_seqlens=None):
    op = C.lazy_op_name(cu_seqlens)
    C.check_lazy_inputs(op, q, k, v, tau, bias, seqlens, cu_seqlens, softmax_scale)
    C.check_flash_bwd_inputs(op, grad_out, q, v, out, lse, cu_seqlens is not None)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            torch.empty_like(tau, memory_format=torch.contiguous_format),
            torch.empty_like(bias, memory_format=torch.contiguous_format))


# Block ops of ring_lazy_attn (csrc/ops/lazy/lazy_ops.h): dense, explicit positions.
@torch.library.register_fake("adaattn::lazy_block_lse")
def _lazy_block_lse_fake(q, k, tau, bias, softmax_scale, q_position, k_position):
    C.check_lazy_inputs("lazy_block_lse", q, k, k, tau, bias, None, None, softmax_scale)
    return _lse_fake(q, False)


@torch.library.register_fake("adaattn::lazy_block_out")
def _lazy_block_out_fake(q, k, v, tau, bias, lse, softmax_scale, q_position, k_position):
    C.check_lazy_inputs("lazy_block_out", q, k, v, tau, bias, None, None, softmax_scale)
    return _out_fake(q, v)


@torch.library.register_fake("adaattn::lazy_block_row_terms")
def _lazy_block_row_terms_fake(grad_out, q, k, v, tau, bias, lse, softmax_scale, q_position,
                               k_position):
    C.check_lazy_inputs("lazy_block_row_terms", q, k, v, tau, bias, None, None, softmax_scale)
    return _lse_fake(q, False), _lse_fake(q, False)


@torch.library.register_fake("adaattn::lazy_block_bwd")
def _lazy_block_bwd_fake(grad_out, q, k, v, tau, bias, lse, delta, softmax_scale, q_position,
                         k_position, bias_grad):
    C.check_lazy_inputs("lazy_block_bwd", q, k, v, tau, bias, None, None, softmax_scale)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            torch.empty_like(bias, memory_format=torch.contiguous_format))


def _linear_state_fake(q, v, cu_seqlens, normalize):
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(C.linear_state_shape(q, v, cu_seqlens, normalize), dtype=dtype)


@torch.library.register_fake("adaattn::linear_fwd")
def _linear_fwd_fake(q, k, v, initial_state, cu_seqlens, feature_map, causal, normalize):
    C.check_linear_inputs(q, k, v, initial_state, cu_seqlens, feature_map, normalize)
    out = torch.empty_like(v, memory_format=torch.contiguous_format)
    return out, _linear_state_fake(q, v, cu_seqlens, normalize)


@torch.library.register_fake("adaattn::linear_bwd")
def _linear_bwd_fake(grad_out, grad_state, q, k, v, initial_state, cu_seqlens, feature_map, causal,
                     normalize):
    C.check_linear_inputs(q, k, v, initial_state, cu_seqlens, feature_map, normalize)
    C.check_linear_grads(grad_out, grad_state, q, v, cu_seqlens, normalize)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            _linear_state_fake(q, v, cu_seqlens, normalize))


@torch.library.register_fake("adaattn::block_sparse_fwd")
def _block_sparse_fwd_fake(q, k, v, kv_num_blocks, kv_indices, block_m, block_n, softmax_scale,
                           causal, softcap=0.0, alibi_slopes=None, sinks=None, rel_bias=None):
    C.check_block_sparse_inputs(q, k, v, kv_num_blocks, kv_indices, None, None, block_m, block_n)
    C.check_flash_options(C.BLOCK_SPARSE, softmax_scale, -1, -1, softcap)
    C.check_score_tensors(C.BLOCK_SPARSE, q, q.shape[0], alibi_slopes, sinks, rel_bias)
    out = _out_fake(q, v)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    return out, lse


@torch.library.register_fake("adaattn::block_sparse_bwd")
def _block_sparse_bwd_fake(grad_out, q, k, v, out, lse, kv_num_blocks, kv_indices, q_num_blocks,
                           q_indices, block_m, block_n, softmax_scale, causal,
                           bwd_mode="atomic", softcap=0.0, alibi_slopes=None, sinks=None,
                           rel_bias=None, param_grads=False):
    C.check_block_sparse_inputs(q, k, v, kv_num_blocks, kv_indices, q_num_blocks, q_indices,
                                block_m, block_n)
    C.check_bwd_mode(bwd_mode)
    C.check_flash_options(C.BLOCK_SPARSE, softmax_scale, -1, -1, softcap)
    C.check_flash_bwd_inputs(C.BLOCK_SPARSE, grad_out, q, v, out, lse, False)
    C.check_score_tensors(C.BLOCK_SPARSE, q, q.shape[0], alibi_slopes, sinks, rel_bias)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            C.param_grad_fake(sinks, param_grads, q), C.param_grad_fake(rel_bias, param_grads, q))


@torch.library.register_fake("adaattn::sym_eig")
def _sym_eig_fake(a):
    C.check_sym_eig_input("sym_eig", a)
    return a.new_empty(a.shape[:2]), torch.empty_like(a, memory_format=torch.contiguous_format)


@torch.library.register_fake("adaattn::shifted_cholesky_info")
def _shifted_cholesky_info_fake(a, rel_shift):
    C.check_shifted_cholesky_input(a, rel_shift)
    return a.new_empty(a.shape[:1], dtype=torch.int32)


@torch.library.register_fake("adaattn::sym_sketch_top")
def _sym_sketch_top_fake(a, omega, energy, min_rank, multiple, power_iters, oversample,
                         rel_shift):
    C.check_sym_sketch_args(a, omega, energy, min_rank, multiple, power_iters, oversample,
                            rel_shift)
    n, dim, width = a.shape[0], a.shape[1], omega.shape[1]
    return (a.new_empty(n, dim), a.new_empty(n, dim, width), a.new_empty(n, dtype=torch.int32),
            a.new_empty(n, dtype=torch.bool), a.new_empty(3, dtype=torch.int32))


@torch.library.register_fake("adaattn::sym_gram")
def _sym_gram_fake(q, k):
    C.check_sym_gram_args(q, k)
    return q.new_empty(q.shape[0], q.shape[2], q.shape[2], dtype=torch.float32)


@torch.library.register_fake("adaattn::sym_eig_top")
def _sym_eig_top_fake(a, energy, min_rank, multiple):
    C.check_sym_eig_input("sym_eig_top", a)
    C.check_sym_eig_top_args(energy, min_rank, multiple)
    return (a.new_empty(a.shape[:2]), torch.empty_like(a, memory_format=torch.contiguous_format),
            a.new_empty(a.shape[:1], dtype=torch.int32))


@torch.library.register_fake("adaattn::flash_attn_with_kvcache")
def _flash_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, block_table=None,
                        softmax_scale=None, causal=True, window_left=-1, window_right=-1,
                        softcap=0.0, num_splits=0, k_scale=None, v_scale=None,
                        alibi_slopes=None, sinks=None, rel_bias=None, q_basis=None):
    op = "flash_attn_with_kvcache"
    q_rows = q
    if q_basis is not None:
        C.check_query_basis(op, q, k_cache, q_basis)
        q_rows = q[..., :q_basis.shape[3]]
    fp8 = C.is_fp8_cache(k_cache, v_cache)
    C.check_kvcache_inputs(op, q_rows, k_cache, v_cache, k, v, cache_seqlens, block_table,
                           num_splits, fp8)
    C.check_fp8_cache(op, q_rows, k_cache, k, block_table, k_scale, v_scale, fp8)
    C.check_flash_options(op, softmax_scale, window_left, window_right, softcap)
    C.check_score_tensors(op, q, q.shape[0], alibi_slopes, sinks, rel_bias)
    return _out_fake(q, v_cache), _lse_fake(q, False)


@torch.library.register_fake("adaattn::lazy_attn_with_kvcache")
def _lazy_kvcache_fake(q, k_cache, v_cache, k, v, tau, bias, cache_seqlens, block_table=None,
                       softmax_scale=None, num_splits=0):
    op = "lazy_attn_with_kvcache"
    C.check_kvcache_inputs(op, q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits)
    C.check_lazy_kvcache_args(op, q, v_cache, tau, bias)
    C.check_flash_options(op, softmax_scale, -1, 0, 0.0)
    return _out_fake(q, v_cache), _lse_fake(q, False)
