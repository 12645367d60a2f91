"""Benchmarks flash_attn at head dims without a tensor-core kernel of their own (zero-padded to
the next compiled pair) against the compiled ones and against SDPA's backends at the same dims.

bf16, B = 4, H = 16, L = 4096, causal and not; D in {64, 80, 96, 128} (80 and 96 run on the
(128, 128) kernels). TFLOP/s count the caller's D (flash-attn's count: forward 4*B*H*L^2*D,
halved when causal, forward+backward 3.5x), so a padded dim shows what the padding costs.
Times are medians of triton's do_bench.

    python benchmarks/bench_head_dims.py
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (also puts the in-place build on sys.path)

B, H, L = 4, 16, 4096
DIMS = (64, 80, 96, 128)


# bench_attention's builders: each maps a config (only its `causal` is read) to fn(q, k, v).
PEERS = ("adaattn", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetitions (ms)")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, B={B}, H={H}, L={L}, bf16")
    print("| D | causal | op | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for d in DIMS:
        for causal in (False, True):
            q, k, v = (torch.randn(B, H, L, d, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            dout = torch.randn_like(q)
            flops = 4 * B * H * L * L * d / (2 if causal else 1)
            for name in PEERS:
                fn = ba.PEERS[name](ba.Config(d, L, causal))
                try:
                    fwd = ba._do_bench(lambda: fn(q, k, v), args.warmup, args.rep, [q, k, v])
                    both = ba._do_bench(lambda: fn(q, k, v).backward(dout), args.warmup,
                                        args.rep, [q, k, v])
                except RuntimeError as e:
                    print(f"| {d} | {causal} | {name} | refused: {str(e).splitlines()[0][:60]} "
                          "| | | |")
                    continue
                print(f"| {d} | {causal} | {name} | {fwd:.3f} | {both:.3f} | "
                      f"{flops / fwd / 1e9:.1f} | {3.5 * flops / both / 1e9:.1f} |")


if __name__ == "__main__":
    main()
