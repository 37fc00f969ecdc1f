"""Gemma 4's assistant drafter (`--draft-model` naming a `gemma4_assistant` checkpoint),
loaded with mlx-vlm's own classes, drafting for a Gemma 4 target (mlx-lm's classes) over
the target's paged K/V: tiny random models of both, written by the tests."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams
from tests.helpers import (drafting_engine, generate, make_mlx_lm_model, record_proposals, same_tokens_as_plain,
                           save_model_dir)
from tests.zoo import tiny_config


def make_assistant(path: str, target: dict, seed: int = 0, **overrides) -> None:
    """A tiny assistant for `target` (its config): two layers, a sliding and a full one,
    reading the target's K/V (so its head sizes are the target's)."""
    from mlx_vlm.speculative.drafters.gemma4_assistant import Gemma4AssistantDraftModel, ModelConfig

    text = dict(model_type="gemma4_text", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                num_attention_heads=4, head_dim=target["head_dim"], global_head_dim=target.get("global_head_dim"),
                num_key_value_heads=target["num_key_value_heads"], vocab_size=target["vocab_size"],
                sliding_window=target.get("sliding_window", 8),
                layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-5,
                partial_rotary_factor=target.get("partial_rotary_factor", 1.0), hidden_size_per_layer_input=0,
                vocab_size_per_layer_input=target["vocab_size"], use_double_wide_mlp=False,
                max_position_embeddings=2048)
    config = dict(model_type="gemma4_assistant", backbone_hidden_size=target["hidden_size"],
                  tie_word_embeddings=True, use_ordered_embeddings=False, text_config=text)
    config.update(overrides)
    mx.random.seed(seed)
    model = Gemma4AssistantDraftModel(ModelConfig.from_dict(config))
    if model.masked_embedding is not None:  # each centroid's tokens: a shuffle of the vocabulary
        order = np.random.default_rng(seed).permutation(target["vocab_size"]).astype(np.int32)
        model.masked_embedding.token_ordering = mx.array(order)
    save_model_dir(path, config, model)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny Gemma 4 (sliding window 8 and full layers, KV shared by the last two layers,
    MoE, per-layer inputs) and an assistant for it."""
    root = tmp_path_factory.mktemp("gemma4_assistant")
    config = tiny_config("gemma4_text")
    model = make_mlx_lm_model(config, seed=3)
    target = save_model_dir(str(root / "target"), config, model)
    make_assistant(str(root / "assistant"), config)
    return target, str(root / "assistant"), model, config


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 290, size=n).tolist() for n in (5, 7, 8, 12, 30, 41)]


def test_outputs_are_those_of_decoding_without_speculation(pair):
    """Greedy and seeded (top-p, a repetition penalty) requests over prompts shorter and
    longer than the window: the same tokens as the target alone."""
    target, assistant, _, _ = pair
    plain = LLMEngine(target, EngineConfig(kv_cache_gb=0.02))
    engine, *_ = same_tokens_as_plain(plain, assistant, _prompts(),
                                      dict(temperature=0.8, top_p=0.9, repetition_penalty=1.1))
    assert engine.drafter.forwards > 0


def _reference_drafts(model, config: dict, assistant, tokens: list[int], p: int, k: int,
                      int8_from: int | None = None) -> list[int]:
    """transformers' assistant, densely: the target over tokens[:p + 1] (every key kept),
    then k greedy drafts from [embed(tokens[p + 1]) * embed_scale, the target's normed
    hidden at p], each at RoPE position p, reading the K/V of the target's last full
    layer (keys 0..p) and last sliding layer (its last W - 1 keys: the window of the next
    token, whose own K/V is not there yet), through mlx-vlm's layers with those masks.
    `int8_from`: the target's K/V rows round-tripped through int8 (groups of 32), the full
    layers' first `int8_from` positions kept exact (`--kv-quant-start`)."""
    from mlx_lm.models.cache import KVCache

    inner = model.model
    cache = [KVCache() for _ in model.make_cache()]
    if int8_from is not None:
        def roundtrip(x, at, keep):
            q = mx.quantize(x.reshape(-1, x.shape[-1]), group_size=32, bits=8)
            y = mx.dequantize(*q, group_size=32, bits=8).reshape(x.shape).astype(x.dtype)
            return mx.where((mx.arange(x.shape[2]) + at < keep)[None, None, :, None], x, y)

        for c, layer in zip(cache, inner.layers):
            keep = int8_from if layer.layer_type == "full_attention" else 0

            def update(keys, values, c=c, keep=keep, update=c.update_and_fetch):
                return update(roundtrip(keys, c.offset, keep), roundtrip(values, c.offset, keep))

            c.update_and_fetch = update
    hidden = inner(mx.array([tokens[: p + 1]]), cache=cache)
    kv = {}
    for j, layer in enumerate(inner.layers):  # the last layer of each type: the cache it reads
        c = cache[inner.previous_kvs[j]]
        kv[layer.layer_type] = (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])
    assistant.bind(model)
    window = config["sliding_window"]
    h, tok, out = hidden[:, -1:, :], tokens[p + 1], []
    for _ in range(k):
        x = assistant.pre_projection(mx.concatenate(
            [inner.embed_tokens(mx.array([[tok]])) * inner.embed_scale, h], axis=-1))
        for layer in assistant.model.layers:
            keys, values = kv[layer.layer_type]
            floor = p - window + 2 if layer.layer_type == "sliding_attention" else 0
            mask = (mx.arange(keys.shape[2]) >= floor)[None, None, None, :]
            x, _, _ = layer(x, mask=mask, cache=None, per_layer_input=None, shared_kv=(keys, values), offset=p)
        x = assistant.model.norm(x)
        h = assistant.post_projection(x)
        tok = int(mx.argmax(assistant._lm_head_fn(x)[0, -1]).item())
        out.append(tok)
    return out


