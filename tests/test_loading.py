"""Loading: GGUF (tokenizer, Q/K layout), MLX directories, and clear errors."""

import json
import os

import mlx.core as mx
import numpy as np
import pytest

from macinfer.loading.loader import ModelNotFoundError, load
from macinfer.models import UnsupportedArchitectureError
from macinfer.text.tokenizer import IncrementalDetokenizer
from tests.gguf_writer import llama_tensors, write_gguf
from tests.helpers import make_mlx_lm_model, tiny_config, tiny_model_dir

@pytest.mark.parametrize("tie", [True, False])
def test_f32_llama_gguf_matches_mlx_lm(tmp_path, tie):
    config = tiny_config("llama", tie)
    ref = make_mlx_lm_model(config, seed=3)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, config, llama_tensors(config, ref))
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from tests.test_model_parity import _reference_logits

    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01))
    tokens = list(range(5, 35))
    ours = engine.score([tokens], [30])[0]
    np.testing.assert_allclose(ours, _reference_logits(ref, tokens, [30]), atol=1e-4, rtol=1e-4)
    # SentencePiece-kind tokenizer from the GGUF: bytes fall back to <0xNN> pieces.
    tok = engine.tokenizer
    ids = tok.encode("hé")
    assert ids[0] == 1  # BOS added for the llama kind
    assert tok.decode(ids) == "hé"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False) == "[user] x\n"


def test_smollm2_gguf_tokenizer(smollm2_engine):
    tok = smollm2_engine.tokenizer
    # <|im_end|> is the GGUF's EOS; <|endoftext|> is a control token llama.cpp also ends on.
    assert tok.eos_token_ids == {0, 2} and tok.bos_token_id == 1
    text = "Hello, world! 123 — ünïcode 日本語 🙂"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("12") == [tok.tokenizer.token_to_id("1"), tok.tokenizer.token_to_id("2")]  # digits split
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.endswith("<|im_start|>assistant\n")
    chat_ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert chat_ids == tok.encode(chat, add_special_tokens=False)
    assert chat_ids.count(1) == 3  # <|im_start|> is one special token, three times


def test_incremental_detokenizer_is_utf8_safe(smollm2_engine):
    tok = smollm2_engine.tokenizer
    text = "Emoji 🙂🎉 and 日本語 and ünïcode, done."
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add(i) for i in tok.encode(text)]
    assert "".join(pieces) + detok.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # multi-byte characters were held back


def test_mlx_dir_and_convert_roundtrip(tmp_path, smollm2_mlx_dir):
    path, _ = tiny_model_dir(tmp_path, "qwen3")
    assert load(path).config["model_type"] == "qwen3"
    with open(os.path.join(smollm2_mlx_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["model.embed_tokens"]["bits"] == 8


def test_missing_path_is_a_clear_error():
    with pytest.raises(ModelNotFoundError, match="not found: ./no/such/model"):
        load("./no/such/model")


def test_repo_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="no-such-org/no-such-model"):
        load("no-such-org/no-such-model")


def test_unsupported_architecture_dir(tmp_path):
    path, _ = tiny_model_dir(tmp_path, "llama")
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    for model_type, why in (("gpt2", r"mlx-lm's mlx_lm.models.gpt2 cannot build this config \(.*'n_embd'"),
                            ("not_a_model", "Model type not_a_model not supported")):
        cfg["model_type"] = model_type
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
        with pytest.raises(UnsupportedArchitectureError, match=f"unsupported architecture '{model_type}': {why}"):
            load(path)


def test_unsupported_architecture_gguf(tmp_path):
    path = str(tmp_path / "falcon.gguf")
    mx.save_gguf(path, {"token_embd.weight": mx.zeros((4, 4))}, {"general.architecture": "falcon"})
    with pytest.raises(UnsupportedArchitectureError, match="'falcon'"):
        load(path)


@pytest.mark.parametrize("tie", [False, True])
def test_a_tiny_minicpm_with_its_scales_loads_and_matches_mlx_lm(tmp_path, tie):
    """MiniCPM's `dim_model_base`, `scale_depth`, `scale_emb`, tied or not. Tied, mlx-lm's
    sanitizer copies the embedding to an lm_head the tied model lacks (mlx_lm.load then
    refuses the directory); the loader drops that copy, and the tokens equal mlx-lm's
    model built in memory on the same weights."""
    from tests.helpers import generate, make_mlx_lm_model, save_model_dir
    from tests.test_architectures import _reference_greedy

    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.sampling_params import SamplingParams

    config = {"model_type": "minicpm", "hidden_size": 64, "dim_model_base": 32, "num_hidden_layers": 2,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
              "vocab_size": 300, "scale_depth": 1.4, "scale_emb": 12.0, "max_position_embeddings": 2048,
              "rope_theta": 10000.0, "tie_word_embeddings": tie, "eos_token_id": 2}
    ref = make_mlx_lm_model(config, seed=3)
    path = save_model_dir(str(tmp_path / "minicpm"), config, ref)
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01))
    prompt = list(range(5, 30))
    got = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].token_ids
    assert got == _reference_greedy(ref, prompt, 10)
