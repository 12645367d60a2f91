"""Benchmarks flash_attn(precision="fp8" | "auto") (issue 32) against the bf16 forward on CUDA.

Shapes as bench_attention.py: bf16, B * L = 16384, H * D = 2048, D in {128, 64}, L in {4096,
16384}, causal and not, N(0, 1) q, k, v. Rows (forward only; fp8 is for inference):

* ``precision="fp8"``: adaattn's time includes the pre-pass that quantises q, k and v (every
  call quantises its inputs); peers in the same run: adaattn's bf16 forward
  (``adaattn-bf16``) and ``F.scaled_dot_product_attention`` on cuDNN (``sdpa-cudnn``). Extra
  keys: ``speedup`` (bf16 / fp8 time; the issue's bar is 1.5 at D = 128 and 1.3 at D = 64),
  and the relative L2 error and cosine similarity against float64 of the first two heads of
  the first batch entry, fp8 beside bf16 (``rel_err``, ``cosine``, ``rel_err_bf16``).
* ``precision="auto"`` at D = 128, L = 4096 with q and k of half the heads scaled 4x (the
  heads auto must send to bf16): peers bf16 and fp8 on every head; ``heads_fp8`` the share of
  heads auto ran 8-bit.

Times: medians of triton's do_bench (L2 flushed between calls). Writes
benchmarks/results/precision.json (results_io format) and prints the table.

    python benchmarks/bench_precision.py [--quick] [--results-dir DIR]
"""
import argparse
import os
import sys
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (also puts the in-place build on sys.path)
import results_io  # noqa: E402

adaattn = ba.adaattn  # None when the extension is not built (--help still works)

DTYPE = torch.bfloat16
TOKENS, WIDTH = 16384, 2048
BARS = {128: 1.5, 64: 1.3}
AUTO_BAR = 1.25


def bench(fn: Callable, args) -> float:
    with torch.no_grad():
        return ba._do_bench(fn, args.warmup, args.rep, None)


def sdpa_cudnn(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def accuracy(q, k, v, causal, out) -> Dict[str, float]:
    """Relative L2 error and cosine of out (and of the bf16 forward) against float64 on the
    first two heads of the first batch entry."""
    sl = (slice(0, 1), slice(0, 2))
    ref = adaattn.reference.flash_attn(q[sl].double(), k[sl].double(), v[sl].double(),
                                       causal=causal)[0]
    bf16 = adaattn.flash_attn(q[sl], k[sl], v[sl], causal=causal)

    def err(x):
        return ((x.double() - ref).norm() / ref.norm()).item()

    cos = F.cosine_similarity(out[sl].double().flatten(), ref.flatten(), dim=0).item()
    return {"rel_err": round(err(out[sl]), 5), "cosine": round(cos, 6),
            "rel_err_bf16": round(err(bf16), 6)}


def fp8_rows(args) -> List[dict]:
    rows = []
    dims = (128,) if args.quick else (128, 64)
    lengths = (4096,) if args.quick else (4096, 16384)
    for dim in dims:
        heads = WIDTH // dim
        for length in lengths:
            batch = TOKENS // length
            for causal in (False, True):
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(batch, heads, length, dim, device="cuda", dtype=DTYPE,
                                       generator=gen) for _ in range(3))
                ms = {
                    "adaattn": bench(lambda: adaattn.flash_attn(q, k, v, causal=causal,
                                                                precision="fp8"), args),
                    "adaattn-bf16": bench(lambda: adaattn.flash_attn(q, k, v, causal=causal),
                                          args),
                    "sdpa-cudnn": bench(lambda: sdpa_cudnn(q, k, v, causal), args),
                }
                with torch.no_grad():
                    out = adaattn.flash_attn(q, k, v, causal=causal, precision="fp8")
                case = f"D={dim} L={length} B={batch} H={heads}" + (" causal" if causal else "")
                rows.append(results_io.row(
                    case, "fwd", ms, speedup=round(ms["adaattn-bf16"] / ms["adaattn"], 3),
                    bar=BARS[dim], **accuracy(q, k, v, causal, out)))
                print(f"{case:40s} fp8 {ms['adaattn']:.3f} bf16 {ms['adaattn-bf16']:.3f} "
                      f"cudnn {ms['sdpa-cudnn']:.3f} ms  speedup {rows[-1]['speedup']:.2f}x "
                      f"(bar {BARS[dim]})  err {rows[-1]['rel_err']:.4f} "
                      f"(bf16 {rows[-1]['rel_err_bf16']:.5f})", flush=True)
    return rows


def auto_row(args) -> dict:
    dim, length = 128, 4096
    heads, batch = WIDTH // dim, TOKENS // length
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(batch, heads, length, dim, device="cuda", dtype=DTYPE, generator=gen)
               for _ in range(3))
    q[:, heads // 2:] *= 4
    k[:, heads // 2:] *= 4
    ms = {
        "adaattn": bench(lambda: adaattn.flash_attn(q, k, v, precision="auto"), args),
        "adaattn-bf16": bench(lambda: adaattn.flash_attn(q, k, v), args),
        "adaattn-fp8": bench(lambda: adaattn.flash_attn(q, k, v, precision="fp8"), args),
    }
    with torch.no_grad():
        _, chosen = adaattn.flash_attn(q, k, v, precision="auto", return_precision=True)
    case = f"auto D={dim} L={length} B={batch} H={heads}, half the heads q, k x4"
    row = results_io.row(case, "fwd", ms, speedup=round(ms["adaattn-bf16"] / ms["adaattn"], 3),
                         bar=AUTO_BAR, heads_fp8=round(chosen.float().mean().item(), 3))
    print(f"{case}: auto {ms['adaattn']:.3f} bf16 {ms['adaattn-bf16']:.3f} fp8 "
          f"{ms['adaattn-fp8']:.3f} ms  speedup {row['speedup']:.2f}x  heads fp8 "
          f"{row['heads_fp8']:.2f}", flush=True)
    return row


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="D = 128, L = 4096 only")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    results_io.add_arguments(parser, "precision")
    args = parser.parse_args(argv)
    if adaattn is None:
        print(results_io.import_error_message("bench_precision.py", ba.IMPORT_ERROR))
        return 1
    if not torch.cuda.is_available():
        print("bench_precision.py: needs a CUDA GPU (sm_90 for precision='fp8')")
        return 1
    rows = fp8_rows(args)
    rows.append(auto_row(args))
    if not args.no_write:
        path = results_io.write(
            args.family or ("precision-quick" if args.quick else "precision"), rows,
            title="Adaptive precision: the 8-bit forward against bf16",
            setup=f"bf16 inputs, B*L = {TOKENS}, H*D = {WIDTH}; fp8 times include the "
                  "quantising pre-pass; forward only",
            notes=["speedup = adaattn-bf16 / adaattn (fp8); bar 1.5x at D = 128, 1.3x at "
                   "D = 64 (auto: 1.25x)",
                   "rel_err / cosine: float64 reference, first two heads of batch entry 0"],
            argv=argv, results_dir=args.results_dir)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
