"""Benchmarks adaattn.lazy_attn on CUDA (issue bar: B=4, H=16, L=4096, D=128, W=512, tau=-1).

Configs as bench_attention.py (bf16, B*L = 16384, H*D = 2048, D in {64, 128}, L in {1k, 4k, 16k}),
causal, bias window W = 512, tau = -1, bias ~ 0.1 N(0, 1). Rows in the same run: adaattn.lazy_attn
(with tau and bias requiring grad), adaattn.flash_attn causal (the bar's "our own flash"), and
the eager reference (adaattn.reference.lazy_attn, where its L x L matrices fit). Times are
medians of triton's do_bench; TFLOP/s use the causal flash count (so lazy and flash compare
directly); peak memory is one forward+backward above the inputs. The zero-weight and
skipped-tile fractions are the op's own statistics for the same inputs.

Writes benchmarks/results/lazy.json (``--quick``: lazy-quick.json; adaattn = adaattn-lazy, the
other rows its peers) and prints the tables.

    python benchmarks/bench_lazy.py [--quick] [--results-dir DIR]
"""
import argparse
import os
import sys
import warnings
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (also puts the in-place build on sys.path)
import results_io  # noqa: E402

adaattn = ba.adaattn  # None when the extension is not built (--help still works)

WINDOW = 512
TAU = -1.0
# The eager reference keeps about this many float32 L x L matrices alive in forward+backward.
REFERENCE_LXL_COPIES = 12


def configs(quick: bool) -> List[ba.Config]:
    if quick:
        return [ba.Config(128, 4096, True)]
    return [ba.Config(d, length, True) for d in (64, 128) for length in (1024, 4096, 16384)]


def _params(cfg: ba.Config):
    tau = torch.full((cfg.heads,), TAU, device="cuda", requires_grad=True)
    bias = (0.1 * torch.randn(cfg.heads, WINDOW, device="cuda")).requires_grad_()
    return tau, bias


def _lazy(cfg: ba.Config) -> Callable:
    tau, bias = _params(cfg)
    return lambda q, k, v: adaattn.lazy_attn(q, k, v, tau, bias)


def _flash(cfg: ba.Config) -> Callable:
    return lambda q, k, v: adaattn.flash_attn(q, k, v, causal=True)


def _reference(cfg: ba.Config) -> Callable:
    need = REFERENCE_LXL_COPIES * cfg.batch * cfg.heads * cfg.length ** 2 * 4
    have = torch.cuda.get_device_properties(0).total_memory
    if need > 0.7 * have:
        raise ba.PeerSkipped(f"skipped: ~{need / 2**30:.0f} GiB of L x L matrices would not fit")
    tau, bias = _params(cfg)
    return lambda q, k, v: adaattn.reference.lazy_attn(q, k, v, tau, bias)[0]


PEERS: Dict[str, Callable[[ba.Config], Callable]] = {
    "adaattn-lazy": _lazy,
    "adaattn-flash-causal": _flash,
    "reference-lazy-eager": _reference,
}


def sparsity(cfg: ba.Config) -> str:
    """The op's zero-weight and skipped-tile fractions on the benchmark's inputs."""
    q, k, v = (torch.randn(cfg.batch, cfg.heads, cfg.length, cfg.d, device="cuda",
                           dtype=ba.DTYPE) for _ in range(3))
    tau, bias = _params(cfg)
    with torch.no_grad():
        _, stats = adaattn.lazy_attn(q, k, v, tau, bias, return_stats=True)
    return (f"zero weights {stats.zero_weight_fraction.item():.3f}, "
            f"skipped tiles {stats.skipped_block_fraction.item():.3f}")


def render_ratios(rows: List[ba.Row]) -> str:
    by_key = {(r.cfg, r.peer): r for r in rows}
    lines = ["| D | L | B | H | lazy fwd+bwd ms | vs our causal flash | peak vs our flash "
             "| speed-up vs eager | sparsity |", "|---:|---:|---:|---:|---:|---:|---:|---:|:---|"]
    for cfg in dict.fromkeys(r.cfg for r in rows):
        lazy = by_key.get((cfg, "adaattn-lazy"))
        flash = by_key.get((cfg, "adaattn-flash-causal"))
        eager = by_key.get((cfg, "reference-lazy-eager"))

        def ratio(a: Optional[float], b: Optional[float]) -> str:
            return "—" if a is None or b is None else f"{a / b:.2f}x"
        lines.append(
            f"| {cfg.d} | {cfg.length} | {cfg.batch} | {cfg.heads} "
            f"| {ba._fmt(lazy and lazy.fwdbwd_ms, '.3f')} "
            f"| {ratio(lazy and lazy.fwdbwd_ms, flash and flash.fwdbwd_ms)} "
            f"| {ratio(lazy and lazy.peak_mib, flash and flash.peak_mib)} "
            f"| {ratio(eager and eager.fwdbwd_ms, lazy and lazy.fwdbwd_ms)} "
            f"| {lazy.note if lazy else ''} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="only D=128, L=4096 (the bar)")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"comma-separated subset of {','.join(PEERS)}")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    results_io.add_arguments(parser, "lazy, or lazy-quick with --quick")
    args = parser.parse_args(argv[1:])
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = set(peers) - set(PEERS)
    if unknown:
        parser.error(f"unknown peers {sorted(unknown)}; choose from {list(PEERS)}")
    if adaattn is None:
        print(results_io.import_error_message("bench_lazy.py", ba.IMPORT_ERROR),
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_lazy.py needs a CUDA device", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", category=UserWarning)
    ba.PEERS.update(PEERS)  # ba.measure looks peers up by name

    family = args.family or ("lazy-quick" if args.quick else "lazy")
    title = (f"lazy attention{' (quick subset)' if args.quick else ''}: bf16, causal, "
             f"W = {WINDOW}, tau = {TAU}, B·L = {ba.TOKENS}, H·D = {ba.HIDDEN}")
    setup = ("bias ~ 0.1 N(0, 1), tau and bias requiring grad; note: the op's zero-weight and "
             f"skipped-tile fractions; {ba.TIMING}")
    meta = ba.run_metadata(argv)
    rows: List[ba.Row] = []
    for cfg in configs(args.quick):
        for peer in peers:
            row = ba.measure(peer, cfg, args)
            if peer == "adaattn-lazy" and row.fwd_ms is not None:
                row.note = sparsity(cfg)
            rows.append(row)
            print(ba.render_table([row]).splitlines()[-1], flush=True)
        if not args.no_write:
            path = results_io.write(family, ba.json_rows(rows, ours="adaattn-lazy"),
                                    title=title, setup=setup, argv=argv,
                                    results_dir=args.results_dir)
    print()
    print("## " + title)
    print(meta)
    print(ba.render_table(rows))
    print()
    print(render_ratios(rows))
    if not args.no_write:
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
