"""EAGLE-3 drafter checkpoints (`models/eagle3.py`): a tiny random head written in the EAGLE
authors' layout (`midlayer.*`, a draft vocabulary with its d2t map) and in vLLM
speculators' layout, run as the target's head; drafts equal a dense reference of the
published formula, tokens those of decoding without speculation."""

import json
import os

import mlx.core as mx
import numpy as np
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate, make_mlx_lm_model, save_model_dir, tiny_config

LAYERS = 8  # the target's: the head reads the inputs of layers 2, 4 and 5
DRAFT_VOCAB = 200  # of the target's 300 tokens


def _head_tensors(dims: int, heads: int, inter: int, agree: bool, seed: int) -> dict:
    """An EAGLE-3 head's tensors in the EAGLE authors' names. `agree`: its attention
    looks up the input token's own embedding (queries and keys the embedding, scaled up),
    passes it through, and skips the hidden rows: it predicts what the damped target
    predicts one token later."""
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.2):
        return mx.array(rng.normal(size=shape) * scale / np.sqrt(shape[-1]) * 4, dtype=mx.float32)

    eye = np.concatenate([np.eye(dims), np.zeros((dims, dims))], axis=1)
    t = {
        "fc.weight": mx.zeros((dims, 3 * dims)) if agree else w(dims, 3 * dims),
        "midlayer.self_attn.q_proj.weight": mx.array(3 * eye, dtype=mx.float32) if agree else w(dims, 2 * dims),
        "midlayer.self_attn.k_proj.weight": mx.array(3 * eye, dtype=mx.float32) if agree else w(dims, 2 * dims),
        "midlayer.self_attn.v_proj.weight": mx.array(eye, dtype=mx.float32) if agree else w(dims, 2 * dims),
        "midlayer.self_attn.o_proj.weight": mx.eye(dims) if agree else w(dims, dims),
        "midlayer.mlp.gate_proj.weight": w(inter, dims),
        "midlayer.mlp.up_proj.weight": w(inter, dims),
        "midlayer.mlp.down_proj.weight": mx.zeros((dims, inter)) if agree else w(dims, inter),
        "midlayer.input_layernorm.weight": mx.array(1 + 0.05 * rng.normal(size=dims), dtype=mx.float32),
        "midlayer.hidden_norm.weight": mx.array(1 + 0.05 * rng.normal(size=dims), dtype=mx.float32),
        "midlayer.post_attention_layernorm.weight": mx.array(1 + 0.05 * rng.normal(size=dims), dtype=mx.float32),
        "norm.weight": mx.array(1 + 0.05 * rng.normal(size=dims), dtype=mx.float32),
    }
    return t


def eagle3_pair(root, agree: bool = True, layout: str = "eagle", seed: int = 5) -> tuple[str, str]:
    """A damped 8-layer Llama target and an EAGLE-3 head for it."""
    config = tiny_config("llama", tie=False, num_hidden_layers=LAYERS, num_key_value_heads=4)
    target = make_mlx_lm_model(config, seed=seed)
    from mlx.utils import tree_flatten

    flat = dict(tree_flatten(target.parameters()))
    target.load_weights([(k, v * 0.2 if k.endswith(("o_proj.weight", "down_proj.weight")) else v)
                         for k, v in flat.items()])
    tpath = save_model_dir(str(root / f"target-{int(agree)}-{layout}"), config, target)
    dims, heads = config["hidden_size"], config["num_attention_heads"]
    t = _head_tensors(dims, heads, 96, agree, seed + 1)
    # The draft vocabulary: every other token of the first 200 and the last 100; d2t maps it.
    keep = np.array(sorted(set(range(0, 200, 2)) | set(range(200, 300))))
    t["lm_head.weight"] = mx.array(np.array(flat["lm_head.weight"])[keep]) if agree else \
        mx.array(np.random.default_rng(seed).normal(size=(len(keep), dims)).astype(np.float32))
    t["d2t"] = mx.array(keep - np.arange(len(keep)), dtype=mx.int64)
    t["t2d"] = mx.array(np.isin(np.arange(300), keep))
    hpath = str(root / f"eagle3-{int(agree)}-{layout}")
    os.makedirs(hpath)
    head_cfg = {"hidden_size": dims, "intermediate_size": 96, "num_attention_heads": heads,
                "num_key_value_heads": heads, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0, "max_position_embeddings": 2048, "vocab_size": 300,
                "draft_vocab_size": len(keep), "tie_word_embeddings": False}
    if layout == "eagle":
        cfg = {**head_cfg, "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"}
    else:  # vLLM speculators
        cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
               "transformer_layer_config": head_cfg, "draft_vocab_size": len(keep),
               "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}]}}
        t = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in t.items()}
    with open(os.path.join(hpath, "config.json"), "w") as f:
        json.dump(cfg, f)
    mx.save_safetensors(os.path.join(hpath, "model.safetensors"), t)
    return tpath, hpath


