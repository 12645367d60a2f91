"""Benchmarks flash_attn across head dims, the compiled ones and those that run on the next
compiled pair, against SDPA's backends at the same dims.

bf16, H = 16, causal and not: B = 4, L = 4096 for D = Dv in {64, 80, 96, 128, 160, 192, 256} (80
and 96 run on the (128, 128) kernels, 160 on (192, 192)) and for MLA's (D, Dv) = (192, 128);
B = 1, L = 16384 for D in {192, 256} and (192, 128). TFLOP/s count the caller's dims
(flash-attn's count: forward 2*B*H*L^2*(D + Dv), halved when causal, forward+backward 3.5x), so
a dim on a wider kernel shows what the unused columns cost. Times are medians of triton's
do_bench; an SDPA backend that refuses a shape is reported as such.

Writes benchmarks/results/head-dims.json (a case per D and mask, SDPA's backends as peers) and
prints the table.

    python benchmarks/bench_head_dims.py [--results-dir DIR]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (also puts the in-place build on sys.path)
import results_io  # noqa: E402

H = 16
# (D, Dv, B, L): B * L = 16k tokens.
SHAPES = tuple((d, d, 4, 4096) for d in (64, 80, 96, 128, 160, 192, 256)) + (
    (192, 128, 4, 4096), (192, 192, 1, 16384), (256, 256, 1, 16384), (192, 128, 1, 16384))


# bench_attention's builders: each maps a config (only its `causal` is read) to fn(q, k, v).
PEERS = ("adaattn", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetitions (ms)")
    parser.add_argument("--dims", default=None,
                        help="comma-separated head dims to run (default: every shape)")
    results_io.add_arguments(parser, "head-dims")
    args = parser.parse_args()
    if ba.adaattn is None:
        print(results_io.import_error_message("bench_head_dims.py", ba.IMPORT_ERROR),
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_head_dims.py needs a CUDA device", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, H={H}, bf16")
    print("| D | Dv | B | L | causal | op | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s |")
    print("|---:|---:|---:|---:|---|---|---:|---:|---:|---:|")
    json_rows = []
    dims = None if args.dims is None else {int(x) for x in args.dims.split(",")}
    for d, dv, B, L in SHAPES:
        if dims is not None and d not in dims:
            continue
        for causal in (False, True):
            q, k = (torch.randn(B, H, L, d, device="cuda", dtype=torch.bfloat16,
                                requires_grad=True) for _ in range(2))
            v = torch.randn(B, H, L, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dout = torch.randn_like(v)
            flops = 2 * B * H * L * L * (d + dv) / (2 if causal else 1)
            times, notes = {}, []
            for name in PEERS:
                fn = ba.PEERS[name](ba.Config(d, L, causal))
                try:
                    fwd = ba._do_bench(lambda: fn(q, k, v), args.warmup, args.rep, [q, k, v])
                    both = ba._do_bench(lambda: fn(q, k, v).backward(dout), args.warmup,
                                        args.rep, [q, k, v])
                except RuntimeError as e:
                    first = str(e).splitlines()[0][:60]
                    print(f"| {d} | {dv} | {B} | {L} | {causal} | {name} | refused: {first} | | | |")
                    times[name] = (None, None)
                    notes.append(f"{name}: refused: {first}")
                    continue
                times[name] = (fwd, both)
                print(f"| {d} | {dv} | {B} | {L} | {causal} | {name} | {fwd:.3f} | {both:.3f} | "
                      f"{flops / fwd / 1e9:.1f} | {3.5 * flops / both / 1e9:.1f} |")
            dims_name = f"D={d}" if dv == d else f"D={d} Dv={dv}"
            case = f"{dims_name} L={L} {'causal' if causal else 'non-causal'}"
            for i, (direction, count) in enumerate((("fwd", flops), ("fwd+bwd", 3.5 * flops))):
                json_rows.append(results_io.row(
                    case, direction, {name: t[i] for name, t in times.items()},
                    tflops={name: round(count / t[i] / 1e9, 1) for name, t in times.items()
                            if t[i] is not None},
                    note="; ".join(notes), config={"b": B, "h": H, "l": L, "d": d,
                                                    "dv": dv, "causal": causal}))
            if not args.no_write:
                path = results_io.write(
                    args.family or "head-dims", json_rows,
                    title=f"head dims: bf16, H = {H}, B * L = 16k",
                    setup="D = 80 and 96 run on the (128, 128) kernels (the columns past D "
                          "masked in their loads and stores), 160 zero-padded on (192, 192); "
                          "TFLOP/s count the caller's dims (flash-attn's count); "
                          "time: median of triton.testing.do_bench",
                    results_dir=args.results_dir)
    if not args.no_write:
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
