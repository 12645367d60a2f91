"""Benchmarks adaattn.rank_plan and adaptive-rank attention on CUDA against flash_attn (docs/ops.md;
§3.9; issue 33's bars, bf16, B=4, H=16, L=4096, D=128).

Part 1, the plan against one attention forward (bar: rank_plan <= 15% of one non-causal
flash_attn forward): rank_plan with method="sketch" and method="exact" on planted rank-32 and on
random inputs, and flash_attn forward on the same inputs, all by triton's do_bench.

Part 2, attention against flash_attn, causal and not, forward and forward+backward (dq, dk, dv):
* planted rank 32 (1% noise): adaptive_rank_attn planning every call (bars: flash / ours >=
  1.1x forward, >= 1.25x forward+backward) and nn.AdaptiveRankAttention reusing its plan (bars:
  >= 1.25x / >= 1.35x);
* random full-rank inputs: adaptive_rank_attn (bar: cost <= 1.03x flash, i.e. flash / ours >=
  0.971) and nn.AdaptiveRankAttention at its (full-rank) plan, which calls flash_attn.

Part 3, the plan's pieces (below).

Configs: q, k bf16 [4, 16, 4096, 128] (Hkv = 16, 64 Gram matrices of 128 x 128) and the GQA case
Hkv = 4 (k [4, 4, 4096, 128], 16 matrices), with random normal inputs and with a planted rank-32
subspace plus noise (a spectrum like real attention heads'). Rows: the Gram matrices as rank_plan
forms them (float32 accumulation inside the bf16 GEMM), the same through a float32 copy of q and
k (rank_plan's former way), torch.ops.adaattn.sym_eig on them (the full decomposition),
torch.ops.adaattn.sym_eig_top (rank_plan's op: all eigenvalues, the rank, the first `rank`
eigenvectors), torch.ops.adaattn.shifted_cholesky_info (adaptive_rank_attn's full-rank
certificate, at its shift for energy 0.99), torch.linalg.eigh in float64 (the former
eigensolver), and the whole rank_plan (with its one host synchronisation). Times are medians of
CUDA-event timings after warmup; sym_eig's accuracy on the same matrices is printed too
(max |U^T U - I| in float32 epsilons, max |A U - U diag(w)| / ||A||_F).

Writes benchmarks/results/rank.json: per (Hkv, inputs), the Gram step against the float32-copy
way, sym_eig and sym_eig_top against float64 torch.linalg.eigh, the certificate and the whole
rank_plan (direction "fwd": the plan has no backward); prints the table.

    python benchmarks/bench_rank.py [--markdown] [--results-dir DIR] [--skip-pieces]
"""
import argparse
import datetime
import os
import sys
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (also puts the in-place build on sys.path)
import results_io  # noqa: E402

adaattn = ba.adaattn  # None when the extension is not built (--help still works)
if adaattn is not None:
    from adaattn import rank as rank_module  # noqa: E402
    from adaattn.rank import _gram  # noqa: E402

BATCH, HEADS, LENGTH, DIM = 4, 16, 4096, 128
KV_HEADS = (16, 4)
PLANTED_RANK = 32


def inputs(hkv: int, kind: str):
    shape_q, shape_k = (BATCH, HEADS, LENGTH, DIM), (BATCH, hkv, LENGTH, DIM)
    if kind == "random":
        return (torch.randn(shape_q, device="cuda", dtype=torch.bfloat16),
                torch.randn(shape_k, device="cuda", dtype=torch.bfloat16))
    basis = torch.linalg.qr(torch.randn(BATCH, hkv, DIM, PLANTED_RANK, device="cuda"))[0]
    group = HEADS // hkv
    q = torch.randn(BATCH, HEADS, LENGTH, PLANTED_RANK, device="cuda") @ \
        basis.repeat_interleave(group, dim=1).mT
    k = torch.randn(BATCH, hkv, LENGTH, PLANTED_RANK, device="cuda") @ basis.mT
    return ((q + 0.05 * torch.randn_like(q)).bfloat16(),
            (k + 0.05 * torch.randn_like(k)).bfloat16())


def accuracy(gram: torch.Tensor) -> str:
    w, u = torch.ops.adaattn.sym_eig(gram)
    a, w, u = gram.double(), w.double(), u.double()
    eye = torch.eye(DIM, dtype=torch.float64, device="cuda")
    orth = (u.mT @ u - eye).abs().max().item() / torch.finfo(torch.float32).eps
    resid = ((a @ u - u * w.unsqueeze(-2)).abs().amax((-1, -2))
             / torch.linalg.matrix_norm(a)).max().item()
    return f"orthonormal to {orth:.1f} eps, residual {resid:.1e}"


