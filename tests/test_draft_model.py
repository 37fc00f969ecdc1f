"""Speculative decoding with a draft model (`engine/drafter.py`): a small model of the same
tokenizer drafts, the target verifies in its batch, and the tokens are the ones decoding
without speculation gives (greedy and seeded), for every cache kind of target."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from click.testing import CliRunner

from macinfer.cli.main import main
from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate, make_mlx_lm_model, save_model_dir, tiny_model_dir
from tests.zoo import tiny_config

ROWS = 32


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """A one-layer Llama of the same byte tokenizer: smaller than every target below."""
    return tiny_model_dir(tmp_path_factory.mktemp("draft"), num_hidden_layers=1, seed=2)[0]


def _target(tmp_path_factory, model_type: str, seed: int = 5, noise: float = 0.0) -> str:
    """A tiny random `model_type`; with `noise`, its weights jittered by that share of their
    spread (a draft that agrees with the target often, not always: both the accepting and
    the rejecting paths run)."""
    config = tiny_config(model_type)
    model = make_mlx_lm_model(config, seed=seed)
    if noise:
        mx.random.seed(seed + 1)
        model.update(tree_map(lambda w: w + noise * w.std() * mx.random.normal(w.shape), model.parameters()))
    name = f"{model_type}-noisy" if noise else model_type
    return save_model_dir(str(tmp_path_factory.mktemp(name)), config, model)


DAMPED = ("o_proj", "out_proj", "down_proj")


def _damped(model, scale: float):
    """Each layer's writes to the residual stream scaled down: the logits mostly follow the
    input token through the embedding, norm and head."""
    flat = dict(tree_flatten(model.parameters()))
    model.load_weights([(k, v * scale if any(d in k for d in DAMPED) else v) for k, v in flat.items()])
    return model


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    """A Qwen3-Next target (Gated DeltaNet + attention) and an attention-only draft (a
    one-layer Llama) that share its embedding, final norm and head, both with their
    layers damped: the draft agrees with the target often, not always."""
    root = tmp_path_factory.mktemp("hybrid")
    config = tiny_config("qwen3_next")
    target = _damped(make_mlx_lm_model(config, seed=7), 0.2)
    d_config = tiny_config("llama", num_hidden_layers=1, tie_word_embeddings=False)
    draft = _damped(make_mlx_lm_model(d_config, seed=8), 0.2)
    t = dict(tree_flatten(target.parameters()))
    draft.load_weights([(k, t[k]) for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")],
                       strict=False)
    return (save_model_dir(str(root / "target"), config, target), save_model_dir(str(root / "draft"), d_config, draft))


def _engine(path, **kw):
    kw = {"num_kv_blocks": 160, "block_size": 16, "max_num_seqs": ROWS, "speculative_max_batch": ROWS, **kw}
    return LLMEngine(path, EngineConfig(**kw))


def _prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 250, int(rng.integers(3, 40))).tolist() for _ in range(n)]


def _params(n: int, max_tokens: int = 16) -> list[SamplingParams]:
    """Greedy rows, and seeded sampled rows (temperature, top-p, penalties)."""
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0) if i % 2 == 0 else
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, top_p=0.9, seed=i,
                           repetition_penalty=1.1) for i in range(n)]


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen3_next", "deepseek_v2", "qwen2_moe"])
def test_32_rows_give_the_tokens_of_decoding_without_speculation(tmp_path_factory, hybrid_pair, model_type):
    """Plain K/V; sliding window + full groups; Gated DeltaNet state (rolled back after a
    rejected draft); MLA latents; MoE experts. The draft: a jittered copy of the target
    (the hybrid's, which must be attention-only: the one-layer Llama)."""
    if model_type == "qwen3_next":
        target, draft = hybrid_pair
    else:
        target, draft = _target(tmp_path_factory, model_type), _target(tmp_path_factory, model_type, noise=0.3)
    prompts, params = _prompts(ROWS), _params(ROWS)
    want = [o.token_ids for o in generate(_engine(target), prompts, params)]
    engine = _engine(target, num_speculative_tokens=4, speculative_max_batch=ROWS, draft_model=draft)
    got = [o.token_ids for o in generate(engine, prompts, params)]
    assert got == want
    st = engine.stats
    # Both paths were taken: drafts accepted and drafts rejected.
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"], st
    assert st["spec_drafted_by_position"][0] == st["spec_verify_steps"] > 0
    assert engine.drafter.block_manager.num_used_blocks == 0  # every shadow freed with its sequence
    assert engine.block_manager.num_used_blocks == 0


def test_the_target_as_its_own_draft_is_always_accepted_greedy_or_sampled(tmp_path_factory):
    """Full acceptance (the bonus token every step): 5 tokens per target forward, for
    sampled rows too: the draft draws each position with the noise the target draws it
    with, so the same distribution gives the same token."""
    target = tiny_model_dir(tmp_path_factory.mktemp("self"), num_hidden_layers=2, seed=3)[0]
    prompts = _prompts(4)
    params = [SamplingParams(max_tokens=41, ignore_eos=True, temperature=0),
              SamplingParams(max_tokens=41, ignore_eos=True, temperature=1.0, seed=3),
              SamplingParams(max_tokens=41, ignore_eos=True, temperature=0.7, top_p=0.9, top_k=50, seed=4),
              SamplingParams(max_tokens=41, ignore_eos=True, temperature=0.9, min_p=0.05, seed=5,
                             logit_bias={7: 2.0})]  # (penalties count the known tokens only: a draft may miss)
    want = [o.token_ids for o in generate(_engine(target), prompts, params)]
    engine = _engine(target, num_speculative_tokens=4, draft_model=target)
    got = [o.token_ids for o in generate(engine, prompts, params)]
    assert got == want
    st = engine.stats
    assert st["spec_accepted_tokens"] == st["spec_draft_tokens"] == 4 * 4 * 8  # 8 verify steps of 4 drafts each
    assert st["spec_accepted_by_position"] == st["spec_drafted_by_position"]


def test_a_hybrid_target_stays_exact_over_200_steps(hybrid_pair):
    """Qwen3-Next-style target: every rejection rewinds its recurrent state (the step's
    state transaction) and recomputes; 200 tokens match decoding without speculation."""
    target, draft = hybrid_pair
    prompts, params = _prompts(3), [SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)] * 3
    want = [o.token_ids for o in generate(_engine(target), prompts, params)]
    engine = _engine(target, num_speculative_tokens=3, draft_model=draft)
    got = [o.token_ids for o in generate(engine, prompts, params)]
    assert got == want
    assert 0 < engine.stats["spec_accepted_tokens"] < engine.stats["spec_draft_tokens"], engine.stats


