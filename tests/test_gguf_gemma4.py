"""Gemma 4 GGUF files (llama.cpp's `gemma4`), written as its Gemma4Model converter writes them
(`tests/gguf_gemma4.py`), load onto mlx-lm's `gemma4_text` class and give its logits: sliding
and global layers of two head widths, KV shared across layers, per-layer token embeddings,
the double-wide MLP, experts beside the MLP, keys as values, the global layers' partial
rotation read from `rope_freqs`; and its tokenizer kind (BPE over raw UTF-8 with "▁" spaces);
and the load-time refusals of forms the new architectures' classes cannot run."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from mlx.utils import tree_flatten

from macinfer.gguf.tokenizer import tokenizer_from_gguf
from tests.gguf_hybrid_writer import hybrid_tensors, write_hybrid_gguf
from tests.helpers import make_mlx_lm_model
from tests.test_gguf_hybrid import _check_quantized_file, _runs_like_mlx_lm
from tests.zoo import tiny_config

MOE = dict(num_kv_shared_layers=0, hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4,
           top_k_experts=2, moe_intermediate_size=32)
CASES = {
    "e2b": {},  # per-layer embeddings, the last two layers reading earlier layers' K/V
    "double_wide": dict(use_double_wide_mlp=True),  # the KV-shared layers' MLP twice as wide
    "26b_a4b": MOE,  # experts beside the MLP, their gate and up fused in the file
    "31b": dict(num_kv_shared_layers=0, hidden_size_per_layer_input=0, attention_k_eq_v=True,
                num_global_key_value_heads=1),  # global layers: one K/V head, keys as values
}


def _model(extra: dict, seed: int = 0):
    """A tiny Gemma 4 from mlx-lm's class, its parameters that initialise to one value (the
    router's scales, the layer scalars) set off it, so a mix-up of them shows in the logits."""
    config = {**tiny_config("gemma4_text"), **extra}
    model = make_mlx_lm_model(config, seed=seed)
    params = {k: (v * (1 + 0.3 * mx.random.normal(v.shape)) if v.size > 0 and mx.all(v == v.reshape(-1)[0]).item()
                  else v) for k, v in tree_flatten(model.parameters())}
    model.load_weights(list(params.items()))
    return config, model


@pytest.mark.parametrize("case", sorted(CASES))
def test_gemma4_gguf_runs_like_mlx_lm(tmp_path, case):
    config, model = _model(CASES[case])
    path = str(tmp_path / "g4.gguf")
    write_hybrid_gguf(path, "gemma4", config, hybrid_tensors("gemma4", config, model))
    engine = _runs_like_mlx_lm(path, model, "gemma4_text")
    read = engine.loaded.config
    assert read["rope_parameters"]["full_attention"]["partial_rotary_factor"] == 0.25  # (from rope_freqs)
    assert read["attention_k_eq_v"] == (case == "31b") and read["enable_moe_block"] == (case == "26b_a4b")
    heads = {s.kind.describe(): (s.num_kv_heads, s.head_dim) for s in engine.layer_specs}
    assert heads == {"sliding window 8": (2, 16), "full attention": (1 if case == "31b" else 2, 32)}


def test_gemma4_gguf_with_q8_0_experts(tmp_path):
    """The fused gate_up experts in a block format: split row-wise, scales and biases alike."""
    config, model = _model(MOE, seed=3)
    tensors = hybrid_tensors("gemma4", config, model)
    quant = {n: Q.Q8_0 for n, t in tensors.items() if t.ndim >= 2 and t.shape[-1] % 32 == 0 and "_exps" in n}
    assert {n.split(".")[2] for n in quant} == {"ffn_gate_up_exps", "ffn_down_exps"}
    _check_quantized_file(tmp_path, "gemma4", config, model, tensors, quant, atol=2e-4)


def test_gemma4_gguf_reads_its_rotation_from_rope_freqs(tmp_path):
    """The converter writes the global layers' whole head width as rotated and marks the still
    pairs in `rope_freqs` (1e30): reading the width alone would turn all of them."""
    config, model = _model({}, seed=1)
    tensors = hybrid_tensors("gemma4", config, model)
    tensors["rope_freqs.weight"] = np.ones_like(tensors["rope_freqs.weight"])
    path = str(tmp_path / "g4.gguf")
    write_hybrid_gguf(path, "gemma4", config, tensors)
    with pytest.raises(AssertionError):  # a file that turns every pair is another model
        _runs_like_mlx_lm(path, model)