def measure(hkv: int, kind: str, args, accuracies: Optional[Dict] = None) -> List[list]:
    """Rows [hkv, kind, step, ms]; sym_eig's accuracy goes to ``accuracies[(hkv, kind)]``."""
    q, k = inputs(hkv, kind)
    group = HEADS // hkv
    qm = q.reshape(BATCH * hkv, group * LENGTH, DIM)
    km = k.reshape(BATCH * hkv, LENGTH, DIM)
    gram = _gram(qm, km, torch.float32)
    rows = []

    def row(name: str, fn: Callable, reps: Optional[int] = None):
        ms = ba.event_bench(fn, (), args.warmup, reps or args.reps)
        rows.append([hkv, kind, name, ms])
        print(f"Hkv={hkv:2d} {kind:8s} {name:34s} {ms:9.3f} ms", flush=True)

    with torch.no_grad():
        row("gram (bf16 GEMM, fp32 accumulate)", lambda: _gram(qm, km, torch.float32))
        row("gram (float32 copy)", lambda: (lambda x, y: x.mT @ x + y.mT @ y)(qm.float(),
                                                                              km.float()))
        row("sym_eig", lambda: torch.ops.adaattn.sym_eig(gram))
        row("sym_eig_top (energy 0.99)", lambda: torch.ops.adaattn.sym_eig_top(gram, 0.99, 16, 16))
        shift = 0.01 / (DIM - 16 * ((DIM - 1) // 16)) + 8 * DIM * torch.finfo(torch.float32).eps
        row("shifted_cholesky_info (certificate)",
            lambda: torch.ops.adaattn.shifted_cholesky_info(gram, shift))
        row("eigh float64", lambda: torch.linalg.eigh(gram.double()), reps=args.eigh_reps)
        row("rank_plan (energy 0.99)", lambda: adaattn.rank_plan(q, k, energy=0.99))
    acc = accuracy(gram)
    print(f"Hkv={hkv:2d} {kind:8s} sym_eig accuracy: {acc}", flush=True)
    if accuracies is not None:
        accuracies[(hkv, kind)] = acc
    return rows


PLANTED_NOISE = 0.01
ENERGY = 0.99
# (name, direction, minimum flash / adaattn) of issue 33.
BARS = {("plan each call", "fwd"): 1.1, ("plan each call", "fwd+bwd"): 1.25,
        ("plan reused", "fwd"): 1.25, ("plan reused", "fwd+bwd"): 1.35,
        ("full rank, plan each call", "fwd"): 1 / 1.03,
        ("full rank, plan each call", "fwd+bwd"): 1 / 1.03,
        ("full rank, plan reused", "fwd"): 1 / 1.03,
        ("full rank, plan reused", "fwd+bwd"): 1 / 1.03}
PLAN_BAR = 0.15


def attention_inputs(kind: str, gen: torch.Generator):
    """q, k [B, H, L, D] bf16 (Hkv = H): planted rank 32 with unit-scale entries plus 1% noise,
    or random normal."""
    shape = (BATCH, HEADS, LENGTH, DIM)
    if kind == "random":
        return tuple(torch.randn(shape, device="cuda", generator=gen).bfloat16()
                     for _ in range(2))
    basis = torch.linalg.qr(torch.randn(BATCH, HEADS, DIM, PLANTED_RANK, device="cuda",
                                        generator=gen))[0]
    scale = (DIM / PLANTED_RANK) ** 0.5

    def draw():
        x = torch.randn(BATCH, HEADS, LENGTH, PLANTED_RANK, device="cuda", generator=gen)
        x = x @ basis.mT * scale
        return (x + PLANTED_NOISE * torch.randn(x.shape, device="cuda", generator=gen)).bfloat16()

    return draw(), draw()


def bench_pair(fn, inputs, dout, args):
    """(forward ms, forward+backward ms) of fn(*inputs), triton do_bench (L2 flushed)."""
    grads = [t for t in inputs if t.requires_grad]
    fwd = ba._do_bench(lambda: fn(*inputs), args.bench_warmup, args.bench_rep, grads)
    both = ba._do_bench(lambda: fn(*inputs).backward(dout), args.bench_warmup, args.bench_rep,
                        grads)
    return fwd, both


def measure_attention(args, json_rows: List[dict]) -> List[str]:
    """Parts 1 and 2; appends results_io rows, returns markdown table lines."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    v = torch.randn(BATCH, HEADS, LENGTH, DIM, device="cuda", generator=gen).bfloat16()
    dout = torch.randn(BATCH, HEADS, LENGTH, DIM, device="cuda", generator=gen).bfloat16()
    config = {"b": BATCH, "h": HEADS, "l": LENGTH, "d": DIM}
    lines = ["| inputs | causal | case | direction | adaattn ms | flash ms | flash / adaattn | "
             "bar | pass |", "|---|---|---|---|---:|---:|---:|---:|---|"]

    def report(kind, causal, case, direction, ours, flash, bar, **extra):
        ratio = flash / ours
        ok = ratio >= bar
        line = (f"| {kind} | {causal} | {case} | {direction} | {ours:.3f} | {flash:.3f} | "
                f"{ratio:.3f} | >= {bar:.3f} | {'yes' if ok else 'NO'} |")
        lines.append(line)
        print(line, flush=True)
        json_rows.append(results_io.row(
            f"{kind} q/k, {'causal' if causal else 'non-causal'}: {case}", direction,
            {"adaattn": ours, "adaattn-flash": flash}, ratio=round(ratio, 4),
            bar=f"flash / adaattn >= {bar:.3f}", passed="yes" if ok else "NO",
            config=dict(config, causal=causal), **extra))

    for kind in ("planted", "random"):
        q, k = attention_inputs(kind, gen)
        with torch.no_grad():
            flash_fwd = ba._do_bench(lambda: adaattn.flash_attn(q, k, v), args.bench_warmup,
                                     args.bench_rep, [])
            default_iters = rank_module._SKETCH_POWER_ITERS
            for method, iters in (("sketch", default_iters), ("sketch", 1 - default_iters),
                                  ("exact", default_iters)):
                rank_module._SKETCH_POWER_ITERS = iters
                plan = adaattn.rank_plan(q, k, energy=ENERGY, method=method)
                ranks = plan.ranks.unique().tolist()
                ms = ba._do_bench(lambda: adaattn.rank_plan(q, k, energy=ENERGY, method=method),
                                  args.bench_warmup, args.bench_rep, [])
                rank_module._SKETCH_POWER_ITERS = default_iters
                share = ms / flash_fwd
                ok = share <= PLAN_BAR
                if method == "sketch":
                    method = f"sketch, {iters} power iteration{'s' * (iters != 1)}"
                line = (f"| {kind} | - | rank_plan(method={method!r}) vs one flash forward, "
                        f"ranks {ranks} | fwd | {ms:.3f} | {flash_fwd:.3f} | {share:.1%} of "
                        f"flash | <= {PLAN_BAR:.0%} | {'yes' if ok else 'NO'} |")
                lines.append(line)
                print(line, flush=True)
                json_rows.append(results_io.row(
                    f"{kind} q/k: rank_plan(method={method!r}) against one flash_attn forward",
                    "fwd", {"adaattn": ms, "adaattn-flash": flash_fwd},
                    share_of_flash=round(share, 4), bar=f"<= {PLAN_BAR:.0%} of flash",
                    passed="yes" if ok else "NO", ranks=ranks, config=config))
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        prefix = "" if kind == "planted" else "full rank, "
        for causal in (False, True):
            flash = bench_pair(lambda a, b, c: adaattn.flash_attn(a, b, c, causal=causal),
                               (qg, kg, vg), dout, args)
            each = bench_pair(lambda a, b, c: adaattn.adaptive_rank_attn(
                a, b, c, energy=ENERGY, causal=causal), (qg, kg, vg), dout, args)
            module = adaattn.nn.AdaptiveRankAttention(ENERGY, causal=causal,
                                                      replan_every=10 ** 9)
            module(q, k, v)
            width = module.plan.basis.shape[-1]
            reused = bench_pair(module, (qg, kg, vg), dout, args)
            assert module.plans_made == 1
            for i, direction in enumerate(("fwd", "fwd+bwd")):
                case = prefix + "plan each call"
                report(kind, causal, case + " (adaptive_rank_attn)", direction, each[i],
                       flash[i], BARS[(case, direction)])
                case = prefix + "plan reused"
                report(kind, causal, case + f" (nn.AdaptiveRankAttention, width {width})",
                       direction, reused[i], flash[i], BARS[(case, direction)])
        del q, k, qg, kg, vg
        torch.cuda.empty_cache()
    return lines


def render(rows: List[list]) -> str:
    lines = ["| Hkv | matrices | inputs | step | ms |", "|---:|---:|:---|:---|---:|"]
    for hkv, kind, name, ms in rows:
        lines.append(f"| {hkv} | {BATCH * hkv} | {kind} | {name} | {ms:.3f} |")
    return "\n".join(lines)


def metadata(argv: List[str]) -> str:
    props = torch.cuda.get_device_properties(0)
    return "\n".join([
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- GPU: {props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs)",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"commit {results_io.git_commit()}",
        f"- command: `{results_io.command_line(argv)}`",
        f"- q bf16 [{BATCH}, {HEADS}, {LENGTH}, {DIM}], k [{BATCH}, Hkv, {LENGTH}, {DIM}]; "
        f"planted: rank {PLANTED_RANK} + 0.05 noise; time: median of CUDA events",
    ])


# (case, the step reported as adaattn, {peer name: the step measured as that peer})
CASES = (("Gram matrices", "gram (bf16 GEMM, fp32 accumulate)",
          {"torch-float32-copy": "gram (float32 copy)"}),
         ("sym_eig (all eigenvectors)", "sym_eig", {"torch-eigh-float64": "eigh float64"}),
         ("sym_eig_top (energy 0.99)", "sym_eig_top (energy 0.99)",
          {"torch-eigh-float64": "eigh float64"}),
         ("shifted_cholesky_info (certificate)", "shifted_cholesky_info (certificate)", {}),
         ("rank_plan (energy 0.99)", "rank_plan (energy 0.99)", {}))


def json_rows(rows: List[list], accuracies: Dict) -> List[dict]:
    times = {(hkv, kind, name): ms for hkv, kind, name, ms in rows}
    out = []
    for hkv, kind in dict.fromkeys((hkv, kind) for hkv, kind, _, _ in rows):
        for case, ours, peers in CASES:
            if (hkv, kind, ours) not in times:
                continue
            ms = {"adaattn": times[(hkv, kind, ours)]}
            ms.update({peer: times.get((hkv, kind, step)) for peer, step in peers.items()})
            out.append(results_io.row(
                f"Hkv={hkv} ({BATCH * hkv} matrices of {DIM}), {kind}: {case}", "fwd", ms,
                accuracy=accuracies.get((hkv, kind)) if ours == "sym_eig" else None,
                config={"b": BATCH, "hq": HEADS, "hkv": hkv, "l": LENGTH, "d": DIM}))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true",
                        help="also print the results as a markdown section")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--eigh-reps", type=int, default=3, help="reps of the slow float64 eigh")
    parser.add_argument("--bench-warmup", type=int, default=25,
                        help="do_bench warmup of parts 1 and 2, ms")
    parser.add_argument("--bench-rep", type=int, default=100,
                        help="do_bench measuring time of parts 1 and 2, ms")
    parser.add_argument("--skip-pieces", action="store_true",
                        help="skip part 3 (the plan's pieces, incl. the slow float64 eigh)")
    results_io.add_arguments(parser, "rank")
    args = parser.parse_args(argv[1:])
    if adaattn is None:
        print(results_io.import_error_message("bench_rank.py", ba.IMPORT_ERROR),
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_rank.py needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    attention_rows: List[dict] = []
    attention_table = measure_attention(args, attention_rows)
    rows: List[list] = []
    accuracies: Dict = {}
    if not args.skip_pieces:
        for hkv in KV_HEADS:
            for kind in ("random", "planted"):
                rows += measure(hkv, kind, args, accuracies)
    title = ("adaptive rank: rank_plan and adaptive_rank_attn against "
             "flash_attn; the plan's pieces")
    body = (f"## {title}\n\n{metadata(argv)}\n\n" + "\n".join(attention_table)
            + (f"\n\n{render(rows)}" if rows else ""))
    if args.markdown:
        print()
        print(body)
    if not args.no_write:
        setup = (f"bf16 q, k, v [{BATCH}, {HEADS}, {LENGTH}, {DIM}]; parts 1-2: planted rank "
                 f"{PLANTED_RANK} + {PLANTED_NOISE:.0%} noise or random, energy {ENERGY}, "
                 "median of triton do_bench (L2 flushed), rank_plan timed with its host "
                 "synchronisation; part 3 (the plan's pieces, k [4, Hkv, 4096, 128], planted "
                 "+ 0.05 noise): median of CUDA events")
        path = results_io.write(args.family or "rank",
                                attention_rows + json_rows(rows, accuracies), title=title,
                                setup=setup, argv=argv, results_dir=args.results_dir)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
