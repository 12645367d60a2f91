"""``torch.nn`` modules built on the adaattn ops."""
from typing import Optional, Tuple

import torch
from torch import nn

from . import _checks as C
from .flash import flash_attn, flash_attn_varlen
from .rank import low_rank_attn


class FlashAttention(nn.Module):
    """The flash-attention core with its score variants as module state: learnable attention
    sinks and relative-bias table (parameters), fixed ALiBi slopes (a buffer), softcap.

    Projections stay with the caller. Given ``q [B, Hq, Lq, D]`` and ``k, v [B, Hkv, Lk, D]``
    (``Hq == num_heads``; any strides with a contiguous last dim) it returns
    ``out [B, Hq, Lq, Dv]`` of :func:`adaattn.flash_attn`; packed: ``q [T, Hq, D]``, ``k, v
    [T, Hkv, D]`` with int32 ``cu_seqlens [N + 1]`` (:func:`adaattn.flash_attn_varlen`).

    Args:
        num_heads: query heads ``Hq``.
        causal, window, softmax_scale, softcap: as in :func:`adaattn.flash_attn`.
        alibi_slopes: optional float32 ``[Hq]`` ALiBi slopes (stored as a buffer, not learned).
        sinks: learn a per-head sink logit ``sinks [Hq]`` (float32, initialised to 0).
        rel_bias_window: ``W > 0`` learns a relative-position bias ``rel_bias [Hq, W]``
            (float32, initialised to 0); 0 = none.

    Raises:
        TypeError, ValueError: a wrong argument type or value (messages start
            ``adaattn.nn.FlashAttention:``); in forward what :func:`adaattn.flash_attn` raises.
    """

    def __init__(self, num_heads: int, *, causal: bool = False,
                 window: Tuple[int, int] = (-1, -1), softmax_scale: Optional[float] = None,
                 softcap: float = 0, alibi_slopes: Optional[torch.Tensor] = None,
                 sinks: bool = False, rel_bias_window: int = 0):
        super().__init__()
        op = "nn.FlashAttention"
        C.integer(op, "num_heads", num_heads)
        C.check(num_heads > 0, ValueError, op, "num_heads must be positive, got ", num_heads)
        C.integer(op, "rel_bias_window", rel_bias_window)
        C.check(rel_bias_window >= 0, ValueError, op, "rel_bias_window must be >= 0, got ",
                rel_bias_window)
        self.num_heads = num_heads
        self.causal = C.boolean(op, "causal", causal)
        self.window = tuple(C.window_pair(op, window))
        self.softmax_scale = C.optional_float(op, "softmax_scale", softmax_scale)
        C.softcap_value(op, softcap)
        # Kept as given: an int 0 stays a constant under torch.compile(dynamic=True) (flash.py).
        self.softcap = softcap
        C.tensor(op, "alibi_slopes", alibi_slopes, optional=True)
        if alibi_slopes is not None:
            C.check(alibi_slopes.shape == (num_heads,), ValueError, op,
                    "alibi_slopes must have shape [num_heads] = [", num_heads, "], got ",
                    list(alibi_slopes.shape))
            alibi_slopes = alibi_slopes.detach().float().clone()
        self.register_buffer("alibi_slopes", alibi_slopes)
        self.sinks = (nn.Parameter(torch.zeros(num_heads, dtype=torch.float32))
                      if C.boolean(op, "sinks", sinks) else None)
        self.rel_bias = (nn.Parameter(torch.zeros(num_heads, rel_bias_window,
                                                  dtype=torch.float32))
                         if rel_bias_window > 0 else None)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, causal={self.causal}, window={self.window}, "
                f"softcap={self.softcap}, alibi={self.alibi_slopes is not None}, "
                f"sinks={self.sinks is not None}, "
                f"rel_bias_window={0 if self.rel_bias is None else self.rel_bias.shape[1]}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                seqlens: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]`` (optional int32 ``seqlens [B]``) ->
        ``[B, Hq, Lq, Dv]``; packed: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` with int32
        ``cu_seqlens [N + 1]`` -> ``[T, Hq, Dv]``."""
        # The variant tensors are float32 whatever the module was cast to.
        mods = dict(alibi_slopes=None if self.alibi_slopes is None else self.alibi_slopes.float(),
                    sinks=None if self.sinks is None else self.sinks.float(),
                    rel_bias=None if self.rel_bias is None else self.rel_bias.float())
        if self.softcap:
            mods["softcap"] = self.softcap
        if cu_seqlens is not None:
            C.check(seqlens is None, ValueError, "nn.FlashAttention",
                    "seqlens (padding) and cu_seqlens (packing) exclude each other")
            return flash_attn_varlen(q, k, v, cu_seqlens, cu_seqlens, causal=self.causal,
                                     window=self.window, softmax_scale=self.softmax_scale,
                                     **mods)
        return flash_attn(q, k, v, causal=self.causal, window=self.window,
                          softmax_scale=self.softmax_scale, seqlens=seqlens, **mods)


class FlashSelfAttention(nn.Module):
    """Multi-head self-attention (GQA-capable) with fused q/k/v projections and flash attention.

    Input ``x [B, L, E]``, output ``[B, L, E]``. Heads are viewed as ``(B, L, H, D)`` and passed
    transposed, so no copy is made for the attention call. Packed batches: ``x [T, E]`` with
    int32 ``cu_seqlens [N + 1]`` (documents never attend to each other; see
    :func:`adaattn.flash_attn_varlen`).

    Args:
        embed_dim: model width ``E``.
        num_heads: query heads ``Hq`` (``E % Hq == 0``, ``D = E // Hq``).
        num_kv_heads: key/value heads ``Hkv`` (defaults to ``Hq``; must divide ``Hq``).
        causal, window: as in :func:`adaattn.flash_attn`.
        softcap, alibi_slopes, sinks, rel_bias_window: the score variants, as in
            :class:`FlashAttention` (whose instance is ``self.attn``).

    Raises:
        TypeError: a size that is not an int, a flag that is not a bool, window not a pair of
            ints.
        ValueError: sizes that do not divide (``E % Hq``, ``Hq % Hkv``) or are not positive;
            in forward, a packed call without x ``[T, E]``; and what
            :func:`adaattn.flash_attn` raises. Messages start
            ``adaattn.nn.FlashSelfAttention:``.
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: Optional[int] = None, *,
                 causal: bool = False, window: Tuple[int, int] = (-1, -1), bias: bool = False,
                 softcap: float = 0, alibi_slopes: Optional[torch.Tensor] = None,
                 sinks: bool = False, rel_bias_window: int = 0):
        super().__init__()
        op = "nn.FlashSelfAttention"
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads)):
            C.integer(op, name, value)
            C.check(value > 0, ValueError, op, name, " must be positive, got ", value)
        C.check(embed_dim % num_heads == 0, ValueError, op, "embed_dim (", embed_dim,
                ") must be divisible by num_heads (", num_heads, ")")
        C.check(num_heads % num_kv_heads == 0, ValueError, op, "num_heads (", num_heads,
                ") must be a multiple of num_kv_heads (", num_kv_heads, ")")
        C.boolean(op, "causal", causal)
        C.boolean(op, "bias", bias)
        C.window_pair(op, window)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.causal = causal
        self.window = tuple(window)
        self.qkv = nn.Linear(embed_dim, (num_heads + 2 * num_kv_heads) * self.head_dim, bias=bias)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.attn = FlashAttention(num_heads, causal=causal, window=window, softcap=softcap,
                                   alibi_slopes=alibi_slopes, sinks=sinks,
                                   rel_bias_window=rel_bias_window)

    def forward(self, x: torch.Tensor, seqlens: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x ``[B, L, E]`` (optional int32 ``seqlens [B]`` for right padding) -> ``[B, L, E]``;
        or packed x ``[T, E]`` with int32 ``cu_seqlens [N + 1]`` -> ``[T, E]``."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        if cu_seqlens is not None:
            C.check(x.dim() == 2 and seqlens is None, ValueError, "nn.FlashSelfAttention",
                    "packed input is x [T, E] with cu_seqlens and no seqlens, got x of shape ",
                    tuple(x.shape))
            total = x.shape[0]
            out = self.attn(q.view(total, hq, d), k.view(total, hkv, d), v.view(total, hkv, d),
                            cu_seqlens=cu_seqlens)
            return self.proj(out.reshape(total, hq * d))
        batch, length, _ = x.shape
        q = q.view(batch, length, hq, d).transpose(1, 2)
        k = k.view(batch, length, hkv, d).transpose(1, 2)
        v = v.view(batch, length, hkv, d).transpose(1, 2)
        out = self.attn(q, k, v, seqlens=seqlens)
        return self.proj(out.transpose(1, 2).reshape(batch, length, hq * d))


class LazyAttention(nn.Module):
    """Lazy attention (docs/ops.md) with its learnable per-head ``tau`` and bias table.

    The attention core only, like :func:`adaattn.lazy_attn` (always causal): projections stay
    with the caller. Given ``q [B, Hq, Lq, D]`` and ``k, v [B, Hkv, Lk, D]`` (``Hq ==
    num_heads``, ``Hq % Hkv == 0``, any strides with a contiguous last dim, e.g. ``(B, L, H, D)``
    tensors passed as ``.transpose(1, 2)``), it returns ``out [B, Hq, Lq, D]``::

        s_ij = scale * q_i.k_j + (bias[h, i - j] if i - j < window else 0)     (j <= i)
        o_i  = sum_j max(0, softmax_j(s_ij) + tau[h] / (i + 1)) v_j

    Packed batches: ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` with int32 ``cu_seqlens [N + 1]``
    (positions restart in every sequence; see :func:`adaattn.lazy_attn_varlen`).

    Parameters (always float32): ``tau [num_heads]`` (initialised to ``tau_init``; negative
    values zero out weak attention weights) and ``bias [num_heads, window]`` (zeros).

    Under ``torch.autocast`` q, k and v are cast to the autocast dtype (as autocast does for
    ``F.scaled_dot_product_attention``) while tau and bias are passed in float32, and the output
    has the autocast dtype. Outside autocast the output has q's dtype.

    Args:
        num_heads: query heads ``Hq``.
        window: length ``W`` of the relative-position bias table; keys ``W`` or more positions
            back get bias 0 but are still attended.
        tau_init: initial value of every head's ``tau``.
        softmax_scale: multiplies ``q @ k^T``; defaults to ``D ** -0.5``.

    Raises:
        TypeError: num_heads or window not an int, tau_init or softmax_scale not a float.
        ValueError: num_heads or window < 1; in forward, q not ``[B, num_heads, Lq, D]``
            (packed ``[T, num_heads, D]``), seqlens with cu_seqlens; and what
            :func:`adaattn.lazy_attn` raises. Messages start ``adaattn.nn.LazyAttention:``.
    """

    def __init__(self, num_heads: int, window: int = 512, tau_init: float = -1.0, *,
                 softmax_scale: Optional[float] = None):
        super().__init__()
        op = "nn.LazyAttention"
        for name, value in (("num_heads", num_heads), ("window", window)):
            C.integer(op, name, value)
            C.check(value >= 1, ValueError, op, name, " must be positive, got ", value)
        C.real(op, "tau_init", tau_init)
        C.optional_float(op, "softmax_scale", softmax_scale)
        self.num_heads = num_heads
        self.window = window
        self.tau_init = tau_init
        self.softmax_scale = softmax_scale
        self.tau = nn.Parameter(torch.empty(num_heads, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(num_heads, window, dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.tau.fill_(self.tau_init)
            self.bias.zero_()

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, window={self.window}, tau_init={self.tau_init}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                seqlens: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]`` (optional int32 ``seqlens [B]`` for
        right padding) -> ``[B, Hq, Lq, D]``; packed: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``
        with int32 ``cu_seqlens [N + 1]`` -> ``[T, Hq, D]``."""
        # Looked up at call time: adaattn/__init__.py imports this module before the op.
        import adaattn

        op = "nn.LazyAttention"
        packed = cu_seqlens is not None
        C.tensor(op, "q", q)
        layout = "[T, {h}, D] (packed)" if packed else "[B, {h}, Lq, D]"
        if q.dim() != (3 if packed else 4) or q.shape[1] != self.num_heads:
            C.fail(ValueError, op, "q must be ", layout.format(h=self.num_heads), " (num_heads=",
                   self.num_heads, "), got shape ", tuple(q.shape))
        C.check(not (packed and seqlens is not None), ValueError, op,
                "seqlens (padding) and cu_seqlens (packing) exclude each other")
        device_type = q.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            q, k, v = (t.to(dtype) for t in (q, k, v))
        # The op takes float32 tau/bias; autocast is off for the call so that no cast policy
        # (now or registered later for the op) lowers them, and .float() keeps a module that was
        # cast with .to(bfloat16) working (a no-op for float32 parameters).
        with torch.autocast(device_type, enabled=False):
            if packed:
                return adaattn.lazy_attn_varlen(q, k, v, cu_seqlens, self.tau.float(),
                                                self.bias.float(),
                                                softmax_scale=self.softmax_scale)
            return adaattn.lazy_attn(q, k, v, self.tau.float(), self.bias.float(),
                                     softmax_scale=self.softmax_scale, seqlens=seqlens)


