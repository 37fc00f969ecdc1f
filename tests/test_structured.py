"""Constrained decoding in the engine: grammar rows batched with free rows, seeds,
preemption and prefix caching, on the bundled SmolLM2."""

import json

import jsonschema
import numpy as np
import mlx.core as mx
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.engine.structured import GrammarError, apply_bitmask, json_schema_grammar
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["city", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def prompts(smollm2_engine):
    asks = ["Describe Paris as JSON.", "Describe Rome as JSON.", "Tell me about Oslo."]
    return [smollm2_engine.tokenizer.encode_chat([{"role": "user", "content": a}]) for a in asks]


def test_mask_leaves_free_rows_alone():
    logits = mx.array(np.random.default_rng(0).normal(size=(2, 70)).astype(np.float32))
    mask = np.full((2, 3), -1, dtype=np.int32)
    mask[0] = 0
    mask[0, 1] = 1 << 3  # row 0: only token 35
    out = np.array(apply_bitmask(logits, mask))
    assert np.isneginf(out[0]).sum() == 69 and out[0, 35] == np.array(logits)[0, 35]
    np.testing.assert_array_equal(out[1], np.array(logits)[1])


def test_grammar_rows_batched_with_free_rows(smollm2_engine, prompts):
    g = json_schema_grammar(SCHEMA)
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    held = SamplingParams(temperature=0, max_tokens=60, grammar=g)
    alone_free = generate(smollm2_engine, [prompts[2]], free)[0].token_ids
    alone_held = generate(smollm2_engine, [prompts[0]], held)[0]
    mixed = generate(smollm2_engine, [prompts[0], prompts[2], prompts[1]], [held, free, held])
    assert mixed[1].token_ids == alone_free  # the free row is untouched by its neighbours' masks
    assert mixed[0].text == alone_held.text and mixed[0].finish_reason == "stop"
    for out in (mixed[0], mixed[2]):
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_seeded_sampling_under_a_grammar_is_reproducible(smollm2_engine, prompts):
    g = json_schema_grammar(SCHEMA)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, grammar=g) for s in (1, 2, 3)]
    batched = generate(smollm2_engine, [prompts[0]] * 3, params)
    alone = [generate(smollm2_engine, [prompts[0]], p)[0] for p in params]
    assert [o.text for o in batched] == [o.text for o in alone]
    for o in batched:
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_preemption_and_prefix_cache_keep_the_grammar_state(smollm2_gguf, smollm2_engine, prompts):
    g = json_schema_grammar(SCHEMA)
    params = SamplingParams(temperature=0, max_tokens=60, grammar=g)
    # 47 prompt tokens: 3 blocks each, a 4th as soon as the answer starts. 6 blocks for 3
    # such requests (no sharing): they preempt each other.
    ask = smollm2_engine.tokenizer.encode_chat([{"role": "user", "content": (
        "Describe Paris as JSON, with the city name and a score from zero to nine.")}])
    assert len(ask) == 47
    want = generate(smollm2_engine, [ask], params)[0].text
    tight = LLMEngine(smollm2_gguf, EngineConfig(num_kv_blocks=6, max_num_seqs=3, max_model_len=96,
                                                 enable_prefix_caching=False))
    outs = generate(tight, [ask] * 3, params)
    assert tight.scheduler.num_preemptions > 0
    assert all(o.text == want for o in outs)
    jsonschema.validate(json.loads(want), SCHEMA)
    again = generate(smollm2_engine, [ask], params)[0]
    assert again.num_cached_tokens > 0 and again.text == want


def test_bad_grammar_is_refused_before_admission(smollm2_engine, prompts):
    with pytest.raises(GrammarError):
        smollm2_engine.validate_request(prompts[0], SamplingParams(grammar=json_schema_grammar(
            {"type": "object", "properties": {"a": {"$ref": "#/missing"}}})))
    assert not smollm2_engine.has_unfinished_requests()


def test_unbounded_integers_end_within_the_safe_range():
    """A schema integer without bounds is held to +-(2^53 - 1): llguidance refuses a
    seventeenth digit instead of following a model that writes digits forever."""
    import llguidance

    from macinfer.engine.structured import SAFE_INTEGER, _bounded_integers

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "m": {"type": ["integer", "null"],
              "maximum": 5}, "k": {"enum": [{"type": "integer"}]}}, "required": ["n"]}
    bounded = _bounded_integers(schema)
    assert bounded["properties"]["n"] == {"type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    assert bounded["properties"]["m"]["maximum"] == 5 and bounded["properties"]["k"] == schema["properties"]["k"]
    from tests.helpers import byte_tokenizer

    tok = byte_tokenizer()
    ll = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=2)
    grammar = json_schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})

    def accepted(text: str) -> int:
        ids = tok.encode(text).ids
        return llguidance.LLMatcher(ll, grammar).try_consume_tokens(ids) == len(ids)

    assert accepted('{"n": 9007199254740991}') and accepted('{"n": -42}')
    assert not accepted('{"n": 90071992547409910')
