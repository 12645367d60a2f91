"""Context parallelism: ring attention over ``torch.distributed`` (NCCL on GPUs, gloo on CPU).

Each rank of a process group holds one shard of the sequence (``shard_sequence``); the ring ops
pass key/value shards around the ring with ``batch_isend_irecv`` while the local attention of
the shard in hand runs, and merge the partial results through their log-sum-exp. Results and
gradients equal the single-process op on the full sequence (up to float rounding of the merge).

Layouts (the sequence of length ``L`` cut into equal chunks):

* ``"contiguous"``: ``W`` chunks, rank ``r`` holds chunk ``r``.
* ``"zigzag"``: ``2 W`` chunks, rank ``r`` holds chunks ``r`` and ``2 W - 1 - r`` (in that order),
  so that under a causal mask every rank does the same work.

With ``torch.distributed.device_mesh``, pass the context-parallel dimension's group:
``mesh = init_device_mesh("cuda", (dp, cp), mesh_dim_names=("dp", "cp"))`` then
``group=mesh.get_group("cp")`` (FSDP/TP use the other dimensions). docs/context_parallel.md
describes the communication and when the ring pays off.
"""
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from . import _checks as C
from ._ops import ops

__all__ = ["LAYOUTS", "ring_flash_attn", "ring_flash_attn_varlen", "ring_lazy_attn",
           "shard_sequence", "unshard"]

LAYOUTS = ("zigzag", "contiguous")


# ---- layout ------------------------------------------------------------------------------------

def _group(op: str, group):
    C.check(dist.is_available() and dist.is_initialized(), RuntimeError, op,
            "torch.distributed is not initialised (call torch.distributed.init_process_group)")
    return dist.get_world_size(group), dist.get_rank(group)


def _layout(op: str, layout) -> str:
    C.check(isinstance(layout, str), TypeError, op, "layout must be a str, got ",
            C.type_name(layout))
    C.check(layout in LAYOUTS, ValueError, op, "layout must be one of ", repr(LAYOUTS), ", got ",
            repr(layout))
    return layout


def _chunk_ids(rank: int, world: int, layout: str) -> List[int]:
    """The chunks of the full sequence that rank ``rank`` holds, in shard order."""
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def _num_chunks(world: int, layout: str) -> int:
    return world if layout == "contiguous" else 2 * world


def _check_dim(op: str, x: torch.Tensor, dim) -> None:
    C.integer(op, "dim", dim)
    C.check(-x.dim() <= dim < x.dim(), ValueError, op, "dim must be in [", -x.dim(), ", ",
            x.dim(), "), got ", dim)


