"""Adaptive-rank attention for prefill and decode on inputs with a planted spectrum (docs/ops.md;
§3.9).

Queries and keys of each head have an exponentially decaying spectrum whose decay length differs
per head (2 to 16 of D = 128 directions), plus small isotropic noise. The script prints the
per-head ranks that ``adaattn.rank_plan`` picks, then for energy in {0.9, 0.95, 0.99, 0.999}:
the realised ranks; the relative output error of ``adaattn.low_rank_attn`` against exact
attention, next to the rigorous ``adaattn.rank_error_bound`` and the sampled
``adaattn.rank_error_estimate`` (all relative, ``||.||_F / ||O||_F`` over heads); and forward
times against ``adaattn.flash_attn``: the plan alone (``method="sketch"``), attention with the
plan reused (``low_rank_attn``) and planning every call (``adaptive_rank_attn``). Then decode:
the prefill's keys become a KV cache, projected onto the plan's bases for
``adaattn.low_rank_attn_with_kvcache`` (R + D values per cached token instead of 2D), and the
last DECODE_ROWS query rows attend it as new tokens: their error (actual, bound, estimate) and
the time of a one-token decode step against ``adaattn.flash_attn_with_kvcache`` on the
full-width cache. It saves a PNG of the errors and speed-ups against energy, prefill and
decode.

    pip install -r requirements-examples.txt        # matplotlib, for the PNG
    python examples/adaptive_rank.py [--device auto|cpu|cuda] [--out adaptive_rank.png]

CUDA times bfloat16 at B=4, H=16, L=4096 (decode: B=32 sequences of that cache length); the
errors are measured in float32 on the first batch entry. The CPU runs everything in float32 at a
smaller shape.
"""
import argparse
import os
import sys
import time
from typing import Callable, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # plotting.py

import adaattn  # noqa: E402
from plotting import require_pyplot  # noqa: E402

ENERGIES = (0.9, 0.95, 0.99, 0.999)
HEAD_DIM = 128
NOISE = 0.01
DECODE_ROWS = 64  # query rows whose decode error is measured (each attends the whole cache)


def planted_inputs(batch: int, heads: int, length: int, device: str, dtype: torch.dtype,
                   gen: torch.Generator):
    """q, k, v [B, H, L, D]. q and k of head h have singular values exp(-i / l_h) along a random
    orthonormal basis (decay length l_h = 2 * (h % 8 + 1), so the rank that holds a given energy
    differs per head and grows with the energy) plus isotropic noise; v is isotropic."""
    decay = [2 * (h % 8 + 1) for h in range(heads)]
    q = torch.empty(batch, heads, length, HEAD_DIM)
    k = torch.empty_like(q)
    index = torch.arange(HEAD_DIM, dtype=torch.float32)
    for h, ell in enumerate(decay):
        spectrum = torch.exp(-index / ell)
        spectrum *= HEAD_DIM ** 0.5 / torch.linalg.vector_norm(spectrum)  # unit-scale entries
        basis = torch.linalg.qr(torch.randn(batch, HEAD_DIM, HEAD_DIM, generator=gen))[0]
        for t in (q, k):
            t[:, h] = (torch.randn(batch, length, HEAD_DIM, generator=gen) * spectrum) @ basis.mT
    q += NOISE * torch.randn(q.shape, generator=gen)
    k += NOISE * torch.randn(k.shape, generator=gen)
    v = torch.randn(q.shape, generator=gen)
    return [t.to(device, dtype) for t in (q, k, v)], decay


