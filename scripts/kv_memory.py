#!/usr/bin/env python
"""KV memory under macinfer's pool plan. No weights needed.

Sliding-window models against the same model with every layer kept in full: bytes per
token of context and the tokens a budget holds (the layer pattern from the config).

Hybrid models (recurrent + attention layers): each sequence's recurrent state and each
token's K/V, measured on mlx-lm's own classes built from the published config (lazily:
nothing is allocated), and how many conversations of a given length fit a budget,
against a dense model with the same attention in every layer.

Multi-head latent attention: the latent a token against K/V expanded per head, and the
context 16/64/256 GiB hold (DeepSeek V3, Kimi K2.5, GLM-4.7-Flash, Mistral Small 4).

Quantized KV (`--kv-cache-dtype`): bytes a token per dtype, with bfloat16 activations as on a
Mac (scales and biases in them), and the 4,096-token conversations a budget holds against
auto's (each dtype at its default block size), from the functions the engine's pool plan uses.

    python scripts/kv_memory.py                      # all of the above
    python scripts/kv_memory.py --config config.json --kv-cache-gb 8 --max-num-seqs 32
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from macinfer.kv.cache import CHANNEL_KEYS, KV_CACHE_DTYPES, bytes_per_block, layer_bytes_per_block, plan_blocks
from macinfer.kv.spec import CacheGroup, FullAttention, LayerKV, SlidingWindow

PRESETS = {  # from the published config.json files
    "gemma-3-27b": dict(num_hidden_layers=62, num_key_value_heads=16, head_dim=128, sliding_window=1024,
                        full_every=6, dtype="bfloat16"),
    "gpt-oss-20b": dict(num_hidden_layers=24, num_key_value_heads=8, head_dim=64, sliding_window=128,
                        full_every=2, dtype="bfloat16"),
}


_QWEN_LINEAR = dict(num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                    linear_conv_kernel_dim=4, full_attention_interval=4, hidden_size=2048, rms_norm_eps=1e-6,
                    rope_theta=10000000.0, partial_rotary_factor=0.25, max_position_embeddings=262144,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512, intermediate_size=5120,
                    decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[], tie_word_embeddings=False)
HYBRID_PRESETS = {  # from the published config.json files (text part)
    "Qwen3.5-35B-A3B": dict(_QWEN_LINEAR, model_type="qwen3_5_moe", num_hidden_layers=40, num_experts=256,
                            num_experts_per_tok=8, vocab_size=248320),
    "Qwen3-Next-80B-A3B": dict(_QWEN_LINEAR, model_type="qwen3_next", num_hidden_layers=48, num_experts=512,
                               num_experts_per_tok=10, vocab_size=151936),
}


MLA_PRESETS = {  # from the published config.json files: layers, heads, kv_lora_rank, rope, nope, v dims
    "DeepSeek-V3": dict(layers=61, heads=128, kv_lora_rank=512, rope=64, nope=128, v=128),
    "Kimi-K2.5": dict(layers=61, heads=64, kv_lora_rank=512, rope=64, nope=128, v=128),
    "GLM-4.7-Flash": dict(layers=47, heads=20, kv_lora_rank=512, rope=64, nope=192, v=256),
    # Mistral-Small-4-119B-2603: transformers' Mistral4Config, whose defaults are that checkpoint's
    "Mistral-Small-4": dict(layers=36, heads=32, kv_lora_rank=256, rope=64, nope=64, v=128),
    # DeepSeek Sparse Attention: each layer's indexer also caches one key a token
    "DeepSeek-V3.2": dict(layers=61, heads=128, kv_lora_rank=512, rope=64, nope=128, v=128, index_head_dim=128),
}


def mla_report(name: str, m: dict, budgets: tuple[float, ...] = (16, 64, 256), itemsize: int = 2) -> None:
    """Latent bytes a token (what macinfer caches: one K head of latent + rope key, V read
    from it) against K/V expanded per head, and the context each budget holds."""
    # A sparse attention's index keys, kept once (mlx-lm's cache keeps them as K and as V).
    index = m.get("index_head_dim", 0)
    latent = m["layers"] * (m["kv_lora_rank"] + m["rope"] + index) * itemsize
    expanded = m["layers"] * m["heads"] * (m["nope"] + m["rope"] + m["v"]) * itemsize
    held = ", ".join(f"{b:g} GiB: {int(b * 2**30 // latent):,} tokens" for b in budgets)
    parts = f"{m['kv_lora_rank']} + {m['rope']}" + (f" + {index} index key" if index else "")
    mlx_lm = f" (mlx-lm's cache: {m['layers'] * (m['kv_lora_rank'] + m['rope'] + 2 * index) * itemsize / 1024:.1f} " \
        "KiB, the index keys twice)" if index else ""
    print(f"{name} (MLA): {m['layers']} layers x ({parts}) bf16 = {latent / 1024:.1f} KiB a "
          f"token{mlx_lm} ({expanded / latent:.0f}x less than K/V expanded over {m['heads']} heads); {held}")


def hybrid_report(name: str, config: dict, budget_gb: float, context: int, max_num_seqs: int) -> None:
    """State bytes a sequence and K/V bytes a token, from mlx-lm's classes (bf16 weights)."""
    from macinfer.models.mlx_lm_adapter import build

    if config["model_type"] == "qwen3_5_moe":
        config = {"model_type": "qwen3_5_moe", "text_config": dict(config, model_type="qwen3_5_moe")}
    model = build(config)
    model.lm.set_dtype(mx.bfloat16)  # lazily: nothing is allocated
    states, kv = model.state_specs(), model.layer_specs
    state = sum(s.nbytes for s in states)
    per_token = sum(spec.bytes_per_token(2) for spec in kv)
    dense_per_token = per_token * model.num_layers // max(len(kv), 1)
    budget = budget_gb * 2**30
    # macinfer keeps a running slot and a mark slot a sequence (plus snapshots, not counted here)
    hybrid_conv = budget // (context * per_token + 2 * state)
    dense_conv = budget // (context * dense_per_token)
    print(f"{name}: {model.num_layers} layers, {len(kv)} attention ({kv[0].num_kv_heads} KV heads x "
          f"{kv[0].head_dim}), {len(states)} recurrent")
    print(f"  recurrent state: {state / 2**20:.1f} MiB a sequence ({states[0].describe()} per layer, "
          f"{', '.join(str(d).removeprefix('mlx.core.') for d in states[0].dtypes)}), whatever its length")
    print(f"  K/V: {per_token / 1024:.0f} KiB a token (a dense model with this attention in all "
          f"{model.num_layers} layers: {dense_per_token / 1024:.0f} KiB)")
    print(f"  a {context // 1024}k-token conversation: {(context * per_token + 2 * state) / 2**30:.2f} GiB "
          f"(dense: {context * dense_per_token / 2**30:.2f} GiB); {budget_gb:g} GiB holds {hybrid_conv} of them "
          f"(dense: {dense_conv}); --max-num-seqs {max_num_seqs} reserves {2 * max_num_seqs * state / 2**30:.2f} GiB "
          "of state slots")


