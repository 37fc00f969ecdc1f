"""DFlash block drafters (`--draft-model` naming a checkpoint with a `dflash_config`: z-lab's
Qwen3 layout, DFlash2, DSpark), loaded with mlx-vlm's own classes, drafting k tokens in one
forward on a paged pool of their own: tiny random models of both, written by the tests."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import numpy as np
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams
from tests.helpers import (drafting_engine, generate, make_mlx_lm_model, record_proposals, same_tokens_as_plain,
                           save_model_dir)
from tests.zoo import tiny_config

IDS = [0, 2]  # the target layers whose outputs the drafter reads


def make_dflash(path: str, target: dict, seed: int = 0, **overrides) -> None:
    from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel
    from mlx_vlm.speculative.drafters.qwen3_dflash.config import DFlashConfig

    config = dict(model_type="qwen3", architectures=["DFlashDraftModel"], hidden_size=target["hidden_size"],
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, rms_norm_eps=1e-5, vocab_size=target["vocab_size"], rope_theta=10000.0,
                  max_position_embeddings=2048, block_size=4, num_target_layers=target["num_hidden_layers"],
                  dflash_config={"mask_token_id": target["vocab_size"] - 1, "target_layer_ids": IDS})
    config.update(overrides)
    mx.random.seed(seed)
    model = DFlashDraftModel(DFlashConfig.from_dict(config))
    save_model_dir(path, config, model)


def make_dflash2(path: str, target: dict, seed: int = 0) -> None:
    """A DFlash2 drafter (mlx-vlm's class): grouped causal convolutions in each layer, scaled
    embeddings and logits, a capped head, a scorer of each position's top candidates."""
    from mlx.utils import tree_flatten
    from mlx_vlm.speculative.drafters.dflash2 import DFlash2DraftModel
    from mlx_vlm.speculative.drafters.dflash2.config import DFlash2Config

    config = dict(model_type="qwen3", architectures=["DFlash2DraftModel"], hidden_size=target["hidden_size"],
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, rms_norm_eps=1e-5, vocab_size=target["vocab_size"], rope_theta=10000.0,
                  max_position_embeddings=2048, block_size=4, num_target_layers=target["num_hidden_layers"],
                  dflash_config={"mask_token_id": target["vocab_size"] - 1, "target_layer_ids": IDS,
                                 "conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8,
                                 "selector_top_k": 4, "output_multiplier": 1.5, "input_embedding_scale": 0.9,
                                 "final_logit_softcapping": 30.0})
    mx.random.seed(seed)
    model = DFlash2DraftModel(DFlash2Config.from_dict(config))
    # (its base kernels initialise to zeros: random ones, so a tap out of place shows)
    model.load_weights([(k, 0.3 * mx.random.normal(v.shape)) for k, v in tree_flatten(model.parameters())
                        if k.endswith("base_kernel")], strict=False)
    save_model_dir(path, config, model)


def make_dspark(path: str, target: dict, seed: int = 0) -> None:
    """A DSpark drafter (mlx-vlm's class): DFlash's layers, its block from the last token (whose
    row drafts first), a low-rank transition row of the previous pick added to each position."""
    from mlx_vlm.speculative.drafters.dspark import DSparkDraftModel
    from mlx_vlm.speculative.drafters.dspark.config import DSparkConfig

    config = dict(model_type="qwen3", architectures=["Qwen3DSparkModel"], hidden_size=target["hidden_size"],
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, rms_norm_eps=1e-5, vocab_size=target["vocab_size"], rope_theta=10000.0,
                  max_position_embeddings=2048, num_target_layers=target["num_hidden_layers"],
                  dflash_config={"mask_token_id": target["vocab_size"] - 1, "target_layer_ids": IDS,
                                 "projector_type": "dspark", "markov_rank": 8, "block_size": 4,
                                 "block_size_policy": "fixed"})
    mx.random.seed(seed)
    save_model_dir(path, config, DSparkDraftModel(DSparkConfig.from_dict(config)))


def make_gemma4_dspark(path: str, target: dict, seed: int = 0, shared_kv: bool = False) -> None:
    """Gemma 4's DSpark drafter (mlx-vlm's class): Gemma 4's sandwich-normed layers at its global
    head width, an embedding and a capped head of its own."""
    from mlx.utils import tree_flatten
    from mlx_vlm.speculative.drafters.gemma4_dspark import Gemma4DSparkDraftModel
    from mlx_vlm.speculative.drafters.gemma4_dspark.config import Gemma4DsparkConfig

    config = dict(model_type="gemma4_text", architectures=["Gemma4DSparkModel"], hidden_size=target["hidden_size"],
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  # (keys and values apart: mlx-vlm 0.7.10's own dense path fails on the shared projection,
                  # `_project_context_kv` asks every layer for a `v_proj`)
                  head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=shared_kv,
                  layer_types=["full_attention", "full_attention"], rope_parameters={
                      "full_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
                  rms_norm_eps=1e-6, vocab_size=target["vocab_size"], max_position_embeddings=2048,
                  final_logit_softcapping=30.0, tie_word_embeddings=False,
                  num_target_layers=target["num_hidden_layers"],
                  mask_token_id=target["vocab_size"] - 1, target_layer_ids=IDS, markov_rank=8, block_size=3,
                  block_size_policy="fixed")
    mx.random.seed(seed)
    model = Gemma4DSparkDraftModel(Gemma4DsparkConfig.from_dict(config))
    # (norms and the layer scalar jittered off their ones, so one out of place shows)
    model.load_weights([(k, v + 0.2 * mx.random.normal(v.shape)) for k, v in tree_flatten(model.parameters())
                        if "norm" in k or k.endswith("layer_scalar")], strict=False)
    save_model_dir(path, config, model)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    config = tiny_config("qwen3", num_hidden_layers=4)
    model = make_mlx_lm_model(config, seed=4)
    target = save_model_dir(str(root / "target"), config, model)
    make_dflash(str(root / "dflash"), config)
    make_dflash2(str(root / "dflash2"), config, seed=2)
    make_dspark(str(root / "dspark"), config, seed=3)
    make_gemma4_dspark(str(root / "gemma4_dspark"), config, seed=4)
    make_gemma4_dspark(str(root / "gemma4_dspark_shared"), config, seed=4, shared_kv=True)
    return target, str(root / "dflash"), model, config


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, 290, size=n).tolist() for n in (3, 9, 17, 40)]


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dspark", "gemma4_dspark", "gemma4_dspark_shared"])
def test_outputs_are_those_of_decoding_without_speculation(pair, kind):
    target, draft, _, _ = pair
    draft = os.path.join(os.path.dirname(draft), kind)
    plain = LLMEngine(target, EngineConfig(kv_cache_gb=0.02))
    engine, prompts, params, want = same_tokens_as_plain(plain, draft, _prompts(), dict(temperature=0.8, top_k=20))
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))  # the drafter's own prefix cache holds it
    again = generate(engine, [prompts[longest]], [params[longest]])[0]
    assert again.token_ids == want[longest] and again.num_cached_tokens > 0