def shard_sequence(x: torch.Tensor, group=None, *, dim: int = 2,
                   layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of a full-sequence tensor.

    Args:
        x: the full tensor, identical on every rank, e.g. ``[B, H, L, D]`` (``dim=2``) or a
            packed ``[T, H, D]`` (``dim=0``). ``x.size(dim)`` must be divisible by ``W``
            (contiguous) or ``2 W`` (zigzag), ``W`` the group's size.
        group: the process group (default: the world).
        dim: the sequence dim.
        layout: ``"zigzag"`` or ``"contiguous"`` (module docstring).

    Returns:
        ``x`` with ``x.size(dim) / W`` entries along ``dim`` (a view for contiguous, a copy for
        zigzag). Differentiable.
    """
    op = "shard_sequence"
    C.tensor(op, "x", x)
    layout = _layout(op, layout)
    world, rank = _group(op, group)
    _check_dim(op, x, dim)
    n = _num_chunks(world, layout)
    length = x.shape[dim]
    C.check(length % n == 0, ValueError, op, "x.size(dim) = ", length, " must be divisible by ",
            n, " (", layout, " layout over ", world, " ranks)")
    size = length // n
    parts = [x.narrow(dim, c * size, size) for c in _chunk_ids(rank, world, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard(x: torch.Tensor, group=None, *, dim: int = 2, layout: str = "zigzag") -> torch.Tensor:
    """All-gathers the shards (as made by :func:`shard_sequence`) back into the full sequence.

    Args:
        x: this rank's shard, ``x.size(dim) = L / W`` (an even number for zigzag).
        group, dim, layout: as in :func:`shard_sequence`.

    Returns:
        The full tensor, ``L`` entries along ``dim``, on every rank. Differentiable (the
        gradient of a shard is the sum over ranks of their gradients of its entries).
    """
    op = "unshard"
    C.tensor(op, "x", x)
    layout = _layout(op, layout)
    world, _ = _group(op, group)
    _check_dim(op, x, dim)
    per_rank = len(_chunk_ids(0, world, layout))
    C.check(x.shape[dim] % per_rank == 0, ValueError, op, "x.size(dim) = ", x.shape[dim],
            " must be even for the zigzag layout")
    from torch.distributed.nn.functional import all_gather
    shards = all_gather(x.contiguous(), group=group)
    size = x.shape[dim] // per_rank
    chunks = [None] * _num_chunks(world, layout)
    for r, shard in enumerate(shards):
        for i, c in enumerate(_chunk_ids(r, world, layout)):
            chunks[c] = shard.narrow(dim, i * size, size)
    return torch.cat(chunks, dim)


# ---- ring transport ----------------------------------------------------------------------------

_COMM_STREAMS = {}


class _Ring:
    """Sends tensors to the next rank and receives as many from the previous one.

    On CUDA the transfers are issued from a dedicated stream (after it waits for the current
    one), so that the kernels queued meanwhile on the current stream run concurrently; ``wait``
    makes the current stream wait for the received data.
    """

    def __init__(self, group, device: torch.device):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.world = world
        # P2POp takes global ranks
        self.next, self.prev = (rank + 1) % world, (rank - 1) % world
        if group is not None:
            self.next = dist.get_global_rank(group, self.next)
            self.prev = dist.get_global_rank(group, self.prev)
        self.stream = None
        if device.type == "cuda":
            key = (device.index if device.index is not None else torch.cuda.current_device())
            if key not in _COMM_STREAMS:
                _COMM_STREAMS[key] = torch.cuda.Stream(device=key)
            self.stream = _COMM_STREAMS[key]

    def start(self, tensors: Sequence[torch.Tensor], tag: int = 0):
        """Starts the exchange; transfers in flight together need distinct ``tag`` ranges
        (gloo matches messages by tag, not by the order they were posted in)."""
        sends = [t.contiguous() for t in tensors]
        recvs = [torch.empty_like(t) for t in sends]
        p2p = ([dist.P2POp(dist.isend, t, self.next, self.group, tag + i)
                for i, t in enumerate(sends)]
               + [dist.P2POp(dist.irecv, t, self.prev, self.group, tag + i)
                  for i, t in enumerate(recvs)])
        if self.stream is None:
            return dist.batch_isend_irecv(p2p), recvs, sends
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            reqs = dist.batch_isend_irecv(p2p)
        for t in sends + recvs:
            t.record_stream(self.stream)
        return reqs, recvs, sends

    def wait(self, pending) -> List[torch.Tensor]:
        """The received tensors; the sent ones (kept alive until now) are released."""
        reqs, recvs, _ = pending
        for req in reqs:
            req.wait()
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
        return recvs


# ---- block plans -------------------------------------------------------------------------------
# A plan lists the attention calls between this rank's query shard and the key shard of rank
# `src`: (query rows, key rows, window_left, window_right[, cu_seqlens_q, cu_seqlens_k]), rows as
# slices of the shards' sequence dim, window_right = 0 meaning causal. Without a sliding window,
# a causal mask is only ever needed on a chunk against itself (same positions, so the op's
# bottom-right diagonal is exact); every other chunk pair is entirely visible or entirely
# masked. With one, _window_call clips each chunk pair to what the window reaches.

_ALL = slice(None)


def _dense_plan(rank: int, src: int, world: int, layout: str, causal: bool, lq: int, lk: int):
    if not causal:
        return [(_ALL, _ALL, -1, -1)]
    if src == rank:
        return [(_ALL, _ALL, -1, 0)]
    if layout == "contiguous":
        return [(_ALL, _ALL, -1, -1)] if src < rank else []
    # zigzag: this rank holds chunks (rank, 2W-1-rank), src holds (src, 2W-1-src)
    if src < rank:
        return [(_ALL, slice(0, lk // 2), -1, -1)]   # all queries see src's first chunk
    return [(slice(lq // 2, None), _ALL, -1, -1)]    # the second query chunk sees both


def _window_call(d: int, chunk: int, left: int, right: int):
    """The call for a query chunk ``d`` positions after a key chunk of the same length under a
    window (``-1`` = unbounded): the query rows and keys that see anything, and the window that
    the op, bottom-right aligned on those slices, needs for the exact global mask; None when
    nothing is visible.

    Row r sees keys c with ``d - left <= c - r <= d + right``; for slices q[qa:qb], k[ka:kb]
    the op's condition is ``e - wl <= c - r <= e + wr`` with ``e = kb - qb``.
    """
    qa = 0 if right == -1 else max(0, -(d + right))
    qb = chunk if left == -1 else min(chunk, chunk - d + left)
    if qa >= qb:
        return None
    ka = 0 if left == -1 else max(0, qa + d - left)
    kb = chunk if right == -1 else min(chunk, qb + d + right)
    if ka >= kb:
        return None
    e = kb - qb
    wl = -1 if left == -1 else e - (d - left)
    wr = -1 if right == -1 else d + right - e
    return slice(qa, qb), slice(ka, kb), wl, wr


def _windowed_plan(rank: int, src: int, world: int, layout: str, causal: bool, left: int,
                   right: int, chunk: int):
    """Chunk-pair calls under a sliding window (causal: right = 0), dense layout."""
    if causal:
        right = 0
    calls = []
    for qi, qc in enumerate(_chunk_ids(rank, world, layout)):
        for ki, kc in enumerate(_chunk_ids(src, world, layout)):
            call = _window_call((qc - kc) * chunk, chunk, left, right)
            if call is None:
                continue
            (qa, qb), (ka, kb) = (call[0].start, call[0].stop), (call[1].start, call[1].stop)
            calls.append((slice(qi * chunk + qa, qi * chunk + qb),
                          slice(ki * chunk + ka, ki * chunk + kb), call[2], call[3]))
    return calls


def _varlen_plan(rank: int, src: int, world: int, layout: str, causal: bool, chunk: int,
                 cu: torch.Tensor):
    """Chunk-pair calls with cu_seqlens cut to the two chunks (clamped on the device)."""
    calls = []
    for qi, qc in enumerate(_chunk_ids(rank, world, layout)):
        for ki, kc in enumerate(_chunk_ids(src, world, layout)):
            if causal and kc > qc:
                continue
            cu_q = (cu.clamp(qc * chunk, (qc + 1) * chunk) - qc * chunk).to(torch.int32)
            cu_k = (cu.clamp(kc * chunk, (kc + 1) * chunk) - kc * chunk).to(torch.int32)
            calls.append((slice(qi * chunk, (qi + 1) * chunk), slice(ki * chunk, (ki + 1) * chunk),
                          -1, 0 if causal and kc == qc else -1, cu_q, cu_k))
    return calls


# ---- ring flash --------------------------------------------------------------------------------

def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(t: torch.Tensor, dim: int, rows: slice) -> torch.Tensor:
    return t if rows == _ALL else t[(slice(None),) * dim + (rows,)]


def _merge(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
           lse_dim: int, row_dim: int):
    """acc, acc_lse <- the softmax-weighted union of (acc, acc_lse) and (out, lse), in place."""
    lse = lse.to(acc_lse.dtype)
    new = torch.logaddexp(acc_lse, lse)
    # rows that saw no key anywhere keep lse = -inf and out = 0 (exp(-inf - 0) = 0, no NaN)
    ref = torch.where(new == float("-inf"), torch.zeros_like(new), new)
    w_acc = torch.exp(acc_lse - ref)
    w_new = torch.exp(lse - ref)
    if lse_dim != row_dim:  # packed: lse [H, T], out [T, H, D]
        w_acc, w_new = w_acc.transpose(0, 1), w_new.transpose(0, 1)
    acc.mul_(w_acc.unsqueeze(-1)).add_(out.to(acc.dtype) * w_new.unsqueeze(-1))
    acc_lse.copy_(new)


class _RingSpec:
    """What one ring call needs besides the tensors (op options, plan, dims)."""

    def __init__(self, group, world, rank, layout, causal, scale, softcap, deterministic,
                 packed, cu_seqlens=None, chunk=0, window=(-1, -1)):
        self.group, self.world, self.rank, self.layout = group, world, rank, layout
        self.window = window
        self.causal, self.scale, self.softcap = causal, scale, softcap
        self.deterministic, self.packed = deterministic, packed
        self.cu_seqlens, self.chunk = cu_seqlens, chunk
        self.row_dim = 0 if packed else 2   # sequence dim of q/k/v/out
        self.lse_dim = 1 if packed else 2   # sequence dim of lse
        self.heads = [(_ALL, _ALL)]  # (query heads, kv heads) of each ring: _head_groups

    def plan(self, src: int, lq: int, lk: int):
        """[(query rows, key rows, window_left, window_right, cu_seqlens_q, cu_seqlens_k)]."""
        if self.packed:
            return _varlen_plan(self.rank, src, self.world, self.layout, self.causal, self.chunk,
                                self.cu_seqlens)
        if self.window != (-1, -1):
            per_rank = len(_chunk_ids(self.rank, self.world, self.layout))
            return [(*call, None, None) for call in _windowed_plan(
                self.rank, src, self.world, self.layout, self.causal, *self.window,
                lq // per_rank)]
        return [(*call, None, None)
                for call in _dense_plan(self.rank, src, self.world, self.layout, self.causal,
                                        lq, lk)]


# ---- head groups -------------------------------------------------------------------------------
# Heads are independent, so a ring call may run its heads in groups, one whole ring per group:
# every buffer the ring adds to the single-GPU op (received K/V, fp32 accumulators, travelling
# dK/dV partials, the block calls' outputs) then holds one group's heads. The transfers shrink
# with the compute, so the ring hides them as well as before; each group's kernels must still
# fill the GPU, hence the automatic choice below.

# The automatic choice: at most this many groups (the ring's extra memory, about 13 bf16 shard
# tensors for MHA (docs/context_parallel.md), falls to about 13 / G of one), each keeping at
# least _MIN_WAVES 128-row tiles per streaming multiprocessor busy.
_AUTO_MAX_HEAD_GROUPS = 8
_MIN_WAVES = 2


def _auto_head_groups(hq: int, hkv: int, rows: int, batch: int, sms: int) -> int:
    """The most head groups (a divisor of ``hkv``, at most _AUTO_MAX_HEAD_GROUPS) whose 128-row
    tiles still fill ``sms`` streaming multiprocessors _MIN_WAVES times over."""
    tiles = batch * -(-rows // 128)
    best = 1
    for groups in range(1, min(hkv, _AUTO_MAX_HEAD_GROUPS) + 1):
        if hkv % groups == 0 and tiles * (hq // groups) >= _MIN_WAVES * sms:
            best = groups
    return best


def _head_groups(op: str, head_chunks, q: torch.Tensor, hq: int, hkv: int, rows: int,
                 batch: int) -> List[tuple]:
    """[(query head slice, kv head slice)] of ``head_chunks`` groups (None: automatic); a
    group's query heads are those of its kv heads (GQA)."""
    if head_chunks is None:
        groups = 1
        if q.device.type == "cuda":
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            groups = _auto_head_groups(hq, hkv, rows, batch, sms)
    else:
        C.check(isinstance(head_chunks, int) and not isinstance(head_chunks, bool)
                and head_chunks >= 1 and hkv % head_chunks == 0, ValueError, op,
                "head_chunks must be None or a positive divisor of the kv heads (", hkv,
                "), got ", repr(head_chunks))
        groups = head_chunks
    per_q, per_kv = hq // groups, hkv // groups
    return [(slice(g * per_q, (g + 1) * per_q), slice(g * per_kv, (g + 1) * per_kv))
            for g in range(groups)]


def _lse_heads(spec, lse: torch.Tensor, heads: slice) -> torch.Tensor:
    """The rows of ``heads`` in an lse tensor (dense ``[B, Hq, L]``, packed ``[Hq, T]``)."""
    return lse[heads] if spec.packed else lse[:, heads]


def _mask(window_left: int, window_right: int):
    """The op's (causal, window_left, window_right) for a call's window (causal kernels skip
    tiles above the diagonal: say causal rather than window_right = 0)."""
    if window_right == 0:
        return True, window_left, -1
    return False, window_left, window_right


def _ring_flash_fwd(spec: _RingSpec, q, k, v):
    ring = _Ring(spec.group, q.device)
    lq, lk = q.shape[spec.row_dim], k.shape[spec.row_dim]
    acc = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=_acc_dtype(q.dtype))
    # rows no call reaches (none today: the first step covers every row) stay 0 / -inf
    lse_shape = (q.shape[1], q.shape[0]) if spec.packed else q.shape[:3]
    acc_lse = q.new_full(lse_shape, float("-inf"), dtype=_acc_dtype(q.dtype))
    kv = (k, v)
    block_lse = []
    for step in range(spec.world):
        src = (spec.rank - step) % spec.world
        pending = ring.start(kv) if step < spec.world - 1 else None
        for qr, kr, wl, wr, cu_q, cu_k in spec.plan(src, lq, lk):
            out_b, lse_b = ops.flash_fwd(
                _rows(q, spec.row_dim, qr), _rows(kv[0], spec.row_dim, kr),
                _rows(kv[1], spec.row_dim, kr), None, spec.scale, *_mask(wl, wr), cu_q, cu_k,
                spec.softcap)
            if step == 0 and qr == _ALL and len(block_lse) == 0:  # the first block: no merge
                acc.copy_(out_b)
                acc_lse.copy_(lse_b)
            else:
                _merge(_rows(acc, spec.row_dim, qr), _rows(acc_lse, spec.lse_dim, qr), out_b,
                       lse_b, spec.lse_dim, spec.row_dim)
            block_lse.append(lse_b)
        if pending is not None:
            kv = tuple(ring.wait(pending))
    return acc.to(q.dtype), acc_lse.to(torch.float32), block_lse


