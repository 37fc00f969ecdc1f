"""/v1/embeddings and LLMEngine.embed against mlx-lm's hidden states on a tiny model."""

import asyncio
import base64
import json
import os

import httpx
import mlx.core as mx
import numpy as np
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from tests.helpers import tiny_model_dir

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 61))]


def _with_pooling(path: str, mode_key: str, normalize: bool) -> str:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, mode_key: True}, f)
    return path


def _reference(model, tokens, mode, normalize):
    h = model.model(mx.array([tokens]))[0].astype(mx.float32)  # mlx-lm: final hidden states, normed
    v = h.mean(axis=0) if mode == "mean" else h[-1]
    if normalize:
        v = v / mx.linalg.norm(v)
    return np.array(v)


@pytest.mark.parametrize("mode_key,mode,normalize", [("pooling_mode_lasttoken", "last", True),
                                                      ("pooling_mode_mean_tokens", "mean", False)])
def test_embed_matches_mlx_lm_hidden_states(tmp_path, mode_key, mode, normalize):
    path, ref = tiny_model_dir(tmp_path, "qwen3")
    _with_pooling(path, mode_key, normalize)
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, max_num_batched_tokens=16))  # 41 tokens: 3 chunks
    got = engine.embed(PROMPTS)
    for v, tokens in zip(got, PROMPTS):
        np.testing.assert_allclose(v, _reference(ref, tokens, mode, normalize), atol=1e-4, rtol=1e-4)
    assert engine.block_manager.num_used_blocks == 0


def test_embeddings_endpoint(tmp_path):
    from macinfer.server.app import create_app

    path, ref = tiny_model_dir(tmp_path, "llama")
    _with_pooling(path, "pooling_mode_lasttoken", True)
    app = create_app(LLMEngine(path, EngineConfig(kv_cache_gb=0.01)), "tiny")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            a = await c.post("/v1/embeddings", json={"input": ["hello", "a longer input"], "model": "tiny"})
            b = await c.post("/v1/embeddings", json={"input": [5, 6, 7], "encoding_format": "base64"})
            bad = await c.post("/v1/embeddings", json={"input": "x", "dimensions": 8})
            return a, b, bad

    try:
        a, b, bad = asyncio.run(go())
    finally:
        app.state.async_engine.shutdown()
    assert a.status_code == 200 and len(a.json()["data"]) == 2 and a.json()["usage"]["prompt_tokens"] > 0
    v = np.array(a.json()["data"][0]["embedding"])
    assert abs(np.linalg.norm(v) - 1) < 1e-5
    vb = np.frombuffer(base64.b64decode(b.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vb, _reference(ref, [5, 6, 7], "last", True), atol=1e-4)
    assert bad.status_code == 400


def test_models_without_embedding_use_get_a_400(tiny_llama):
    from macinfer.server.app import create_app

    app = create_app(LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01)), "tiny")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/embeddings", json={"input": "hello"})

    try:
        r = asyncio.run(go())
    finally:
        app.state.async_engine.shutdown()
    assert r.status_code == 400 and "does not publish embedding use" in r.json()["error"]["message"]
