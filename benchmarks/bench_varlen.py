"""Benchmarks the packed (varlen) ops on CUDA (issue bar: bf16, D=128, H=16, 16k tokens of
documents 512-2048 tokens long, causal).

Rows in the same run, all on the same seeded packing:
* adaattn-flash-varlen: ``adaattn.flash_attn_varlen`` (causal per document);
* flex-document: compiled FlexAttention over the packed sequence (B=1) with a causal document
  block mask (``create_block_mask`` on the document ids), the peer of the bar;
* adaattn-flash-dense: ``adaattn.flash_attn`` on a dense batch of equal-length sequences with the
  same total tokens (L = the mean document length rounded to 128), for throughput per token;
* adaattn-lazy-varlen and adaattn-lazy-dense: the same for ``lazy_attn`` (W = 512, tau = -1).
TFLOP/s count causal attention per document (4 * H * L^2 * D / 2 forward, 3.5x for
forward+backward), so packed and dense rows compare as throughput on the same work. Times are
medians of triton's do_bench; peak memory is one forward+backward above the inputs.

Writes benchmarks/results/varlen-d<D>.json, one case per op and layout (adaattn = our op on it;
FlexAttention is the packed flash case's peer), and prints the tables.

    python benchmarks/bench_varlen.py [--d 128] [--results-dir DIR]
"""
import argparse
import os
import random
import sys
import warnings
from typing import Callable, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (also puts the in-place build on sys.path)
import results_io  # noqa: E402

adaattn = ba.adaattn  # None when the extension is not built (--help still works)

TOKENS = 16384
HEADS = 16
DOC_MIN, DOC_MAX = 512, 2048
WINDOW, TAU = 512, -1.0


def document_lengths(seed: int = 0) -> List[int]:
    """Document lengths uniform in [DOC_MIN, DOC_MAX] summing to TOKENS (the last one is cut)."""
    rng = random.Random(seed)
    lengths: List[int] = []
    while sum(lengths) < TOKENS:
        lengths.append(rng.randint(DOC_MIN, DOC_MAX))
    lengths[-1] -= sum(lengths) - TOKENS
    return lengths


def causal_flops(lengths: List[int], d: int, mode: str) -> float:
    fwd = sum(4 * HEADS * n * n * d / 2 for n in lengths)
    return fwd if mode == "fwd" else 3.5 * fwd


class Row:
    def __init__(self, name: str, lengths: List[int]):
        self.name, self.lengths = name, lengths
        self.fwd_ms: Optional[float] = None
        self.fwdbwd_ms: Optional[float] = None
        self.peak_mib: Optional[float] = None
        self.note = ""


def _measure(name: str, lengths: List[int], build: Callable, args) -> Row:
    """build() -> (fn, inputs, dout): fn(*inputs) is the forward; inputs require grad."""
    row = Row(name, lengths)
    try:
        fn, inputs, dout = build()

        def fwd_bwd():
            fn(*inputs).backward(dout)

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd()
        torch.cuda.synchronize()
        row.peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
        grads = [t for t in inputs if t.requires_grad]
        for t in grads:
            t.grad = None
        row.fwd_ms = ba._do_bench(lambda: fn(*inputs), args.warmup, args.rep, grads)
        row.fwdbwd_ms = ba._do_bench(fwd_bwd, args.warmup, args.rep, grads)
    except Exception as e:  # a peer refusing a config must not end the run
        row.note = ba._short_error(e)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return row


def _randn(*shape):
    return torch.randn(*shape, device="cuda", dtype=ba.DTYPE)


def _lazy_params():
    tau = torch.full((HEADS,), TAU, device="cuda", requires_grad=True)
    bias = (0.1 * torch.randn(HEADS, WINDOW, device="cuda")).requires_grad_()
    return tau, bias