def _block_grad_out(spec: _RingSpec, dout: torch.Tensor, lse_block: torch.Tensor,
                    lse_rows: torch.Tensor) -> torch.Tensor:
    """grad_out scaled by c = exp(lse_block - lse) per row.

    The backward ops normalise a block's scores by the block's own lse (the CPU and exact CUDA
    kernels even recompute it); the block's share of the full row's gradient has probabilities
    p = c p_block and, with Delta = grad_out . out of the full row, dS = p (dP - Delta) =
    p_block (c dP - c Delta): exactly the op's backward with grad_out scaled by c.
    """
    ref = lse_block.to(_acc_dtype(dout.dtype))
    c = torch.exp(ref - lse_rows.to(ref.dtype))
    c = torch.where(ref == float("-inf"), torch.zeros_like(c), c)
    c = c.transpose(0, 1) if spec.packed else c
    return dout * c.unsqueeze(-1).to(dout.dtype)


def _ring_flash_bwd(spec: _RingSpec, dout, q, k, v, out, lse, block_lse):
    """dq, dk, dv of ring flash attention (_ring_grads), each block against its own lse."""
    lq, lk = q.shape[spec.row_dim], k.shape[spec.row_dim]
    block_lse = iter(block_lse)

    def block_grads(call, k_shard, v_shard):
        qr, kr, wl, wr, cu_q, cu_k = call
        lse_b = next(block_lse)
        dout_b = _block_grad_out(spec, _rows(dout, spec.row_dim, qr), lse_b,
                                 _rows(lse, spec.lse_dim, qr))
        dq_b, dk_b, dv_b, _, _ = ops.flash_bwd(
            dout_b, _rows(q, spec.row_dim, qr), _rows(k_shard, spec.row_dim, kr),
            _rows(v_shard, spec.row_dim, kr), _rows(out, spec.row_dim, qr), lse_b, None,
            spec.scale, *_mask(wl, wr), spec.deterministic, cu_q, cu_k, spec.softcap)
        return dq_b, dk_b, dv_b

    return _ring_grads(spec, q, k, v, lambda src: spec.plan(src, lq, lk), block_grads)


