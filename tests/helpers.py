"""Tiny random-weight models, written the way mlx-community publishes them."""

from __future__ import annotations

import json
import math
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

FAMILIES = {
    "llama": {"model_type": "llama", "rope_theta": 10000.0},
    "llama3": {
        "model_type": "llama",
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    },
    "mistral": {"model_type": "mistral", "rope_theta": 1000000.0},
    "qwen2": {"model_type": "qwen2", "rope_theta": 1000000.0},
    "qwen3": {"model_type": "qwen3", "rope_theta": 1000000.0, "head_dim": 16},
}


def tiny_config(family: str = "llama", tie: bool = True, **overrides) -> dict:
    cfg = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 300,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": tie,
        "eos_token_id": 2,
    }
    cfg.update(FAMILIES[family])
    cfg.update(overrides)
    return cfg


def byte_tokenizer() -> Tokenizer:
    """A byte-level BPE with 256 byte tokens and 3 specials (ids 0-2), no merges."""
    specials = ["<unk>", "<s>", "</s>"]
    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(specials + sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return tok


def randomize_packs(params: dict) -> None:
    """Layers a family builds already packed (Prism's Hadamard 2-bit packs) start at zero:
    random bits, scales and sign vectors for them, in place."""
    for k, v in list(params.items()):
        prefix = k.rsplit(".", 1)[0]
        if v.dtype == mx.uint32 and f"{prefix}.scales" in params:
            scales = params[f"{prefix}.scales"]
            params[k] = mx.random.randint(0, 2**31, v.shape).astype(mx.uint32)
            params[f"{prefix}.scales"] = (0.05 * mx.random.uniform(shape=scales.shape)).astype(scales.dtype)
            params[f"{prefix}.biases"] = -1.5 * params[f"{prefix}.scales"]
            if f"{prefix}.signs" in params:
                signs = params[f"{prefix}.signs"]
                params[f"{prefix}.signs"] = mx.where(mx.random.uniform(shape=signs.shape) < 0.5, -1.0, 1.0).astype(mx.float32)


def make_mlx_lm_model(config: dict, seed: int = 0, quantize: dict | None = None) -> nn.Module:
    """Random-weight model built with mlx-lm's own class for this family (mlx-vlm's, for a
    language model only mlx-vlm implements)."""
    mx.random.seed(seed)
    from mlx_lm.utils import _get_classes  # honours mlx-lm's model_type remapping

    from macinfer.models.mlx_lm_classes import availability_probes_met

    try:
        with availability_probes_met():  # (OLMo's file checks for a package it never uses)
            model_class, args_class = _get_classes(config)
    except ValueError:  # a language model only mlx-vlm implements: its own class
        from mlx_vlm.utils import get_model_and_args

        module, _ = get_model_and_args(config)
        model = module.Model(module.ModelConfig.from_dict(config))
    else:
        model = model_class(args_class.from_dict(config))
    # mlx-lm initialises norms to 1; jitter them so a norm mix-up shows in logits.
    params = dict(tree_flatten(model.parameters()))
    params = {k: (v + 0.1 * mx.random.normal(v.shape) if "norm" in k else v) for k, v in params.items()}
    if config.get("model_type") in ZERO_INITIALISED:  # parameters left at 0 would leave layers unused
        params = {k: (v if mx.any(v).item() else _off_zero(v.shape)) for k, v in params.items()}
    randomize_packs(params)
    model.load_weights(list(params.items()))
    if quantize:
        nn.quantize(model, **quantize)
    mx.eval(model.parameters())
    return model


# Families whose classes start parameters at zero (Limite's `qkv_scale`, `o_scale`,
# `*_lambda_*`, gates; Talkie's output head and embedding skips): a random model keeps them
# off zero, or its layers add nothing (Talkie's logits were all 0) and any attention rule
# would pass its tests.
ZERO_INITIALISED = {"limite", "talkie"}


def _off_zero(shape: tuple) -> mx.array:
    """Scales and mixes near 0.5; a matrix like a Linear layer's initialisation."""
    return 0.5 + 0.2 * mx.random.normal(shape) if len(shape) < 2 else linear_start(shape)


def linear_start(shape: tuple) -> mx.array:
    """Random weights of a Linear layer's scale (its inputs along the last axis)."""
    return mx.random.normal(shape) * shape[-1] ** -0.5


def save_model_dir(path: str, config: dict, model: nn.Module, quantize: dict | None = None) -> str:
    os.makedirs(path, exist_ok=True)
    cfg = dict(config)
    if quantize:
        cfg["quantization"] = dict(quantize)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    mx.save_safetensors(os.path.join(path, "model.safetensors"), dict(tree_flatten(model.parameters())))
    byte_tokenizer().save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>",
                   "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"}, f)
    return path


