"""Host (Python) overhead of ``attn_implementation="adaattn"`` against ``"sdpa"``.

Generation at batch 1 is bound by the host: every Python step of the attention function runs
once per layer per token, while SDPA's is one C++ call. This times, with tensors small enough
that the kernels cost next to nothing:

- one attention call of a decode step (``Lq = 1`` against a cache of ``--cache`` keys, no
  gradient), of a prefill/train call (``Lq = Lk``, with gradients) and of a packed call
  (``position_ids`` restarting, ``cu_seq_lens_*`` kwargs), each through the function transformers
  calls (``ALL_ATTENTION_FUNCTIONS[impl]``): microseconds per call;
- ``generate()`` of a small Llama (4 layers, the heads above, MLP width 128, vocabulary 128,
  greedy, DynamicCache): milliseconds per new token;
- a train step (forward + backward) of the same model on a packed row (``position_ids`` only).

``--profile`` adds torch.profiler tables (host time per op) of the decode calls. Usage::

    python benchmarks/bench_hf_host.py                  # CPU (or CUDA when present)
    # CUDA, bench_hf.py's heads (16/4 of 128: the decode kernel's path), 4 layers of width 2048
    python benchmarks/bench_hf_host.py --device cuda --dtype bfloat16 --heads-q 16 \
        --heads-kv 4 --head-dim 128 --cache 576 --prompt 512 --new 128 --profile

Runs on CPU or CUDA (``--device``); prints a table, writes nothing. Compare numbers of one run
only.
"""
import argparse
import statistics
import time

import torch
import transformers
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import adaattn.integrations.transformers  # noqa: F401  (registers "adaattn")

IMPLS = ("adaattn", "sdpa")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call_us(fn, device, reps: int, rounds: int = 5) -> float:
    """Median over ``rounds`` of the mean wall time of ``reps`` calls, in microseconds."""
    for _ in range(max(reps // 10, 3)):
        fn()
    results = []
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        results.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(results)


class _Module(torch.nn.Module):
    """What the attention functions read of a Llama attention module."""
    is_causal = True


def bench_calls(args, device, dtype):
    batch, hq, hkv, d = args.batch, args.heads_q, args.heads_kv, args.head_dim
    module = _Module()
    module.num_key_value_groups = hq // hkv
    rows = []
    q1 = torch.randn(batch, 1, hq, d, device=device, dtype=dtype).transpose(1, 2)
    kc = torch.randn(batch, hkv, args.cache, d, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    mask_kwargs = dict(position_ids=torch.full((batch, 1), args.cache - 1, device=device))
    length = 16
    qf = torch.randn(batch, length, hq, d, device=device, dtype=dtype,
                     requires_grad=True)
    kf = torch.randn(batch, hkv, length, d, device=device, dtype=dtype, requires_grad=True)
    vf = torch.randn_like(kf, requires_grad=True)
    positions = torch.arange(length, device=device)[None].expand(batch, -1)
    packed = torch.cat([torch.arange(6), torch.arange(10)]).to(device)[None]
    cu = torch.tensor([0, 6, 16], dtype=torch.int32, device=device)
    qp = torch.randn(1, length, hq, d, device=device, dtype=dtype, requires_grad=True)
    kp = torch.randn(1, hkv, length, d, device=device, dtype=dtype, requires_grad=True)
    vp = torch.randn_like(kp, requires_grad=True)
    for impl in IMPLS:
        fn = ALL_ATTENTION_FUNCTIONS[impl]

        def decode():
            with torch.no_grad():
                return fn(module, q1, kc, vc, None, scaling=d ** -0.5, **mask_kwargs)

        def prefill():
            return fn(module, qf.transpose(1, 2), kf, vf, None, scaling=d ** -0.5,
                      position_ids=positions)

        def packed_call():
            return fn(module, qp.transpose(1, 2), kp, vp, None, scaling=d ** -0.5,
                      position_ids=packed, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                      max_length_q=10, max_length_k=10)
        rows.append((f"decode call B={batch} Lk={args.cache} (us)", impl,
                     per_call_us(decode, device, args.reps)))
        rows.append((f"prefill call with grad L={length} (us)", impl,
                     per_call_us(prefill, device, args.reps)))
        if args.profile:
            profile(decode, f"decode call, {impl}")
        if impl == "adaattn":
            # SDPA has no packed path without a 4D mask; adaattn's alone.
            rows.append(("packed call with grad, 2 docs L=16 (us)", impl,
                         per_call_us(packed_call, device, args.reps)))
    return rows


def profile(fn, title: str, calls: int = 200):
    """Prints the ops' host (self CPU) time over ``calls`` calls of ``fn``."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
    print(f"## {title}: {calls} calls")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def tiny_llama(args, device, dtype):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=args.heads_q * args.head_dim, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=args.heads_q, num_key_value_heads=args.heads_kv,
        head_dim=args.head_dim, max_position_embeddings=4096,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)


def bench_model(args, device, dtype):
    model = tiny_llama(args, device, dtype)
    prompt = torch.randint(3, 128, (args.batch, args.prompt), device=device)
    mask = torch.ones_like(prompt)
    docs = torch.cat([torch.arange(n) for n in (100, 60, 96)]).to(device)[None]
    ids = torch.randint(3, 128, (1, docs.shape[1]), device=device)
    rows = []
    for impl in IMPLS:
        model.set_attn_implementation(impl)
        model.eval()

        def generate():
            with torch.no_grad():
                return model.generate(prompt, attention_mask=mask, max_new_tokens=args.new,
                                      min_new_tokens=args.new, do_sample=False, use_cache=True,
                                      pad_token_id=0)
        times = []
        generate()
        for _ in range(args.gen_reps):
            sync(device)
            t0 = time.perf_counter()
            generate()
            sync(device)
            times.append((time.perf_counter() - t0) * 1e3 / args.new)
        rows.append((f"generate B={args.batch} prompt {args.prompt} +{args.new} (ms/token)",
                     impl, statistics.median(times)))
        model.train()

        def train_step():
            model(input_ids=ids, position_ids=docs, labels=ids, use_cache=False).loss.backward()
        rows.append(("train step packed row of 3 docs, position_ids only (us)", impl,
                     per_call_us(train_step, device, max(args.reps // 50, 5))))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads-q", type=int, default=4)
    parser.add_argument("--heads-kv", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--cache", type=int, default=64, help="cached keys of a decode call")
    parser.add_argument("--reps", type=int, default=2000, help="calls per timing round")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--gen-reps", type=int, default=5)
    parser.add_argument("--profile", action="store_true",
                        help="also print torch.profiler tables of the decode calls")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.set_num_threads(1)
    rows = bench_calls(args, device, dtype) + bench_model(args, device, dtype)
    cases = list(dict.fromkeys(case for case, _, _ in rows))
    table = {(case, impl): value for case, impl, value in rows}
    print(f"device {device}, {dtype}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}")
    print(f"| case | {' | '.join(IMPLS)} | adaattn / sdpa |")
    print("|:---|" + "---:|" * (len(IMPLS) + 1))
    for case in cases:
        values = [table.get((case, impl)) for impl in IMPLS]
        ratio = (f"{values[0] / values[1]:.2f}" if None not in values else "—")
        print(f"| {case} | " + " | ".join("—" if v is None else f"{v:.1f}" for v in values)
              + f" | {ratio} |")


if __name__ == "__main__":
    main()
