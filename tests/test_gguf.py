"""GGUF files as llama.cpp writes them: RoPE scaling, K-quants, broken files,
tokenizer metadata, Hub references."""

import os

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as Q
from mlx.utils import tree_flatten

from macinfer.cli.main import main
from macinfer.gguf.tensor_config import llama3_factors
from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.loading.loader import ModelLoadError, ModelNotFoundError, load, resolve
from macinfer.models import UnsupportedArchitectureError
from tests.gguf_writer import dequantized, llama_tensors, random_kquant, write_gguf
from tests.helpers import make_mlx_lm_model, save_model_dir, tiny_config
from tests.test_model_parity import _reference_logits

TOKENS = list(range(5, 45))


def _engine(path: str) -> LLMEngine:
    return LLMEngine(path, EngineConfig(kv_cache_gb=0.01))


def _assert_logits_match(path: str, ref, atol=1e-4):
    ours = _engine(path).score([TOKENS], [24, 16])[0]
    want = _reference_logits(ref, TOKENS, [24, 16])
    np.testing.assert_allclose(ours, want, atol=atol, rtol=atol)


def test_rope_freqs_are_applied(tmp_path):
    """Llama 3.1+ GGUF files carry llama3 scaling as `rope_freqs.weight` only."""
    config = tiny_config("llama3", tie=False)
    ref = make_mlx_lm_model(config, seed=5)
    tensors = llama_tensors(config, ref)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    tensors["rope_freqs.weight"] = np.array(llama3_factors(head_dim, config["rope_theta"], config["rope_scaling"]),
                                            dtype=np.float32)
    path = str(tmp_path / "llama31.gguf")
    write_gguf(path, config, tensors)
    assert load(path).config["rope_freq_factors"][-1] == 8.0
    _assert_logits_match(path, ref)
    # Without the factors the positions rotate differently: the test can fail.
    del tensors["rope_freqs.weight"]
    write_gguf(str(tmp_path / "plain.gguf"), config, tensors)
    with pytest.raises(AssertionError):
        _assert_logits_match(str(tmp_path / "plain.gguf"), ref)


def test_convert_turns_rope_freqs_into_llama3_scaling(tmp_path):
    config = tiny_config("llama3", tie=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, rope_theta=500000.0, hidden_size=256, num_attention_heads=2)
    ref = make_mlx_lm_model(config, seed=1)
    tensors = llama_tensors(config, ref)
    tensors["rope_freqs.weight"] = np.array(llama3_factors(128, 500000.0, config["rope_scaling"]), dtype=np.float32)
    write_gguf(str(tmp_path / "m.gguf"), config, tensors)
    from macinfer.loading.convert import convert_gguf

    out = load(convert_gguf(str(tmp_path / "m.gguf"), str(tmp_path / "mlx")))
    assert out.config["rope_scaling"]["rope_type"] == "llama3" and "rope_freq_factors" not in out.config


