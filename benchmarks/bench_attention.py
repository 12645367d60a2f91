"""Benchmarks adaattn.flash_attn against its peers on CUDA.

Configs: bf16, B*L = 16384, H*D = 2048, D in {64, 128}, L in {1024, 4096, 16384}, causal and not.
Peers in the same run: F.scaled_dot_product_attention pinned to each backend (flash, cuDNN,
efficient), compiled FlexAttention, and the eager reference (adaattn.reference, only where its
L x L matrices fit in memory). For each: forward and forward+backward time (median of
triton.testing.do_bench), TFLOP/s with flash-attn's count (forward 4*B*H*Lq*Lk*D, halved when
causal; backward 2.5x forward, so forward+backward = 3.5x), and the peak memory of one
forward+backward above the inputs. A peer that refuses or fails a config is recorded, not fatal.
adaattn, sdpa-flash and sdpa-cudnn run in every invocation, whatever ``--peers`` says, so that
each result is against the strongest SDPA backend of the same run.

Writes benchmarks/results/flash.json (``--quick``: flash-quick.json) in the format of
``results_io``, after every config, and prints the table; ``make_results.py`` renders it.

    python benchmarks/bench_attention.py [--quick] [--peers ...] [--results-dir DIR]
"""
import argparse
import dataclasses
import datetime
import os
import sys
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # the in-place build next to the sources
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import results_io  # noqa: E402

try:
    import adaattn  # noqa: E402
except ImportError as _import_error:  # not built yet: --help still works
    adaattn = None
    IMPORT_ERROR: Optional[ImportError] = _import_error
else:
    IMPORT_ERROR = None

TOKENS = 16384  # B * L
HIDDEN = 2048  # H * D
DTYPE = torch.bfloat16
# Every run measures these, so that each row has the strongest SDPA backend beside it.
REQUIRED_PEERS = ("adaattn", "sdpa-flash", "sdpa-cudnn")


@dataclasses.dataclass(frozen=True)
class Config:
    d: int
    length: int
    causal: bool

    @property
    def batch(self) -> int:
        return TOKENS // self.length

    @property
    def heads(self) -> int:
        return HIDDEN // self.d

    def flops(self, mode: str) -> float:
        fwd = 4 * self.batch * self.heads * self.length * self.length * self.d
        fwd /= 2 if self.causal else 1
        return fwd if mode == "fwd" else 3.5 * fwd


def configs(quick: bool) -> List[Config]:
    if quick:
        return [Config(128, 4096, causal) for causal in (False, True)]
    return [Config(d, length, causal) for d in (64, 128) for length in (1024, 4096, 16384)
            for causal in (False, True)]


class PeerSkipped(Exception):
    """A peer that cannot run a config by construction (reported as a note, not an error)."""


def _adaattn(cfg: Config) -> Callable:
    return lambda q, k, v: adaattn.flash_attn(q, k, v, causal=cfg.causal)


def _sdpa(backend_name: str) -> Callable[[Config], Callable]:
    def build(cfg: Config) -> Callable:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = getattr(SDPBackend, backend_name)

        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=cfg.causal)
        return run
    return build


_flex_compiled = None


def _flex(cfg: Config) -> Callable:
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if cfg.causal:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B=None,
                                       H=None, Q_LEN=cfg.length, KV_LEN=cfg.length,
                                       device="cuda")
    return lambda q, k, v: _flex_compiled(q, k, v, block_mask=block_mask)


# The eager reference keeps about this many L x L bf16 matrices alive during forward+backward
# (scores, masked scores, exponentials, probabilities, and their gradients).
REFERENCE_LXL_COPIES = 8


def _reference(cfg: Config) -> Callable:
    need = REFERENCE_LXL_COPIES * cfg.batch * cfg.heads * cfg.length ** 2 * DTYPE.itemsize
    have = torch.cuda.get_device_properties(0).total_memory
    if need > 0.7 * have:
        raise PeerSkipped(f"skipped: ~{need / 2**30:.0f} GiB of L x L matrices would not fit")
    return lambda q, k, v: adaattn.reference.flash_attn(q, k, v, causal=cfg.causal)[0]