def _ring_grads(spec: _RingSpec, q, k, v, calls_of, block_grads):
    """dq, dk, dv: the key/value shards travel as in the forward; each shard's dk/dv partial
    sums travel with it and reach their owner after the last step. ``calls_of(src)`` lists the
    block calls against rank ``src``'s shard (query rows and key rows first),
    ``block_grads(call, k_shard, v_shard)`` returns their ``(dq, dk, dv)``."""
    ring = _Ring(spec.group, q.device)
    acc_t = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc_t, device=q.device)
    kv = (k, v)
    pending_dkv = None

    def partial_sums():
        """The received dk/dv partial sums of the shard in hand (fp32; zeros at step 0): the
        block gradients are added into them in place, no buffer of their own."""
        if pending_dkv is None:
            return (torch.zeros(k.shape, dtype=acc_t, device=k.device),
                    torch.zeros(v.shape, dtype=acc_t, device=v.device))
        return tuple(ring.wait(pending_dkv))

    for step in range(spec.world):
        src = (spec.rank - step) % spec.world
        pending_kv = ring.start(kv) if step < spec.world - 1 else None
        dk = dv = None
        for call in calls_of(src):
            qr, kr = call[0], call[1]
            dq_b, dk_b, dv_b = block_grads(call, kv[0], kv[1])
            _rows(dq, spec.row_dim, qr).add_(dq_b)
            if dk is None:  # after the first block's compute, which hid the transfer
                dk, dv = partial_sums()
            _rows(dk, spec.row_dim, kr).add_(dk_b)
            _rows(dv, spec.row_dim, kr).add_(dv_b)
            del dq_b, dk_b, dv_b
        if dk is None:
            dk, dv = partial_sums()
        if spec.world > 1:
            if step == spec.world - 1:
                # complete sums on their way to their owner, who would round them to the
                # input dtype on arrival: round before sending (half the bytes if bf16/fp16)
                dk, dv = dk.to(k.dtype), dv.to(v.dtype)
            pending_dkv = ring.start((dk, dv), tag=2)
            dk = dv = None
        if pending_kv is not None:
            kv = tuple(ring.wait(pending_kv))
    if pending_dkv is not None:
        dk, dv = ring.wait(pending_dkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _as_out_rows(spec: _RingSpec, x: torch.Tensor) -> torch.Tensor:
    """A per-(head, row) tensor in lse's layout (dense ``[B, Hq, L]``, packed ``[Hq, T]``)
    shaped to broadcast against out (dense ``[B, Hq, L, 1]``, packed ``[T, Hq, 1]``)."""
    return x.unsqueeze(-1) if not spec.packed else x.transpose(0, 1).unsqueeze(-1)


def _add_sinks(spec: _RingSpec, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """(out, lse) of the rows with each head's sink logit joining their denominators: the sink
    is one more key, of value zero, so it only rescales the merged rows."""
    sink = sinks.view(1, -1, 1) if not spec.packed else sinks.view(-1, 1)
    with_sink = torch.logaddexp(lse, sink)
    out = out * _as_out_rows(spec, torch.exp(lse - with_sink)).to(out.dtype)
    return out, with_sink


class _RingFlashFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, spec):
        if len(spec.heads) == 1:
            out, lse, block_lse = _ring_flash_fwd(spec, q, k, v)
            counts = [len(block_lse)]
        else:
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
            lse = q.new_empty((q.shape[1], q.shape[0]) if spec.packed else q.shape[:3],
                              dtype=torch.float32)
            block_lse, counts = [], []
            for qh, kh in spec.heads:
                out_g, lse_g, block_g = _ring_flash_fwd(spec, q[:, qh], k[:, kh], v[:, kh])
                out[:, qh] = out_g
                _lse_heads(spec, lse, qh).copy_(lse_g)
                block_lse += block_g
                counts.append(len(block_g))
        if sinks is not None:
            out, lse = _add_sinks(spec, out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks, *block_lse)
        ctx.spec = spec
        ctx.counts = counts
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks, *block_lse = ctx.saved_tensors
        if dout is None:
            return None, None, None, None, None
        spec = ctx.spec
        # With the sinks in lse and out, the blocks' gradients are the plain ones: the sink is
        # a key of value zero, which adds nothing to dq, dk or dv.
        if len(spec.heads) == 1:
            dq, dk, dv = _ring_flash_bwd(spec, dout, q, k, v, out, lse, block_lse)
        else:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            first = 0
            for (qh, kh), count in zip(spec.heads, ctx.counts):
                dq[:, qh], dk[:, kh], dv[:, kh] = _ring_flash_bwd(
                    spec, dout[:, qh], q[:, qh], k[:, kh], v[:, kh], out[:, qh],
                    _lse_heads(spec, lse, qh), block_lse[first:first + count])
                first += count
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # d sinks[h] = -sum_i exp(sinks[h] - lse_i) dO_i.o_i over this rank's rows: the
            # rank's share, as every replicated parameter's gradient under context parallelism
            # (the data-parallel reduction over the group sums the shares).
            delta = (dout.float() * out.float()).sum(-1)
            if spec.packed:
                delta = delta.transpose(0, 1)
            sink = sinks.view(1, -1, 1) if not spec.packed else sinks.view(-1, 1)
            share = -(torch.exp(sink - lse) * delta)
            dsinks = share.sum(dim=(0, 2)) if not spec.packed else share.sum(dim=1)
        return dq, dk, dv, dsinks, None


# ---- ring lazy ---------------------------------------------------------------------------------
# Lazy attention's weights a_ij = max(0, p_ij + tau_h / (i + 1)) need each row's global lse and
# are not renormalised, so the ring runs twice: lse of every block (K travels), merged; then each
# block's share of the output against the merged lse (K and V travel), summed. The backward
# likewise: the row terms Delta_i and G_i (sums over the row's keys), then the gradients of every
# block against the summed row terms. Every block call is a chunk pair with its own positions.

def _lazy_plan(rank: int, src: int, world: int, layout: str, chunk: int):
    """[(query rows, key rows, q_position, k_position)] of this rank's shard against rank
    ``src``'s: every causal pair of chunks (the bias reaches any distance, so no pair is
    skipped but those above the diagonal)."""
    calls = []
    for qi, qc in enumerate(_chunk_ids(rank, world, layout)):
        for ki, kc in enumerate(_chunk_ids(src, world, layout)):
            if kc <= qc:
                calls.append((slice(qi * chunk, (qi + 1) * chunk),
                              slice(ki * chunk, (ki + 1) * chunk), qc * chunk, kc * chunk))
    return calls


def _ring_lazy_fwd(spec: _RingSpec, q, k, v, tau, bias):
    ring = _Ring(spec.group, q.device)
    acc_t = _acc_dtype(q.dtype)
    lse = q.new_full(q.shape[:3], float("-inf"), dtype=acc_t)
    shard = k
    for step in range(spec.world):
        src = (spec.rank - step) % spec.world
        pending = ring.start((shard,)) if step < spec.world - 1 else None
        for qr, kr, q_pos, k_pos in spec.plan(src):
            lse_b = ops.lazy_block_lse(q[:, :, qr], shard[:, :, kr], tau, bias, spec.scale, q_pos,
                                       k_pos)
            lse[:, :, qr] = torch.logaddexp(lse[:, :, qr], lse_b.to(acc_t))
        if pending is not None:
            shard = ring.wait(pending)[0]
    lse32 = lse.to(torch.float32)
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=acc_t, device=q.device)
    kv = (k, v)
    for step in range(spec.world):
        src = (spec.rank - step) % spec.world
        pending = ring.start(kv) if step < spec.world - 1 else None
        for qr, kr, q_pos, k_pos in spec.plan(src):
            out[:, :, qr] += ops.lazy_block_out(q[:, :, qr], kv[0][:, :, kr], kv[1][:, :, kr], tau,
                                                bias, lse32[:, :, qr].contiguous(), spec.scale,
                                                q_pos, k_pos)
        if pending is not None:
            kv = tuple(ring.wait(pending))
    return out.to(q.dtype), lse32


