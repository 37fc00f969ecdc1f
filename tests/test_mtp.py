"""Speculative decoding with the checkpoint's own MTP head (`models/mtp.py`,
`engine/mtp_drafter.py`): tiny random targets written with MTP tensors in the published
layouts (`tests/mtp_heads.py`), the head computing the published formula, and the tokens
those of decoding without speculation, for hybrid, MoE and MLA targets."""

import json
import os

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

from macinfer.cli.main import main
from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate, make_mlx_lm_model, save_model_dir
from tests.mtp_heads import DAMPED, declare, hf_head, mtp_target
from tests.zoo import tiny_config

ROWS = 32


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return mtp_target(tmp_path_factory.mktemp("q35"), "qwen3_5")


def _engine(path, **kw):
    kw = {"num_kv_blocks": 160, "block_size": 16, "max_num_seqs": ROWS, "speculative_max_batch": ROWS, **kw}
    return LLMEngine(path, EngineConfig(**kw))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, int(rng.integers(3, 40))).tolist() for _ in range(n)]


def _params(n: int, max_tokens: int = 16) -> list[SamplingParams]:
    """Greedy rows, and seeded sampled rows."""
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0) if i % 2 == 0 else
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, top_p=0.9, seed=i)
            for i in range(n)]


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next", "deepseek_v3", "glm4_moe", "glm4_moe_lite",
                                        "glm_moe_dsa", "mimo", "nemotron_h", "step3p5", "longcat_flash",
                                        "ernie4_5_moe", "mellum", "exaone_moe", "bailing_hybrid",
                                        "mimo_v2_flash"])
def test_32_rows_give_the_tokens_of_decoding_without_speculation(tmp_path_factory, qwen35, model_type):
    """Hybrid (Gated DeltaNet + attention, its state rolled back after a rejection), MoE
    experts (written one by one), MLA latents (kv_b_proj split by the target's sanitizer),
    GQA with a shared head of its own, MiMo's hidden-first projection: greedy and seeded
    rows alike."""
    target = qwen35 if model_type == "qwen3_5" else mtp_target(tmp_path_factory.mktemp(model_type), model_type)
    prompts, params = _prompts(ROWS), _params(ROWS)
    want = [o.token_ids for o in generate(_engine(target), prompts, params)]
    engine = _engine(target, num_speculative_tokens=3, speculative_method="mtp")
    got = [o.token_ids for o in generate(engine, prompts, params)]
    assert got == want
    st = engine.stats
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"], st  # both paths taken
    assert st["spec_drafted_by_position"][0] == st["spec_verify_steps"] > 0
    assert not engine.drafter.shadows and not engine.drafter.pending  # every shadow freed with its sequence
    assert engine.drafter.block_manager.num_used_blocks == 0 and engine.block_manager.num_used_blocks == 0


def test_a_hybrid_target_with_mtp_stays_exact_over_200_steps(qwen35):
    """Qwen3.5-style: each rejection rewinds the target's recurrent state; 200 tokens match."""
    prompts, params = _prompts(3, seed=1), [SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)] * 3
    want = [o.token_ids for o in generate(_engine(qwen35), prompts, params)]
    engine = _engine(qwen35, num_speculative_tokens=2, speculative_method="mtp")
    got = [o.token_ids for o in generate(engine, prompts, params)]
    assert got == want
    st = engine.stats
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"], st
    # More than one token per target forward on average (the head agrees often by construction).
    assert st["generation_tokens"] / (st["spec_verify_steps"] + 3) > 1.3, st


