"""Block-sparse attention (docs/ops.md): a BCSR block mask and the op that visits only its
blocks."""
import math
from typing import Optional, Tuple, Union

import torch

from . import _checks as C
from ._ops import ops

# Mean listed keys per query row up to which bwd_mode="auto" takes the two-pass (dQ-pass)
# kernels; above it the atomic-dQ kernel is faster. On the H100 the two-pass was faster at 2.7
# and 5.1 listed blocks of 128 per row and the atomic one at 7.1-16.6 (docs/lab/history.md).
_TWO_PASS_MAX_KEYS_PER_ROW = 6 * 128

BLOCK_SIZES = (64, 128)
BWD_MODES = ("auto", "atomic", "two_pass")


def _block_size_pair(op, block_size, name="block_size") -> Tuple[int, int]:
    def is_int(b):
        return isinstance(b, int) and not isinstance(b, bool)

    C.check(is_int(block_size) or (isinstance(block_size, (tuple, list))
                                   and all(is_int(b) for b in block_size)),
            TypeError, op, name, " must be an int or a pair of ints (BM, BN), got ",
            repr(block_size))
    pair = (block_size, block_size) if is_int(block_size) else tuple(block_size)
    C.check(len(pair) == 2, ValueError, op, name,
            " must be an int or a pair of ints (BM, BN), got ", repr(block_size))
    C.check(all(b in BLOCK_SIZES for b in pair), ValueError, op, name,
            " entries must be 64 or 128, got ", pair)
    return pair


