"""A paged key/value cache for one attention layer, in the layout of the decode ops
(:func:`adaattn.flash_attn_with_kvcache`, :func:`adaattn.lazy_attn_with_kvcache`), and its
low-rank variant that stores projected keys (:func:`adaattn.low_rank_attn_with_kvcache`)."""
from typing import List, Optional, Sequence

import torch

from . import _checks as C
from .precision import _FORMAT_MAX, _round


class KVCache:
    """Fixed pools of key and value pages plus a block table, with a host-side page allocator.

    Storage: ``k_pages [num_pages, Hkv, page_size, D]`` and ``v_pages [num_pages, Hkv, page_size,
    Dv]``. Sequences live in the ``max_batch`` rows of ``block_table`` (int32 ``[max_batch,
    max_pages_per_seq]``): key position j of sequence s is slot ``j % page_size`` of page
    ``block_table[s, j // page_size]``, and ``seqlens`` (int32 ``[max_batch]``) holds how many
    positions each sequence has. Entries past a sequence's pages are 0 (a valid page that the
    ops never read for it); free rows have length 0. The allocator's state (free pages, each
    sequence's pages and length) stays on the host, so no call reads the device.

    A decode step writes its new keys inside the attention op::

        ids = [0, 2]                                   # the sequences of this step
        cache.reserve(ids, lq)                         # pages for lq more positions
        out = adaattn.flash_attn_with_kvcache(
            q, cache.k_pages, cache.v_pages, k, v,     # k, v [len(ids), Hkv, lq, D]
            cache_seqlens=cache.seqlens[ids], block_table=cache.block_table[ids])
        cache.advance(ids, lq)                         # the op does not advance the lengths

    and :meth:`append` writes keys without attending (prefill). Page contents past a
    sequence's length are unspecified (the pools are allocated with ``torch.empty``).

    ``dtype=torch.float8_e4m3fn`` makes an 8-bit cache (half the bytes a decode step reads):
    ``k_scale``/``v_scale`` (float32 ``[num_pages, Hkv]``) hold a scale per page and kv head,
    and a cached value means value * scale. :meth:`append` quantises (round to nearest e4m3,
    scale = the page's largest magnitude / 448 so far; when new tokens raise it, the page's
    earlier tokens are re-rounded at the new scale; a NaN or infinite value makes its page's
    scale, and so the whole page of that kv head, non-finite), and the ops read the cache with
    the scales, without appending themselves::

        cache.append(ids, k, v)                        # quantises k, v [len(ids), Hkv, lq, D]
        out = adaattn.flash_attn_with_kvcache(
            q, cache.k_pages, cache.v_pages, cache_seqlens=cache.seqlens[ids],
            block_table=cache.block_table[ids], k_scale=cache.k_scale, v_scale=cache.v_scale)

    Args:
        num_pages: pages in each pool.
        page_size: positions per page.
        heads_kv: ``Hkv``.
        head_dim: ``D``; ``head_dim_v`` is ``Dv`` (defaults to ``D``).
        max_batch: rows of the block table (sequences alive at once).
        max_pages_per_seq: columns of the block table (a sequence holds at most
            ``max_pages_per_seq * page_size`` positions).
        dtype, device: of the pools (``torch.float8_e4m3fn``: an 8-bit cache, above).
    """

    def __init__(self, num_pages: int, page_size: int, heads_kv: int, head_dim: int,
                 head_dim_v: Optional[int] = None, *, max_batch: int, max_pages_per_seq: int,
                 dtype: torch.dtype = torch.float32, device=None):
        for name, value in (("num_pages", num_pages), ("page_size", page_size),
                            ("heads_kv", heads_kv), ("head_dim", head_dim),
                            ("max_batch", max_batch), ("max_pages_per_seq", max_pages_per_seq)):
            C.integer("KVCache", name, value)
            C.check(value >= 1, ValueError, "KVCache", name, " must be positive, got ", value)
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.page_size = page_size
        self.k_pages = torch.empty(num_pages, heads_kv, page_size, head_dim, dtype=dtype,
                                   device=device)
        self.v_pages = torch.empty(num_pages, heads_kv, page_size, head_dim_v, dtype=dtype,
                                   device=device)
        self._block_table = torch.zeros(max_batch, max_pages_per_seq, dtype=torch.int32,
                                        device=device)
        self._k_scale = self._v_scale = None
        if dtype == torch.float8_e4m3fn:
            self._k_scale = torch.zeros(num_pages, heads_kv, dtype=torch.float32, device=device)
            self._v_scale = torch.zeros(num_pages, heads_kv, dtype=torch.float32, device=device)
        self._seqlens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        # Popped from the end: the lowest page ids are handed out first.
        self._free_pages: List[int] = list(range(num_pages - 1, -1, -1))
        self._pages: List[Optional[List[int]]] = [None] * max_batch  # None: a free row
        self._lengths = [0] * max_batch

    @property
    def block_table(self) -> torch.Tensor:
        """int32 ``[max_batch, max_pages_per_seq]``: the pages of every row (index it with the
        step's sequence ids for the ops' ``block_table``)."""
        return self._block_table

    @property
    def k_scale(self) -> Optional[torch.Tensor]:
        """float32 ``[num_pages, Hkv]``: the key pages' scales of an 8-bit cache, else None."""
        return self._k_scale

    @property
    def v_scale(self) -> Optional[torch.Tensor]:
        """float32 ``[num_pages, Hkv]``: the value pages' scales of an 8-bit cache, else None."""
        return self._v_scale

    @property
    def seqlens(self) -> torch.Tensor:
        """int32 ``[max_batch]``: positions held by each row (the ops' ``cache_seqlens``)."""
        return self._seqlens

    @property
    def num_free_pages(self) -> int:
        """Pages in the pool that no sequence holds."""
        return len(self._free_pages)

    def length(self, seq_id: int) -> int:
        """Positions held by sequence ``seq_id`` (host value)."""
        self._check_alive(seq_id)
        return self._lengths[seq_id]

    def allocate(self, seq_id: Optional[int] = None) -> int:
        """Claims a free row (the first one, or ``seq_id``) for a new, empty sequence; returns
        its id."""
        if seq_id is None:
            seq_id = next((s for s, pages in enumerate(self._pages) if pages is None), None)
            if seq_id is None:
                raise RuntimeError(
                    f"adaattn.KVCache: all {len(self._pages)} rows (max_batch) are in use")
        elif not 0 <= seq_id < len(self._pages):
            raise ValueError(
                f"adaattn.KVCache: seq_id must be in [0, {len(self._pages)}), got {seq_id}")
        elif self._pages[seq_id] is not None:
            raise RuntimeError(f"adaattn.KVCache: row {seq_id} is in use")
        self._pages[seq_id] = []
        self._lengths[seq_id] = 0
        return seq_id

    def free(self, seq_id: int) -> None:
        """Returns the sequence's pages to the pool and its row to the free rows."""
        self._check_alive(seq_id)
        self._free_pages.extend(reversed(self._pages[seq_id]))
        self._pages[seq_id] = None
        self._lengths[seq_id] = 0
        self._block_table[seq_id].zero_()
        self._seqlens[seq_id] = 0

    def reserve(self, seq_ids: Sequence[int], num_tokens: int) -> None:
        """Gives every sequence of ``seq_ids`` the pages for ``num_tokens`` positions past its
        length (``block_table`` updated, lengths unchanged). Raises ``RuntimeError`` when the
        pool or a block-table row would run out; nothing is allocated then."""
        needs = []
        for seq_id in seq_ids:
            self._check_alive(seq_id)
            total = -(-(self._lengths[seq_id] + num_tokens) // self.page_size)
            if total > self._block_table.shape[1]:
                raise RuntimeError(
                    f"adaattn.KVCache: sequence {seq_id} would need {total} pages for "
                    f"{self._lengths[seq_id] + num_tokens} positions, more than "
                    f"max_pages_per_seq = {self._block_table.shape[1]}")
            needs.append((seq_id, total - len(self._pages[seq_id])))
        missing = sum(max(n, 0) for _, n in needs)
        if missing > len(self._free_pages):
            raise RuntimeError(
                f"adaattn.KVCache: {missing} pages needed, {len(self._free_pages)} free")
        for seq_id, count in needs:
            if count <= 0:
                continue
            pages = self._pages[seq_id]
            start = len(pages)
            pages.extend(self._free_pages.pop() for _ in range(count))
            new_pages = torch.tensor(pages[start:], dtype=torch.int32,
                                     device=self._block_table.device)
            self._block_table[seq_id, start:len(pages)] = new_pages
            if self._k_scale is not None:  # a reused page's scale starts again from its tokens
                self._k_scale[new_pages.long()] = 0
                self._v_scale[new_pages.long()] = 0

    def advance(self, seq_ids: Sequence[int], num_tokens: int) -> None:
        """Adds ``num_tokens`` to the lengths of ``seq_ids``, whose pages must be reserved
        (after an op wrote their keys at the old lengths)."""
        for seq_id in seq_ids:
            self._check_alive(seq_id)
            length = self._lengths[seq_id] + num_tokens
            if length > len(self._pages[seq_id]) * self.page_size:
                raise RuntimeError(f"adaattn.KVCache: sequence {seq_id} has no pages reserved for "
                                   f"{length} positions; call reserve first")
            self._lengths[seq_id] = length
        self._seqlens[list(seq_ids)] = torch.tensor(
            [self._lengths[s] for s in seq_ids], dtype=torch.int32, device=self._seqlens.device)

    def append(self, seq_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes ``k [len(seq_ids), Hkv, L, D]`` and ``v [len(seq_ids), Hkv, L, Dv]`` at the
        sequences' next L positions (reserving pages) and advances their lengths: the prefill
        path, or any write without attention. One indexed copy per pool."""
        if k.dim() != 4 or k.shape[0] != len(seq_ids) or v.shape[:3] != k.shape[:3]:
            raise ValueError(f"adaattn.KVCache: k and v must be [len(seq_ids) = {len(seq_ids)}, "
                             f"Hkv, L, D], got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        self.reserve(seq_ids, k.shape[2])
        rows = torch.tensor(list(seq_ids), dtype=torch.long, device=self._seqlens.device)
        starts = torch.tensor([self._lengths[s] for s in seq_ids], dtype=torch.long,
                              device=self._seqlens.device)
        pos = starts.view(-1, 1) + torch.arange(k.shape[2], device=starts.device)  # [N, L]
        pages = self._block_table[rows].long().gather(1, pos // self.page_size)
        slots = pos % self.page_size
        # Index pairs (page, slot) select [N, L, Hkv, D] rows of the pools.
        if self._k_scale is None:
            self.k_pages[pages, :, slots] = k.transpose(1, 2).to(self.k_pages)
            self.v_pages[pages, :, slots] = v.transpose(1, 2).to(self.v_pages)
        elif k.shape[2] > 0:
            # The pages the new positions touch, from the host's page lists (no device read).
            touched = [page for s in seq_ids for page in self._pages[s][
                self._lengths[s] // self.page_size:
                (self._lengths[s] + k.shape[2] - 1) // self.page_size + 1]]
            touched = torch.tensor(touched, dtype=torch.long, device=self.k_pages.device)
            _quantize_rows(self.k_pages, self._k_scale, k, pages, slots, touched)
            _quantize_rows(self.v_pages, self._v_scale, v, pages, slots, touched)
        self.advance(seq_ids, k.shape[2])

    def fork(self, src: int, dst: Optional[int] = None) -> int:
        """Makes ``dst`` a copy of sequence ``src`` (beam search) and returns its id: a new
        sequence when ``dst`` is None, else that row (its pages are released first if it holds
        a sequence). The pages holding ``src``'s positions are copied, not shared
        (no copy-on-write), so either sequence can then grow independently."""
        self._check_alive(src)
        if dst == src:
            return dst
        if dst is not None and self._alive(dst):
            self.free(dst)
        dst = self.allocate(dst)
        self.reserve([dst], self._lengths[src])
        used = -(-self._lengths[src] // self.page_size)
        src_pages = torch.tensor(self._pages[src][:used], dtype=torch.long,
                                 device=self.k_pages.device)
        dst_pages = torch.tensor(self._pages[dst][:used], dtype=torch.long,
                                 device=self.k_pages.device)
        self.k_pages[dst_pages] = self.k_pages[src_pages]
        self.v_pages[dst_pages] = self.v_pages[src_pages]
        if self._k_scale is not None:
            self._k_scale[dst_pages] = self._k_scale[src_pages]
            self._v_scale[dst_pages] = self._v_scale[src_pages]
        self.advance([dst], self._lengths[src])
        return dst

    def _alive(self, seq_id: int) -> bool:
        return 0 <= seq_id < len(self._pages) and self._pages[seq_id] is not None

    def _check_alive(self, seq_id: int) -> None:
        if not self._alive(seq_id):
            raise ValueError(f"adaattn.KVCache: no sequence {seq_id} (allocate it first)")


def _quantize_rows(pool: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, pages: torch.Tensor,
                   slots: torch.Tensor, touched: torch.Tensor) -> None:
    """Writes ``x [N, Hkv, L, D]`` at (pages, slots) ``[N, L]`` of an e4m3 pool ``[num_pages,
    Hkv, page_size, D]`` whose ``scale [num_pages, Hkv]`` grows (for the ``touched`` pages,
    which hold every page of ``pages``) to cover the new values; a page's earlier values are
    re-rounded at its new scale."""
    rows = x.transpose(1, 2).float()  # [N, L, Hkv, D]
    heads = scale.shape[1]
    page_amax = torch.zeros_like(scale).scatter_reduce_(
        0, pages.reshape(-1, 1).expand(-1, heads), rows.abs().amax(-1).reshape(-1, heads),
        reduce="amax")
    old = scale[touched]
    # a page's scale maps its largest magnitude to e4m3's
    new = torch.maximum(old, page_amax[touched] / _FORMAT_MAX["e4m3"])
    ratio = torch.where(new > 0, old / new, torch.zeros_like(new))
    pool[touched] = _round(pool[touched].float() * ratio[:, :, None, None], "e4m3")
    scale[touched] = new
    row_scale = scale[pages]  # [N, L, Hkv]; 0 only where the rows are 0
    divisor = torch.where(row_scale > 0, row_scale, torch.ones_like(row_scale))
    pool[pages, :, slots] = _round(rows / divisor[..., None], "e4m3")


class LowRankKVCache(KVCache):
    """A :class:`KVCache` whose key pages hold the keys projected onto a per-(sequence, kv head)
    basis, ``k U`` (width R), next to full-width values, for
    :func:`adaattn.low_rank_attn_with_kvcache`.

    Storage: ``k_pages [num_pages, Hkv, page_size, R]``, ``v_pages [num_pages, Hkv, page_size,
    Dv]`` and ``basis [max_batch, Hkv, D, R]`` (the pools' dtype, float32 for 8-bit pools; row s
    is sequence s's basis). With ``dtype=torch.float8_e4m3fn`` both pools are 8-bit as
    :class:`KVCache`'s (projected keys and values quantised on append, a scale per page and kv
    head; pass ``k_scale``/``v_scale`` to the op): R + Dv bytes per cached token.
    A sequence's basis is set once, before its first keys (typically :func:`adaattn.rank_plan`
    on the prefill, whose bases are per (batch, kv head): with GQA the Gram matrix of a kv head
    sums its group's query heads, so no per-query-head basis has to be reduced). A plan of
    rank ``r < R`` is stored with ``R - r`` zero columns, which add nothing to any score. ::

        plan = adaattn.rank_plan(q, k)                 # prefill q [N, Hq, L, D], k [N, Hkv, L, D]
        cache.set_basis(ids, plan.basis)
        cache.append(ids, k, v)                        # stores k U and v
        out = adaattn.low_rank_attn(q, k, v, plan.basis, causal=True)
        ...
        cache.reserve(ids, lq)                         # a decode step
        out = adaattn.low_rank_attn_with_kvcache(
            q, cache.k_pages, cache.v_pages, cache.basis[ids], k, v,   # k at full width D
            cache_seqlens=cache.seqlens[ids], block_table=cache.block_table[ids])
        cache.advance(ids, lq)

    Args:
        num_pages, page_size, heads_kv, max_batch, max_pages_per_seq, dtype, device: as
            :class:`KVCache`.
        head_dim: ``D`` of the queries and keys before projection.
        rank: ``R``, the width of the stored keys, ``1 <= R <= D``.
        head_dim_v: ``Dv`` (defaults to ``D``).
    """

    def __init__(self, num_pages: int, page_size: int, heads_kv: int, head_dim: int, rank: int,
                 head_dim_v: Optional[int] = None, *, max_batch: int, max_pages_per_seq: int,
                 dtype: torch.dtype = torch.float32, device=None):
        for name, value in (("head_dim", head_dim), ("rank", rank)):
            C.integer("LowRankKVCache", name, value)
        C.check(1 <= rank <= head_dim, ValueError, "LowRankKVCache",
                "rank must be in [1, head_dim = ", head_dim, "], got ", rank)
        super().__init__(num_pages, page_size, heads_kv, rank,
                         head_dim if head_dim_v is None else head_dim_v, max_batch=max_batch,
                         max_pages_per_seq=max_pages_per_seq, dtype=dtype, device=device)
        self.head_dim = head_dim
        self.rank = rank
        basis_dtype = torch.float32 if dtype == torch.float8_e4m3fn else dtype
        self._basis = torch.zeros(max_batch, heads_kv, head_dim, rank, dtype=basis_dtype,
                                  device=device)
        self._has_basis = [False] * max_batch

    @property
    def basis(self) -> torch.Tensor:
        """``[max_batch, Hkv, D, R]`` in the pools' dtype (float32 for 8-bit pools): the bases of
        every row (index it with the step's sequence ids for the op's ``basis``)."""
        return self._basis

    def set_basis(self, seq_ids: Sequence[int], basis: torch.Tensor) -> None:
        """Sets the bases ``[len(seq_ids), Hkv, D, r]`` (``r <= R``; zero columns pad it to R)
        of sequences that hold no keys yet."""
        op = "LowRankKVCache.set_basis"
        C.tensor(op, "basis", basis)
        shape = (len(seq_ids), self._basis.shape[1], self.head_dim)
        C.check(basis.dim() == 4 and tuple(basis.shape[:3]) == shape
                and 1 <= basis.shape[3] <= self.rank, ValueError, op,
                f"basis must be [len(seq_ids), Hkv, D, r] = [{shape[0]}, {shape[1]}, {shape[2]}, "
                f"r] with 1 <= r <= rank = {self.rank}, got {tuple(basis.shape)}")
        C.check(basis.dtype.is_floating_point, TypeError, op, "basis must be floating, got ",
                basis.dtype)
        for seq_id in seq_ids:
            self._check_alive(seq_id)
            C.check(self._lengths[seq_id] == 0, RuntimeError, op, "sequence ", seq_id,
                    " already holds ", self._lengths[seq_id], " keys projected with its basis")
        rows = torch.tensor(list(seq_ids), dtype=torch.long, device=self._basis.device)
        self._basis[rows] = torch.nn.functional.pad(
            basis.to(self._basis), (0, self.rank - basis.shape[3]))
        for seq_id in seq_ids:
            self._has_basis[seq_id] = True

    def append(self, seq_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Projects ``k [len(seq_ids), Hkv, L, D]`` onto the sequences' bases (in the basis's
        dtype: the pools', as :func:`adaattn.low_rank_attn` projects in q's, or float32 for
        8-bit pools) and writes ``k U`` and ``v [len(seq_ids), Hkv, L, Dv]`` as
        :meth:`KVCache.append` does (quantising them into 8-bit pools)."""
        op = "LowRankKVCache.append"
        C.tensor(op, "k", k)
        if not (k.dim() == 4 and k.shape[0] == len(seq_ids) and k.shape[-1] == self.head_dim):
            C.fail(ValueError, op, f"k must be [len(seq_ids) = {len(seq_ids)}, Hkv, L, D = "
                   f"{self.head_dim}] (not projected), got {tuple(k.shape)}")
        for seq_id in seq_ids:
            self._check_alive(seq_id)
            C.check(self._has_basis[seq_id], RuntimeError, op, "sequence ", seq_id,
                    " has no basis; call set_basis first")
        rows = torch.tensor(list(seq_ids), dtype=torch.long, device=self._basis.device)
        super().append(seq_ids, torch.matmul(k.to(self._basis), self._basis[rows]), v)

    def free(self, seq_id: int) -> None:
        """As :meth:`KVCache.free`; the row's basis must be set again before its next keys."""
        super().free(seq_id)
        self._has_basis[seq_id] = False

    def fork(self, src: int, dst: Optional[int] = None) -> int:
        """As :meth:`KVCache.fork`; the copy gets a copy of ``src``'s basis row."""
        dst = super().fork(src, dst)
        if dst != src:
            self._basis[dst] = self._basis[src]
            self._has_basis[dst] = self._has_basis[src]
        return dst