def _reference_drafts(engine, prompt: list[int], first: int, k: int) -> list[int]:
    """The head's greedy drafts after `prompt` + [first], computed densely, one position at
    a time, from the published formula: the target's hidden rows from mlx-lm's own forward,
    the head's input projection written out, its layer run with mlx-lm's cache."""
    target = engine.model.text_model
    ids = mx.array([prompt])
    hidden = target.model(ids)[0]  # [T, D], after the final norm
    head = engine.drafter.model.lm
    stack = head.model
    embed = engine.model.embed_module()
    caches = head.make_cache()  # (the kind of the head's layer: Mellum's slides)

    qwen = stack.style == "qwen"
    eps = (stack.norm if qwen else stack.enorm).eps

    def rms(x, w):
        return x * mx.rsqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def step(token: int, h: mx.array, pos: int) -> mx.array:
        e = embed(mx.array([[token]]))[0, 0]
        if stack.style == "bailing" and pos == 0:  # (Bailing's first position reads no token)
            e = mx.zeros_like(e)
        if qwen:  # fc([norm_e(e), norm_h(h)]); its layers; its own final norm
            x = stack.fc(mx.concatenate([rms(e, stack.pre_fc_norm_embedding.weight),
                                         rms(h, stack.pre_fc_norm_hidden.weight)]))[None, None]
        else:  # ERNIE's: eh_proj([enorm(e), hnorm(h)]); its block; the model's final norm before the head
            x = stack.eh_proj(mx.concatenate([rms(e, stack.enorm.weight), rms(h, stack.hnorm.weight)]))[None, None]
        for layer, c in zip(stack.layers, caches):
            x = layer(x, None, c)
        final = stack.norm if qwen else getattr(stack, "final_layernorm", None)  # (Bailing's)
        return rms(x[0, 0], final.weight) if final is not None else x[0, 0]

    def logits(out: mx.array) -> mx.array:
        normed = out if "shared_head" not in head else rms(out, head.shared_head.norm.weight)
        return engine.model.logits(normed[None])[0]

    tokens = prompt[1:] + [first]
    for i, t in enumerate(tokens):
        out = step(t, hidden[i], i)
    drafts = []
    for j in range(k):
        drafts.append(int(mx.argmax(logits(out)).item()))
        out = step(drafts[-1], out, len(tokens) + j)
    return drafts


@pytest.mark.parametrize("model_type", ["qwen3_5", "ernie4_5_moe", "mellum", "exaone_moe", "bailing_hybrid",
                                        "mimo_v2_flash"])
def test_the_heads_drafts_follow_the_published_formula(tmp_path_factory, model_type):
    """A head that mostly disagrees (random projection): after a long prompt (caught up in
    chunks), the batched paged drafts equal the dense reference's, position by position
    (Qwen3.5's layout, and ERNIE 4.5's: the model's final norm before the head)."""
    path = mtp_target(tmp_path_factory.mktemp("formula"), model_type, agree=False)
    engine = _engine(path, num_speculative_tokens=3, speculative_method="mtp", max_num_batched_tokens=32,
                     enable_prefix_caching=False)
    prompts = [_prompts(1, seed=3)[0] * 3, [1, 5, 9], *_prompts(6, seed=5)]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
    seqs = list(engine.requests.values())
    engine.scheduler.speculative = None  # no drafting while the prompts go in (the head still catches up)
    while any(s.seq.num_output_tokens == 0 for s in seqs):
        engine.step()
    drafter = engine.drafter
    proposals = {}
    for _ in range(4):  # a shadow still catching up (32 tokens a step) drafts in a later proposal
        proposals.update(drafter.propose([(s.seq, 4) for s in seqs]))
    for s, p in zip(seqs, prompts):
        seq = s.seq
        assert proposals[seq] == _reference_drafts(engine, p + seq.output_token_ids[:-1], seq.output_token_ids[-1], 4)


def test_prefix_hits_are_held_to_what_the_head_holds(tmp_path_factory, qwen35):
    """A request whose prompt the target's prefix cache holds: the head's cache holds it
    too (hit together), or the target's hit is cut to the head's, and the tokens stay
    those of decoding without speculation."""
    shared = _prompts(1, seed=4)[0] * 3  # 3 blocks and more
    prompts = [shared + [7, 8, 9], shared + [10, 11], shared[:40] + [12]]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    base = _engine(qwen35)
    want = [generate(base, [p], params)[0].token_ids for p in prompts]
    engine = _engine(qwen35, num_speculative_tokens=2, speculative_method="mtp")
    got = [generate(engine, [p], params)[0].token_ids for p in prompts]
    assert got == want
    assert engine.block_manager.prefix_hits > 0 and engine.drafter.block_manager.prefix_hits > 0
    # The head's cache dropped: the target recomputes what the head lacks, still exact.
    engine.drafter.block_manager.drop_cache()
    hits = engine.block_manager.prefix_hits
    assert generate(engine, [prompts[0]], params)[0].token_ids == want[0]
    assert engine.block_manager.prefix_hits == hits


