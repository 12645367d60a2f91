"""Small fwd+bwd calls of the CUDA kernels for compute-sanitizer (memcheck, racecheck): flash
(D 64 and 128, GQA, causal, window, seqlens, Lq != Lk; atomic and two-pass backward; with
softcap; ALiBi, sinks and rel_bias composed), block-sparse (an empty row of blocks included;
atomic and two-pass backward), lazy (and its ring block ops, at positions past key 0) and
low-rank, bf16; shifted_cholesky_info (D 33 and 128, pivots failing and not);
sym_sketch_top (D 17 and 128, decided and not, a zero matrix); and the KV-cache decode ops
(decode()).

    compute-sanitizer --tool memcheck python benchmarks/sanitize_ops.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import adaattn  # noqa: E402  (the in-place build)


def rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)


def backward(out):
    out.backward(torch.randn_like(out))


def composed(d):
    """ALiBi, learnable sinks and rel_bias (with softcap; GQA, causal, seqlens) on the tensor cores."""
    slopes = torch.rand(4, device="cuda")
    sinks = torch.randn(4, device="cuda", requires_grad=True)
    table = (0.1 * torch.randn(4, 40, device="cuda")).requires_grad_()
    seqlens = torch.tensor([150, 3], dtype=torch.int32, device="cuda")
    for kwargs in ({"alibi_slopes": slopes}, {"sinks": sinks, "causal": True},
                   {"rel_bias": table, "causal": True, "deterministic": True},
                   {"alibi_slopes": slopes, "sinks": sinks, "rel_bias": table, "softcap": 5.0},
                   {"rel_bias": table, "sinks": sinks, "causal": True, "seqlens": seqlens}):
        q, k, v = rand(2, 4, 197, d), rand(2, 2, 197, d), rand(2, 2, 197, d)
        backward(adaattn.flash_attn(q, k, v, **kwargs))


def lazy_blocks():
    """ring_lazy_attn's block ops (D 64 and 128): a diagonal block and one far past its keys."""
    ops = torch.ops.adaattn
    for d in (64, 128):
        q, k, v, dout = (torch.randn(2, 4, 197, d, device="cuda", dtype=torch.bfloat16)
                         for _ in range(4))
        k, v = k[:, :2], v[:, :2]
        tau = torch.full((4,), -1.0, device="cuda")
        bias = 0.1 * torch.randn(4, 300, device="cuda")
        for q_pos, k_pos in ((197, 197), (600, 0)):
            lse = ops.lazy_block_lse(q, k, tau, bias, None, q_pos, k_pos)
            ops.lazy_block_out(q, k, v, tau, bias, lse, None, q_pos, k_pos)
            delta, _ = ops.lazy_block_row_terms(dout, q, k, v, tau, bias, lse, None, q_pos, k_pos)
            ops.lazy_block_bwd(dout, q, k, v, tau, bias, lse, delta, None, q_pos, k_pos, True)


