"""Recurrent and hybrid GGUF files (Mamba-2, LFM2, Qwen3-Next), written the way
llama.cpp's converter writes them (its tensor map's names, A as -exp(A_log), squeezed
convolution kernels, Qwen3-Next's split in_proj_qkvz...; `tests/gguf_hybrid_writer.py`), load
onto mlx-lm's classes and give mlx-lm's logits on the model they were written from."""

from __future__ import annotations

import gguf
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.gguf.load import load_gguf
from macinfer.gguf.hybrid import to_model_names
from macinfer.sampling_params import SamplingParams
from tests.gguf_hybrid_writer import hybrid_tensors, write_hybrid_gguf
from tests.helpers import generate, make_mlx_lm_model
from tests.zoo import tiny_config

NEMOTRON_MOE = dict(hybrid_override_pattern="M*EM", moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                    norm_topk_prob=True, routed_scaling_factor=1.5)
CASES = [("mamba2", "mamba2", {}), ("lfm2", "lfm2", {}),
         # LFM2-8B-A1B: a dense first layer, sigmoid-routed experts with their selection bias
         ("lfm2moe", "lfm2_moe", dict(num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2,
                                      full_attn_idxs=[1, 3], use_expert_bias=True)), ("qwen3next", "qwen3_next", {}),
         ("nemotron_h", "nemotron_h", dict(hybrid_override_pattern="M*-M", intermediate_size=96, n_groups=2)),
         ("nemotron_h_moe", "nemotron_h", NEMOTRON_MOE),
         ("qwen35", "qwen3_5", dict(linear_num_value_heads=4)),  # Qwen3.5's 2-4 value heads a key head
         ("qwen35moe", "qwen3_5_moe", dict(linear_num_value_heads=6)),
         # Gemma 3n: AltUp streams, LAuReL, per-layer embeddings, shared KV, the first layers' activation sparsity
         # (a window past the prompts: mlx-lm's forward without a cache applies none; the engine does, as its
         # folder path, which the architecture tests check)
         ("gemma3n", "gemma3n", dict(activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0], altup_num_inputs=4)),
         ("olmoe", "olmoe", dict(norm_topk_prob=False)),  # (query/key norms over all heads)
         ("qwen2moe", "qwen2_moe", dict(head_dim=16)),  # (biases, a gated shared expert)
         # Ling/Ring 2.0: fused QKV, query/key norms, partial rotary, sigmoid grouped routing with a selection bias
         ("bailingmoe2", "bailing_moe", dict(head_dim=16, use_qk_norm=True, score_function="sigmoid", n_group=2, topk_group=1,
                                              moe_router_enable_expert_bias=True, routed_scaling_factor=2.5)),
         # Granite 4.0 H: Mamba-2 and attention layers, routed and shared experts, no RoPE; and its dense form
         ("granitehybrid", "granitemoehybrid", dict(position_embedding_type="nope", mamba_n_groups=2)),
         ("granitehybrid", "granitemoehybrid", dict(num_local_experts=0, num_experts_per_tok=0,
                                                    layer_types=["attention", "mamba"]))]