PEERS: Dict[str, Callable[[Config], Callable]] = {
    "adaattn": _adaattn,
    "sdpa-flash": _sdpa("FLASH_ATTENTION"),
    "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa-efficient": _sdpa("EFFICIENT_ATTENTION"),
    "flex-compiled": _flex,
    "reference-eager": _reference,
}


def _do_bench(fn: Callable, warmup_ms: int, rep_ms: int, grad_to_none) -> float:
    """Median milliseconds per call (triton's do_bench, which also flushes L2 between calls)."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return event_bench(fn, grad_to_none)
    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none,
                    return_mode="median")


def event_bench(fn: Callable, grad_to_none, warmup: int = 10, reps: int = 50) -> float:
    """Median milliseconds per call by CUDA events around each call (no L2 flush), after
    ``warmup`` calls; the ``.grad`` of each tensor in ``grad_to_none`` is reset before each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        for t in grad_to_none:
            t.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@dataclasses.dataclass
class Row:
    cfg: Config
    peer: str
    fwd_ms: Optional[float] = None
    fwdbwd_ms: Optional[float] = None
    peak_mib: Optional[float] = None
    note: str = ""


def _short_error(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:100]}"


def measure(peer: str, cfg: Config, args) -> Row:
    row = Row(cfg, peer)
    q, k, v, dout = (torch.randn(cfg.batch, cfg.heads, cfg.length, cfg.d, device="cuda",
                                 dtype=DTYPE, requires_grad=i < 3) for i in range(4))
    try:
        fn = PEERS[peer](cfg)

        def fwd_bwd():
            fn(q, k, v).backward(dout)

        # One forward+backward for the peak memory (it also compiles FlexAttention).
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd()
        torch.cuda.synchronize()
        row.peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
        q.grad = k.grad = v.grad = None
        row.fwd_ms = _do_bench(lambda: fn(q, k, v), args.warmup, args.rep, [q, k, v])
        row.fwdbwd_ms = _do_bench(fwd_bwd, args.warmup, args.rep, [q, k, v])
    except PeerSkipped as e:
        row.note = str(e)
    except Exception as e:  # a peer refusing a config must not end the run
        row.note = _short_error(e)
    finally:
        del q, k, v, dout
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return row