def main():
    torch.manual_seed(0)
    for d in (64, 128):
        for kwargs in ({}, {"causal": True}, {"window": (33, 0)},
                       {"causal": True, "deterministic": True}, {"softcap": 5.0},
                       {"causal": True, "softcap": 5.0, "deterministic": True}):
            q, k, v = rand(2, 4, 197, d), rand(2, 2, 230, d), rand(2, 2, 230, d)
            backward(adaattn.flash_attn(q, k, v, **kwargs))
        composed(d)
        q, k, v = rand(2, 4, 197, d), rand(2, 4, 197, d), rand(2, 4, 197, d)
        seqlens = torch.tensor([150, 3], dtype=torch.int32, device="cuda")
        for deterministic in (False, True):
            backward(adaattn.flash_attn(q, k, v, causal=True, seqlens=seqlens,
                                        deterministic=deterministic))
    q, k, v = rand(1, 2, 300, 128), rand(1, 2, 300, 128), rand(1, 2, 300, 128)
    layout = torch.rand(1, 2, 3, 3, device="cuda") < 0.5
    layout[0, 0, 1] = False
    mask = adaattn.BlockSparseMask.from_dense(layout, block_size=128)
    for bwd_mode in ("atomic", "two_pass"):
        backward(adaattn.block_sparse_attn(q, k, v, mask, causal=True, bwd_mode=bwd_mode))
    backward(adaattn.block_sparse_attn(q, k, v, mask, causal=True, softcap=5.0))
    tau = torch.full((2,), -1.0, device="cuda", requires_grad=True)
    bias = (0.1 * torch.randn(2, 64, device="cuda")).requires_grad_()
    backward(adaattn.lazy_attn(q, k, v, tau, bias))
    lazy_blocks()
    basis = torch.linalg.qr(torch.randn(1, 2, 128, 32, device="cuda"))[0].bfloat16()
    backward(adaattn.low_rank_attn(q, k, v, basis.requires_grad_(), causal=True))
    for dim in (33, 128):
        x = torch.randn(3, 2 * dim, dim, device="cuda")
        gram = x.mT @ x
        for rel_shift in (1e-3, 0.5):
            torch.ops.adaattn.shifted_cholesky_info(gram, rel_shift)
    for dim, width in ((17, 9), (128, 64)):
        x = torch.randn(3, 2 * dim, dim, device="cuda") * torch.rand(dim, device="cuda") ** 4
        gram = torch.cat([x.mT @ x, torch.zeros(1, dim, dim, device="cuda")])
        omega = torch.randn(dim, width, device="cuda")
        for energy in (0.5, 0.99):
            torch.ops.adaattn.sym_sketch_top(gram, omega, energy, 4, 4, 1, 8, 1e-3)
    decode()
    torch.cuda.synchronize()
    print("sanitize_ops: done")