def _mlx_lm_prompt_logprobs(model, prompt: list[int]) -> np.ndarray:
    # (with mlx-lm's own cache, as it generates: Gemma 3n's KV-sharing layers read it)
    logits = model(mx.array(prompt)[None], cache=make_prompt_cache(model))[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(lp[mx.arange(len(prompt) - 1), mx.array(prompt[1:])])


PROMPTS = [[int(x) for x in mx.random.randint(3, 300, (n,), key=mx.random.key(n)).tolist()] for n in (37, 20)]


def _runs_like_mlx_lm(path: str, model, model_type: str | None = None) -> LLMEngine:
    """The GGUF file at `path` on the engine (prompts cut into chunks) gives `model`'s
    (mlx-lm's) prompt log-probs within 2e-4."""
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, max_num_batched_tokens=16))
    if model_type is not None:
        assert engine.model.args.model_type == model_type
    outs = generate(engine, PROMPTS, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    for prompt, out in zip(PROMPTS, outs):
        ours = np.array([t.logprob for t in out.prompt_logprobs[1:]])
        np.testing.assert_allclose(ours, _mlx_lm_prompt_logprobs(model, prompt), atol=2e-4)
    return engine


@pytest.mark.parametrize("arch,model_type,extra", CASES)
def test_hybrid_gguf_runs_like_mlx_lm(tmp_path, arch, model_type, extra):
    config = tiny_config(model_type)
    config.get("text_config", config).update(extra)
    model = make_mlx_lm_model(config)
    if arch in ("lfm2moe", "bailingmoe2"):  # their experts' selection bias starts at zero: set it off, so it counts
        model.load_weights([(k, 0.5 * mx.random.normal(v.shape, key=mx.random.key(1)))
                            for k, v in tree_flatten(model.parameters()) if k.endswith("expert_bias")], strict=False)
    path = str(tmp_path / f"{arch}.gguf")
    write_hybrid_gguf(path, arch, config, hybrid_tensors(arch, config, model))
    _runs_like_mlx_lm(path, model)


def _check_quantized_file(tmp_path, arch: str, config: dict, model, tensors: dict, quant: dict,
                          atol: float) -> None:
    """Write `tensors` with `quant` as Q8_0; the loader must read llama.cpp's own dequantized
    values (MLX's affine form keeps scale and offset in float16, as Q8_0 does, and the CPU
    expands them in float32, as llama.cpp does: the same numbers), and the engine must give
    mlx-lm's log-probs on those values within `atol`."""
    path = str(tmp_path / "q.gguf")
    write_hybrid_gguf(path, arch, config, tensors, quant)
    stored = {n: dequantize(gguf.quants.quantize(tensors[n], Q.Q8_0), Q.Q8_0) for n in quant}
    expected = to_model_names(arch, model, {n: mx.array(stored.get(n, t)) for n, t in tensors.items()},
                              config.get("text_config", config))
    _, loaded, _ = load_gguf(path)
    for name in [n[: -len(".scales")] for n in loaded if n.endswith(".scales")]:
        values = mx.dequantize(loaded[f"{name}.weight"], loaded[f"{name}.scales"].astype(mx.float32),
                               loaded[f"{name}.biases"].astype(mx.float32), 32, 8)
        np.testing.assert_allclose(np.array(values), np.array(expected[f"{name}.weight"]), rtol=1e-6, atol=1e-7)
        expected[f"{name}.weight"] = values
    model.load_weights(list(expected.items()))
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, max_num_batched_tokens=16))
    prompt = [int(x) for x in mx.random.randint(3, 300, (30,), key=mx.random.key(3)).tolist()]
    out = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    ours = np.array([t.logprob for t in out.prompt_logprobs[1:]])
    np.testing.assert_allclose(ours, _mlx_lm_prompt_logprobs(model, prompt), atol=atol)


@pytest.mark.parametrize("arch,model_type", [("qwen3next", "qwen3_next"), ("qwen35", "qwen3_5")])
def test_gated_deltanet_gguf_with_q8_0_projections(tmp_path, arch, model_type):
    """A quantized file, twice as many value heads as key heads (Qwen3-Next's and Qwen3.5's
    shapes): the split in_proj_qkvz is put back together row by row in the block format,
    and Qwen3.5's tiled value heads are untiled in it (ssm_out's columns a whole head of
    quantization groups at a time)."""
    config = tiny_config(model_type)
    config.get("text_config", config).update(linear_num_value_heads=4, linear_value_head_dim=32)
    model = make_mlx_lm_model(config)
    tensors = hybrid_tensors(arch, config, model)
    quant = {n: Q.Q8_0 for n, t in tensors.items() if t.ndim == 2 and t.shape[1] % 32 == 0
             and (".attn_" in n or ".ssm_" in n) and "conv1d" not in n}
    assert {".attn_qkv.", ".attn_gate.", ".ssm_out."} <= {f".{n.split('.')[2]}." for n in quant}
    _check_quantized_file(tmp_path, arch, config, model, tensors, quant, atol=2e-4)


