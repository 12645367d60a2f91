"""Hugging Face transformers integration: ``attn_implementation="adaattn"`` and lazy attention.

Importing this module registers two attention implementations with transformers'
``AttentionInterface`` and ``AttentionMaskInterface``:

- ``"adaattn"``: exact softmax attention through the ops of :func:`adaattn.flash_attn`,
  :func:`adaattn.flash_attn_varlen` (packed batches) and :func:`adaattn.flash_attn_with_kvcache`
  (generation), honouring the model's causality, ``sliding_window``, ``softcap`` (Gemma 2),
  ``scaling`` and GQA (the ops are called directly: generation at batch 1 is bound by the
  host's time per layer and token)::

      import adaattn.integrations.transformers
      model = AutoModelForCausalLM.from_config(config, attn_implementation="adaattn")

- ``"adaattn_lazy"``: lazy attention (:func:`adaattn.lazy_attn`) with per-layer learnable
  ``tau``/``bias``, installed by :func:`use_lazy_attention`.

How a call is computed (``q [B, Hq, Lq, D]``, ``k/v [B, Hkv, Lk, D]`` as transformers passes
them; causal limits are bottom-right aligned, so a cache's ``Lq < Lk`` needs no mask):

- no padding: one dense call; during generation (no gradient, ``Lq < Lk``) the KV-cache op
  on the cache's keys (transformers' cache already holds the new ones), as long as the call has
  at most ``DECODE_MAX_ROWS`` query rows per kv head (``Hq / Hkv * Lq``); a longer chunk against
  a cache runs the dense op (bottom-right causal), whose tiles suit many rows.
- padding-free packed batches: ``cu_seq_lens_q/k`` kwargs (``DataCollatorWithFlattening``), or
  ``position_ids`` that restart (a new sequence starts wherever the position is not the previous
  one + 1, as transformers' own packed masks read them): the varlen op, no cross-document
  attention.
- a 2D padding mask ``[B, L]``: right padding runs the dense op with ``seqlens`` (no copy); any
  other pattern (left padding, or the holes that ``generate()`` makes after a right-padded prompt)
  moves each row's unmasked tokens to the front, runs the op with ``seqlens`` and moves the
  outputs back. Positions (causal diagonal, sliding window, lazy attention's ``i``) then count
  unmasked tokens, as ``generate()``'s ``position_ids`` and flash-attn's unpadding do. Query rows
  that are padding give 0.
- with cached keys (``Lq < Lk``) the mask must leave every new query token unmasked (as
  ``generate()`` does), and gradients through a padded call against a cache are refused.
- a static cache (``StaticCache``, ``cache_implementation="static"``) hands the attention its
  whole preallocated key buffer; the mask function then marks the slots that hold tokens, and
  the call runs as a padded one (a host sync per forward, a K/V gather per layer: DynamicCache, the
  default, is the fast path).

Attention sinks (``s_aux`` / ``module.sinks``, e.g. GPT-OSS) go to the ops' ``sinks``, the
KV-cache op's included.

Not supported (a clear error rather than a wrong answer): attention dropout, prepared 4D masks, mask overlays (``or_mask_function`` /
``and_mask_function``, e.g. image tokens attending bidirectionally, or ``block_sequence_ids``
blocks) and chunked attention layers (Llama 4). Cross-attention is outside this integration (a
2D mask is read as self-attention padding).
"""
import weakref
from typing import Optional, Tuple

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface

import adaattn
from adaattn import _checks as C
from adaattn._ops import ops
from adaattn.nn import LazyAttention

ATTN_IMPLEMENTATION = "adaattn"
LAZY_ATTN_IMPLEMENTATION = "adaattn_lazy"
# Model types whose attention modules use_lazy_attention knows (q/k/v/o projections, RoPE,
# no score soft-capping).
LAZY_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma")
# Calls against a cache with at most this many query rows per kv head (Hq / Hkv * Lq) run the
# KV-cache op: its decode kernel holds 64 rows in one CTA (tc/decode.h) and re-reads the cache
# for every further 64; the dense kernels' tiles suit longer chunks.
DECODE_MAX_ROWS = 64