def _engine(path, **kw):
    kw = {"num_kv_blocks": 160, "block_size": 16, "max_num_seqs": 32, "speculative_max_batch": 32, **kw}
    return LLMEngine(path, EngineConfig(**kw))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, int(rng.integers(3, 40))).tolist() for _ in range(n)]


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_32_rows_give_the_tokens_of_decoding_without_speculation(tmp_path_factory, layout):
    target, head = eagle3_pair(tmp_path_factory.mktemp(layout), layout=layout)
    prompts = _prompts(32)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0) if i % 2 == 0 else
              SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_p=0.9, seed=i) for i in range(32)]
    want = [o.token_ids for o in generate(_engine(target), prompts, params)]
    engine = _engine(target, num_speculative_tokens=3, draft_model=head)
    got = [o.token_ids for o in generate(engine, prompts, params)]
    assert got == want
    st = engine.stats
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"], st
    assert not engine.drafter.shadows and engine.drafter.block_manager.num_used_blocks == 0


def _reference_drafts(engine, tokens: list[int], k: int) -> list[int]:
    """The head's greedy drafts after `tokens`, computed densely from the published formula:
    the target's layer inputs from its own mlx-lm forward, the first layer written out, one
    position at a time on mlx-lm's cache."""
    from mlx_lm.models.cache import KVCache

    inner = engine.model.text_model.model
    x = inner.embed_tokens(mx.array([tokens[:-1]]))
    aux = []
    for i, layer in enumerate(inner.layers):
        if i in (2, 4, 5):
            aux.append(x[0])
        x = layer(x, "causal", None)
    head = engine.drafter.model.lm
    stack, first = head.model, head.model.layers[0]
    hidden = stack.fc(mx.concatenate(aux, axis=-1))
    cache = KVCache()
    eps = first.input_layernorm.eps

    def rms(v, w):
        return v * mx.rsqrt((v * v).mean(-1, keepdims=True) + eps) * w

    def step(token: int, h: mx.array) -> mx.array:
        e = inner.embed_tokens(mx.array([[token]]))[0, 0]
        a = first.self_attn(mx.concatenate([rms(e, first.input_layernorm.weight),
                                            rms(h, first.hidden_norm.weight)])[None, None], None, cache)[0, 0]
        y = h + a
        return y + first.mlp(rms(y, first.post_attention_layernorm.weight))

    for i, t in enumerate(tokens[1:]):
        out = step(t, hidden[i])
    drafts = []
    for _ in range(k):
        d = int(mx.argmax(head.lm_head(rms(out, head.norm.weight))).item())
        drafts.append(d + int(head.d2t[d].item()))
        out = step(drafts[-1], out)
    return drafts


def test_the_heads_drafts_follow_the_published_formula(tmp_path_factory):
    target, head = eagle3_pair(tmp_path_factory.mktemp("formula"), agree=False)
    engine = _engine(target, num_speculative_tokens=4, draft_model=head, max_num_batched_tokens=32,
                     enable_prefix_caching=False, model_impl="mlx-lm")  # mlx-lm's own forward for the reference
    prompts = [_prompts(1, seed=3)[0] * 3, [1, 5, 9], *_prompts(5, seed=5)]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
    seqs = [s.seq for s in engine.requests.values()]
    engine.scheduler.speculative = None  # no drafting while the prompts go in (the head still catches up)
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    proposals = {}
    for _ in range(4):
        proposals.update(engine.drafter.propose([(s, 4) for s in seqs]))
    for seq in seqs:
        assert proposals[seq] == _reference_drafts(engine, seq.token_ids, 4)


def test_eagle3_refusals(tmp_path_factory):
    root = tmp_path_factory.mktemp("refuse")
    target, head = eagle3_pair(root)
    other = save_model_dir(str(root / "wide"), tiny_config("llama", hidden_size=128, num_hidden_layers=8),
                           make_mlx_lm_model(tiny_config("llama", hidden_size=128, num_hidden_layers=8)))
    with pytest.raises(ValueError, match="reads hidden states 64 wide; the target's are 128"):
        _engine(other, num_speculative_tokens=2, draft_model=head)
    with pytest.raises(ValueError, match="is not an EAGLE-3 checkpoint"):
        _engine(target, num_speculative_tokens=2, draft_model=target, speculative_method="eagle3")
    with pytest.raises(ValueError, match="needs --draft-model"):
        _engine(target, num_speculative_tokens=2, speculative_method="eagle3")