def test_every_proposal_is_the_drafts_greedy_continuation(tmp_path_factory):
    """A long prompt's shadow catching up in chunks, rejected drafts rolled back: each
    proposal equals what the draft model alone decodes greedily from the same tokens (its
    K/V for them is right), and the output is the target's."""
    target, draft = _target(tmp_path_factory, "llama"), _target(tmp_path_factory, "llama", noise=0.1)
    prompts = [list(range(3, 250)) * 2, [5, 6, 7]]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0)] * 2
    want = [o.token_ids for o in generate(_engine(target), prompts, params)]
    engine = _engine(target, num_speculative_tokens=4, draft_model=draft, max_num_batched_tokens=64)
    proposals, propose = [], engine.drafter.propose

    def recorded(wants):
        drafts = propose(wants)
        proposals.extend((list(seq.token_ids), d) for seq, d in drafts.items() if d)
        return drafts

    engine.drafter.propose = recorded
    got = [o.token_ids for o in generate(engine, prompts, params)]
    assert got == want
    assert 0 < engine.stats["spec_accepted_tokens"] < engine.stats["spec_draft_tokens"], engine.stats
    assert any(len(tokens) > 400 for tokens, _ in proposals)  # the long prompt drafted once caught up
    alone = generate(_engine(draft), [t for t, _ in proposals],
                     [SamplingParams(max_tokens=len(d), ignore_eos=True, temperature=0) for _, d in proposals])
    assert [o.token_ids for o in alone] == [d for _, d in proposals]


