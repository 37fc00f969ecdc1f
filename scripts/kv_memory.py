#!/usr/bin/env python
"""KV memory of a sliding-window model under macinfer's pool plan, against the same
model with every layer kept in full: bytes per token of context and the tokens a
budget holds. No weights needed: the layer pattern comes from the config.

    python scripts/kv_memory.py                      # Gemma 3 27B and gpt-oss-20b shapes
    python scripts/kv_memory.py --config config.json --kv-cache-gb 8 --max-num-seqs 32
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from macinfer.kv.cache import bytes_per_block, plan_blocks
from macinfer.kv.spec import CacheGroup, FullAttention, SlidingWindow

PRESETS = {  # from the published config.json files
    "gemma-3-27b": dict(num_hidden_layers=62, num_key_value_heads=16, head_dim=128, sliding_window=1024,
                        full_every=6, dtype="bfloat16"),
    "gpt-oss-20b": dict(num_hidden_layers=24, num_key_value_heads=8, head_dim=64, sliding_window=128,
                        full_every=2, dtype="bfloat16"),
}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="an HF config.json of a sliding-window model")
    ap.add_argument("--kv-cache-gb", type=float, default=16.0)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = ap.parse_args()
    models = PRESETS
    if args.config:
        with open(args.config) as f:
            models = {args.config: from_config(json.load(f))}
    for name, m in models.items():
        report(name, m, args.kv_cache_gb, args.max_num_seqs, args.max_num_batched_tokens)


if __name__ == "__main__":
    main()