@pytest.mark.parametrize("model_type,extra,split", [
    ("deepseek_v3", dict(rms_norm_eps=1e-6), True),  # DeepSeek V3 / Kimi K2: sigmoid routing, its norm eps
    ("deepseek_v3", dict(rms_norm_eps=1e-6, q_lora_rank=None), False),  # no q LoRA; an older file's attn_kv_b
    ("glm4_moe_lite", {}, True),  # GLM-4.7-Flash: stored as deepseek2, its own norm eps
    ("deepseek_v2", {}, True),  # softmax routing, YaRN, kv_b_proj whole in mlx-lm's file
    ("deepseek_v2", {}, False),
    # GLM-5 (16 indexer heads: with few, relu leaves several keys at score 0, a tie at the
    # top-k boundary that mlx-lm's argpartition and ours may break differently)
    ("glm_moe_dsa", {}, True),
])
def test_deepseek2_gguf_runs_like_mlx_lm(tmp_path, model_type, extra, split):
    """MLA files as llama.cpp writes them (`deepseek2`): kv_b_proj split into attn_k_b
    (transposed) and attn_v_b, or one attn_kv_b in older files; the latent cache is paged.
    GLM-5 (`glm-dsa`): the same, with the sparse-attention indexer's tensors and top-k (8 of
    the prompts' 20 and 37 keys: the selection matters)."""
    config = {**tiny_config(model_type), **extra}
    model = make_mlx_lm_model(config)
    path = str(tmp_path / "ds.gguf")
    arch = "glm-dsa" if model_type == "glm_moe_dsa" else "deepseek2"
    write_hybrid_gguf(path, arch, config, hybrid_tensors(arch, config, model, kv_b_split=split))
    _runs_like_mlx_lm(path, model, model_type)


@pytest.mark.parametrize("extra", [dict(attention_bias=True, routed_scaling_factor=2.5), dict(use_qk_norm=True)])
def test_glm4moe_gguf_runs_like_mlx_lm(tmp_path, extra):
    """GLM-4.5/4.6/4.7 files (`glm4moe`): experts stacked, the correction bias as exp_probs_b,
    partial rotary as a rotated width, and the MTP layer the converter keeps (one more `blk.N`
    with its `nextn.*` tensors, counted in block_count) left for the drafter."""
    config = {**tiny_config("glm4_moe"), **extra}
    model = make_mlx_lm_model(config)
    tensors = hybrid_tensors("glm4moe", config, model)
    n = config["num_hidden_layers"]
    mtp = {k.replace(f"blk.{n - 1}.", f"blk.{n}."): v for k, v in tensors.items() if k.startswith(f"blk.{n - 1}.")}
    hidden = config["hidden_size"]
    mtp.update({f"blk.{n}.nextn.eh_proj.weight": np.zeros((hidden, 2 * hidden), np.float32),
                f"blk.{n}.nextn.enorm.weight": np.ones(hidden, np.float32),
                f"blk.{n}.nextn.hnorm.weight": np.ones(hidden, np.float32),
                f"blk.{n}.nextn.shared_head_norm.weight": np.ones(hidden, np.float32)})
    path = str(tmp_path / "glm.gguf")
    write_hybrid_gguf(path, "glm4moe", config, {**tensors, **mtp}, nextn=1)
    engine = _runs_like_mlx_lm(path, model, "glm4_moe")
    assert engine.model.num_layers == n


