"""Benchmarks the score-modifier variants of adaattn.flash_attn on CUDA against plain flash
attention and compiled FlexAttention with the same score_mod, in one run.

Configs as bench_attention.py (bf16, B*L = 16384, H*D = 2048); D in {64, 128}, L in {1k, 4k},
causal and not. Variants: softcap = 30 (Gemma 2's logit cap at its scale: s <- 30 tanh(s / 30)),
alibi (slopes 2^(-8 h / H), flash-attn's ALiBi), sinks (learnable [H], its gradient included in
fwd+bwd), rel_bias (learnable [H, 256] table, gradient included). Rows per variant V:
adaattn-V (the row's "adaattn"), adaattn-plain (flash_attn without a modifier: the variant's
cost, same run), flex-V (FlexAttention, score_mod = the same modifier, where one exists: softcap,
alibi, and rel_bias with the table captured as a learnable tensor; sinks have no score_mod).
Issue bars: each variant within 10% of plain flash at D = 128, L = 4096, fwd and fwd+bwd;
rel_bias fwd+bwd >= 1.5x compiled Flex with the same learnable bias where Flex compiles (a Flex
failure is recorded in the row's note).

Writes benchmarks/results/variants.json (``--quick``: variants-quick.json); case names start
with the variant ("alibi D=128 L=4096 ...").

    python benchmarks/bench_variants.py [--quick] [--variants softcap,alibi,sinks,rel_bias]
        [--results-dir DIR]
"""
import argparse
import os
import statistics
import sys
import warnings
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (also puts the in-place build on sys.path)
import results_io  # noqa: E402

adaattn = ba.adaattn  # None when the extension is not built (--help still works)

SOFTCAP = 30.0
REL_BIAS_WINDOW = 256
VARIANT_NAMES = ("softcap", "alibi", "sinks", "rel_bias")


def _alibi_slopes(heads: int) -> torch.Tensor:
    return 2.0 ** (-8.0 * torch.arange(1, heads + 1, device="cuda", dtype=torch.float32) / heads)


def _sinks(heads: int) -> torch.Tensor:
    return torch.zeros(heads, device="cuda", requires_grad=True)


def _rel_bias(heads: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    return (0.1 * torch.randn(heads, REL_BIAS_WINDOW, device="cuda", generator=g)
            ).requires_grad_()


def configs(quick: bool) -> List[ba.Config]:
    if quick:
        return [ba.Config(128, 4096, False), ba.Config(128, 4096, True)]
    return [ba.Config(d, length, causal) for d in (64, 128) for length in (1024, 4096)
            for causal in (False, True)]


def _softcap(cfg: ba.Config) -> Callable:
    return lambda q, k, v: adaattn.flash_attn(q, k, v, causal=cfg.causal, softcap=SOFTCAP)


def _plain(cfg: ba.Config) -> Callable:
    return lambda q, k, v: adaattn.flash_attn(q, k, v, causal=cfg.causal)


def _alibi(cfg: ba.Config) -> Callable:
    slopes = _alibi_slopes(cfg.heads)
    return lambda q, k, v: adaattn.flash_attn(q, k, v, causal=cfg.causal, alibi_slopes=slopes)


def _with_sinks(cfg: ba.Config) -> Callable:
    sinks = _sinks(cfg.heads)
    return lambda q, k, v: adaattn.flash_attn(q, k, v, causal=cfg.causal, sinks=sinks)


def _with_rel_bias(cfg: ba.Config) -> Callable:
    bias = _rel_bias(cfg.heads)
    return lambda q, k, v: adaattn.flash_attn(q, k, v, causal=cfg.causal, rel_bias=bias)


_flex_compiled = None


def _flex(cfg: ba.Config, score_mod: Callable) -> Callable:
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if cfg.causal:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B=None,
                                       H=None, Q_LEN=cfg.length, KV_LEN=cfg.length,
                                       device="cuda")
    return lambda q, k, v: _flex_compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)


def _flex_softcap(cfg: ba.Config) -> Callable:
    def cap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)
    return _flex(cfg, cap)


def _flex_alibi(cfg: ba.Config) -> Callable:
    slopes = _alibi_slopes(cfg.heads)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return _flex(cfg, alibi)


