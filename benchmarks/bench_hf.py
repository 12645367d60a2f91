"""Benchmarks attn_implementation="adaattn" in a Hugging Face transformers model on CUDA (issue 35).

Model: a randomly initialised Llama (transformers.LlamaForCausalLM), 4 layers, hidden 2048,
intermediate 5632, GQA 16 query / 4 kv heads of dim 128, vocabulary 32000, bf16 weights (no
autocast). Every implementation runs the same weights in the same process
(``model.set_attn_implementation``): "adaattn", "sdpa" and, when flash-attn is installed,
"flash_attention_2".

Cases (time: median of CUDA-event timings after warmup; generation: wall clock, as its host
work is part of the cost):

- train step, fwd + bwd of the LM loss (no optimizer step; gradients reset to None before each
  step, untimed): L = 4096 (B = 4) and L = 16384 (B = 1), no padding.
- packed vs padded: documents of random lengths in [256, 4096] (seed 0) totalling 16384 tokens,
  trained as one padding-free row (position_ids restarting per document plus transformers'
  ``cu_seq_lens_*`` / ``max_length_*`` kwargs, as ``DataCollatorWithFlattening`` makes them)
  and as a right-padded batch ``[documents, longest]`` with its attention_mask; the padding
  fraction is the padded batch's share of padding tokens.
- generate(): batch 1 and 32, prompts of 512 random tokens (no padding), 128 new tokens
  (min_new_tokens = max_new_tokens, greedy, DynamicCache); reported as milliseconds per
  generated token (the call's time over batch * 128; lower is better; tokens/s = 1000 / ms).
  adaattn's first call counts its KV-cache op calls (the decode path), expected layers * 127.

Bars (issue 35), printed at the end: adaattn's train step at most sdpa's time at both lengths;
packed adaattn at most (1 - padding fraction) of padded adaattn's time; generate ms per token at
most sdpa's at batch 1 and 32.

Every case catches its own failure (an out-of-memory error included) and records it in the row's
note; the results file is rewritten after every case, and cases past ``--budget-s`` seconds are
skipped (noted), so the run ends well within the device's 10-minute limit (about 2 minutes on an
H100).

    python benchmarks/bench_hf.py [--budget-s 300] [--results-dir DIR]   # writes hf.json
    python benchmarks/bench_hf.py --smoke --no-write                     # tiny model, any device
"""
import argparse
import gc
import os
import random
import statistics
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (also puts the in-place build on sys.path)
import results_io  # noqa: E402

adaattn = ba.adaattn  # None when the extension is not built (--help still works)

FAMILY = "hf"
DTYPE = torch.bfloat16
MODEL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=4, head_dim=128,
             max_position_embeddings=32768, attention_dropout=0.0, pad_token_id=0,
             bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
TRAIN_SHAPES = ((4, 4096), (1, 16384))  # (B, L)
PACKED_TOKENS, DOC_MIN, DOC_MAX = 16384, 256, 4096
PROMPT, NEW_TOKENS, GEN_BATCHES = 512, 128, (1, 32)
# --smoke: the same cases on a tiny model and short lengths (checks the script, times nothing).
SMOKE_MODEL = dict(MODEL, vocab_size=512, hidden_size=128, intermediate_size=256,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   max_position_embeddings=1024)
SMOKE_TRAIN_SHAPES = ((2, 128), (1, 256))
SMOKE_PACKED = (256, 16, 96)
SMOKE_GEN = (16, 6, (1, 3))


