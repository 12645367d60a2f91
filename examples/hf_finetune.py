"""Train a tiny Hugging Face Llama with attn_implementation="adaattn", then fine-tune it into
lazy attention with use_lazy_attention, on packed (padding-free) synthetic text.

The corpus is the seeded template of examples/train_lazy.py (each line introduces two invented
names and an object; its last sentence repeats them), tokenised by character. Every step packs
randomly drawn lines into one padding-free row with transformers' DataCollatorWithFlattening
(``position_ids`` restart per line; ``cu_seq_lens_*`` kwargs), which adaattn runs through
``flash_attn_varlen`` / ``lazy_attn_varlen`` without cross-line attention. The script then

1. trains a randomly initialised 2-layer Llama (GQA 4/2 heads of dim 64) for ``--steps``;
2. converts it with ``use_lazy_attention`` (learnable ``tau``/``bias`` per layer) and trains
   ``--lazy-steps`` more;
3. times forward + backward (tokens/s) of "sdpa", "adaattn" and lazy attention on the same
   batches;
4. completes a batch of left-padded prompts with ``generate()`` (DynamicCache; adaattn's decode
   goes through ``flash_attn_with_kvcache`` / ``lazy_attn_with_kvcache``), checks that greedy
   tokens of "adaattn" equal those of "sdpa", and prints tokens/s;
5. saves both loss curves to a PNG (when matplotlib is installed).

    pip install -r requirements-examples.txt        # matplotlib, for the PNG (optional)
    python examples/hf_finetune.py [--steps 300] [--lazy-steps 150] [--device auto|cpu|cuda]
                                   [--out hf_finetune.png] [--seed 0] [--threads 1]

CUDA runs in bfloat16 autocast (parameters, tau and bias float32), the CPU in float32.
"""
import argparse
import copy
import dataclasses
import os
import random
import sys
import time
from typing import Callable, Dict, List

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_lazy.py, plotting.py

from adaattn.integrations import transformers as hf  # noqa: E402
from adaattn.nn import LazyAttention  # noqa: E402
from train_lazy import make_corpus  # noqa: E402

PROMPTS = ["kalo met zefi at the market. kalo gave zefi a red coin. zefi thanked",
           "rapo met vesa at the tower. rapo gave",
           "duno met fika at the bridge. duno gave fika a gold map. fika",
           "mira met tuze at the"]


@dataclasses.dataclass
class Config:
    steps: int = 300
    lazy_steps: int = 150
    lines_per_step: int = 8       # corpus lines packed into each step's row (~600 tokens)
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64            # a head dim of the CUDA tensor-core kernels
    window: int = 128             # lazy attention's bias table (longer than a corpus line)
    tau_init: float = -1.0
    lr: float = 3e-3
    lr_lazy: float = 3e-2         # tau and bias must move by units, like train_lazy.py's
    corpus_lines: int = 4000
    timing_steps: int = 20
    new_tokens: int = 24
    seed: int = 0


class Data:
    """Character vocabulary of the corpus and packed training rows."""

    def __init__(self, cfg: Config):
        self.lines = make_corpus(cfg.corpus_lines, cfg.seed).splitlines(keepends=True)
        self.chars = ["<pad>"] + sorted(set("".join(self.lines)))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.rng = random.Random(cfg.seed)
        self.collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        self.lines_per_step = cfg.lines_per_step

    def encode(self, text: str) -> List[int]:
        return [self.index[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)

    def batch(self, device: str) -> Dict[str, torch.Tensor]:
        """One padding-free row: ``input_ids``, ``labels``, ``position_ids`` ``[1, T]`` and the
        ``cu_seq_lens_q/k`` / ``max_length_q/k`` kwargs."""
        lines = self.rng.sample(self.lines, self.lines_per_step)
        batch = self.collator([{"input_ids": self.encode(line)} for line in lines])
        return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def make_model(cfg: Config, vocab: int, device: str) -> transformers.LlamaForCausalLM:
    torch.manual_seed(cfg.seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=cfg.heads * cfg.head_dim, head_dim=cfg.head_dim,
        intermediate_size=2 * cfg.heads * cfg.head_dim, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=512, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    return transformers.LlamaForCausalLM._from_config(
        config, attn_implementation=hf.ATTN_IMPLEMENTATION).to(device)


def _autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))