def decode():
    """KV-cache decode: contiguous and paged (pages of 16 and 64), one and several splits, Lq 1
    and 16, lazy, ALiBi / sinks / relative bias, keys narrower than values, 8-bit pages;
    cache_seqlens past the capacity and block-table entries out of range, which the kernels must
    clamp without reading or writing outside the caches."""
    dt = torch.bfloat16
    for d, lq in ((128, 1), (64, 16)):
        q = torch.randn(3, 8, lq, d, device="cuda", dtype=dt)
        k = torch.randn(3, 2, lq, d, device="cuda", dtype=dt)
        v = torch.randn(3, 2, lq, d, device="cuda", dtype=dt)
        lens = torch.tensor([0, 200, 1024 - lq], dtype=torch.int32, device="cuda")
        cache_k = torch.randn(3, 2, 1024, d, device="cuda", dtype=dt)
        cache_v = torch.randn_like(cache_k)
        tau = torch.full((8,), -1.0, device="cuda")
        bias = 0.1 * torch.randn(8, 64, device="cuda")
        scores = dict(alibi_slopes=torch.rand(3, 8, device="cuda"),
                      sinks=torch.randn(8, device="cuda"), rel_bias=bias)
        for splits in (0, 1, 5):
            adaattn.flash_attn_with_kvcache(q, cache_k, cache_v, k, v, cache_seqlens=lens,
                                            num_splits=splits, softcap=5.0 if splits else 0)
            adaattn.flash_attn_with_kvcache(q, cache_k, cache_v, k, v, cache_seqlens=lens,
                                            num_splits=splits, **scores)
            adaattn.lazy_attn_with_kvcache(q, cache_k, cache_v, k, v, tau, bias,
                                           cache_seqlens=lens, num_splits=splits)
        for page in (16, 64):
            pages = 1024 // page
            pool_k = torch.randn(3 * pages + 1, 2, page, d, device="cuda", dtype=dt)
            pool_v = torch.randn_like(pool_k)
            table = torch.randperm(3 * pages, device="cuda").int().view(3, pages)
            adaattn.flash_attn_with_kvcache(q, pool_k, pool_v, k, v, cache_seqlens=lens,
                                            block_table=table)
            table[1, 3] = -5
            table[2, 0] = 10 ** 6
            bad = torch.tensor([-3, 2000, 1024], dtype=torch.int32, device="cuda")
            adaattn.flash_attn_with_kvcache(q, pool_k, pool_v, k, v, cache_seqlens=bad,
                                            block_table=table)
            adaattn.flash_attn_with_kvcache(q, pool_k, pool_v, k, v, cache_seqlens=bad,
                                            block_table=table, sinks=scores["sinks"])
            for splits in (0, 1):
                adaattn.lazy_attn_with_kvcache(q, pool_k, pool_v, k, v, tau, bias,
                                               cache_seqlens=bad, block_table=table,
                                               num_splits=splits)
    # Narrow keys (a low-rank key cache, D = 32 < Dv = 128), contiguous and paged (page 16).
    q = torch.randn(3, 8, 1, 32, device="cuda", dtype=dt)
    lens = torch.tensor([0, 200, 1023], dtype=torch.int32, device="cuda")
    cache_k = torch.randn(3, 2, 1024, 32, device="cuda", dtype=dt)
    cache_v = torch.randn(3, 2, 1024, 128, device="cuda", dtype=dt)
    for splits in (1, 5):
        adaattn.flash_attn_with_kvcache(q, cache_k, cache_v, cache_seqlens=lens, num_splits=splits)
    table = torch.randperm(3 * 64, device="cuda").int().view(3, 64)
    adaattn.flash_attn_with_kvcache(q, cache_k.view(-1, 2, 16, 32), cache_v.view(-1, 2, 16, 128),
                                    cache_seqlens=lens, block_table=table)
    # The same with the query at full width (128, and 96 with 16 rows per kv head), projected
    # ahead of the decode kernel (float32 and bf16 bases), one and several splits, new rows
    # appended.
    for dim, heads in ((128, 8), (96, 32)):
        q_full = torch.randn(3, heads, 1, dim, device="cuda", dtype=dt)
        for basis in (torch.randn(3, 2, dim, 32, device="cuda"),
                      torch.randn(3, 2, dim, 32, device="cuda", dtype=dt)):
            for splits in (1, 5):
                adaattn.low_rank_attn_with_kvcache(
                    q_full, cache_k, cache_v, basis, torch.randn(3, 2, 1, dim, device="cuda",
                                                                 dtype=dt),
                    torch.randn(3, 2, 1, 128, device="cuda", dtype=dt), cache_seqlens=lens - 1,
                    num_splits=splits)
    # 8-bit pages of 64 keys: 4 and 16 query rows per kv head, keys narrower than values, one
    # and several splits, with the same lengths and table entries out of range.
    for lq, d, dv in ((1, 128, 128), (4, 64, 64), (1, 32, 128)):
        pool_k = torch.randn(3 * 16 + 1, 2, 64, d, device="cuda").to(torch.float8_e4m3fn)
        pool_v = torch.randn(3 * 16 + 1, 2, 64, dv, device="cuda").to(torch.float8_e4m3fn)
        scales = [torch.rand(3 * 16 + 1, 2, device="cuda") for _ in range(2)]
        q = torch.randn(3, 8, lq, d, device="cuda", dtype=dt)
        table = torch.randperm(3 * 16, device="cuda").int().view(3, 16)
        table[1, 3] = -5
        table[2, 0] = 10 ** 6
        bad = torch.tensor([-3, 2000, 1024], dtype=torch.int32, device="cuda")
        for splits in (0, 1, 5):
            adaattn.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=bad,
                                            block_table=table, k_scale=scales[0],
                                            v_scale=scales[1], num_splits=splits)
            if d < dv:  # the query at full width, projected by the kernel
                adaattn.low_rank_attn_with_kvcache(
                    torch.randn(3, 8, lq, 128, device="cuda", dtype=dt), pool_k, pool_v,
                    torch.randn(3, 2, 128, d, device="cuda"), cache_seqlens=bad,
                    block_table=table, k_scale=scales[0], v_scale=scales[1],
                    num_splits=splits)


if __name__ == "__main__":
    main()