def test_bad_draft_settings_are_refused_with_the_reason(tmp_path_factory, draft):
    target = _target(tmp_path_factory, "llama")
    with pytest.raises(ValueError, match="needs --num-speculative-tokens"):
        _engine(target, draft_model=draft)
    with pytest.raises(ValueError, match="1 to 16"):
        _engine(target, num_speculative_tokens=100)
    big = tiny_model_dir(tmp_path_factory.mktemp("big"), num_hidden_layers=4, hidden_size=128, seed=4)[0]
    with pytest.raises(ValueError, match="bigger than the target"):
        _engine(target, num_speculative_tokens=4, draft_model=big)
    other = tiny_model_dir(tmp_path_factory.mktemp("vocab"), num_hidden_layers=1, vocab_size=400, seed=4)[0]
    with pytest.raises(ValueError, match="more than the target's"):
        _engine(target, num_speculative_tokens=4, draft_model=other)
    hybrid = _target(tmp_path_factory, "qwen3_next")
    big_target = tiny_model_dir(tmp_path_factory.mktemp("bigt"), num_hidden_layers=6, hidden_size=256, seed=4)[0]
    with pytest.raises(ValueError, match="recurrent layers"):
        _engine(big_target, num_speculative_tokens=4, draft_model=hybrid)
    with pytest.raises(ValueError, match="distributed"):
        _engine(target, num_speculative_tokens=4, draft_model=draft, distributed="pipeline")
    eagle = tiny_model_dir(tmp_path_factory.mktemp("eagle"), num_hidden_layers=1, seed=6)[0]
    config = json.load(open(f"{eagle}/config.json"))
    json.dump({**config, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 300},
              open(f"{eagle}/config.json", "w"))
    with pytest.raises(ValueError, match="EAGLE-3 checkpoint without its fc projection"):  # an EAGLE-3 head's layout
        _engine(target, num_speculative_tokens=4, draft_model=eagle)
    json.dump({**config, "architectures": ["DFlashDraftModel"]}, open(f"{eagle}/config.json", "w"))
    with pytest.raises(ValueError, match="trained dflash drafter .*DFlashDraftModel.*EAGLE-3, Gemma 4.s assistant and DFlash"):
        _engine(target, num_speculative_tokens=4, draft_model=eagle)
    # The CLI: one line and a non-zero exit.
    for args, says in [(["--num-speculative-tokens", "100"], "0<=x<=16"),
                       (["--draft-model", draft], "needs --num-speculative-tokens"),
                       (["--num-speculative-tokens", "4", "--draft-model", big], "bigger than the target")]:
        result = CliRunner().invoke(main, ["generate", target, "--prompt", "hi", "-n", "2", *args])
        assert result.exit_code != 0 and says in result.output, result.output


