#!/usr/bin/env python
"""Hybrid, recurrent and MLA models on macinfer against mlx-lm, on the same random weights.

Builds tiny-but-not-toy random models with mlx-lm's own classes (hidden 512, 8 layers,
vocab 32k; Qwen3-Next: 6 Gated DeltaNet + 2 attention layers, dense MLP; Mamba-2: 8
SSM layers; DeepSeek-V3 MLA: 16 heads, latent 256, rope 32), then runs `macinfer bench`'s two measurements on each:

- offline (`bench engine`): single-stream decode and prefill, and throughput at 1, 8
  and 32 concurrent requests against mlx-lm's `BatchGenerator` (its `batch_generate`);
- decode steps (`bench step`): step time by batch x context against mlx-lm's model
  with its own caches (K/V filled with random rows, recurrent state by one step).

    python scripts/bench_hybrid.py [--family qwen3_next mamba2] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = {
    "qwen3_next": dict(model_type="qwen3_next", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=64, intermediate_size=1408, vocab_size=32000,
                       linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                       linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4,
                       num_experts=0, num_experts_per_tok=0, moe_intermediate_size=256,
                       shared_expert_intermediate_size=256, decoder_sparse_step=1, mlp_only_layers=[],
                       norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=0.25,
                       max_position_embeddings=4096, tie_word_embeddings=False),
    # MLA with realistic ratios (16 heads, latent 256, rope 32), dense MLP (no MoE layer).
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=512, num_hidden_layers=8, num_attention_heads=16,
                        num_key_value_heads=16, kv_lora_rank=256, q_lora_rank=128, qk_rope_head_dim=32,
                        qk_nope_head_dim=64, v_head_dim=64, intermediate_size=1408, moe_intermediate_size=256,
                        first_k_dense_replace=8, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                        vocab_size=32000, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                        max_position_embeddings=4096, tie_word_embeddings=False),
    "mamba2": dict(model_type="mamba2", hidden_size=512, num_hidden_layers=8, num_heads=16, head_dim=64,
                   state_size=64, conv_kernel=4, n_groups=1, expand=2, vocab_size=32000, use_bias=False,
                   use_conv_bias=True, layer_norm_epsilon=1e-5, chunk_size=64, tie_word_embeddings=True,
                   time_step_limit=(0.0, float("inf")), time_step_rank=32, residual_in_fp32=True,
                   max_position_embeddings=4096),
}


def model_dir(family: str) -> str:
    from tests.helpers import make_mlx_lm_model, save_model_dir
    from tests.zoo import tiny_config

    config = {**tiny_config(family), **CONFIGS[family]}
    return save_model_dir(tempfile.mkdtemp(prefix=f"hybrid-{family}-"), config, make_mlx_lm_model(config, seed=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--points", nargs="+", default=["1x128", "1x1024", "8x128", "8x1024", "32x128", "32x512"])
    ap.add_argument("--json", help="write every result here")
    args = ap.parse_args()
    from macinfer.bench import engine as bench_engine
    from macinfer.bench import step as bench_step
    from macinfer.loading.memory import release_freed

    out = {}
    for family in args.family:
        path = model_dir(family)
        res = bench_engine.run(path, ["mlx-lm"], prompt_len=32, gen_len=64, prefill_len=512,
                               concurrency=(1, 8, 32), batch_gen_len=32, repeats=args.repeats, kv_cache_gb=1.0)
        print(f"\n== {family}: {json.dumps(CONFIGS[family])}")
        print(bench_engine.table(res))
        points = [bench_step.parse_point(p) for p in args.points]
        # The engine of `bench engine` is garbage (its pools ~1 GB): freed before the step
        # bench builds its own, whose steps ran ~1.5x slower beside it (Mamba-2 at 32 x 128).
        release_freed()
        steps = bench_step.run(path, ["mlx-lm"], points, [], repeats=max(5, args.repeats))
        print(bench_step.table(steps))
        out[family] = {"engine": res, "step": steps}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