@pytest.mark.parametrize("extra", [dict(use_qk_norm=True), dict(use_qk_norm=False)])
def test_minimax_m2_gguf_runs_like_mlx_lm(tmp_path, extra):
    """MiniMax M2 files (`minimax-m2`): experts w1/w2/w3 stacked, the correction bias as
    exp_probs_b, partial rotary as rotary_dim, q/k norms over all heads when stored."""
    config = {**tiny_config("minimax"), **extra}
    model = make_mlx_lm_model(config)
    path = str(tmp_path / "mm.gguf")
    write_hybrid_gguf(path, "minimax-m2", config, hybrid_tensors("minimax-m2", config, model))
    _runs_like_mlx_lm(path, model, "minimax")


def test_gpt_oss_gguf_runs_like_mlx_lm(tmp_path):
    """gpt-oss files (`gpt-oss`): attention with biases and sinks (`attn_sinks.weight`), sliding
    layers every other one, experts with biases; their experts in MXFP4 (as the converter
    repacks them) are held packed in MLX's mxfp4 mode, giving back their exact values."""
    config = tiny_config("gpt_oss")
    model = make_mlx_lm_model(config)
    tensors = hybrid_tensors("gpt-oss", config, model)
    path = str(tmp_path / "oss.gguf")
    write_hybrid_gguf(path, "gpt-oss", config, tensors)
    _runs_like_mlx_lm(path, model, "gpt_oss")

    experts = {n: Q.MXFP4 for n in tensors if n.endswith("_exps.weight")}
    path = str(tmp_path / "oss-mxfp4.gguf")
    write_hybrid_gguf(path, "gpt-oss", config, tensors, experts)
    _, loaded, _ = load_gguf(path)
    stored = {n: dequantize(gguf.quants.quantize(np.ascontiguousarray(tensors[n]), Q.MXFP4), Q.MXFP4) for n in experts}
    expected = to_model_names("gpt-oss", model, {n: mx.array(stored.get(n, t)) for n, t in tensors.items()}, config)
    packed = [n[: -len(".scales")] for n in loaded if n.endswith(".scales")]
    assert len(packed) == 3 * config["num_hidden_layers"]  # held in MLX's mxfp4 mode: 4 bits a value
    for name in packed:
        loaded[f"{name}.weight"] = mx.dequantize(loaded[f"{name}.weight"], loaded.pop(f"{name}.scales"), None, 32, 4,
                                                 mode="mxfp4")
    for name in expected:
        np.testing.assert_array_equal(np.array(loaded[name].astype(mx.float32)), np.array(expected[name]), err_msg=name)
    model.load_weights(list(expected.items()))
    _runs_like_mlx_lm(path, model)


