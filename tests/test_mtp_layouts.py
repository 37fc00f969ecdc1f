"""The MTP head as each published layout holds it (`models/mtp_checkpoint.py`): the head's
tensors are the checkpoint's, read from transformers' layout, an MLX conversion's or a GGUF
file's `nextn` block, and each family's own rule (Step 3.5's zero-centred norms, LongCat's
block, Bailing's first position)."""

import os

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from macinfer.sampling_params import SamplingParams
from tests.helpers import generate, make_mlx_lm_model, save_model_dir
from tests.mtp_heads import DAMPED, declare, hf_head, mtp_engine, mtp_target, random_prompts
from tests.zoo import tiny_config


def test_a_head_written_by_mlx_loads_as_written(tmp_path_factory):
    """MLX conversions that keep the head (`format: mlx` files) hold it in mlx-lm's layout:
    norms already shifted, maybe quantized. The same head read from either layout has the
    same weights; a quantized one runs (expanded to float32 on the CPU), exact."""
    from macinfer.loading.loader import load
    from macinfer.models.mtp import load_mtp

    root = tmp_path_factory.mktemp("mlxhead")
    hf = mtp_target(root, "qwen3_5")
    heads = {}
    for quantize in (None, {"group_size": 32, "bits": 8}):
        path = str(root / f"mlx-{bool(quantize)}")
        os.makedirs(path)
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
            with open(os.path.join(hf, name), "rb") as a, open(os.path.join(path, name), "wb") as b:
                b.write(a.read())
        mlx_head = dict(tree_flatten(load_mtp(load(hf)).lm.model.parameters()))
        tensors = {f"mtp.{k}": v for k, v in mlx_head.items()}
        if quantize:
            for k in [k for k in tensors if k.endswith(".weight") and tensors[k].ndim == 2 and "norm" not in k]:
                w, scales, biases = mx.quantize(tensors[k], **quantize)
                tensors[k], tensors[k[:-6] + "scales"], tensors[k[:-6] + "biases"] = w, scales, biases
            import json
            with open(os.path.join(path, "config.json")) as f:
                config = json.load(f)
            config["quantization"] = quantize
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(config, f)
        mx.save_safetensors(os.path.join(path, "model-mtp.safetensors"), tensors, metadata={"format": "mlx"})
        heads[bool(quantize)] = (path, mlx_head)
    from_hf = heads[False][1]
    from_mlx = dict(tree_flatten(load_mtp(load(heads[False][0])).lm.model.parameters()))
    assert from_hf.keys() == from_mlx.keys()
    assert all(mx.array_equal(from_hf[k], from_mlx[k]) for k in from_hf)
    quantized = heads[True][0]
    prompts, params = random_prompts(6, seed=7), SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
    want = [o.token_ids for o in generate(mtp_engine(hf), prompts, params)]
    engine = mtp_engine(quantized, num_speculative_tokens=2, speculative_method="mtp")
    assert [o.token_ids for o in generate(engine, prompts, params)] == want
    assert engine.stats["spec_accepted_tokens"] > 0


def _gguf_block(head: dict, n: int, arch: str, config: dict) -> dict:
    """The HF head tensors of block `n` as llama.cpp's converter writes them: experts
    stacked, the correction bias as exp_probs_b, MLA's kv_b_proj split into k_b (transposed)
    and v_b, the tensor map's names (nextn.*)."""
    import gguf

    from macinfer.gguf.hybrid import model_arch

    tmap = gguf.get_tensor_name_map(model_arch(arch), n + 1)
    prefix, out, experts = f"model.layers.{n}.", {}, {}
    for k, v in head.items():
        v = np.array(v.astype(mx.float32))
        base, kind = k.rsplit(".", 1)
        if base.endswith("self_attn.kv_b_proj"):
            per_head = v.reshape(config["num_attention_heads"], -1, v.shape[-1])
            k_b, v_b = np.split(per_head, [config["qk_nope_head_dim"]], axis=1)
            out[tmap.get_name(base.replace("kv_b_proj", "k_b_proj")) + ".weight"] = k_b.swapaxes(-1, -2)
            out[tmap.get_name(base.replace("kv_b_proj", "v_b_proj")) + ".weight"] = v_b
            continue
        if ".mlp.experts." in base:  # model.layers.n.mlp.experts.{e}.{proj}
            e, proj = base.split(".mlp.experts.")[1].split(".")
            experts.setdefault(proj, {})[int(e)] = v
            continue
        if kind == "e_score_correction_bias":
            base, kind = f"{base}.e_score_correction", "bias"
        out[f"{tmap.get_name(base)}.{kind}"] = v
    for proj, per in experts.items():
        out[tmap.get_name(f"{prefix}mlp.experts.{proj}") + ".weight"] = np.stack([per[e] for e in sorted(per)])
    return out


