"""Rank planning for adaptive-rank attention (docs/ops.md): the per-(batch, kv head) subspace
that holds a given share of the query/key energy (exact or sketched), and the rigorous bound and
the sampled estimate of the error of attending inside it.

:func:`low_rank_attn` attends with scores at rank R (``adaattn::low_rank_attn``: two projection
GEMMs and the flash kernel with query/key head dim R); :func:`adaptive_rank_attn` plans and
attends in one call.
"""
import math
from typing import NamedTuple, Optional, Tuple, Union

import torch

from . import _checks as C
from .flash import flash_attn


class RankPlan(NamedTuple):
    """Result of :func:`rank_plan`.

    Attributes:
        basis: float32 ``[B, Hkv, D, R]``; the first ``ranks[b, h]`` columns of ``basis[b, h]``
            are orthonormal eigenvectors of ``G`` (largest eigenvalues first; from the sketch, an
            orthonormal basis of the kept subspace whose leading columns tend to the top
            eigenvectors), the rest are 0. ``R`` is the largest rank of the plan.
        ranks: int32 ``[B, Hkv]``.
        eigenvalues: float32 ``[B, Hkv, D]``, descending (from the sketch: the Rayleigh
            quotients ``u_j^T G u_j`` of its columns in column order, then the rest of the trace
            spread evenly).
    """

    basis: torch.Tensor
    ranks: torch.Tensor
    eigenvalues: torch.Tensor


# Largest D of torch.ops.adaattn.sym_eig (core/sym_eig.h's kSymEigMaxDim) and of
# torch.ops.adaattn.sym_gram (sym_gram_checks.h's kGramMaxDim).
_SYM_EIG_MAX_DIM = 256
_GRAM_OP_MAX_DIM = 128


