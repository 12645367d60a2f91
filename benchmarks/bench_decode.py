"""Benchmarks KV-cache decoding (adaattn.flash_attn_with_kvcache, lazy_attn_with_kvcache) on CUDA.

Issue bars: bf16, D = 128, GQA Hq = 32 / Hkv = 8, (B, Lk) in {(32, 8192), (1, 131072), (128, 2048)}
where Lk is the number of keys each new row attends (``cache_seqlens = Lk - Lq``; the op appends
the Lq new keys and values in place, as in a real decode step). Rows, per shape: flash Lq = 1 on a
contiguous cache and on paged ones (pages of 64 and of 16 keys, vLLM's default, shuffled over
the pool), flash Lq = 16
(speculative decoding, causal) contiguous, and lazy attention Lq = 1 contiguous and paged
(tau = -1, bias W = 512 ~ 0.1 N(0, 1), as bench_lazy.py). An 8-bit cache (the paged pool in
float8_e4m3fn, a scale per page and kv head as adaattn.KVCache keeps them) cannot take the new
keys inside the op, so its row (``paged64-fp8``, Lq = 1) and its 16-bit peer
(``adaattn-bf16-cache``: the same paged pool in bf16) attend a cache that already holds all Lk
keys (no append in either); ``vs_bf16_cache`` is the peer's time over the row's; ``graph_ms`` and
``graph_vs_bf16_cache`` are the same from CUDA-graph replays (10 calls per graph, median of the
replays): the GPU's time without the host's per-call work. The other rows carry ``graph_ms``
too, with ``graph_vs_sdpa`` (the fastest SDPA backend's CUDA-graph time over the row's, peers
replayed the same way) and ``graph_hbm_fraction``: what a serving loop that replays graphs
sees. A low-rank key cache
(``paged64-lowrank-R32``, and ``-fp8`` in 8 bits: adaattn.low_rank_attn_with_kvcache on keys
stored at rank R = 32 and full-width values, the query's projection q U included, a random
orthonormal basis per sequence and kv head) has the same peer and columns; its bars (the
adaptive-rank issue's) are 1.45x in bf16 and 2.6x in 8 bits.

Peers, in the same run, on the same shapes with a contiguous ``[B, Hkv, Lk, D]`` cache (SDPA has
no paged layout, so paged rows repeat the contiguous peers' times):
``F.scaled_dot_product_attention`` pinned to each backend (cuDNN, flash, efficient) with
``enable_gqa=True``, or with K/V expanded to Hq heads beforehand (outside the timing) where a
backend refuses GQA (the row's note says which); Lq = 16 passes
``causal_lower_right(16, Lk)``. Lazy rows also list adaattn's flash decode of the same layout.

HBM: a device-to-device copy of a 2 GiB buffer measures the bandwidth (bytes read + written /
time); each adaattn row reports its achieved bandwidth (K+V cache bytes attended + q + out over
its time) and that as a fraction of the copy's. Times are medians of CUDA-event timings of single
calls (every cache is far larger than L2).

Writes benchmarks/results/decode.json (results_io format) and prints the table and the bars.

    python benchmarks/bench_decode.py [--reps 200] [--num-splits 0] [--results-dir DIR]
"""
import argparse
import os
import statistics
import sys
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (also puts the in-place build on sys.path)
import results_io  # noqa: E402

adaattn = ba.adaattn  # None when the extension is not built (--help still works)

DTYPE = torch.bfloat16
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
SHAPES = ((32, 8192), (1, 131072), (128, 2048))  # (B, Lk)
PAGE_SIZE = 64
SMALL_PAGE = 16  # vLLM's default block size: pages smaller than the kernel's 64-key tiles
WINDOW = 512
TAU = -1.0
COPY_BYTES = 2 << 30
SDPA_BACKENDS = (("sdpa-cudnn", "CUDNN_ATTENTION"), ("sdpa-flash", "FLASH_ATTENTION"),
                 ("sdpa-efficient", "EFFICIENT_ATTENTION"))
# The issue's bars, checked in the printed summary.
HBM_BAR, PAGED_BAR, LAZY_BAR, SPECULATIVE_BAR = 0.85, 1.05, 1.15, 1.3
FP8_BAR = 1.7  # the 8-bit cache's speed over the bf16 cache's (adaptive precision issue)
RANK = 32  # the low-rank key cache's rows (adaptive-rank issue's bars over the bf16 cache)
LOW_RANK_BAR, LOW_RANK_FP8_BAR = 1.45, 2.6