def test_yarn_metadata_is_applied(tmp_path):
    config = tiny_config("llama", tie=True)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    ref = make_mlx_lm_model(config, seed=2)
    path = str(tmp_path / "yarn.gguf")
    write_gguf(path, config, llama_tensors(config, ref), extra_meta={
        "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 512})
    assert load(path).config["rope_scaling"]["rope_type"] == "yarn"
    _assert_logits_match(path, ref)


def test_unknown_rope_kinds_are_refused_at_load(tmp_path):
    config = tiny_config("llama")
    ref = make_mlx_lm_model(config)
    path = str(tmp_path / "odd.gguf")
    write_gguf(path, config, llama_tensors(config, ref), extra_meta={"llama.rope.scaling.type": "longrope-x"})
    with pytest.raises(ModelLoadError, match="unsupported RoPE scaling 'longrope-x'"):
        load(path)
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    save_model_dir(str(tmp_path / "dyn"), config, ref)
    with pytest.raises(UnsupportedArchitectureError, match="unsupported RoPE scaling 'dynamic'"):
        load(str(tmp_path / "dyn"))


KQ_CONFIG = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=512, tie_word_embeddings=False)


# Q4_K and Q5_K keep their own per-32 grids (exact up to float16); Q6_K goes to
# 8 bits; Q2_K / Q3_K (16-wide sub-blocks) are approximated with 4 bits per 32.
@pytest.mark.parametrize("types,tol", [({"default": Q.Q4_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K}, 0.02),
                                       ({"default": Q.Q5_K, "ffn_down": Q.Q3_K, "output": Q.Q2_K}, 0.15)],
                         ids=["Q4_K_M-like", "Q5_K-Q3_K-Q2_K"])
def test_kquant_gguf_requantized_near_file_size(tmp_path, monkeypatch, types, tol):
    monkeypatch.setenv("MACINFER_CPU_WEIGHTS", "quantized")  # keep the weights as loaded
    config = tiny_config("llama", tie=False, **KQ_CONFIG)
    base = make_mlx_lm_model(config, seed=4)
    tensors, quant = llama_tensors(config, base), {}
    rng = np.random.default_rng(0)
    for name, t in list(tensors.items()):
        if t.ndim == 2:
            kind = next((q for k, q in types.items() if k in name), types["default"])
            tensors[name], quant[name] = random_kquant(kind, *t.shape, rng), kind
    path = str(tmp_path / "kq.gguf")
    write_gguf(path, config, tensors, quant=quant)

    # Reference: mlx-lm's class with the blocks dequantized by llama.cpp's gguf package (float32).
    ref_weights = {}
    from tests.gguf_writer import GGUF_NAMES, permute_qk

    inv = {v: k for k, v in GGUF_NAMES.items()}
    for name, t in tensors.items():
        w = dequantized(t, quant[name]) if name in quant else t
        if name.startswith("blk."):
            _, i, part, kind = name.split(".")
            hf = f"model.layers.{i}.{inv[part]}.{kind}"
            if part in ("attn_q", "attn_k"):  # undo the converter's permutation
                n = config["num_attention_heads"] if part == "attn_q" else config["num_key_value_heads"]
                w = w.reshape(n, w.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        else:
            hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}[name]
        ref_weights[hf] = mx.array(w)
    base.load_weights(list(ref_weights.items()))
    assert permute_qk  # (the writer's permutation, inverted above)

    calls = []
    loaded = load(path, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[0] == (0, len(tensors)) and calls[-1] == (len(tensors) - 1, len(tensors))  # per tensor
    param_bytes = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
    ratio = param_bytes / os.path.getsize(path)
    assert ratio < 1.3, f"in memory {param_bytes} bytes for a {os.path.getsize(path)}-byte file"
    assert any("scales" in k for k, _ in tree_flatten(loaded.model.parameters()))
    ours = _engine(path).score([TOKENS], [40])[0]
    want = _reference_logits(base, TOKENS, [40])
    err = np.abs(ours - want).max() / np.abs(want).max()
    print(f"K-quant logits: max abs error {np.abs(ours - want).max():.2e}, relative to max |logit| {err:.2e}, "
          f"memory/file {ratio:.3f}")
    assert err < tol


def _truncated_copy(src: str, dst: str, fraction: float) -> str:
    with open(src, "rb") as f, open(dst, "wb") as g:
        g.write(f.read(int(os.path.getsize(src) * fraction)))
    return dst


def test_broken_gguf_files_are_one_line_errors(tmp_path, smollm2_gguf):
    half = _truncated_copy(smollm2_gguf, str(tmp_path / "half.gguf"), 0.5)
    header = _truncated_copy(smollm2_gguf, str(tmp_path / "header.gguf"), 0.001)
    notgguf = str(tmp_path / "text.gguf")
    with open(notgguf, "w") as f:
        f.write("<html>404 Not Found</html>" * 10)
    for path, msg in ((half, "truncated GGUF file"), (header, "truncated or corrupt GGUF header"),
                      (notgguf, "not a GGUF file")):
        with pytest.raises(ModelLoadError, match=msg) as e:
            load(path)
        assert os.path.basename(path) in str(e.value) and "\n" not in str(e.value)
    # Every CLI entry point: one line, exit 1, no traceback.
    for args in (["generate", half, "-p", "hi"], ["chat", half], ["serve", half, "--port", "0"],
                 ["convert", half, str(tmp_path / "out")]):
        r = CliRunner().invoke(main, args, input="")
        assert r.exit_code == 1, (args, r.output)
        assert "truncated GGUF file" in r.output and "Traceback" not in r.output
        lines = [ln for ln in r.output.strip().splitlines() if not ln.startswith("loading ")]
        assert len(lines) == 1, r.output
    # The Python API raises the same one-line error.
    from macinfer import LLM

    with pytest.raises(ModelLoadError, match="half.gguf: truncated GGUF file"):
        LLM(half)


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    config = tiny_config("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [chr(0x100 + i) for i in range(config["vocab_size"] - 3)]
    write_gguf(str(tmp_path / "pre.gguf"), config, llama_tensors(config, make_mlx_lm_model(config)),
               tokenizer={"model": "gpt2", "pre": "mystery-bpe",
                          "vocab": (tokens, [0.0] * len(tokens), [3, 3, 3] + [1] * (len(tokens) - 3))})
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer 'mystery-bpe'"):
        load(str(tmp_path / "pre.gguf"))


def test_user_defined_tokens_decode_as_text(smollm2_engine):
    """GGUF USER_DEFINED tokens (Qwen3's <think>) are text; CONTROL ones are skipped."""
    from macinfer.gguf.tokenizer import tokenizer_from_gguf

    tokens = ["<unk>", "<|im_end|>", "<think>", "</think>"] + list("abcdefghijklmnopqrstuvwxyz ")
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": [], "tokenizer.ggml.token_type": [2, 3, 4, 4] + [1] * 27,
            "tokenizer.ggml.eos_token_id": 1}
    tok, facts = tokenizer_from_gguf(meta)
    ids = tok.encode("<think>x</think><|im_end|>").ids
    assert ids == [2, tokens.index("x"), 3, 1]
    assert tok.decode(ids, skip_special_tokens=True) == "<think>x</think>"
    assert facts["eos_token_ids"] == {1}


def test_hub_gguf_references(monkeypatch, tmp_path):
    import huggingface_hub

    files = ["README.md", "Model-Q4_K_M.gguf", "Model-Q8_0.gguf", "Model-f16.gguf", "mmproj-Model-Q4_K_M.gguf"]
    fetched = []
    from macinfer.loading import loader

    monkeypatch.setattr(loader, "_check_hub_reachable", lambda ref: None)  # the Hub is the fake below
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo: files)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda repo, filename: fetched.append((repo, filename)) or str(tmp_path / filename))
    assert resolve("org/Model-GGUF:Q4_K_M") == str(tmp_path / "Model-Q4_K_M.gguf")
    assert resolve("org/Model-GGUF:q8_0").endswith("Model-Q8_0.gguf")
    assert resolve("org/Model-GGUF/sub/Model-f16.gguf").endswith("Model-f16.gguf")
    assert fetched[-1] == ("org/Model-GGUF", "sub/Model-f16.gguf")
    with pytest.raises(ModelNotFoundError, match="no GGUF file for 'Q5_K_S'; it has: F16, Q4_K_M, Q8_0"):
        resolve("org/Model-GGUF:Q5_K_S")