@pytest.mark.parametrize("model_type,arch", [("glm4_moe", "glm4moe"), ("glm_moe_dsa", "glm-dsa")])
def test_a_gguf_files_nextn_block_is_the_same_head(tmp_path_factory, model_type, arch):
    """GLM-4.5 (`glm4moe`) and GLM-5 (`glm-dsa`) GGUF: llama.cpp's converter keeps the MTP
    layer as one more `blk.N` with `nextn.*` tensors. Read from it, the head has the weights
    it has when read from the safetensors checkpoint, and speculating with it gives the
    tokens of decoding without speculation."""
    from macinfer.loading.loader import load
    from macinfer.models.mtp import load_mtp
    from tests.gguf_hybrid_writer import hybrid_tensors, write_hybrid_gguf

    root = tmp_path_factory.mktemp("gguf-mtp")
    config = declare(tiny_config(model_type))
    model = make_mlx_lm_model(config, seed=5)
    flat = dict(tree_flatten(model.parameters()))
    model.load_weights([(k, v * 0.2 if any(d in k for d in DAMPED) else v) for k, v in flat.items()])
    n = config["num_hidden_layers"]
    head = hf_head(model, config, "deepseek", agree=True)
    hf = save_model_dir(str(root / "hf"), config, model)
    mx.save_safetensors(os.path.join(hf, "model-mtp.safetensors"), head)
    path = str(root / "glm.gguf")
    write_hybrid_gguf(path, arch, config, {**hybrid_tensors(arch, config, model), **_gguf_block(head, n, arch, config)},
                      nextn=1)

    from macinfer.gguf.load import read_block

    from_hf = dict(tree_flatten(load_mtp(load(hf)).lm.parameters()))
    from_gguf = dict(tree_flatten(load_mtp(load(path), read_block=read_block).lm.parameters()))
    assert from_hf.keys() == from_gguf.keys() and any(k.startswith("shared_head.head.") for k in from_gguf)
    for k in from_hf:
        np.testing.assert_allclose(np.array(from_gguf[k]), np.array(from_hf[k]), atol=1e-6, err_msg=k)
    prompts, params = random_prompts(6, seed=9), SamplingParams(max_tokens=16, ignore_eos=True, temperature=0)
    want = [o.token_ids for o in generate(mtp_engine(path), prompts, params)]
    engine = mtp_engine(path, num_speculative_tokens=2, speculative_method="mtp")
    assert [o.token_ids for o in generate(engine, prompts, params)] == want
    assert engine.stats["spec_accepted_tokens"] > 0


def _loaded_head(path: str):
    """The target's MTP head as loaded (its inner model) and the checkpoint's tensors as written."""
    from safetensors.numpy import load_file

    from macinfer.loading.loader import load
    from macinfer.models.mtp import load_mtp

    hf = {k: v for f in ("model.safetensors", "model-mtp.safetensors") for k, v in load_file(os.path.join(path, f)).items()}
    return load_mtp(load(path)).lm, hf


# Each layout's head as loaded -> the checkpoint's tensor it holds as written, and its stacked
# experts (the head's name, the checkpoint's one-by-one pattern).
HELD = {
    # Nemotron-H (`mtp.layers.*`, blocks by `mtp_hybrid_override_pattern`): the input projection and
    # norms off the first block, the final norm off the last
    "nemotron_h": ({"model.eh_proj.weight": "mtp.layers.0.eh_proj.weight", "model.enorm.weight": "mtp.layers.0.enorm.weight",
                    "model.hnorm.weight": "mtp.layers.0.hnorm.weight",
                    "model.final_layernorm.weight": "mtp.layers.1.final_layernorm.weight",
                    "model.layers.0.mixer.q_proj.weight": "mtp.layers.0.mixer.q_proj.weight"},
                   ("model.layers.1.mixer.switch_mlp.fc1.weight", "mtp.layers.1.mixer.experts.{}.up_proj.weight")),
    # ERNIE 4.5 (`model.mtp_{block,emb_norm,hidden_norm,linear_proj}.0`): the model's final norm as its post-norm
    "ernie4_5_moe": ({"model.eh_proj.weight": "model.mtp_linear_proj.0.weight",
                      "model.enorm.weight": "model.mtp_emb_norm.0.weight",
                      "model.hnorm.weight": "model.mtp_hidden_norm.0.weight", "shared_head.norm.weight": "model.norm.weight",
                      "model.layers.0.self_attn.q_proj.weight": "model.mtp_block.0.self_attn.q_proj.weight"},
                     ("model.layers.0.mlp.switch_mlp.up_proj.weight", "model.mtp_block.0.mlp.experts.{}.up_proj.weight")),
}


@pytest.mark.parametrize("model_type", sorted(HELD))
def test_a_head_holds_the_checkpoints_tensors(tmp_path_factory, model_type):
    """The head's tensors are the checkpoint's, by the family's published names; its experts
    stacked from transformers' one-by-one tensors."""
    lm, hf = _loaded_head(mtp_target(tmp_path_factory.mktemp(model_type), model_type, agree=False))
    head = dict(tree_flatten(lm.parameters()))
    pairs, (stacked, one_by_one) = HELD[model_type]
    for ours, theirs in pairs.items():
        np.testing.assert_array_equal(np.array(head[ours]), hf[theirs], err_msg=ours)
    np.testing.assert_array_equal(np.array(head[stacked]), np.stack([hf[one_by_one.format(e)] for e in range(4)]))