__all__ = ["ATTN_IMPLEMENTATION", "DECODE_MAX_ROWS", "LAZY_ATTN_IMPLEMENTATION",
           "LAZY_MODEL_TYPES", "adaattn_attention_forward", "adaattn_mask",
           "lazy_attention_forward", "use_lazy_attention"]


def _mask_parts(mask_function, seen=None):
    """``mask_function`` and every function that its closures hold (transformers composes mask
    functions with ``and_masks`` / ``or_masks`` closures)."""
    seen = set() if seen is None else seen
    if not callable(mask_function) or id(mask_function) in seen:
        return
    seen.add(id(mask_function))
    yield mask_function
    for cell in getattr(mask_function, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        for item in contents if isinstance(contents, (tuple, list)) else (contents,):
            yield from _mask_parts(item, seen)


def adaattn_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                 mask_function=None, attention_mask: Optional[torch.Tensor] = None,
                 use_vmap: bool = False, config=None, device=None,
                 **kwargs) -> Optional[torch.Tensor]:
    """The ``AttentionMaskInterface`` entry: turns transformers' 2D padding mask into what
    :func:`adaattn_attention_forward` consumes, once per forward (with a 2D mask or a static
    cache one host sync, two for a padded batch; none without a mask).

    Causality, sliding windows and packing are not in the mask: they reach the attention call as
    ``is_causal``, ``sliding_window`` and ``position_ids`` (as for flash-attn).

    Args:
        batch_size: ``B``.
        q_length: query rows ``Lq`` of the attention calls.
        kv_length: key rows ``Lk`` (with a cache: cached + new; a static cache's whole buffer).
        q_offset: tokens before the queries (a 0-dim tensor for static caches).
        mask_function: transformers' mask pattern; checked for ``block_sequence_ids`` blocks.
        attention_mask: bool ``[B, >= Lk]`` (True = token), or None; also what this function
            returned before (``generate()`` prepares static-cache masks ahead of the forward).
        use_vmap: set by transformers when the model overlays ``or_mask_function`` /
            ``and_mask_function``, which adaattn cannot express.
        config: the model config; chunked attention layers (``layer_types``) are refused.
        device: where the model runs (for a static cache's slot mask).

    Returns:
        None (no padding, every key slot a token), int32 ``seqlens [B]`` (right padding with
        ``Lq == Lk``: token counts) or the bool ``[B, L]`` mask of the last ``L <= Lk`` keys
        (any other padding; ``L < Lk`` with a static cache, whose keys past ``L`` are unused
        slots).
    """
    if use_vmap:
        raise NotImplementedError(
            "adaattn: this model overlays or_mask_function/and_mask_function on its attention "
            "mask (e.g. image tokens attending bidirectionally), which attn_implementation="
            "'adaattn' cannot express; use attn_implementation='sdpa' for it")
    if any(getattr(f, "__qualname__", "").startswith("blockwise_overlay")
           for f in _mask_parts(mask_function)):
        raise NotImplementedError(
            "adaattn: block_sequence_ids (blocks of tokens attending bidirectionally, e.g. "
            "images) cannot be expressed by attn_implementation='adaattn'; use "
            "attn_implementation='sdpa' for it")
    if "chunked_attention" in (getattr(config, "layer_types", None) or ()):
        raise NotImplementedError(
            "adaattn: chunked attention layers (config.layer_types, e.g. Llama 4) are not "
            "supported; use attn_implementation='sdpa' for this model")
    if attention_mask is not None and attention_mask.dim() == 1:
        return attention_mask
    if attention_mask is None:
        if not isinstance(q_offset, torch.Tensor) and q_offset + q_length >= kv_length:
            return None
        # A static cache: its first q_offset + q_length slots hold tokens (as generate()'s mask
        # of the tokens so far says), the rest is unused.
        tokens = min(int(q_offset) + q_length, kv_length)
        attention_mask = torch.ones(batch_size, tokens, dtype=torch.bool, device=device)
    mask = attention_mask[:, -kv_length:].bool()
    length = mask.shape[-1]
    # The common case (generate() without padding: a mask of ones) in one reduction and sync;
    # a padded batch pays a second one below.
    if length == kv_length and bool(mask.all()):
        return None
    seqlens = mask.sum(-1, dtype=torch.int32)
    right_padded = (mask == (torch.arange(length, device=mask.device) < seqlens[:, None])).all()
    full, right_padded, queries_unmasked = torch.stack(
        [(seqlens == length).all(), right_padded, mask[:, length - q_length:].all()]).tolist()
    if full and length == kv_length:
        return None
    if q_length < length and not queries_unmasked:
        raise ValueError(
            "adaattn: attention_mask masks some of the new query tokens of a call against cached "
            "keys (Lq < Lk); only past tokens may be padding (left padding, as generate() uses)")
    if right_padded and q_length == length:
        return seqlens
    return mask