class LinearAttention(nn.Module):
    """Linear attention (docs/ops.md), the attention core of :func:`adaattn.linear_attn`.

    No parameters: projections stay with the caller. Given ``q, k [B, H, T, D]`` and
    ``v [B, H, T, Dv]`` (any strides with a contiguous last dim, e.g. ``(B, T, H, D)`` tensors
    passed as ``.transpose(1, 2)``), or packed ``[T, H, *]`` tensors with int32 ``cu_seqlens
    [N + 1]``, it returns ``out`` with v's shape::

        o_t = phi(q_t) S_t / (phi(q_t) . z_t),  S_t = sum_{s <= t} phi(k_s)^T v_s,
        z_t = sum_{s <= t} phi(k_s)        (all s when not causal; no division without normalize)

    Under ``torch.autocast`` q, k and v are cast to the autocast dtype; the state stays float32.

    Args:
        feature_map: ``"elu"`` (``elu(x) + 1``), ``"relu"`` or ``"identity"``.
        causal: causal (default) or full attention.
        normalize: divide by ``phi(q_t) . z_t`` (default).

    Raises:
        TypeError: feature_map not a str, a flag that is not a bool.
        ValueError: an unknown feature_map; in forward, what :func:`adaattn.linear_attn`
            raises. Messages start ``adaattn.nn.LinearAttention:``.
    """

    FEATURE_MAPS = ("elu", "relu", "identity")

    def __init__(self, feature_map: str = "elu", *, causal: bool = True, normalize: bool = True):
        super().__init__()
        op = "nn.LinearAttention"
        C.check(isinstance(feature_map, str), TypeError, op, "feature_map must be a str, got ",
                C.type_name(feature_map))
        C.check(feature_map in self.FEATURE_MAPS, ValueError, op, "feature_map must be one of ",
                self.FEATURE_MAPS, ", got ", repr(feature_map))
        C.boolean(op, "causal", causal)
        C.boolean(op, "normalize", normalize)
        self.feature_map = feature_map
        self.causal = causal
        self.normalize = normalize

    def extra_repr(self) -> str:
        return (f"feature_map={self.feature_map!r}, causal={self.causal}, "
                f"normalize={self.normalize}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens: Optional[torch.Tensor] = None,
                initial_state: Optional[torch.Tensor] = None, return_state: bool = False):
        """q/k ``[B, H, T, D]``, v ``[B, H, T, Dv]`` (packed: ``[T, H, *]`` with
        ``cu_seqlens``) -> ``out`` (v's shape), or ``(out, state)`` with ``return_state`` (see
        :func:`adaattn.linear_attn` for ``initial_state`` and the state layout)."""
        import adaattn

        device_type = q.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            q, k, v = (t.to(dtype) for t in (q, k, v))
        with torch.autocast(device_type, enabled=False):
            return adaattn.linear_attn(q, k, v, feature_map=self.feature_map, causal=self.causal,
                                       normalize=self.normalize, cu_seqlens=cu_seqlens,
                                       initial_state=initial_state, return_state=return_state)


