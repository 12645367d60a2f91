"""Benchmarks adaattn.block_sparse_attn on CUDA against compiled FlexAttention on the same masks
(issue bar: bf16, D=128, H=16, causal; B=4 L=4096 and B=1 L=16384).

Masks (128x128 blocks, causal within them):
* window: a block-aligned causal sliding window of 8 blocks (query block i sees key blocks
  i-7 .. i), built as a FlexAttention BlockMask and converted with BlockSparseMask.from_flex;
* random-0.1, random-0.25: random lower-triangular layouts at that density (the diagonal always
  listed), the same layout given to FlexAttention through its mask_mod.
Rows per shape: adaattn-block-sparse and flex on each mask, and our dense flash_attn (causal
and not) for the proportionality bar: time / (listed blocks / all blocks x dense non-causal time).
Times are medians of triton's do_bench; peak memory is one forward+backward above the inputs.
--scaling adds a section on the proportionality bar: ours on random causal layouts from the
diagonal alone to every causal block, each against density x our dense non-causal time; the
excess t - 1.2 x fraction x dense is the fixed overhead that bar lets us state.

Writes benchmarks/results/block-sparse.json (a case per shape and mask: adaattn against
flex-compiled, plus our dense rows) and, with --scaling, block-sparse-scaling.json; prints the
tables.

    python benchmarks/bench_block_sparse.py [--scaling | --only-scaling] [--results-dir DIR]
"""
import argparse
import os
import sys
import warnings
from typing import List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (also puts the in-place build on sys.path)
import bench_varlen as bv  # noqa: E402
import results_io  # noqa: E402

adaattn = ba.adaattn  # None when the extension is not built (--help still works)
BlockSparseMask = getattr(adaattn, "BlockSparseMask", None)

HEADS, DIM, BLOCK = 16, 128, 128
SHAPES = [(4, 4096), (1, 16384)]
WINDOW_BLOCKS = 8
SCALING_DENSITIES = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0)


def random_layout(n_blocks: int, density: float, seed: int) -> torch.Tensor:
    """Lower-triangular [1, 1, n, n] bool layout: each causal block listed with probability
    `density`, the diagonal always (every row keeps its own keys)."""
    gen = torch.Generator().manual_seed(seed)
    layout = torch.rand(n_blocks, n_blocks, generator=gen) < density
    layout = torch.tril(layout) | torch.eye(n_blocks, dtype=torch.bool)
    return layout.view(1, 1, n_blocks, n_blocks)


def prime(mask: BlockSparseMask) -> None:
    """Gives the mask what it has after a training loop's first step: the transposed index and
    the listed-key count on the host, which picks the backward's kernels (so that the one
    fwd+bwd that measures peak memory runs the kernels the timed calls run)."""
    mask.transposed()
    mask.prefers_two_pass()
    torch.cuda.synchronize()
    mask.prefers_two_pass()