def _reference_drafts(model, draft, tokens: list[int], n: int, k: int) -> list[int]:
    """The published formula, densely with mlx-vlm's own drafter: the target's layer outputs
    at positions [0, n) as one context, the block [tokens[n], mask x k], greedy."""
    from mlx_lm.models.base import create_attention_mask

    inner = model.model
    h = inner.embed_tokens(mx.array([tokens[:n]]))
    mask = create_attention_mask(h, None)
    outs = []
    for layer in inner.layers:
        h = layer(h, mask, None)
        outs.append(h)
    features = mx.concatenate([outs[i] for i in IDS], axis=-1)
    from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel

    own = {name: getattr(draft, name) for name in ("embed_tokens", "lm_head", "embed_scale")} \
        if type(draft).__name__ == "Gemma4DSparkDraftModel" else {}  # (its own, which its bind keeps)
    DFlashDraftModel.bind(draft, model)  # (DFlash2's and DSpark's own check wants mlx-vlm's rollback API)
    for name, value in own.items():
        setattr(draft, name, value)
    got = draft.draft_block(tokens[n], features, draft.make_cache(), k + 1, lambda x: mx.argmax(x, axis=-1))
    return got[0].tolist()


@pytest.mark.parametrize("impl,kind", [("auto", "dflash"), ("mlx-lm", "dflash"), ("auto", "dflash2"),
                                       ("auto", "dspark"), ("auto", "gemma4_dspark")])
def test_drafts_follow_the_published_formula(pair, impl, kind):
    """Every batched proposal (shadows caught up in chunks, blocks at different positions,
    after rejections) equals mlx-vlm's own drafter run densely over the whole context; the
    target through macinfer's Llama file or mlx-lm's classes; DFlash2's convolutions within
    each block and its candidate scorer, DSpark's block from the last token and its
    transition rows too."""
    from mlx_vlm.speculative.drafters import load_drafter

    target, draft_path, model, _ = pair
    draft_path = os.path.join(os.path.dirname(draft_path), kind)
    engine = drafting_engine(target, draft_path, max_num_batched_tokens=16, model_impl=impl)
    records = record_proposals(engine)
    generate(engine, _prompts(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    draft, _ = load_drafter(draft_path, kind="dflash")
    assert len(records) >= 8 and len({t for *_, d in records for t in d}) > 4
    for tokens, n, drafts in records:
        assert drafts == _reference_drafts(model, draft, tokens, n, len(drafts)), (n, len(tokens))


def test_refusals(pair, tmp_path):
    target, _, _, config = pair
    causal = str(tmp_path / "causal")
    make_dflash(causal, config, dflash_config={"mask_token_id": 299, "target_layer_ids": IDS, "causal": True})
    with pytest.raises(ValueError, match="causal block attention"):
        drafting_engine(target, causal)
    other = str(tmp_path / "other")
    make_dflash(other, {**config, "num_hidden_layers": 8})
    with pytest.raises(ValueError, match="trained on a target of 8 layers"):
        drafting_engine(target, other)


def test_gemma4s_dflash_drafter_drafts_for_a_gemma4_target(tmp_path):
    """Gemma 4's DFlash drafter (mlx-vlm's `gemma4_dflash`: DFlash's class, mask token 4 by
    default) on a Gemma 4 target (sliding and full layers, scaled embeddings): the tokens of
    decoding without speculation, greedy and seeded, also preempted."""
    from mlx_vlm.speculative.drafters.gemma4_dflash import Gemma4DFlashDraftModel
    from mlx_vlm.utils import get_model_type

    config = tiny_config("gemma4_text", num_hidden_layers=4)
    target = save_model_dir(str(tmp_path / "gemma4"), config, make_mlx_lm_model(config, seed=6))
    draft = str(tmp_path / "gemma4-dflash")
    make_dflash(draft, config, model_type="gemma4", dflash_config={"target_layer_ids": IDS})
    with open(os.path.join(draft, "config.json")) as f:
        assert get_model_type(json.load(f)) == "gemma4_dflash"  # (how mlx-vlm picks its class)
    plain = LLMEngine(target, EngineConfig(kv_cache_gb=0.02))
    engine, *_ = same_tokens_as_plain(plain, draft, _prompts(), dict(temperature=0.8, top_k=20))
    assert type(engine.drafter.model.draft) is Gemma4DFlashDraftModel and engine.drafter.model.mask_id == 4
