"""The explicit forms the CPU path uses where MLX's fast ops are not fused kernels
(softmax by powers of two, RoPE from per-step tables, SwiGLU through `power`)
against float64 references and against the fused forms they replace."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from macinfer.kv import decode_attention, prefill_plan
from macinfer.kv.dense import dense_attention, sdpa
from macinfer.kv.decode_attention import block_heads, decode_mask, reference_decode_attention
from macinfer.models.llama import swiglu
from macinfer.models.rope import FreqFactorRoPE, apply_rope_tables, make_rope, rope_tables
from tests.helpers import PAGED_BS, float64_decode_attention, paged_case

BS = PAGED_BS


def _paged_case(lens, seed=0):
    return paged_case(len(lens), 2, 3, 32, lens, seed=seed)


@pytest.mark.parametrize("exp2", [True, False])
@pytest.mark.parametrize("extra", ["plain", "sinks", "softcap"])
def test_reference_decode_attention_matches_float64(monkeypatch, exp2, extra):
    monkeypatch.setattr(decode_attention, "EXP2_MIN_SCORES", 0 if exp2 else 1 << 60)
    q, kp, vp, tables, lens = _paged_case([5, 16, 40, 71])
    scale = q.shape[-1] ** -0.5
    sinks = np.linspace(-1.0, 2.0, q.shape[1]).astype(np.float32) if extra == "sinks" else None
    softcap = 3.0 if extra == "softcap" else None
    heads = block_heads(mx.array(tables), kp.shape[1])
    mask = decode_mask(mx.array(lens), tables.shape[1] * BS)
    got = reference_decode_attention(mx.array(q), mx.array(kp), mx.array(vp), heads, mask, scale,
                                     None if sinks is None else mx.array(sinks), softcap)
    want = float64_decode_attention(q, kp, vp, tables, lens, sinks=sinks, softcap=softcap, scale=scale)
    np.testing.assert_allclose(np.array(got), want, atol=2e-5, rtol=1e-4)


def test_exp2_decode_with_several_queries_per_row(monkeypatch):
    """A speculating sequence: 3 queries sharing one table, each with its own length."""
    q, kp, vp, tables, lens = _paged_case([40, 40, 40], seed=3)
    lens = np.array([38, 39, 40], np.int32)
    scale = q.shape[-1] ** -0.5
    heads = block_heads(mx.array(tables[:1]), kp.shape[1])
    mask = decode_mask(mx.array(lens), tables.shape[1] * BS)[None]
    outs = {}
    for exp2 in (True, False):
        monkeypatch.setattr(decode_attention, "EXP2_MIN_SCORES", 0 if exp2 else 1 << 60)
        outs[exp2] = np.array(reference_decode_attention(mx.array(q)[None], mx.array(kp), mx.array(vp), heads,
                                                         mask, scale)[0])
    want = float64_decode_attention(q, kp, vp, np.repeat(tables[:1], 3, axis=0), lens, scale=scale)
    np.testing.assert_allclose(outs[True], want, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(outs[False], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("mask", ["causal", "window", None])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("lk", [19, 7])  # a chunk after a cached prefix; a chunk alone
def test_explicit_sdpa_matches_the_fused_form(mask, sinks, lk):
    rng = np.random.default_rng(1)
    lq, kvh, g, d = 7, 2, 3, 32
    q = mx.array(rng.normal(size=(1, kvh * g, lq, d)).astype(np.float32))
    k, v = (mx.array(rng.normal(size=(1, kvh, lk, d)).astype(np.float32)) for _ in range(2))
    if mask == "window":
        qpos = mx.arange(lk - lq, lk)[:, None]
        kpos = mx.arange(lk)[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - 5)
    s = mx.array(np.linspace(-1, 1, kvh * g).astype(np.float32)) if sinks else None
    fused = sdpa(q, k, v, 0.2, mask, s, None)
    explicit = sdpa(q, k, v, 0.2, mask, s, None, explicit=True)
    np.testing.assert_allclose(np.array(explicit), np.array(fused), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("sinks", [False, True])
def test_causal_tiles_on_two_streams_match_the_fused_form(sinks):
    """A 45-token chunk after 60 cached keys in 16-query tiles (the last one short), the tiles
    alternating between the two CPU streams."""
    rng = np.random.default_rng(2)
    lq, lk, kvh, g, d = 45, 105, 3, 3, 64
    q = mx.array(rng.normal(size=(1, kvh * g, lq, d)).astype(np.float32))
    k, v = (mx.array(rng.normal(size=(1, kvh, lk, d)).astype(np.float32) * 2) for _ in range(2))
    s = mx.array(np.linspace(-1, 3, kvh * g).astype(np.float32)) if sinks else None
    fused = sdpa(q, k, v, 0.125, "causal", s, None)
    tiled = dense_attention(q, k, v, 0.125, "causal", True, 16, s)
    np.testing.assert_allclose(np.array(tiled), np.array(fused), atol=1e-5, rtol=1e-5)  # both ~5e-6 off float64


ROPES = {
    "default": (64, 10000.0, False, None),
    "traditional": (64, 10000.0, True, None),
    "linear": (64, 10000.0, False, {"type": "linear", "factor": 2.0}),
    "llama3": (64, 500000.0, False, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "yarn": (64, 10000.0, False, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
}


@pytest.mark.parametrize("kind", [*ROPES, "freq_factors"])
def test_rope_tables_give_what_the_module_gives(kind):
    if kind == "freq_factors":
        rope = FreqFactorRoPE(64, 10000.0, False, [1.0 + i / 8 for i in range(32)])
    else:
        dims, base, traditional, scaling = ROPES[kind]
        rope = make_rope(dims, base, traditional, scaling, 32768)
    positions = mx.array([0, 1, 7, 300, 5000, 20000], dtype=mx.int32)
    x = mx.random.normal((6, 5, 64), key=mx.random.key(0))
    want = rope(x[:, :, None, :], offset=positions)[:, :, 0, :]
    got = apply_rope_tables(x, rope_tables(rope, positions, 64), rope.traditional)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)


def test_rope_tables_refuse_partial_rotation():
    assert rope_tables(nn.RoPE(32), mx.arange(3), 64) is None


def test_swiglu_matches_silu():
    gate = mx.random.normal((4, 96), key=mx.random.key(1)) * 6
    up = mx.random.normal((4, 96), key=mx.random.key(2))
    np.testing.assert_allclose(np.array(swiglu(gate, up)), np.array(nn.silu(gate) * up), atol=1e-5, rtol=1e-5)


def _span(length, context, blocks=1):
    return prefill_plan.PrefillSpan(0, length, context, mx.zeros((blocks,), dtype=mx.int32))


def test_group_spans_pads_little_and_leaves_long_chunks_alone():
    spans = [_span(32, 32), _span(32, 32), _span(31, 32), _span(500, 500), _span(4, 900), _span(5, 5)]
    groups = prefill_plan.group_spans(spans)
    # 500 is too long; 4 tokens at 900 context too unlike the rest; 5 at 5 pads cheaply
    assert sorted(map(sorted, groups)) == [[0, 1, 2, 5]]
    assert prefill_plan.group_spans([_span(8, 8)]) == []  # one span is attended alone
    rng = np.random.default_rng(0)
    for _ in range(50):
        spans = [_span(int(n), int(n + c)) for n, c in zip(rng.integers(1, 200, 12), rng.integers(0, 1100, 12))]
        groups = prefill_plan.group_spans(spans)
        members = [i for g in groups for i in g]
        assert len(members) == len(set(members)) and all(len(g) >= 2 for g in groups)
        for g in groups:
            assert all(spans[i].length <= 128 and spans[i].context_len <= 1024 for i in g)
            padded = len(g) * max(spans[i].length for i in g) * max(spans[i].context_len for i in g)
            assert padded <= 1.5 * sum(spans[i].length * spans[i].context_len for i in g) + 4096 * len(g)


@pytest.mark.parametrize("explicit_ops", [True, False], ids=["explicit", "fused"])
def test_prompt_chunks_of_different_sizes_in_one_step_match_mlx_lm(tmp_path, monkeypatch, explicit_ops):
    """One step holds a decode, short chunks of different lengths after cached
    prefixes of different lengths (batched with padding) and a long chunk (alone)."""
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.engine.sequence import Sequence
    from macinfer.sampling_params import SamplingParams
    from tests.helpers import tiny_model_dir

    path, ref = tiny_model_dir(tmp_path, "llama", max_position_embeddings=512)
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.02, block_size=16))
    engine.runner.explicit_ops = explicit_ops
    grouped = []
    original = prefill_plan.group_spans
    monkeypatch.setattr(prefill_plan, "group_spans", lambda spans: grouped.append(original(spans)) or grouped[-1])
    rng = np.random.default_rng(5)
    plans = [[7, 9], [3, 30], [20, 1], [33, 5], [150, 2], [40, 31]]  # tokens fed in step 1, step 2
    seqs = [Sequence(f"s{i}", rng.integers(3, 300, size=sum(p)).tolist(), SamplingParams(temperature=0), 0)
            for i, p in enumerate(plans)]
    got: list[list[np.ndarray]] = [[] for _ in seqs]
    for step in range(2):
        scheduled = sorted(((s, p[step]) for s, p in zip(seqs, plans)), key=lambda it: it[1] != 1)
        for s, n in scheduled:
            engine.block_manager.allocate(s, s.num_computed_tokens + n)
        ids, meta, _, _ = engine.runner.prepare(scheduled)
        logits = engine.model.logits(engine.model(ids, meta))
        mx.eval(logits)
        row = 0
        for s, n in scheduled:
            got[seqs.index(s)].append(np.array(logits[row : row + n]))
            s.num_computed_tokens += n
            row += n
    assert any(len(g) >= 3 for groups in grouped for g in groups), grouped  # padding did happen
    for s, parts in zip(seqs, got):
        want = np.array(ref(mx.array([s.prompt_token_ids]))[0])
        np.testing.assert_allclose(np.concatenate(parts), want, atol=2e-4, rtol=2e-4)