def _fmt(x: Optional[float], spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _tflops(cfg: Config, ms: Optional[float], mode: str) -> Optional[float]:
    return None if ms is None else cfg.flops(mode) / (ms * 1e-3) / 1e12


def render_table(rows: List[Row]) -> str:
    lines = ["| D | L | B | H | causal | impl | fwd ms | fwd TFLOP/s | fwd+bwd ms "
             "| fwd+bwd TFLOP/s | peak MiB | note |",
             "|---:|---:|---:|---:|:---:|:---|---:|---:|---:|---:|---:|:---|"]
    for r in rows:
        c = r.cfg
        lines.append(
            f"| {c.d} | {c.length} | {c.batch} | {c.heads} | {'yes' if c.causal else 'no'} "
            f"| {r.peer} | {_fmt(r.fwd_ms, '.3f')} | {_fmt(_tflops(c, r.fwd_ms, 'fwd'), '.1f')} "
            f"| {_fmt(r.fwdbwd_ms, '.3f')} | {_fmt(_tflops(c, r.fwdbwd_ms, 'fwdbwd'), '.1f')} "
            f"| {_fmt(r.peak_mib, '.0f')} | {r.note.replace('|', '/')} |")
    return "\n".join(lines)


def render_ratios(rows: List[Row], ours: str = "adaattn") -> str:
    """``ours``'s speed against the fastest other peer of each config and direction (peer time
    / our time, so > 1 means ours is faster), one line per config."""
    by_key = {(r.cfg, r.peer): r for r in rows}
    lines = ["| D | L | causal | fwd vs fastest peer | fwd+bwd vs fastest peer |",
             "|---:|---:|:---:|:---|:---|"]
    for cfg in dict.fromkeys(r.cfg for r in rows):
        mine = by_key.get((cfg, ours))
        if mine is None:
            continue
        cells = []
        for field in ("fwd_ms", "fwdbwd_ms"):
            peers = [(getattr(r, field), r.peer) for r in rows
                     if r.cfg == cfg and r.peer != ours and getattr(r, field) is not None]
            t = getattr(mine, field)
            if t is None or not peers:
                cells.append("—")
                continue
            best, name = min(peers)
            cells.append(f"{best / t:.2f}x {name}")
        lines.append(f"| {cfg.d} | {cfg.length} | {'yes' if cfg.causal else 'no'} "
                     f"| {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def run_metadata(argv: List[str]) -> str:
    """The run's GPU, software, commit and command, for the printed table."""
    props = torch.cuda.get_device_properties(0)
    return "\n".join([
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- GPU: {props.name} (sm_{props.major}{props.minor}, "
        f"{props.total_memory / 2**30:.0f} GiB)",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"commit {results_io.git_commit()}",
        f"- command: `{results_io.command_line(argv)}`",
        "- " + TIMING,
    ])


TIMING = ("time: median of triton.testing.do_bench; TFLOP/s: flash-attn's count (fwd "
          "4·B·H·L²·D, halved when causal; fwd+bwd 3.5x fwd); peak: max_memory_allocated "
          "during one fwd+bwd minus the inputs")


def config_case(cfg: Config) -> str:
    return (f"D={cfg.d} L={cfg.length} B={cfg.batch} H={cfg.heads} "
            f"{'causal' if cfg.causal else 'non-causal'}")


def json_rows(rows: List[Row], ours: str = "adaattn", tflops: bool = True) -> List[dict]:
    """results_io rows (one per config and direction) from measured Rows: peer ``ours`` is
    reported as "adaattn", every other peer under its own name."""
    out = []
    for cfg in dict.fromkeys(r.cfg for r in rows):
        peers = [r for r in rows if r.cfg == cfg]
        if not any(r.peer == ours for r in peers):
            continue
        note = "; ".join(f"{r.peer}: {r.note}" for r in peers if r.note)
        config = {"d": cfg.d, "l": cfg.length, "b": cfg.batch, "h": cfg.heads,
                  "causal": cfg.causal}
        for field, direction, mode in (("fwd_ms", "fwd", "fwd"),
                                       ("fwdbwd_ms", "fwd+bwd", "fwdbwd")):
            def name(r):
                return "adaattn" if r.peer == ours else r.peer
            ms = {name(r): getattr(r, field) for r in peers}
            extra = {}
            if tflops:
                extra["tflops"] = {name(r): round(_tflops(cfg, getattr(r, field), mode), 1)
                                   for r in peers if getattr(r, field) is not None}
            if direction == "fwd+bwd":
                extra["peak_mib"] = {name(r): round(r.peak_mib) for r in peers
                                     if r.peak_mib is not None}
            out.append(results_io.row(config_case(cfg), direction, ms, config=config,
                                      note=note, **extra))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="D=128, L=4096, causal and not")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"comma-separated subset of {','.join(PEERS)} "
                             f"({', '.join(REQUIRED_PEERS)} always run)")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    results_io.add_arguments(parser, "flash, or flash-quick with --quick")
    args = parser.parse_args(argv[1:])
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = set(peers) - set(PEERS)
    if unknown:
        parser.error(f"unknown peers {sorted(unknown)}; choose from {list(PEERS)}")
    peers = [p for p in PEERS if p in peers or p in REQUIRED_PEERS]
    if adaattn is None:
        print(results_io.import_error_message("bench_attention.py", IMPORT_ERROR),
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_attention.py needs a CUDA device", file=sys.stderr)
        return 2
    # Every (config, mask) pair is a new FlexAttention graph; the default limit would silently
    # fall back to the eager (materialising) implementation after a few of them.
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    warnings.filterwarnings("ignore", category=UserWarning)

    family = args.family or ("flash-quick" if args.quick else "flash")
    title = (f"flash attention{' (quick subset)' if args.quick else ''}: bf16, "
             f"B·L = {TOKENS}, H·D = {HIDDEN}")
    meta = run_metadata(argv)
    rows: List[Row] = []
    for cfg in configs(args.quick):
        for peer in peers:
            row = measure(peer, cfg, args)
            rows.append(row)
            print(render_table([row]).splitlines()[-1], flush=True)
        if not args.no_write:  # after every config, so a run cut short still leaves results
            path = results_io.write(family, json_rows(rows), title=title, setup=TIMING,
                                    argv=argv, results_dir=args.results_dir)
    print()
    print("## " + title)
    print(meta)
    print(render_table(rows))
    print()
    print(render_ratios(rows))
    if not args.no_write:
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