class _Flash:
    """Exact softmax attention with the call's causality, window, scale and softcap (the same
    options for the dense, packed and KV-cache ops).

    The options are checked once, here (:func:`_flash_kernel` keeps one per configuration); the
    methods call the registered ops directly, which check the tensors themselves: the Python
    wrappers would only repeat the option checks at every layer of every decode step."""

    def __init__(self, causal: bool, scale: Optional[float], window: Tuple[int, int],
                 softcap: float):
        op = "flash_attn"
        self.causal = C.boolean(op, "causal", causal)
        self.scale = C.optional_float(op, "softmax_scale", scale)
        self.left, self.right = C.window_pair(op, window)
        self.softcap = C.softcap_value(op, softcap)

    def needs_grad(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                            or v.requires_grad)

    def dense(self, q, k, v, seqlens=None):
        return _FLASH_OP(q, k, v, seqlens, self.scale, self.causal, self.left, self.right, False,
                         None, None, self.softcap)[0]

    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
        return _FLASH_OP(q, k, v, None, self.scale, self.causal, self.left, self.right, False,
                         cu_seqlens_q, cu_seqlens_k, self.softcap)[0]

    def decode(self, q, k_cache, v_cache, cache_seqlens):
        return _KVCACHE_OP(q, k_cache, v_cache, None, None, cache_seqlens, None, self.scale,
                           self.causal, self.left, self.right, self.softcap, 0)[0]


