"""Train a small character-level language model whose attention is adaattn.nn.LazyAttention.

The corpus is made up by the script from a seeded template: each line introduces two invented
names and an object, and its last sentence repeats them, so the model can only predict it by
attending back to the start of the line. Every layer uses lazy attention (docs/ops.md): a learnable
per-head ``tau`` that zeroes weak attention weights and a relative-position bias table, which is
the model's only position signal. The script prints the loss as it trains, completes a prompt at
the end, and saves a PNG with the training-loss curve and every head's ``tau`` over training.

    pip install -r requirements-examples.txt        # matplotlib, for the PNG
    python examples/train_lazy.py [--steps 800] [--device auto|cpu|cuda] [--out train_lazy.png]
                                  [--seed 0] [--log-every 50] [--threads 1]

CUDA runs in bfloat16 autocast (tau and bias stay float32), the CPU in float32. On the CPU a
run is deterministic for a given seed and thread count; on CUDA the script asks torch for
deterministic kernels.
"""
import argparse
import dataclasses
import os
import random
import sys
import time
from typing import Callable, List

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # plotting.py

from adaattn.nn import LazyAttention  # noqa: E402
from plotting import require_pyplot  # noqa: E402

SYLLABLES = ["ka", "lo", "mi", "ra", "tu", "ze", "no", "fi", "sa", "ve", "du", "pe"]
PLACES = ["garden", "harbor", "market", "tower", "forest", "bridge"]
COLORS = ["red", "blue", "green", "gold", "grey", "white"]
OBJECTS = ["lamp", "book", "coin", "key", "map", "cup"]
PROMPT = "kalo met zefi at the market. kalo gave zefi a red coin. zefi thanked"


def make_corpus(num_lines: int, seed: int) -> str:
    """``num_lines`` lines such as ``"rapo met vesa at the tower. rapo gave vesa a gold key.
    vesa thanked rapo for the gold key."``: the last sentence is fixed by the first two."""
    rng = random.Random(seed)

    def name():
        return "".join(rng.choice(SYLLABLES) for _ in range(2))

    lines = []
    for _ in range(num_lines):
        a, b = name(), name()
        place, color, obj = rng.choice(PLACES), rng.choice(COLORS), rng.choice(OBJECTS)
        lines.append(f"{a} met {b} at the {place}. {a} gave {b} a {color} {obj}. "
                     f"{b} thanked {a} for the {color} {obj}.\n")
    return "".join(lines)


@dataclasses.dataclass
class Config:
    steps: int = 800
    batch_size: int = 16
    context: int = 128        # characters per training sequence (one to two corpus lines)
    layers: int = 2
    heads: int = 2
    head_dim: int = 64        # 64 or 128: the head dims of the op's CUDA tensor-core path
    window: int = 128         # bias table length; >= context gives every distance its own bias
    tau_init: float = -1.0
    lr: float = 1e-2
    # Rate for tau and bias: Adam moves a parameter by at most about its rate per step, and
    # these must move by units (a strong previous-character bias, say) early in training.
    lr_lazy: float = 3e-2
    corpus_lines: int = 4000
    seed: int = 0
    log_every: int = 50


class Block(nn.Module):
    """Pre-norm transformer block: causal lazy self-attention, then an MLP. ``[B, L, E]``."""

    def __init__(self, cfg: Config):
        super().__init__()
        dim = cfg.heads * cfg.head_dim
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attn = LazyAttention(cfg.heads, window=cfg.window, tau_init=cfg.tau_init)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, self.head_dim)
        # (B, L, H, D) viewed as [B, H, L, D]: the op takes these strides without a copy.
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        x = x + self.proj(self.attn(q, k, v).transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x))


class CharLM(nn.Module):
    """Token ids ``[B, L]`` -> next-character logits ``[B, L, vocab]``."""

    def __init__(self, vocab: int, cfg: Config):
        super().__init__()
        dim = cfg.heads * cfg.head_dim
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def taus(self) -> torch.Tensor:
        """Every head's tau, ``[layers, heads]``."""
        return torch.stack([block.attn.tau.detach() for block in self.blocks])


@dataclasses.dataclass
class Result:
    model: CharLM
    chars: List[str]          # vocabulary: id -> character
    losses: torch.Tensor      # [steps], training loss of each step
    taus: torch.Tensor        # [steps + 1, layers, heads], before training and after each step
    seconds: float