def builders(lengths: List[int], d: int, dense_len: int):
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32,
                      device="cuda")
    dense_batch = TOKENS // dense_len

    def packed_inputs():
        q, k, v = (_randn(TOKENS, HEADS, d).requires_grad_() for _ in range(3))
        return [q, k, v], _randn(TOKENS, HEADS, d)

    def dense_inputs():
        q, k, v = (_randn(dense_batch, HEADS, dense_len, d).requires_grad_() for _ in range(3))
        return [q, k, v], _randn(dense_batch, HEADS, dense_len, d)

    def flash_varlen():
        inputs, dout = packed_inputs()
        return (lambda q, k, v: adaattn.flash_attn_varlen(q, k, v, cu, cu, causal=True),
                inputs, dout)

    def flash_dense():
        inputs, dout = dense_inputs()
        return lambda q, k, v: adaattn.flash_attn(q, k, v, causal=True), inputs, dout

    def lazy_varlen():
        inputs, dout = packed_inputs()
        tau, bias = _lazy_params()
        return (lambda q, k, v: adaattn.lazy_attn_varlen(q, k, v, cu, tau, bias), inputs, dout)

    def lazy_dense():
        inputs, dout = dense_inputs()
        tau, bias = _lazy_params()
        return lambda q, k, v: adaattn.lazy_attn(q, k, v, tau, bias), inputs, dout

    def flex_document():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"),
                                      torch.tensor(lengths, device="cuda"))

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        mask = create_block_mask(document_causal, B=None, H=None, Q_LEN=TOKENS, KV_LEN=TOKENS,
                                 device="cuda")
        flex = torch.compile(flex_attention, dynamic=False)
        q, k, v = (_randn(1, HEADS, TOKENS, d).requires_grad_() for _ in range(3))
        return (lambda q, k, v: flex(q, k, v, block_mask=mask), [q, k, v],
                _randn(1, HEADS, TOKENS, d))

    return {
        "adaattn-flash-varlen": (flash_varlen, lengths),
        "flex-document": (flex_document, lengths),
        "adaattn-flash-dense": (flash_dense, [dense_len] * dense_batch),
        "adaattn-lazy-varlen": (lazy_varlen, lengths),
        "adaattn-lazy-dense": (lazy_dense, [dense_len] * dense_batch),
    }


def render(rows: List[Row], d: int) -> str:
    lines = ["| op | sequences | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | peak MiB "
             "| note |", "|:---|:---|---:|---:|---:|---:|---:|:---|"]
    for r in rows:
        shape = (f"{len(r.lengths)} docs, {min(r.lengths)}-{max(r.lengths)}"
                 if len(set(r.lengths)) > 1 else f"{len(r.lengths)} x {r.lengths[0]}")

        def tflops(ms, mode):
            return None if ms is None else causal_flops(r.lengths, d, mode) / ms / 1e9
        lines.append(f"| {r.name} | {shape} | {ba._fmt(r.fwd_ms, '.3f')} "
                     f"| {ba._fmt(tflops(r.fwd_ms, 'fwd'), '.0f')} "
                     f"| {ba._fmt(r.fwdbwd_ms, '.3f')} "
                     f"| {ba._fmt(tflops(r.fwdbwd_ms, 'fwdbwd'), '.0f')} "
                     f"| {ba._fmt(r.peak_mib, '.0f')} | {r.note} |")
    return "\n".join(lines)


def render_bars(rows: List[Row], d: int) -> str:
    by = {r.name: r for r in rows}

    def speedup(a: str, b: str, field: str) -> str:
        x, y = getattr(by.get(a), field, None), getattr(by.get(b), field, None)
        return "—" if x is None or y is None else f"{y / x:.2f}x"

    def per_token(a: str, b: str, field: str) -> str:
        ra, rb = by.get(a), by.get(b)
        x, y = getattr(ra, field, None), getattr(rb, field, None)
        if x is None or y is None:
            return "—"
        mode = "fwd" if field == "fwd_ms" else "fwdbwd"
        ours = causal_flops(ra.lengths, d, mode) / x
        return f"{ours / (causal_flops(rb.lengths, d, mode) / y):.2f}x"
    return "\n".join([
        "| bar | fwd | fwd+bwd |", "|:---|---:|---:|",
        f"| flash varlen speed-up vs FlexAttention (>= 1.0x) "
        f"| {speedup('adaattn-flash-varlen', 'flex-document', 'fwd_ms')} "
        f"| {speedup('adaattn-flash-varlen', 'flex-document', 'fwdbwd_ms')} |",
        f"| flash varlen throughput vs dense equal-length batch (>= 0.9x) "
        f"| {per_token('adaattn-flash-varlen', 'adaattn-flash-dense', 'fwd_ms')} "
        f"| {per_token('adaattn-flash-varlen', 'adaattn-flash-dense', 'fwdbwd_ms')} |",
        f"| lazy varlen throughput vs dense equal-length batch "
        f"| {per_token('adaattn-lazy-varlen', 'adaattn-lazy-dense', 'fwd_ms')} "
        f"| {per_token('adaattn-lazy-varlen', 'adaattn-lazy-dense', 'fwdbwd_ms')} |",
    ])


