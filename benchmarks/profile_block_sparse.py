"""Per-kernel CUDA time of one block-sparse forward+backward, ours against compiled FlexAttention,
on bench_block_sparse.py's masks (bf16, causal, D = 128, H = 16): where the backward's time goes.

    python benchmarks/profile_block_sparse.py [--batch 4] [--length 4096] [--mask window-8x128]
    python benchmarks/profile_block_sparse.py --ncu   # one fwd+bwd of ours only, for ncu
"""
import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_block_sparse as bbs  # noqa: E402

import adaattn  # noqa: E402


def step(fn, q, k, v, dout):
    out = fn(q, k, v)
    out.backward(dout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--mask", action="append", help="mask names (default: all)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--ncu", action="store_true", help="ours only, two steps, no profiler")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    from torch.nn.attention.flex_attention import flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    shape = (args.batch, bbs.HEADS, args.length, bbs.DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    for name, (mask, flex_mask, fraction) in bbs.masks(args.length).items():
        if args.mask and name not in args.mask:
            continue
        bbs.prime(mask)
        fns = {"adaattn": lambda q, k, v, m=mask: adaattn.block_sparse_attn(q, k, v, m,
                                                                           causal=True)}
        if not args.ncu:
            fns["flex"] = lambda q, k, v, m=flex_mask: flex(q, k, v, block_mask=m)
        for who, fn in fns.items():
            for _ in range(2 if args.ncu else 5):
                step(fn, q, k, v, dout)
            torch.cuda.synchronize()
            if args.ncu:
                continue
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.iters):
                    step(fn, q, k, v, dout)
                torch.cuda.synchronize()
            print(f"\n## {who} {name} (listed {fraction:.3f}), B={args.batch} L={args.length}: "
                  f"CUDA us per fwd+bwd")
            total = 0.0
            for evt in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
                if evt.device_time_total <= 0:
                    continue
                per = evt.device_time_total / args.iters
                total += per
                print(f"{per:9.1f}  x{evt.count // args.iters:<3d} {evt.key[:110]}")
            print(f"{total:9.1f}  total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
