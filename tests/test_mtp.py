"""Speculative decoding with the checkpoint's own MTP head (`models/mtp.py`,
`engine/mtp_drafter.py`): tiny random targets written with MTP tensors in the published
layouts (`tests/mtp_heads.py`), the head computing the published formula, and the tokens
those of decoding without speculation, for hybrid, MoE and MLA targets."""

import json
import os

import mlx.core as mx
import pytest
from click.testing import CliRunner

from macinfer.cli.main import main
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate, make_mlx_lm_model, save_model_dir
from tests.mtp_heads import ROWS, mtp_engine, mtp_target, random_prompts
from tests.zoo import tiny_config


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return mtp_target(tmp_path_factory.mktemp("q35"), "qwen3_5")


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
    prompts, params = random_prompts(ROWS), _params(ROWS)
    want = [o.token_ids for o in generate(mtp_engine(target), prompts, params)]
    engine = mtp_engine(target, num_speculative_tokens=3, speculative_method="mtp")
    got = [o.token_ids for o in generate(engine, prompts, params)]
    assert got == want
    st = engine.stats
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"], st  # both paths taken
    assert st["spec_drafted_by_position"][0] == st["spec_verify_steps"] > 0
    assert not engine.drafter.shadows and not engine.drafter.pending  # every shadow freed with its sequence
    assert engine.drafter.block_manager.num_used_blocks == 0 and engine.block_manager.num_used_blocks == 0


