"""Every model_type mlx-lm implements: it runs exactly, or it is refused at load with the reason.

The verdicts are `macinfer/models/architectures.json` (written by
scripts/architectures.py from tiny models of tests/zoo.py); this module checks
the table is current and, for every architecture it lists as running, that the
paged engine matches mlx-lm alone on the same random weights: logits through
chunked prefill and batched decodes (within 2e-4), and greedy tokens of eight requests
joining at different steps, a prefix-cache hit and a forced preemption. Windows
and chunks are 8 tokens, so the 40-token prompts cross them.

The reference is mlx-lm itself, except for the families whose mlx-lm file applies
no sliding window although transformers and llama.cpp do (Gemma 2, StarCoder2,
Phi-3: `CONFIG_WINDOWS`): there the reference is mlx-lm's model recomputing the
whole sequence each step with transformers' window mask (a key is visible to a
query at q when q - W < k <= q) on the layers transformers windows.
The 15 families of tests/test_architectures.py are checked there in more op forms.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.models import ARCHITECTURES, VERDICTS, VERDICTS_FILE, UnsupportedArchitectureError, build_model
from macinfer.models.mlx_lm_classes import CONFIG_WINDOWS, config_windows, mlx_lm_model_types
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate, generate_joining, make_mlx_lm_model, save_model_dir
from tests.zoo import tiny_config

from tests.test_architectures import FAMILIES
from tests.test_state_group import STATEFUL

# Eight requests of 5-40 tokens (windows and chunks of 8 crossed), batched as they join.
TOKENS = [list(range(5, 45)), list(range(100, 140)), [7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27],
          list(range(200, 205)), list(range(250, 220, -1)), [3 + (i * 37) % 290 for i in range(17)],
          list(range(60, 93, 2)), [290 - i for i in range(23)]]
CHUNKS = [9, 13, 1, 1, 1, 6]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
RUNS = sorted(t for t, v in VERDICTS.items() if v == "runs" and t not in FAMILIES)
REFUSED = sorted(t for t, v in VERDICTS.items() if v != "runs")


def _refused_at_load(reason: str) -> bool:
    return reason.startswith("its layers on the paged cache compute other logits")


def test_the_table_covers_every_mlx_lm_model_type_and_is_current():
    """Build verdicts here (cheap); load verdicts by the tests below, which load every model."""
    from scripts.architectures import verdicts

    assert sorted(VERDICTS) == mlx_lm_model_types()
    built = {t: "runs" if _refused_at_load(v) else v for t, v in VERDICTS.items()}
    assert verdicts(load=False) == built, f"{VERDICTS_FILE} is stale: run python scripts/architectures.py"
    assert set(FAMILIES) <= set(ARCHITECTURES)
    # The minimum: plain and windowed K/V of these families run.
    assert {"gemma4", "gemma4_text", "gemma4_unified", "gemma3n", "llama4", "mistral3", "qwen3_vl", "minimax_m2",
            "glm4_moe", "gpt2", "gpt_neox", "dbrx", "hunyuan", "step3p5", "nemotron-nas"} <= set(ARCHITECTURES)


@pytest.mark.parametrize("model_type", REFUSED)
def test_refused_with_its_reason(model_type, tmp_path):
    config = tiny_config(model_type)
    with pytest.raises(UnsupportedArchitectureError) as e:
        if _refused_at_load(VERDICTS[model_type]):
            path = save_model_dir(str(tmp_path / "m"), config, make_mlx_lm_model(config, seed=7))
            LLMEngine(path, EngineConfig(kv_cache_gb=0.01, model_impl="mlx-lm"))
        build_model(config)
    assert str(e.value) == f"unsupported architecture {model_type!r}: {VERDICTS[model_type]}"


def _text_model(model):
    """A vision-language wrapper's language model: mlx-lm's wrappers do not all pass their
    text model's make_cache on (mistral3, pixtral), so their decodes skip its windows."""
    chain = [model]
    while hasattr(chain[-1], "language_model"):
        chain.append(chain[-1].language_model)
    return next((m for m in reversed(chain) if hasattr(m, "make_cache")), model)


