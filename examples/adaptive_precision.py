"""Adaptive precision: which heads run 8-bit, at what error, and at what speed (docs/ops.md).

Planted heads (D = 128, N(0, 1) unless said): two plain, two whose queries match one key each
(peaked rows, as trained models), two with outlier K channels (4 channels x8 and per-channel
offsets), two with q and k scaled 4x (large logits, the heads "auto" must keep at bf16). The
script prints, per head, the estimated 8-bit error (``adaattn.precision.estimate_precision_error``),
the actual relative L2 error of ``precision="fp8"`` against float64, and what
``precision="auto"`` chose; then (CUDA, sm_90) forward times of bf16, fp8 and auto on those heads
at B=4, H=16, L=4096, and saves a PNG of error against time.

    pip install -r requirements-examples.txt        # matplotlib, for the PNG
    python examples/adaptive_precision.py [--device auto|cpu|cuda] [--out adaptive_precision.png]

On the CPU the 8-bit forward is its emulation (the same quantisation, float32 arithmetic).
"""
import argparse
import os
import sys
import time
from typing import List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # plotting.py

import adaattn  # noqa: E402
from adaattn import precision as P  # noqa: E402

KINDS = ("plain", "plain", "peaked", "peaked", "outlier", "outlier", "x4", "x4")


def planted(batch: int, length: int, dim: int, gen: torch.Generator, repeat: int = 1):
    """q, k, v [B, 8 * repeat, L, D] float32, head h of kind KINDS[h % 8]."""
    heads = len(KINDS) * repeat
    q, k, v = (torch.randn(batch, heads, length, dim, generator=gen) for _ in range(3))
    for h in range(heads):
        kind = KINDS[h % len(KINDS)]
        if kind in ("peaked", "outlier"):
            match = torch.randint(0, length, (batch, length), generator=gen)
            keys = torch.gather(k[:, h], 1, match.unsqueeze(-1).expand(-1, -1, dim))
            q[:, h] = 0.5 * q[:, h] + 2.0 * keys
        if kind == "outlier":
            k[:, h, :, :4] *= 8
            k[:, h] += 3 * torch.randn(batch, 1, dim, generator=gen)
        if kind == "x4":
            q[:, h] *= 4
            k[:, h] *= 4
    return q, k, v


def rel_err(out, ref):
    return ((out.double() - ref).flatten(2).norm(dim=-1) / ref.flatten(2).norm(dim=-1))[0]


def time_ms(fn, reps: int = 20) -> float:
    with torch.no_grad():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--length", type=int, default=1024, help="L of the per-head table")
    parser.add_argument("--out", default="adaptive_precision.png")
    parser.add_argument("--no-plot", action="store_true", help="print only, save no PNG")
    args = parser.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    fp8_kernel = device == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    if device == "cuda" and not fp8_kernel:
        print("precision='fp8' runs on sm_90 GPUs; using the CPU emulation")
        device = "cpu"
    gen = torch.Generator().manual_seed(0)
    q, k, v = (t.to(device, torch.bfloat16) for t in planted(1, args.length, 128, gen))
    ref = adaattn.reference.flash_attn(q.double(), k.double(), v.double())[0]
    with torch.no_grad():
        fp8 = adaattn.flash_attn(q, k, v, precision="fp8")
        auto, chosen = adaattn.flash_attn(q, k, v, precision="auto", return_precision=True)
        bf16 = adaattn.flash_attn(q, k, v)
    estimate = P.estimate_precision_error(q, k, v)[0]
    errors = {"bf16": rel_err(bf16, ref), "fp8": rel_err(fp8, ref), "auto": rel_err(auto, ref)}
    print(f"fp8_tol = {P.FP8_TOL}; L = {args.length}, D = 128, {device}")
    print(f"{'head':>4} {'kind':>8} {'estimate':>9} {'fp8 err':>8} {'bf16 err':>9} "
          f"{'auto runs':>9} {'auto err':>8}")
    for h, kind in enumerate(KINDS):
        print(f"{h:4d} {kind:>8} {estimate[h]:9.4f} {errors['fp8'][h]:8.4f} "
              f"{errors['bf16'][h]:9.5f} {'fp8' if chosen[0, h] else 'bf16':>9} "
              f"{errors['auto'][h]:8.4f}")
    times = {}
    if fp8_kernel:
        qb, kb, vb = (t.to("cuda", torch.bfloat16) for t in planted(4, 4096, 128, gen, repeat=2))
        for mode in ("bf16", "fp8", "auto"):
            times[mode] = time_ms(lambda: adaattn.flash_attn(qb, kb, vb, precision=mode))
        print("forward, B=4 H=16 L=4096 D=128: " +
              ", ".join(f"{m} {t:.3f} ms" for m, t in times.items()))
    if args.no_plot:
        return 0
    from plotting import require_pyplot
    plt = require_pyplot("adaptive_precision.py")
    fig, axes = plt.subplots(1, 2 if times else 1, figsize=(11 if times else 6, 4), squeeze=False)
    ax = axes[0][0]
    colors = ["tab:green" if c else "tab:red" for c in chosen[0].tolist()]
    ax.scatter(estimate.cpu(), errors["fp8"].cpu(), c=colors)
    for h, kind in enumerate(KINDS):
        ax.annotate(kind, (estimate[h].item(), errors["fp8"][h].item()), fontsize=7)
    ax.axvline(P.FP8_TOL, color="gray", ls="--", label="fp8_tol")
    ax.set(xlabel="estimated fp8 error", ylabel="actual fp8 error (vs float64)",
           title="per head (green: auto runs fp8)")
    ax.legend()
    if times:
        ax = axes[0][1]
        for mode, t in times.items():
            ax.scatter(t, errors[mode].max().item(), s=60)
            ax.annotate(mode, (t, errors[mode].max().item()))
        ax.set(xlabel="forward ms (B=4, H=16, L=4096)", ylabel="worst head's error",
               yscale="log", title="error against speed")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
