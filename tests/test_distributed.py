"""adaattn.distributed: ring attention equals the single-process op on the full sequence.

Each test spawns a process group (gloo on CPU: world sizes 2 and 4; NCCL on 2 GPUs) and runs all
its cases in it, since starting processes costs more than the cases. In every case each rank
draws the same full q/k/v/grad_out, runs the single-process op on the full sequence and the ring
op on its shard, and compares its shard of out, lse and every gradient.
"""
import datetime
import os
import sys
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from accuracy import assert_low_precision_rule, assert_rel_close

# fp32: accuracy.py's rule. fp64: the merge weights come from the ops' float32 lse (lse is float32
# for every dtype), so the ring agrees with the single-process fp64 op to float32's rounding of
# lse (observed: up to 4e-8 relative), not to fp64's; the issue's 1e-10 needs an fp64 lse.
RTOL = {torch.float32: 1e-5, torch.float64: 1e-6}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(worker, world: int, *args):
    port = _free_port()
    mp.spawn(_entry, args=(world, port, worker, args), nprocs=world, join=True)


def _entry(rank, world, port, worker, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    cuda = worker is _cuda_worker and (not args or args[0] == "cuda")
    if cuda:
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)
    # A rank whose case fails stops talking: the others' collectives then time out and raise
    # instead of hanging the test.
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank) if cuda else None,
                            timeout=datetime.timedelta(seconds=60))
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # unwritten outputs are NaN
    try:
        failures = worker(rank, world, *args)
    finally:
        dist.destroy_process_group()
    assert not failures, "\n".join(failures)
    # Passed: leave without the interpreter's teardown, in which gloo (torch 2.11) at times
    # aborts ("terminate called without an active exception") after destroy_process_group.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_cases(cases):
    """Runs each case, collecting failures (all ranks run all cases: they communicate)."""
    failures = []
    for name, fn in cases:
        try:
            fn()
        except Exception:  # noqa: BLE001 - reported with the case name below
            failures.append(f"[rank {dist.get_rank()}] {name}:\n{traceback.format_exc()}")
    return failures


