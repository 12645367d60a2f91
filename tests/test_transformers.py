"""Tests of adaattn.integrations.transformers (attn_implementation="adaattn", use_lazy_attention).

Tiny randomly initialised models built here (Llama with GQA, Qwen2 with a sliding layer, Mistral
with a sliding window, Gemma 2 with softcap and sliding layers, Gemma, Qwen3) run on the CPU.
The reference is transformers' own "sdpa" (exact in float64), or "eager" for Gemma 2, whose
softcap sdpa ignores: eager takes its softmax in float32, so that comparison runs in float32.
Bars: float64 relative error <= 1e-12, float32 <= 1e-5 (accuracy.py's fp32 rule); greedy tokens
identical. Generation is also checked for the ops it calls (the KV-cache op at every decode
step, the dense op for long chunks against a cache) and with static caches. Lazy attention is
checked against adaattn.lazy_attn on the module's own q/k/v and against cache-free decoding, and
must train (loss falls) and save/load through state_dict. About 20 s of CPU on an idle core.
"""
import copy
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import adaattn  # noqa: E402
from adaattn import reference  # noqa: E402
from adaattn.integrations import transformers as hf  # noqa: E402
from adaattn.nn import LazyAttention  # noqa: E402
from accuracy import FP32_RTOL, assert_low_precision_rule, assert_rel_close  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP64_RTOL = 1e-12
VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, initializer_range=0.2, pad_token_id=0)


CONFIGS = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen2": (transformers.Qwen2Config,
              dict(use_sliding_window=True, sliding_window=8,
                   layer_types=["full_attention", "sliding_attention"])),
    "qwen3": (transformers.Qwen3Config, {}),
    "mistral": (transformers.MistralConfig, dict(sliding_window=8)),
    "gemma": (transformers.GemmaConfig, {}),
    "gemma2": (transformers.Gemma2Config,
               dict(sliding_window=8, attn_logit_softcapping=5.0, query_pre_attn_scalar=16)),
}


def _config(name, **overrides):
    """Tiny configs; sliding windows of 8 are shorter than the 19-token test sequences."""
    config_class, defaults = CONFIGS[name]
    return config_class(**{**COMMON, **defaults, **overrides})


MODELS = list(CONFIGS)


def _model(name, dtype=torch.float64, attn="adaattn", **overrides):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(name, **overrides),
                                                          attn_implementation=attn)
    return model.to(dtype).eval()


def _reference_impl(name):
    return "eager" if name == "gemma2" else "sdpa"


def _logits(model, impl, *args, **kwargs):
    """Logits of a cache-free forward (with a cache, transformers' own masks ignore packing)."""
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(*args, use_cache=False, **kwargs).logits


def _ids(batch, length, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=generator)


def _padding(kind, batch=3, length=19):
    """int64 ``[batch, length]`` masks: none, right padding, left padding (row 0 unpadded)."""
    mask = torch.ones(batch, length, dtype=torch.long)
    if kind == "right":
        mask[1, 12:] = 0
        mask[2, 5:] = 0
    elif kind == "left":
        mask[1, :7] = 0
        mask[2, :14] = 0
    return mask


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_reference(name):
    dtype = torch.float32 if name == "gemma2" else torch.float64
    rtol = FP32_RTOL if dtype == torch.float32 else FP64_RTOL
    model = _model(name, dtype)
    ids = _ids(2, 19)
    ours = _logits(model, "adaattn", ids)
    assert_rel_close("logits", ours, _logits(model, _reference_impl(name), ids), rtol)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_logits_match_sdpa_float32(name):
    model = _model(name, torch.float32)
    ids = _ids(2, 19)
    assert_rel_close("logits", _logits(model, "adaattn", ids), _logits(model, "sdpa", ids),
                     FP32_RTOL)


@pytest.mark.parametrize("name, plain_overrides", [
    ("mistral", dict(sliding_window=None)),
    ("gemma2", dict(attn_logit_softcapping=None)),
])
def test_sliding_window_and_softcap_take_effect(name, plain_overrides):
    """The reference comparisons above are not vacuous: without the window (or the softcap)
    the logits differ well beyond the tolerance."""
    model = _model(name, torch.float32)
    plain = _model(name, torch.float32, **plain_overrides)
    plain.load_state_dict(model.state_dict())
    ids = _ids(2, 19)
    diff = (_logits(model, "adaattn", ids) - _logits(plain, "adaattn", ids)).abs().max()
    assert diff > 1e-2