def time_ms(fn: Callable, device: str, reps: int = 20) -> float:
    """Median milliseconds per call after a warm-up."""
    fn()
    times: List[float] = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def decode_errors(q1, k1, v1, basis1):
    """Relative errors (actual, bound, estimate) of the last DECODE_ROWS query rows, each
    attending every cached key (as new tokens after the prefill), against exact attention:
    the low-rank cache's decode rows are those of ``low_rank_attn`` on the same rows."""
    q_new = q1[:, :, -DECODE_ROWS:]
    exact = adaattn.flash_attn(q_new, k1, v1)
    norm = torch.linalg.vector_norm(exact).item()
    k_low = (k1 @ basis1).to(k1.dtype)
    approx = adaattn.low_rank_attn_with_kvcache(
        q_new, k_low, v1, basis1, cache_seqlens=torch.full(
            (q1.shape[0],), k1.shape[2], dtype=torch.int32, device=q1.device), causal=False)
    error = torch.linalg.vector_norm(approx - exact).item() / norm
    bound = torch.linalg.vector_norm(adaattn.rank_error_bound(q_new, k1, v1, basis1)).item()
    estimate = torch.linalg.vector_norm(
        adaattn.rank_error_estimate(q_new, k1, v1, basis1, samples=16)).item()
    return error, bound / norm, estimate / norm