def _gram(q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q^T q + k^T k`` per batch entry, ``[N, D, D]`` in ``dtype``, for q ``[N, Lq, D]`` and
    k ``[N, Lk, D]``. float16/bfloat16 inputs with a float32 result take
    ``torch.ops.adaattn.sym_gram`` (one tensor-core kernel that accumulates in float32, exactly
    symmetric) where its layout rules hold; everything else is converted and multiplied."""
    if (dtype == torch.float32 and q.dtype == k.dtype
            and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] % 8 == 0 and 8 <= q.shape[-1] <= _GRAM_OP_MAX_DIM):
        q, k = q.contiguous(), k.contiguous()
        if q.data_ptr() % 16 == 0 and k.data_ptr() % 16 == 0:
            return torch.ops.adaattn.sym_gram(q, k)

    def gram(x):
        x = x.to(dtype)
        return torch.bmm(x.mT, x)
    return gram(q) + gram(k)


# Defaults of the sketch planner: test-matrix seed, oversampling beyond the decided rank, the
# relative shift that keeps the sketched Gram matrix well conditioned.
_SKETCH_SEED = 20261126
_SKETCH_OVERSAMPLE = 8
_SKETCH_REL_SHIFT = 1e-3
# Power iterations of the sketch: 1 sharpens the nested columns on slowly decaying spectra (with
# 0, two of tests/test_rank.py's decided ranks came out one multiple above the exact rule's).
_SKETCH_POWER_ITERS = 1
# Largest D and sketch width of torch.ops.adaattn.sym_sketch_top (kSketchMaxDim, kSketchMaxWidth
# in csrc/ops/linalg/sym_sketch_checks.h).
_SKETCH_OP_MAX_DIM = 128
_SKETCH_OP_MAX_WIDTH = 64
_TEST_MATRICES = {}


def _test_matrix(dim: int, width: int, device: torch.device,
                 dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The fixed Gaussian test matrix ``[D, width]`` of the sketch planner: drawn once per
    (D, width) on the CPU in float64 from a fixed seed (then cast and copied once per dtype and
    device), so plans are deterministic and identical across devices and processes."""
    key = (dim, width, str(device), dtype)
    omega = _TEST_MATRICES.get(key)
    if omega is None:
        gen = torch.Generator().manual_seed(_SKETCH_SEED)
        omega = torch.randn(dim, width, generator=gen, dtype=torch.float64)
        omega = omega.to(device=device, dtype=dtype).contiguous()
        _TEST_MATRICES[key] = omega
    return omega


def _cholesky_qr(y: torch.Tensor) -> torch.Tensor:
    """One pass of shifted Cholesky QR: ``y [N, D, p]`` (float64) times ``R^-1`` where
    ``R^T R = y^T y + s I`` (``s`` a few float64 ulps of ``||y||_F^2``, so a rank-deficient
    ``y`` still factors). Orthonormal to ``eps * cond(y)^2``: a second pass makes it so to
    working precision when ``cond(y) < 1e7``. Keeps the columns nested (column ``j`` of the
    result lies in the span of columns ``0..j`` of ``y``). Batched GEMMs, one batched Cholesky
    and one triangular solve; no host synchronisation (``cholesky_ex`` does not check its
    info)."""
    gram = y.mT @ y
    width = y.shape[-1]
    shift = 11 * (y.shape[-2] * width + width * (width + 1)) * torch.finfo(y.dtype).eps
    diagonal = gram.diagonal(dim1=-2, dim2=-1)
    diagonal += shift * diagonal.sum(-1, keepdim=True)
    chol = torch.linalg.cholesky_ex(gram).L
    return torch.linalg.solve_triangular(chol.mT, y, upper=True, left=False)


def _sketch_width(dim: int, min_rank: int, multiple: int) -> int:
    """Columns of the sketch: half of D (rounded up to a multiple of 8), and at least room for
    ``min_rank`` rounded up to ``multiple`` plus the oversampling."""
    floor = -(-min_rank // multiple) * multiple + _SKETCH_OVERSAMPLE
    return max(-(-dim // 16) * 8, floor)


def _sketch_from_gram(gram: torch.Tensor, exact: bool, energy: float, min_rank: int,
                      multiple: int, width: int, power_iters: int):
    """Randomized subspace iteration on ``gram [B, Hkv, D, D]``: ``(values, vectors, ranks,
    summary)`` with ``values [B, Hkv, D]`` (the Rayleigh quotients ``q_j^T G q_j`` of the
    ``width`` basis columns, then the rest of the trace spread evenly), ``vectors
    [B, Hkv, D, width]`` an orthonormal basis (columns past the rank 0), ``ranks`` int32 and
    ``summary`` int32 ``[3]``: the largest rank, the heads not decided (whose rank plus the
    oversampling does not fit in the sketch, or whose G is 0: the caller must then take the
    exact solver) and the heads whose trace is not finite (exactly those whose G is not).

    The algorithm is ``torch.ops.adaattn.sym_sketch_top``'s (csrc/ops/linalg/sym_sketch.cpp):
    Y = (G + s I) Omega, ``power_iters`` times Y = (G + s I) orth(Y), Q = orth(orth(Y)) (Cholesky
    QR, which keeps the columns nested; the op's last pass runs unshifted in float32), the rank
    from the prefix sums of the Rayleigh quotients.
    By Ky Fan's maximum principle a prefix sum never exceeds the sum of as many largest
    eigenvalues, so the rank is never below the exact rule's, and the kept columns hold at
    least ``energy`` of the trace of G exactly. float32 Gram matrices (D <= 128, width <= 64)
    run the op, one kernel; float64 ones (and larger sizes) the same steps as torch ops in
    float64."""
    b, hkv, dim = gram.shape[:3]
    if not exact and dim <= _SKETCH_OP_MAX_DIM and width <= _SKETCH_OP_MAX_WIDTH:
        values, vectors, ranks, _, summary = torch.ops.adaattn.sym_sketch_top(
            gram.reshape(b * hkv, dim, dim).float().contiguous(),
            _test_matrix(dim, width, gram.device, torch.float32), energy, min_rank, multiple,
            power_iters, _SKETCH_OVERSAMPLE, _SKETCH_REL_SHIFT)
        return (values.reshape(b, hkv, dim), vectors.reshape(b, hkv, dim, width),
                ranks.reshape(b, hkv), summary)
    g = gram.reshape(b * hkv, dim, dim).double()
    trace = g.diagonal(dim1=-2, dim2=-1).sum(-1)
    shift = ((_SKETCH_REL_SHIFT / dim) * trace)[:, None, None]

    def times_shifted(x):  # (G + s I) x
        return torch.baddbmm(shift * x, g, x)

    y = times_shifted(_test_matrix(dim, width, g.device).expand(b * hkv, dim, width))
    for _ in range(power_iters):
        y = times_shifted(_cholesky_qr(y))
    basis = _cholesky_qr(_cholesky_qr(y))
    values = ((g @ basis) * basis).sum(-2).clamp(min=0)
    reached = values.cumsum(-1) >= energy * trace.unsqueeze(-1)
    first = width + 1 - reached.sum(-1)  # width + 1 where the sketch never reaches the target
    ranks = first.clamp(min=min_rank)
    ranks = (ranks + multiple - 1) // multiple * multiple
    decided = (ranks + _SKETCH_OVERSAMPLE <= width) & (trace > 0)
    ranks = ranks.clamp(max=width)
    summary = torch.stack([ranks.max(), (~decided).sum(), (~torch.isfinite(trace)).sum()])
    vectors = basis.float()
    vectors = vectors * (torch.arange(width, device=g.device) < ranks.unsqueeze(-1)).unsqueeze(-2)
    rest = ((trace - values.sum(-1)).clamp(min=0) / max(dim - width, 1)).unsqueeze(-1)
    values = torch.cat([values, rest.expand(-1, dim - width)], -1)
    return (values.float().reshape(b, hkv, dim), vectors.reshape(b, hkv, dim, width),
            ranks.to(torch.int32).reshape(b, hkv), summary.to(torch.int32))


def _check_qk(op: str, q: torch.Tensor, k: torch.Tensor) -> int:
    C.tensor(op, "q", q)
    C.tensor(op, "k", k)
    C.check(q.dim() == 4 and k.dim() == 4, ValueError, op, "q and k must be [B, H, L, D], got q ",
            tuple(q.shape), ", k ", tuple(k.shape))
    C.check(q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3], ValueError, op,
            "q and k must share B and D, got q ", tuple(q.shape), ", k ", tuple(k.shape))
    C.check(k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0, ValueError, op,
            "q's heads (", q.shape[1], ") must be a multiple of k's (", k.shape[1], ")")
    C.check(q.device == k.device, RuntimeError, op, "q and k must be on one device, got ",
            q.device, " and ", k.device)
    return q.shape[1] // k.shape[1]


@torch.no_grad()
def rank_plan(q: torch.Tensor, k: torch.Tensor, *, energy: float = 0.99, min_rank: int = 16,
              multiple: int = 16, method: str = "exact") -> RankPlan:
    """Per (batch, kv head) subspace of the queries and keys, sized by spectral energy.

    For each ``(b, g)``: ``G = K^T K + sum over the query heads h of group g of Q_h^T Q_h``
    (``D x D``, accumulated in float32: ``torch.ops.adaattn.sym_gram`` for float16/bfloat16
    q and k); the rank is the smallest ``r >= min_rank``, rounded up to a multiple of
    ``multiple`` and capped at ``D``, whose largest eigenvalues hold ``energy`` of the trace.
    Two solvers:

    * ``method="sketch"``: randomized subspace iteration on ``G`` with a fixed-seed
      Gaussian test matrix of ``max(D / 2, rank bucket + 8)`` columns, one power iteration and
      Cholesky QR (float64, the last pass float32), which keeps the columns nested; the rank
      comes from the prefix sums of the columns' Rayleigh quotients (no eigensolve). A prefix sum never exceeds the
      sum of as many largest eigenvalues (Ky Fan), so its rank is never below the exact rule's
      (on spectra with a gap, such as a planted rank plus noise, it is the same) and the
      subspace it keeps holds at least ``energy`` of the trace exactly; the basis is
      orthonormal but its columns are not eigenvectors. float32 Gram matrices (D <= 128, up to
      64 columns) run ``torch.ops.adaattn.sym_sketch_top``, one kernel; float64 ones the same
      steps as torch ops. When some head's rank plus 8 does not fit in the sketch (spread
      spectra, e.g. random full-rank inputs at energy 0.99), or ``energy = 1``, or ``D`` is
      small enough that the sketch would be ``D`` wide, the plan is the exact one (the
      sketch's cost is then spent in vain). benchmarks/bench_rank.py times both methods.
    * ``method="exact"`` (default): ``torch.ops.adaattn.sym_eig_top`` (batched tridiagonal
      eigensolver, float32, eigenvectors orthonormal to a few float32 ulps, computed for the
      first ``rank`` columns only). float64 inputs (and ``D > 256``) take ``G`` in float64 and
      ``torch.linalg.eigh`` instead.

    No gradient flows; the result is deterministic for given inputs. Reading the largest rank
    to size ``basis`` is one host synchronisation per plan (a plan is meant to be reused across
    steps, see :class:`adaattn.nn.AdaptiveRankAttention`); a sketch that falls back to the
    exact solver reads once more, and the first sketch per (D, device) copies its test matrix
    to the device. float64 inputs read once more to check finiteness first.

    Args:
        q: ``[B, Hq, Lq, D]``; k: ``[B, Hkv, Lk, D]`` with ``Hq % Hkv == 0``.
        energy: share of the trace to keep, in ``(0, 1]``; ``1.0`` keeps all ``D`` directions
            (low-rank attention then equals full attention).
        min_rank, multiple: positive ints.
        method: ``"sketch"`` or ``"exact"``.

    Returns:
        :class:`RankPlan` ``(basis [B, Hkv, D, R], ranks [B, Hkv], eigenvalues [B, Hkv, D])``;
        from the sketch, ``eigenvalues`` holds the ``p`` Ritz values followed by the rest of the
        trace spread evenly over the other ``D - p`` entries.

    Raises:
        TypeError: q or k not a tensor, energy not a float, min_rank or multiple not an int,
            method not a str.
        ValueError: q, k not ``[B, H, L, D]`` of one B and D, ``Hq % Hkv != 0``, energy outside
            ``(0, 1]``, min_rank or multiple < 1, an unknown method; q or k not finite (a NaN
            or inf in the Gram matrix would make the plan meaningless).
        RuntimeError: q and k on different devices.
        Every message starts ``adaattn.rank_plan:`` and names the argument.
    """
    op = "rank_plan"
    group = _check_plan_args(op, q, k, energy, min_rank, multiple)
    method = _check_method(op, method)
    return _plan_from_gram(op, *_plan_gram(q, k, group), energy, min_rank, multiple, method)


def _check_method(op: str, method) -> str:
    C.check(isinstance(method, str), TypeError, op, "method must be a str, got ",
            C.type_name(method))
    C.check(method in ("sketch", "exact"), ValueError, op,
            "method must be 'sketch' or 'exact', got '", method, "'")
    return method


def _check_plan_args(op: str, q: torch.Tensor, k: torch.Tensor, energy: float, min_rank: int,
                     multiple: int) -> int:
    group = _check_qk(op, q, k)
    energy = C.real(op, "energy", energy)
    C.check(0.0 < energy <= 1.0, ValueError, op, "energy must be in (0, 1], got ", energy)
    C.integer(op, "min_rank", min_rank)
    C.integer(op, "multiple", multiple)
    C.check(min_rank >= 1 and multiple >= 1, ValueError, op,
            "min_rank and multiple must be positive, got ", min_rank, ", ", multiple)
    return group


def _check_finite(op: str, finite: bool) -> None:
    C.check(finite, ValueError, op, "q and k must be finite: their Gram matrix K^T K + Q^T Q has "
            "NaN or inf entries")


def _plan_gram(q: torch.Tensor, k: torch.Tensor, group: int) -> Tuple[torch.Tensor, bool]:
    """``G [B * Hkv, D, D]`` and whether the plan takes the exact float64 path. Under autocast
    too: autocast would run the float32 GEMMs in its lower precision."""
    b, hkv, dim = k.shape[0], k.shape[1], k.shape[3]
    exact = torch.float64 in (q.dtype, k.dtype) or not 1 <= dim <= _SYM_EIG_MAX_DIM
    args = (q.reshape(b * hkv, group * q.shape[2], dim), k.reshape(b * hkv, k.shape[2], dim),
            torch.float64 if exact else torch.float32)
    if torch.is_autocast_enabled(q.device.type):
        with torch.autocast(q.device.type, enabled=False):
            gram = _gram(*args)
    else:
        gram = _gram(*args)
    return gram.reshape(b, hkv, dim, dim), exact


def _diagonal_sum(gram: torch.Tensor) -> torch.Tensor:
    """The sum of the diagonals of ``gram [..., D, D]`` (a Gram matrix), a float64 scalar: finite
    exactly when every entry is (a NaN or inf in q or k reaches a diagonal entry; Cauchy-Schwarz
    bounds the others by the diagonal; float64 does not overflow on float32 entries)."""
    return gram.diagonal(dim1=-2, dim2=-1).sum(dtype=torch.float64)


def _gram_is_finite(gram: torch.Tensor) -> bool:
    """Whether ``gram`` has only finite entries: one host read."""
    return math.isfinite(_diagonal_sum(gram).item())


def _plan_from_gram(op: str, gram: torch.Tensor, exact: bool, energy: float, min_rank: int,
                    multiple: int, method: str = "exact") -> RankPlan:
    b, hkv, dim = gram.shape[:3]
    width = _sketch_width(dim, min_rank, multiple)
    # Whether G's finiteness is known by now (checked); else the last host read checks it.
    checked = False
    if exact and gram.numel():
        # eigh fails on a non-finite matrix: checked first (an extra host read on this path).
        _check_finite(op, _gram_is_finite(gram))
        checked = True
    if method == "sketch" and energy < 1.0 and width < dim and gram.numel():
        values, vectors, ranks, summary = _sketch_from_gram(gram, exact, energy, min_rank,
                                                            multiple, width, _SKETCH_POWER_ITERS)
        # One host read: the largest rank, the heads not decided, the heads not finite.
        top, undecided, not_finite = summary.tolist()
        _check_finite(op, not_finite == 0)
        if undecided == 0:
            return RankPlan(vectors[..., :top].contiguous(), ranks, values)
        checked = True
    if exact:
        values, vectors = torch.linalg.eigh(gram)  # ascending
        values, vectors = values.flip(-1).float(), vectors.flip(-1).float()
        values = values.clamp(min=0)
        if energy >= 1.0:
            ranks = torch.full((b, hkv), dim, dtype=torch.int32, device=gram.device)
        else:
            # The cumulative energy is non-decreasing: the rank is the index of its first entry
            # that reaches the target, plus one.
            reached = values.cumsum(-1) >= energy * values.sum(-1, keepdim=True)
            first = (dim + 1 - reached.sum(-1)).clamp(max=dim)
            ranks = first.clamp(min=min_rank)
            ranks = ((ranks + multiple - 1) // multiple * multiple).clamp(max=dim).to(torch.int32)
        columns = torch.arange(dim, device=gram.device)
        vectors = vectors * (columns < ranks.unsqueeze(-1)).unsqueeze(-2)
    else:
        # One kernel: all eigenvalues, the same rank rule (core/sym_eig.h's sym_eig_rank, summed
        # in float64), and only the first `rank` eigenvectors (the other columns are 0).
        values, vectors, ranks = torch.ops.adaattn.sym_eig_top(gram.reshape(b * hkv, dim, dim),
                                                                energy, min_rank, multiple)
        values = values.reshape(b, hkv, dim).clamp(min=0)
        vectors, ranks = vectors.reshape(b, hkv, dim, dim), ranks.reshape(b, hkv)
    width = 0
    if ranks.numel() and checked:
        width = int(ranks.max())
    elif ranks.numel():
        # One host read: the basis width, and whether G was finite (the solver ran on it anyway).
        width, total = torch.stack([ranks.max().double(), _diagonal_sum(gram)]).tolist()
        _check_finite(op, math.isfinite(total))
    return RankPlan(vectors[..., :int(width)].contiguous(), ranks, values)


def _full_rank_flag(gram: torch.Tensor, energy: float, min_rank: int,
                    multiple: int) -> Optional[torch.Tensor]:
    """A bool scalar on ``gram``'s device, True only if the plan of ``gram [B, Hkv, D, D]``
    provably gives every head rank D; ``None`` when every plan does (``energy = 1``, or
    ``min_rank`` above the last bucket below D). Computed without a host synchronisation.

    A rank rounds up to D iff it exceeds ``c = multiple * floor((D - 1) / multiple)``, i.e. iff
    the top ``c`` eigenvalues hold less than ``energy`` of the trace, i.e. iff the bottom
    ``D - c`` hold more than ``1 - energy`` of it. That holds when every eigenvalue exceeds
    ``t = (1 - energy) * trace / (D - c)``, which a successful Cholesky factorisation of
    ``G - t I`` proves (batched). ``t`` carries a margin of ``8 D eps * trace`` for the
    factorisation's rounding (backward error ~ D eps ||G||, ||G|| <= trace). float32 Gram
    matrices take ``torch.ops.adaattn.shifted_cholesky_info`` (trace, shift and factorisation in
    one kernel); float64 ones torch's ``cholesky_ex``."""
    dim = gram.shape[-1]
    cut = multiple * ((dim - 1) // multiple)
    if energy >= 1.0 or min_rank > cut:
        return None
    rel_shift = (1.0 - energy) / (dim - cut) + 8 * dim * torch.finfo(gram.dtype).eps
    if gram.dtype == torch.float32:
        info = torch.ops.adaattn.shifted_cholesky_info(gram.reshape(-1, dim, dim).contiguous(),
                                                       rel_shift)
    else:
        shift = rel_shift * gram.diagonal(dim1=-2, dim2=-1).sum(-1)
        eye = torch.eye(dim, dtype=gram.dtype, device=gram.device)
        info = torch.linalg.cholesky_ex(gram - shift[..., None, None] * eye).info
    return (info == 0).all()


def _gated_flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flag: torch.Tensor,
                      causal: bool, softmax_scale: Optional[float]) -> Tuple[torch.Tensor, bool]:
    """``(flash_attn(q, k, v), bool(flag))`` for a CUDA bool scalar ``flag``, with the attention
    queued before the host reads the flag: it is gated through ``seqlens``, the full length
    when ``flag`` holds (every row and key attends, the same result as without seqlens) and 0
    when not (every row is padding: the kernels only write zeros, an output the caller drops).
    The flag travels to pinned memory and is read once it has landed, while flash runs."""
    with torch.no_grad():
        host_flag = torch.empty((), dtype=torch.bool, pin_memory=True)
        host_flag.copy_(flag, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
        gate = (flag.to(torch.int32) * max(q.shape[2], k.shape[2])).expand(q.shape[0])
    out = flash_attn(q, k, v, causal=causal, softmax_scale=softmax_scale,
                     seqlens=gate.contiguous())
    landed.synchronize()
    return out, bool(host_flag)


def _check_error_args(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      basis: torch.Tensor, causal, softmax_scale) -> Tuple[int, bool, float]:
    group = _check_qk(op, q, k)
    C.tensor(op, "v", v)
    C.tensor(op, "basis", basis)
    b, hkv, lk, dim = k.shape
    C.check(v.dim() == 4 and tuple(v.shape[:3]) == (b, hkv, lk), ValueError, op,
            "v must be [B, Hkv, Lk, Dv] = [", b, ", ", hkv, ", ", lk, ", Dv], got ",
            tuple(v.shape))
    C.check(v.device == q.device and basis.device == q.device, RuntimeError, op,
            "v and basis must be on q's device ", q.device)
    C.check(basis.dim() == 4 and tuple(basis.shape[:3]) == (b, hkv, dim), ValueError, op,
            "basis must be [B, Hkv, D, R] = [", b, ", ", hkv, ", ", dim, ", R], got ",
            tuple(basis.shape))
    causal = C.boolean(op, "causal", causal)
    softmax_scale = C.optional_float(op, "softmax_scale", softmax_scale)
    return group, causal, dim ** -0.5 if softmax_scale is None else softmax_scale


def _visible(rows: torch.Tensor, len_q: int, len_k: int, causal: bool) -> Optional[torch.Tensor]:
    """Bool ``[len(rows), Lk]``: key ``c`` visible from query row ``r`` (bottom-right causal);
    None without a mask."""
    if not causal:
        return None
    cols = torch.arange(len_k, device=rows.device)
    return cols <= rows.unsqueeze(-1) + (len_k - len_q)


# Score elements per chunk of query rows in the error bound and estimate (float64: 32 MiB).
_CHUNK_ELEMENTS = 1 << 22


@torch.no_grad()
def rank_error_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, basis: torch.Tensor, *,
                     causal: bool = False, softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Rigorous bound on ``||O - O_low||_F`` per (b, query head), where ``O`` is softmax
    attention and ``O_low`` the attention on the scores ``s' = scale * (q U)(k U)^T`` of
    :func:`low_rank_attn` (any basis ``U``; it need not be orthonormal).

    Per query row ``i``, with the score perturbation ``d_j = s_ij - s'_ij = scale * q_i (k_j -
    k_j U U^T)`` over the keys ``j`` the row sees (its range ``rho``), the low-rank
    probabilities ``p_j`` and ``w_j = p_j^2``, ``W = sum w``, ``c = sum w d / W``,
    ``S = sum w (d - c)^2``, ``delta = |sum p d - c| + rho^2 / 4``::

        ||o_i - o'_i|| <= sigma(V) * min(sqrt(2), (exp(rho) - 1) / rho * sqrt(S + W * delta^2))

    with ``sigma(V)`` the spectral norm of the kv head's ``V`` minus its mean row. The proof
    (docs/rank_error_bound.md): along ``s' + t d``, ``do/dt = V^T x_t`` with
    ``x_t = p_t * (d - E_{p_t} d)`` summing to 0 (so any row can be subtracted from V);
    ``p_t <= p e^{t rho}`` elementwise; ``E_{p_t} d`` moves by at most ``rho^2 / 4`` (its
    derivative is a variance); integrate over ``t in [0, 1]``. The cap: ``o - o' = V^T (p_1 -
    p_0)`` of two probability vectors, ``||p_1 - p_0||_2 <= sqrt(2)``. The bound is per row, so
    it holds for any mask; against the actual ``||V^T x||`` it loses about ``sigma(V) /
    sqrt(Dv)`` (3-7 on Gaussian V at L = 512-4096; measured 2.9-3.1x on planted rank-32 inputs
    at L = 512).

    Cost: the perturbation ``d`` and the low-rank probabilities for every (row, key) pair, in
    float64, in chunks of query rows: one attention-sized pass. A validation tool; to guide
    choices during training, :func:`rank_error_estimate` samples rows instead.

    Args:
        q: ``[B, Hq, Lq, D]``; k: ``[B, Hkv, Lk, D]``; v: ``[B, Hkv, Lk, Dv]``; basis:
            ``[B, Hkv, D, R]`` (e.g. :func:`rank_plan`'s).
        causal: bottom-right aligned causal mask, as in :func:`low_rank_attn`.
        softmax_scale: defaults to ``D ** -0.5``.

    Returns:
        float32 ``[B, Hq]``, rounded up from the float64 computation. It bounds the difference
        of the two attentions in exact arithmetic, not the rounding of a bf16 kernel.

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`rank_plan` for q and k, and v or a basis
            whose shapes do not match, causal not a bool, the message starting
            ``adaattn.rank_error_bound:``.
    """
    op = "rank_error_bound"
    group, causal, scale = _check_error_args(op, q, k, v, basis, causal, softmax_scale)
    b, hq, len_q, dim = q.shape
    hkv, len_k = k.shape[1], k.shape[2]
    dtype = torch.float64
    u = basis.to(dtype)
    kd = k.to(dtype)
    k_low = kd @ u                                   # [B, Hkv, Lk, R]
    k_res = kd - k_low @ u.mT                        # [B, Hkv, Lk, D]
    vd = v.to(dtype)
    sigma = torch.linalg.matrix_norm(vd - vd.mean(-2, keepdim=True), ord=2)  # [B, Hkv]
    qg = q.reshape(b, hkv, group, len_q, dim)
    total = torch.zeros(b, hkv, group, dtype=dtype, device=q.device)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, b * hq * len_k))
    for start in range(0, len_q, chunk):
        rows = torch.arange(start, min(start + chunk, len_q), device=q.device)
        qc = qg[:, :, :, start:start + chunk].to(dtype)
        s_low = scale * (qc @ u.unsqueeze(2)) @ k_low.unsqueeze(2).mT   # [B, Hkv, g, c, Lk]
        d = scale * qc @ k_res.unsqueeze(2).mT
        seen = _visible(rows, len_q, len_k, causal)
        if seen is not None:
            s_low = s_low.masked_fill(~seen, float("-inf"))
            hi = d.masked_fill(~seen, float("-inf")).amax(-1)
            lo = d.masked_fill(~seen, float("inf")).amin(-1)
            any_seen = seen.any(-1)
            rho = torch.where(any_seen, hi - lo, torch.zeros_like(hi))
            d = d.masked_fill(~seen, 0.0)
        else:
            rho = d.amax(-1) - d.amin(-1)
            any_seen = None
        p = torch.softmax(s_low, -1)
        if any_seen is not None:
            p = torch.where(any_seen.unsqueeze(-1), p, torch.zeros_like(p))  # rows with no key
        w = p * p
        w_sum = w.sum(-1)
        centre = (w * d).sum(-1) / w_sum.clamp(min=torch.finfo(dtype).tiny)
        spread = (w * (d - centre.unsqueeze(-1)) ** 2).sum(-1)
        drift = ((p * d).sum(-1) - centre).abs() + rho * rho / 4
        growth = torch.where(rho > 0, torch.expm1(rho) / rho.clamp(min=torch.finfo(dtype).tiny),
                             torch.ones_like(rho))
        row = growth * growth * (spread + w_sum * drift * drift)
        # o - o' = V^T (p_1 - p_0) with ||p_1 - p_0||_2 <= sqrt(2): the cap for large rho.
        total += row.clamp(max=2.0).nan_to_num(2.0).sum(-1)
    bound = sigma.unsqueeze(-1) * total.sqrt()
    # Rounded up: float32 of the float64 value, plus the float64 rounding of the sums.
    bound = (bound * (1 + 1e-12)).reshape(b, hq).float()
    return torch.nextafter(bound, torch.full_like(bound, float("inf")))


@torch.no_grad()
def rank_error_estimate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, basis: torch.Tensor, *,
                        causal: bool = False, softmax_scale: Optional[float] = None,
                        samples: int = 256, relative: bool = False) -> torch.Tensor:
    """Estimate of ``||O - O_low||_F`` per (b, query head) from sampled query rows computed
    exactly (``O_low``: :func:`low_rank_attn` with ``basis``).

    The rows: ``m = min(samples, Lq)`` strata of consecutive rows, one row drawn uniformly in
    each from a fixed seed (deterministic), weighted by its stratum's size. For each sampled
    row both attentions are computed against every key (float32, float64 for float64 inputs):
    ``O(m * Lk * (D + Dv))`` per head instead of ``O(Lq * Lk * ...)``.

    Confidence: the estimate of the squared error ``sum_i e_i^2`` is unbiased; stratified
    sampling has variance at most that of ``m`` rows drawn uniformly, i.e. a relative standard
    deviation at most ``cv / sqrt(m)`` where ``cv`` is the coefficient of variation of the
    per-row squared errors ``e_i^2``. With row errors of comparable size (``cv <= 1``, as on
    planted-rank and random inputs), ``m = 256`` gives at most 6% on the squared error, 3% on
    the norm; by Chebyshev, within 2x of the actual error with probability >= 1 - cv^2 / (9 m).
    It can miss errors concentrated in a few rows it does not sample (heavy-tailed ``e_i``):
    :func:`rank_error_bound` is the rigorous check. ``m >= Lq`` computes every row: exact.

    Args:
        q: ``[B, Hq, Lq, D]``; k: ``[B, Hkv, Lk, D]``; v: ``[B, Hkv, Lk, Dv]``; basis:
            ``[B, Hkv, D, R]``.
        causal, softmax_scale: as in :func:`low_rank_attn`.
        samples: rows to sample (positive int).
        relative: return ``||O - O_low||_F / ||O||_F`` (both estimated from the same rows).

    Returns:
        float32 ``[B, Hq]``.

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`rank_error_bound`, and samples not a
            positive int, the message starting ``adaattn.rank_error_estimate:``.
    """
    op = "rank_error_estimate"
    group, causal, scale = _check_error_args(op, q, k, v, basis, causal, softmax_scale)
    C.integer(op, "samples", samples)
    C.check(samples >= 1, ValueError, op, "samples must be positive, got ", samples)
    relative = C.boolean(op, "relative", relative)
    rows, weights = _sample_rows(q.shape[2], samples, q.device)
    err, ref = _sampled_errors(q, k, v, basis.unsqueeze(0), rows, weights, causal, scale, group)
    err, ref = err[0], ref
    out = err / ref.clamp(min=torch.finfo(ref.dtype).tiny) if relative else err
    return out.float()


_SAMPLE_SEED = 1126
_SAMPLED_ROWS = {}


def _sample_rows(len_q: int, samples: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stratified row sample: ``(rows int64 [m], weights float64 [m])``, one row per stratum of
    consecutive rows, weighted by the stratum's size (the sum over rows of any per-row quantity
    is then estimated without bias)."""
    key = (len_q, samples, str(device))
    if key in _SAMPLED_ROWS:
        return _SAMPLED_ROWS[key]
    m = min(samples, len_q)
    edges = torch.arange(m + 1, dtype=torch.float64) * len_q / m
    edges = edges.floor().long()
    sizes = edges[1:] - edges[:-1]
    gen = torch.Generator().manual_seed(_SAMPLE_SEED)
    offset = (torch.rand(m, generator=gen, dtype=torch.float64) * sizes).floor().long()
    rows = edges[:-1] + offset.minimum(sizes - 1)
    # Cached: the copy to the device happens once per (Lq, samples, device).
    _SAMPLED_ROWS[key] = rows.to(device), sizes.to(torch.float64).to(device)
    return _SAMPLED_ROWS[key]


def _sampled_errors(q, k, v, bases, rows, weights, causal, scale, group):
    """Estimated ``||O - O_low||_F`` for each of ``bases [N, B, Hkv, D, R]`` (``[N, B, Hq]``)
    and ``||O||_F`` (``[B, Hq]``) from the sampled ``rows`` with ``weights``."""
    b, hq, len_q, dim = q.shape
    hkv, len_k = k.shape[1], k.shape[2]
    dtype = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    qs = q.reshape(b, hkv, group, len_q, dim)[:, :, :, rows].to(dtype)   # [B, Hkv, g, m, D]
    kd, vd = k.to(dtype).unsqueeze(2), v.to(dtype).unsqueeze(2)
    seen = _visible(rows, len_q, len_k, causal)

    def attend(scores):
        if seen is not None:
            scores = scores.masked_fill(~seen, float("-inf"))
        p = torch.softmax(scores, -1)
        if seen is not None:
            p = torch.where(seen.any(-1, keepdim=True), p, torch.zeros_like(p))
        return p @ vd                                                    # [B, Hkv, g, m, Dv]

    full = attend(scale * qs @ kd.mT)
    w = weights.to(dtype)
    ref = ((full * full).sum(-1) * w).sum(-1).sqrt().reshape(b, hq)
    errs = []
    for u in bases:
        u = u.to(dtype).unsqueeze(2)
        low = attend(scale * (qs @ u) @ (kd @ u).mT)
        diff = low - full
        errs.append(((diff * diff).sum(-1) * w).sum(-1).sqrt().reshape(b, hq))
    return torch.stack(errs), ref


def low_rank_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, basis: torch.Tensor, *,
                  causal: bool = False, softmax_scale: Optional[float] = None,
                  return_lse: bool = False
                  ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Exact softmax attention on scores projected to rank R (docs/ops.md):
    ``s = scale * (q U)(k U)^T``, v at full width.

    The projections are batched GEMMs; QK^T then runs at width R (on CUDA fp16/bf16 R is padded
    with zero columns to a compiled width: 32, 64 or 128), so FLOPs and time fall with R.
    Differentiable in q, k, v and basis (``dq = dq' U^T``, ``dU = q^T dq' + k^T dk'``).

    Args:
        q: ``[B, Hq, Lq, D]``; k: ``[B, Hkv, Lk, D]``; v: ``[B, Hkv, Lk, Dv]`` (dense layout,
            ``Hq % Hkv == 0``; query head ``h`` uses the basis of kv head ``h // (Hq // Hkv)``).
        basis: ``U [B, Hkv, D, R]``, float32 or q's dtype (cast to q's dtype for the GEMMs),
            e.g. :func:`rank_plan`'s; columns need not be orthonormal.
        causal: bottom-right aligned causal mask.
        softmax_scale: defaults to ``D ** -0.5`` of the full head dim D (the scores approximate
            ``q k^T``).
        return_lse: also return ``lse [B, Hq, Lq]`` (float32, not differentiable).

    Returns:
        ``out [B, Hq, Lq, Dv]`` (q's dtype), and ``lse`` when ``return_lse``.

    Raises:
        TypeError: a flag that is not a bool; q, k, v as :func:`flash_attn`; a basis neither
            float32 nor q's dtype.
        ValueError: as :func:`flash_attn` for q, k, v; a basis that is not ``[B, Hkv, D, R]``
            with ``R >= 1``.
        RuntimeError: tensors on different devices; on CUDA fp16/bf16 a rank or Dv without a
            kernel.
        Every message starts ``adaattn.low_rank_attn:`` and names the argument.
    """
    op = "low_rank_attn"
    C.tensors(op, q=q, k=k, v=v, basis=basis)
    return_lse = C.boolean(op, "return_lse", return_lse)
    out, lse = torch.ops.adaattn.low_rank_attn(
        q, k, v, basis, causal=C.boolean(op, "causal", causal),
        softmax_scale=C.optional_float(op, "softmax_scale", softmax_scale))
    return (out, lse) if return_lse else out


def _plan_for_error(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    gram: torch.Tensor, exact: bool, max_error: float, min_rank: int,
                    multiple: int, causal: bool, scale: float, group: int,
                    samples: int) -> RankPlan:
    """The plan whose rank, per (b, kv head), is the smallest candidate (``min_rank`` rounded
    up to ``multiple``, then every ``multiple`` up to D) at which the sampled relative error
    estimate of every query head of the group is at most ``max_error``."""
    full = _plan_from_gram(op, gram, exact, 1.0, min_rank, multiple, "exact")
    b, hkv, dim = gram.shape[:3]
    first = min(dim, -(-min_rank // multiple) * multiple)
    candidates = list(range(first, dim, multiple)) + [dim]
    columns = torch.arange(dim, device=q.device)
    bases = [full.basis * (columns < r) for r in candidates[:-1]]
    rows, weights = _sample_rows(q.shape[2], samples, q.device)
    if bases:
        errors, norms = _sampled_errors(q, k, v, torch.stack(bases), rows, weights, causal,
                                        scale, group)
        rel = errors / norms.clamp(min=torch.finfo(norms.dtype).tiny)
        ok = (rel.reshape(len(bases), b, hkv, group).amax(-1) <= max_error)
        # Rank D (exact attention) always qualifies.
        ok = torch.cat([ok, torch.ones_like(ok[:1])])
    else:
        ok = torch.ones(1, b, hkv, dtype=torch.bool, device=q.device)
    index = ok.int().argmax(0)
    ranks = torch.tensor(candidates, device=q.device)[index].to(torch.int32)
    width = int(ranks.max()) if ranks.numel() else 0
    basis = (full.basis * (columns < ranks.unsqueeze(-1)).unsqueeze(-2))[..., :width]
    return RankPlan(basis.contiguous(), ranks, full.eigenvalues)


def adaptive_rank_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                       energy: float = 0.99, causal: bool = False,
                       softmax_scale: Optional[float] = None, min_rank: int = 16,
                       multiple: int = 16, return_plan: bool = False, method: str = "exact",
                       max_error: Optional[float] = None, samples: int = 64
                       ) -> Union[torch.Tensor, Tuple[torch.Tensor, RankPlan]]:
    """:func:`rank_plan` (detached) followed by :func:`low_rank_attn` at the plan's rank.

    When the plan keeps every direction (largest rank = D) this is :func:`flash_attn` itself:
    projecting onto a full orthonormal basis changes nothing but the cost. Full-rank inputs are
    recognised before the eigendecomposition (a Cholesky factorisation of the shifted Gram
    matrix proves every eigenvalue large enough that each head's rank rounds up to D), so they
    cost the Gram matrices and the factorisation on top of flash_attn; on CUDA, flash_attn is
    queued before the host reads the certificate (see :func:`_gated_flash_attn`), so the GPU
    does not wait for the host in between.

    With ``max_error``, the rank comes from a target error instead of ``energy``: the full
    eigendecomposition (``method="exact"``), then for each candidate rank (``min_rank`` rounded
    up to ``multiple``, every ``multiple`` up to D) the relative error ``||O - O_low||_F /
    ||O||_F`` estimated on ``samples`` rows as :func:`rank_error_estimate` does; each (b, kv
    head) takes the smallest rank at which every query head of its group is within
    ``max_error``. It costs about ``D / multiple`` sampled-row attentions on top of the plan,
    and two host reads (finiteness, the basis width).

    Args:
        q: ``[B, Hq, Lq, D]``; k: ``[B, Hkv, Lk, D]``; v: ``[B, Hkv, Lk, Dv]``.
        energy, min_rank, multiple, method: as in :func:`rank_plan` (energy and method unused
            with ``max_error``).
        causal, softmax_scale: as in :func:`low_rank_attn`.
        return_plan: also return the :class:`RankPlan` (to reuse it across steps, call
            :func:`low_rank_attn` with ``plan.basis``, or use
            :class:`adaattn.nn.AdaptiveRankAttention`).
        max_error: target relative error in ``(0, inf)``, or None to size by ``energy``.
        samples: rows sampled per candidate rank with ``max_error`` (positive int).

    Returns:
        ``out [B, Hq, Lq, Dv]``, and the plan when ``return_plan``.

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`rank_plan` and :func:`flash_attn`,
            max_error not a positive float, samples not a positive int, the message starting
            ``adaattn.adaptive_rank_attn:``. Non-finite q or k raise whenever the ranks depend
            on them; where every plan keeps all D directions (``energy = 1``, or ``min_rank``
            above the last multiple below D) this is :func:`flash_attn`, whose output then
            carries the NaN.
    """
    op = "adaptive_rank_attn"
    causal = C.boolean(op, "causal", causal)
    return_plan = C.boolean(op, "return_plan", return_plan)
    softmax_scale = C.optional_float(op, "softmax_scale", softmax_scale)
    method = _check_method(op, method)
    if max_error is not None:
        max_error = C.real(op, "max_error", max_error)
        C.check(max_error > 0, ValueError, op, "max_error must be positive, got ", max_error)
    C.integer(op, "samples", samples)
    C.check(samples >= 1, ValueError, op, "samples must be positive, got ", samples)
    with torch.no_grad():
        group = _check_plan_args(op, q, k, energy, min_rank, multiple)
        C.tensor(op, "v", v)
        C.check_flash_inputs(op, q, k, v)
        C.check_flash_options(op, softmax_scale, -1, -1, 0.0)
        gram, exact = _plan_gram(q.detach(), k.detach(), group)
        full = None if return_plan or max_error is not None else \
            _full_rank_flag(gram, energy, min_rank, multiple)
    if not return_plan and max_error is None:
        if full is None:
            return flash_attn(q, k, v, causal=causal, softmax_scale=softmax_scale)
        if q.is_cuda:
            out, certified = _gated_flash_attn(q, k, v, full, causal, softmax_scale)
            if certified:
                return out
        elif bool(full):
            return flash_attn(q, k, v, causal=causal, softmax_scale=softmax_scale)
    with torch.no_grad():
        if max_error is None:
            plan = _plan_from_gram(op, gram, exact, energy, min_rank, multiple, method)
        else:
            _check_finite(op, _gram_is_finite(gram))
            scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
            plan = _plan_for_error(op, q.detach(), k.detach(), v.detach(), gram, exact,
                                   max_error, min_rank, multiple, causal, scale, group, samples)
    if plan.basis.shape[-1] == q.shape[-1]:
        out = flash_attn(q, k, v, causal=causal, softmax_scale=softmax_scale)
    else:
        out = low_rank_attn(q, k, v, plan.basis, causal=causal, softmax_scale=softmax_scale)
    return (out, plan) if return_plan else out