class Budget:
    """Seconds left of the run's budget; cases starting past it are skipped."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def spent(self) -> bool:
        return time.monotonic() > self.end


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], None], before: Callable[[], None], warmup: int, reps: int,
              device: torch.device) -> float:
    """Median milliseconds of ``reps`` calls of ``fn`` after ``warmup`` (``before`` runs, untimed,
    ahead of each): CUDA events on a GPU, the wall clock elsewhere."""
    for _ in range(warmup):
        before()
        fn()
    times = []
    for _ in range(reps):
        before()
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def attempt(fn: Callable[[], object], device: torch.device) -> Tuple[object, str]:
    """``(fn(), "")``, or ``(None, the error)`` when it fails (out of memory included): one case
    must not end the run."""
    try:
        return fn(), ""
    except torch.cuda.OutOfMemoryError as e:
        return None, "OOM: " + ba._short_error(e)
    except Exception as e:  # noqa: BLE001  (a refusing implementation is a result too)
        return None, ba._short_error(e)
    finally:
        free(device)


def implementations() -> List[str]:
    import transformers
    impls = ["adaattn", "sdpa"]
    if transformers.utils.is_flash_attn_2_available():
        impls.append("flash_attention_2")
    return impls


def build_model(config_kwargs: dict, device: torch.device):
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**config_kwargs)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    return model.to(DTYPE)


def train_inputs_dense(batch: int, length: int, vocab: int, device) -> dict:
    ids = torch.randint(3, vocab, (batch, length), device=device)
    return dict(input_ids=ids, labels=ids)


def document_lengths(total: int, low: int, high: int, seed: int = 0) -> List[int]:
    """Random lengths in [low, high] adding up to ``total`` (the last one cut to fit, at least
    ``low``)."""
    rng = random.Random(seed)
    lengths: List[int] = []
    while sum(lengths) < total:
        lengths.append(rng.randint(low, high))
    lengths[-1] -= sum(lengths) - total
    if lengths[-1] < low:
        lengths[-2] += lengths.pop()
    return lengths


def train_inputs_packed(lengths: List[int], vocab: int, device) -> dict:
    """One padding-free row: position_ids restart per document, cu_seq_lens_* as
    DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives them, and labels -100 at
    every document's first token (no prediction across documents)."""
    total = sum(lengths)
    ids = torch.randint(3, vocab, (1, total), device=device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    starts = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    labels = ids.clone()
    labels[0, starts[:-1].long()] = -100
    longest = max(lengths)
    return dict(input_ids=ids, position_ids=positions, labels=labels, cu_seq_lens_q=starts,
                cu_seq_lens_k=starts, max_length_q=longest, max_length_k=longest)


def train_inputs_padded(lengths: List[int], vocab: int, device) -> Tuple[dict, float]:
    """The documents as a right-padded batch ``[len(lengths), max(lengths)]``, and its padding
    fraction."""
    longest = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), longest), device=device)
    mask = (torch.arange(longest)[None] < torch.tensor(lengths)[:, None]).to(device)
    ids = ids.masked_fill(~mask, MODEL["pad_token_id"])
    labels = ids.masked_fill(~mask, -100)
    padding = 1 - sum(lengths) / (len(lengths) * longest)
    return dict(input_ids=ids, attention_mask=mask.long(), labels=labels), padding