class AdaptiveRankAttention(nn.Module):
    """Adaptive-rank attention (docs/ops.md) that plans rarely and reuses the plan.

    The attention core only: given ``q [B, Hq, Lq, D]``, ``k [B, Hkv, Lk, D]``, ``v [B, Hkv,
    Lk, Dv]`` it returns :func:`adaattn.low_rank_attn` with a cached :class:`adaattn.RankPlan`
    (gradients for q, k, v; the basis is a constant), or :func:`adaattn.flash_attn` when the
    plan keeps all D directions, so a full-rank plan costs what flash_attn costs.

    The plan (detached) is made on the first call, every ``replan_every`` calls, when B, Hkv,
    D or the device change, after :meth:`replan`, and, with ``check_every > 0``, when the
    sampled error estimate (:func:`adaattn.rank_error_estimate`, relative, ``samples`` rows)
    taken every ``check_every`` calls has drifted: above ``drift`` times its value right after
    planning, or above ``max_error`` when that is set. Each plan costs :func:`adaattn.rank_plan`
    (or, with ``max_error``, the error-driven choice of :func:`adaattn.adaptive_rank_attn`)
    and one host synchronisation; each drift check one more. Between them a call is one
    low-rank (or flash) attention. Plans are per module: for a plan shared by several layers
    assign ``other.plan = module.plan`` (ranks are per (batch, kv head), so the layers must
    see similar q and k subspaces).

    Args:
        energy, min_rank, multiple, method: as in :func:`adaattn.rank_plan`.
        max_error: plan by target relative error instead of energy (see
            :func:`adaattn.adaptive_rank_attn`), and the drift threshold.
        causal, softmax_scale: as in :func:`adaattn.low_rank_attn`.
        replan_every: calls between plans (positive int).
        check_every: calls between drift checks (0: none).
        drift: allowed growth of the estimated error before re-planning (> 1).
        samples: rows of each error estimate.

    Raises:
        TypeError, ValueError: arguments of the wrong type or range, messages starting
            ``adaattn.nn.AdaptiveRankAttention:``; in forward, what :func:`adaattn.rank_plan`
            and :func:`adaattn.low_rank_attn` raise.
    """

    def __init__(self, energy: float = 0.99, *, max_error: Optional[float] = None,
                 causal: bool = False, softmax_scale: Optional[float] = None,
                 min_rank: int = 16, multiple: int = 16, method: str = "exact",
                 replan_every: int = 100, check_every: int = 0, drift: float = 2.0,
                 samples: int = 64):
        super().__init__()
        op = "nn.AdaptiveRankAttention"
        energy = C.real(op, "energy", energy)
        C.check(0.0 < energy <= 1.0, ValueError, op, "energy must be in (0, 1], got ", energy)
        if max_error is not None:
            max_error = C.real(op, "max_error", max_error)
            C.check(max_error > 0, ValueError, op, "max_error must be positive, got ",
                    max_error)
        C.boolean(op, "causal", causal)
        C.optional_float(op, "softmax_scale", softmax_scale)
        for name, value, least in (("min_rank", min_rank, 1), ("multiple", multiple, 1),
                                   ("replan_every", replan_every, 1),
                                   ("check_every", check_every, 0), ("samples", samples, 1)):
            C.integer(op, name, value)
            C.check(value >= least, ValueError, op, name, " must be >= ", least, ", got ", value)
        C.check(method in ("sketch", "exact"), ValueError, op,
                "method must be 'sketch' or 'exact', got ", repr(method))
        drift = C.real(op, "drift", drift)
        C.check(drift > 1.0, ValueError, op, "drift must be > 1, got ", drift)
        self.energy, self.max_error, self.causal = energy, max_error, causal
        self.softmax_scale, self.min_rank, self.multiple = softmax_scale, min_rank, multiple
        self.method, self.replan_every, self.check_every = method, replan_every, check_every
        self.drift, self.samples = drift, samples
        self._plan = None
        self.plans_made = 0
        self._calls_since_plan = 0
        self._planned_error: Optional[torch.Tensor] = None

    def extra_repr(self) -> str:
        target = f"max_error={self.max_error}" if self.max_error is not None else \
            f"energy={self.energy}"
        return (f"{target}, causal={self.causal}, replan_every={self.replan_every}, "
                f"check_every={self.check_every}")

    @property
    def plan(self):
        """The cached :class:`adaattn.RankPlan` (None before the first call). Assigning one (e.g.
        another layer's) makes this module use it until its next re-plan."""
        return self._plan

    @plan.setter
    def plan(self, plan) -> None:
        self._plan = plan
        self._calls_since_plan = 0
        self._planned_error = None

    def replan(self) -> None:
        """Drop the cached plan: the next call plans again."""
        self.plan = None

    def _estimate(self, q, k, v) -> torch.Tensor:
        from .rank import rank_error_estimate
        return rank_error_estimate(q, k, v, self.plan.basis, causal=self.causal,
                                   softmax_scale=self.softmax_scale, samples=self.samples,
                                   relative=True)

    def _make_plan(self, q, k, v) -> None:
        from . import rank
        op = "nn.AdaptiveRankAttention"
        if self.max_error is None:
            self.plan = rank.rank_plan(q, k, energy=self.energy, min_rank=self.min_rank,
                                       multiple=self.multiple, method=self.method)
        else:
            group = rank._check_plan_args(op, q, k, self.energy, self.min_rank, self.multiple)
            C.check_flash_inputs(op, q, k, v)
            gram, exact = rank._plan_gram(q, k, group)
            rank._check_finite(op, rank._gram_is_finite(gram))
            scale = q.shape[-1] ** -0.5 if self.softmax_scale is None else self.softmax_scale
            self.plan = rank._plan_for_error(op, q, k, v, gram, exact, self.max_error,
                                             self.min_rank, self.multiple, self.causal, scale,
                                             group, self.samples)
        self.plans_made += 1
        self._calls_since_plan = 0
        self._planned_error = None
        full = self.plan.basis.shape[-1] == q.shape[-1]
        if self.check_every and self.max_error is None and not full:
            self._planned_error = self._estimate(q, k, v)

    def _needs_plan(self, q, k, v) -> bool:
        if self.plan is None or self._calls_since_plan >= self.replan_every:
            return True
        basis = self.plan.basis
        if (tuple(basis.shape[:3]) != (k.shape[0], k.shape[1], k.shape[3])
                or basis.device != q.device):
            return True
        if not self.check_every or self._calls_since_plan % self.check_every:
            return False
        if basis.shape[-1] == q.shape[-1]:
            return False  # exact attention: no error to drift (replan_every revisits it)
        estimate = self._estimate(q, k, v)
        if self.max_error is not None:
            return bool((estimate > self.max_error).any())
        if self._planned_error is None:  # an assigned plan: its first check is the reference
            self._planned_error = estimate
            return False
        # Floor: errors at float32 rounding level are not a drift.
        limit = self.drift * self._planned_error.clamp(min=1e-6)
        return bool((estimate > limit).any())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lk, D]``, v ``[B, Hkv, Lk, Dv]`` ->
        ``[B, Hq, Lq, Dv]``."""
        device_type = q.device.type
        autocast = torch.is_autocast_enabled(device_type)
        if autocast:
            dtype = torch.get_autocast_dtype(device_type)
            q, k, v = (t.to(dtype) for t in (q, k, v))
        # _needs_plan's drift estimate runs without autograd (rank_error_estimate is no_grad).
        if self._needs_plan(q, k, v):
            with torch.no_grad():
                self._make_plan(q.detach(), k.detach(), v.detach())
        self._calls_since_plan += 1
        if not autocast:
            # A call between plans is one attention: no context managers on its host path.
            return self._attend(q, k, v)
        with torch.autocast(device_type, enabled=False):
            return self._attend(q, k, v)

    def _attend(self, q, k, v):
        """One attention on the cached plan: flash_attn when it keeps every direction."""
        if self.plan.basis.shape[-1] == q.shape[-1]:
            return flash_attn(q, k, v, causal=self.causal, softmax_scale=self.softmax_scale)
        return low_rank_attn(q, k, v, self.plan.basis, causal=self.causal,
                             softmax_scale=self.softmax_scale)