def decode_times(q, k, v, basis, device, batch):
    """Milliseconds of one decode step (one new token per sequence, the cache full) of ``batch``
    sequences whose caches hold the prefill's keys and values: the full-width cache
    (``flash_attn_with_kvcache``) and the low-rank key cache (``low_rank_attn_with_kvcache``,
    keys ``k U`` of width R)."""
    reps = (batch + q.shape[0] - 1) // q.shape[0]
    k_cache, v_cache = (t.repeat(reps, 1, 1, 1)[:batch] for t in (k, v))
    basis = basis.repeat(reps, 1, 1, 1)[:batch]
    k_low = (k_cache.float() @ basis.float()).to(k.dtype)
    q_new = q[:, :, -1:].repeat(reps, 1, 1, 1)[:batch]
    seqlens = torch.full((batch,), k.shape[2], dtype=torch.int32, device=q.device)
    full_ms = time_ms(lambda: adaattn.flash_attn_with_kvcache(q_new, k_cache, v_cache,
                                                              cache_seqlens=seqlens), device)
    low_ms = time_ms(lambda: adaattn.low_rank_attn_with_kvcache(q_new, k_low, v_cache, basis,
                                                                cache_seqlens=seqlens), device)
    return full_ms, low_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", default="adaptive_rank.png", help="PNG path")
    args = parser.parse_args()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    if device == "cuda":
        batch, heads, length, dtype, decode_batch = 4, 16, 4096, torch.bfloat16, 32
    else:
        batch, heads, length, dtype, decode_batch = 1, 8, 512, torch.float32, 4
    (q, k, v), dims = planted_inputs(batch, heads, length, device, dtype, gen)
    q1, k1, v1 = (t[:1].float() for t in (q, k, v))  # errors: float32, first batch entry
    exact = adaattn.flash_attn(q1, k1, v1)
    exact_norm = torch.linalg.vector_norm(exact).item()

    print(f"device {device}, {dtype}, B={batch} H={heads} L={length} D={HEAD_DIM}; spectral "
          f"decay length per head: {dims}")
    plan = adaattn.rank_plan(q, k, energy=0.99)
    print("per-head ranks at energy 0.99 (batch entry 0):", plan.ranks[0].tolist())

    flash_ms = time_ms(lambda: adaattn.flash_attn(q, k, v), device)
    print(f"\nflash_attn forward: {flash_ms:.3f} ms")
    print(f"{'energy':>7} | {'ranks':>8} | {'width':>5} | {'rel. error':>10} | "
          f"{'rel. bound':>10} | {'estimate':>10} | {'plan ms':>7} | {'reused ms':>9} | "
          f"{'per call ms':>11} | {'reused':>6} | {'per call':>8}")
    rows = []
    for energy in ENERGIES:
        plan = adaattn.rank_plan(q, k, energy=energy)
        plan_ms = time_ms(lambda: adaattn.rank_plan(q, k, energy=energy), device)
        low_ms = time_ms(lambda: adaattn.low_rank_attn(q, k, v, plan.basis), device)
        each_ms = time_ms(lambda: adaattn.adaptive_rank_attn(q, k, v, energy=energy), device)
        basis1 = plan.basis[:1]
        approx = adaattn.low_rank_attn(q1, k1, v1, basis1)
        error = torch.linalg.vector_norm(approx - exact).item() / exact_norm
        bound = torch.linalg.vector_norm(adaattn.rank_error_bound(q1, k1, v1, basis1)).item()
        estimate = torch.linalg.vector_norm(
            adaattn.rank_error_estimate(q1, k1, v1, basis1)).item()
        rows.append((energy, error, bound / exact_norm, estimate / exact_norm,
                     flash_ms / low_ms, flash_ms / each_ms))
        ranks = plan.ranks
        print(f"{energy:>7} | {f'{int(ranks.min())}..{int(ranks.max())}':>8} | "
              f"{plan.basis.shape[-1]:>5} | {error:>10.2e} | {bound / exact_norm:>10.2e} | "
              f"{estimate / exact_norm:>10.2e} | {plan_ms:>7.3f} | {low_ms:>9.3f} | "
              f"{each_ms:>11.3f} | {flash_ms / low_ms:>5.2f}x | {flash_ms / each_ms:>7.2f}x")

    print(f"\ndecode: the last {DECODE_ROWS} query rows against the cache of L={length} keys "
          f"(errors); one new token of {decode_batch} sequences (times)")
    print(f"{'energy':>7} | {'width':>5} | {'rel. error':>10} | {'rel. bound':>10} | "
          f"{'estimate':>10} | {'full ms':>7} | {'low-rank ms':>11} | {'speed-up':>8}")
    decode_rows = []
    for energy in ENERGIES:
        plan = adaattn.rank_plan(q, k, energy=energy)
        error, bound, estimate = decode_errors(q1, k1, v1, plan.basis[:1])
        basis = plan.basis.to(dtype)
        full_ms, low_ms = decode_times(q, k, v, basis, device, decode_batch)
        decode_rows.append((energy, error, bound, estimate, full_ms / low_ms))
        print(f"{energy:>7} | {plan.basis.shape[-1]:>5} | {error:>10.2e} | {bound:>10.2e} | "
              f"{estimate:>10.2e} | {full_ms:>7.3f} | {low_ms:>11.3f} | "
              f"{full_ms / low_ms:>7.2f}x")

    plt = require_pyplot("examples/adaptive_rank.py")  # after the tables, which need no plot
    fig, ((ax_err, ax_speed), (ax_derr, ax_dspeed)) = plt.subplots(2, 2, figsize=(11, 8))
    energies = [r[0] for r in rows]
    ax_err.semilogy(energies, [r[1] for r in rows], "o-", label="actual")
    ax_err.semilogy(energies, [r[2] for r in rows], "s--", label="rigorous bound")
    ax_err.semilogy(energies, [r[3] for r in rows], "^:", label="sampled estimate")
    ax_err.set(title="relative output error vs energy", xlabel="energy",
               ylabel="||O_low - O||_F / ||O||_F")
    ax_err.legend()
    ax_speed.plot(energies, [r[4] for r in rows], "o-", label="plan reused (low_rank_attn)")
    ax_speed.plot(energies, [r[5] for r in rows], "s--",
                  label="plan every call (adaptive_rank_attn)")
    ax_speed.axhline(1.0, color="grey", linewidth=0.8)
    ax_speed.set(title=f"prefill forward speed-up over flash_attn ({device})", xlabel="energy",
                 ylabel="flash time / adaptive-rank time")
    ax_speed.legend()
    ax_derr.semilogy(energies, [r[1] for r in decode_rows], "o-", label="actual")
    ax_derr.semilogy(energies, [r[2] for r in decode_rows], "s--", label="rigorous bound")
    ax_derr.semilogy(energies, [r[3] for r in decode_rows], "^:", label="sampled estimate")
    ax_derr.set(title=f"decode: relative error of the last {DECODE_ROWS} rows", xlabel="energy",
                ylabel="||O_low - O||_F / ||O||_F")
    ax_derr.legend()
    ax_dspeed.plot(energies, [r[4] for r in decode_rows], "o-")
    ax_dspeed.axhline(1.0, color="grey", linewidth=0.8)
    ax_dspeed.set(title=f"decode step speed-up, low-rank key cache ({device})", xlabel="energy",
                  ylabel="full-cache time / low-rank-cache time")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"\nsaved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
