"""Benchmarks causal linear attention (adaattn.linear_attn, tensor-core path) against fla's
``chunk_linear_attn`` and against our causal flash attention, bf16, B=1, H=16,
T in {4k, 16k, 64k}, D = Dv in {64, 128}; forward and forward+backward times in ms.

Like with like: fla's ``chunk_linear_attn`` applies no feature map, multiplies q.k by ``scale``
(default D^-0.5) and, with ``normalize=True``, divides by ``scale * q . cumsum(k) + 1e-10``. The
comparable adaattn call is ``feature_map="identity"``: rows ``linear raw`` compare
``normalize=False`` on both sides with fla's ``scale=1``; rows ``linear norm`` compare
``normalize=True`` (fla's z is its running key sum, ours the state's z column; same maths up to
fla's 1e-10 and scale, which cancels). ``adaattn elu`` is our default (elu+1 features, normalised)
for reference. All inputs are one (B, T, H, D) bf16 tensor per operand, passed to adaattn as
``.transpose(1, 2)`` views (no copy), to fla as is. fla rows are skipped when ``fla`` is not
importable (it needs the fla-core wheel and triton). The last line gives, per D, the smallest T
at which linear attention (raw, ours) beats causal flash attention forward+backward.

Timing: CUDA events around each call, ``--warmup`` untimed calls, median of ``--reps``.

Writes benchmarks/results/linear.json: a case per (D, T, feature setting) with adaattn's
linear_attn, fla's matching call (raw, norm) and our causal flash_attn in the same run; prints
the table.

    python benchmarks/bench_linear.py [--lengths 4096,16384,65536] [--dims 64,128]
                                      [--heads 16] [--reps 20] [--warmup 5] [--results-dir DIR]
"""
import argparse
import os
import statistics
import sys
from typing import Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_io  # noqa: E402

try:
    import adaattn  # noqa: E402
except ImportError as _import_error:  # not built yet: --help still works
    adaattn = None
    IMPORT_ERROR: Optional[ImportError] = _import_error
else:
    IMPORT_ERROR = None

DTYPE = torch.bfloat16


def median_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median wall time of ``fn`` on the current stream in ms (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def load_fla() -> Optional[Callable]:
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except Exception as exc:  # ImportError, or triton failing to initialise
        print(f"fla not available ({type(exc).__name__}: {exc}); skipping its rows",
              file=sys.stderr)
        return None
    return chunk_linear_attn


def peers(fla: Optional[Callable]) -> Dict[str, Callable]:
    """name -> fn(q, k, v) on (B, T, H, D) tensors, returning the (B, T, H, D) output."""
    def ours(op: Callable, **kwargs):
        return lambda q, k, v: op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  **kwargs).transpose(1, 2)

    table = {
        "adaattn linear raw": ours(adaattn.linear_attn, feature_map="identity", normalize=False),
        "adaattn linear norm": ours(adaattn.linear_attn, feature_map="identity", normalize=True),
        "adaattn elu": ours(adaattn.linear_attn, feature_map="elu", normalize=True),
        "adaattn flash causal": ours(adaattn.flash_attn, causal=True),
    }
    if fla is not None:
        table["fla linear raw"] = lambda q, k, v: fla(q, k, v, scale=1.0, normalize=False)[0]
        table["fla linear norm"] = lambda q, k, v: fla(q, k, v, normalize=True)[0]
    return table