def test_a_step35_head_reads_its_zero_centred_norms_and_output_head(tmp_path_factory):
    """Step 3.5's checkpoint stores every norm as w - 1 (its sanitizer shifts them when it
    sees the whole model's tensors, not the MTP layer's alone) and names the shared head's
    projection `output`: the head holds the norms shifted back (the test wrote 1 + noise,
    stored minus one) and the projection under its own name."""
    path = mtp_target(tmp_path_factory.mktemp("step3p5"), "step3p5")
    engine = mtp_engine(path, num_speculative_tokens=2, speculative_method="mtp")
    head = engine.drafter.model.lm
    stack = head.model
    for norm in (stack.enorm.weight, stack.hnorm.weight, head.shared_head.norm.weight,
                 stack.layers[0].input_layernorm.weight, stack.layers[0].post_attention_layernorm.weight):
        assert float(mx.abs(norm - 1.0).max()) < 0.5, norm
    stored = mx.load(os.path.join(path, "model-mtp.safetensors"))
    n = engine.model.args.num_hidden_layers
    assert mx.array_equal(head.shared_head.head.weight, stored[f"model.layers.{n}.shared_head.output.weight"])


def test_a_longcat_head_holds_the_checkpoints_mtp_tensors(tmp_path_factory):
    """LongCat-Flash keeps one MTP layer under `model.mtp.*` (its config declares none): the
    stack's norms, projection and its own embedding, the block's dense MLP (the checkpoint's
    `transformer_layer.mlp`) and its latent attention's kv_b_proj split as the target splits its own."""
    path = mtp_target(tmp_path_factory.mktemp("longcat"), "longcat_flash", agree=False)
    engine = mtp_engine(path, num_speculative_tokens=2, speculative_method="mtp")
    stack = engine.drafter.model.lm.model
    stored = mx.load(os.path.join(path, "model-mtp.safetensors"))
    m = "model.mtp."
    pairs = [(stack.enorm.weight, m + "layers.0.enorm.m.weight"), (stack.hnorm.weight, m + "layers.0.hnorm.m.weight"),
             (stack.final_layernorm.weight, m + "norm.weight"), (stack.eh_proj.weight, m + "layers.0.eh_proj.weight"),
             (stack.embed_tokens.weight, m + "embed_tokens.weight"),
             (stack.layers[0].mlp.gate_proj.weight, m + "layers.0.transformer_layer.mlp.gate_proj.weight"),
             (stack.layers[0].input_layernorm.weight, m + "layers.0.input_layernorm.weight")]
    for got, key in pairs:
        assert mx.array_equal(got, stored[key]), key
    attn = stack.layers[0].self_attn
    kv_b = stored[m + "layers.0.self_attn.kv_b_proj.weight"]
    heads, nope = attn.num_attention_heads, attn.qk_nope_head_dim
    kv_b = kv_b.reshape(heads, nope + attn.v_head_dim, -1)
    assert mx.allclose(attn.embed_q.weight, kv_b[:, :nope, :].swapaxes(-1, -2))
    assert mx.allclose(attn.unembed_out.weight, kv_b[:, nope:, :])


def test_a_bailing_head_reads_no_token_at_the_first_position(tmp_path_factory):
    """Bailing v2.5's head zeroes the token's embedding at position 0 (vLLM's reader): what
    token sits there changes nothing the head computes; its final norm and projection are
    the checkpoint's `model.layers.{N}` tensors."""
    path = mtp_target(tmp_path_factory.mktemp("bailing"), "bailing_hybrid", agree=False)
    engine = mtp_engine(path, num_speculative_tokens=2, speculative_method="mtp")
    head = engine.drafter.model.lm
    stack = head.model
    n = tiny_config("bailing_hybrid")["num_hidden_layers"]
    stored = mx.load(os.path.join(path, "model-mtp.safetensors"))
    assert mx.array_equal(stack.final_layernorm.weight, stored[f"model.layers.{n}.final_layernorm.weight"])
    assert mx.array_equal(stack.eh_proj.weight, stored[f"model.layers.{n}.eh_proj.weight"])
    mx.random.seed(0)
    object.__setattr__(stack, "given", mx.random.normal((1, 3, stack.eh_proj.weight.shape[0])))
    try:
        outs = [stack(mx.array([[first, 9, 11]]), head.make_cache()) for first in (5, 77)]
    finally:
        object.__setattr__(stack, "given", None)
    assert mx.array_equal(outs[0], outs[1])
    assert not mx.array_equal(stack(mx.array([[9, 5, 11]]), head.make_cache()),
                              stack(mx.array([[9, 77, 11]]), head.make_cache()))  # (later positions read theirs)