def time_ms(fn: Callable, warmup: int, reps: int) -> float:
    """Median milliseconds of ``reps`` CUDA-event-timed calls, after ``warmup`` calls."""
    return ba.event_bench(fn, [], warmup=warmup, reps=reps)


def graph_time_ms(fn: Callable, reps: int, calls: int = 10) -> float:
    """Median milliseconds per call of ``fn`` replayed from a CUDA graph of ``calls`` calls
    (``reps`` replays): the GPU's time without the host's per-call work, as a decode loop
    that replays CUDA graphs runs it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture (kernel attributes, allocator)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def copy_bandwidth(warmup: int, reps: int) -> float:
    """Device-to-device copy bandwidth in GB/s: (bytes read + bytes written) / time."""
    src = torch.empty(COPY_BYTES // 2, dtype=DTYPE, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup, reps)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES / (ms * 1e-3) / 1e9


class Shape:
    """The tensors of one (B, Lk) shape: a contiguous cache ``[B, Hkv, Lk, D]``, the same keys in
    shuffled paged pools ``[B * Lk / page, Hkv, page, D]`` (page 64 and SMALL_PAGE) with their
    block tables (``pools``), and the lazy parameters."""

    def __init__(self, batch: int, len_k: int):
        self.batch, self.len_k = batch, len_k
        shape = (batch, HEADS_KV, len_k, HEAD_DIM)
        self.k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
        self.v_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
        pages = len_k // PAGE_SIZE
        perm = torch.randperm(batch * pages, device="cuda")
        self.block_table = perm.view(batch, pages).to(torch.int32)
        self.k_pages = torch.empty(batch * pages, HEADS_KV, PAGE_SIZE, HEAD_DIM, dtype=DTYPE,
                                   device="cuda")
        self.v_pages = torch.empty_like(self.k_pages)
        for cache, pool in ((self.k_cache, self.k_pages), (self.v_cache, self.v_pages)):
            pool[perm] = cache.unflatten(2, (pages, PAGE_SIZE)).transpose(1, 2).flatten(0, 1)
        # The same keys in shuffled pages of SMALL_PAGE: page size -> (k pool, v pool, table).
        self.pools = {PAGE_SIZE: (self.k_pages, self.v_pages, self.block_table)}
        small = len_k // SMALL_PAGE
        perm = torch.randperm(batch * small, device="cuda")
        small_pools = []
        for cache in (self.k_cache, self.v_cache):
            pool = torch.empty(batch * small, HEADS_KV, SMALL_PAGE, HEAD_DIM, dtype=DTYPE,
                               device="cuda")
            pool[perm] = cache.unflatten(2, (small, SMALL_PAGE)).transpose(1, 2).flatten(0, 1)
            small_pools.append(pool)
        self.pools[SMALL_PAGE] = (*small_pools, perm.view(batch, small).to(torch.int32))
        # The same pool in 8 bits: scale = each page's and kv head's largest magnitude / 448.
        self.scales = []
        self.pages8 = []
        for pool in (self.k_pages, self.v_pages):
            scale = pool.float().abs().amax(dim=(2, 3)) / 448
            self.scales.append(scale)
            self.pages8.append((pool.float() / scale[:, :, None, None]).to(torch.float8_e4m3fn))
        # Keys at rank RANK in the same page order, and their bases (float32 for 8-bit pools).
        self.k_pages_low = torch.randn(batch * pages, HEADS_KV, PAGE_SIZE, RANK, dtype=DTYPE,
                                       device="cuda")
        scale = self.k_pages_low.float().abs().amax(dim=(2, 3)) / 448
        self.k_scale_low = scale
        self.k_pages_low8 = (self.k_pages_low.float() / scale[:, :, None, None]).to(
            torch.float8_e4m3fn)
        # Contiguous, as LowRankKVCache keeps it (a strided one costs the op a copy).
        self.basis = torch.linalg.qr(torch.randn(batch, HEADS_KV, HEAD_DIM, RANK,
                                                 device="cuda"))[0].contiguous()
        self.tau = torch.full((HEADS_Q,), TAU, device="cuda")
        self.bias = 0.1 * torch.randn(HEADS_Q, WINDOW, device="cuda")
        # BLOOM's ALiBi slopes and gpt-oss-like sinks.
        self.alibi_slopes = 2.0 ** (-8.0 * torch.arange(1, HEADS_Q + 1, device="cuda") / HEADS_Q)
        self.sinks = torch.randn(HEADS_Q, device="cuda")

    def inputs(self, len_q: int):
        """q ``[B, Hq, Lq, D]``, new k, v ``[B, Hkv, Lq, D]`` and ``cache_seqlens = Lk - Lq``."""
        q = torch.randn(self.batch, HEADS_Q, len_q, HEAD_DIM, dtype=DTYPE, device="cuda")
        k, v = (torch.randn(self.batch, HEADS_KV, len_q, HEAD_DIM, dtype=DTYPE, device="cuda")
                for _ in range(2))
        seqlens = torch.full((self.batch,), self.len_k - len_q, dtype=torch.int32, device="cuda")
        return q, k, v, seqlens

    def bytes_moved(self, len_q: int, cache_itemsize: int = DTYPE.itemsize) -> int:
        """K+V cache bytes attended, plus q read and out written."""
        kv = 2 * self.batch * HEADS_KV * self.len_k * HEAD_DIM * cache_itemsize
        return kv + 2 * self.batch * HEADS_Q * len_q * HEAD_DIM * DTYPE.itemsize


def adaattn_decode(s: Shape, len_q: int, page: int, variant: str, num_splits: int) -> Callable:
    """The op on the contiguous cache (page 0) or on the pool of pages of ``page`` keys;
    ``variant`` "flash", "lazy", or "flash+alibi+sinks" (ALiBi slopes and attention sinks)."""
    q, k, v, seqlens = s.inputs(len_q)
    k_cache, v_cache, table = s.pools[page] if page else (s.k_cache, s.v_cache, None)
    if variant == "lazy":
        return lambda: adaattn.lazy_attn_with_kvcache(
            q, k_cache, v_cache, k, v, s.tau, s.bias, cache_seqlens=seqlens, block_table=table,
            num_splits=num_splits)
    scores = {}
    if variant == "flash+alibi+sinks":
        scores = dict(alibi_slopes=s.alibi_slopes, sinks=s.sinks)
    return lambda: adaattn.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table, causal=True,
        num_splits=num_splits, **scores)


def adaattn_decode_full_cache(s: Shape, fp8: bool, num_splits: int) -> Callable:
    """Flash decode, Lq = 1, on the paged pool already holding all Lk keys (no append): in
    8 bits with its scales, or in bf16."""
    q = torch.randn(s.batch, HEADS_Q, 1, HEAD_DIM, dtype=DTYPE, device="cuda")
    seqlens = torch.full((s.batch,), s.len_k, dtype=torch.int32, device="cuda")
    if fp8:
        return lambda: adaattn.flash_attn_with_kvcache(
            q, *s.pages8, cache_seqlens=seqlens, block_table=s.block_table,
            num_splits=num_splits, k_scale=s.scales[0], v_scale=s.scales[1])
    return lambda: adaattn.flash_attn_with_kvcache(
        q, s.k_pages, s.v_pages, cache_seqlens=seqlens, block_table=s.block_table,
        num_splits=num_splits)


def adaattn_decode_low_rank(s: Shape, fp8: bool, num_splits: int) -> Callable:
    """low_rank_attn_with_kvcache, Lq = 1, on the paged pools (keys at rank RANK, values at
    full width) already holding all Lk keys: in 8 bits with their scales, or in bf16."""
    q = torch.randn(s.batch, HEADS_Q, 1, HEAD_DIM, dtype=DTYPE, device="cuda")
    seqlens = torch.full((s.batch,), s.len_k, dtype=torch.int32, device="cuda")
    if fp8:
        return lambda: adaattn.low_rank_attn_with_kvcache(
            q, s.k_pages_low8, s.pages8[1], s.basis, cache_seqlens=seqlens,
            block_table=s.block_table, num_splits=num_splits, k_scale=s.k_scale_low,
            v_scale=s.scales[1])
    basis = s.basis.to(DTYPE)
    return lambda: adaattn.low_rank_attn_with_kvcache(
        q, s.k_pages_low, s.v_pages, basis, cache_seqlens=seqlens, block_table=s.block_table,
        num_splits=num_splits)


def sdpa_decode(s: Shape, len_q: int, backend_name: str) -> Tuple[Callable, str]:
    """SDPA on the contiguous cache pinned to one backend: ``(call, how GQA is done)``. Tries
    ``enable_gqa=True`` first, then K/V expanded to Hq heads; raises if both are refused."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    backend = getattr(SDPBackend, backend_name)
    q = torch.randn(s.batch, HEADS_Q, len_q, HEAD_DIM, dtype=DTYPE, device="cuda")
    mask = causal_lower_right(len_q, s.len_k) if len_q > 1 else None
    group = HEADS_Q // HEADS_KV
    errors = []
    for gqa in ("enable_gqa", "expanded k/v"):
        if gqa == "enable_gqa":
            k, v, kw = s.k_cache, s.v_cache, {"enable_gqa": True}
        else:
            k = s.k_cache.repeat_interleave(group, dim=1)
            v = s.v_cache.repeat_interleave(group, dim=1)
            kw = {}

        def call(k=k, v=v, kw=kw):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
        try:
            call()
            torch.cuda.synchronize()
            return call, gqa
        except RuntimeError as e:
            errors.append(f"{gqa}: {ba._short_error(e)}")
    raise RuntimeError("; ".join(errors))


