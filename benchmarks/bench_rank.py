"""Benchmarks adaattn.rank_plan's pieces on CUDA (spec §3.4: the plan should cost well under one
attention forward).

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

    python benchmarks/bench_rank.py [--markdown] [--out benchmarks/RESULTS.md]
"""
import argparse
import datetime
import os
import shlex
import sys
from typing import Callable, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (also puts the in-place build on sys.path)

import adaattn  # noqa: E402
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


def measure(hkv: int, kind: str, args) -> List[list]:
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
    print(f"Hkv={hkv:2d} {kind:8s} sym_eig accuracy: {accuracy(gram)}", flush=True)
    return rows


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
        f"- torch {torch.__version__}, CUDA {torch.version.cuda}, commit {ba._git_commit()}",
        f"- command: `{' '.join(shlex.quote(a) for a in ['python'] + argv)}`",
        f"- q bf16 [{BATCH}, {HEADS}, {LENGTH}, {DIM}], k [{BATCH}, Hkv, {LENGTH}, {DIM}]; "
        f"planted: rank {PLANTED_RANK} + 0.05 noise; time: median of CUDA events",
    ])


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true",
                        help="also print the results as a markdown section for RESULTS.md")
    parser.add_argument("--out", help="markdown results file to update (section 'rank')")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--eigh-reps", type=int, default=3, help="reps of the slow float64 eigh")
    args = parser.parse_args(argv[1:])
    if not torch.cuda.is_available():
        print("bench_rank.py needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rows = []
    for hkv in KV_HEADS:
        for kind in ("random", "planted"):
            rows += measure(hkv, kind, args)
    body = (f"## rank_plan (spec §3.4): Gram, sym_eig, eigh, whole plan\n\n{metadata(argv)}\n\n"
            f"{render(rows)}")
    if args.markdown:
        print()
        print(body)
    if args.out:
        ba.update_results(args.out, "rank", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
