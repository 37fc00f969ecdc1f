"""PLaMo 3: which side is right, against a float64 NumPy forward (issue #45).

mlx-lm's plamo3 file masks a prompt with `window_size + 1` keys per query but
keeps `window_size` keys in its RotatingKVCache for decodes, so its whole-prompt
logits and its token-by-token logits disagree once a prompt passes the window.
The published semantics (vLLM's and SGLang's PLaMo 3: a sliding layer's query
sees `window_size` keys, itself included; SGLang passes `window_size - 1` as its
exclusive window) are written here in float64 NumPy from the weights alone, not
through mlx-lm's classes. Verdict: macinfer equals them; mlx-lm's prompt path is
one key too wide (docs/architectures.md).
"""

from __future__ import annotations

import numpy as np
import pytest
from mlx.utils import tree_flatten

from macinfer import EngineConfig, LLMEngine
from tests.helpers import make_mlx_lm_model, save_model_dir
from tests.zoo import tiny_config

import mlx.core as mx

TOKENS = [int(t) for t in np.random.default_rng(3).integers(3, 300, 30)]


def _rms(x: np.ndarray, w: np.ndarray, offset: float, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (w + offset)


def _rope(x: np.ndarray, base: float) -> np.ndarray:
    """Half-split (non-interleaved) rotary embedding over the whole head, positions 0.."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(x.shape[-2], dtype=np.float64)[:, None] * inv[None]
    cos, sin = np.cos(ang), np.sin(ang)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def plamo3_float64(weights: dict[str, np.ndarray], cfg: dict, tokens: list[int], window: int) -> np.ndarray:
    """Logits [len, vocab] of PLaMo 3 from its config and weights; a sliding layer's
    query attends to the `window` latest keys, itself included."""
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    nq, nkv, pattern = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["sliding_window_pattern"]
    w = lambda name: weights[name].astype(np.float64)  # noqa: E731
    n = len(tokens)
    x = w("model.embed_tokens.weight")[tokens]
    i, j = np.arange(n)[:, None], np.arange(n)[None]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.layers.{layer}."
        full = (layer + 1) % pattern == 0
        h = _rms(x, w(p + "pre_mixer_norm.weight"), 1.0, eps)
        qkv = h @ w(p + "mixer.qkv_proj.weight").T
        q, k, v = np.split(qkv, [nq * hd, (nq + nkv) * hd], axis=-1)
        q = q.reshape(n, nq, hd).transpose(1, 0, 2)
        k = k.reshape(n, nkv, hd).transpose(1, 0, 2)
        v = v.reshape(n, nkv, hd).transpose(1, 0, 2)
        base = cfg["rope_theta"] if full else cfg["rope_local_theta"]
        q = _rope(_rms(q, w(p + "mixer.q_norm.weight"), 1.0, eps), base)
        k = _rope(_rms(k, w(p + "mixer.k_norm.weight"), 1.0, eps), base)
        k, v = np.repeat(k, nq // nkv, axis=0), np.repeat(v, nq // nkv, axis=0)
        allowed = (j <= i) if full else (j <= i) & (j > i - window)
        s = np.where(allowed, q @ k.transpose(0, 2, 1) * hd**-0.5, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = ((s / s.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(n, nq * hd)
        x = x + _rms(o @ w(p + "mixer.o_proj.weight").T, w(p + "post_mixer_norm.weight"), 1 / 5, eps)
        gate, value = np.split(_rms(x, w(p + "pre_mlp_norm.weight"), 1.0, eps) @ w(p + "mlp.gate_up_proj.weight").T, 2, -1)
        m = (gate / (1 + np.exp(-gate)) * value) @ w(p + "mlp.down_proj.weight").T
        x = x + _rms(m, w(p + "post_mlp_norm.weight"), 5**-1.5, eps)
    x = _rms(x, w("model.norm.weight"), 1.0, eps)
    head = w("lm_head.weight") if "lm_head.weight" in weights else w("model.embed_tokens.weight")
    return x @ head.T


@pytest.fixture(scope="module")
def plamo3(tmp_path_factory):
    config = tiny_config("plamo3", num_hidden_layers=4, rope_local_theta=500.0)
    model = make_mlx_lm_model(config, seed=11)
    weights = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}
    path = save_model_dir(str(tmp_path_factory.mktemp("plamo3") / "m"), config, model)
    return config, model, weights, path


def test_macinfer_equals_the_float64_forward(plamo3):
    config, _, weights, path = plamo3
    window = config["sliding_window"]
    assert len(TOKENS) > 3 * window  # the window matters at most positions
    want = plamo3_float64(weights, config, TOKENS, window)
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, model_impl="mlx-lm"))
    for chunks in ([30], [7, 9, 1, 1, 12], [1] * 30):  # one prefill, chunked, all decodes
        got = engine.score([TOKENS], chunks)[0]
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4, err_msg=str(chunks))
    # The reference is sharp: one key more per sliding query moves the logits.
    wider = plamo3_float64(weights, config, TOKENS, window + 1)
    assert np.abs(wider[window:] - want[window:]).max() > 1e-2
    np.testing.assert_allclose(wider[:window], want[:window], atol=1e-9)


def test_mlx_lm_prompt_path_is_one_key_too_wide(plamo3):
    """The documented mlx-lm departure: its decodes follow the published window, its
    prompt mask is `window + 1` keys (mlx_lm/models/plamo3.py, `window_size + 1`)."""
    from mlx_lm.models.cache import make_prompt_cache

    config, model, weights, _ = plamo3
    window = config["sliding_window"]
    prompt = np.array(model(mx.array([TOKENS]))[0].astype(mx.float32))
    np.testing.assert_allclose(prompt, plamo3_float64(weights, config, TOKENS, window + 1), atol=2e-4, rtol=2e-4)
    cache = make_prompt_cache(model)
    steps = np.concatenate([np.array(model(mx.array([[t]]), cache=cache)[0].astype(mx.float32)) for t in TOKENS])
    np.testing.assert_allclose(steps, plamo3_float64(weights, config, TOKENS, window), atol=2e-4, rtol=2e-4)