def graph_or_none(fn_builder: Callable[[], Callable], reps: int = 50) -> Optional[float]:
    """graph_time_ms of the built call, or None where it cannot be captured."""
    try:
        return graph_time_ms(fn_builder(), reps)
    except RuntimeError:
        return None
    finally:
        torch.cuda.synchronize()


def measure(fn_builder: Callable[[], Callable], args) -> Tuple[Optional[float], str]:
    """``(median ms, note)``; a refusal gives ``(None, the error)``."""
    try:
        fn = fn_builder()
        return time_ms(fn, args.warmup, args.reps), ""
    except Exception as e:  # a peer refusing a shape must not end the run
        return None, ba._short_error(e)
    finally:
        torch.cuda.synchronize()


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else round(a / b, 3)


def bench_shape(batch: int, len_k: int, args, copy_gbps: float) -> List[dict]:
    s = Shape(batch, len_k)
    base = f"B={batch} Lk={len_k}"
    config = {"b": batch, "lk": len_k, "hq": HEADS_Q, "hkv": HEADS_KV, "d": HEAD_DIM}
    sdpa: Dict[int, Dict[str, Optional[float]]] = {}
    sdpa_graph: Dict[int, Dict[str, Optional[float]]] = {}
    sdpa_notes: Dict[int, List[str]] = {}
    replays = max(1, args.reps // 4)
    for len_q in (1, 16):
        sdpa[len_q], sdpa_graph[len_q], sdpa_notes[len_q] = {}, {}, []
        for name, backend in SDPA_BACKENDS:
            built = {}

            def build(backend=backend, len_q=len_q, built=built):
                fn, built["gqa"] = sdpa_decode(s, len_q, backend)
                return fn
            sdpa[len_q][name], note = measure(build, args)
            sdpa_notes[len_q].append(f"{name}: {note or built['gqa']}")
            if sdpa[len_q][name] is not None:
                sdpa_graph[len_q][name] = graph_or_none(build, replays)

    rows, ours = [], {}
    for variant, len_q, page in (("flash", 1, 0), ("flash", 1, PAGE_SIZE), ("flash", 1, SMALL_PAGE),
                                 ("flash", 16, 0), ("lazy", 1, 0), ("lazy", 1, PAGE_SIZE),
                                 ("flash+alibi+sinks", 1, PAGE_SIZE)):
        paged = page > 0
        layout = f"paged{page}" if paged else "contiguous"
        ms, note = measure(lambda: adaattn_decode(s, len_q, page, variant, args.num_splits), args)
        ours[variant, len_q, page] = ms
        peers = dict(sdpa[len_q])
        graph = None if ms is None else graph_or_none(
            lambda: adaattn_decode(s, len_q, page, variant, args.num_splits), replays)
        graph_peers = [t for t in sdpa_graph[len_q].values() if t is not None]
        extra = {"graph_ms": None if graph is None else round(graph, 4),
                 "graph_vs_sdpa": ratio(min(graph_peers), graph) if graph_peers else None,
                 "graph_hbm_fraction": None if graph is None else
                 round(s.bytes_moved(len_q) / (graph * 1e-3) / 1e9 / copy_gbps, 3)}
        if variant == "lazy":
            peers["adaattn-flash"] = ours["flash", 1, page]
            extra["vs_flash"] = ratio(ms, ours["flash", 1, page])
        if variant == "flash+alibi+sinks":
            peers = {"adaattn-flash": ours["flash", 1, page]}
            extra["vs_plain"] = ratio(ms, ours["flash", 1, page])
            extra["graph_vs_sdpa"] = None
        if paged and variant != "flash+alibi+sinks":
            extra["vs_contiguous"] = ratio(ms, ours[variant, len_q, 0])
        if len_q == 16:
            extra["vs_lq1"] = ratio(ms, ours[variant, 1, 0])
        gbps = None if ms is None else s.bytes_moved(len_q) / (ms * 1e-3) / 1e9
        notes = ([f"adaattn: {note}"] if note else [])
        if variant != "flash+alibi+sinks":
            notes += sdpa_notes[len_q]
        if paged and variant != "flash+alibi+sinks":
            notes.append("SDPA peers on the contiguous cache")
        rows.append(results_io.row(
            f"{variant} Lq={len_q} {layout} {base}", "fwd", {"adaattn": ms, **peers},
            gbps=None if gbps is None else round(gbps, 1),
            hbm_fraction=None if gbps is None else round(gbps / copy_gbps, 3),
            note="; ".join(notes),
            config=dict(config, lq=len_q, paged=paged, variant=variant,
                        **({"page_size": page} if paged else {})),
            **extra))
        print(f"{rows[-1]['case']:<40} adaattn {ba._fmt(ms, '.3f')} ms  "
              f"{ba._fmt(gbps, '.0f')} GB/s  peers {rows[-1]['ms']}", flush=True)
    bf16, _ = measure(lambda: adaattn_decode_full_cache(s, False, args.num_splits), args)
    bf16_graph = graph_time_ms(adaattn_decode_full_cache(s, False, args.num_splits), replays)
    full_cache = [(f"paged{PAGE_SIZE}-fp8", "float8_e4m3fn", None,
                   lambda: adaattn_decode_full_cache(s, True, args.num_splits)),
                  (f"paged{PAGE_SIZE}-lowrank-R{RANK}", "bfloat16", RANK,
                   lambda: adaattn_decode_low_rank(s, False, args.num_splits)),
                  (f"paged{PAGE_SIZE}-lowrank-R{RANK}-fp8", "float8_e4m3fn", RANK,
                   lambda: adaattn_decode_low_rank(s, True, args.num_splits))]
    for layout, cache, rank, build in full_cache:
        ms, note = measure(build, args)
        graph = None if ms is None else graph_time_ms(build(), replays)
        itemsize = 1 if cache == "float8_e4m3fn" else DTYPE.itemsize
        cache_bytes = s.batch * HEADS_KV * s.len_k * ((rank or HEAD_DIM) + HEAD_DIM) * itemsize
        moved = cache_bytes + 2 * s.batch * HEADS_Q * HEAD_DIM * DTYPE.itemsize
        gbps = None if ms is None else moved / (ms * 1e-3) / 1e9
        rows.append(results_io.row(
            f"flash Lq=1 {layout} {base}", "fwd", {"adaattn": ms, "adaattn-bf16-cache": bf16},
            gbps=None if gbps is None else round(gbps, 1),
            hbm_fraction=None if gbps is None else round(gbps / copy_gbps, 3),
            vs_bf16_cache=ratio(bf16, ms),
            graph_ms=None if graph is None else round(graph, 4),
            graph_vs_bf16_cache=ratio(bf16_graph, graph),
            note="; ".join([f"adaattn: {note}"] if note else []) + "the cache holds all Lk "
            "keys (no append), as its peer's",
            config=dict(config, lq=1, paged=True, variant="flash", cache=cache,
                        **({"rank": rank} if rank else {}))))
        print(f"{rows[-1]['case']:<40} adaattn {ba._fmt(ms, '.3f')} ms  "
              f"{ba._fmt(gbps, '.0f')} GB/s  bf16 cache {ba._fmt(bf16, '.3f')} ms; graphs "
              f"{ba._fmt(graph, '.3f')} / {bf16_graph:.3f} ms", flush=True)
    del s
    torch.cuda.empty_cache()
    return rows


def bars(rows: List[dict]) -> str:
    """The issue's bars, one line per row: HBM fraction and speed against the fastest SDPA
    backend (bars for flash Lq = 1; shown for the rest), and the row's own ratio bar (paged,
    lazy, Lq = 16)."""
    lines = ["| case | HBM fraction (>= 0.85) | vs fastest SDPA (>= 1.0x) | the same, CUDA graphs "
             "| own ratio bar |",
             "|:---|:---|:---|:---|:---|"]
    for r in rows:
        ms = r["ms"]
        sdpa = [t for name, t in ms.items() if name.startswith("sdpa") and t is not None]
        speed = None if ms["adaattn"] is None or not sdpa else min(sdpa) / ms["adaattn"]
        barred = (r["config"]["variant"] == "flash" and r["config"]["lq"] == 1
                  and "cache" not in r["config"])

        def verdict(x, limit):
            if x is None:
                return "—"
            return f"{x:.3f}" + ((" ok" if x >= limit else " MISS") if barred else "")
        own = "—"
        for key, limit in (("vs_contiguous", PAGED_BAR), ("vs_flash", LAZY_BAR),
                           ("vs_lq1", SPECULATIVE_BAR)):
            if r.get(key) is not None:
                own = f"{key} {r[key]:.3f} {'ok' if r[key] <= limit else 'MISS'} (<= {limit})"
        if r.get("vs_plain") is not None:
            own = f"vs_plain {r['vs_plain']:.3f} (no bar)"
        if r.get("vs_bf16_cache") is not None:
            x, c = r["vs_bf16_cache"], r["config"]
            fp8 = c["cache"] == "float8_e4m3fn"
            bar = (LOW_RANK_FP8_BAR if fp8 else LOW_RANK_BAR) if "rank" in c else FP8_BAR
            own = f"vs_bf16_cache {x:.3f} {'ok' if x >= bar else 'MISS'} (>= {bar})"
            if r.get("graph_vs_bf16_cache") is not None:
                own += f"; CUDA graphs {r['graph_vs_bf16_cache']:.3f}"
        graphs = "—"
        if r.get("graph_vs_sdpa") is not None:
            graphs = (f"HBM {verdict(r['graph_hbm_fraction'], HBM_BAR)}, "
                      f"{verdict(r['graph_vs_sdpa'], 1.0)}")
        lines.append(f"| {r['case']} | {verdict(r.get('hbm_fraction'), HBM_BAR)} "
                     f"| {verdict(speed, 1.0)} | {graphs} | {own} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls per measurement")
    parser.add_argument("--reps", type=int, default=200, help="timed calls per measurement")
    parser.add_argument("--num-splits", type=int, default=0,
                        help="adaattn's num_splits (0: its own choice)")
    results_io.add_arguments(parser, "decode")
    args = parser.parse_args(argv[1:])
    if adaattn is None:
        print(results_io.import_error_message("bench_decode.py", ba.IMPORT_ERROR),
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_decode.py needs a CUDA device", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.manual_seed(0)

    family = args.family or "decode"
    title = (f"KV-cache decode: bf16, D = {HEAD_DIM}, GQA {HEADS_Q}/{HEADS_KV}, "
             f"page {PAGE_SIZE}, lazy W = {WINDOW}, tau = {TAU}")
    copy_gbps = copy_bandwidth(args.warmup, args.reps)
    setup = ("Lk keys attended per row (cache_seqlens = Lk - Lq, new k/v appended in place); "
             "time: median of CUDA-event timings of single calls; gbps: (K+V cache bytes "
             "attended + q + out) / time; hbm_fraction: gbps / the device-to-device copy's "
             f"({copy_gbps:.0f} GB/s, {COPY_BYTES >> 30} GiB buffer, read + write, same run); "
             "vs_contiguous / vs_flash / vs_lq1: time over the contiguous / flash / Lq = 1 row's")
    rows: List[dict] = []
    for batch, len_k in SHAPES:
        rows += bench_shape(batch, len_k, args, copy_gbps)
        if not args.no_write:
            path = results_io.write(family, rows, title=title, setup=setup, argv=argv,
                                    notes=[f"device-to-device copy: {copy_gbps:.0f} GB/s"],
                                    results_dir=args.results_dir)
    print()
    print("## " + title)
    print(ba.run_metadata(argv).replace("- " + ba.TIMING, "- " + setup))
    print()
    print(bars(rows))
    if not args.no_write:
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