def test_mtp_refusals(tmp_path_factory, qwen35):
    root = tmp_path_factory.mktemp("refuse")
    plain = save_model_dir(str(root / "llama"), tiny_config("llama"), make_mlx_lm_model(tiny_config("llama")))
    with pytest.raises(ValueError, match="declares no multi-token-prediction layers"):
        _engine(plain, num_speculative_tokens=2, speculative_method="mtp")
    stripped = mtp_target(root, "qwen3_5", with_weights=False)
    with pytest.raises(ValueError, match="hold no MTP weights"):
        _engine(stripped, num_speculative_tokens=2, speculative_method="mtp")
    assert generate(_engine(stripped), [[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids  # serves without
    exaone = mtp_target(root, "exaone_moe")  # K-EXAONE's layer kind is the config's to say
    with open(os.path.join(exaone, "config.json")) as f:
        cfg = {k: v for k, v in json.load(f).items() if k != "mtp_layer_types"}
    with open(os.path.join(exaone, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="mtp_layer_types"):
        _engine(exaone, num_speculative_tokens=2, speculative_method="mtp")
    pro = mtp_target(root, "mimo_v2_flash")  # MiMo-V2-Pro's fused qkv_proj (chunked by K/V head) is not read
    head = mx.load(os.path.join(pro, "model-mtp.safetensors"))
    head["model.mtp.layers.0.self_attn.qkv_proj.weight"] = mx.concatenate(
        [head.pop(f"model.mtp.layers.0.self_attn.{p}_proj.weight") for p in "qkv"])
    mx.save_safetensors(os.path.join(pro, "model-mtp.safetensors"), head)
    with pytest.raises(ValueError, match="fused qkv_proj"):
        _engine(pro, num_speculative_tokens=2, speculative_method="mtp")
    with pytest.raises(ValueError, match="cannot combine"):
        _engine(qwen35, num_speculative_tokens=2, speculative_method="mtp", draft_model=plain)
    with pytest.raises(ValueError, match="needs --num-speculative-tokens"):
        _engine(qwen35, speculative_method="mtp")
    with pytest.raises(ValueError, match="needs --draft-model"):
        _engine(qwen35, num_speculative_tokens=2, speculative_method="draft")
    r = CliRunner().invoke(main, ["generate", plain, "-p", "hi", "-n", "2", "--num-speculative-tokens", "2",
                                  "--speculative-method", "mtp"])
    assert r.exit_code != 0 and "multi-token-prediction" in r.output and "Traceback" not in r.output


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
    prompts, params = _prompts(6, seed=7), SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
    want = [o.token_ids for o in generate(_engine(hf), prompts, params)]
    engine = _engine(quantized, num_speculative_tokens=2, speculative_method="mtp")
    assert [o.token_ids for o in generate(engine, prompts, params)] == want
    assert engine.stats["spec_accepted_tokens"] > 0


def test_a_failing_head_leaves_the_requests_decoding(qwen35, monkeypatch):
    """The head's forward fails once (say, out of memory): the running requests go on
    without drafts, exact, and the next requests draft again."""
    prompts, params = _prompts(4, seed=8), SamplingParams(max_tokens=16, ignore_eos=True, temperature=0)
    want = [o.token_ids for o in generate(_engine(qwen35), prompts, params)]
    engine = _engine(qwen35, num_speculative_tokens=2, speculative_method="mtp")
    drafter, calls = engine.drafter, []
    real = drafter._forward_rows

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(drafter, "_forward_rows", flaky)
    assert [o.token_ids for o in generate(engine, prompts, params)] == want
    assert len(calls) == 4 and not drafter.shadows and not drafter.pending  # none drafted for again
    drafted = engine.stats["spec_draft_tokens"]
    assert [o.token_ids for o in generate(engine, prompts, params)] == want
    assert engine.stats["spec_draft_tokens"] > drafted


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
    from tests.gguf_writer import hybrid_tensors, write_hybrid_gguf

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
    prompts, params = _prompts(6, seed=9), SamplingParams(max_tokens=16, ignore_eos=True, temperature=0)
    want = [o.token_ids for o in generate(_engine(path), prompts, params)]
    engine = _engine(path, num_speculative_tokens=2, speculative_method="mtp")
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
    engine = _engine(path, num_speculative_tokens=2, speculative_method="mtp")
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
    engine = _engine(path, num_speculative_tokens=2, speculative_method="mtp")
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
    engine = _engine(path, num_speculative_tokens=2, speculative_method="mtp")
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
