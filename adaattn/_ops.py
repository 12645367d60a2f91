"""Loads the op library and registers the fake (meta) kernels used by torch.compile/export.

Loading the library registers the ops in `torch.ops.adaattn`; it does not initialise CUDA.
"""
import glob
import os

import torch

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


@torch.library.register_fake("adaattn::flash_fwd")
def _flash_fwd_fake(q, k, v, seqlens, softmax_scale, causal, window_left, window_right,
                    cu_seqlens_q=None, cu_seqlens_k=None, softcap=0.0):
    out = _out_fake(q, v)
    return out, _lse_fake(q, cu_seqlens_q is not None)


@torch.library.register_fake("adaattn::flash_bwd")
def _flash_bwd_fake(grad_out, q, k, v, out, lse, seqlens, softmax_scale, causal, window_left,
                    window_right, deterministic, cu_seqlens_q=None, cu_seqlens_k=None,
                    softcap=0.0):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


@torch.library.register_fake("adaattn::lazy_fwd")
def _lazy_fwd_fake(q, k, v, tau, bias, seqlens, softmax_scale, return_stats, cu_seqlens=None):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    stats = q.new_empty((4 if return_stats else 0,), dtype=torch.int64)
    return out, _lse_fake(q, cu_seqlens is not None), stats


@torch.library.register_fake("adaattn::lazy_bwd")
def _lazy_bwd_fake(grad_out, q, k, v, tau, bias, out, lse, seqlens, softmax_scale, param_grads,
                   cu_seqlens=None):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            torch.empty_like(tau, memory_format=torch.contiguous_format),
            torch.empty_like(bias, memory_format=torch.contiguous_format))


def _linear_state_fake(q, v, cu_seqlens, normalize):
    seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty((seqs, q.shape[1], q.shape[-1], v.shape[-1] + int(normalize)), dtype=dtype)


@torch.library.register_fake("adaattn::linear_fwd")
def _linear_fwd_fake(q, k, v, initial_state, cu_seqlens, feature_map, causal, normalize):
    out = torch.empty_like(v, memory_format=torch.contiguous_format)
    return out, _linear_state_fake(q, v, cu_seqlens, normalize)


@torch.library.register_fake("adaattn::linear_bwd")
def _linear_bwd_fake(grad_out, grad_state, q, k, v, initial_state, cu_seqlens, feature_map, causal,
                     normalize):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            _linear_state_fake(q, v, cu_seqlens, normalize))


@torch.library.register_fake("adaattn::block_sparse_fwd")
def _block_sparse_fwd_fake(q, k, v, kv_num_blocks, kv_indices, block_m, block_n, softmax_scale,
                           causal, softcap=0.0):
    out = _out_fake(q, v)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    return out, lse


@torch.library.register_fake("adaattn::block_sparse_bwd")
def _block_sparse_bwd_fake(grad_out, q, k, v, out, lse, kv_num_blocks, kv_indices, q_num_blocks,
                           q_indices, block_m, block_n, softmax_scale, causal,
                           deterministic=False, softcap=0.0):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


@torch.library.register_fake("adaattn::sym_eig")
def _sym_eig_fake(a):
    return a.new_empty(a.shape[:2]), torch.empty_like(a, memory_format=torch.contiguous_format)


@torch.library.register_fake("adaattn::shifted_cholesky_info")
def _shifted_cholesky_info_fake(a, rel_shift):
    return a.new_empty(a.shape[:1], dtype=torch.int32)


@torch.library.register_fake("adaattn::sym_eig_top")
def _sym_eig_top_fake(a, energy, min_rank, multiple):
    return (a.new_empty(a.shape[:2]), torch.empty_like(a, memory_format=torch.contiguous_format),
            a.new_empty(a.shape[:1], dtype=torch.int32))


@torch.library.register_fake("adaattn::flash_attn_with_kvcache")
def _flash_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, block_table=None,
                        softmax_scale=None, causal=True, window_left=-1, window_right=-1,
                        softcap=0.0, num_splits=0):
    return _out_fake(q, v_cache), _lse_fake(q, False)


@torch.library.register_fake("adaattn::lazy_attn_with_kvcache")
def _lazy_kvcache_fake(q, k_cache, v_cache, k, v, tau, bias, cache_seqlens, block_table=None,
                       softmax_scale=None, num_splits=0):
    return _out_fake(q, v_cache), _lse_fake(q, False)