def _dense_to_lists(layout: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """BCSR lists of a boolean ``[Bm, Hm, R, C]`` layout: counts int32 ``[Bm, Hm, R]`` and
    indices int32 ``[Bm, Hm, R, C]`` holding each row's listed columns first, ascending (the
    unlisted columns follow, past the count). Torch ops only: no host sync."""
    counts = layout.sum(-1, dtype=torch.int32)
    order = torch.argsort((~layout).to(torch.uint8), dim=-1, stable=True)
    return counts, order.to(torch.int32)


def _lists_to_dense(counts: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Boolean ``[Bm, Hm, R, C]`` layout of BCSR lists (``C = indices.shape[-1]``). Entries past
    a row's count and out-of-range indices are dropped, as the kernels drop them."""
    cols = indices.shape[-1]
    idx = indices.long()
    listed = ((torch.arange(cols, device=idx.device) < counts.unsqueeze(-1))
              & (idx >= 0) & (idx < cols))
    # Dropped entries go to a spill column that is cut off afterwards.
    idx = torch.where(listed, idx, torch.full_like(idx, cols))
    dense = torch.zeros(*idx.shape[:-1], cols + 1, dtype=torch.bool, device=idx.device)
    return dense.scatter_(-1, idx, True)[..., :cols]


def _check_index(t, name, dims, what):
    op = "BlockSparseMask"
    C.tensor(op, name, t)
    C.check(t.dtype == torch.int32, TypeError, op, name, " must be int32, got ", t.dtype)
    C.check(t.dim() == dims, ValueError, op, name, " must have ", dims, " dims ", what,
            ", got shape ", tuple(t.shape))


class BlockSparseMask:
    """A block mask in BCSR form: which key blocks each query block attends.

    Element ``(i, j)`` (query row ``i``, key ``j``) of batch ``b`` and query head ``h`` is attended
    iff key block ``j // BN`` is among the first ``kv_num_blocks[b, h, i // BM]`` entries of
    ``kv_indices[b, h, i // BM]`` (and, when causal, ``j <= i + Lk - Lq``).

    Attributes:
        kv_num_blocks: int32 ``[B|1, H|1, nQ]``: number of key blocks listed per query block.
            A size-1 batch or head dim broadcasts over all batches / query heads.
        kv_indices: int32 ``[B|1, H|1, nQ, nKV]``: the listed key blocks, first in each row,
            distinct. ``nQ = ceil(Lq / BM)`` and ``nKV = ceil(Lk / BN)`` of the inputs it is used
            with.
        block_size: ``(BM, BN)``, each 64 or 128.
        causal: the mask is meant to be combined with the causal rule (set by ``from_flex`` for
            FlexAttention masks whose partial blocks are causal); ``block_sparse_attn`` then
            applies it whatever its own ``causal`` argument.

    The transposed index of the backward pass (``q_num_blocks [B|1, H|1, nKV]``,
    ``q_indices [B|1, H|1, nKV, nQ]``: the query blocks that list each key block) is built on
    the mask's device with torch ops (no host sync) the first time it is needed, then cached.
    So is the mean number of listed keys per query row, which picks the backward's kernels
    (see ``block_sparse_attn``); it is copied to the host asynchronously, without a sync.
    Values are checked by the op on CPU tensors, and on CUDA with ``ADAATTN_CHECK_INPUTS=1``
    (a host sync); otherwise CUDA clamps counts and skips out-of-range indices, and duplicate
    indices are the caller's responsibility.
    """

    def __init__(self, kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor,
                 block_size: Union[int, Tuple[int, int]] = 128, *, causal: bool = False):
        _check_index(kv_num_blocks, "kv_num_blocks", 3, "[B|1, H|1, nQ]")
        _check_index(kv_indices, "kv_indices", 4, "[B|1, H|1, nQ, nKV]")
        op = "BlockSparseMask"
        C.check(kv_indices.shape[:3] == kv_num_blocks.shape, ValueError, op,
                "kv_indices [B|1, H|1, nQ, nKV] must start with kv_num_blocks' shape ",
                tuple(kv_num_blocks.shape), ", got ", tuple(kv_indices.shape))
        C.check(kv_indices.device == kv_num_blocks.device, RuntimeError, op,
                "kv_indices must be on kv_num_blocks' device ", kv_num_blocks.device, ", got ",
                kv_indices.device)
        self.kv_num_blocks = kv_num_blocks
        self.kv_indices = kv_indices
        self.block_size = _block_size_pair(op, block_size)
        self.causal = C.boolean(op, "causal", causal)
        self._transposed: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self._keys_per_row: Optional[float] = None
        self._keys_probe: Optional[Tuple[torch.Tensor, torch.cuda.Event]] = None

    @classmethod
    def from_dense(cls, layout: torch.Tensor,
                   block_size: Union[int, Tuple[int, int]] = 128) -> "BlockSparseMask":
        """Mask of a boolean block layout ``[B|1, H|1, nQ, nKV]`` (True: block attended).

        ``block_size`` is ``BM = BN`` or ``(BM, BN)``, each 64 or 128. Runs on the layout's
        device without a host sync.
        """
        op = "BlockSparseMask.from_dense"
        C.tensor(op, "layout", layout)
        C.check(layout.dtype == torch.bool, TypeError, op,
                "layout must be a bool tensor [B|1, H|1, nQ, nKV], got ", layout.dtype)
        C.check(layout.dim() == 4, ValueError, op,
                "layout must have 4 dims [B|1, H|1, nQ, nKV], got shape ", tuple(layout.shape))
        counts, indices = _dense_to_lists(layout)
        return cls(counts, indices, block_size)

    @classmethod
    def from_flex(cls, block_mask) -> "BlockSparseMask":
        """Exact conversion of a FlexAttention ``BlockMask`` (``create_block_mask``).

        Full blocks are kept. Each partial block's ``mask_mod`` is evaluated densely (on the
        block's in-range elements, with ``torch.vmap``) and must be all True (kept), all False
        (dropped), or, for every partial block at once, exactly the bottom-right aligned causal
        rule ``kv_idx <= q_idx + Lk - Lq`` (kept; the returned mask has ``causal=True``, and
        every full block must then lie inside the causal region). Otherwise the conversion would
        not be exact and a ``ValueError`` names the first offending block. Note FlexAttention's
        usual ``q_idx >= kv_idx`` is top-left aligned: it matches the causal rule only when
        ``Lq == Lk``. Reads the mask on the host (a one-off conversion, not for compiled code).

        Returns a mask of the BlockMask's shape ``[B|1, H|1, nQ, nKV]`` and block size.
        """
        from torch.nn.attention.flex_attention import BlockMask

        op = "BlockSparseMask.from_flex"
        C.check(isinstance(block_mask, BlockMask), TypeError, op,
                "block_mask must be a torch.nn.attention.flex_attention.BlockMask, got ",
                C.type_name(block_mask))
        bm, bn = _block_size_pair(op, tuple(block_mask.BLOCK_SIZE), "the BlockMask's BLOCK_SIZE")
        len_q, len_k = block_mask.seq_lengths
        nq, nkv = math.ceil(len_q / bm), math.ceil(len_k / bn)
        grid = tuple(block_mask.kv_indices.shape[-2:])
        C.check(grid == (nq, nkv), ValueError, op, "the BlockMask has ", grid[0], " x ", grid[1],
                " blocks, but its seq_lengths ", (len_q, len_k), " and BLOCK_SIZE ", (bm, bn),
                " need ", nq, " x ", nkv)
        partial = _lists_to_dense(block_mask.kv_num_blocks, block_mask.kv_indices)
        full = torch.zeros_like(partial)
        if block_mask.full_kv_num_blocks is not None:
            full = _lists_to_dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
            partial = partial & ~full
        if not bool(partial.any()):
            return cls.from_dense(full, (bm, bn))
        device = partial.device
        shift = len_k - len_q

        # Every element of every partial block: coordinates [P, BM, BN].
        blocks = partial.nonzero()
        b, h = blocks[:, 0].view(-1, 1, 1), blocks[:, 1].view(-1, 1, 1)
        rows = (blocks[:, 2] * bm).view(-1, 1, 1) + torch.arange(bm, device=device).view(1, -1, 1)
        cols = (blocks[:, 3] * bn).view(-1, 1, 1) + torch.arange(bn, device=device).view(1, 1, -1)
        inside = (rows < len_q) & (cols < len_k)
        shape = torch.broadcast_shapes(b.shape, rows.shape, cols.shape)
        # Padding elements are clamped into range (mask_mods may index tensors of length L)
        # and ignored below.
        args = [t.expand(shape).reshape(-1) for t in
                (b, h, rows.clamp(max=len_q - 1), cols.clamp(max=len_k - 1))]
        allowed = torch.vmap(block_mask.mask_mod)(*args).view(shape).to(torch.bool)
        causal_rule = cols <= rows + shift

        def every(x):
            return (x | ~inside).flatten(1).all(1)

        none = every(~allowed)
        dense_ok = every(allowed) | none
        causal_ok = every(allowed == causal_rule) | none
        keep = partial.clone()
        keep[tuple(blocks.t())] = ~none
        if bool(dense_ok.all()):
            return cls.from_dense(full | keep, (bm, bn))
        # Under causal every full block must lie inside the causal region: its last key is at
        # most its first row's diagonal.
        full_blocks = full.nonzero()
        last_key = torch.clamp((full_blocks[:, 3] + 1) * bn, max=len_k) - 1
        full_ok = last_key <= full_blocks[:, 2] * bm + shift
        if bool(causal_ok.all()) and bool(full_ok.all()):
            mask = cls.from_dense(full | keep, (bm, bn))
            mask.causal = True
            return mask
        if not bool(causal_ok.all()):
            bad = blocks[~causal_ok][0].tolist()
            what = ("is neither fully attended, fully masked nor masked exactly by the causal "
                    "rule kv_idx <= q_idx + Lk - Lq")
        else:
            bad = full_blocks[~full_ok][0].tolist()
            what = ("is a full block outside the causal region, while other partial blocks "
                    "need the causal rule")
        C.fail(ValueError, op,
               f"the conversion would not be exact: block (b={bad[0]}, h={bad[1]}, query block "
               f"{bad[2]}, key block {bad[3]}) {what}; block-sparse attention supports "
               f"block-level masks, optionally combined with the bottom-right aligned causal "
               f"rule")

    def to_dense(self) -> torch.Tensor:
        """Boolean block layout ``[B|1, H|1, nQ, nKV]`` (entries past a row's count and
        out-of-range indices are not listed)."""
        return _lists_to_dense(self.kv_num_blocks, self.kv_indices)

    def transposed(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(q_num_blocks int32 [B|1, H|1, nKV], q_indices int32 [B|1, H|1, nKV, nQ])``: the
        query blocks listing each key block, ascending. Built once on the mask's device with
        torch ops (no host sync) and cached."""
        if self._transposed is None:
            self._transposed = _dense_to_lists(self.to_dense().transpose(-1, -2))
        return self._transposed

    def prefers_two_pass(self) -> bool:
        """Whether ``bwd_mode="auto"`` should take the two-pass kernels (dK/dV, then dQ without
        a float32 accumulator) rather than atomic dQ: True while rows list at most
        ``_TWO_PASS_MAX_KEYS_PER_ROW`` keys on average, and whenever that mean is not known yet.

        On CUDA the first call starts the count and a non-blocking copy of it to pinned host
        memory; a later call reads it once the copy has landed (an event query, no sync). Compiled
        code uses a count known from an eager call, else True.
        """
        if self._keys_per_row is None:
            counts = self.kv_num_blocks
            if torch.compiler.is_compiling() or not counts.is_cuda or counts.numel() == 0:
                return True
            if self._keys_probe is None:
                with torch.cuda.device(counts.device):
                    total = torch.empty((), dtype=torch.int64, pin_memory=True)
                    total.copy_(counts.sum(dtype=torch.int64), non_blocking=True)
                    landed = torch.cuda.Event()
                    landed.record()
                self._keys_probe = (total, landed)
                return True
            total, landed = self._keys_probe
            if not landed.query():
                return True
            self._keys_per_row = total.item() * self.block_size[1] / counts.numel()
            self._keys_probe = None
        return self._keys_per_row <= _TWO_PASS_MAX_KEYS_PER_ROW

    @property
    def q_num_blocks(self) -> torch.Tensor:
        """int32 ``[B|1, H|1, nKV]``, see ``transposed``."""
        return self.transposed()[0]

    @property
    def q_indices(self) -> torch.Tensor:
        """int32 ``[B|1, H|1, nKV, nQ]``, see ``transposed``."""
        return self.transposed()[1]

    @property
    def num_blocks(self) -> Tuple[int, int]:
        """``(nQ, nKV)``: query and key blocks of the layout."""
        return self.kv_indices.shape[-2], self.kv_indices.shape[-1]

    def to(self, device) -> "BlockSparseMask":
        """The mask on ``device`` (with its cached transposed index, if built)."""
        mask = BlockSparseMask(self.kv_num_blocks.to(device), self.kv_indices.to(device),
                               self.block_size, causal=self.causal)
        if self._transposed is not None:
            mask._transposed = tuple(t.to(device) for t in self._transposed)
        mask._keys_per_row = self._keys_per_row
        return mask

    def __repr__(self):
        return (f"BlockSparseMask(shape={tuple(self.kv_indices.shape)}, "
                f"block_size={self.block_size}, causal={self.causal}, "
                f"device={self.kv_indices.device})")


def _bwd_mode(bwd_mode, deterministic, block_mask: BlockSparseMask) -> str:
    """The op's ``bwd_mode``, ``"atomic"`` or ``"two_pass"``, from ``block_sparse_attn``'s
    arguments."""
    op = "block_sparse_attn"
    C.check(isinstance(bwd_mode, str), TypeError, op, "bwd_mode must be a str, got ",
            C.type_name(bwd_mode))
    C.check(bwd_mode in BWD_MODES, ValueError, op, "bwd_mode must be one of ",
            ", ".join(map(repr, BWD_MODES)), ", got ", repr(bwd_mode))
    C.check(not (bwd_mode == "atomic" and deterministic), ValueError, op,
            "deterministic=True contradicts bwd_mode='atomic' (atomic dq accumulation is not "
            "bit-reproducible); pass bwd_mode='two_pass' or 'auto'")
    if bwd_mode != "auto":
        return bwd_mode
    return "two_pass" if deterministic or block_mask.prefers_two_pass() else "atomic"


def block_sparse_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      block_mask: BlockSparseMask, *, causal: bool = False,
                      softmax_scale: Optional[float] = None, return_lse: bool = False,
                      deterministic: bool = False, bwd_mode: str = "auto", softcap: float = 0,
                      alibi_slopes: Optional[torch.Tensor] = None,
                      sinks: Optional[torch.Tensor] = None, rel_bias: Optional[torch.Tensor] = None
                      ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Softmax attention restricted to the blocks of ``block_mask``; work scales with the number
    of listed blocks, forward and backward.

    Args:
        q: ``[B, Hq, Lq, D]``; any strides with a contiguous last dim.
        k: ``[B, Hkv, Lk, D]`` with ``Hq % Hkv == 0`` (GQA/MQA: query head ``h`` reads kv head
            ``h // (Hq // Hkv)``).
        v: ``[B, Hkv, Lk, D]``.
        block_mask: a ``BlockSparseMask`` of ``ceil(Lq / BM) x ceil(Lk / BN)`` blocks, batch dim
            ``B`` or 1, head dim ``Hq`` or 1. Element ``(i, j)`` is attended iff its block
            ``(i // BM, j // BN)`` is listed (and the causal rule holds, if any).
        causal: query row ``r`` sees key ``c`` only if ``c <= r + (Lk - Lq)`` (bottom-right
            aligned), combined elementwise with the layout; also applied when
            ``block_mask.causal`` is set.
        softmax_scale: multiplies ``q @ k^T``; defaults to ``D ** -0.5``.
        return_lse: also return the float32 log-sum-exp ``[B, Hq, Lq]``.
        deterministic: ask for a bit-reproducible backward (as ``flash_attn``'s):
            ``bwd_mode="auto"`` then takes ``"two_pass"``; with ``bwd_mode="atomic"`` it is a
            contradiction (``ValueError``).
        bwd_mode: how the CUDA fp16/bf16 backward forms dq (the CPU and the float32/float64
            kernels are deterministic in every mode):

            * ``"two_pass"``: dq in a pass of its own that recomputes the scores; no atomics,
              bit-reproducible.
            * ``"atomic"``: the dK/dV kernel also adds each key tile's share of dq with float32
              atomics, whose order varies between runs (before Hopper only at ``Dv = 64``; the
              other head dims take the two passes).
            * ``"auto"``: ``"two_pass"`` when ``deterministic`` or while the mask's rows list
              at most 768 keys on average (``BlockSparseMask.prefers_two_pass``: also on a
              mask's first calls, before its count has reached the host), where it is faster;
              ``"atomic"`` above that.

            ``ADAATTN_BWD_TWO_PASS=1|0`` overrides the choice on Hopper (A/B runs).
        softcap: score soft-capping ``s <- softcap * tanh(s / softcap)`` on the scaled scores
            ``[B, Hq, Lq, Lk]`` before masking; ``0`` = off. Must be finite and ``>= 0``;
            ``lse`` is then that of the capped scores.
        alibi_slopes, sinks, rel_bias: ALiBi slopes float32 ``[Hq]`` or ``[B, Hq]``, learnable
            sinks ``[Hq]`` and relative bias ``[Hq, W]``, as in :func:`adaattn.flash_attn`
            (with sinks, a row that sees no key has ``lse = sinks[h]``).

    Returns:
        ``out [B, Hq, Lq, D]`` (dtype of q), and ``lse`` when ``return_lse``. A row that sees no
        key gives ``out = 0``, ``lse = -inf`` and zero gradients.

    Raises:
        TypeError: block_mask not a ``BlockSparseMask``, a flag that is not a bool, bwd_mode not
            a str; q, k, v not floating or not of one dtype.
        ValueError: a wrong shape or value (as :func:`flash_attn`; a mask whose block grid does
            not fit ``Lq``/``Lk``; an unknown bwd_mode or one that contradicts
            ``deterministic``; on the CPU, mask counts or indices out of range or repeated).
        RuntimeError: tensors on different devices; on CUDA fp16/bf16, blocks other than
            128 x 128 or an unsupported head dim.
        Every message starts ``adaattn.block_sparse_attn:`` and names the argument.
    """
    op = "block_sparse_attn"
    C.tensors(op, q=q, k=k, v=v)
    C.optional_tensors(op, alibi_slopes=alibi_slopes, sinks=sinks, rel_bias=rel_bias)
    C.check(isinstance(block_mask, BlockSparseMask), TypeError, op,
            "block_mask must be an adaattn.BlockSparseMask, got ", C.type_name(block_mask))
    causal = C.boolean(op, "causal", causal)
    return_lse = C.boolean(op, "return_lse", return_lse)
    deterministic = C.boolean(op, "deterministic", deterministic)
    bm, bn = block_mask.block_size
    # Eager only: dynamo cannot trace this message with symbolic lengths; compiled code gets the
    # op's own check of the same shapes (naming kv_num_blocks / kv_indices) while tracing.
    if q.dim() == 4 and k.dim() == 4 and not torch.compiler.is_compiling():
        need = (math.ceil(q.shape[2] / bm), math.ceil(k.shape[2] / bn))
        if tuple(block_mask.num_blocks) != need:
            C.fail(ValueError, op,
                   f"block_mask has {block_mask.num_blocks[0]} x {block_mask.num_blocks[1]} "
                   f"blocks of {bm}x{bn}, but Lq = {q.shape[2]} and Lk = {k.shape[2]} need "
                   f"ceil(Lq / {bm}) x ceil(Lk / {bn}) = {need[0]} x {need[1]}")
    q_num_blocks, q_indices = block_mask.transposed()
    out, lse = ops.block_sparse_attn(q, k, v, block_mask.kv_num_blocks, block_mask.kv_indices,
                                     q_num_blocks, q_indices, bm, bn,
                                     C.optional_float(op, "softmax_scale", softmax_scale),
                                     causal or block_mask.causal,
                                     _bwd_mode(bwd_mode, deterministic, block_mask),
                                     C.softcap_value(op, softcap), alibi_slopes, sinks, rel_bias)
    return (out, lse) if return_lse else out
