"""Loading: GGUF (tokenizer, Q/K layout), MLX directories, and clear errors."""

import json
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from macinfer.loader import ModelNotFoundError, load
from macinfer.models import UnsupportedArchitectureError
from macinfer.tokenizer import IncrementalDetokenizer
from tests.helpers import make_mlx_lm_model, tiny_config, tiny_model_dir

_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def _write_llama_gguf(path: str, config: dict, model) -> None:
    """Write an F32 GGUF the way llama.cpp's converter does (Q/K rows permuted)."""
    def permute(w, n_heads):
        return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)

    tensors = {}
    for name, w in tree_flatten(model.parameters()):
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            module, kind = ".".join(rest[:-1]), rest[-1]
            if module == "self_attn.q_proj":
                w = permute(w, config["num_attention_heads"])
            elif module == "self_attn.k_proj":
                w = permute(w, config["num_key_value_heads"])
            tensors[f"blk.{i}.{_GGUF_NAMES[module]}.{kind}"] = w
        elif name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = w
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = w
        elif name == "lm_head.weight":
            tensors["output.weight"] = w
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>"] + byte_tokens + ["▁"] + [f"▁tok{i}" for i in range(config["vocab_size"] - 260)]
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": u32(config["hidden_size"]),
        "llama.block_count": u32(config["num_hidden_layers"]),
        "llama.feed_forward_length": u32(config["intermediate_size"]),
        "llama.attention.head_count": u32(config["num_attention_heads"]),
        "llama.attention.head_count_kv": u32(config["num_key_value_heads"]),
        "llama.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"], dtype=mx.float32),
        "llama.rope.freq_base": mx.array(config["rope_theta"], dtype=mx.float32),
        "llama.context_length": u32(config["max_position_embeddings"]),
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": mx.array([0.0] * 3 + [-1000.0] * 256 + [-float(i) for i in range(len(tokens) - 259)], dtype=mx.float32),
        "tokenizer.ggml.token_type": mx.array([2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259), dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}",
    }
    mx.save_gguf(path, tensors, meta)


@pytest.mark.parametrize("tie", [True, False])
def test_f32_llama_gguf_matches_mlx_lm(tmp_path, tie):
    config = tiny_config("llama", tie)
    ref = make_mlx_lm_model(config, seed=3)
    path = str(tmp_path / "tiny.gguf")
    _write_llama_gguf(path, config, ref)
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
    cfg["model_type"] = "gpt2"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(UnsupportedArchitectureError, match="unsupported architecture 'gpt2'; supported: llama, mistral, qwen2, qwen3"):
        load(path)


def test_unsupported_architecture_gguf(tmp_path):
    path = str(tmp_path / "falcon.gguf")
    mx.save_gguf(path, {"token_embd.weight": mx.zeros((4, 4))}, {"general.architecture": "falcon"})
    with pytest.raises(UnsupportedArchitectureError, match="'falcon'"):
        load(path)