@pytest.mark.parametrize("kind", ["right", "left"])
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_padded_batch(name, kind):
    """Logits of the unmasked tokens match the reference on the same padded batch."""
    dtype = torch.float32 if name == "gemma2" else torch.float64
    rtol = FP32_RTOL if dtype == torch.float32 else FP64_RTOL
    model = _model(name, dtype)
    ids, mask = _ids(3, 19), _padding(kind)
    ours = _logits(model, "adaattn", ids, attention_mask=mask)
    ref = _logits(model, _reference_impl(name), ids, attention_mask=mask)
    keep = mask.bool()
    assert_rel_close("logits", ours[keep], ref[keep], rtol)
    assert torch.isfinite(ours).all()


def test_right_padded_rows_equal_unpadded_sequences():
    model = _model("llama")
    ids, mask = _ids(3, 19), _padding("right")
    padded = _logits(model, "adaattn", ids, attention_mask=mask)
    for row, length in enumerate(mask.sum(-1).tolist()):
        alone = _logits(model, "adaattn", ids[row:row + 1, :length])
        assert_rel_close("logits", padded[row, :length], alone[0], FP64_RTOL)


def test_padding_mask_kinds():
    """The mask function hands the attention call seqlens for right padding (no copy), the
    bool mask for other padding, and nothing for a full mask."""
    def mask_for(mask, q_length=19, kv_length=19):
        return hf.adaattn_mask(batch_size=3, q_length=q_length, kv_length=kv_length,
                               attention_mask=mask.bool())

    assert mask_for(_padding("none")) is None
    seqlens = mask_for(_padding("right"))
    assert seqlens.dtype == torch.int32 and seqlens.tolist() == [19, 12, 5]
    left = _padding("left")
    assert torch.equal(mask_for(left), left.bool())
    assert torch.equal(mask_for(left, q_length=1), left.bool())


def _packed(lengths, seed=2):
    """Sequences of the given lengths, alone and flattened into one row by transformers'
    DataCollatorWithFlattening (position_ids restart; cu_seq_lens_* kwargs)."""
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = collator([{"input_ids": s.tolist()} for s in sequences])
    return sequences, batch


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_packed_batch_equals_separate_sequences(name):
    dtype = torch.float32 if name == "gemma2" else torch.float64
    rtol = FP32_RTOL if dtype == torch.float32 else FP64_RTOL
    model = _model(name, dtype)
    sequences, batch = _packed([5, 11, 1, 9])
    ids, positions = batch["input_ids"], batch["position_ids"]
    by_positions = _logits(model, "adaattn", ids, position_ids=positions)[0]
    flash_kwargs = {key: batch[key] for key in ("cu_seq_lens_q", "cu_seq_lens_k",
                                                "max_length_q", "max_length_k")}
    by_cu = _logits(model, "adaattn", ids, position_ids=positions, **flash_kwargs)[0]
    alone = torch.cat([_logits(model, "adaattn", s[None])[0] for s in sequences])
    assert_rel_close("logits (position_ids)", by_positions, alone, rtol)
    assert_rel_close("logits (cu_seq_lens)", by_cu, alone, rtol)
    assert_rel_close("logits vs reference", by_positions,
                     _logits(model, _reference_impl(name), ids, position_ids=positions)[0], rtol)


def test_packing_check_runs_once_per_position_ids():
    """Every layer gets the same position_ids: the packing check (a host sync) is remembered
    for that tensor until it changes in place; inference tensors are checked every time."""
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    first = hf._packed_cu_seqlens(positions, 1, 5)
    assert first.tolist() == [0, 3, 5]
    assert hf._packed_cu_seqlens(positions, 1, 5) is first
    assert hf._packed_cu_seqlens(positions, 2, 5).tolist() == [0, 3, 5, 8, 10]
    positions[0, 3:] = torch.tensor([3, 4])
    assert hf._packed_cu_seqlens(positions, 2, 5) is None
    with torch.inference_mode():
        positions = torch.tensor([[0, 1, 0]])
        assert hf._packed_cu_seqlens(positions, 1, 3).tolist() == [0, 2, 3]
        positions[0, 2] = 2
        assert hf._packed_cu_seqlens(positions, 1, 3) is None


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_padded_and_packed_batches_agree(name):
    """The same sequences as a right-padded batch and as one packed row give the same logits
    for every token."""
    model = _model(name)
    sequences, batch = _packed([7, 16, 3, 11])
    packed = _logits(model, "adaattn", batch["input_ids"], position_ids=batch["position_ids"])[0]
    length = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(sequences):
        ids[row, :len(s)], mask[row, :len(s)] = s, 1
    padded = _logits(model, "adaattn", ids, attention_mask=mask)
    assert_rel_close("logits", padded[mask.bool()], packed, FP64_RTOL)