def test_hub_gguf_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="'no-org/no-model-GGUF:Q4_K_M' is not in the Hugging Face cache "
                       "and HF_HUB_OFFLINE is set"):
        resolve("no-org/no-model-GGUF:Q4_K_M")


@pytest.mark.slow
def test_gguf_and_converted_dir_give_the_same_tokens(smollm2_engine, smollm2_mlx_dir):
    from macinfer.sampling_params import SamplingParams
    from tests.helpers import generate

    conv = LLMEngine(smollm2_mlx_dir, EngineConfig(kv_cache_gb=0.05, max_model_len=512))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colors."}]
    a, b = smollm2_engine.tokenizer.encode_chat(msgs), conv.tokenizer.encode_chat(msgs)
    assert a == b
    p = SamplingParams(temperature=0, max_tokens=12)
    assert generate(smollm2_engine, [a], p)[0].token_ids == generate(conv, [b], p)[0].token_ids


# llama.cpp architecture -> (mlx-lm config overrides, extra GGUF metadata)
GGUF_ARCHS = {
    "qwen2": ({"model_type": "qwen2", "tie_word_embeddings": True}, {}),
    "qwen3": ({"model_type": "qwen3"}, {}),
    "qwen3moe": ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "moe_intermediate_size": 32, "norm_topk_prob": True},
                 {"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2,
                  "qwen3moe.expert_feed_forward_length": 32}),
    "gemma2": ({"model_type": "gemma2", "query_pre_attn_scalar": 16.0, "attn_logit_softcapping": 5.0,
                "final_logit_softcapping": 3.0},
               {"gemma2.attn_logit_softcapping": 5.0, "gemma2.final_logit_softcapping": 3.0}),
    "gemma3": ({"model_type": "gemma3_text", "query_pre_attn_scalar": 16.0, "sliding_window": 8, "num_hidden_layers": 6,
                "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0},
               {"gemma3.attention.sliding_window": 8}),
    "phi3": ({"model_type": "phi3", "partial_rotary_factor": 0.5}, {"phi3.rope.dimension_count": 8}),
    # GLM-4-0414: sandwich norms, fused gate/up, Q/K/V biases, pairwise RoPE on half of each head
    "glm4": ({"model_type": "glm4", "partial_rotary_factor": 0.5, "attention_bias": True},
             {"glm4.rope.dimension_count": 8}),
    "gemma": ({"model_type": "gemma", "tie_word_embeddings": True}, {}),  # (Gemma 1: norms stored as 1 + w)
    "olmo2": ({"model_type": "olmo2"}, {}),  # (norms after attention and MLP, query/key norms over all heads)
    "starcoder2": ({"model_type": "starcoder2", "norm_epsilon": 1e-5},  # (LayerNorms, biases, a GELU MLP)
                   {"starcoder2.attention.layer_norm_epsilon": 1e-5}),
    # Granite 3.x: Llama's layers (Q/K rows permuted by its converter) with four scales
    "granite": ({"model_type": "granite", "attention_multiplier": 0.2, "embedding_multiplier": 3.0,
                 "residual_multiplier": 0.5, "logits_scaling": 4.0, "attention_bias": False, "mlp_bias": False},
                {"granite.attention.scale": 0.2, "granite.embedding_scale": 3.0, "granite.residual_scale": 0.5,
                 "granite.logit_scale": 4.0}),
    # Command R: a LayerNorm before attention and MLP in parallel, pairwise RoPE, a logit scale
    "command-r": ({"model_type": "cohere", "logit_scale": 0.25, "layer_norm_eps": 1e-5, "tie_word_embeddings": True},
                  {"command-r.logit_scale": 0.25, "command-r.attention.layer_norm_epsilon": 1e-5}),
    # SmolLM3: Llama's converter (Q/K rows permuted), no RoPE in every fourth layer (llama.cpp's fixed step)
    "smollm3": ({"model_type": "smollm3", "num_hidden_layers": 4, "tie_word_embeddings": True}, {}),
    # Seed-OSS: Q/K/V biases, Q/K rows as they are
    "seed_oss": ({"model_type": "seed_oss", "attention_bias": True}, {}),
    # EXAONE 4.0: post-norms, query/key norms, sliding layers with RoPE and global ones without
    "exaone4": ({"model_type": "exaone4", "num_hidden_layers": 4, "sliding_window": 8, "sliding_window_pattern": "LLLG",
                 "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}},
                {"exaone4.attention.sliding_window": 8, "exaone4.attention.sliding_window_pattern": [True, True, True, False]}),
    # Ministral 3: Llama's converter (Q/K rows permuted), YaRN, Llama 4's temperature past 16 positions (the prompts cross it)
    "mistral3": ({"model_type": "ministral3", "tie_word_embeddings": True, "rope_parameters": {
                  "rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 16,
                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}},
                 {"mistral3.rope.scaling.type": "yarn", "mistral3.rope.scaling.factor": 16.0,
                  "mistral3.rope.scaling.original_context_length": 16, "mistral3.rope.scaling.yarn_log_multiplier": 1.0,
                  "mistral3.attention.temperature_scale": 0.1}),
    # Hunyuan dense: query/key norms after RoPE (its NTK alpha folded into the file's base by the converter)
    "hunyuan-dense": ({"model_type": "hunyuan_v1_dense", "use_qk_norm": True}, {}),
    # Command R7B / A: three sliding layers (window 8 here: the prompts cross it) to one global
    "cohere2": ({"model_type": "cohere2", "num_hidden_layers": 4, "sliding_window": 8, "sliding_window_pattern": 4,
                 "logit_scale": 0.25, "layer_norm_eps": 1e-5, "tie_word_embeddings": True},
                {"cohere2.logit_scale": 0.25, "cohere2.attention.layer_norm_epsilon": 1e-5,
                 "cohere2.attention.sliding_window": 8}),
}


@pytest.mark.parametrize("arch", sorted(GGUF_ARCHS))
def test_gguf_architectures_match_mlx_lm(tmp_path, arch):
    """GGUFs named by llama.cpp's own tensor map load onto mlx-lm's classes."""
    from tests.gguf_writer import arch_tensors
    from tests.test_architectures import BASE

    overrides, meta = GGUF_ARCHS[arch]
    config = {**BASE, **overrides}
    ref = make_mlx_lm_model(config, seed=11)
    path = str(tmp_path / f"{arch}.gguf")
    tensors = arch_tensors(arch, config, ref)
    if arch in ("granite", "smollm3", "mistral3"):  # (their converter is Llama's: Q/K rows permuted)
        from tests.gguf_writer import permute_qk

        heads = {".attn_q.": config["num_attention_heads"], ".attn_k.": config["num_key_value_heads"]}
        tensors = {k: next((permute_qk(x, n) for p, n in heads.items() if p in k), x) for k, x in tensors.items()}
    if (scaling := config.get("rope_scaling")) is not None:  # (the converter's llama3 factors)
        from macinfer.gguf.tensor_config import llama3_factors

        tensors["rope_freqs.weight"] = np.array(llama3_factors(config["head_dim"], config["rope_theta"], scaling),
                                                dtype=np.float32)
    write_gguf(path, config, tensors, extra_meta=meta, arch=arch)
    loaded = load(path)
    assert loaded.config["model_type"] == overrides["model_type"]
    if "rope_scaling" in config:  # (read back from rope_freqs)
        assert loaded.config["rope_scaling"] == config["rope_scaling"]
    _assert_logits_match(path, ref, atol=2e-4)


@pytest.mark.parametrize("arch,windows", [("gemma2", [8, None]), ("phi3", [8, 8])])
def test_gguf_sliding_windows_follow_llama_cpp(tmp_path, arch, windows):
    """mlx-lm's files for Gemma 2 and Phi-3 apply no window; llama.cpp (and transformers) do,
    from `{arch}.attention.sliding_window`: Gemma 2 on even layers, Phi-3 on every layer."""
    from tests.gguf_writer import arch_tensors
    from tests.test_architectures import BASE

    overrides, meta = GGUF_ARCHS[arch]
    config = {**BASE, **overrides}
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf(path, config, arch_tensors(arch, config, make_mlx_lm_model(config, seed=11)),
               extra_meta={**meta, f"{arch}.attention.sliding_window": 8}, arch=arch)
    assert [getattr(s.kind, "window", None) for s in load(path).model.layer_specs] == windows


@pytest.mark.parametrize("pattern", [None, [True, False, True, True]])
def test_olmo3_gguf_is_olmo2_with_a_window(tmp_path, pattern):
    """OLMo 3 files are llama.cpp's `olmo2` with `attention.sliding_window` and (from its
    `layer_types`) a pattern; without one, three sliding layers in four (the converter's
    default). They run on mlx-lm's `olmo3` class: the window (8 here: the prompts cross it) applied."""
    from tests.gguf_writer import arch_tensors
    from tests.test_architectures import BASE

    types = ["sliding_attention" if s else "full_attention" for s in pattern or [True, True, True, False]]
    config = {**BASE, "model_type": "olmo3", "num_hidden_layers": 4, "sliding_window": 8, "layer_types": types}
    ref = make_mlx_lm_model(config, seed=11)
    path = str(tmp_path / "olmo3.gguf")
    meta = {"olmo2.attention.sliding_window": 8, **({"olmo2.attention.sliding_window_pattern": pattern} if pattern else {})}
    write_gguf(path, config, arch_tensors("olmo2", config, ref), extra_meta=meta, arch="olmo2")
    loaded = load(path)
    assert loaded.config["model_type"] == "olmo3" and loaded.config["layer_types"] == types
    _assert_logits_match(path, ref, atol=2e-4)


def test_unknown_tensor_type_and_corrupt_header_are_one_line_errors(tmp_path):
    import struct

    config = tiny_config("llama")
    path = str(tmp_path / "ok.gguf")
    write_gguf(path, config, llama_tensors(config, make_mlx_lm_model(config)))
    data = bytearray(open(path, "rb").read())
    name = b"token_embd.weight"
    at = data.find(name) + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    bad_type = bytearray(data)
    struct.pack_into("<I", bad_type, type_at, 99)
    (tmp_path / "type.gguf").write_bytes(bad_type)
    with pytest.raises(ModelLoadError, match="type.gguf: tensor token_embd.weight has unknown GGML type 99"):
        load(str(tmp_path / "type.gguf"))
    garbled = bytearray(data)
    struct.pack_into("<Q", garbled, 16, 2**40)  # a metadata count no file could hold
    (tmp_path / "garbled.gguf").write_bytes(garbled)
    with pytest.raises(ModelLoadError, match="garbled.gguf: truncated or corrupt GGUF header"):
        load(str(tmp_path / "garbled.gguf"))


def test_rope_freqs_are_refused_where_they_would_be_ignored(tmp_path):
    config = tiny_config("llama3", tie=True)
    tensors = llama_tensors(config, make_mlx_lm_model(config))
    tensors["rope_freqs.weight"] = np.ones(8, dtype=np.float32)
    write_gguf(str(tmp_path / "f.gguf"), config, tensors)
    with pytest.raises(UnsupportedArchitectureError, match="rope_freqs"):
        load(str(tmp_path / "f.gguf"), impl="mlx-lm")
