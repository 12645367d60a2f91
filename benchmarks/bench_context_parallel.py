"""Benchmarks ring attention (adaattn.distributed) against the single-GPU op (issue 34's bars).

Run on one host with N >= 2 GPUs (NCCL)::

    torchrun --nproc_per_node=2 benchmarks/bench_context_parallel.py [--tokens-per-gpu 32768]

Case (the bar): bf16, B = 1, H = 16, D = 128, causal, zigzag layout, ``tokens-per-gpu`` tokens on
each GPU (N times that in total). Rows, forward and forward+backward:

* ``adaattn`` = ``ring_flash_attn`` (``ring_lazy_attn``) over the N GPUs; its peer ``single-gpu``
  = ``flash_attn`` (``lazy_attn``) on one GPU at the per-GPU length (rank 0 runs it alone while
  the others wait). Lazy attention: bias window 512, tau = -1.
* ``per_gpu_throughput_ratio``: (the ring's FLOPs / N per ring second) over (the single op's
  FLOPs per second); FLOPs as flash-attn counts them (causal forward ``4 B H L^2 D / 2``,
  forward+backward 3.5x; the same count for lazy attention). Bars: >= 0.85 (flash), >= 0.80
  (lazy).
* ``peak_mem_ratio``: the ring's peak allocated memory on the fullest GPU (inputs, outputs and
  gradients included) over the single op's, same accounting. Bar: <= 1.2 (forward+backward).

Ring times are the slowest rank's (every rank waits for the others at the end of each
iteration). Rank 0 writes benchmarks/results/context_parallel.json after every row and prints the
table; a failing case is recorded as a note and the script goes on.
"""
import argparse
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import results_io  # noqa: E402

FAMILY = "context_parallel"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens-per-gpu", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layouts", default="zigzag,contiguous",
                    help="comma-separated ring layouts to measure (zigzag is the bar's)")
    ap.add_argument("--head-chunks", default="auto",
                    help="comma-separated head_chunks of the ring ops to measure: auto (the "
                         "ops' own choice, the bar's) or a divisor of the heads")
    ap.add_argument("--ops", default="flash,lazy",
                    help="comma-separated ring ops to measure: flash, lazy")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the script's flow on CPU with gloo at a tiny size (checks the "
                         "script, measures nothing meaningful; writes no results unless "
                         "--results-dir is given)")
    results_io.add_arguments(ap, FAMILY)
    return ap.parse_args()


def flops(b, h, length, d, direction):
    fwd = 4 * b * h * length * length * d / 2  # causal
    return fwd if direction == "fwd" else 3.5 * fwd


CPU = False  # --cpu-smoke: gloo on CPU, wall-clock timers, no memory statistics


def sync():
    if not CPU:
        torch.cuda.synchronize()