@pytest.mark.parametrize("name, kind", [("llama", "none"), ("llama", "right"), ("llama", "left"),
                                        ("llama", "packed"), ("qwen2", "packed")])
def test_training_step_gradients_match_sdpa(name, kind):
    """A training step's loss and every parameter gradient match sdpa in float64 (Qwen2 with
    one sliding-window layer)."""
    model = _model(name).train()
    if kind == "packed":
        _, batch = _packed([7, 12, 5])
        inputs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        labels = batch["labels"]
    else:
        ids, mask = _ids(3, 19), _padding(kind)
        inputs = dict(input_ids=ids, attention_mask=mask)
        labels = ids.masked_fill(mask == 0, -100)
    results = {}
    for impl in ("adaattn", "sdpa"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        loss = model(**inputs, labels=labels, use_cache=False).loss
        loss.backward()
        results[impl] = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    names = ["loss"] + [n for n, _ in model.named_parameters()]
    for name, ours, ref in zip(names, results["adaattn"], results["sdpa"]):
        assert_rel_close(name, ours, ref, FP64_RTOL)


def _generate(model, impl, ids, mask=None, use_cache=True, new_tokens=10):
    model.set_attn_implementation(impl)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         use_cache=use_cache, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gemma2"])
def test_generate_matches_reference(name, padding):
    """Greedy generation with transformers' DynamicCache: identical tokens, and the logits of
    every step (prefill dense or compacted, then the KV-cache op) match the reference. 12 new
    tokens after 19 run past the sliding windows of 8."""
    dtype = torch.float32 if name == "gemma2" else torch.float64
    rtol = FP32_RTOL if dtype == torch.float32 else FP64_RTOL
    model = _model(name, dtype)
    ids, mask = _ids(3, 19), _padding(padding)
    tokens, logits = _generate(model, "adaattn", ids, mask, new_tokens=12)
    ref_tokens, ref_logits = _generate(model, _reference_impl(name), ids, mask, new_tokens=12)
    assert torch.equal(tokens, ref_tokens)
    assert_rel_close("logits", logits, ref_logits, rtol)


class _OpCalls:
    """Counts the calls of adaattn's attention ops made through the integration (its kernels'
    dense / varlen / decode methods, each the only caller of its op)."""

    OPS = {"flash_attn": (hf._Flash, "dense"), "flash_attn_varlen": (hf._Flash, "varlen"),
           "flash_attn_with_kvcache": (hf._Flash, "decode"), "lazy_attn": (hf._Lazy, "dense"),
           "lazy_attn_varlen": (hf._Lazy, "varlen"),
           "lazy_attn_with_kvcache": (hf._Lazy, "decode")}

    def __init__(self, monkeypatch):
        self.counts = dict.fromkeys(self.OPS, 0)
        for name, (cls, method) in self.OPS.items():
            monkeypatch.setattr(cls, method, self._counted(name, getattr(cls, method)))

    def _counted(self, name, op):
        def counted(*args, **kwargs):
            self.counts[name] += 1
            return op(*args, **kwargs)
        return counted

    def take(self):
        """The counts since the last take (nonzero ones)."""
        counts = {name: n for name, n in self.counts.items() if n}
        self.counts = dict.fromkeys(self.OPS, 0)
        return counts


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("impl", ["adaattn", hf.LAZY_ATTN_IMPLEMENTATION])
def test_generate_decode_steps_use_the_kvcache_op(monkeypatch, impl, padding):
    """generate(): the prefill runs the dense op once per layer, and every decode step the
    KV-cache op (the split-KV decode kernel on CUDA) once per layer, never the dense one."""
    model = _lazy_model() if impl == hf.LAZY_ATTN_IMPLEMENTATION else _model("llama")
    calls = _OpCalls(monkeypatch)
    new_tokens, layers = 6, model.config.num_hidden_layers
    _generate(model, impl, _ids(3, 19), _padding(padding), new_tokens=new_tokens)
    family = "flash" if impl == "adaattn" else "lazy"
    assert calls.take() == {f"{family}_attn": layers,
                            f"{family}_attn_with_kvcache": layers * (new_tokens - 1)}


@pytest.mark.parametrize("impl", ["adaattn", hf.LAZY_ATTN_IMPLEMENTATION])
def test_chunks_against_a_cache(monkeypatch, impl):
    """Forwards of 10, 40 and 5 tokens against a DynamicCache equal one forward of all 55: the
    40-token chunk (2 * 40 query rows per kv head > DECODE_MAX_ROWS) runs the dense op, the
    5-token chunk the KV-cache op."""
    model = _lazy_model() if impl == hf.LAZY_ATTN_IMPLEMENTATION else _model("llama")
    model.set_attn_implementation(impl)
    ids = _ids(2, 55)
    family = "flash" if impl == "adaattn" else "lazy"
    calls = _OpCalls(monkeypatch)
    cache = transformers.DynamicCache(config=model.config)
    chunks = []
    with torch.no_grad():
        for start, stop, op in ((0, 10, "attn"), (10, 50, "attn"), (50, 55, "attn_with_kvcache")):
            chunks.append(model(ids[:, start:stop], past_key_values=cache, use_cache=True).logits)
            assert calls.take() == {f"{family}_{op}": 2}
    assert_rel_close("logits", torch.cat(chunks, 1), _logits(model, impl, ids), FP64_RTOL)


@pytest.mark.parametrize("padding", ["none", "left"])
def test_generate_with_a_static_cache(padding):
    """cache_implementation="static": the attention gets the whole preallocated key buffer,
    and generate() prepares the masks ahead of the forward (the mask function then reads its
    own output); tokens and logits match sdpa."""
    model = _model("llama")
    ids, mask = _ids(3, 19), _padding(padding)
    results = {}
    for impl in ("adaattn", "sdpa"):
        model.set_attn_implementation(impl)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                             cache_implementation="static", output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        results[impl] = out.sequences, torch.stack(out.logits, 1)
    assert torch.equal(results["adaattn"][0], results["sdpa"][0])
    assert_rel_close("logits", results["adaattn"][1], results["sdpa"][1], FP64_RTOL)


def test_static_cache_without_a_mask():
    """A StaticCache used without attention_mask: only the slots that hold tokens are keys."""
    model = _model("llama")
    ids = _ids(2, 19)
    results = {}
    for impl in ("adaattn", "sdpa"):
        model.set_attn_implementation(impl)
        cache = transformers.StaticCache(config=model.config, max_cache_len=40)
        with torch.no_grad():
            results[impl] = torch.cat(
                [model(ids[:, a:b], past_key_values=cache, use_cache=True).logits
                 for a, b in ((0, 12), (12, 18), (18, 19))], 1)
    assert_rel_close("logits", results["adaattn"], results["sdpa"], FP64_RTOL)


def test_bidirectional_model_matches_sdpa():
    """An encoder (BERT: is_causal = False) with right and left padding."""
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).double().eval()
    ids, mask = _ids(3, 19), _padding("right")
    mask[0, :6] = 0
    outs = {}
    for impl in ("adaattn", "sdpa"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = model(ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()
    assert_rel_close("hidden states", outs["adaattn"][keep], outs["sdpa"][keep], FP64_RTOL)


def _bf16_copy(model, device):
    return copy.deepcopy(model).to(device=device, dtype=torch.bfloat16)


@pytest.mark.parametrize("name,head_dim", [("llama", 64), ("gemma2", 64), ("gemma2", 256)])
def test_bfloat16_logits(name, head_dim, device):
    """bfloat16 (on CUDA the tensor-core kernels; Gemma 2 also at its own head dim, 256, with
    softcap and sliding layers) for a plain, a left-padded and a packed batch: flash-attn's rule
    against float64 (float32 for Gemma 2's eager reference, whose float64 masks overflow in
    padded rows), the reference implementation run in bfloat16 on the same device setting the
    bar. Padding rows are left out."""
    model = _model(name, torch.float32 if name == "gemma2" else torch.float64, head_dim=head_dim)
    low = _bf16_copy(model, device)
    reference_impl = _reference_impl(name)
    _, packed = _packed([5, 11, 3])
    ids, mask = _ids(3, 19), _padding("left")
    cases = {"plain": dict(input_ids=ids),
             "left padded": dict(input_ids=ids, attention_mask=mask),
             "packed": dict(input_ids=packed["input_ids"], position_ids=packed["position_ids"])}
    for case, inputs in cases.items():
        keep = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
        on_device = {key: value.to(device) for key, value in inputs.items()}
        truth = _logits(model, reference_impl, **inputs)[keep]
        ours = _logits(low, "adaattn", **on_device)[keep.to(device)]
        ref_low = _logits(low, reference_impl, **on_device)[keep.to(device)]
        assert_low_precision_rule(f"{case} logits", ours, ref_low, truth)


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("name,head_dim", [("llama", 64), ("gemma2", 256)])
def test_bfloat16_generate_decode_steps(name, head_dim, padding, device):
    """bfloat16 generation (on CUDA the prefill and split-KV decode kernels; at Gemma 2's head
    dim 256 the prefill kernels on the cache): the logits of every step obey flash-attn's rule
    against float64 full forwards over the generated tokens (float32 for Gemma 2's eager
    reference; teacher forcing, positions as generate() derives them from the mask), the
    reference implementation's bfloat16 full forwards setting the bar."""
    model = _model(name, torch.float32 if name == "gemma2" else torch.float64, head_dim=head_dim)
    reference_impl = _reference_impl(name)
    low = _bf16_copy(model, device)
    ids, mask = _ids(3, 19), _padding(padding)
    tokens, logits = _generate(low, "adaattn", ids.to(device), mask.to(device), new_tokens=8)
    full = torch.cat([ids, tokens.cpu()], 1)
    full_mask = torch.cat([mask, torch.ones_like(tokens.cpu())], 1)
    positions = (full_mask.cumsum(-1) - 1).masked_fill(full_mask == 0, 1)
    steps = slice(ids.shape[1] - 1, -1)
    truth = _logits(model, reference_impl, full, attention_mask=full_mask,
                    position_ids=positions)
    ref_low = _logits(low, reference_impl, full.to(device), attention_mask=full_mask.to(device),
                      position_ids=positions.to(device))
    assert_low_precision_rule("logits", logits, ref_low[:, steps], truth[:, steps])


def test_cpu_autocast_bfloat16():
    """Under bfloat16 autocast (float32 weights; RoPE hands over float32 q/k and a bfloat16 v)
    the logits obey flash-attn's rule against float64, sdpa under the same autocast setting the
    bar."""
    model = _model("llama")
    low = copy.deepcopy(model).float()
    ids = _ids(2, 19)
    truth = _logits(model, "sdpa", ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _logits(low, "adaattn", ids)
        ref_low = _logits(low, "sdpa", ids)
    assert_low_precision_rule("logits", ours, ref_low, truth)


def test_mask_function_rejects_overlays_chunks_and_masked_queries():
    with pytest.raises(NotImplementedError, match="or_mask_function"):
        hf.adaattn_mask(batch_size=1, q_length=4, kv_length=4, use_vmap=True)
    masking = transformers.masking_utils
    blocks = masking.or_masks(masking.causal_mask_function,
                              masking.blockwise_overlay(torch.tensor([[0, 0, 1, 1]])))
    with pytest.raises(NotImplementedError, match="block_sequence_ids"):
        hf.adaattn_mask(batch_size=1, q_length=4, kv_length=4, mask_function=blocks)
    chunked = transformers.PretrainedConfig(layer_types=["chunked_attention", "full_attention"])
    with pytest.raises(NotImplementedError, match="chunked attention"):
        hf.adaattn_mask(batch_size=1, q_length=4, kv_length=4, config=chunked)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, -1] = False
    with pytest.raises(ValueError, match="new query tokens"):
        hf.adaattn_mask(batch_size=2, q_length=2, kv_length=6, attention_mask=mask)


class _Module(torch.nn.Module):
    is_causal = True


def _gpt_oss(dtype=torch.float32):
    """A tiny GPT-OSS: learnable sinks in every layer, sliding and full layers, MoE MLPs (whose
    grouped GEMM takes no float64)."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        **{**COMMON, "intermediate_size": 64}, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.self_attn.sinks, mean=1.0, std=1.0)
    return model.to(dtype).eval()


def test_gpt_oss_sinks_match_eager():
    """GPT-OSS's sinks (s_aux) reach the ops: logits, packed logits, the sinks' gradients and
    greedy generation (decode steps on the KV-cache op), also of a left-padded batch through
    the sliding layers, equal transformers' eager attention."""
    model = _gpt_oss()
    ids = _ids(2, 19)
    expected = _logits(model, "eager", ids)
    assert_rel_close("logits", _logits(model, "adaattn", ids), expected, FP32_RTOL)
    packed = torch.cat([ids[0, :11], ids[1, :8]])[None]
    positions = torch.cat([torch.arange(11), torch.arange(8)])[None]
    ours = _logits(model, "adaattn", packed, position_ids=positions)
    assert_rel_close("packed", ours[0, 11:], _logits(model, "eager", ids[1:, :8])[0], FP32_RTOL)
    grads = {}
    for impl in ("eager", "adaattn"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        model(ids, labels=ids, use_cache=False).loss.backward()
        grads[impl] = torch.stack([layer.self_attn.sinks.grad for layer in model.model.layers])
    assert grads["eager"].abs().sum() > 0
    assert_rel_close("d sinks", grads["adaattn"], grads["eager"], FP32_RTOL)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    tokens, padded = {}, {}
    for impl in ("eager", "adaattn"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(ids[:1, :10], max_new_tokens=12, do_sample=False,
                                      min_new_tokens=12)
        padded[impl] = model.generate(ids[:, :10], attention_mask=mask, max_new_tokens=12,
                                      do_sample=False, min_new_tokens=12, pad_token_id=0)
    assert torch.equal(tokens["adaattn"], tokens["eager"])
    assert torch.equal(padded["adaattn"], padded["eager"])


def test_unsupported_calls_raise():
    q = torch.randn(1, 4, 5, 16)
    k = v = torch.randn(1, 2, 5, 16)
    with_sinks = _Module()
    with_sinks.sinks = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(NotImplementedError, match="sinks"):
        hf.lazy_attention_forward(with_sinks, q, k, v, None)
    with pytest.raises(NotImplementedError, match="dropout"):
        hf.adaattn_attention_forward(_Module(), q, k, v, None, dropout=0.1)
    with pytest.raises(NotImplementedError, match="4D"):
        hf.adaattn_attention_forward(_Module(), q, k, v, torch.zeros(1, 1, 5, 5))
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        hf.adaattn_attention_forward(_Module(), q, k, v, None,
                                     cu_seq_lens_q=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="use_lazy_attention"):
        hf.lazy_attention_forward(_Module(), q, k, v, None)
    lazy = _Module()
    lazy.lazy_attention = LazyAttention(4, 8, -1.0)
    with pytest.raises(ValueError, match="sliding_window=8"):
        hf.lazy_attention_forward(lazy, q, k, v, None, sliding_window=8)
    lazy.sinks = with_sinks.sinks
    with pytest.raises(NotImplementedError, match="sinks"):
        hf.lazy_attention_forward(lazy, q, k, v, None)


def test_call_options_are_checked_once_per_configuration_without_losing_checks():
    """The options of a call are checked once per configuration (types included, so a bool
    scale is not taken for a checked 1.0) and still raise the wrappers' errors."""
    q = torch.randn(1, 4, 5, 16, dtype=torch.float64)
    k = v = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    out, _ = hf.adaattn_attention_forward(_Module(), q, k, v, None, scaling=1.0)
    ref, _ = reference.flash_attn(q, k, v, causal=True, softmax_scale=1.0)
    assert_rel_close("out", out, ref.transpose(1, 2), FP64_RTOL)
    with pytest.raises(TypeError, match="softmax_scale must be a float"):
        hf.adaattn_attention_forward(_Module(), q, k, v, None, scaling=True)
    with pytest.raises(TypeError, match="softmax_scale must be a float"):
        hf.adaattn_attention_forward(_Module(), q, k, v, None, scaling="0.25")
    with pytest.raises(TypeError, match="window must be a pair of ints"):
        hf.adaattn_attention_forward(_Module(), q, k, v, None, sliding_window=2.5)
    with pytest.raises(ValueError, match="softcap"):
        hf.adaattn_attention_forward(_Module(), q, k, v, None, softcap=-1.0)


def test_decode_cache_seqlens_shared_across_layers_and_modes():
    """A decode step's layers share one cache_seqlens tensor; no_grad and inference_mode
    steps of the same shapes each get their own and agree."""
    model = _model("llama")
    model.set_attn_implementation("adaattn")
    ids = _ids(2, 12)
    seen = []
    decode = hf._Flash.decode

    def recording(self, q, k_cache, v_cache, cache_seqlens):
        seen.append(cache_seqlens)
        return decode(self, q, k_cache, v_cache, cache_seqlens)
    logits = []
    for mode in (torch.no_grad, torch.inference_mode, torch.no_grad):
        cache = transformers.DynamicCache(config=model.config)
        with mode():
            model(ids[:, :11], past_key_values=cache, use_cache=True)
            hf._Flash.decode = recording
            try:
                logits.append(model(ids[:, 11:], past_key_values=cache, use_cache=True).logits)
            finally:
                hf._Flash.decode = decode
    layers = model.config.num_hidden_layers
    assert len(seen) == 3 * layers
    for step in range(3):
        assert all(t is seen[step * layers] for t in seen[step * layers:(step + 1) * layers])
        assert seen[step * layers].tolist() == [12, 12]
    assert seen[layers] is not seen[0]
    for other in logits[1:]:
        assert torch.equal(other, logits[0])
    assert_rel_close("logits", logits[0], _logits(model, "sdpa", ids)[:, 11:], FP64_RTOL)


def test_import_adaattn_does_not_import_transformers():
    code = "import sys, adaattn; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---------------------------------------------------------------------------- lazy attention

def _lazy_model(name="llama", dtype=torch.float64, window=8, tau_init=-0.5):
    model = hf.use_lazy_attention(_model(name, dtype), window=window, tau_init=tau_init)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LazyAttention):
                module.tau.add_(0.3 * torch.randn_like(module.tau))
                module.bias.normal_(0.0, 0.5)
    return model


def test_use_lazy_attention_parameters():
    model = hf.use_lazy_attention(_model("qwen2"), window=16, tau_init=-2.0)
    assert model.config._attn_implementation == hf.LAZY_ATTN_IMPLEMENTATION
    params = dict(model.named_parameters())
    for layer in range(2):
        prefix = f"model.layers.{layer}.self_attn.lazy_attention."
        tau, bias = params[prefix + "tau"], params[prefix + "bias"]
        assert tau.dtype == bias.dtype == torch.float32
        assert tau.shape == (4,) and bias.shape == (4, 16)
        assert torch.all(tau == -2.0) and torch.all(bias == 0)
    assert hf.use_lazy_attention(model, window=3) is model
    assert params["model.layers.0.self_attn.lazy_attention.bias"].shape == (4, 16)


def test_use_lazy_attention_rejects_other_models():
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        hf.use_lazy_attention(transformers.GPT2LMHeadModel(config))


def test_lazy_attention_equals_op_on_module_inputs(monkeypatch):
    """Each layer's output is adaattn.lazy_attn (and the float64 reference) of the q/k/v that
    the model hands its attention module, with that module's tau and bias."""
    model = _lazy_model()
    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        out, _ = hf.lazy_attention_forward(module, query, key, value, attention_mask, **kwargs)
        seen.append((module, query, key, value, kwargs["scaling"], out))
        return out, None

    monkeypatch.setitem(transformers.AttentionInterface._global_mapping,
                        hf.LAZY_ATTN_IMPLEMENTATION, spy)
    with torch.no_grad():
        model(_ids(2, 19))
    assert len(seen) == 2
    for module, q, k, v, scale, out in seen:
        tau, bias = module.lazy_attention.tau, module.lazy_attention.bias
        expected = adaattn.lazy_attn(q, k, v, tau, bias, softmax_scale=scale).transpose(1, 2)
        assert torch.equal(out, expected)
        ref, _ = reference.lazy_attn(q, k, v, tau, bias, softmax_scale=scale)
        assert_rel_close("out", out, ref.transpose(1, 2), FP64_RTOL)


def test_lazy_packed_and_padded_equal_separate_sequences():
    """Positions (tau / (i + 1), bias distances) restart in every packed sequence and count
    unmasked tokens in a padded batch."""
    model = _lazy_model()
    sequences, batch = _packed([6, 13, 4])
    packed = _logits(model, hf.LAZY_ATTN_IMPLEMENTATION, batch["input_ids"],
                     position_ids=batch["position_ids"])[0]
    alone = [_logits(model, hf.LAZY_ATTN_IMPLEMENTATION, s[None])[0] for s in sequences]
    assert_rel_close("packed", packed, torch.cat(alone), FP64_RTOL)
    ids = torch.zeros(3, 13, dtype=torch.long)
    mask = torch.zeros(3, 13, dtype=torch.long)
    for row, s in enumerate(sequences):
        ids[row, 13 - len(s):], mask[row, 13 - len(s):] = s, 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    padded = _logits(model, hf.LAZY_ATTN_IMPLEMENTATION, ids, attention_mask=mask,
                     position_ids=positions)
    for row, s in enumerate(sequences):
        assert_rel_close("left padded", padded[row, 13 - len(s):], alone[row], FP64_RTOL)


@pytest.mark.parametrize("name, padding", [("llama", "none"), ("llama", "left"),
                                           ("mistral", "none"), ("qwen2", "left")])
def test_lazy_generate_matches_cache_free_decoding(name, padding):
    """The KV-cache decode steps (adaattn.lazy_attn_with_kvcache) give the tokens and logits of
    recomputing the whole prefix at every step (use_cache=False). Mistral and Qwen2 have
    sliding-window layers (window 8 < 19 tokens), whose caches would drop the tokens that lazy
    attention still attends had use_lazy_attention not made them full-attention layers."""
    model = _lazy_model(name)
    ids, mask = _ids(3, 19), _padding(padding)
    tokens, logits = _generate(model, hf.LAZY_ATTN_IMPLEMENTATION, ids, mask)
    full_tokens, full_logits = _generate(model, hf.LAZY_ATTN_IMPLEMENTATION, ids, mask,
                                         use_cache=False)
    assert torch.equal(tokens, full_tokens)
    assert_rel_close("logits", logits, full_logits, FP64_RTOL)


def test_lazy_attention_trains():
    """tau and bias receive gradients and the loss falls over a few steps on a fixed batch."""
    model = _lazy_model("qwen3", torch.float32).train()
    _, batch = _packed([9, 14, 8], seed=3)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                     labels=batch["labels"]).loss
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    for module in model.modules():
        if isinstance(module, LazyAttention):
            assert module.tau.grad is not None and module.tau.grad.abs().sum() > 0
            assert module.bias.grad is not None and module.bias.grad.abs().sum() > 0
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_use_lazy_attention_removes_sliding_windows(name):
    model = _lazy_model(name)
    config = model.config
    assert getattr(config, "layer_types", None) in (None, ["full_attention"] * 2)
    if getattr(config, "layer_types", None) is None:
        assert config.sliding_window is None
    assert all(getattr(m, "sliding_window", None) is None for m in model.modules())


def test_lazy_state_dict_round_trip_and_very_negative_tau():
    model = _lazy_model("gemma", tau_init=-1e4)
    ids = _ids(2, 11)
    out = _logits(model, hf.LAZY_ATTN_IMPLEMENTATION, ids)
    assert torch.isfinite(out).all()
    fresh = hf.use_lazy_attention(_model("gemma"), window=8)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(_logits(fresh, hf.LAZY_ATTN_IMPLEMENTATION, ids), out)


# ------------------------------------------------------------------- examples/hf_finetune.py

def test_hf_finetune_example_runs(tmp_path, capsys):
    """A few steps of the example: both phases train, the timings and generate() run, greedy
    tokens of "adaattn" equal sdpa's, and the PNG is written when matplotlib is installed."""
    path = os.path.join(ROOT, "examples", "hf_finetune.py")
    spec = importlib.util.spec_from_file_location("hf_finetune", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = tmp_path / "hf.png"
    threads = torch.get_num_threads()
    try:
        example.main(["--steps", "3", "--lazy-steps", "2", "--device", "cpu", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "greedy adaattn tokens identical to sdpa" in printed
    assert "training tokens/s: sdpa" in printed and "adaattn_lazy" in printed
    if importlib.util.find_spec("matplotlib") is None:
        assert "no PNG will be written" in printed
    else:
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
