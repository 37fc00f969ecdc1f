"""Mistral 7B v0.1's `sliding_window: 4096` (of 32,768 positions) is applied (#40).

mlx-lm and llama.cpp attend to every earlier key; the Mistral paper, transformers and
vLLM attend to the last 4,096. We follow the published semantics: a tiny model with the
v0.1 config, a 4,300-token prompt, logits past position 4,096 against mlx-lm's model run
over the whole sequence with transformers' window mask (a key is visible to the query at
q when q - 4096 < k <= q), and shown to differ from mlx-lm's unwindowed answer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.models.mlx_lm_classes import config_windows
from tests.helpers import make_mlx_lm_model, save_model_dir
from tests.test_architecture_matrix import _window_masks

CONFIG = {"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 300,
          "max_position_embeddings": 32768, "rope_theta": 10000.0, "sliding_window": 4096,
          "tie_word_embeddings": False, "eos_token_id": 2}
N = 4300


def test_mistral_v01_attends_to_its_4096_token_window(tmp_path):
    ref = make_mlx_lm_model(CONFIG, seed=11)
    path = save_model_dir(str(tmp_path / "mistral"), CONFIG, ref)
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.05, max_model_len=8192, max_num_batched_tokens=1024))
    assert [s.kind.window for s in engine.layer_specs] == [4096, 4096] == config_windows(CONFIG, 2)
    tokens = np.random.default_rng(0).integers(3, 300, N).tolist()
    ours = engine.score([tokens], [1024] * 4 + [N - 4096])[0][-64:]
    with _window_masks(ref, [4096, 4096]):
        windowed = np.array(ref(mx.array([tokens]))[0, -64:].astype(mx.float32))
    unwindowed = np.array(ref(mx.array([tokens]))[0, -64:].astype(mx.float32))
    np.testing.assert_allclose(ours, windowed, atol=2e-4, rtol=2e-4)
    assert np.abs(unwindowed - windowed).max() > 1e-3  # the window changes these logits