@pytest.mark.parametrize("ordered", [False, True])
def test_drafts_follow_the_published_formula(pair, tmp_path, ordered):
    """Every batched proposal the engine made (rows at different positions, below and past
    the window, after rejections) equals the dense reference of transformers' formula;
    also with the centroid-routed head of the small Gemma 4s (`use_ordered_embeddings`)."""
    from mlx_vlm.speculative.drafters import load_drafter

    target, assistant_path, model, config = pair
    if ordered:
        assistant_path = str(tmp_path / "ordered")
        make_assistant(assistant_path, config, seed=1, use_ordered_embeddings=True, num_centroids=30,
                       centroid_intermediate_top_k=4)
    engine = drafting_engine(target, assistant_path)
    made = record_proposals(engine)
    generate(engine, _prompts(), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assistant, _ = load_drafter(assistant_path, kind="mtp")
    records = [(tokens, n - 1, d) for tokens, n, d in made]  # p: the last position with K/V
    positions = {p for _, p, _ in records}
    assert len(records) >= 10 and min(positions) < config["sliding_window"] - 1 < max(positions)
    assert len({t for *_, d in records for t in d}) > 5  # (not one token drawn every time)
    for tokens, p, drafts in records:
        assert drafts == _reference_drafts(model, config, assistant, tokens, p, len(drafts)), (p, len(tokens))


def test_refusals(pair, tmp_path):
    target, _, _, config = pair
    wrong = str(tmp_path / "wide")
    make_assistant(wrong, {**config, "hidden_size": 128})
    with pytest.raises(ValueError, match="hidden size 128; this target's is 64"):
        drafting_engine(target, wrong)
    qwen_config = tiny_config("qwen3")  # full attention only
    qwen = save_model_dir(str(tmp_path / "qwen3"), qwen_config, make_mlx_lm_model(qwen_config, seed=1))
    for_qwen = str(tmp_path / "for_qwen3")
    make_assistant(for_qwen, {**qwen_config, "global_head_dim": 16})
    with pytest.raises(ValueError, match="reads the target's last sliding attention layer, which this target"):
        drafting_engine(qwen, for_qwen)
    with pytest.raises(ValueError, match="is a Gemma 4 assistant drafter"):
        drafting_engine(target, pair[1], speculative_method="eagle3")


def test_drafts_read_a_quantized_target_cache(tmp_path):
    """The target on int8 KV with its full layers' first 10 tokens kept apart
    (`--kv-quant-start`): the assistant reads the dequantized rows and the first tokens'
    store as the target does, proposals equal to the reference on the same quantization."""
    from mlx_vlm.speculative.drafters import load_drafter

    config = tiny_config("gemma4_text", head_dim=32, global_head_dim=64)
    model = make_mlx_lm_model(config, seed=3)
    target = save_model_dir(str(tmp_path / "target"), config, model)
    make_assistant(str(tmp_path / "assistant"), config)
    engine = drafting_engine(target, str(tmp_path / "assistant"), kv_cache_dtype="int8", kv_quant_start=10)
    made = record_proposals(engine)
    generate(engine, _prompts(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assistant, _ = load_drafter(str(tmp_path / "assistant"), kind="mtp")
    assert len(made) >= 8 and min(n for _, n, _ in made) <= 10 < max(n for _, n, _ in made)
    for tokens, n, drafts in made:
        assert drafts == _reference_drafts(model, config, assistant, tokens, n - 1, len(drafts), int8_from=10), n