def _ring_lazy_bwd(spec: _RingSpec, dout, q, k, v, tau, bias, lse, bias_grad: bool):
    """dq, dk, dv and this rank's shares of dtau, dbias."""
    ring = _Ring(spec.group, q.device)
    acc_t = _acc_dtype(q.dtype)
    delta = torch.zeros(lse.shape, dtype=acc_t, device=q.device)
    row_g = torch.zeros(lse.shape, dtype=acc_t, device=q.device)
    kv = (k, v)
    for step in range(spec.world):
        src = (spec.rank - step) % spec.world
        pending = ring.start(kv) if step < spec.world - 1 else None
        for qr, kr, q_pos, k_pos in spec.plan(src):
            d_b, g_b = ops.lazy_block_row_terms(dout[:, :, qr], q[:, :, qr], kv[0][:, :, kr],
                                                kv[1][:, :, kr], tau, bias,
                                                lse[:, :, qr].contiguous(), spec.scale, q_pos,
                                                k_pos)
            delta[:, :, qr] += d_b
            row_g[:, :, qr] += g_b
        if pending is not None:
            kv = tuple(ring.wait(pending))
    delta32 = delta.to(torch.float32)
    dbias = torch.zeros_like(bias)

    def block_grads(call, k_shard, v_shard):
        qr, kr, q_pos, k_pos = call
        dq_b, dk_b, dv_b, dbias_b = ops.lazy_block_bwd(
            dout[:, :, qr], q[:, :, qr], k_shard[:, :, kr], v_shard[:, :, kr], tau, bias,
            lse[:, :, qr].contiguous(), delta32[:, :, qr].contiguous(), spec.scale, q_pos, k_pos,
            bias_grad)
        if bias_grad:
            dbias.add_(dbias_b)
        return dq_b, dk_b, dv_b

    dq, dk, dv = _ring_grads(spec, q, k, v, spec.plan, block_grads)
    # dtau_h = sum_i G_i / (i + 1): row_g holds the terms (each block's already divided).
    dtau = row_g.sum(dim=(0, 2)).to(torch.float32)
    return dq, dk, dv, dtau, dbias