def tiny_model_dir(tmp_path, family: str = "llama", tie: bool = True, quantize: dict | None = None, seed: int = 0, **overrides):
    config = tiny_config(family, tie, **overrides)
    model = make_mlx_lm_model(config, seed, quantize)
    return save_model_dir(str(tmp_path / f"{family}-{int(tie)}-{seed}"), config, model, quantize), model


def mlx_lm_greedy(model, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `prompt` from mlx-lm's own model and caches (the reference)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out


def chunked_logits(model, tokens: list[int], chunks: list[int], cache: list) -> np.ndarray:
    """mlx-lm's forward over `tokens` fed in `chunks` through `cache`: float32 logits [sum(chunks), vocab]."""
    out, pos = [], 0
    for n in chunks:
        out.append(np.array(model(mx.array([tokens[pos:pos + n]]), cache=cache)[0].astype(mx.float32)))
        pos += n
    return np.concatenate(out)


def generate(engine, prompts, params) -> list:
    """Run prompts (one SamplingParams or one per prompt) to completion; outputs in order."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


PAGED_BS = 16  # block size of the paged attention cases below


def paged_case(B, KVH, GQA, D, lens, dtype=np.float32, seed=0, bs=PAGED_BS):
    """Random decode queries and a paged K/V pool whose blocks are scattered (not
    contiguous): (q [B, H, D], k pool, v pool [nb, KVH, bs, D], tables, lens)."""
    rng = np.random.default_rng(seed)
    H = KVH * GQA
    nb = sum(-(-n // bs) for n in lens) + 3
    q = rng.normal(size=(B, H, D)).astype(dtype)
    kp = rng.normal(size=(nb, KVH, bs, D)).astype(dtype)
    vp = rng.normal(size=(nb, KVH, bs, D)).astype(dtype)
    perm = rng.permutation(nb)
    width = max(-(-n // bs) for n in lens)
    tables = np.zeros((B, width), np.int32)
    at = 0
    for b, n in enumerate(lens):
        k = -(-n // bs)
        tables[b, :k] = perm[at : at + k]
        at += k
    return q, kp, vp, tables, np.array(lens, np.int32)


def float64_decode_attention(q, kp, vp, tables, lens, window=None, sinks=None, softcap=None, scale=None):
    """Decode attention over a `paged_case` in float64, one (row, head) at a time: a
    sliding `window` keeps the last keys; `sinks` (per head) join only the softmax
    denominator; `softcap` caps the logits (tanh)."""
    B, H, D = q.shape
    gqa, bs = H // kp.shape[1], kp.shape[2]
    scale = D**-0.5 if scale is None else scale
    out = np.zeros((B, H, vp.shape[-1]))  # V may be narrower than K (MLA: K's leading columns)
    for b in range(B):
        first = max(0, lens[b] - window) if window else 0
        blocks = [tables[b][t // bs] for t in range(first, lens[b])]
        offsets = [t % bs for t in range(first, lens[b])]
        for h in range(H):
            k = kp[blocks, h // gqa, offsets].astype(np.float64)
            v = vp[blocks, h // gqa, offsets].astype(np.float64)
            s = k @ q[b, h].astype(np.float64) * scale
            if softcap:
                s = np.tanh(s / softcap) * softcap
            top = max(s.max(), sinks[h]) if sinks is not None else s.max()
            p = np.exp(s - top)
            denom = p.sum() + (math.exp(sinks[h] - top) if sinks is not None else 0.0)
            out[b, h] = (p / denom) @ v
    return out


class ProcessProbe:
    """What a benchmark's isolated process sees (`macinfer.bench.isolated`)."""

    def __init__(self, tag: str):
        self.tag = tag

    def where(self) -> tuple[str, int, int]:
        import mlx.core as mx

        limit = mx.set_cache_limit(0)
        mx.set_cache_limit(limit)
        return self.tag, os.getpid(), limit

    def fail(self) -> None:
        raise ValueError("probe failed on purpose")


def generate_joining(engine, prompts: list[list[int]], params) -> list[list[int]]:
    """Each request's tokens, each request joining a few steps after the previous one."""
    ids, outs = [], {}
    for i, prompt in enumerate(prompts):
        ids.append(engine.add_request(prompt, params))
        for _ in range(2 + i):
            outs.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    return [outs[r].token_ids for r in ids]


def greedy_by_recompute(logits, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens, each from `logits(tokens)` ([len, vocab]) over the whole sequence so
    far: a reference that runs no cache."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(mx.argmax(mx.array(logits(prompt + out))[-1]).item()))
    return out


def drafting_engine(target, draft: str, **kw):
    """An engine drafting 3 tokens a step with `draft` (anything --draft-model takes),
    speculating for up to 32 sequences."""
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine

    kw = {"kv_cache_gb": 0.02, "speculative_max_batch": 32, **kw}
    return LLMEngine(target, EngineConfig(draft_model=draft, num_speculative_tokens=3, **kw))


def same_tokens_as_plain(plain, draft: str, base: list[list[int]], sampled: dict):
    """32 rows (`base` and random prompts around a window's length), greedy and seeded with
    `sampled`'s settings, drafted by `draft` with the target `plain` runs: the tokens of
    `plain` alone, also on a pool so small that rows are preempted and recomputed. Returns
    (the drafting engine, the prompts, their params, the tokens)."""
    import numpy as np

    from macinfer.sampling_params import SamplingParams

    engine = drafting_engine(plain.loaded, draft)
    own = engine.drafter.kv_cache.nbytes if getattr(engine.drafter, "kv_cache", None) is not None else 0
    assert engine.kv_cache.nbytes + own <= engine.config.kv_cache_gb * 2**30  # one budget buys both pools
    rng = np.random.default_rng(7)
    prompts = base + [rng.integers(3, 290, size=int(rng.integers(3, 45))).tolist() for _ in range(32 - len(base))]
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True) if i % 2 else
              SamplingParams(**sampled, seed=i, max_tokens=14, ignore_eos=True) for i in range(len(prompts))]
    want = [o.token_ids for o in generate(plain, prompts, params)]
    assert [o.token_ids for o in generate(engine, prompts, params)] == want
    tight = drafting_engine(plain.loaded, draft, kv_cache_gb=None, num_kv_blocks=24, max_num_batched_tokens=64)
    assert [o.token_ids for o in generate(tight, prompts, params)] == want  # preempted and recomputed
    assert tight.scheduler.num_preemptions > 0
    assert engine.stats["spec_draft_tokens"] > 0
    return engine, prompts, params, want


def record_proposals(engine) -> list[tuple[list[int], int, list[int]]]:
    """Every proposal the engine's drafter makes from now on, as it makes it: (the
    sequence's tokens, its computed count, the drafts)."""
    records, propose = [], engine.drafter.propose

    def recording(wants):
        out = propose(wants)
        records.extend((list(seq.token_ids), seq.num_computed_tokens, d) for seq, d in out.items())
        return out

    engine.drafter.propose = recording
    return records