def bench_train(model, impl: str, inputs: dict, args, device) -> Tuple[float, float]:
    """(median ms of one fwd + bwd, peak MiB allocated during a step)."""
    model.set_attn_implementation(impl)
    model.train()

    def step():
        model(**inputs, use_cache=False).loss.backward()

    def reset():
        model.zero_grad(set_to_none=True)

    ms = median_ms(step, reset, args.train_warmup, args.train_reps, device)
    peak = None
    if device.type == "cuda":
        reset()
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        sync(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    reset()
    return ms, peak


def count_decode_calls(fn: Callable[[], object]) -> Tuple[object, int]:
    """``fn()`` with the integration's KV-cache op calls counted (``_Flash.decode``, the only
    caller of ``adaattn.ops.flash_attn_with_kvcache`` there)."""
    from adaattn.integrations.transformers import _Flash
    op, calls = _Flash.decode, [0]

    def counted(*a, **k):
        calls[0] += 1
        return op(*a, **k)
    _Flash.decode = counted
    try:
        return fn(), calls[0]
    finally:
        _Flash.decode = op


def generate_call(model, impl: str, prompt: torch.Tensor, new_tokens: int) -> Callable:
    """One greedy ``generate()`` of ``new_tokens`` tokens with ``impl``, as a closure."""
    mask = torch.ones_like(prompt)

    def generate():
        model.set_attn_implementation(impl)
        model.eval()
        with torch.no_grad():
            return model.generate(prompt, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                                  pad_token_id=MODEL["pad_token_id"])
    return generate


def bench_generate(model, impls: List[str], prompt: torch.Tensor, new_tokens: int, args,
                   device) -> Tuple[Dict, Dict, Optional[int], List[str]]:
    """Per implementation: median ms per generated token over ``args.gen_reps`` rounds, the
    implementations alternating inside each round (batch-1 generation is bound by host time,
    which drifts over a run), after one warmup call each; the new tokens of the warmup; and
    adaattn's KV-cache op calls in its warmup call, and the errors."""
    calls, tokens, times, errors = None, {}, {}, []
    generate = {impl: generate_call(model, impl, prompt, new_tokens) for impl in impls}
    for impl in impls:
        if impl == "adaattn":
            result, err = attempt(lambda: count_decode_calls(generate[impl]), device)
            out, calls = result if result is not None else (None, None)
        else:
            out, err = attempt(generate[impl], device)
        if err:
            errors.append(f"{impl}: {err}")
        else:
            tokens[impl] = out[:, prompt.shape[1]:]
            times[impl] = []
    for _ in range(args.gen_reps):
        for impl in times:
            sync(device)
            t0 = time.perf_counter()
            generate[impl]()
            sync(device)
            times[impl].append((time.perf_counter() - t0) * 1e3)
    per_token = {impl: (statistics.median(times[impl]) / (prompt.shape[0] * new_tokens)
                        if impl in times else None) for impl in impls}
    return per_token, tokens, calls, errors


def fmt(x: Optional[float], spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def run(args, argv: List[str]) -> int:
    import transformers
    import adaattn.integrations.transformers  # noqa: F401  (registers "adaattn")
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    smoke = args.smoke
    if not smoke and device.type != "cuda":
        print("bench_hf.py needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    if smoke and device.type != "cuda":
        results_io.gpu_name = lambda: "cpu (--smoke)"
    model_kwargs = SMOKE_MODEL if smoke else MODEL
    train_shapes = SMOKE_TRAIN_SHAPES if smoke else TRAIN_SHAPES
    packed_tokens, doc_min, doc_max = SMOKE_PACKED if smoke else (PACKED_TOKENS, DOC_MIN, DOC_MAX)
    prompt_len, new_tokens, gen_batches = SMOKE_GEN if smoke else (PROMPT, NEW_TOKENS,
                                                                   GEN_BATCHES)
    vocab, layers = model_kwargs["vocab_size"], model_kwargs["num_hidden_layers"]
    budget = Budget(args.budget_s)
    impls = implementations()
    model = build_model(model_kwargs, device)
    params = sum(p.numel() for p in model.parameters())
    title = (f"HF transformers Llama ({layers} layers, hidden {model_kwargs['hidden_size']}, "
             f"GQA {model_kwargs['num_attention_heads']}/{model_kwargs['num_key_value_heads']} "
             f"heads of {model_kwargs['head_dim']}, {params / 1e6:.0f}M parameters, random init, "
             f"bf16): attn_implementation adaattn vs {', '.join(impls[1:])}")
    setup = ("train: median CUDA-event time of fwd + bwd of the LM loss (no optimizer step), "
             f"{args.train_warmup} warmup + {args.train_reps} timed steps; packed: documents of "
             f"{doc_min}-{doc_max} tokens (seed 0) totalling {packed_tokens}, one padding-free "
             "row with position_ids and cu_seq_lens_* kwargs, vs the same documents right-padded "
             "to the longest; generate: greedy, DynamicCache, prompt "
             f"{prompt_len} random tokens, {new_tokens} new tokens, median wall clock of "
             f"{args.gen_reps} rounds of one call per implementation (alternating) after one "
             "warmup call each, in ms per generated token (lower is "
             "better); tokens_match_sdpa: share of greedy tokens equal to sdpa's (random-init "
             "logits are nearly flat, so bf16 rounding flips some; exactness is tested on the "
             "CPU in float64); decode_op_calls: KV-cache op calls "
             "(adaattn.ops.flash_attn_with_kvcache) in one generate() "
             f" (layers * (new tokens - 1) = {layers * (new_tokens - 1)} when every "
             "decode step takes the KV-cache op)")
    rows: List[dict] = []
    notes: List[str] = []
    summary: List[str] = []

    def write():
        if not args.no_write:
            results_io.write(args.family or FAMILY, rows, title=title, setup=setup, notes=notes,
                             argv=argv, results_dir=args.results_dir)

    def measure_all(label: str, fn: Callable[[str], object]) -> Tuple[Dict, List[str]]:
        results, errors = {}, []
        for impl in impls:
            if budget.spent():
                results[impl] = None
                errors.append(f"{impl}: skipped (time budget of {args.budget_s:.0f} s spent)")
                continue
            t0 = time.monotonic()
            results[impl], err = attempt(lambda impl=impl: fn(impl), device)
            if err:
                errors.append(f"{impl}: {err}")
            print(f"  {label} {impl}: {time.monotonic() - t0:.1f} s {err}", flush=True)
        return results, errors

    def ms_of(results, i=0):
        return {impl: (None if r is None else r[i]) for impl, r in results.items()}

    # Train steps without padding.
    for batch, length in train_shapes:
        inputs = train_inputs_dense(batch, length, vocab, device)
        results, errors = measure_all(f"train L={length}",
                                      lambda impl: bench_train(model, impl, inputs, args, device))
        ms = ms_of(results)
        peak = {impl: round(p, 1) for impl, p in ms_of(results, 1).items() if p is not None}
        rows.append(results_io.row(
            f"train step L={length} B={batch} (fwd+bwd, no optimizer)", "fwd+bwd", ms,
            peak_mib=peak, note="; ".join(errors), config=dict(b=batch, l=length, kind="dense")))
        summary.append(bar_line(f"train L={length}: adaattn <= sdpa", ms["adaattn"], ms["sdpa"]))
        del inputs
        write()

    # Packed vs padded.
    lengths = document_lengths(packed_tokens, doc_min, doc_max)
    packed = train_inputs_packed(lengths, vocab, device)
    padded, padding = train_inputs_padded(lengths, vocab, device)
    res_packed, err_packed = measure_all(
        "train packed", lambda impl: bench_train(model, impl, packed, args, device))
    res_padded, err_padded = measure_all(
        "train padded", lambda impl: bench_train(model, impl, padded, args, device))
    ms_packed, ms_padded = ms_of(res_packed), ms_of(res_padded)
    ratio = (None if ms_packed["adaattn"] is None or ms_padded["adaattn"] is None
             else round(ms_packed["adaattn"] / ms_padded["adaattn"], 3))
    config = dict(documents=len(lengths), tokens=sum(lengths), longest=max(lengths),
                  lengths=lengths)
    rows.append(results_io.row(
        f"train step packed: {len(lengths)} documents, {sum(lengths)} tokens in one row "
        "(padding-free)", "fwd+bwd", ms_packed, padding_fraction=round(padding, 3),
        packed_over_padded=ratio, note="; ".join(err_packed), config=dict(config, kind="packed"),
        peak_mib={i: round(p, 1) for i, p in ms_of(res_packed, 1).items() if p is not None}))
    rows.append(results_io.row(
        f"train step padded: B={len(lengths)} x L={max(lengths)}, right padding", "fwd+bwd",
        ms_padded, padding_fraction=round(padding, 3), note="; ".join(err_padded),
        config=dict(config, kind="padded"),
        peak_mib={i: round(p, 1) for i, p in ms_of(res_padded, 1).items() if p is not None}))
    summary.append(
        f"packed/padded adaattn = {fmt(ratio)} (bar <= 1 - padding fraction = {1 - padding:.3f}): "
        + ("—" if ratio is None else ("ok" if ratio <= 1 - padding else "MISS")))
    del packed, padded
    write()

    # generate().
    model.zero_grad(set_to_none=True)
    for batch in gen_batches:
        prompt = torch.randint(3, vocab, (batch, prompt_len), device=device)
        if budget.spent():
            ms, tokens, calls = {impl: None for impl in impls}, {}, None
            errors = [f"skipped (time budget of {args.budget_s:.0f} s spent)"]
        else:
            t0 = time.monotonic()
            ms, tokens, calls, errors = bench_generate(model, impls, prompt, new_tokens, args,
                                                       device)
            print(f"  generate B={batch}: {time.monotonic() - t0:.1f} s", flush=True)
        match = None
        if tokens.get("adaattn") is not None and tokens.get("sdpa") is not None:
            match = round((tokens["adaattn"] == tokens["sdpa"]).float().mean().item(), 3)
        expected = layers * (new_tokens - 1)
        if calls is not None and calls != expected:
            errors.append(f"adaattn took the KV-cache op {calls} times, expected {expected}")
        rows.append(results_io.row(
            f"generate B={batch} prompt {prompt_len} +{new_tokens} greedy: ms per generated "
            "token (lower is better)", "fwd", ms,
            tokens_per_s=None if ms["adaattn"] is None else round(1e3 / ms["adaattn"], 1),
            decode_op_calls=calls, tokens_match_sdpa=match, note="; ".join(errors),
            config=dict(b=batch, prompt=prompt_len, new_tokens=new_tokens)))
        summary.append(bar_line(f"generate B={batch} ms/token: adaattn <= sdpa", ms["adaattn"],
                                ms["sdpa"]) + f" (decode op calls {calls}, expected {expected})")
        del prompt
        write()

    print()
    print("## " + title)
    if device.type == "cuda":
        print(ba.run_metadata(argv).replace("- " + ba.TIMING, "- " + setup))
    print()
    print("| case | " + " | ".join(f"{i} ms" for i in impls) + " | extras |")
    print("|:---|" + "---:|" * len(impls) + ":---|")
    for r in rows:
        extras = {k: v for k, v in r.items() if k not in ("case", "direction", "ms", "config",
                                                          "peak_mib", "note")}
        print(f"| {r['case']} | " + " | ".join(fmt(r["ms"].get(i)) for i in impls)
              + f" | {extras} |")
        if r.get("note"):
            print(f"|   note: {r['note']} |")
    print()
    print("Bars (issue 35):")
    for line in summary:
        print("- " + line)
    if not args.no_write:
        print(f"\nwrote {os.path.join(args.results_dir, (args.family or FAMILY) + '.json')}")
    return 0


def bar_line(label: str, ours: Optional[float], peer: Optional[float]) -> str:
    if ours is None or peer is None:
        return f"{label}: — (adaattn {fmt(ours)}, peer {fmt(peer)})"
    verdict = "ok" if ours <= peer else "MISS"
    return f"{label}: {ours:.3f} vs {peer:.3f} ms, {peer / ours:.2f}x: {verdict}"


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=300,
                        help="cases starting after this many seconds are skipped (default 300)")
    parser.add_argument("--train-warmup", type=int, default=3)
    parser.add_argument("--train-reps", type=int, default=10)
    parser.add_argument("--gen-reps", type=int, default=5,
                        help="rounds of timed generate() calls per case (the implementations "
                             "alternating), after one warmup call each")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model and short lengths on any device: checks the script")
    results_io.add_arguments(parser, FAMILY)
    args = parser.parse_args(argv[1:])
    if adaattn is None:
        print(results_io.import_error_message("bench_hf.py", ba.IMPORT_ERROR), file=sys.stderr)
        return 2
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"bench_hf.py needs transformers (requirements-dev.txt pins 5.17.0): {e}",
              file=sys.stderr)
        return 2
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
