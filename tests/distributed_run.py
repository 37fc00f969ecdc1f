"""One rank of a distributed generation (started by `mlx.launch` from tests/test_distributed.py).

    mlx.launch -n 2 --backend ring --python PY tests/distributed_run.py MODEL MODE OUT.json [KV_DTYPE:KV_QUANT_START]

Greedy requests that join a few steps apart (chunked prefill with 24-token steps, a shared
prefix, one request aborted); rank 0 writes each request's tokens to OUT.json. A vision
checkpoint's requests carry pictures instead (`images`)."""

import json
import sys

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams

PROMPTS = [list(range(5, 45)), list(range(5, 45)) + [50, 51], [7, 9, 11, 13, 15], list(range(100, 131))]


def run(model: str, mode: str | None, kv: str = "auto:0") -> dict:
    # "pipeline": two steps in flight (the default); "pipeline-d1": one at a time;
    # "pipeline-mb2": one at a time, cut into 2 micro-batches
    micro, depth = (2 if mode == "pipeline-mb2" else 1), (1 if mode == "pipeline-d1" else None)
    kv_dtype, kv_start = kv.split(":")  # the KV cache's dtype and --kv-quant-start
    engine = LLMEngine(model, EngineConfig(kv_cache_gb=0.05, max_num_batched_tokens=24, max_model_len=512,
                                           distributed=mode and mode.split("-")[0], pipeline_micro_batches=micro,
                                           pipeline_depth=depth, kv_cache_dtype=kv_dtype,
                                           kv_quant_start=int(kv_start)))
    if engine.dist is not None and not engine.dist.is_driver:
        engine.run_worker()
        return {}
    if engine.vision is not None or engine.vision_refusal is not None:
        return images(engine)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ids, done = [], {}
    for i, prompt in enumerate(PROMPTS):  # each joins a few steps after the previous one
        ids.append(engine.add_request(prompt, params, request_id=f"r{i}"))
        for _ in range(2):
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    victim = engine.add_request([3, 4, 5, 6], params, request_id="aborted")
    engine.step()
    engine.abort_request(victim)
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    cached = engine.block_manager.stats() if hasattr(engine.block_manager, "stats") else None
    engine.close()
    return {"tokens": [done[i] for i in ids], "cached": cached, "micro_batched": engine.runner.micro_batched_steps,
            "overlapped": engine.overlapped_steps}


def images(engine: LLMEngine) -> dict:
    """Requests with a picture each joining a step apart, the first picture again (its blocks
    a prefix hit: the picture's hash in their keys) and a text request between them."""
    from tests.vision_models import picture

    assert engine.vision is not None, engine.vision_refusal
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    ids, done = [], {}
    for i, seed in enumerate([0, 1, None, 0]):
        content = [{"type": "text", "text": "what is it"}] if seed is None else \
            [{"type": "image"}, {"type": "text", "text": "what is it"}]
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": content}])
        prompt, inputs = (prompt, None) if seed is None else engine.prepare_images(prompt, [picture(seed)])
        ids.append(engine.add_request(prompt, params, request_id=f"r{i}", images=inputs))
        done.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    engine.close()
    return {"tokens": [done[i].token_ids for i in ids],
            "logprobs": [[t.logprob for t in done[i].logprobs] for i in ids],
            "cached": [done[i].num_cached_tokens for i in ids], "encoded": engine.vision.encoder.images_encoded}


def fake_hub(root: str, out: str) -> None:
    """MACINFER_TEST_HUB=DIR: `snapshot_download` serves repos from DIR/<org>/<name>, copying
    only the files its allow_patterns match (as the Hub does) into a cache of this rank's,
    and records the weight files this rank fetched in OUT.rank<r>.json."""
    import fnmatch
    import os
    import shutil

    import huggingface_hub

    rank = os.environ.get("MLX_RANK", "single")
    fetched = []

    def snapshot_download(repo_id, allow_patterns=None, **_):
        src, dst = os.path.join(root, repo_id), os.path.join(root + ".cache", rank, repo_id)
        os.makedirs(dst, exist_ok=True)
        for name in os.listdir(src):
            if allow_patterns is None or any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                shutil.copy(os.path.join(src, name), dst)
                if name.endswith(".safetensors") and name not in fetched:
                    fetched.append(name)
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump(sorted(fetched), f)
        return dst

    huggingface_hub.snapshot_download = snapshot_download


if __name__ == "__main__":
    import os

    model, mode, out, *kv = sys.argv[1:]
    if os.environ.get("MACINFER_TEST_HUB"):
        fake_hub(os.environ["MACINFER_TEST_HUB"], out)
    result = run(model, None if mode == "single" else mode, *kv)
    if result:
        with open(out, "w") as f:
            json.dump(result, f)