def _windows(model, config) -> list[int | None] | None:
    """transformers' window of each layer, for a family whose mlx-lm file ignores it."""
    return config_windows(config, len(model.layers)) if config["model_type"] in CONFIG_WINDOWS else None


@contextmanager
def _window_masks(model, windows):
    """mlx-lm's attention layers, each given transformers' causal (and window) mask."""
    attn = [layer.self_attn for layer in model.layers]
    cls, table = type(attn[0]), {id(a): w for a, w in zip(attn, windows)}
    original = cls.__call__

    def call(self, x, mask=None, cache=None):
        q, k = mx.arange(x.shape[1])[:, None], mx.arange(x.shape[1])[None]
        w = table[id(self)]
        return original(self, x, (k <= q) & (k > q - w) if w else k <= q, cache)

    cls.__call__ = call
    try:
        yield
    finally:
        cls.__call__ = original


def _reference_logits(model, tokens, chunks, windows):
    if windows is not None:  # the whole sequence at once, no cache
        with _window_masks(model, windows):
            return np.array(model(mx.array([tokens[: sum(chunks)]]))[0].astype(mx.float32))
    cache, outs, pos = make_prompt_cache(model), [], 0
    for n in chunks:
        outs.append(model(mx.array([tokens[pos : pos + n]]), cache=cache)[0])
        pos += n
    return np.array(mx.concatenate(outs, axis=0).astype(mx.float32))


def _reference_greedy(model, prompt, n, windows, one_by_one=False):
    out = []
    if windows is not None:
        with _window_masks(model, windows):
            for _ in range(n):
                out.append(int(mx.argmax(model(mx.array([prompt + out]))[0, -1]).item()))
        return out
    cache = make_prompt_cache(model)
    for t in prompt[:-1] if one_by_one else []:
        model(mx.array([[t]]), cache=cache)
    logits = model(mx.array([prompt[-1:] if one_by_one else prompt]), cache=cache)[0, -1]
    for _ in range(n):
        out.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out


@pytest.mark.parametrize("model_type", RUNS)
def test_runs_like_mlx_lm(model_type, tmp_path):
    config = tiny_config(model_type)
    model = make_mlx_lm_model(config, seed=7)
    path = save_model_dir(str(tmp_path / "m"), config, model)
    ref = _text_model(model)
    windows = _windows(ref, config)

    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, model_impl="mlx-lm", max_num_batched_tokens=24))
    # tests/test_state_group.py speculates on every family with recurrent state: its list is current.
    assert (engine.kv_cache.states is not None) == (model_type in STATEFUL), model_type
    seqs = [TOKENS[0][:31], TOKENS[1][:31]]
    # plamo3's mlx-lm file masks W + 1 keys in a prompt but keeps W in its cache for
    # decodes; the cache (W keys, as RotatingKVCache(W) holds) is the reference.
    ref_chunks = [1] * sum(CHUNKS) if model_type == "plamo3" else CHUNKS
    # Muse Spark: with the attention written out (as the suite forces), its residual streams
    # differ from mlx-lm's fused SDPA by <= 3e-6, as every family's, and its head turns that
    # into 2.4e-4 at one position of these weights; with the fused form all within 1e-6.
    tol = 5e-4 if model_type == "muse_spark" else 2e-4
    for got, toks in zip(engine.score(seqs, CHUNKS), seqs):
        np.testing.assert_allclose(got, _reference_logits(ref, toks, ref_chunks, windows), atol=tol, rtol=tol)

    want = [_reference_greedy(ref, p, GREEDY.max_tokens, windows, model_type == "plamo3") for p in TOKENS]
    assert generate_joining(engine, TOKENS, GREEDY) == want

    # 6 blocks of 16 tokens for 3 requests of 50 tokens each: they preempt each other.
    tight = LLMEngine(path, EngineConfig(num_kv_blocks=6, model_impl="mlx-lm", max_num_seqs=3))
    if any(not g.kind.bounded for g in tight.kv_cache.groups):
        assert all(o.token_ids == want[0] for o in generate(tight, [TOKENS[0]] * 3, GREEDY))
    else:  # no K/V that grows (recurrent state, windows only): preempt by hand, mid-prompt and mid-answer
        assert [o.token_ids for o in _generate_preempting(tight, [TOKENS[0]] * 3)] == [want[0]] * 3
        # In 6 blocks the prompt's window blocks may be evicted by then (a lookahead takes a
        # sequence's next block a step before a block leaving its window comes back): run it once more.
        generate(tight, [TOKENS[0]], GREEDY)
    assert tight.scheduler.num_preemptions > 0
    again = generate(tight, [TOKENS[0]], GREEDY)[0]
    assert again.token_ids == want[0] and again.num_cached_tokens > 0