def train(cfg: Config, device: str = "cpu", log: Callable[[str], None] = print) -> Result:
    """Trains a CharLM on the generated corpus with Adam (``lr_lazy`` for tau and bias);
    bfloat16 autocast on CUDA."""
    torch.manual_seed(cfg.seed)
    text = make_corpus(cfg.corpus_lines, cfg.seed)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    model = CharLM(len(chars), cfg).to(device)
    lazy = [p for block in model.blocks for p in block.attn.parameters()]  # tau and bias
    rest = [p for name, p in model.named_parameters() if ".attn." not in name]
    optimizer = torch.optim.Adam([{"params": rest}, {"params": lazy, "lr": cfg.lr_lazy}],
                                 lr=cfg.lr)
    batches = torch.Generator().manual_seed(cfg.seed)
    offsets = torch.arange(cfg.context + 1)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))

    losses, taus = [], [model.taus().clone()]
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        begin = torch.randint(len(data) - cfg.context - 1, (cfg.batch_size, 1), generator=batches)
        seq = data[begin + offsets].to(device)
        with autocast:
            logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), seq[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        taus.append(model.taus().clone())
        if step % cfg.log_every == 0 or step == cfg.steps:
            tau_text = " ".join(f"{t:+.2f}" for t in taus[-1].flatten().tolist())
            log(f"step {step:5d}  loss {loss.item():.3f}  tau [{tau_text}]  "
                f"{time.perf_counter() - start:6.1f}s")
    return Result(model, chars, torch.stack(losses).cpu(), torch.stack(taus).cpu(),
                  time.perf_counter() - start)


@torch.no_grad()
def complete(result: Result, prompt: str, length: int, device: str) -> str:
    """Greedy continuation of ``prompt`` by ``length`` characters (recomputed from scratch)."""
    ids = [result.chars.index(c) for c in prompt]
    for _ in range(length):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda")):
            logits = result.model(torch.tensor([ids], device=device))
        ids.append(int(logits[0, -1].argmax()))
    return "".join(result.chars[i] for i in ids[len(prompt):])


def save_plot(plt, result: Result, path: str) -> None:
    """Left: training loss per step. Right: each head's tau over training."""
    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(range(1, len(result.losses) + 1), result.losses.numpy(), linewidth=0.8)
    ax_loss.set(title="training loss", xlabel="step", ylabel="cross-entropy (nats/char)")
    ax_loss.grid(alpha=0.3)
    for layer in range(result.taus.shape[1]):
        for head in range(result.taus.shape[2]):
            ax_tau.plot(result.taus[:, layer, head].numpy(), label=f"layer {layer} head {head}")
    ax_tau.set(title="tau per head", xlabel="step", ylabel="tau")
    ax_tau.grid(alpha=0.3)
    ax_tau.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    defaults = Config()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda")
    parser.add_argument("--out", default="train_lazy.png", help="path of the PNG to write")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--log-every", type=int, default=defaults.log_every)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch (more gain little here, and are slow on a "
                             "busy CPU)")
    args = parser.parse_args(argv)
    # Before training, so a missing matplotlib costs no time.
    plt = require_pyplot("examples/train_lazy.py")

    # The model's products are small: a second thread gains little on idle cores, and on 2 cores
    # busy with other work, 2 threads made a step 8x slower than 1. A fixed count also keeps CPU
    # runs repeatable across machines (the results depend on the thread count).
    torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        # Same seed, same losses: ask for deterministic kernels (cuBLAS needs this setting);
        # warn_only, as an op without a deterministic CUDA kernel should not stop the example.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = dataclasses.replace(defaults, steps=args.steps, seed=args.seed,
                              log_every=args.log_every)
    print(f"device {device}{' (bfloat16 autocast)' if device.startswith('cuda') else ''}, "
          f"{cfg.layers} layers x {cfg.heads} heads x {cfg.head_dim}, context {cfg.context}, "
          f"batch {cfg.batch_size}, {cfg.steps} steps")
    result = train(cfg, device)
    print(f"trained in {result.seconds:.1f}s, final loss {result.losses[-1]:.3f} "
          f"(mean of the last 10 steps {result.losses[-10:].mean():.3f})")
    print(f"prompt:     {PROMPT!r}\ncompletion: {complete(result, PROMPT, 23, device)!r}")
    save_plot(plt, result, args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
