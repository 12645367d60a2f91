"""adaattn quickstart: every op forward+backward, checked against the reference and timed.

Picks CUDA (bfloat16) when a GPU is present, else the CPU (float32). Runs adaattn.flash_attn
forward and backward on a causal problem, checks the output and gradients against the float64
reference with the spec's tolerance (§4), and times it against F.scaled_dot_product_attention.
Then does the same for adaattn.lazy_attn (tau = -1, a 512-entry bias table), checked with the
rule "max error <= 2x that of the eager reference run in the same dtype" and timed against
that eager PyTorch implementation (there is no fused PyTorch lazy attention to compare with),
the same for adaattn.linear_attn (causal, elu + 1, normalised) against its eager reference,
for adaattn.flash_attn_varlen and adaattn.lazy_attn_varlen on packed documents (against SDPA run
document by document, and the eager lazy reference), and for adaattn.block_sparse_attn with a
causal sliding window of blocks (against SDPA with the equivalent boolean mask), and for
adaattn.low_rank_attn at the rank adaattn.rank_plan finds in q/k of planted rank 32 (against its
eager reference and timed against adaattn.flash_attn).

    python examples/quickstart.py
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import adaattn  # noqa: E402
from adaattn import reference  # noqa: E402


def ours(q, k, v):
    """adaattn, causal."""
    return adaattn.flash_attn(q, k, v, causal=True)


def sdpa(q, k, v):
    """The PyTorch baseline, causal."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def pick_setup():
    """(device, dtype, (B, H, L, D)) for the machine at hand."""
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16, (4, 16, 4096, 128)
    return "cpu", torch.float32, (2, 4, 512, 64)