def train(model, data: Data, steps: int, optimizer, device: str,
          log: Callable[[str], None] = print, label: str = "") -> List[float]:
    """``steps`` Adam steps on packed rows; returns the loss of every step."""
    model.train()
    losses = []
    for step in range(1, steps + 1):
        with _autocast(device):
            loss = model(**data.batch(device), use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps:
            log(f"{label} step {step:4d}  loss {loss.item():.3f}")
    return losses


def lazy_optimizer(model, cfg: Config) -> torch.optim.Optimizer:
    lazy = [p for n, p in model.named_parameters() if ".lazy_attention." in n]
    rest = [p for n, p in model.named_parameters() if ".lazy_attention." not in n]
    return torch.optim.Adam([{"params": rest}, {"params": lazy, "lr": cfg.lr_lazy}], lr=cfg.lr)


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def training_tokens_per_second(models: Dict[str, torch.nn.Module], batches,
                               device: str) -> Dict[str, float]:
    """Training-step throughput of a copy of each ``{attn_implementation: model}``; the
    implementations take turns on every batch, so that load from other processes hits them
    alike (the first batch warms up)."""
    copies = {impl: copy.deepcopy(model) for impl, model in models.items()}
    seconds = dict.fromkeys(copies, 0.0)
    for i, batch in enumerate(batches):
        for impl, model in copies.items():
            model.set_attn_implementation(impl)
            _synchronize(device)
            start = time.perf_counter()
            with _autocast(device):
                loss = model(**batch, use_cache=False).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            _synchronize(device)
            seconds[impl] += (time.perf_counter() - start) if i else 0.0
    tokens = sum(batch["input_ids"].numel() for batch in batches[1:])
    return {impl: tokens / s for impl, s in seconds.items()}


@torch.no_grad()
def generate(model, impl: str, data: Data, new_tokens: int, device: str):
    """Greedy completions of the left-padded PROMPTS; returns ``(new token ids [B, new_tokens],
    tokens/s)``."""
    model.eval()
    model.set_attn_implementation(impl)
    width = max(len(p) for p in PROMPTS)
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(PROMPTS):
        ids[row, width - len(prompt):] = torch.tensor(data.encode(prompt))
        mask[row, width - len(prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)
    _synchronize(device)
    start = time.perf_counter()
    with _autocast(device):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    _synchronize(device)
    return out[:, width:].cpu(), out[:, width:].numel() / (time.perf_counter() - start)


def save_plot(plt, losses: List[float], lazy_losses: List[float], path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses, linewidth=0.8, label='attn_implementation="adaattn"')
    ax.plot(range(len(losses) + 1, len(losses) + len(lazy_losses) + 1), lazy_losses,
            linewidth=0.8, label="after use_lazy_attention")
    ax.set(title="tiny Llama on packed synthetic text", xlabel="step",
           ylabel="cross-entropy (nats/char)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _pyplot():
    """matplotlib.pyplot (Agg), or None with a message: the PNG is optional here."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG will be written "
              "(pip install -r requirements-examples.txt)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def main(argv=None) -> None:
    defaults = Config()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--lazy-steps", type=int, default=defaults.lazy_steps)
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda")
    parser.add_argument("--out", default="hf_finetune.png", help="path of the PNG to write")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch (the model's products are small)")
    args = parser.parse_args(argv)
    plt = _pyplot()
    torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = dataclasses.replace(defaults, steps=args.steps, lazy_steps=args.lazy_steps,
                              seed=args.seed)
    data = Data(cfg)
    model = make_model(cfg, len(data.chars), device)
    print(f"device {device}{' (bfloat16 autocast)' if device.startswith('cuda') else ''}, "
          f"Llama {cfg.layers} layers, {cfg.heads}/{cfg.kv_heads} heads x {cfg.head_dim}, "
          f"{cfg.lines_per_step} packed lines per step")

    start = time.perf_counter()
    losses = train(model, data, cfg.steps, torch.optim.Adam(model.parameters(), lr=cfg.lr),
                   device, label="adaattn")
    print(f"trained {cfg.steps} steps in {time.perf_counter() - start:.1f}s")

    reference, _ = generate(model, "sdpa", data, cfg.new_tokens, device)
    tokens, gen_rate = generate(model, hf.ATTN_IMPLEMENTATION, data, cfg.new_tokens, device)
    _, sdpa_gen_rate = generate(model, "sdpa", data, cfg.new_tokens, device)
    agree = torch.equal(tokens, reference)

    lazy = hf.use_lazy_attention(copy.deepcopy(model), window=cfg.window, tau_init=cfg.tau_init)
    start = time.perf_counter()
    lazy_losses = train(lazy, data, cfg.lazy_steps, lazy_optimizer(lazy, cfg), device,
                        label="lazy   ")
    print(f"fine-tuned into lazy attention for {cfg.lazy_steps} steps in "
          f"{time.perf_counter() - start:.1f}s")
    batches = [data.batch(device) for _ in range(cfg.timing_steps + 1)]
    rates = training_tokens_per_second({"sdpa": model, hf.ATTN_IMPLEMENTATION: model,
                                        hf.LAZY_ATTN_IMPLEMENTATION: lazy}, batches, device)
    lazy_tokens, lazy_gen_rate = generate(lazy, hf.LAZY_ATTN_IMPLEMENTATION, data,
                                          cfg.new_tokens, device)
    taus = torch.stack([m.tau.detach() for m in lazy.modules()
                        if isinstance(m, LazyAttention)]).cpu()
    print("tau per head after fine-tuning: " + " | ".join(
        f"layer {layer}: " + " ".join(f"{t:+.2f}" for t in row)
        for layer, row in enumerate(taus.tolist())))

    print("training tokens/s: " + ", ".join(f"{k} {v:,.0f}" for k, v in rates.items()))
    print(f"generate() tokens/s: sdpa {sdpa_gen_rate:,.0f}, adaattn {gen_rate:,.0f}, "
          f"lazy {lazy_gen_rate:,.0f}; greedy adaattn tokens "
          f"{'identical to' if agree else 'DIFFER from'} sdpa")
    for prompt, ours, lazy_ids in zip(PROMPTS, tokens.tolist(), lazy_tokens.tolist()):
        print(f"prompt {prompt!r}\n  adaattn {data.decode(ours)!r}\n  lazy    "
              f"{data.decode(lazy_ids)!r}")
    if plt is not None:
        save_plot(plt, losses, lazy_losses, args.out)
        print(f"saved {args.out}")


if __name__ == "__main__":
    main()