def measure(fn: Callable, d: int, length: int, heads: int, warmup: int,
            reps: int) -> Tuple[float, float]:
    """(forward ms, forward+backward ms) of ``fn`` at B=1, the given shape."""
    q, k, v = (torch.randn(1, length, heads, d, device="cuda", dtype=DTYPE, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(1, length, heads, d, device="cuda", dtype=DTYPE)
    leaves = (q, k, v)

    def forward():
        with torch.no_grad():
            return fn(q, k, v)

    def forward_backward():
        return torch.autograd.grad(fn(q, k, v), leaves, grad)

    return median_ms(forward, warmup, reps), median_ms(forward_backward, warmup, reps)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4096,16384,65536")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-fla", action="store_true", help="skip fla even if importable")
    results_io.add_arguments(parser, "linear")
    args = parser.parse_args(argv)
    if adaattn is None:
        print(results_io.import_error_message("bench_linear.py", IMPORT_ERROR), file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_linear.py needs a CUDA device", file=sys.stderr)
        return 2
    lengths = [int(x) for x in args.lengths.split(",")]
    dims = [int(x) for x in args.dims.split(",")]
    table = peers(None if args.no_fla else load_fla())

    lines = [f"bf16, B=1, H={args.heads}, causal, D = Dv; {torch.cuda.get_device_name()}; "
             f"median of {args.reps} (CUDA events)", "",
             "| D | T | peer | fwd ms | fwd+bwd ms |", "|---:|---:|:---|---:|---:|"]
    results: Dict[Tuple[int, int, str], Tuple[float, float]] = {}
    for d in dims:
        for length in lengths:
            for name, fn in table.items():
                try:
                    results[(d, length, name)] = measure(fn, d, length, args.heads, args.warmup,
                                                         args.reps)
                    fwd, fwdbwd = results[(d, length, name)]
                    lines.append(f"| {d} | {length} | {name} | {fwd:.3f} | {fwdbwd:.3f} |")
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    lines.append(f"| {d} | {length} | {name} | OOM | OOM |")
                print(lines[-1], flush=True)
    lines.append("")
    for d in dims:
        won = [t for t in lengths
               if (d, t, "adaattn linear raw") in results and (d, t, "adaattn flash causal")
               in results and results[(d, t, "adaattn linear raw")][1]
               < results[(d, t, "adaattn flash causal")][1]]
        where = f"T = {min(won)}" if won else "no measured T"
        lines.append(f"D = {d}: linear (raw) beats causal flash forward+backward from {where} "
                     f"(of {lengths}).")
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        title = f"linear attention: bf16, B = 1, H = {args.heads}, causal, D = Dv"
        setup = ("raw: identity features without normalisation (fla scale=1, normalize=False); "
                 "norm: identity features, normalised (fla's default); elu: our default "
                 "(elu + 1, normalised), no fla equivalent; adaattn-flash-causal: our causal "
                 "flash_attn at the same shape; inputs (B, T, H, D), passed to adaattn as "
                 f"transposed views; time: CUDA events, median of {args.reps} after "
                 f"{args.warmup} warm-up calls")
        path = results_io.write(args.family or "linear",
                                json_rows(results, dims, lengths, args.heads, table),
                                title=title, setup=setup, argv=[sys.argv[0]] + list(argv),
                                results_dir=args.results_dir)
        print(f"\nwrote {path}")
    return 0


# (case suffix, our peer name in ``peers``, fla's peer name)
SETTINGS = (("raw", "adaattn linear raw", "fla linear raw"),
            ("norm", "adaattn linear norm", "fla linear norm"),
            ("elu", "adaattn elu", None))


def json_rows(results: Dict[Tuple[int, int, str], Tuple[float, float]], dims: List[int],
              lengths: List[int], heads: int, table: Dict[str, Callable]) -> List[dict]:
    """results_io rows: one case per (D, T, setting); a peer that ran out of memory is None."""
    out = []
    for d in dims:
        for length in lengths:
            for setting, ours, fla in SETTINGS:
                names = [("adaattn", ours)] + ([("fla", fla)] if fla in table else []) + \
                        [("adaattn-flash-causal", "adaattn flash causal")]
                oom = [peer for peer, name in names if (d, length, name) not in results]
                for i, direction in enumerate(("fwd", "fwd+bwd")):
                    ms = {peer: results[(d, length, name)][i] if (d, length, name) in results
                          else None for peer, name in names}
                    out.append(results_io.row(
                        f"D={d} T={length} {setting}", direction, ms,
                        note="; ".join(f"{peer}: out of memory" for peer in oom),
                        config={"d": d, "t": length, "h": heads, "b": 1}))
    return out


if __name__ == "__main__":
    sys.exit(main())