class _FlashWithSinks:
    """A :class:`_Flash` whose calls add attention sinks (float32 ``[Hq]``, one logit per head in
    every row's softmax denominator), to the dense, packed and KV-cache ops alike."""

    def __init__(self, base: _Flash, sinks: torch.Tensor):
        self.base, self.sinks = base, sinks

    def needs_grad(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        return self.base.needs_grad(q, k, v) or (torch.is_grad_enabled()
                                                 and self.sinks.requires_grad)

    def dense(self, q, k, v, seqlens=None):
        b = self.base
        return _FLASH_OP(q, k, v, seqlens, b.scale, b.causal, b.left, b.right, False, None, None,
                         b.softcap, None, self.sinks, None)[0]

    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
        b = self.base
        return _FLASH_OP(q, k, v, None, b.scale, b.causal, b.left, b.right, False, cu_seqlens_q,
                         cu_seqlens_k, b.softcap, None, self.sinks, None)[0]

    def decode(self, q, k_cache, v_cache, cache_seqlens):
        b = self.base
        return _KVCACHE_OP(q, k_cache, v_cache, None, None, cache_seqlens, None, b.scale,
                           b.causal, b.left, b.right, b.softcap, 0, None, None, None,
                           self.sinks, None)[0]


# The op overloads themselves (an OpOverloadPacket call resolves the overload each time).
_FLASH_OP = ops.flash_attn.default
_KVCACHE_OP = ops.flash_attn_with_kvcache.default
_LAZY_KVCACHE_OP = ops.lazy_attn_with_kvcache.default
# _Flash per call configuration (module causality, scaling, sliding window, softcap); the
# types are part of the key, so that e.g. scaling=True is not taken for a checked 1.0.
_FLASH_KERNELS = {}
_FLASH_KERNELS_MAX = 64


def _flash_kernel(causal, scaling, sliding_window, softcap) -> _Flash:
    """The :class:`_Flash` of a call's options, checked once per configuration."""
    key = (causal, type(causal), scaling, type(scaling), sliding_window, type(sliding_window),
           softcap, type(softcap))
    kernel = _FLASH_KERNELS.get(key)
    if kernel is None:
        window = (-1, -1)
        if sliding_window:
            window = (sliding_window - 1, 0 if causal else sliding_window - 1)
        kernel = _Flash(bool(causal), scaling, window, softcap or 0)
        if len(_FLASH_KERNELS) >= _FLASH_KERNELS_MAX:
            _FLASH_KERNELS.clear()
        _FLASH_KERNELS[key] = kernel
    return kernel


class _SeqlensMemo:
    """The last :func:`_full_seqlens` tensor: every layer of a decode step (and nothing else)
    asks for the same one, so it is made once per step, not once per layer."""

    key = None  # (batch, length, device, inference mode)
    value = None


def _full_seqlens(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """int32 ``[batch]`` filled with ``length`` (read-only: the ops never write it)."""
    # Inference tensors (made under inference_mode) are kept apart from normal ones.
    key = (batch, length, device, torch.is_inference_mode_enabled())
    memo = _SeqlensMemo
    if memo.key == key and not torch.compiler.is_compiling():
        return memo.value
    value = torch.full((batch,), length, dtype=torch.int32, device=device)
    if not torch.compiler.is_compiling():
        memo.key, memo.value = key, value
    return value


class _Lazy:
    """Lazy attention (causal) with an attention module's ``lazy_attention`` parameters."""

    def __init__(self, lazy: LazyAttention, scale: Optional[float]):
        self.tau, self.bias = lazy.tau.float(), lazy.bias.float()
        self.scale = C.optional_float("lazy_attn", "softmax_scale", scale)

    def needs_grad(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                            or self.tau.requires_grad or self.bias.requires_grad)

    def dense(self, q, k, v, seqlens=None):
        return adaattn.lazy_attn(q, k, v, self.tau, self.bias, softmax_scale=self.scale,
                                 seqlens=seqlens)

    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
        if cu_seqlens_q is not cu_seqlens_k and not torch.equal(cu_seqlens_q, cu_seqlens_k):
            raise ValueError("adaattn: lazy attention of packed sequences is self-attention: "
                             "cu_seq_lens_q must equal cu_seq_lens_k")
        return adaattn.lazy_attn_varlen(q, k, v, cu_seqlens_q, self.tau, self.bias,
                                        softmax_scale=self.scale)

    def decode(self, q, k_cache, v_cache, cache_seqlens):
        return _LAZY_KVCACHE_OP(q, k_cache, v_cache, None, None, self.tau, self.bias,
                                cache_seqlens, None, self.scale, 0)[0]


class _PackedMemo:
    """The last :func:`_packed_cu_seqlens` answer: every layer of a forward gets the same
    ``position_ids`` tensor, so the host sync of the packing check happens once per forward."""

    positions = None  # weakref to the position_ids tensor
    key = None  # (its version counter, batch, length)
    cu_seqlens = None


def _version(t: torch.Tensor) -> Optional[int]:
    """The in-place version counter, or None for inference tensors (which have none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _packed_cu_seqlens(position_ids: Optional[torch.Tensor], batch: int,
                       length: int) -> Optional[torch.Tensor]:
    """int32 ``cu_seqlens [N + 1]`` over the ``batch * length`` tokens when ``position_ids
    [B | 1, length]`` restart somewhere (packed sequences), else None (one host sync per
    ``position_ids`` tensor, as long as it is not modified in place)."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != length:
        return None
    key = (_version(position_ids), batch, length)
    memo = _PackedMemo
    if (key[0] is not None and memo.positions is not None and memo.positions() is position_ids
            and memo.key == key):
        return memo.cu_seqlens
    positions = position_ids.expand(batch, length)
    starts = torch.ones(batch, length, dtype=torch.bool, device=positions.device)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    cu_seqlens = None
    if bool(starts[:, 1:].any()):
        first = starts.flatten().nonzero().flatten()
        total = torch.tensor([batch * length], device=first.device)
        cu_seqlens = torch.cat([first, total]).to(torch.int32)
    if key[0] is not None:
        memo.positions, memo.key, memo.cu_seqlens = weakref.ref(position_ids), key, cu_seqlens
    return cu_seqlens


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [B, H, L, D]`` with its rows reordered per batch by ``index [B, L]``."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def _attend(kernel, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
            cu_seq_lens_q: Optional[torch.Tensor], cu_seq_lens_k: Optional[torch.Tensor]
            ) -> torch.Tensor:
    """q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D(v)]`` -> ``[B, Lq, Hq, Dv]`` (the layout the
    models reshape); see the module docstring for the cases."""
    if (cu_seq_lens_q is None) != (cu_seq_lens_k is None):
        raise ValueError("adaattn: pass both cu_seq_lens_q and cu_seq_lens_k, or neither")
    args = (attention_mask, position_ids, cu_seq_lens_q, cu_seq_lens_k)
    device_type = query.device.type
    if not torch.is_autocast_enabled(device_type):
        return _attend_exact(kernel, query, key, value, *args)
    # As autocast does for SDPA: RoPE can leave q/k in float32 while v has the autocast dtype.
    dtype = torch.get_autocast_dtype(device_type)
    query, key, value = (t.to(dtype) for t in (query, key, value))
    with torch.autocast(device_type, enabled=False):
        return _attend_exact(kernel, query, key, value, *args)


def _attend_exact(kernel, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                  cu_seq_lens_q: Optional[torch.Tensor], cu_seq_lens_k: Optional[torch.Tensor]
                  ) -> torch.Tensor:
    """:func:`_attend` with q, k and v of one dtype, outside autocast (the check of autocast's
    state is cheap; entering its context is not, at every layer of every decode step)."""
    batch, heads, len_q, _ = query.shape
    if attention_mask is None:
        if cu_seq_lens_q is None and key.shape[2] == len_q:
            cu_seq_lens_q = cu_seq_lens_k = _packed_cu_seqlens(position_ids, batch, len_q)
        if cu_seq_lens_q is not None:
            def tokens(x):
                return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])
            out = kernel.varlen(tokens(query), tokens(key), tokens(value),
                                cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32))
            return out.view(batch, len_q, heads, -1)
        if (len_q < key.shape[2] and not kernel.needs_grad(query, key, value)
                and heads // key.shape[1] * len_q <= DECODE_MAX_ROWS):
            # The cache already holds the new keys: keys [0, Lk), row r at Lk - Lq + r.
            return kernel.decode(query, key, value,
                                 _full_seqlens(batch, key.shape[2], query.device)).transpose(1, 2)
        return kernel.dense(query, key, value).transpose(1, 2)
    if attention_mask.dim() == 1:
        return kernel.dense(query, key[:, :, :len_q], value[:, :, :len_q],
                            seqlens=attention_mask).transpose(1, 2)
    if attention_mask.dim() != 2:
        raise NotImplementedError(
            "adaattn: attention_mask must be a 2D padding mask [B, L] (transformers builds "
            f"it from one); got a prepared mask of shape {tuple(attention_mask.shape)}; use "
            "attn_implementation='sdpa' for custom 4D masks")
    length = attention_mask.shape[-1]
    key, value = key[:, :, :length], value[:, :, :length]
    seqlens = attention_mask.sum(-1, dtype=torch.int32)
    # Unmasked tokens first, in order: each row becomes right-padded for the seqlens ops.
    order = torch.argsort((~attention_mask).to(torch.uint8), dim=-1, stable=True)
    key, value = _gather_rows(key, order), _gather_rows(value, order)
    if len_q == length:
        out = kernel.dense(_gather_rows(query, order), key, value, seqlens=seqlens)
        return _gather_rows(out, torch.argsort(order, dim=-1)).transpose(1, 2)
    if kernel.needs_grad(query, key, value):
        raise NotImplementedError(
            "adaattn: gradients through a padded batch against cached keys (Lq < Lk) are "
            "not supported; train without a cache or without attention_mask padding")
    return kernel.decode(query, key, value, seqlens).transpose(1, 2)


def _attention_sinks(module: nn.Module,
                     s_aux: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The call's attention sinks (``s_aux``, else ``module.sinks``; ``[Hq]``, one logit per head
    in every row's softmax denominator, e.g. GPT-OSS) as the ops take them: float32 (a cast
    that autograd follows back to the model's parameter)."""
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    if sinks is None:
        return None
    return sinks.float()


def _check_call(module: nn.Module, dropout: float) -> None:
    if dropout:
        raise NotImplementedError(
            f"adaattn: attention dropout is not supported (dropout={dropout}); set the config's "
            "attention_dropout to 0.0")


def adaattn_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                              dropout: float = 0.0, scaling: Optional[float] = None,
                              sliding_window: Optional[int] = None,
                              softcap: Optional[float] = None, is_causal: Optional[bool] = None,
                              s_aux: Optional[torch.Tensor] = None,
                              position_ids: Optional[torch.Tensor] = None,
                              cu_seq_lens_q: Optional[torch.Tensor] = None,
                              cu_seq_lens_k: Optional[torch.Tensor] = None,
                              **kwargs) -> Tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` entry of ``attn_implementation="adaattn"``.

    Args:
        module: the model's attention module (``is_causal`` is read from it unless passed).
        query: ``[B, Hq, Lq, D]``; key: ``[B, Hkv, Lk, D]``; value: ``[B, Hkv, Lk, Dv]``
            (``Lk`` = cached + new keys during generation).
        attention_mask: what :func:`adaattn_mask` returned.
        dropout: must be 0.
        scaling: softmax scale (default ``D ** -0.5``).
        sliding_window: a query attends the ``sliding_window`` most recent keys including
            itself (both sides when not causal), as transformers' masks define it.
        softcap: ``s <- softcap * tanh(s / softcap)`` on the scaled scores (None = off).
        is_causal: overrides ``module.is_causal``.
        s_aux: attention sinks ``[Hq]`` (else ``module.sinks`` is read), e.g. GPT-OSS.
        position_ids: ``[B | 1, Lq]``; restarts mark packed sequences (no mask, ``Lq == Lk``).
        cu_seq_lens_q, cu_seq_lens_k: int ``[N + 1]`` boundaries of packed sequences over the
            ``B * L`` tokens (transformers' padding-free kwargs).

    Returns:
        ``(out [B, Lq, Hq, Dv], None)`` (no attention weights).
    """
    _check_call(module, dropout)
    sinks = _attention_sinks(module, s_aux)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    kernel = _flash_kernel(causal, scaling, sliding_window, softcap)
    if sinks is not None:
        kernel = _FlashWithSinks(kernel, sinks)
    return _attend(kernel, query, key, value, attention_mask, position_ids, cu_seq_lens_q,
                   cu_seq_lens_k), None


def lazy_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                           dropout: float = 0.0, scaling: Optional[float] = None,
                           sliding_window: Optional[int] = None,
                           softcap: Optional[float] = None, is_causal: Optional[bool] = None,
                           s_aux: Optional[torch.Tensor] = None,
                           position_ids: Optional[torch.Tensor] = None,
                           cu_seq_lens_q: Optional[torch.Tensor] = None,
                           cu_seq_lens_k: Optional[torch.Tensor] = None,
                           **kwargs) -> Tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` entry of ``attn_implementation="adaattn_lazy"``: lazy
    attention with ``module.lazy_attention``'s ``tau [Hq]`` and ``bias [Hq, W]`` (see
    :func:`use_lazy_attention`). Arguments and result as :func:`adaattn_attention_forward`;
    always causal, no softcap, no sliding window (lazy attention sees the whole prefix, with its
    own bias table over the last ``W`` distances).
    """
    _check_call(module, dropout)
    if _attention_sinks(module, s_aux) is not None:
        raise NotImplementedError("adaattn: lazy attention has no attention sinks")
    lazy = getattr(module, "lazy_attention", None)
    if not isinstance(lazy, LazyAttention):
        raise ValueError(
            f"adaattn: {type(module).__name__} has no lazy_attention parameters; convert the "
            "model with adaattn.integrations.transformers.use_lazy_attention(model)")
    if is_causal is False or (is_causal is None and not getattr(module, "is_causal", True)):
        raise NotImplementedError("adaattn: lazy attention is causal only")
    if softcap:
        raise NotImplementedError(
            f"adaattn: lazy attention has no score soft-capping (softcap={softcap})")
    if sliding_window:
        raise ValueError(
            f"adaattn: lazy attention attends the whole prefix, got sliding_window="
            f"{sliding_window}; use_lazy_attention(model) turns the model's sliding-window "
            "layers into full-attention ones")
    return _attend(_Lazy(lazy, scaling), query, key, value, attention_mask, position_ids,
                   cu_seq_lens_q, cu_seq_lens_k), None


def use_lazy_attention(model: nn.Module, window: int = 512, tau_init: float = -1.0) -> nn.Module:
    """Swaps the attention of a Llama-family model (``LAZY_MODEL_TYPES``) for lazy attention.

    Every attention module (one with ``q_proj`` and ``o_proj``) gets a
    :class:`adaattn.nn.LazyAttention` submodule ``lazy_attention`` owning float32 parameters
    ``tau [Hq]`` (filled with ``tau_init``) and ``bias [Hq, window]`` (zeros), on the module's
    device, so they train, appear in ``model.parameters()`` and save in ``state_dict()``
    (``...self_attn.lazy_attention.tau``; to load such a checkpoint, convert the fresh model
    first). The model then runs ``attn_implementation="adaattn_lazy"``. Converting twice keeps
    the existing parameters.

    Lazy attention is causal: ``s_ij = scale * q_i.k_j + bias[h, i - j]`` (``i - j < window``),
    weights ``max(0, softmax_j(s_ij) + tau[h] / (i + 1))`` (see :func:`adaattn.lazy_attn`). It
    attends the whole prefix, so the model's sliding-window layers become full-attention ones
    (``config.layer_types`` all ``"full_attention"``, or ``config.sliding_window = None`` for
    models without layer types, e.g. Mistral): caches then keep every token, as lazy attention's
    positions and weights need.

    Args:
        model: a transformers model whose ``config.model_type`` is in ``LAZY_MODEL_TYPES``.
        window: length ``W`` of each head's relative-position bias table.
        tau_init: initial ``tau`` of every head (``-1.0`` zeroes weights below ``1 / (i + 1)``).

    Returns:
        ``model``, converted in place.
    """
    config = model.config
    if config.model_type not in LAZY_MODEL_TYPES:
        raise ValueError(f"adaattn: use_lazy_attention supports model types {LAZY_MODEL_TYPES}, "
                         f"got model.config.model_type={config.model_type!r}")
    modules = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "o_proj")]
    if not modules:
        raise ValueError(f"adaattn: found no attention module in {type(model).__name__}")
    for module in modules:
        if not hasattr(module, "lazy_attention"):
            module.lazy_attention = LazyAttention(config.num_attention_heads, window, tau_init).to(
                module.q_proj.weight.device)
        if getattr(module, "sliding_window", None) is not None:
            module.sliding_window = None
    # Models with layer types look their masks up by type and keep their own sliding-window
    # mask; the others (Mistral) read config.sliding_window in every forward.
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"] * len(config.layer_types)
    elif getattr(config, "sliding_window", None) is not None:
        config.sliding_window = None
    model.set_attn_implementation(LAZY_ATTN_IMPLEMENTATION)
    return model


AttentionInterface.register(ATTN_IMPLEMENTATION, adaattn_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, adaattn_mask)
AttentionInterface.register(LAZY_ATTN_IMPLEMENTATION, lazy_attention_forward)
AttentionMaskInterface.register(LAZY_ATTN_IMPLEMENTATION, adaattn_mask)