def forward_backward(attn, q, k, v, dout):
    """Output and (dq, dk, dv) of ``attn`` (a function of q, k, v)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attn(q, k, v)
    return (out.detach(),) + torch.autograd.grad(out, (q, k, v), dout)


def reference_results(q, k, v, dout, dtype):
    """Reference output and gradients computed in ``dtype``, one batch element at a time so
    that the L x L float64 matrices stay small."""
    parts = [forward_backward(lambda q, k, v: reference.flash_attn(q, k, v, causal=True)[0],
                              q[b:b + 1].to(dtype), k[b:b + 1].to(dtype), v[b:b + 1].to(dtype),
                              dout[b:b + 1].to(dtype))
             for b in range(q.shape[0])]
    return [torch.cat(ts) for ts in zip(*parts)]


def check(results, q, k, v, dout):
    """Spec §4: float32 relative error <= 1e-5 vs float64; fp16/bf16: max error <= 2x that of
    the reference run in the same dtype, + 1e-5."""
    exact = reference_results(q, k, v, dout, torch.float64)
    low = q.dtype in (torch.float16, torch.bfloat16)
    same_dtype = reference_results(q, k, v, dout, q.dtype) if low else exact
    for name, a, e, r in zip(("out", "dq", "dk", "dv"), results, exact, same_dtype):
        a = a.double()
        rel = ((a - e).norm() / e.norm()).item()
        if low:
            err, bar = (a - e).abs().max().item(), 2 * (r.double() - e).abs().max().item() + 1e-5
        else:
            err, bar = rel, 1e-5
        print(f"  {name}: relative error {rel:.2e}  (checked: {err:.2e} <= {bar:.2e})")
        assert err <= bar, f"{name} misses the tolerance"


def time_ms(fn, device, reps):
    """Median wall time of ``fn`` in ms, after two warm-up calls."""
    def sync():
        if device == "cuda":
            torch.cuda.synchronize()
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def lazy_inputs(b, h, d, device):
    """tau [H] = -1 (+-10%) and a small random bias table [H, 512], float32, requiring grad."""
    tau = (-1.0 * (1 + 0.1 * torch.randn(h))).to(device).requires_grad_()
    bias = (0.1 * torch.randn(h, 512)).to(device).requires_grad_()
    return tau, bias


def run_with_grads(fn, tensors, dout, dtype):
    """Output of ``fn`` and its gradients for every tensor; q, k, v (3 dims packed, 4 dense) and
    a low-rank basis are cast to ``dtype``, parameters (tau, bias) keep theirs."""
    ins = [t.detach().to(dtype) if t.dim() >= 3 else t.detach() for t in tensors]
    ins = [t.requires_grad_() for t in ins]
    out = fn(*ins)
    return (out.detach(),) + torch.autograd.grad(out, ins, dout.to(dtype))


def rule_check(names, ours, exact, same_dtype):
    """Max error <= 2x that of the eager reference in the same dtype (+ 1e-5), vs float64."""
    for name, a, e, r in zip(names, ours, exact, same_dtype):
        a, e, r = a.double(), e.double(), r.double()
        rel = ((a - e).norm() / e.norm()).item()
        err, bar = (a - e).abs().max().item(), 2 * (r - e).abs().max().item() + 1e-5
        print(f"  {name}: relative error {rel:.2e}  (checked: {err:.2e} <= {bar:.2e})")
        assert err <= bar, f"{name} misses the tolerance"


def lazy_check(q, k, v, tau, bias, dout):
    """Output and all five gradients against float64, 2x the same-dtype eager error."""
    def ref(upcast):
        return lambda q, k, v, tau, bias: reference.lazy_attn(q, k, v, tau, bias,
                                                              upcast=upcast)[0]
    tensors = (q, k, v, tau, bias)
    rule_check(("out", "dq", "dk", "dv", "dtau", "dbias"),
               run_with_grads(adaattn.lazy_attn, tensors, dout, q.dtype),
               run_with_grads(ref(True), tensors, dout, torch.float64),
               run_with_grads(ref(False), tensors, dout, q.dtype))


def linear_check(q, k, v, dout):
    """Causal linear attention (elu + 1, normalised): output and gradients, same rule."""
    def ref(q, k, v):
        return reference.linear_attn(q, k, v)[0]
    tensors = (q, k, v)
    rule_check(("out", "dq", "dk", "dv"),
               run_with_grads(adaattn.linear_attn, tensors, dout, q.dtype),
               run_with_grads(ref, tensors, dout, torch.float64),
               run_with_grads(ref, tensors, dout, q.dtype))


def print_times(rows, inputs, dout, device):
    reps = 20 if device == "cuda" else 5
    print("time (median ms)        forward   forward+backward")
    for name, attn in rows:
        with torch.no_grad():
            fwd = time_ms(lambda: attn(*inputs), device, reps)
        both = time_ms(lambda: attn(*inputs).backward(dout), device, reps)
        print(f"  {name:<30} {fwd:8.2f}   {both:8.2f}")


def main():
    device, dtype, (b, h, length, d) = pick_setup()
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, length, d, device=device, dtype=dtype) for _ in range(4))
    print(f"flash attention: device {device}, {dtype}, B={b} H={h} L={length} D={d}, causal")
    check(forward_backward(ours, q, k, v, dout), q, k, v, dout)
    qkv = [t.detach().requires_grad_() for t in (q, k, v)]
    print_times((("adaattn.flash_attn", ours), ("F.scaled_dot_product_attention", sdpa)), qkv,
                dout, device)

    # Lazy attention: the eager reference materialises L x L matrices, so one batch element.
    q, k, v, dout = (t[:1] for t in (q, k, v, dout))
    tau, bias = lazy_inputs(1, h, d, device)
    print(f"\nlazy attention: device {device}, {dtype}, B=1 H={h} L={length} D={d}, W=512, "
          f"tau=-1")
    lazy_check(q, k, v, tau, bias, dout)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)] + [tau, bias]
    print_times((("adaattn.lazy_attn", adaattn.lazy_attn),
                 ("eager PyTorch (reference)",
                  lambda *a: reference.lazy_attn(*a, upcast=False)[0])),
                inputs, dout, device)

    # Linear attention (fp16/bf16 with D in {64, 128} run the chunked tensor-core kernels).
    print(f"\nlinear attention: device {device}, {dtype}, B=1 H={h} L={length} D={d}, causal, "
          f"elu + 1, normalised")
    linear_check(q, k, v, dout)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    print_times((("adaattn.linear_attn", adaattn.linear_attn),
                 ("eager PyTorch (reference)", lambda *a: reference.linear_attn(*a)[0])),
                inputs, dout, device)

    packed_demo(device, dtype, h, d)
    block_sparse_demo(device, dtype, h, d)
    low_rank_demo(device, dtype, length, h)


def document_lengths(total, device):
    """Seeded document lengths summing to ``total`` (between total/16 and total/4 each)."""
    gen = torch.Generator().manual_seed(0)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(total // 16, total // 4, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - total
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return lengths, cu.to(device)


def packed_demo(device, dtype, h, d):
    """flash_attn_varlen and lazy_attn_varlen on one packed batch of documents."""
    total = 4096 if device == "cuda" else 512
    lengths, cu = document_lengths(total, device)
    q, k, v, dout = (torch.randn(total, h, d, device=device, dtype=dtype) for _ in range(4))
    print(f"\npacked documents: device {device}, {dtype}, {len(lengths)} documents, {total} "
          f"tokens, H={h} D={d}, causal")

    def flash_packed(q, k, v):
        return adaattn.flash_attn_varlen(q, k, v, cu, cu, causal=True)

    def flash_ref(q, k, v):
        return reference.flash_attn_varlen(q, k, v, cu, cu, causal=True)[0]

    tensors = (q, k, v)
    print("flash_attn_varlen:")
    rule_check(("out", "dq", "dk", "dv"), run_with_grads(flash_packed, tensors, dout, dtype),
               run_with_grads(flash_ref, tensors, dout, torch.float64),
               run_with_grads(flash_ref, tensors, dout, dtype))

    def sdpa_per_document(q, k, v):
        outs = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)),
                                               is_causal=True).transpose(0, 1)
                for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
        return torch.cat(outs)

    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    print_times((("adaattn.flash_attn_varlen", flash_packed),
                 ("SDPA, one call per document", sdpa_per_document)), inputs, dout, device)

    tau, bias = lazy_inputs(1, h, d, device)

    def lazy_packed(q, k, v, tau, bias):
        return adaattn.lazy_attn_varlen(q, k, v, cu, tau, bias)

    def lazy_ref(upcast):
        return lambda q, k, v, tau, bias: reference.lazy_attn_varlen(q, k, v, cu, tau, bias,
                                                                     upcast=upcast)[0]
    print("lazy_attn_varlen (W=512, tau=-1):")
    tensors = (q, k, v, tau, bias)
    rule_check(("out", "dq", "dk", "dv", "dtau", "dbias"),
               run_with_grads(lazy_packed, tensors, dout, dtype),
               run_with_grads(lazy_ref(True), tensors, dout, torch.float64),
               run_with_grads(lazy_ref(False), tensors, dout, dtype))
    inputs = [t.detach().requires_grad_() for t in (q, k, v)] + [tau, bias]
    print_times((("adaattn.lazy_attn_varlen", lazy_packed),
                 ("eager PyTorch (reference)", lazy_ref(False))), inputs, dout, device)


def block_sparse_demo(device, dtype, h, d):
    """block_sparse_attn with a causal window of 4 blocks of 128 (each query block sees itself
    and the 3 before), against SDPA with the equivalent element mask."""
    length = 2048 if device == "cuda" else 512
    n = length // 128
    rows = torch.arange(n).view(-1, 1)
    cols = torch.arange(n).view(1, -1)
    layout = ((cols <= rows) & (rows - cols < 4)).view(1, 1, n, n).to(device)
    mask = adaattn.BlockSparseMask.from_dense(layout, 128)
    q, k, v, dout = (torch.randn(1, h, length, d, device=device, dtype=dtype) for _ in range(4))
    print(f"\nblock-sparse attention: device {device}, {dtype}, B=1 H={h} L={length} D={d}, "
          f"causal window of 4 blocks of 128 ({mask.kv_num_blocks.sum().item()} of {n * n} "
          f"blocks listed)")

    def sparse(q, k, v):
        return adaattn.block_sparse_attn(q, k, v, mask, causal=True)

    def sparse_ref(q, k, v):
        return reference.block_sparse_attn(q, k, v, mask, causal=True)[0]

    tensors = (q, k, v)
    rule_check(("out", "dq", "dk", "dv"), run_with_grads(sparse, tensors, dout, dtype),
               run_with_grads(sparse_ref, tensors, dout, torch.float64),
               run_with_grads(sparse_ref, tensors, dout, dtype))
    elements = reference.block_sparse_key_mask(mask, length, length, causal=True)

    def sdpa_masked(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=elements)

    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    print_times((("adaattn.block_sparse_attn", sparse),
                 ("SDPA with the element mask", sdpa_masked)), inputs, dout, device)


def low_rank_demo(device, dtype, length, h):
    """low_rank_attn (D = 128) at the planned rank of q/k that lie near a rank-32 subspace per
    head, against its eager reference (output and the q, k, v, basis gradients) and flash_attn."""
    d, rank = 128, 32
    basis = torch.linalg.qr(torch.randn(1, h, d, rank))[0]
    q, k = ((torch.randn(1, h, length, rank) @ basis.mT * 2 + 0.01 * torch.randn(1, h, length, d))
            .to(device, dtype) for _ in range(2))
    v, dout = (torch.randn(1, h, length, d, device=device, dtype=dtype) for _ in range(2))
    plan = adaattn.rank_plan(q, k, energy=0.99)
    print(f"\nlow-rank attention: device {device}, {dtype}, B=1 H={h} L={length} D={d}, causal, "
          f"planted rank {rank}: rank_plan picked {sorted(set(plan.ranks.flatten().tolist()))}")

    def low_rank(q, k, v, u):
        return adaattn.low_rank_attn(q, k, v, u, causal=True)

    def low_rank_ref(q, k, v, u):
        return reference.low_rank_attn(q, k, v, u, causal=True)[0]

    tensors = (q, k, v, plan.basis)
    rule_check(("out", "dq", "dk", "dv", "dbasis"),
               run_with_grads(low_rank, tensors, dout, dtype),
               run_with_grads(low_rank_ref, tensors, dout, torch.float64),
               run_with_grads(low_rank_ref, tensors, dout, dtype))
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    print_times((("adaattn.low_rank_attn", lambda q, k, v: low_rank(q, k, v, plan.basis)),
                 ("adaattn.flash_attn", lambda q, k, v: adaattn.flash_attn(q, k, v, causal=True))),
                inputs, dout, device)


if __name__ == "__main__":
    main()