def _draw(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(device, dtype)


def _compare(name, ours, expected, dtype):
    assert_rel_close(name, ours, expected, RTOL[dtype])


# ---- cases ------------------------------------------------------------------------------------

def _sinks_grad(full, ring):
    """The ring's sinks gradient summed over the group (each rank holds its rows' share)
    against the single op's, at float32's bar (sinks are float32 whatever q's dtype)."""
    total = ring.grad.clone()
    dist.all_reduce(total)
    _compare("dsinks", total, full.grad, torch.float32)


def _dense_case(world, layout, causal, dtype, hq, hkv, transposed, softcap=0.0, seed=0,
                window=(-1, -1), sinks=False, head_chunks=None):
    from adaattn import flash_attn
    from adaattn.distributed import ring_flash_attn, shard_sequence, unshard

    def run():
        b, length, d, dv = 2, 6 * world, 16, 8
        q = _draw((b, length, hq, d), dtype, "cpu", seed).transpose(1, 2) if transposed \
            else _draw((b, hq, length, d), dtype, "cpu", seed)
        k = _draw((b, hkv, length, d), dtype, "cpu", seed + 1)
        v = _draw((b, hkv, length, dv), dtype, "cpu", seed + 2)
        dout = _draw((b, hq, length, dv), dtype, "cpu", seed + 3)
        sink = (_draw((hq,), torch.float32, "cpu", seed + 4) + 1.0) if sinks else None
        full_sink, ring_sink = ((sink.clone().requires_grad_(), sink.clone().requires_grad_())
                                if sinks else (None, None))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = flash_attn(*full, causal=causal, softcap=softcap, window=window,
                              sinks=full_sink, return_lse=True)
        out.backward(dout)
        shards = [shard_sequence(t.detach(), layout=layout).requires_grad_() for t in (q, k, v)]
        r_out, r_lse = ring_flash_attn(*shards, layout=layout, causal=causal, softcap=softcap,
                                       window=window, sinks=ring_sink, return_lse=True,
                                       head_chunks=head_chunks)
        r_out.backward(shard_sequence(dout, layout=layout))
        if sinks:
            _sinks_grad(full_sink, ring_sink)
        _compare("out", r_out, shard_sequence(out.detach(), layout=layout), dtype)
        _compare("lse", r_lse, shard_sequence(lse, layout=layout), dtype)
        for nm, s, f in zip(("dq", "dk", "dv"), shards, full):
            _compare(nm, s.grad, shard_sequence(f.grad, layout=layout), dtype)
        torch.testing.assert_close(unshard(r_out.detach(), layout=layout), out.detach(),
                                   rtol=RTOL[dtype], atol=RTOL[dtype])
    return run


def _nan_case(world, layout, causal):
    """A NaN key reaches the same rows through the ring as through the single op: the ring's
    LSE merge and its backward keep it (no row's NaN turns into a zero or a finite value)."""
    from adaattn import flash_attn
    from adaattn.distributed import ring_flash_attn, shard_sequence

    def run():
        b, h, length, d = 1, 2, 6 * world, 8
        q, k, v, dout = (_draw((b, h, length, d), torch.float64, "cpu", 40 + i)
                         for i in range(4))
        k[0, 0, length // 2 + 1, 3] = float("nan")  # past the first shard
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = flash_attn(*full, causal=causal, return_lse=True)
        out.backward(dout)
        shards = [shard_sequence(t.detach(), layout=layout).requires_grad_() for t in (q, k, v)]
        r_out, r_lse = ring_flash_attn(*shards, layout=layout, causal=causal, return_lse=True)
        r_out.backward(shard_sequence(dout, layout=layout))
        expected = [out.detach(), lse] + [f.grad for f in full]
        for nm, a, e in zip(("out", "lse", "dq", "dk", "dv"),
                            [r_out.detach(), r_lse] + [t.grad for t in shards], expected):
            assert bool((~e.isfinite()).any()), f"{nm}: the NaN reached nothing"
            e = shard_sequence(e, layout=layout)
            assert torch.equal(a.isfinite(), e.isfinite()), f"{nm}: non-finite entries differ"
            _compare(nm, a[a.isfinite()], e[e.isfinite()], torch.float64)
    return run


def _varlen_case(world, layout, causal, dtype, cu_list, hq=4, hkv=2, seed=10, sinks=False,
                 head_chunks=None):
    from adaattn import flash_attn_varlen
    from adaattn.distributed import ring_flash_attn_varlen, shard_sequence

    def run():
        t, d = cu_list[-1], 16
        cu = torch.tensor(cu_list, dtype=torch.int32)
        q = _draw((t, hq, d), dtype, "cpu", seed)
        k = _draw((t, hkv, d), dtype, "cpu", seed + 1)
        v = _draw((t, hkv, d), dtype, "cpu", seed + 2)
        dout = _draw((t, hq, d), dtype, "cpu", seed + 3)
        sink = (_draw((hq,), torch.float32, "cpu", seed + 4) + 1.0) if sinks else None
        full_sink, ring_sink = ((sink.clone().requires_grad_(), sink.clone().requires_grad_())
                                if sinks else (None, None))
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = flash_attn_varlen(*full, cu, cu, causal=causal, sinks=full_sink,
                                     return_lse=True)
        out.backward(dout)
        shards = [shard_sequence(x.detach(), dim=0, layout=layout).requires_grad_()
                  for x in (q, k, v)]
        r_out, r_lse = ring_flash_attn_varlen(*shards, cu, layout=layout, causal=causal,
                                              sinks=ring_sink, return_lse=True,
                                              head_chunks=head_chunks)
        r_out.backward(shard_sequence(dout, dim=0, layout=layout))
        if sinks:
            _sinks_grad(full_sink, ring_sink)
        _compare("out", r_out, shard_sequence(out.detach(), dim=0, layout=layout), dtype)
        _compare("lse", r_lse, shard_sequence(lse, dim=1, layout=layout), dtype)
        for nm, s, f in zip(("dq", "dk", "dv"), shards, full):
            _compare(nm, s.grad, shard_sequence(f.grad, dim=0, layout=layout), dtype)
    return run


def _raises(cls, text, fn):
    def run():
        with pytest.raises(cls, match=text):
            fn()
    return run


def _bad_input_cases(world):
    from adaattn.distributed import (ring_flash_attn, ring_flash_attn_varlen, ring_lazy_attn,
                                     shard_sequence)
    q = torch.randn(1, 2, 4, 8)
    tau, bias = torch.full((2,), -1.0), torch.zeros(2, 4)
    odd = torch.randn(1, 2, 3, 8)
    packed = torch.randn(4, 2, 8)
    cu = torch.tensor([0, 4 * world], dtype=torch.int32)
    return [
        ("bad layout", _raises(ValueError, r"adaattn.ring_flash_attn: layout must be one of",
                               lambda: ring_flash_attn(q, q, q, layout="ring"))),
        ("layout type", _raises(TypeError, r"adaattn.shard_sequence: layout must be a str",
                                lambda: shard_sequence(q, layout=None))),
        ("window", _raises(ValueError, r"adaattn.ring_flash_attn_varlen: window must be",
                           lambda: ring_flash_attn_varlen(packed, packed, packed, cu,
                                                          window=(4, 0)))),
        ("window value", _raises(ValueError, r"adaattn.ring_flash_attn: window entries",
                                 lambda: ring_flash_attn(q, q, q, window=(-2, 0)))),
        ("odd zigzag shard", _raises(ValueError, r"q.size\(2\) must be even",
                                     lambda: ring_flash_attn(odd, odd, odd))),
        ("q/k shard lengths", _raises(ValueError, r"same length",
                                      lambda: ring_flash_attn(q, q[:, :, :2], q[:, :, :2]))),
        ("causal type", _raises(TypeError, r"causal must be a bool",
                                lambda: ring_flash_attn(q, q, q, causal=1))),
        ("indivisible length", _raises(ValueError, r"adaattn.shard_sequence: x.size\(dim\) = 5",
                                       lambda: shard_sequence(torch.randn(1, 1, 5, 2)))),
        ("varlen cu dtype", _raises(TypeError, r"ring_flash_attn_varlen: cu_seqlens must be int32",
                                    lambda: ring_flash_attn_varlen(packed, packed, packed,
                                                                   cu.long()))),
        ("sinks shape", _raises(ValueError, r"adaattn.ring_flash_attn: sinks",
                                lambda: ring_flash_attn(q, q, q, sinks=torch.zeros(3)))),
        ("sinks dtype", _raises(TypeError, r"adaattn.ring_flash_attn_varlen: sinks must be float32",
                                lambda: ring_flash_attn_varlen(packed, packed, packed, cu,
                                                               sinks=torch.zeros(2).double()))),
        ("lazy tau shape", _raises(ValueError, r"adaattn.ring_lazy_attn: tau must have shape",
                                   lambda: ring_lazy_attn(q, q, q, tau[:1], bias))),
        ("lazy bias dtype", _raises(TypeError, r"adaattn.ring_lazy_attn: bias must be float32",
                                    lambda: ring_lazy_attn(q, q, q, tau, bias.double()))),
        ("lazy odd zigzag shard", _raises(ValueError, r"ring_lazy_attn: .*q.size\(2\) must be even",
                                          lambda: ring_lazy_attn(odd, odd, odd, tau, bias))),
        ("lazy layout", _raises(ValueError, r"adaattn.ring_lazy_attn: layout must be one of",
                                lambda: ring_lazy_attn(q, q, q, tau, bias, layout="ring"))),
        ("head_chunks divisor", _raises(ValueError, r"ring_flash_attn: head_chunks must be None "
                                        r"or a positive divisor of the kv heads \(2\), got 3",
                                        lambda: ring_flash_attn(q, q, q, head_chunks=3))),
        ("head_chunks zero", _raises(ValueError, r"ring_lazy_attn: head_chunks must be",
                                     lambda: ring_lazy_attn(q, q, q, tau, bias, head_chunks=0))),
        ("head_chunks type", _raises(ValueError, r"ring_flash_attn_varlen: head_chunks must be",
                                     lambda: ring_flash_attn_varlen(packed, packed, packed, cu,
                                                                    head_chunks=1.0))),
    ]


def test_auto_head_groups():
    """The default head_chunks: the most groups (a divisor of Hkv, at most 8) that keep two
    waves of 128-row tiles per group on the GPU."""
    from adaattn.distributed import _auto_head_groups
    assert _auto_head_groups(16, 16, 32768, 1, 132) == 8  # 2 heads x 256 tiles >= 264
    assert _auto_head_groups(16, 16, 16384, 1, 132) == 4  # 4 heads x 128 tiles
    assert _auto_head_groups(16, 16, 4096, 1, 132) == 1   # 2 groups: 8 x 32 tiles < 264
    assert _auto_head_groups(32, 8, 8192, 1, 132) == 4    # 8 groups: 4 x 64 tiles < 264
    assert _auto_head_groups(12, 6, 65536, 2, 132) == 6   # a divisor of 6, not 8
    assert _auto_head_groups(8, 1, 10 ** 6, 4, 132) == 1  # one kv head: one group


def test_not_initialised():
    from adaattn.distributed import ring_flash_attn
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(RuntimeError, match="adaattn.ring_flash_attn: torch.distributed is not"):
        ring_flash_attn(q, q, q)


def _unshard_case(world, layout, dim):
    from adaattn.distributed import shard_sequence, unshard

    def run():
        full = _draw((2, 3, 4 * world, 5), torch.float64, "cpu", 20).movedim(2, dim)
        weight = _draw(full.shape, torch.float64, "cpu", 21)
        x = shard_sequence(full, dim=dim, layout=layout).detach().requires_grad_()
        y = unshard(x, dim=dim, layout=layout)
        assert torch.equal(y, full)
        (y * weight).sum().backward()
        # every rank's loss reads every shard: the gradient sums the W identical weights
        torch.testing.assert_close(x.grad, world * shard_sequence(weight, dim=dim, layout=layout))
    return run


def _lazy_params(hq, window, dtype, device, seed):
    """tau < 0 (clips a share of the weights) and a bias table of `window` distances."""
    tau = (-0.3 - 0.4 * _draw((hq,), torch.float64, "cpu", seed).abs()).to(device, dtype)
    bias = (0.5 * _draw((hq, window), torch.float64, "cpu", seed + 1)).to(device, dtype)
    return tau, bias


def _lazy_case(world, layout, dtype, hq, hkv, window, transposed=False, seed=20,
               head_chunks=None):
    from adaattn import lazy_attn
    from adaattn.distributed import ring_lazy_attn, shard_sequence

    def run():
        b, length, d = 2, 6 * world, 16
        q = _draw((b, length, hq, d), dtype, "cpu", seed).transpose(1, 2) if transposed \
            else _draw((b, hq, length, d), dtype, "cpu", seed)
        k = _draw((b, hkv, length, d), dtype, "cpu", seed + 1)
        v = _draw((b, hkv, length, d), dtype, "cpu", seed + 2)
        dout = _draw((b, hq, length, d), dtype, "cpu", seed + 3)
        tau, bias = _lazy_params(hq, window, torch.float32, "cpu", seed + 4)
        full = [t.clone().requires_grad_() for t in (q, k, v, tau, bias)]
        out, lse = lazy_attn(*full, return_lse=True)
        out.backward(dout)
        shards = [shard_sequence(t.detach(), layout=layout).requires_grad_() for t in (q, k, v)]
        params = [t.clone().requires_grad_() for t in (tau, bias)]
        r_out, r_lse = ring_lazy_attn(*shards, *params, layout=layout, return_lse=True,
                                      head_chunks=head_chunks)
        r_out.backward(shard_sequence(dout, layout=layout))
        _compare("out", r_out, shard_sequence(out.detach(), layout=layout), dtype)
        _compare("lse", r_lse, shard_sequence(lse, layout=layout), dtype)
        for nm, s, f in zip(("dq", "dk", "dv"), shards, full):
            _compare(nm, s.grad, shard_sequence(f.grad, layout=layout), dtype)
        for nm, r, f in zip(("dtau", "dbias"), params, full[3:]):
            total = r.grad.clone()  # each rank holds its rows' share
            dist.all_reduce(total)
            _compare(nm, total, f.grad, torch.float32)
    return run


def _cpu_worker(rank, world):
    cases = _bad_input_cases(world)
    cases += [(f"unshard {layout} dim={dim}", _unshard_case(world, layout, dim))
              for layout in ("contiguous", "zigzag") for dim in (0, 2)]
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            for dtype in (torch.float32, torch.float64):
                cases.append((f"flash {layout} causal={causal} {dtype} gqa",
                              _dense_case(world, layout, causal, dtype, 4, 2, False)))
        cases.append((f"flash {layout} causal mha transposed softcap",
                      _dense_case(world, layout, True, torch.float32, 2, 2, True, softcap=5.0)))
        # L = 6W: chunks of 6 (contiguous) or 3 (zigzag); windows inside one chunk and across
        for causal, window in ((True, (2, 0)), (True, (7, -1)), (False, (4, 5)),
                               (False, (-1, 3)), (False, (5, -1))):
            cases.append((f"flash {layout} causal={causal} window={window}",
                          _dense_case(world, layout, causal, torch.float64, 4, 2, False,
                                      window=window)))
        for causal in (False, True):
            cases.append((f"flash {layout} causal={causal} nan key", _nan_case(world, layout,
                                                                               causal)))
        # T = 8 W; sequences of lengths 0, 5, 3W+2, ... cross chunk and shard boundaries
        n = 8 * world
        cu = [0, 0, 5, 5 + 3 * world + 2, n - 1, n]
        for causal in (False, True):
            cases.append((f"flash varlen {layout} causal={causal} cu={cu}",
                          _varlen_case(world, layout, causal, torch.float64, cu)))
        for causal in (False, True):
            cases.append((f"flash {layout} causal={causal} sinks gqa",
                          _dense_case(world, layout, causal, torch.float64, 4, 2, False,
                                      sinks=True)))
        cases.append((f"flash {layout} causal window sinks",
                      _dense_case(world, layout, True, torch.float32, 4, 2, False,
                                  window=(7, -1), sinks=True)))
        cases.append((f"flash varlen {layout} causal sinks cu={cu}",
                      _varlen_case(world, layout, True, torch.float64, cu, sinks=True)))
        # L = 6W: W = 2 inside a chunk, 9 W + 1 beyond the whole sequence
        for dtype in (torch.float32, torch.float64):
            for window in (2, 9 * world + 1):
                cases.append((f"lazy {layout} {dtype} window={window} gqa",
                              _lazy_case(world, layout, dtype, 4, 2, window)))
        cases.append((f"lazy {layout} mha transposed",
                      _lazy_case(world, layout, torch.float32, 2, 2, 5, transposed=True)))
        # heads in groups, one ring each: GQA groups (2 query heads per kv head), B = 2 (head
        # slices are not contiguous), sinks and softcap per group, packed heads
        for chunks in (1, 2):
            cases.append((f"flash {layout} causal sinks softcap head_chunks={chunks}",
                          _dense_case(world, layout, True, torch.float64, 4, 2, False,
                                      softcap=5.0, sinks=True, head_chunks=chunks)))
            cases.append((f"flash {layout} transposed head_chunks={chunks}",
                          _dense_case(world, layout, False, torch.float32, 4, 4, True,
                                      head_chunks=2 * chunks)))
            cases.append((f"flash varlen {layout} causal sinks head_chunks={chunks}",
                          _varlen_case(world, layout, True, torch.float64, cu, sinks=True,
                                       head_chunks=chunks)))
            cases.append((f"lazy {layout} gqa head_chunks={chunks}",
                          _lazy_case(world, layout, torch.float64, 4, 2, 5,
                                     head_chunks=chunks)))
            cases.append((f"flash {layout} causal window head_chunks={chunks}",
                          _dense_case(world, layout, True, torch.float64, 4, 2, False,
                                      window=(7, -1), head_chunks=chunks)))
    return _run_cases(cases)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_cpu_gloo(world):
    _spawn(_cpu_worker, world)


# ---- CUDA / NCCL -------------------------------------------------------------------------------

def _cuda_worker(rank, world, device_type="cuda", length=1024):
    """bf16 ring vs the float64 reference, flash-attn's 2x rule (device_type="cpu" with gloo
    exercises the same code on CPU)."""
    from adaattn import reference
    from adaattn.distributed import ring_flash_attn, shard_sequence
    dev = torch.device(device_type, rank if device_type == "cuda" else None)

    def case(layout, causal, hq, hkv, length, window=(-1, -1), sinks=False, head_chunks=None):
        def run():
            b, d = 2, 128
            base = [_draw(s, torch.float64, dev, i) for i, s in enumerate(
                [(b, hq, length, d), (b, hkv, length, d), (b, hkv, length, d),
                 (b, hq, length, d)])]
            q64, k64, v64, dout = base
            sink = _draw((hq,), torch.float64, dev, 4) + 1.0 if sinks else None

            def grads(fn, dtype, inputs, grad_out):
                ts = [x.detach().to(dtype).requires_grad_() for x in inputs]
                # sinks are float32 [Hq] for every q dtype (float64 in the fp64 reference)
                sk = (None if sink is None else
                      sink.detach().to(torch.float64 if dtype == torch.float64 else torch.float32)
                      .requires_grad_())
                out, lse = fn(*ts, sinks=sk)
                out.backward(grad_out.to(dtype))
                return [out, lse] + [t.grad for t in ts] + ([] if sk is None else [sk.grad])

            def ref(*t, sinks):
                return reference.flash_attn(*t, causal=causal, window=window, sinks=sinks)
            ref64 = grads(ref, torch.float64, (q64, k64, v64), dout)
            ref_bf = grads(ref, torch.bfloat16, (q64, k64, v64), dout)
            shard = lambda x: shard_sequence(x, layout=layout)  # noqa: E731
            ours = grads(lambda *t, sinks: ring_flash_attn(*t, layout=layout, causal=causal,
                                                           window=window, sinks=sinks,
                                                           return_lse=True,
                                                           head_chunks=head_chunks),
                         torch.bfloat16, [shard(x) for x in (q64, k64, v64)], shard(dout))
            for nm, o, lo, hi in zip(("out", "lse", "dq", "dk", "dv"), ours, ref_bf, ref64):
                assert_low_precision_rule(nm, o, shard(lo), shard(hi))
            if sinks:  # each rank holds its rows' share of d sinks
                total = ours[5].clone()
                dist.all_reduce(total)
                assert_low_precision_rule("dsinks", total, ref_bf[5], ref64[5])
        return run

    def lazy_case(layout, hq, hkv, length, window, head_chunks=None):
        from adaattn.distributed import ring_lazy_attn

        def run():
            b, d = 2, 128
            q64, k64, v64, dout = [_draw(s, torch.float64, dev, 10 + i) for i, s in enumerate(
                [(b, hq, length, d), (b, hkv, length, d), (b, hkv, length, d),
                 (b, hq, length, d)])]
            tau, bias = _lazy_params(hq, window, torch.float64, dev, 14)

            def grads(fn, dtype, inputs, grad_out):
                ts = [x.detach().to(dtype).requires_grad_() for x in inputs]
                pdt = torch.float64 if dtype == torch.float64 else torch.float32
                ps = [x.detach().to(pdt).requires_grad_() for x in (tau, bias)]
                out, lse = fn(*ts, *ps)
                out.backward(grad_out.to(dtype))
                return [out, lse] + [t.grad for t in ts], [p.grad for p in ps]

            def ref(*t):
                return reference.lazy_attn(*t)
            ref64, ref64_p = grads(ref, torch.float64, (q64, k64, v64), dout)
            ref_bf, ref_bf_p = grads(ref, torch.bfloat16, (q64, k64, v64), dout)
            shard = lambda x: shard_sequence(x, layout=layout)  # noqa: E731
            ours, ours_p = grads(lambda *t: ring_lazy_attn(*t, layout=layout, return_lse=True,
                                                           head_chunks=head_chunks),
                                 torch.bfloat16, [shard(x) for x in (q64, k64, v64)],
                                 shard(dout))
            for nm, o, lo, hi in zip(("out", "lse", "dq", "dk", "dv"), ours, ref_bf, ref64):
                assert_low_precision_rule(nm, o, shard(lo), shard(hi))
            for nm, o, lo, hi in zip(("dtau", "dbias"), ours_p, ref_bf_p, ref64_p):
                total = o.clone()  # each rank holds its rows' share
                dist.all_reduce(total)
                assert_low_precision_rule(nm, total, lo, hi)
        return run

    cases = [(f"cuda {layout} causal={causal} hq={hq} hkv={hkv}",
              case(layout, causal, hq, hkv, length))
             for layout in ("contiguous", "zigzag") for causal in (False, True)
             for hq, hkv in ((4, 4), (8, 2))]
    window = (length // 3, 0)
    cases += [(f"cuda {layout} causal window={window}", case(layout, True, 8, 2, length, window))
              for layout in ("contiguous", "zigzag")]
    cases += [(f"cuda {layout} causal={causal} sinks", case(layout, causal, 8, 2, length,
                                                              sinks=True))
              for layout in ("contiguous", "zigzag") for causal in (False, True)]
    # bias windows inside a chunk and beyond the whole sequence
    cases += [(f"cuda lazy {layout} window={w}", lazy_case(layout, 8, 2, length, w))
              for layout in ("contiguous", "zigzag") for w in (length // 8, 2 * length)]
    cases += [("cuda zigzag causal sinks head_chunks=2", case("zigzag", True, 8, 2, length,
                                                               sinks=True, head_chunks=2)),
              ("cuda lazy zigzag head_chunks=2", lazy_case("zigzag", 8, 2, length,
                                                            length // 8, head_chunks=2))]
    return _run_cases(cases)


def test_ring_low_precision_worker_cpu_gloo():
    """The NCCL test's worker (bf16 against the fp64 and bf16 references, sinks included) on
    CPU with gloo: its checks run in CI too."""
    _spawn(_cuda_worker, 2, "cpu", 128)


@pytest.mark.cuda
def test_ring_cuda_nccl_one_gpu():
    """A group of one: every block call of the ring (chunk pairs with their own positions, the
    lazy block ops) on one GPU's kernels, against the references."""
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a CUDA device")
    _spawn(_cuda_worker, 1)


@pytest.mark.cuda
def test_ring_cuda_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    _spawn(_cuda_worker, 2)
