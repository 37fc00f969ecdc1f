"""Image requests: macinfer vs mlx-vlm on the same weights, each engine in its own process.

    python scripts/bench_vision.py [--family qwen2_vl] [--requests 8] [--max-tokens 64] [--repeats 3] [--sizes mixed]

The weights are random (no checkpoint is downloaded here): a Qwen2-VL-shaped model built with
mlx-vlm's own classes (`tests/vision_models.py`) at --hidden/--layers, its vision tower at
--vision-dim/--vision-depth, pictures of --image-size pixels. Each repeat runs both engines,
interleaved, each in a fresh process: N concurrent requests with different pictures (macinfer:
one batch through the engine; mlx-vlm: its `batch_generate`), then, on macinfer, one cold
request and the next turn of its conversation (the picture resent: the prefix cache and the
encoder cache answer it). Reported: medians and spread over repeats; the throughput ratio;
cold vs warm TTFT. Every request generates exactly --max-tokens tokens (EOS ignored on macinfer;
mlx-vlm's counts are its own)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _pictures(n: int, size: int, first_seed: int = 100, mixed: bool = False):
    """n pictures of size x size pixels, or (`mixed`) of sizes spread around it, each its own
    (mlx-vlm 0.7.10's batch_generate batches the pictures of one size together, a size at a time)."""
    from tests.vision_models import picture

    sizes = [size + 28 * (i - n // 2) if mixed else size for i in range(n)]
    return [picture(first_seed + i, (s, s + (28 * (i % 3) if mixed else 0))) for i, s in enumerate(sizes)]


def _worker_macinfer(a) -> dict:
    from macinfer import LLM
    from macinfer.sampling_params import SamplingParams

    llm = LLM(a.model, max_num_seqs=max(8, a.requests), max_model_len=2048, kv_cache_gb=0.5)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    ask = lambda img, text: [{"role": "user", "content": [{"type": "image", "image": img},  # noqa: E731
                                                          {"type": "text", "text": text}]}]
    llm.chat(ask(_pictures(1, a.image_size, 7)[0], "warm up"), params)
    convs = [ask(img, f"describe picture {i}") for i, img in enumerate(_pictures(a.requests, a.image_size,
                                                                                 mixed=a.sizes == "mixed"))]
    start = time.perf_counter()
    outs = llm.chat(convs, params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    ttfts = sorted(o.metrics["ttft"] for o in outs)
    cold_conv = ask(_pictures(1, a.image_size, 999)[0], "what is in this picture?")
    cold = llm.chat(cold_conv, params)
    warm = llm.chat(cold_conv + [{"role": "assistant", "content": cold.text}, {"role": "user", "content": "more?"}],
                    params)
    enc = llm.engine.vision.encoder
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "ttft_p50": ttfts[len(ttfts) // 2],
            "ttft_max": ttfts[-1], "cold_ttft": cold.metrics["ttft"], "warm_ttft": warm.metrics["ttft"],
            "images_encoded": enc.images_encoded}


def _worker_mlx_vlm(a) -> dict:
    from mlx_vlm import load
    from mlx_vlm.generate.ar import batch_generate

    model, processor = load(a.model)
    tok = processor.tokenizer
    # batch_generate renders each prompt through the chat template with the image itself
    batch_generate(model, processor, images=_pictures(1, a.image_size, 7), prompts=["warm up"], max_tokens=a.max_tokens)
    pics = _pictures(a.requests, a.image_size, mixed=a.sizes == "mixed")
    start = time.perf_counter()
    res = batch_generate(model, processor, images=pics, prompts=[f"describe picture {i}" for i in range(len(pics))],
                         max_tokens=a.max_tokens)
    wall = time.perf_counter() - start
    tokens = int(getattr(res.stats, "generation_tokens", 0)) or sum(len(tok.encode(t)) for t in res.texts)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="qwen2_vl")
    p.add_argument("--model", default=None, help="a checkpoint folder (default: a random one built here)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vision-dim", type=int, default=256)
    p.add_argument("--vision-depth", type=int, default=4)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--sizes", choices=["same", "mixed"], default="same",
                   help="every picture --image-size square, or sizes spread around it (28 px steps)")
    p.add_argument("--worker", choices=["macinfer", "mlx-vlm"], default=None)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(_worker_macinfer(a) if a.worker == "macinfer" else _worker_mlx_vlm(a)))
        return
    if a.model is None:
        from tests.vision_models import tiny_vlm_dir

        base = tempfile.mkdtemp(prefix="bench-vision-")
        text = {"hidden_size": a.hidden, "num_hidden_layers": a.layers, "intermediate_size": 4 * a.hidden,
                "num_attention_heads": a.hidden // 64, "num_key_value_heads": max(1, a.hidden // 256)}
        heads = text["num_attention_heads"]
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [8, 12, 12]} if a.family == "qwen2_vl" else None
        vision = {"embed_dim": a.vision_dim, "depth": a.vision_depth, "num_heads": max(1, a.vision_dim // 64),
                  "hidden_size": a.hidden}
        a.model = tiny_vlm_dir(base, a.family, text=text, vision=vision, max_pixels=a.image_size * a.image_size * 2)
        assert a.hidden // heads == 64
    runs: dict[str, list[dict]] = {"macinfer": [], "mlx-vlm": []}
    for r in range(a.repeats):
        for engine in (("macinfer", "mlx-vlm") if r % 2 == 0 else ("mlx-vlm", "macinfer")):
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", engine, "--model", a.model,
                   "--requests", str(a.requests), "--max-tokens", str(a.max_tokens), "--image-size", str(a.image_size),
                   "--sizes", a.sizes]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if out.returncode != 0:
                sys.exit(f"{engine} failed:\n{out.stderr[-3000:]}")
            runs[engine].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"repeat {r + 1} {engine}: {runs[engine][-1]}", file=sys.stderr)

    def med(engine, key):
        vals = [x[key] for x in runs[engine]]
        return statistics.median(vals), (min(vals), max(vals))

    import mlx.core as mx
    import mlx_lm
    import mlx_vlm

    print(f"model: random {a.family}, hidden {a.hidden} x {a.layers} layers, vision {a.vision_dim} x {a.vision_depth}; "
          f"float32; {a.requests} concurrent requests, {a.image_size}px pictures ({a.sizes} sizes), "
          f"{a.max_tokens} tokens each")
    print(f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} cores, MLX {mx.__version__} "
          f"({mx.default_device()}), mlx-lm {mlx_lm.__version__}, mlx-vlm {mlx_vlm.__version__}; {a.repeats} repeats, "
          "each engine in its own process, interleaved")
    for engine in runs:
        tps, spread = med(engine, "tok_s")
        print(f"{engine:>9}: {tps:8.1f} tok/s (spread {spread[0]:.1f}-{spread[1]:.1f}), "
              f"wall {med(engine, 'wall_s')[0]:.2f} s")
    ratio = [m["tok_s"] / v["tok_s"] for m, v in zip(runs["macinfer"], runs["mlx-vlm"])]
    print(f"throughput ratio macinfer / mlx-vlm: median {statistics.median(ratio):.2f}x "
          f"(per repeat {', '.join(f'{x:.2f}' for x in ratio)})")
    cold, warm = med("macinfer", "cold_ttft")[0], med("macinfer", "warm_ttft")[0]
    print(f"macinfer TTFT: batch p50 {med('macinfer', 'ttft_p50')[0]:.3f} s, max {med('macinfer', 'ttft_max')[0]:.3f} s; "
          f"one request cold {cold:.3f} s, its next turn (picture resent) {warm:.3f} s: {cold / warm:.1f}x")
    if max(ratio) > 1.3 * min(ratio):
        print("warning: the ratio varies by more than 30% over repeats; the machine is busy or noisy")


if __name__ == "__main__":
    main()