def _generate_preempting(engine, prompts):
    """Greedy outputs, the newest running request preempted at steps 2 and 6."""
    ids, outs = [engine.add_request(p, GREEDY) for p in prompts], {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        if step in (2, 6) and engine.scheduler.running:
            engine.scheduler.preempt(max(engine.scheduler.running, key=lambda s: s.arrival))
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    return [outs[r] for r in ids]


def test_gemma4_kv_sharing_counts_each_shared_cache_once(tmp_path):
    """Gemma 4: 4 layers, the last 2 reading the K/V of earlier ones, global layers with
    twice the head size: two caches of K/V in the pools, one per kind."""
    config = tiny_config("gemma4_text")
    ref = make_mlx_lm_model(config, seed=7)
    engine = LLMEngine(save_model_dir(str(tmp_path / "g4"), config, ref), EngineConfig(kv_cache_gb=0.01))
    specs = engine.layer_specs
    assert len(specs) == 2 and engine.model.num_layers == 4
    assert [(s.kind.describe(), s.num_kv_heads, s.head_dim) for s in specs] == \
        [("sliding window 8", 2, 16), ("full attention", 2, 32)]
    groups = engine.cache_groups()
    # layers 2 and 3 read the caches of layers 0 and 1 (the last ones of their kind)
    assert [(g["kind"], g["layers"], g["caches"]) for g in groups] == \
        [("full attention", [1, 3], [1]), ("sliding window 8", [0, 2], [0])]
    per_token = {g["kind"]: g["bytes_per_token"] for g in groups}
    assert per_token == {"full attention": 2 * 2 * 32 * 4, "sliding window 8": 2 * 2 * 16 * 4}
    assert sum(g["bytes"] for g in groups) == engine.kv_cache.nbytes


def test_a_paged_forward_that_differs_from_mlx_lm_is_refused_at_load(tmp_path, monkeypatch):
    """The load-time comparison: a layer that loses its rows' positions (as AFM's KV-reuse
    layers did before their route, reading positions from the K/V's length) computes other
    logits than mlx-lm and is refused, with the figures, instead of running wrong."""
    from macinfer.models.paged_layers import PagedLayerCache

    config = tiny_config("qwen3")
    path = save_model_dir(str(tmp_path / "q"), config, make_mlx_lm_model(config, seed=7))
    monkeypatch.setattr(PagedLayerCache, "offset", property(lambda self: mx.zeros_like(self.positions)))
    with pytest.raises(UnsupportedArchitectureError, match="unsupported architecture 'qwen3': its layers on the "
                       r"paged cache compute other logits than mlx-lm's own forward \(off by"):
        LLMEngine(path, EngineConfig(kv_cache_gb=0.01, model_impl="mlx-lm"))


def test_the_table_is_valid_json():
    with open(VERDICTS_FILE) as f:
        assert json.load(f) == VERDICTS
