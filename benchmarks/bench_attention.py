"""Benchmarks adaattn.flash_attn against its peers on CUDA (spec §5).

Configs: bf16, B*L = 16384, H*D = 2048, D in {64, 128}, L in {1024, 4096, 16384}, causal and not.
Peers in the same run: F.scaled_dot_product_attention pinned to each backend (flash, cuDNN,
efficient), compiled FlexAttention, and the eager reference (adaattn.reference, only where its
L x L matrices fit in memory). For each: forward and forward+backward time (median of
triton.testing.do_bench), TFLOP/s with flash-attn's count (forward 4*B*H*Lq*Lk*D, halved when
causal; backward 2.5x forward, so forward+backward = 3.5x), and the peak memory of one
forward+backward above the inputs. A peer that refuses or fails a config is recorded, not fatal.

    python benchmarks/bench_attention.py [--quick] [--out benchmarks/RESULTS.md]

``--out`` rewrites only this script's section of the results file (sections are keyed, see
``update_results``), so other op families can keep their own tables in the same file.
"""
import argparse
import dataclasses
import datetime
import os
import re
import shlex
import subprocess
import sys
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # the in-place build next to the sources

import adaattn  # noqa: E402

TOKENS = 16384  # B * L
HIDDEN = 2048  # H * D
DTYPE = torch.bfloat16
RESULTS_TITLE = "# adaattn benchmark results"
NO_RESULTS = "_No GPU results yet._"


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


def _git_commit() -> str:
    """HEAD of the checkout, or $ADAATTN_COMMIT where the tree was copied without .git."""
    if os.environ.get("ADAATTN_COMMIT"):
        return os.environ["ADAATTN_COMMIT"]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                                capture_output=True, text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, timeout=30).stdout
        return commit + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def render_ratios(rows: List[Row], baseline: str = "sdpa-flash") -> str:
    """adaattn's speed and peak memory relative to ``baseline``, one line per config."""
    by_key = {(r.cfg, r.peer): r for r in rows}
    lines = [f"| D | L | causal | fwd speed vs {baseline} | fwd+bwd speed vs {baseline} "
             f"| peak memory vs {baseline} |", "|---:|---:|:---:|---:|---:|---:|"]
    for cfg in dict.fromkeys(r.cfg for r in rows):
        ours, base = by_key.get((cfg, "adaattn")), by_key.get((cfg, baseline))
        if ours is None or base is None:
            continue

        def ratio(a, b):
            return "—" if a is None or b is None else f"{a / b:.2f}x"
        lines.append(f"| {cfg.d} | {cfg.length} | {'yes' if cfg.causal else 'no'} "
                     f"| {ratio(base.fwd_ms, ours.fwd_ms)} "
                     f"| {ratio(base.fwdbwd_ms, ours.fwdbwd_ms)} "
                     f"| {ratio(ours.peak_mib, base.peak_mib)} |")
    return "\n".join(lines)


def run_metadata(argv: List[str]) -> str:
    props = torch.cuda.get_device_properties(0)
    return "\n".join([
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- GPU: {props.name} (sm_{props.major}{props.minor}, "
        f"{props.total_memory / 2**30:.0f} GiB)",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda}, commit {_git_commit()}",
        f"- command: `{' '.join(shlex.quote(a) for a in ['python'] + argv)}`",
        "- time: median of triton.testing.do_bench; TFLOP/s: flash-attn's count (fwd "
        "4·B·H·L²·D, halved when causal; fwd+bwd 3.5x fwd); peak: max_memory_allocated "
        "during one fwd+bwd minus the inputs",
    ])


def _markers(key: str):
    return f"<!-- results:{key} -->", f"<!-- /results:{key} -->"


def update_results(path: str, key: str, body: str) -> None:
    """Replaces (or appends) the section ``key`` of the markdown results file at ``path``.

    Each benchmark family owns one keyed section, so e.g. a lazy or varlen benchmark can call
    this with its own key without touching the flash tables.
    """
    text = open(path).read() if os.path.exists(path) else RESULTS_TITLE + "\n"
    text = text.replace(NO_RESULTS + "\n", "").replace(NO_RESULTS, "")
    begin, end = _markers(key)
    block = f"{begin}\n{body.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="D=128, L=4096, causal and not")
    parser.add_argument("--out", help="markdown results file to update, e.g. benchmarks/RESULTS.md")
    parser.add_argument("--section", help="results section key (default: flash or flash-quick)")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"comma-separated subset of {','.join(PEERS)}")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    args = parser.parse_args(argv[1:])
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = set(peers) - set(PEERS)
    if unknown:
        parser.error(f"unknown peers {sorted(unknown)}; choose from {list(PEERS)}")
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

    key = args.section or ("flash-quick" if args.quick else "flash")
    title = (f"## flash attention{' (quick subset)' if args.quick else ''}: bf16, "
             f"B·L = {TOKENS}, H·D = {HIDDEN}")
    meta = run_metadata(argv)
    rows: List[Row] = []
    for cfg in configs(args.quick):
        for peer in peers:
            row = measure(peer, cfg, args)
            rows.append(row)
            print(render_table([row]).splitlines()[-1], flush=True)
        if args.out:  # after every config, so a run cut short still leaves its results
            update_results(args.out, key, f"{title}\n\n{meta}\n\n{render_table(rows)}"
                                          f"\n\n{render_ratios(rows)}")
    print()
    print(title)
    print(meta)
    print(render_table(rows))
    print()
    print(render_ratios(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