class _LazyRingSpec(_RingSpec):
    """A _RingSpec (dense, causal) whose plan is _lazy_plan's chunk pairs."""

    def __init__(self, group, world, rank, layout, scale, chunk):
        super().__init__(group, world, rank, layout, True, scale, 0.0, False, False, chunk=chunk)

    def plan(self, src: int, *_):
        return _lazy_plan(self.rank, src, self.world, self.layout, self.chunk)


class _RingLazyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tau, bias, spec):
        if len(spec.heads) == 1:
            out, lse = _ring_lazy_fwd(spec, q, k, v, tau, bias)
        else:
            out = torch.empty_like(q)
            lse = q.new_empty(q.shape[:3], dtype=torch.float32)
            for qh, kh in spec.heads:
                out[:, qh], lse[:, qh] = _ring_lazy_fwd(spec, q[:, qh], k[:, kh], v[:, kh],
                                                        tau[qh], bias[qh])
        ctx.save_for_backward(q, k, v, tau, bias, lse)
        ctx.spec = spec
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, tau, bias, lse = ctx.saved_tensors
        if dout is None:
            return None, None, None, None, None, None
        spec, bias_grad = ctx.spec, ctx.needs_input_grad[4]
        dout = dout.contiguous()
        if len(spec.heads) == 1:
            dq, dk, dv, dtau, dbias = _ring_lazy_bwd(spec, dout, q, k, v, tau, bias, lse,
                                                     bias_grad)
        else:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            dtau, dbias = torch.empty_like(tau), torch.empty_like(bias)
            for qh, kh in spec.heads:
                dq[:, qh], dk[:, kh], dv[:, kh], dtau[qh], dbias[qh] = _ring_lazy_bwd(
                    spec, dout[:, qh], q[:, qh], k[:, kh], v[:, kh], tau[qh], bias[qh],
                    lse[:, qh], bias_grad)
        return (dq, dk, dv, dtau if ctx.needs_input_grad[3] else None,
                dbias if bias_grad else None, None)