def from_config(cfg: dict) -> dict:
    n = cfg["num_hidden_layers"]
    if "layer_types" in cfg:
        n_full = sum(t == "full_attention" for t in cfg["layer_types"])
    else:
        n_full = n // cfg.get("sliding_window_pattern", 1)
    return dict(num_hidden_layers=n, num_key_value_heads=cfg["num_key_value_heads"],
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                sliding_window=cfg["sliding_window"], num_full=n_full, dtype=cfg.get("torch_dtype", "bfloat16"))


def report(name: str, m: dict, budget_gb: float, max_num_seqs: int, step_tokens: int, block_size: int = 16) -> None:
    layers = m["num_hidden_layers"]
    n_full = m.get("num_full", layers // m.get("full_every", 1))
    n_win = layers - n_full
    W = m["sliding_window"]
    dtype = getattr(mx, m["dtype"])
    per_layer_block = bytes_per_block(1, m["num_key_value_heads"], m["head_dim"], block_size, dtype)
    kind = SlidingWindow(W)
    cap = max_num_seqs * kind.live_blocks(block_size) + -(-step_tokens // block_size)
    budget = int(budget_gb * 2**30)
    plain = [CacheGroup(0, FullAttention(), (), bytes_per_block=per_layer_block * layers)]
    groups = [CacheGroup(0, FullAttention(), (), bytes_per_block=per_layer_block * n_full),
              CacheGroup(1, kind, (), bytes_per_block=per_layer_block * n_win)]
    full_plain = plan_blocks(plain, budget, [0], 1 << 40)
    full = plan_blocks(groups, budget, [0, cap], 1 << 40)
    window = groups[1].blocks_for(full, cap)
    per_token_all = per_layer_block * layers / block_size
    per_token_full = per_layer_block * n_full / block_size
    print(f"{name}: {layers} layers ({n_full} full attention, {n_win} with a {W}-token window), "
          f"{m['num_key_value_heads']} KV heads x {m['head_dim']}, {m['dtype']}")
    print(f"  KV per token of context: {per_token_all / 1024:.0f} KiB if every layer keeps it, "
          f"{per_token_full / 1024:.0f} KiB with windows (+ a fixed window pool of "
          f"{per_layer_block * n_win * window / 2**30:.2f} GiB: {max_num_seqs} sequences x {W} tokens + a step)")
    print(f"  a {budget_gb:g} GiB budget holds {full_plain * block_size:,} tokens without windows, "
          f"{full * block_size:,} with them ({full / max(full_plain, 1):.1f}x)")


QUANT_PRESETS = {  # layers, KV heads, head dim: from the published config.json files
    "SmolLM2-135M": (30, 3, 64),
    "Llama-3.1-8B": (32, 8, 128),
    "Qwen3-32B": (64, 8, 128),
}


def quant_report(name: str, shape: tuple[int, int, int], budget_gb: float, context: int = 4096) -> None:
    layers, kvh, d = shape
    spec = LayerKV(FullAttention(), kvh, d, d)
    print(f"{name}: {layers} layers x {kvh} KV heads of {d}, bfloat16; {context}-token conversations in "
          f"{budget_gb:g} GiB")
    print(f"  {'KV':<7}{'block':>6}{'bytes/token':>13}{'conversations':>15}{'vs auto':>9}")
    auto = None
    for dtype in KV_CACHE_DTYPES:
        bs = 32 if dtype in CHANNEL_KEYS else 16
        per_block = layers * layer_bytes_per_block(spec, mx.bfloat16, bs, dtype)
        fit = int(budget_gb * 2**30 // per_block) // -(-context // bs)
        auto = auto or fit
        print(f"  {dtype:<7}{bs:>6}{per_block / bs:>13,.0f}{fit:>15,}{fit / auto:>8.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="an HF config.json of a sliding-window model")
    ap.add_argument("--kv-cache-gb", type=float, default=16.0)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--context", type=int, default=32768, help="conversation length for the hybrid figures")
    args = ap.parse_args()
    models, hybrids = PRESETS, HYBRID_PRESETS
    if args.config:
        with open(args.config) as f:
            cfg = json.load(f)
        text = {**cfg, **cfg.get("text_config", {})}
        if "linear_num_value_heads" in text or "mamba_d_state" in text or "conv_L_cache" in text:
            models, hybrids = {}, {args.config: cfg}
        else:
            models, hybrids = {args.config: from_config(cfg)}, {}
    for name, m in models.items():
        report(name, m, args.kv_cache_gb, args.max_num_seqs, args.max_num_batched_tokens)
    for name, cfg in hybrids.items():
        hybrid_report(name, cfg, args.kv_cache_gb, args.context, args.max_num_seqs)
    if not args.config:
        for name, m in MLA_PRESETS.items():
            mla_report(name, m)
        for name, shape in QUANT_PRESETS.items():
            quant_report(name, shape, args.kv_cache_gb)


if __name__ == "__main__":
    main()
