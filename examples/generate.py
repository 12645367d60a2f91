"""Generate text with a small lazy-attention char LM, decoding through a paged KV cache.

Trains the character-level model of examples/train_lazy.py briefly (every layer is
adaattn.nn.LazyAttention), then completes several prompts of different lengths as one batch:
each prompt is prefilled into one adaattn.KVCache per layer (adaattn.lazy_attn over the prompt,
KVCache.append for its keys and values), and each new token then costs one
adaattn.lazy_attn_with_kvcache call per layer, which writes the token's keys and values into the
cache's pages itself and attends at the token's absolute position (the bias distance and the
``tau / (i + 1)`` shift of lazy attention depend on it). Eager generation, recomputing the model
over the whole sequence for every token (what examples/train_lazy.py's ``complete`` does), runs
on the same prompts; the script prints both token rates and whether the greedy completions agree.

    python examples/generate.py [--steps 250] [--tokens 120] [--device auto|cpu|cuda] [--threads 1]

CUDA runs in bfloat16 autocast with a bfloat16 cache, the CPU in float32 (a run takes well under a
minute on one CPU thread).
"""
import argparse
import dataclasses
import os
import sys
import time
from typing import Callable, List, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import adaattn  # noqa: E402
from train_lazy import PROMPT, CharLM, Config, make_corpus, train  # noqa: E402

PAGE_SIZE = 16


def run_block(block: nn.Module, x: torch.Tensor, attend: Callable) -> torch.Tensor:
    """One train_lazy.Block on ``x [B, L, E]`` with its attention core replaced by
    ``attend(q, k, v) -> out`` (``[B, H, L, D]`` views of the block's projections)."""
    batch, length, dim = x.shape
    qkv = block.qkv(block.norm1(x)).view(batch, length, 3, block.heads, block.head_dim)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    x = x + block.proj(attend(q, k, v).transpose(1, 2).reshape(batch, length, dim))
    return x + block.mlp(block.norm2(x))


class CachedDecoder:
    """Runs a trained CharLM token by token with one paged adaattn.KVCache per layer; every
    layer's cache allocates the same rows and pages, so one sequence id serves them all."""

    def __init__(self, model: CharLM, cfg: Config, max_batch: int, max_len: int, dtype, device):
        self.model = model
        pages_per_seq = -(-max_len // PAGE_SIZE)
        self.caches = [adaattn.KVCache(max_batch * pages_per_seq, PAGE_SIZE, cfg.heads,
                                       cfg.head_dim, max_batch=max_batch,
                                       max_pages_per_seq=pages_per_seq, dtype=dtype,
                                       device=device)
                       for _ in model.blocks]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.head(self.model.norm(x))

    def prefill(self, ids: List[int]) -> Tuple[int, torch.Tensor]:
        """Allocates a sequence for the prompt ``ids`` and fills its caches; returns the
        sequence id and the logits after the prompt ``[vocab]``."""
        seq = [cache.allocate() for cache in self.caches][0]
        x = self.model.embed(torch.tensor([ids], device=self.caches[0].k_pages.device))
        for block, cache in zip(self.model.blocks, self.caches):
            def attend(q, k, v, block=block, cache=cache):
                cache.append([seq], k, v)
                return block.attn(q, k, v)
            x = run_block(block, x, attend)
        return seq, self._logits(x[0, -1])

    def step(self, seq_ids: List[int], tokens: torch.Tensor) -> torch.Tensor:
        """Feeds one token per sequence (``tokens [N]``, int64) at the end of sequences
        ``seq_ids``; returns the next-token logits ``[N, vocab]``."""
        x = self.model.embed(tokens.view(-1, 1))
        for block, cache in zip(self.model.blocks, self.caches):
            def attend(q, k, v, block=block, cache=cache):
                cache.reserve(seq_ids, 1)
                out = adaattn.lazy_attn_with_kvcache(
                    q, cache.k_pages, cache.v_pages, k, v, block.attn.tau, block.attn.bias,
                    cache_seqlens=cache.seqlens[seq_ids], block_table=cache.block_table[seq_ids])
                cache.advance(seq_ids, 1)
                return out
            x = run_block(block, x, attend)
        return self._logits(x[:, -1])


def generate_cached(model, cfg, prompts: List[List[int]], tokens: int, dtype,
                    device) -> List[List[int]]:
    """Greedy completions of every prompt, batched, through the paged caches."""
    decoder = CachedDecoder(model, cfg, len(prompts), max(map(len, prompts)) + tokens, dtype,
                            device)
    seqs, firsts = zip(*(decoder.prefill(p) for p in prompts))
    seqs = list(seqs)
    next_ids = torch.stack(firsts).argmax(-1)
    out = [next_ids]
    for _ in range(tokens - 1):
        next_ids = decoder.step(seqs, next_ids).argmax(-1)
        out.append(next_ids)
    return torch.stack(out, dim=1).tolist()


def generate_eager(model, prompts: List[List[int]], tokens: int, device) -> List[List[int]]:
    """Greedy completions, recomputing the model over the whole sequence for every token."""
    completions = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(tokens):
            ids.append(int(model(torch.tensor([ids], device=device))[0, -1].argmax()))
        completions.append(ids[len(prompt):])
    return completions


def timed(fn: Callable, device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=250, help="training steps")
    parser.add_argument("--tokens", type=int, default=120, help="new tokens per prompt")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device.startswith("cuda")

    cfg = dataclasses.replace(Config(), steps=args.steps, seed=args.seed, log_every=args.steps)
    print(f"training {cfg.layers} layers x {cfg.heads} lazy heads x {cfg.head_dim} for "
          f"{cfg.steps} steps on {device}")
    result = train(cfg, device)
    model = result.model.eval()
    print(f"trained in {result.seconds:.1f}s, final loss {result.losses[-1]:.3f}")

    # The prompt of train_lazy.py and beginnings of other lines, cut at different lengths.
    lines = make_corpus(3, args.seed + 1).splitlines()
    texts = [PROMPT, lines[0][:20], lines[1][:45], lines[2][:7]]
    prompts = [[result.chars.index(c) for c in text] for text in texts]
    dtype = torch.bfloat16 if cuda else torch.float32
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
        # One untimed round of each warms up the allocator and (on CUDA) the kernels.
        generate_cached(model, cfg, prompts, 2, dtype, device)
        generate_eager(model, prompts, 2, device)
        cached, t_cached = timed(
            lambda: generate_cached(model, cfg, prompts, args.tokens, dtype, device), device)
        eager, t_eager = timed(lambda: generate_eager(model, prompts, args.tokens, device),
                               device)
    for text, completion in zip(texts, cached):
        print(f"{text!r} -> {''.join(result.chars[i] for i in completion)!r}")
    total = len(prompts) * args.tokens
    print(f"paged KV cache (lazy_attn_with_kvcache): {total / t_cached:8.1f} tokens/s")
    print(f"eager (whole sequence every token):      {total / t_eager:8.1f} tokens/s "
          f"(the cache is {t_eager / t_cached:.1f}x faster)")
    same = sum(a == b for a, b in zip(cached, eager))
    print(f"greedy completions identical to eager: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
