"""Benchmarks the score-modifier variants of adaattn.flash_attn on CUDA against plain flash
attention and compiled FlexAttention with the same score_mod, in one run.

Configs as bench_attention.py (bf16, B*L = 16384, H*D = 2048); D in {64, 128}, L in {1k, 4k},
causal and not. softcap = 30 (Gemma 2's logit cap at its scale: s <- 30 tanh(s / 30)). Rows:
adaattn-softcap (the row's "adaattn"), adaattn-plain (flash_attn without a modifier: the
variant's cost), flex-softcap (FlexAttention, score_mod = the same tanh cap). Issue bar:
softcap within 10% of plain flash at D = 128, L = 4096, fwd and fwd+bwd.

Writes benchmarks/results/variants.json (``--quick``: variants-quick.json).

    python benchmarks/bench_variants.py [--quick] [--results-dir DIR]
"""
import argparse
import os
import sys
import warnings
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (also puts the in-place build on sys.path)
import results_io  # noqa: E402

adaattn = ba.adaattn  # None when the extension is not built (--help still works)

SOFTCAP = 30.0


def configs(quick: bool) -> List[ba.Config]:
    if quick:
        return [ba.Config(128, 4096, False), ba.Config(128, 4096, True)]
    return [ba.Config(d, length, causal) for d in (64, 128) for length in (1024, 4096)
            for causal in (False, True)]


def _softcap(cfg: ba.Config) -> Callable:
    return lambda q, k, v: adaattn.flash_attn(q, k, v, causal=cfg.causal, softcap=SOFTCAP)


def _plain(cfg: ba.Config) -> Callable:
    return lambda q, k, v: adaattn.flash_attn(q, k, v, causal=cfg.causal)


_flex_compiled = None


def _flex_softcap(cfg: ba.Config) -> Callable:
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if cfg.causal:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B=None,
                                       H=None, Q_LEN=cfg.length, KV_LEN=cfg.length,
                                       device="cuda")

    def cap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)
    return lambda q, k, v: _flex_compiled(q, k, v, score_mod=cap, block_mask=block_mask)


PEERS: Dict[str, Callable[[ba.Config], Callable]] = {
    "adaattn-softcap": _softcap,
    "adaattn-plain": _plain,
    "flex-softcap": _flex_softcap,
}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="only D=128, L=4096 (the bar)")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"comma-separated subset of {','.join(PEERS)}")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    results_io.add_arguments(parser, "variants, or variants-quick with --quick")
    args = parser.parse_args(argv[1:])
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = set(peers) - set(PEERS)
    if unknown:
        parser.error(f"unknown peers {sorted(unknown)}; choose from {list(PEERS)}")
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
    title = (f"score modifiers: softcap = {SOFTCAP}, bf16, B·L = {ba.TOKENS}, "
             f"H·D = {ba.HIDDEN}")
    setup = f"adaattn = flash_attn(softcap={SOFTCAP}); {ba.TIMING}"
    rows: List[ba.Row] = []
    for cfg in configs(args.quick):
        for peer in peers:
            row = ba.measure(peer, cfg, args)
            rows.append(row)
            print(ba.render_table([row]).splitlines()[-1], flush=True)
        if not args.no_write:
            path = results_io.write(family, ba.json_rows(rows, ours="adaattn-softcap"),
                                    title=title, setup=setup, argv=argv,
                                    results_dir=args.results_dir)
    print(ba.render_table(rows))
    if not args.no_write:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