def ring_lazy_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tau: torch.Tensor,
                   bias: torch.Tensor, *, group=None, layout: str = "zigzag",
                   softmax_scale: Optional[float] = None, return_lse: bool = False,
                   head_chunks: Optional[int] = None):
    """Lazy attention over a sequence sharded across a process group (two ring passes).

    Every rank of ``group`` calls this with its shard (:func:`shard_sequence` with the same
    ``layout``, ``dim=2``) of the same-length q/k/v; the result is this rank's shard of
    :func:`adaattn.lazy_attn` on the full sequence (positions, causal mask, bias distances and
    ``tau / (i + 1)`` all global), and so are the gradients.

    Args:
        q: ``[B, Hq, L / W, D]``, this rank's query shard (any strides, contiguous last dim).
        k: ``[B, Hkv, L / W, D]``, ``Hq % Hkv == 0`` (GQA).
        v: ``[B, Hkv, L / W, D]``.
        tau: float32 ``[Hq]``; bias: float32 ``[Hq, W]``, replicated on every rank (``W`` may
            exceed a shard). Their gradients on each rank are that rank's rows' shares: sum
            them over the group as the other replicated parameters'.
        group: the process group (default: the world).
        layout: ``"zigzag"`` (balanced) or ``"contiguous"``.
        softmax_scale: as in :func:`adaattn.lazy_attn`.
        return_lse: also return the float32 ``lse [B, Hq, L / W]`` of the biased scores.
        head_chunks: run the heads in this many groups, one ring each (a divisor of the kv
            heads), so that the ring's buffers beyond the single-GPU op hold one group's heads;
            ``None`` picks it: on CUDA up to 8 groups while each keeps the GPU busy (at least
            2 waves of 128-row tiles), else 1 (docs/context_parallel.md, memory).

    Returns:
        ``out [B, Hq, L / W, D]``, and ``lse`` when ``return_lse``.

    Forward: the keys travel once for the lse and the keys and values once for the weights
    (docs/context_parallel.md); the backward makes two rounds of keys and values, the second
    carrying the dk/dv partial sums. Every rank must call it; gloo on CPU tensors, NCCL on CUDA.
    """
    op = "ring_lazy_attn"
    C.tensors(op, q=q, k=k, v=v, tau=tau, bias=bias)
    layout = _layout(op, layout)
    world, rank = _group(op, group)
    return_lse = C.boolean(op, "return_lse", return_lse)
    scale = C.optional_float(op, "softmax_scale", softmax_scale)
    C.check_lazy_inputs(op, q, k, v, tau, bias, None, None, scale)
    C.check(q.shape[2] == k.shape[2], ValueError, op,
            "q and k shards must have the same length (self-attention), got ", q.shape[2],
            " and ", k.shape[2])
    per_rank = len(_chunk_ids(rank, world, layout))
    C.check(q.shape[2] % per_rank == 0, ValueError, op,
            "a zigzag shard holds two equal chunks: q.size(2) must be even, got ", q.shape[2])
    spec = _LazyRingSpec(group, world, rank, layout, scale, q.shape[2] // per_rank)
    spec.heads = _head_groups(op, head_chunks, q, q.shape[1], k.shape[1], q.shape[2], q.shape[0])
    out, lse = _RingLazyFunction.apply(q, k, v, tau, bias, spec)
    return (out, lse) if return_lse else out


def _ring_options(op, q, k, v, causal, window, softmax_scale, softcap, deterministic, return_lse,
                  packed, cu=None):
    causal = C.boolean(op, "causal", causal)
    return_lse = C.boolean(op, "return_lse", return_lse)
    deterministic = C.boolean(op, "deterministic", deterministic)
    left, right = C.window_pair(op, window)
    C.check(not packed or (left, right) == (-1, -1), ValueError, op, "window must be (-1, -1): "
            "sliding windows over packed sequences are not supported, got ", repr(tuple(window)))
    scale = C.optional_float(op, "softmax_scale", softmax_scale)
    softcap = C.softcap_value(op, softcap)
    C.check_flash_inputs(op, q, k, v, None, cu, cu, ("cu_seqlens", "cu_seqlens"))
    C.check_flash_options(op, scale, -1, -1, softcap)
    dim = 0 if packed else 2
    C.check(q.shape[dim] == k.shape[dim], ValueError, op,
            "q and k shards must have the same length (self-attention), got ", q.shape[dim],
            " and ", k.shape[dim])
    return causal, return_lse, deterministic, scale, softcap, (left, right)


def ring_flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
                    layout: str = "zigzag", causal: bool = False, window=(-1, -1),
                    softmax_scale: Optional[float] = None, softcap: float = 0,
                    sinks: Optional[torch.Tensor] = None, deterministic: bool = False,
                    return_lse: bool = False, head_chunks: Optional[int] = None):
    """Flash attention over a sequence sharded across a process group (ring attention).

    Every rank of ``group`` calls this with its shard (:func:`shard_sequence` with the same
    ``layout``, ``dim=2``) of the same-length self-attention q/k/v; the result is this rank's
    shard of ``flash_attn`` on the full sequence, and so are the gradients.

    Args:
        q: ``[B, Hq, L / W, D]``, this rank's query shard (any strides, contiguous last dim).
        k: ``[B, Hkv, L / W, D]``, ``Hq % Hkv == 0`` (GQA).
        v: ``[B, Hkv, L / W, Dv]``.
        group: the process group (default: the world).
        layout: ``"zigzag"`` (balanced under ``causal``) or ``"contiguous"``.
        causal: causal mask on the full sequence's positions.
        window: ``(left, right)`` sliding window on the full sequence's positions, as in
            :func:`adaattn.flash_attn` (with ``causal``, ``right`` is 0); windowed rings call
            the op per pair of chunks, clipped to the rows and keys the window reaches.
        softmax_scale, softcap, deterministic: as in :func:`adaattn.flash_attn`.
        sinks: float32 ``[Hq]`` attention sinks, as in :func:`adaattn.flash_attn`, joined to
            the merged rows (the blocks run without them). Their gradient on each rank is that
            rank's rows' share: sum it over the group as the other replicated parameters'.
        return_lse: also return the float32 ``lse [B, Hq, L / W]`` of the full rows.
        head_chunks: run the heads in this many groups, one ring each (a divisor of the kv
            heads), so that the ring's buffers beyond the single-GPU op hold one group's heads;
            ``None`` picks it: on CUDA up to 8 groups while each keeps the GPU busy (at least
            2 waves of 128-row tiles), else 1 (docs/context_parallel.md, memory).

    Returns:
        ``out [B, Hq, L / W, Dv]``, and ``lse`` when ``return_lse``.

    Every rank must call it (it communicates); with gloo on CPU tensors, NCCL on CUDA.
    """
    op = "ring_flash_attn"
    C.tensors(op, q=q, k=k, v=v)
    C.optional_tensors(op, sinks=sinks)
    layout = _layout(op, layout)
    world, rank = _group(op, group)
    causal, return_lse, deterministic, scale, softcap, window = _ring_options(
        op, q, k, v, causal, window, softmax_scale, softcap, deterministic, return_lse, False)
    C.check_score_tensors(op, q, q.shape[0], None, sinks, None)
    C.check(layout == "contiguous" or q.shape[2] % 2 == 0, ValueError, op,
            "a zigzag shard holds two equal chunks: q.size(2) must be even, got ", q.shape[2])
    spec = _RingSpec(group, world, rank, layout, causal, scale, softcap, deterministic, False,
                     window=window)
    spec.heads = _head_groups(op, head_chunks, q, q.shape[1], k.shape[1], q.shape[2], q.shape[0])
    out, lse = _RingFlashFunction.apply(q, k, v, sinks, spec)
    return (out, lse) if return_lse else out


