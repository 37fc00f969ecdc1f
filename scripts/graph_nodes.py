#!/usr/bin/env python
"""MLX graph nodes in one decode step (4 sequences at context 64) of the bundled
SmolLM2, for each model implementation: the hand-written Llama file and mlx-lm's
classes through the adapter. On the CPU backend a step costs about its op count,
so this is a deterministic stand-in for speed on a noisy machine.

    python scripts/graph_nodes.py
"""

from collections import Counter
import re

import mlx.core as mx
from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.engine.sequence import Sequence
from macinfer.sampling_params import SamplingParams
for impl in ("auto", "mlx-lm"):
    e = LLMEngine("smollm2", EngineConfig(kv_cache_gb=0.1, model_impl=impl))
    seqs = [Sequence(f"s{i}", list(range(10, 74)), SamplingParams(temperature=0), 0) for i in range(4)]
    for s in seqs:
        e.block_manager.allocate(s, 65); s.num_computed_tokens = 64
        s.output_token_ids.append(5)
    ids, meta, rows, _ = e.runner.prepare([(s, 1) for s in seqs])
    logits = e.model.logits(e.model(ids, meta)[mx.array(rows)])
    mx.export_to_dot(f"/tmp/graph_{impl}.dot", logits, *e.kv_cache.state())
    text = open(f"/tmp/graph_{impl}.dot").read()
    ops = re.findall(r'label ="([A-Za-z]+)', text) or re.findall(r'label="([A-Za-z]+)', text)
    c = Counter(ops)
    layers = e.model.args.num_hidden_layers
    print(impl, "nodes", len(ops), "per layer", round(len(ops) / layers, 1), c.most_common(6))