def test_multi_token_prediction_blocks_are_left_out(tmp_path):
    """llama.cpp's converter keeps Qwen3.5's MTP block as one more `blk.N` and counts it in
    block_count (nextn_predict_layers = 1): the model is the layers before it."""
    config = tiny_config("qwen3_5")
    model = make_mlx_lm_model(config)
    tensors = hybrid_tensors("qwen35", config, model)
    n = config["text_config"]["num_hidden_layers"]
    mtp = {k.replace("blk.0.", f"blk.{n}."): v for k, v in tensors.items() if k.startswith("blk.0.")}
    path = str(tmp_path / "mtp.gguf")
    write_hybrid_gguf(path, "qwen35", config, {**tensors, **mtp}, nextn=1)
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01))
    prompt = [int(x) for x in mx.random.randint(3, 300, (20,), key=mx.random.key(2)).tolist()]
    out = generate(engine, [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    ours = np.array([t.logprob for t in out.prompt_logprobs[1:]])
    np.testing.assert_allclose(ours, _mlx_lm_prompt_logprobs(model, prompt), atol=2e-4)


def test_pre_tokenizers_these_families_name():
    """`tokenizer.ggml.pre` of these families' files, split as llama.cpp's llama-vocab.cpp
    does: Qwen3.5 keeps combining marks with their letter, DeepSeek V3 splits digits in
    threes and CJK runs apart first, LFM2 / Falcon-H1 / GLM-4 / OLMo 2 (`dbrx`) split as Llama 3,
    MiniMax M2 as GPT-4o, OLMo as GPT-2."""
    from macinfer.gguf.tokenizer import PRE_TOKENIZERS

    def pieces(name: str) -> list[str]:
        text = "cafe\u0301 12345 日本語abc, x!"
        return [bytes(_BYTES[c] for c in p).decode() for p, _ in PRE_TOKENIZERS[name]().pre_tokenize_str(text)]

    assert pieces("qwen2")[:2] == ["cafe", "\u0301"] and pieces("qwen35")[0] == "cafe\u0301"
    assert pieces("deepseek-v3") == ["cafe\u0301", " ", "123", "45", " ", "日本語", "abc", ",", " x", "!"]
    # MiniMax M2: GPT-4o's split (cased words, digits in threes, CJK with the letters)
    assert pieces("minimax-m2") == ["cafe\u0301", " ", "123", "45", " 日本語abc", ",", " x", "!"]
    for name in ("lfm2", "falcon-h1", "glm4", "dbrx"):
        assert pieces(name) == ["cafe", "\u0301", " ", "123", "45", " 日本語abc", ",", " x", "!"]
    # OLMo's: GPT-2's (digits kept together, the space before a word with it)
    assert pieces("olmo") == ["cafe", "\u0301", " 12345", " 日本語abc", ",", " x", "!"]


# GPT-2's byte-to-character table, reversed: a pre-tokenized piece back to its UTF-8 bytes.
def _byte_chars() -> dict[str, int]:
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + i): b for i, b in enumerate(extra)}}


_BYTES = _byte_chars()


def test_deepseek2_gguf_with_q8_0_tensors(tmp_path):
    """A quantized MLA file: attn_k_b / attn_v_b in blocks ([heads, rows, cols], quantized
    along their last axis) load as mlx-lm's quantized embed_q / unembed_out. The router is
    quantized too, though llama.cpp keeps it in float: a module MLX cannot quantize gets
    float values."""
    config = {**tiny_config("deepseek_v3"), "rms_norm_eps": 1e-6, "qk_nope_head_dim": 32, "v_head_dim": 32}
    model = make_mlx_lm_model(config)
    tensors = hybrid_tensors("deepseek2", config, model)
    quant = {n: Q.Q8_0 for n, t in tensors.items() if t.ndim >= 2 and t.shape[-1] % 32 == 0
             and n.startswith("blk.") and "norm" not in n}
    assert {".attn_k_b.", ".attn_v_b.", ".attn_q_a.", ".ffn_up_exps."} <= {f".{n.split('.')[2]}." for n in quant}
    # The experts and the absorbed projections stay quantized on the CPU too (only plain
    # linear layers are expanded), and MLX's CPU quantized matmul with float16 scales is good
    # to ~1e-3 (a single 64x64 layer: 7.6e-4 against the same values in float32).
    _check_quantized_file(tmp_path, "deepseek2", config, model, tensors, quant, atol=5e-3)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}])
def test_llama4_gguf_runs_like_mlx_lm(tmp_path, scaling):
    """Llama 4 (`llama4`): MoE and dense layers interleaved, a routed and a shared expert, query/key
    norms, every fourth layer without RoPE, Q/K rows as the checkpoint's; Scout's Llama 3 RoPE
    scaling read back from `rope_freqs`; 128 experts (Maverick) turn the query/key norms off."""
    config = tiny_config("llama4")
    config["text_config"].update(attention_chunk_size=8192, rope_scaling=scaling)  # (llama.cpp's fixed chunk)
    model = make_mlx_lm_model(config)
    path = str(tmp_path / "llama4.gguf")
    write_hybrid_gguf(path, "llama4", config, hybrid_tensors("llama4", config, model))
    engine = _runs_like_mlx_lm(path, model)
    read = engine.loaded.config["text_config"]
    assert read["rope_scaling"] == scaling and read["use_qk_norm"] and read["interleave_moe_layer_step"] == 2