def test_one_budget_buys_the_target_and_draft_pools(tmp_path_factory, draft):
    """--kv-cache-gb is what the target's pool and its drafter's pool take together (the
    drafter's holds a block per target block plus one per running sequence), and the
    weights a memory limit counts are both models'."""
    from macinfer.engine.drafter import weight_bytes

    target = _target(tmp_path_factory, "llama")
    gb = 0.004
    plain = LLMEngine(target, EngineConfig(kv_cache_gb=gb, max_num_seqs=8))
    spec = LLMEngine(plain.loaded, EngineConfig(kv_cache_gb=gb, max_num_seqs=8, draft_model=draft,
                                                num_speculative_tokens=3))
    t_blocks, d_pool = spec.kv_cache.groups[0].num_blocks, spec.drafter.kv_cache
    assert d_pool.groups[0].num_blocks == t_blocks + 8
    total = spec.kv_cache.nbytes + d_pool.nbytes
    per_block = spec.kv_cache.groups[0].bytes_per_block + d_pool.groups[0].bytes_per_block
    assert total <= gb * 2**30 < total + per_block  # within the budget, and one more block of both would not be
    assert plain.kv_cache.nbytes <= gb * 2**30 < plain.kv_cache.nbytes + spec.kv_cache.groups[0].bytes_per_block
    assert t_blocks < plain.kv_cache.groups[0].num_blocks
    assert spec.memory_bytes() == weight_bytes(spec.model) + total + weight_bytes(spec.drafter.model)
    assert spec.drafter_pool() == {"blocks_total": t_blocks + 8, "blocks_used": 0, "bytes": d_pool.nbytes}  # (/status)
    assert plain.drafter_pool() is None
    # A budget below one block of both pools names the drafter's share.
    with pytest.raises(ValueError, match="below one block .*with the drafter's pool"):
        LLMEngine(plain.loaded, EngineConfig(kv_cache_gb=per_block * 4 / 2**30, max_num_seqs=8, draft_model=draft,
                                             num_speculative_tokens=3))
    # A memory limit the target's weights fit but not both models': refused, the weights named.
    limit = weight_bytes(plain.model) + weight_bytes(spec.drafter.model) // 2
    LLMEngine(plain.loaded, EngineConfig(memory_limit_bytes=limit, max_num_seqs=8, kv_cache_gb=None))
    with pytest.raises(ValueError, match="the weights take"):
        LLMEngine(plain.loaded, EngineConfig(memory_limit_bytes=limit, max_num_seqs=8, kv_cache_gb=None,
                                             draft_model=draft, num_speculative_tokens=3))
    # Outputs stay those of decoding without speculation.
    prompts = _prompts(8)
    params = _params(8)
    assert [o.token_ids for o in generate(spec, prompts, params)] == \
        [o.token_ids for o in generate(plain, prompts, params)]


def test_metrics_report_acceptance_per_position(tmp_path_factory):
    from macinfer.server.metrics import _EngineCollector

    target = tiny_model_dir(tmp_path_factory.mktemp("metrics"), num_hidden_layers=2, seed=3)[0]
    engine = _engine(target, num_speculative_tokens=3, draft_model=target)
    generate(engine, _prompts(2), [SamplingParams(max_tokens=9, ignore_eos=True, temperature=0)] * 2)
    values = {f.name: f.samples[0].value for f in _EngineCollector(lambda: [("m", engine)], False).collect()}
    assert values["macinfer_spec_verify_steps"] == engine.stats["spec_verify_steps"] > 0
    assert [values[f"macinfer_spec_acceptance_position_{j}"] for j in (1, 2, 3)] == [1.0, 1.0, 1.0]
    assert values["macinfer_kv_bytes_per_token"] == engine.cache_groups()[0]["bytes_per_token"] > 0


def test_prompt_lookup_goes_first_where_it_finds_a_continuation(tmp_path_factory, draft):
    """--prompt-lookup-first: sequences whose prompt repeats (lookup finds a continuation)
    take its drafts, the draft model drafts only the others; the output is still that of
    decoding without speculation, with fewer rows drafted by the model."""
    target = _target(tmp_path_factory, "llama", noise=0.05)
    rng = np.random.default_rng(3)
    loops = [(rng.integers(3, 250, 6).tolist() * 5) for _ in range(6)]  # repeats: lookup always finds one
    prompts = loops + _prompts(6)
    params = _params(len(prompts))
    plain = _engine(target)
    want = [o.token_ids for o in generate(plain, prompts, params)]
    drafted = {}
    for first in (False, True):
        engine = _engine(plain.loaded, num_speculative_tokens=3, draft_model=draft, prompt_lookup_first=first)
        rows, propose = [], engine.drafter.propose
        engine.drafter.propose = lambda wants: rows.extend(wants) or propose(wants)
        assert [o.token_ids for o in generate(engine, prompts, params)] == want
        drafted[first] = (len(rows), engine.stats["spec_draft_tokens"])
    assert drafted[True][0] < drafted[False][0] and drafted[True][1] > 0, drafted
    with pytest.raises(ValueError, match="--prompt-lookup-first puts prompt lookup before a drafter"):
        _engine(target, num_speculative_tokens=3, prompt_lookup_first=True)