# (case prefix, the measured row reported as adaattn, its peers in the same run)
CASES = (("flash, packed", "adaattn-flash-varlen", ("flex-document",)),
         ("flash, dense", "adaattn-flash-dense", ()),
         ("lazy, packed", "adaattn-lazy-varlen", ()),
         ("lazy, dense", "adaattn-lazy-dense", ()))


def json_rows(rows: List[Row], d: int) -> List[dict]:
    by = {r.name: r for r in rows}
    out = []
    for prefix, ours, peers in CASES:
        if ours not in by:
            continue
        group = [("adaattn", by[ours])] + [(p, by[p]) for p in peers if p in by]
        lengths = by[ours].lengths
        shape = (f"{len(lengths)} docs of {min(lengths)}-{max(lengths)}"
                 if len(set(lengths)) > 1 else f"{len(lengths)} x {lengths[0]}")
        note = "; ".join(f"{name}: {r.note}" for name, r in group if r.note)
        for field, direction, mode in (("fwd_ms", "fwd", "fwd"),
                                       ("fwdbwd_ms", "fwd+bwd", "fwdbwd")):
            ms = {name: getattr(r, field) for name, r in group}
            tflops = {name: round(causal_flops(r.lengths, d, mode) / t / 1e9, 1)
                      for name, r in group for t in [getattr(r, field)] if t is not None}
            peak = ({name: round(r.peak_mib) for name, r in group if r.peak_mib is not None}
                    if direction == "fwd+bwd" else None)
            out.append(results_io.row(f"{prefix}: {shape}", direction, ms, tflops=tflops,
                                      peak_mib=peak, note=note,
                                      config={"d": d, "h": HEADS, "tokens": TOKENS}))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, default=128, help="head dim (64 or 128)")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    results_io.add_arguments(parser, "varlen-d<D>")
    args = parser.parse_args(argv[1:])
    if adaattn is None:
        print(results_io.import_error_message("bench_varlen.py", ba.IMPORT_ERROR),
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_varlen.py needs a CUDA device", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.manual_seed(0)
    lengths = document_lengths()
    dense_len = max(128, round(sum(lengths) / len(lengths) / 128) * 128)
    title = (f"varlen (packed documents): bf16, causal, D = {args.d}, H = {HEADS}, "
             f"{TOKENS} tokens in {len(lengths)} documents of {DOC_MIN}-{DOC_MAX}; dense rows: "
             f"{TOKENS // dense_len} x {dense_len}")
    setup = ("dense: the same tokens as equal-length sequences (compare TFLOP/s, counted "
             "per document); flex-document: compiled FlexAttention with a causal document "
             f"mask; {ba.TIMING}")
    meta = ba.run_metadata(argv)
    rows = []
    for name, (build, lens) in builders(lengths, args.d, dense_len).items():
        rows.append(_measure(name, lens, build, args))
        print(render([rows[-1]], args.d).splitlines()[-1], flush=True)
    body = f"## {title}\n\n{meta}\n\n{render(rows, args.d)}\n\n{render_bars(rows, args.d)}"
    print()
    print(body)
    if not args.no_write:
        path = results_io.write(args.family or f"varlen-d{args.d}", json_rows(rows, args.d),
                                title=title, setup=setup, argv=argv,
                                results_dir=args.results_dir)
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
