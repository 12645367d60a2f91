"""Benchmarks adaptive-rank attention on CUDA (issue bar: bf16, B=4, H=16, L=4096, D=128).

Rows in the same run:
* planted: q, k of effective rank 32 per kv head plus 1% noise; ``rank_plan(energy=0.99)``, then
  ``low_rank_attn`` at the planned rank against ``flash_attn`` at the same shape (forward and
  forward+backward), with the relative output error ``||O_low - O|| / ||O||`` against float32
  SDPA on the bf16 inputs, and the plan's own cost (reusable across steps and layers);
* random: full-rank random q, k; ``adaptive_rank_attn`` (plan + attention, R = D) against
  ``flash_attn``.
Causal and not. Times are medians of triton's do_bench (L2 flushed between calls).

Writes benchmarks/results/low-rank.json (adaattn = low_rank_attn or adaptive_rank_attn, peer
adaattn-flash = flash_attn on the same inputs) and prints the table.

    python benchmarks/bench_low_rank.py [--results-dir DIR]
"""
import argparse
import os
import sys
from typing import List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (also puts the in-place build on sys.path)
import results_io  # noqa: E402

adaattn = ba.adaattn  # None when the extension is not built (--help still works)

B, H, L, D = 4, 16, 4096, 128
PLANTED_RANK, NOISE, ENERGY = 32, 0.01, 0.99


def planted_qk(rank: int, noise: float, generator: torch.Generator):
    """q, k [B, H, L, D] bf16 near one rank-`rank` subspace per head, unit-scale entries."""
    basis = torch.linalg.qr(torch.randn(B, H, D, rank, device="cuda", generator=generator))[0]
    scale = (D / rank) ** 0.5

    def draw():
        x = torch.randn(B, H, L, rank, device="cuda", generator=generator) @ basis.mT * scale
        return (x + noise * torch.randn(x.shape, device="cuda", generator=generator)).bfloat16()

    return draw(), draw()


def bench(fn, inputs, dout, args):
    """(forward ms, forward+backward ms) of fn(*inputs) -> out."""
    grads = [t for t in inputs if t.requires_grad]

    def fwd_bwd():
        fn(*inputs).backward(dout)

    fwd = ba._do_bench(lambda: fn(*inputs), args.warmup, args.rep, grads)
    both = ba._do_bench(fwd_bwd, args.warmup, args.rep, grads)
    return fwd, both


def fmt(x: Optional[float], spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def run(args, json_rows: Optional[List[dict]] = None) -> str:
    """The markdown table; with ``json_rows``, also appends the results_io rows to it."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines: List[str] = []
    lines.append("| inputs | causal | rank R (plan) | plan ms | op | fwd ms | fwd+bwd ms | "
                 "flash fwd ms | flash fwd+bwd ms | fwd speedup | fwd+bwd speedup | "
                 "rel. error |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    v = torch.randn(B, H, L, D, device="cuda", generator=gen).bfloat16()
    dout = torch.randn(B, H, L, D, device="cuda", generator=gen).bfloat16()
    for kind in ("planted", "random"):
        if kind == "planted":
            q, k = planted_qk(PLANTED_RANK, NOISE, gen)
        else:
            q = torch.randn(B, H, L, D, device="cuda", generator=gen).bfloat16()
            k = torch.randn(B, H, L, D, device="cuda", generator=gen).bfloat16()
        plan = adaattn.rank_plan(q, k, energy=ENERGY)
        ranks = plan.ranks.unique().tolist()
        plan_ms = ba._do_bench(lambda: adaattn.rank_plan(q, k, energy=ENERGY), args.warmup,
                               args.rep, [])
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        for causal in (False, True):
            flash = bench(lambda a, b, c: adaattn.flash_attn(a, b, c, causal=causal),
                          (qg, kg, vg), dout, args)
            if kind == "planted":
                basis = plan.basis.requires_grad_(True)
                name = "low_rank_attn"
                ours = bench(lambda a, b, c, u: adaattn.low_rank_attn(a, b, c, u, causal=causal),
                             (qg, kg, vg, basis), dout, args)
                with torch.no_grad():
                    low = adaattn.low_rank_attn(q, k, v, plan.basis, causal=causal).float()
                    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                           is_causal=causal)
                    error = (torch.linalg.vector_norm(low - exact)
                             / torch.linalg.vector_norm(exact)).item()
            else:
                name = "adaptive_rank_attn (plan + attention)"
                ours = bench(lambda a, b, c: adaattn.adaptive_rank_attn(
                    a, b, c, energy=ENERGY, causal=causal), (qg, kg, vg), dout, args)
                error = None
            lines.append(
                f"| {kind} | {causal} | {ranks} (width {plan.basis.shape[-1]}) | {plan_ms:.3f} | "
                f"{name} | {ours[0]:.3f} | {ours[1]:.3f} | {flash[0]:.3f} | {flash[1]:.3f} | "
                f"{flash[0] / ours[0]:.2f}x | {flash[1] / ours[1]:.2f}x | "
                f"{fmt(error, '.2e')} |")
            print(lines[-1], flush=True)
            if json_rows is not None:
                case = (f"{kind} q/k, {'causal' if causal else 'non-causal'}: {name}, "
                        f"rank {'/'.join(map(str, ranks))}")
                for i, direction in enumerate(("fwd", "fwd+bwd")):
                    json_rows.append(results_io.row(
                        case, direction, {"adaattn": ours[i], "adaattn-flash": flash[i]},
                        plan_ms=round(plan_ms, 4), ranks=ranks, rel_error=error,
                        config={"b": B, "h": H, "l": L, "d": D, "causal": causal}))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetitions (ms)")
    results_io.add_arguments(parser, "low-rank")
    args = parser.parse_args(argv[1:])
    if adaattn is None:
        print(results_io.import_error_message("bench_low_rank.py", ba.IMPORT_ERROR),
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_low_rank: needs a CUDA device")
        return 1
    title = f"adaptive-rank attention: bf16, B = {B}, H = {H}, L = {L}, D = {D}"
    setup = (f"planted: q, k of effective rank {PLANTED_RANK} + {NOISE:.0%} noise, "
             f"rank_plan(energy={ENERGY}) then low_rank_attn (basis gradient included); random: "
             "full-rank q, k through adaptive_rank_attn (plan + attention); rel_error against "
             "float32 SDPA on the same bf16 inputs; plan_ms: rank_plan alone; time: median of "
             "triton.testing.do_bench")
    json_rows: List[dict] = []
    table = run(args, json_rows)
    body = "\n".join([
        "## " + title, "", ba.run_metadata(argv), "- " + setup, "", table])
    print(body)
    if not args.no_write:
        path = results_io.write(args.family or "low-rank", json_rows, title=title, setup=setup,
                                argv=argv, results_dir=args.results_dir)
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