def _flex_rel_bias(cfg: ba.Config) -> Callable:
    """The same learnable table captured by the score_mod (Flex differentiates captured
    tensors that require grad)."""
    bias = _rel_bias(cfg.heads)

    def rel(score, b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        inside = (d >= 0) & (d < REL_BIAS_WINDOW)
        return score + torch.where(inside, bias[h, d.clamp(0, REL_BIAS_WINDOW - 1)], 0.0)
    return _flex(cfg, rel)


PEERS: Dict[str, Callable[[ba.Config], Callable]] = {
    "adaattn-softcap": _softcap,
    "adaattn-alibi": _alibi,
    "adaattn-sinks": _with_sinks,
    "adaattn-rel_bias": _with_rel_bias,
    "adaattn-plain": _plain,
    "flex-softcap": _flex_softcap,
    "flex-alibi": _flex_alibi,
    "flex-rel_bias": _flex_rel_bias,
}


def _median(xs: List[Optional[float]]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _measure_rounds(peers: List[str], cfg: ba.Config, args) -> List[ba.Row]:
    """Each peer's row with the medians over ``args.rounds`` rounds that measure every peer in
    turn: a variant's cost is a ratio to plain flash, and the GPU's clock drifts over a run
    (one pass per peer read plain flash 15% slower than its neighbours in one run), so the
    peers share each round's conditions."""
    rounds = [[ba.measure(peer, cfg, args) for peer in peers] for _ in range(args.rounds)]
    merged = []
    for i, peer in enumerate(peers):
        runs = [r[i] for r in rounds]
        row = ba.Row(cfg, peer, note=runs[0].note, peak_mib=runs[0].peak_mib)
        row.fwd_ms = _median([r.fwd_ms for r in runs])
        row.fwdbwd_ms = _median([r.fwdbwd_ms for r in runs])
        merged.append(row)
    return merged


def _variant_json_rows(rows: List[ba.Row], variants: List[str]) -> List[dict]:
    """One results row per (variant, config, direction): adaattn-V as "adaattn", plain flash and
    flex-V of the same run as peers; the case name starts with the variant."""
    out = []
    for variant in variants:
        mine = {f"adaattn-{variant}", "adaattn-plain", f"flex-{variant}"}
        for r in ba.json_rows([r for r in rows if r.peer in mine], ours=f"adaattn-{variant}"):
            r["case"] = f"{variant} {r['case']}"
            out.append(r)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="only D=128, L=4096 (the bar)")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"comma-separated subset of {','.join(PEERS)}")
    parser.add_argument("--variants", default=",".join(VARIANT_NAMES),
                        help="comma-separated variants to report (their adaattn/flex peers run "
                             "when listed in --peers)")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over all peers; each time is the median over rounds")
    results_io.add_arguments(parser, "variants, or variants-quick with --quick")
    args = parser.parse_args(argv[1:])
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(variants) - set(VARIANT_NAMES):
        parser.error(f"unknown variants {sorted(set(variants) - set(VARIANT_NAMES))}; choose "
                     f"from {list(VARIANT_NAMES)}")
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = set(peers) - set(PEERS)
    if unknown:
        parser.error(f"unknown peers {sorted(unknown)}; choose from {list(PEERS)}")
    peers = [p for p in peers if p == "adaattn-plain" or p.split("-", 1)[1] in variants]
    if adaattn is None:
        print(results_io.import_error_message("bench_variants.py", ba.IMPORT_ERROR),
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_variants.py needs a CUDA device", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", category=UserWarning)
    ba.PEERS.update(PEERS)  # ba.measure looks peers up by name

    family = args.family or ("variants-quick" if args.quick else "variants")
    title = (f"score variants: softcap = {SOFTCAP}, ALiBi, learnable sinks, learnable rel_bias "
             f"[H, {REL_BIAS_WINDOW}]; bf16, B·L = {ba.TOKENS}, H·D = {ba.HIDDEN}")
    setup = (f"adaattn = flash_attn(<variant>) per case, vs flash_attn() and FlexAttention in the "
             f"same run; {ba.TIMING}, median over {args.rounds} rounds that each measure every "
             f"peer in turn")
    rows: List[ba.Row] = []
    for cfg in configs(args.quick):
        for row in _measure_rounds(peers, cfg, args):
            rows.append(row)
            print(ba.render_table([row]).splitlines()[-1], flush=True)
        if not args.no_write:
            path = results_io.write(family, _variant_json_rows(rows, variants),
                                    title=title, setup=setup, argv=argv,
                                    results_dir=args.results_dir)
    print(ba.render_table(rows))
    if not args.no_write:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