def test_a_hybrid_target_with_mtp_stays_exact_over_200_steps(qwen35):
    """Qwen3.5-style: each rejection rewinds the target's recurrent state; 200 tokens match."""
    prompts, params = random_prompts(3, seed=1), [SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)] * 3
    want = [o.token_ids for o in generate(mtp_engine(qwen35), prompts, params)]
    engine = mtp_engine(qwen35, num_speculative_tokens=2, speculative_method="mtp")
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
    engine = mtp_engine(path, num_speculative_tokens=3, speculative_method="mtp", max_num_batched_tokens=32,
                     enable_prefix_caching=False)
    prompts = [random_prompts(1, seed=3)[0] * 3, [1, 5, 9], *random_prompts(6, seed=5)]
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
    shared = random_prompts(1, seed=4)[0] * 3  # 3 blocks and more
    prompts = [shared + [7, 8, 9], shared + [10, 11], shared[:40] + [12]]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    base = mtp_engine(qwen35)
    want = [generate(base, [p], params)[0].token_ids for p in prompts]
    engine = mtp_engine(qwen35, num_speculative_tokens=2, speculative_method="mtp")
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
        mtp_engine(plain, num_speculative_tokens=2, speculative_method="mtp")
    stripped = mtp_target(root, "qwen3_5", with_weights=False)
    with pytest.raises(ValueError, match="hold no MTP weights"):
        mtp_engine(stripped, num_speculative_tokens=2, speculative_method="mtp")
    assert generate(mtp_engine(stripped), [[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids  # serves without
    exaone = mtp_target(root, "exaone_moe")  # K-EXAONE's layer kind is the config's to say
    with open(os.path.join(exaone, "config.json")) as f:
        cfg = {k: v for k, v in json.load(f).items() if k != "mtp_layer_types"}
    with open(os.path.join(exaone, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="mtp_layer_types"):
        mtp_engine(exaone, num_speculative_tokens=2, speculative_method="mtp")
    pro = mtp_target(root, "mimo_v2_flash")  # MiMo-V2-Pro's fused qkv_proj (chunked by K/V head) is not read
    head = mx.load(os.path.join(pro, "model-mtp.safetensors"))
    head["model.mtp.layers.0.self_attn.qkv_proj.weight"] = mx.concatenate(
        [head.pop(f"model.mtp.layers.0.self_attn.{p}_proj.weight") for p in "qkv"])
    mx.save_safetensors(os.path.join(pro, "model-mtp.safetensors"), head)
    with pytest.raises(ValueError, match="fused qkv_proj"):
        mtp_engine(pro, num_speculative_tokens=2, speculative_method="mtp")
    with pytest.raises(ValueError, match="cannot combine"):
        mtp_engine(qwen35, num_speculative_tokens=2, speculative_method="mtp", draft_model=plain)
    with pytest.raises(ValueError, match="needs --num-speculative-tokens"):
        mtp_engine(qwen35, speculative_method="mtp")
    with pytest.raises(ValueError, match="needs --draft-model"):
        mtp_engine(qwen35, num_speculative_tokens=2, speculative_method="draft")
    r = CliRunner().invoke(main, ["generate", plain, "-p", "hi", "-n", "2", "--num-speculative-tokens", "2",
                                  "--speculative-method", "mtp"])
    assert r.exit_code != 0 and "multi-token-prediction" in r.output and "Traceback" not in r.output


def test_a_failing_head_leaves_the_requests_decoding(qwen35, monkeypatch):
    """The head's forward fails once (say, out of memory): the running requests go on
    without drafts, exact, and the next requests draft again."""
    prompts, params = random_prompts(4, seed=8), SamplingParams(max_tokens=16, ignore_eos=True, temperature=0)
    want = [o.token_ids for o in generate(mtp_engine(qwen35), prompts, params)]
    engine = mtp_engine(qwen35, num_speculative_tokens=2, speculative_method="mtp")
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


@pytest.mark.parametrize("model_type", ["qwen3_5", "glm4_moe_lite", "glm_moe_dsa", "nemotron_h"])
def test_a_split_mtp_drafter_folder_drafts_as_the_checkpoints_own_head(tmp_path_factory, qwen35, model_type):
    """mlx-vlm's split MTP drafter (`mlx_vlm.split_mtp`: the head's tensors alone, written by
    MLX in its own names) named by `--draft-model` for a target whose files hold no head
    (mlx-lm's conversions drop it): the same drafts as the checkpoint's own head, the tokens of
    decoding without speculation."""
    import shutil

    from mlx_vlm.split_mtp import split_mtp

    root = tmp_path_factory.mktemp("split")
    target = qwen35 if model_type == "qwen3_5" else mtp_target(root, model_type)
    drafter = str(split_mtp(target, str(root / "drafter"), model_type=model_type))
    stripped = str(root / "stripped")
    shutil.copytree(target, stripped, ignore=shutil.ignore_patterns("model-mtp.safetensors"))
    with open(os.path.join(stripped, "config.json")) as f:  # (a conversion may drop the declaration too)
        cfg = json.load(f)
    for part in (cfg, cfg.get("text_config") or {}):
        part.pop("mtp_num_hidden_layers", None), part.pop("num_nextn_predict_layers", None)
    with open(os.path.join(stripped, "config.json"), "w") as f:
        json.dump(cfg, f)
    prompts, params = random_prompts(6, seed=9), SamplingParams(max_tokens=16, ignore_eos=True, temperature=0)
    want = [o.token_ids for o in generate(mtp_engine(stripped), prompts, params)]
    own = mtp_engine(target, num_speculative_tokens=3, speculative_method="mtp")
    # (named as a draft model, or as the MTP head the method names)
    split = mtp_engine(stripped, num_speculative_tokens=3, draft_model=drafter,
                       speculative_method="mtp" if model_type == "qwen3_5" else None)
    assert [o.token_ids for o in generate(own, prompts, params)] == want
    assert [o.token_ids for o in generate(split, prompts, params)] == want
    assert split.stats["spec_accepted_tokens"] == own.stats["spec_accepted_tokens"] > 0
    assert split.stats["spec_draft_tokens"] == own.stats["spec_draft_tokens"]


def test_a_split_drafter_of_another_kind_or_model_is_refused(tmp_path_factory, qwen35):
    import shutil

    from mlx_vlm.split_mtp import split_mtp

    root = tmp_path_factory.mktemp("split-refused")
    drafter = str(split_mtp(qwen35, str(root / "drafter"), model_type="qwen3_5"))
    with open(os.path.join(drafter, "config.json")) as f:
        cfg = json.load(f)
    for name, change, why in [("inkling", {"model_type": "inkling_mtp"}, "inkling_mtp drafter folder"),
                              ("glm", {"model_type": "glm4_moe_lite_mtp"}, "drafts for its own family"),
                              ("wider", {"text_config": {**cfg["text_config"], "hidden_size": 96}}, "hidden_size")]:
        other = str(root / name)
        shutil.copytree(drafter, other)
        with open(os.path.join(other, "config.json"), "w") as f:
            json.dump({**cfg, **change}, f)
        with pytest.raises(ValueError, match=why):
            mtp_engine(qwen35, num_speculative_tokens=3, draft_model=other)