def ring_flash_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens: torch.Tensor, *, group=None, layout: str = "zigzag",
                           causal: bool = False, window=(-1, -1),
                           softmax_scale: Optional[float] = None, softcap: float = 0,
                           sinks: Optional[torch.Tensor] = None, deterministic: bool = False,
                           return_lse: bool = False, head_chunks: Optional[int] = None):
    """Ring flash attention over packed sequences whose token dim is sharded across the group.

    The packed token dim (``T`` tokens of all sequences, total) is sharded like a sequence
    (:func:`shard_sequence` with ``dim=0``); sequences may cross shard (and chunk) boundaries.

    Args:
        q: ``[T / W, Hq, D]``, this rank's shard of the packed queries.
        k: ``[T / W, Hkv, D]``; v: ``[T / W, Hkv, Dv]``.
        cu_seqlens: int32 ``[N + 1]``, the GLOBAL cumulative lengths (0, ..., ``T``), the same
            on every rank, on q's device (self-attention: queries and keys share it).
        group, layout, causal, softmax_scale, softcap, sinks, deterministic, head_chunks: as
            :func:`ring_flash_attn`.
        window: only ``(-1, -1)`` (no sliding window over packed shards).
        return_lse: also return the float32 ``lse [Hq, T / W]``.

    Returns:
        ``out [T / W, Hq, Dv]``, and ``lse`` when ``return_lse``.
    """
    op = "ring_flash_attn_varlen"
    C.tensors(op, q=q, k=k, v=v, cu_seqlens=cu_seqlens)
    C.optional_tensors(op, sinks=sinks)
    layout = _layout(op, layout)
    world, rank = _group(op, group)
    causal, return_lse, deterministic, scale, softcap, _ = _ring_options(
        op, q, k, v, causal, window, softmax_scale, softcap, deterministic, return_lse, True,
        cu_seqlens)
    C.check_score_tensors(op, q, cu_seqlens.shape[0] - 1, None, sinks, None)
    per_rank = len(_chunk_ids(rank, world, layout))
    C.check(q.shape[0] % per_rank == 0, ValueError, op,
            "a zigzag shard holds two equal chunks: q.size(0) must be even, got ", q.shape[0])
    spec = _RingSpec(group, world, rank, layout, causal, scale, softcap, deterministic, True,
                     cu_seqlens, q.shape[0] // per_rank)
    spec.heads = _head_groups(op, head_chunks, q, q.shape[1], k.shape[1], q.shape[0], 1)
    out, lse = _RingFlashFunction.apply(q, k, v, sinks, spec)
    return (out, lse) if return_lse else out