def timed(fn, warmup, iters, sync_group=False):
    """Mean ms per call of fn, after warmup; with sync_group, the slowest rank's time."""
    for _ in range(warmup):
        fn()
    sync()
    if sync_group:
        dist.barrier()
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    ms = (time.perf_counter() - begin) * 1e3 / iters
    if sync_group:
        t = torch.tensor([ms], device="cpu" if CPU else "cuda", dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms = t.item()
    return ms


def peak_mib(make_inputs, fn):
    """Peak allocated MiB while fn(*inputs) runs, counting the inputs (drawn first by
    make_inputs, whose temporaries do not count) and everything fn allocates."""
    state = make_inputs()
    if CPU:
        fn(*state)
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn(*state)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2 ** 20
    del state
    return peak


def inputs(b, h, length, d, dev, seed, shard=None):
    g = torch.Generator(device=dev).manual_seed(seed)
    dtype = torch.float32 if CPU else torch.bfloat16
    ts = [torch.randn(b, h, length, d, device=dev, dtype=dtype, generator=g)
          for _ in range(4)]
    if shard is not None:
        ts = [shard(t).contiguous() for t in ts]
    q, k, v, dout = ts
    return [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout]


def run_op(args, rank, world, dev, op_name, single_op, ring_op, bar, rows, notes, table, save):
    """The single-GPU row and the ring rows (one per layout) of one op."""
    from adaattn.distributed import _head_groups, shard_sequence
    b, h, d, lg = args.batch, args.heads, args.head_dim, args.tokens_per_gpu
    total = lg * world
    # single-GPU op at the per-GPU length (rank 0 alone)
    single = {}
    if rank == 0:
        try:
            q, k, v, dout = inputs(b, h, lg, d, dev, 0)

            def fwd():
                with torch.no_grad():
                    single_op(q, k, v)

            def fwdbwd():
                out = single_op(q, k, v)
                torch.autograd.grad(out, (q, k, v), dout)

            single["fwd"] = timed(fwd, args.warmup, args.iters)
            single["fwd+bwd"] = timed(fwdbwd, args.warmup, args.iters)
            del q, k, v, dout
            single["mem fwd+bwd"] = peak_mib(
                lambda: inputs(b, h, lg, d, dev, 0),
                lambda q, k, v, dout: torch.autograd.grad(
                    single_op(q, k, v), (q, k, v), dout))
        except Exception as e:  # noqa: BLE001 - recorded, the ring rows still run
            traceback.print_exc()
            notes.append(f"single-gpu {op_name} failed: {type(e).__name__}: {e}")
    dist.barrier()

    variants = [(layout, None if hc == "auto" else int(hc))
                for hc in args.head_chunks.split(",") if hc
                for layout in args.layouts.split(",") if layout]
    for layout, head_chunks in variants:
        def shard(t, layout=layout):
            return shard_sequence(t, layout=layout)

        def full_inputs(layout=layout):
            # every rank draws the same full tensors on its GPU and keeps its shard
            return inputs(b, h, total, d, dev, 1, shard=shard)

        try:
            q, k, v, dout = full_inputs()

            def fwd():
                with torch.no_grad():
                    ring_op(q, k, v, layout, head_chunks)

            def fwdbwd():
                out = ring_op(q, k, v, layout, head_chunks)
                torch.autograd.grad(out, (q, k, v), dout)

            groups = len(_head_groups("bench", head_chunks, q, h, h, q.shape[2], b))
            ring = {"fwd": timed(fwd, args.warmup, args.iters, sync_group=True),
                    "fwd+bwd": timed(fwdbwd, args.warmup, args.iters, sync_group=True)}
            del q, k, v, dout
            mem = peak_mib(full_inputs, lambda q, k, v, dout: torch.autograd.grad(
                ring_op(q, k, v, layout, head_chunks), (q, k, v), dout))
            failed = 0.0
        except Exception as e:  # noqa: BLE001 - a rank-local failure (e.g. out of memory)
            traceback.print_exc()
            print(f"rank {rank}: ring_{op_name} {layout} failed: {type(e).__name__}: {e}", flush=True)
            ring, mem, failed, groups = {}, None, 1.0, None
        # every rank reaches this collective whether or not its case failed
        stat = torch.tensor([failed, mem or 0.0], device=dev, dtype=torch.float64)
        dist.all_reduce(stat, op=dist.ReduceOp.MAX)
        if stat[0].item() > 0:
            notes.append(f"ring_{op_name} {layout} failed on some rank (see its log)")
            ring, mem = {}, None
        elif mem is not None:
            mem = stat[1].item()
        for direction in ("fwd", "fwd+bwd"):
            t_ring, t_single = ring.get(direction), single.get(direction)
            ratio = None
            if t_ring and t_single:
                ratio = ((flops(b, h, total, d, direction) / world / t_ring)
                         / (flops(b, h, lg, d, direction) / t_single))
            mem_ratio = None
            if direction == "fwd+bwd" and mem and single.get("mem fwd+bwd"):
                mem_ratio = mem / single["mem fwd+bwd"]
            tflops = (flops(b, h, total, d, direction) / world / t_ring / 1e9) if t_ring else None
            case = f"ring_{op_name} {layout} causal {lg}/GPU x{world}" + (
                f" head_chunks={head_chunks}" if head_chunks is not None else "")
            rows.append(results_io.row(
                case, direction, {"adaattn": t_ring, "single-gpu": t_single},
                tflops_per_gpu=round(tflops, 1) if tflops else None,
                per_gpu_throughput_ratio=round(ratio, 3) if ratio else None,
                peak_mib=round(mem, 1) if (mem and direction == "fwd+bwd") else None,
                single_peak_mib=(round(single["mem fwd+bwd"], 1)
                                 if direction == "fwd+bwd" and single.get("mem fwd+bwd")
                                 else None),
                peak_mem_ratio=round(mem_ratio, 3) if mem_ratio else None,
                config={"world": world, "layout": layout, "head_groups": groups,
                        "head_chunks": "auto" if head_chunks is None else head_chunks,
                        "B": b, "H": h, "D": d,
                        "tokens_per_gpu": lg, "dtype": "bf16", "causal": True,
                        "bar_per_gpu_throughput_ratio": bar}))
            table.append((case, direction, t_ring, t_single, ratio, mem_ratio))
        save()
        dist.barrier()



def main():
    global CPU
    args = parse_args()
    CPU = args.cpu_smoke
    if CPU:
        args.tokens_per_gpu, args.heads, args.head_dim = 64, 2, 16
        args.warmup, args.iters = 1, 1
        args.no_write = args.no_write or args.results_dir == results_io.RESULTS_DIR
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if CPU:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        # the device first: NCCL's communicators (and barrier) bind to it
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    gpu = "CPU smoke run" if CPU else torch.cuda.get_device_name()
    import adaattn
    from adaattn.distributed import ring_flash_attn, ring_lazy_attn, shard_sequence

    b, h, d, lg = args.batch, args.heads, args.head_dim, args.tokens_per_gpu
    total = lg * world
    rows, notes, table = [], [], []
    notes.append(f"ms: the ring runs the {world}x longer sequence on {world} GPUs, the single-gpu "
                 f"peer the per-GPU length on one; the bars are per_gpu_throughput_ratio "
                 f"(>= 0.85 flash, >= 0.80 lazy) and peak_mem_ratio (<= 1.2)")
    setup = (f"{world} GPUs ({gpu}), NCCL, bf16, B={b}, H={h}, D={d}, "
             f"causal, {lg} tokens per GPU ({total} total); single-gpu = the op (flash_attn, "
             f"lazy_attn: window 512, tau -1) at {lg} on one GPU; ring times are the slowest "
             f"rank's")

    def save():
        if rank != 0 or args.no_write:
            return
        try:
            path = results_io.write(args.family or FAMILY, rows,
                                    title="Context parallel (ring attention)", setup=setup,
                                    notes=notes, results_dir=args.results_dir)
            print(f"wrote {path}", flush=True)
        except Exception:  # noqa: BLE001 - the table is still printed
            traceback.print_exc()

    tau = torch.full((h,), -1.0, device=dev)
    bias = 0.1 * torch.randn(h, 512, device=dev, generator=torch.Generator(device=dev)
                             .manual_seed(2))
    # (single-GPU op, ring op, bar) per op; the ops take (q, k, v), the ring ones also a layout
    # and head_chunks
    op_fns = {
        "flash": (lambda q, k, v: adaattn.flash_attn(q, k, v, causal=True),
                  lambda q, k, v, lay, hc: ring_flash_attn(q, k, v, layout=lay, causal=True,
                                                           head_chunks=hc), 0.85),
        "lazy": (lambda q, k, v: adaattn.lazy_attn(q, k, v, tau, bias),
                 lambda q, k, v, lay, hc: ring_lazy_attn(q, k, v, tau, bias, layout=lay,
                                                         head_chunks=hc), 0.80),
    }
    for op_name in [x for x in args.ops.split(",") if x]:
        single_op, ring_op, bar = op_fns[op_name]
        run_op(args, rank, world, dev, op_name, single_op, ring_op, bar, rows, notes, table,
               save)

    if rank == 0:
        save()
        print(f"\n{setup}")
        print(f"{'case':42} {'dir':8} {'ring ms':>9} {'single ms':>10} {'thr ratio':>10} "
              f"{'mem ratio':>10}")

        def fmt(x, spec):
            return format(x, spec) if x is not None else "-"
        for case, direction, t_ring, t_single, ratio, mem_ratio in table:
            print(f"{case:42} {direction:8} {fmt(t_ring, '9.2f')} {fmt(t_single, '10.2f')} "
                  f"{fmt(ratio, '10.3f')} {fmt(mem_ratio, '10.3f')}")
        print("bars: fwd+bwd zigzag throughput ratio >= 0.85 (flash), 0.80 (lazy); memory ratio "
              "<= 1.2")
        for n in notes:
            print("note:", n)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