def _gemma4_vocab(path: str) -> None:
    """The metadata of a small gemma4-kind vocabulary written by the gguf package."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        ["h", "e", "l", "o", "▁", "w", "r", "d", "he", "ll", "llo", "hello", "▁w", "▁wor", "or", "▁world"]
    merges = ["h e", "l l", "ll o", "he llo", "▁ w", "o r", "▁w or", "▁wor l", "▁worl d"]
    tokens += ["▁worl"]
    w = gguf.GGUFWriter(path, "gemma4")
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * (len(tokens) - 260))
    w.add_token_merges(merges)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gemma4_tokenizer_kind(tmp_path):
    """Merges over the text's own characters, a space as "▁" with none put before the text,
    a character the vocabulary lacks as its UTF-8 bytes, BOS first; decoding gives the text."""
    from macinfer.gguf.file import GGUFFile

    _gemma4_vocab(str(tmp_path / "v.gguf"))
    tok, facts = tokenizer_from_gguf(GGUFFile(str(tmp_path / "v.gguf")).metadata)
    enc = tok.encode("hello world é")
    assert enc.tokens == ["<bos>", "hello", "▁world", "▁", "<0xC3>", "<0xA9>"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "hello world é"
    assert facts["bos_token"] == "<bos>" and 1 in facts["eos_token_ids"]


def test_forms_the_loader_cannot_run_are_one_line_load_errors(tmp_path):
    """Files of the new architectures in forms mlx-lm's classes cannot run are refused at load
    with the reason: a Gemma 4 without its layer pattern, a Llama 4 with every layer full
    attention (MobileLLM-R1), a Ministral 3 without YaRN, an EXAONE 4 window without a pattern;
    the CLI prints one line and exits 1."""
    from click.testing import CliRunner

    from macinfer.cli.main import main
    from macinfer.loading.loader import ModelLoadError, load
    from tests.gguf_writer import arch_tensors, write_gguf
    from tests.test_architectures import BASE

    config, model = _model({})
    tensors = hybrid_tensors("gemma4", config, model)
    path = str(tmp_path / "g4.gguf")
    write_hybrid_gguf(path, "gemma4", config, tensors)
    raw = open(path, "rb").read()  # the pattern's key renamed: the file then lacks it
    open(path, "wb").write(raw.replace(b"gemma4.attention.sliding_window_pattern",
                                       b"gemma4.attention.sliding_window_pattexx"))
    cases = [(path, "sliding_window_pattern must mark every layer")]
    l4 = tiny_config("llama4")
    l4["text_config"]["attention_chunk_size"] = 8192
    l4_model = make_mlx_lm_model(l4)
    write_hybrid_gguf(str(tmp_path / "l4.gguf"), "llama4", l4, hybrid_tensors("llama4", l4, l4_model),
                      extra_meta={"llama4.attention.sliding_window": 0})
    cases.append((str(tmp_path / "l4.gguf"), "MobileLLM-R1"))
    m3 = {**BASE, "model_type": "llama"}
    write_gguf(str(tmp_path / "m3.gguf"), m3, arch_tensors("mistral3", m3, make_mlx_lm_model(m3)), arch="mistral3")
    cases.append((str(tmp_path / "m3.gguf"), "without YaRN"))
    ex = {**BASE, "model_type": "exaone4", "sliding_window": 8, "sliding_window_pattern": "LG", "rope_scaling": None}
    write_gguf(str(tmp_path / "ex.gguf"), ex, arch_tensors("exaone4", ex, make_mlx_lm_model(ex)), arch="exaone4",
               extra_meta={"exaone4.attention.sliding_window": 8})
    cases.append((str(tmp_path / "ex.gguf"), "window without attention.sliding_window_pattern"))
    for file, reason in cases:
        with pytest.raises(ModelLoadError, match=reason):
            load(file)
        r = CliRunner().invoke(main, ["generate", file, "-p", "hi", "-n", "1", "--kv-cache-gb", "0.01"])
        assert r.exit_code == 1 and reason.split()[0] in r.output and "Traceback" not in r.output, r.output