def masks(length: int):
    """name -> (BlockSparseMask, FlexAttention BlockMask, listed fraction of all blocks)."""
    from torch.nn.attention.flex_attention import create_block_mask
    n = length // BLOCK

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx // BLOCK - kv_idx // BLOCK < WINDOW_BLOCKS)

    flex_window = create_block_mask(window, B=None, H=None, Q_LEN=length, KV_LEN=length,
                                    device="cuda", BLOCK_SIZE=BLOCK)
    out = {"window-8x128": (BlockSparseMask.from_flex(flex_window), flex_window)}
    for density in (0.1, 0.25):
        layout = random_layout(n, density, seed=int(density * 100)).cuda()
        grid = layout[0, 0]

        def listed(b, h, q_idx, kv_idx, grid=grid):
            return grid[q_idx // BLOCK, kv_idx // BLOCK] & (q_idx >= kv_idx)

        flex_mask = create_block_mask(listed, B=None, H=None, Q_LEN=length, KV_LEN=length,
                                      device="cuda", BLOCK_SIZE=BLOCK)
        out[f"random-{density}"] = (BlockSparseMask.from_dense(layout, BLOCK), flex_mask)
    return {name: (m, f, m.kv_num_blocks.sum().item() / n / n) for name, (m, f) in out.items()}


def builders(batch: int, length: int, only_mask=None):
    """name -> (build, listed fraction) for the main table; with only_mask, {"ours": build} of
    that mask alone."""
    from torch.nn.attention.flex_attention import flex_attention
    flex = torch.compile(flex_attention, dynamic=False)

    def inputs():
        q, k, v = (bv._randn(batch, HEADS, length, DIM).requires_grad_() for _ in range(3))
        return [q, k, v], bv._randn(batch, HEADS, length, DIM)

    def ours(mask):
        def build():
            x, dout = inputs()
            prime(mask)
            return (lambda q, k, v: adaattn.block_sparse_attn(q, k, v, mask, causal=True), x,
                    dout)
        return build

    def peer(block_mask):
        def build():
            x, dout = inputs()
            return lambda q, k, v: flex(q, k, v, block_mask=block_mask), x, dout
        return build

    def dense(causal):
        def build():
            x, dout = inputs()
            return lambda q, k, v: adaattn.flash_attn(q, k, v, causal=causal), x, dout
        return build

    if only_mask is not None:
        return {"ours": ours(only_mask)}
    rows = {"adaattn-dense-full": (dense(False), 1.0), "adaattn-dense-causal": (dense(True), None)}
    for name, (mask, flex_mask, fraction) in masks(length).items():
        rows[f"adaattn-{name}"] = (ours(mask), fraction)
        rows[f"flex-{name}"] = (peer(flex_mask), fraction)
    return rows


def scaling_rows(batch: int, length: int):
    """name -> (build, listed fraction): ours on random layouts (SCALING_DENSITIES; 0 is the
    diagonal alone, 1 every causal block) and dense non-causal flash_attn."""
    rows = {"adaattn-dense-full": (builders(batch, length)["adaattn-dense-full"][0], 1.0)}
    n = length // BLOCK
    for density in SCALING_DENSITIES:
        mask = BlockSparseMask.from_dense(random_layout(n, density, seed=7).cuda(), BLOCK)
        fraction = mask.kv_num_blocks.sum().item() / n / n
        rows[f"adaattn-random-{density}"] = (builders(batch, length, mask)["ours"], fraction)
    return rows


def render_scaling(results, batch: int, length: int) -> str:
    dense = results["adaattn-dense-full"][0].fwdbwd_ms
    lines = [f"### B = {batch}, L = {length} (dense non-causal fwd+bwd {ba._fmt(dense, '.3f')} ms)",
             "", "| layout | listed blocks | fwd ms | fwd+bwd ms | fraction x dense | "
             "t / (fraction x dense) | t - 1.2 x fraction x dense |",
             "|:---|---:|---:|---:|---:|---:|---:|"]
    excess = []
    for name, (row, fraction) in results.items():
        if name == "adaattn-dense-full" or row.fwdbwd_ms is None or dense is None:
            continue
        share = fraction * dense
        excess.append(row.fwdbwd_ms - 1.2 * share)
        lines.append(f"| {name} | {fraction:.3f} | {ba._fmt(row.fwd_ms, '.3f')} "
                     f"| {row.fwdbwd_ms:.3f} | {share:.3f} | {row.fwdbwd_ms / share:.2f} "
                     f"| {excess[-1]:.3f} |")
    if excess:
        lines += ["", f"Largest excess (the fixed overhead this shape needs): {max(excess):.3f} ms"]
    return "\n".join(lines)


def render(results, batch: int, length: int) -> str:
    full = results.get("adaattn-dense-full")
    lines = [f"### B = {batch}, L = {length}", "",
             "| op | listed blocks | fwd ms | fwd+bwd ms | peak MiB | fwd vs flex | "
             "fwd+bwd vs flex | fwd+bwd / (fraction x dense) | note |",
             "|:---|---:|---:|---:|---:|---:|---:|---:|:---|"]
    for name, (row, fraction) in results.items():
        flex = results.get(name.replace("adaattn-", "flex-"), (None, None))[0]

        def speed(field):
            a, b = getattr(row, field), getattr(flex, field, None)
            return "—" if a is None or b is None or flex is row else f"{b / a:.2f}x"
        prop = "—"
        if (name.startswith("adaattn-") and fraction is not None and full is not None
                and full[0].fwdbwd_ms and row.fwdbwd_ms):
            prop = f"{row.fwdbwd_ms / (fraction * full[0].fwdbwd_ms):.2f}"
        lines.append(f"| {name} | {'—' if fraction is None else f'{fraction:.3f}'} "
                     f"| {ba._fmt(row.fwd_ms, '.3f')} | {ba._fmt(row.fwdbwd_ms, '.3f')} "
                     f"| {ba._fmt(row.peak_mib, '.0f')} "
                     f"| {speed('fwd_ms') if name.startswith('adaattn-') else '—'} "
                     f"| {speed('fwdbwd_ms') if name.startswith('adaattn-') else '—'} "
                     f"| {prop} | {row.note} |")
    return "\n".join(lines)


def measure_rows(rows, batch: int, length: int, args):
    """name -> (Row, listed fraction) for rows name -> (build, listed fraction)."""
    results = {}
    for name, (build, fraction) in rows.items():
        row = bv._measure(name, [length] * batch, build, args)
        results[name] = (row, fraction)
        print(f"B={batch} L={length} {name}: fwd {row.fwd_ms} fwd+bwd {row.fwdbwd_ms} "
              f"{row.note}", flush=True)
    return results


def _shape_rows(results, batch: int, length: int, scaling: bool) -> List[dict]:
    """results_io rows of one shape: each adaattn-<mask> row with its flex-<mask> peer (as
    flex-compiled), our dense rows alone."""
    out = []
    full = results.get("adaattn-dense-full", (None, None))[0]
    for name, (row, fraction) in results.items():
        if not name.startswith("adaattn-"):
            continue
        flex = results.get(name.replace("adaattn-", "flex-"), (None, None))[0]
        group = [("adaattn", row)] + ([("flex-compiled", flex)] if flex is not None else [])
        note = "; ".join(f"{n}: {r.note}" for n, r in group if r.note)
        case = f"B={batch} L={length} {name[len('adaattn-'):]}"
        for field, direction in (("fwd_ms", "fwd"), ("fwdbwd_ms", "fwd+bwd")):
            extra = {}
            if direction == "fwd+bwd":
                extra["peak_mib"] = {n: round(r.peak_mib) for n, r in group
                                     if r.peak_mib is not None}
                if (fraction is not None and full is not None and full.fwdbwd_ms
                        and row.fwdbwd_ms is not None):
                    extra["vs_fraction_of_dense"] = round(
                        row.fwdbwd_ms / (fraction * full.fwdbwd_ms), 3)
                if scaling and full is not None:
                    extra["dense_full_ms"] = full.fwdbwd_ms
            out.append(results_io.row(case, direction, {n: getattr(r, field) for n, r in group},
                                      listed_fraction=None if fraction is None
                                      else round(fraction, 4),
                                      note=note, config={"b": batch, "l": length, "h": HEADS,
                                                         "d": DIM, "block": BLOCK},
                                      **extra))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    parser.add_argument("--scaling", action="store_true",
                        help="also the proportionality sweep (block-sparse-scaling.json)")
    parser.add_argument("--only-scaling", action="store_true", help="the sweep alone")
    results_io.add_arguments(parser, "block-sparse; the sweep: <family>-scaling")
    args = parser.parse_args(argv[1:])
    if adaattn is None:
        print(results_io.import_error_message("bench_block_sparse.py", ba.IMPORT_ERROR),
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_block_sparse.py needs a CUDA device", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", category=UserWarning)
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    torch.manual_seed(0)
    family = args.family or "block-sparse"
    title = (f"block-sparse attention: bf16, causal, D = {DIM}, H = {HEADS}, "
             f"{BLOCK}x{BLOCK} blocks")
    setup = ("masks: window-8x128 (a causal window of 8 blocks, from a FlexAttention "
             "BlockMask), random-p (a random causal layout of density p, diagonal always "
             "listed); flex-compiled: compiled FlexAttention on the same mask; dense rows: our "
             f"flash_attn; vs_fraction_of_dense: t / (listed fraction x dense full t); "
             f"{ba.TIMING}")
    scaling_title = (f"block-sparse time against listed blocks: bf16, causal, D = {DIM}, "
                     f"H = {HEADS}, {BLOCK}x{BLOCK} blocks")
    scaling_setup = ("random causal layouts from the diagonal alone (random-0.0) to every "
                     "causal block (random-1.0); the bar: t <= overhead + 1.2 x listed "
                     f"fraction x dense non-causal t; {ba.TIMING}")
    sections = ["## " + title, ba.run_metadata(argv)]
    scaling = ["## " + scaling_title, ba.run_metadata(argv)]
    scaling_json: List[dict] = []
    for batch, length in SHAPES if (args.scaling or args.only_scaling) else []:
        results = measure_rows(scaling_rows(batch, length), batch, length, args)
        scaling.append(render_scaling(results, batch, length))
        scaling_json += _shape_rows(results, batch, length, scaling=True)
        if not args.no_write:
            path = results_io.write(f"{family}-scaling", scaling_json, title=scaling_title,
                                    setup=scaling_setup, argv=argv,
                                    results_dir=args.results_dir)
    if args.scaling or args.only_scaling:
        print("\n\n".join(scaling))
        if not args.no_write:
            print(f"\nwrote {path}")
    if args.only_scaling:
        return 0
    main_json: List[dict] = []
    for batch, length in SHAPES:
        results = measure_rows(builders(batch, length), batch, length, args)
        sections.append(render(results, batch, length))
        main_json += _shape_rows(results, batch, length, scaling=False)
        if not args.no_write:
            path = results_io.write(family, main_json, title=title, setup=setup, argv=argv,
                                    results_dir=args.results_dir)
    print()
    print("\n\n".join(sections))
    if not args.no_write:
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
