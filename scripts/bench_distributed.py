#!/usr/bin/env python
"""Two ranks against one, measured on this machine, and the traffic a step costs on Macs.

    python scripts/bench_distributed.py                      # both parts
    python scripts/bench_distributed.py --only traffic       # the arithmetic only

Measured: the same requests (greedy, 64 new tokens each, 128-token prompts) run by one
process and by `mlx.launch -n 2 --backend ring` in pipeline and tensor mode: single-stream
decode (tok/s, TPOT) and offline throughput at 8 concurrent, medians of `--repeats`
(`pipeline`: two steps in flight, the default; `pipeline-d1`: one step at a time;
`pipeline-mb2`: one step at a time, its sequences in 2 micro-batches). On one
machine both ranks share its cores and the loopback: this shows what the sync costs, not
what two Macs gain.

`--only spin`: whether a rank waiting in `recv` slows the other rank's compute on this
machine (two ranks on two cores: a one-row 4096 x 4096 matmul on rank 1 while rank 0
sleeps, then while it waits in a receive).

`--direct`: start the two ranks here with the environment `mlx.launch` gives them
(`MLX_RANK`, `MLX_HOSTFILE` naming two loopback ports) instead of through it: its
output-relay threads poll without blocking (the child's stdin is always in their select's
write set) and keep ~1.5 of this machine's 2 cores busy, which the ranks then lack.

`--pin`: each rank on a core of its own, and the one-process baseline on one core,
OpenBLAS at one thread: two "devices" of one core each, so a pipeline's bubble and what
micro-batches recover show here (`pipeline-mb4` joins the modes).

Computed: bytes and messages per decode step for DeepSeek V3 and Qwen3.5-397B-A17B in
each mode (mlx-lm's shard(): two all-reduces of the hidden state per layer; pipeline: one
send of it per stage boundary), against Thunderbolt 5 (80 Gb/s a direction; JACCL's
published 50-60 Gb/s effective) and a collective's latency (JACCL over RDMA: single-digit
to tens of microseconds as published; MLX's TCP ring: ~300 us).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# hidden size, decoder layers (published config.json files), and activations' bytes (bf16)
MODELS = {"DeepSeek-V3": (7168, 61), "Qwen3.5-397B-A17B": (4096, 60)}
TB5_BYTES_S = 6.5e9  # ~52 Gb/s effective
LATENCY_S = {"JACCL (RDMA over TB5)": 30e-6, "ring (TCP)": 300e-6}


def traffic(ranks: int = 2, batch: int = 1) -> None:
    print(f"Traffic per decode step, {ranks} ranks, {batch} sequence(s), bf16 activations:")
    print(f"{'model':<20} {'mode':<9} {'msgs/step':>9} {'KiB/token/layer':>16} {'MiB/step':>9} "
          + " ".join(f"{k + ' ms':>26}" for k in LATENCY_S))
    for name, (hidden, layers) in MODELS.items():
        row = hidden * 2 * batch  # the hidden state of the step's tokens
        # tensor: 2 all-reduces a layer; a ring all-reduce moves 2(N-1)/N of the data per rank
        # in 2(N-1) latency-bound hops
        tp_bytes = 2 * layers * row * 2 * (ranks - 1) / ranks
        tp_msgs = 2 * layers * 2 * (ranks - 1)
        pp_bytes, pp_msgs = (ranks - 1) * row, ranks - 1
        for mode, b, m, per_layer in (("tensor", tp_bytes, tp_msgs, 2 * row * 2 * (ranks - 1) / ranks),
                                      ("pipeline", pp_bytes, pp_msgs, row / layers)):
            # macinfer's own per step: the inputs and the sampled tokens, and in tensor mode an
            # acknowledgement (a pipeline with a step in flight has the hidden state coming back)
            sync = 3 if mode == "tensor" else 2
            times = [(m + sync) * lat + b / TB5_BYTES_S for lat in LATENCY_S.values()]
            print(f"{name:<20} {mode:<9} {m + sync:>9} {per_layer / batch / 1024:>16.2f} {b / 2**20:>9.3f} "
                  + " ".join(f"{t * 1e3:>26.2f}" for t in times))


def _rank(model: str, mode: str, out: str, prompt_len: int, new: int, concurrent: int) -> None:
    """One rank of a measurement (under mlx.launch, or alone for mode 'single')."""
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.sampling_params import SamplingParams

    micro = int(mode.split("-mb")[1]) if "-mb" in mode else 1  # "pipeline-mb2": 2 micro-batches
    depth = 1 if mode == "pipeline-d1" else None  # "pipeline-d1": one step at a time
    engine = LLMEngine(model, EngineConfig(kv_cache_gb=0.2, max_model_len=1024, enable_prefix_caching=False,
                                           distributed=None if mode == "single" else mode.split("-")[0],
                                           pipeline_micro_batches=micro, pipeline_depth=depth))
    if engine.dist is not None and not engine.dist.is_driver:
        engine.run_worker()
        return
    vocab = engine.model.args.vocab_size
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    result = {}
    for n in (1, concurrent):
        prompts = [[(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(prompt_len)] for i in range(n)]
        start = time.perf_counter()
        first = None
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=f"{n}-{i}")
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first is None and any(o.token_ids for o in outs):
                first = time.perf_counter()
        total = time.perf_counter() - start
        result[n] = {"tok_s": n * new / total, "ttft_s": first - start, "tpot_ms": (total - (first - start)) / (new - 1) * 1e3}
    engine.close()
    with open(out, "w") as f:
        json.dump(result, f)


def pin_to_core() -> None:
    """This process (before MLX starts its threads, which inherit it) on core RANK only."""
    os.sched_setaffinity(0, {int(os.environ.get("MLX_RANK", "0")) % os.cpu_count()})


def _spin_rank() -> None:
    """Rank 1 times a matmul while rank 0 sleeps, then while rank 0 waits in a receive."""
    import mlx.core as mx

    group = mx.distributed.init(backend="ring")
    mx.eval(mx.distributed.all_sum(mx.ones(4), group=group))
    if group.rank() == 0:
        time.sleep(1.5)  # asleep while rank 1 times its first run
        for _ in range(2):
            mx.eval(mx.distributed.recv((4,), mx.float32, 1, group=group))
        return
    w, x = mx.random.normal((4096, 4096)), mx.random.normal((1, 4096))
    mx.eval(w, x)

    def timed() -> float:
        times = []
        for _ in range(60):
            start = time.perf_counter()
            mx.eval(x @ w)
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    alone = timed()
    mx.eval(mx.distributed.send(mx.ones(4), 0, group=group))  # rank 0 now waits for the second
    time.sleep(0.2)
    beside = timed()
    mx.eval(mx.distributed.send(mx.ones(4), 0, group=group))
    print(f"rank 1, a one-row 4096 x 4096 matmul: {alone:.2f} ms while rank 0 sleeps, "
          f"{beside:.2f} ms while rank 0 waits in recv ({beside / alone:.2f}x)")


def run_ranks(args: list[str], env: dict, direct: bool) -> tuple[str, str]:
    """This script with `args` as 2 ring ranks on loopback: through `mlx.launch`, or
    (`direct`) started here with the environment it would give them. (stdout, stderr)."""
    if not direct:
        launch = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
        proc = subprocess.run([launch, "-n", "2", "--backend", "ring", "--python", sys.executable, __file__, *args],
                              capture_output=True, text=True, env=env)
        return proc.stdout, proc.stderr
    from macinfer.bench.targets import free_port

    ports = {free_port()}
    while len(ports) < 2:  # (a port just released may be handed out again)
        ports.add(free_port())
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[f"127.0.0.1:{p}"] for p in ports], f)
    try:
        procs = [subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env={**env, "MLX_RANK": str(r), "MLX_HOSTFILE": f.name})
                 for r in range(2)]
        outs = [p.communicate() for p in procs]
    finally:
        os.remove(f.name)
    return "".join(o for o, _ in outs), "".join(e for _, e in outs)


def spin(direct: bool) -> None:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "MACINFER_BENCH_PIN": "1", "PYTHONPATH": ROOT}
    out, err = run_ranks(["--spin-rank"], env, direct)
    print(("ranks started directly: " if direct else "under mlx.launch: ") + (out.strip() or err[-1500:]))


def measure(model: str, repeats: int, prompt_len: int, new: int, concurrent: int, pin: bool = False,
            direct: bool = False) -> None:
    modes = ["single", "pipeline", "pipeline-d1", "pipeline-mb2", *(["pipeline-mb4"] if pin else []), "tensor"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    env = {**os.environ, "PYTHONPATH": ROOT, **({"OPENBLAS_NUM_THREADS": "1", "MACINFER_BENCH_PIN": "1"} if pin else {})}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            for mode in runs:  # interleaved
                out = os.path.join(tmp, f"{mode}.json")
                args = [__file__, "--rank", model, mode, out, str(prompt_len), str(new), str(concurrent)]
                if mode == "single":
                    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env)
                    stdout, stderr = proc.stdout, proc.stderr
                else:
                    stdout, stderr = run_ranks(args[1:], env, direct)
                if not os.path.exists(out):
                    print(f"{mode}: failed\n{stdout[-1500:]}{stderr[-1500:]}")
                    runs[mode] = []
                    continue
                runs[mode].append(json.load(open(out)))
                os.remove(out)
    print(f"\n{model}: prompts of {prompt_len} tokens, {new} new tokens, greedy; medians of {repeats} "
          + ("(one core per rank, one core for the single process)" if pin
             else f"(2 ranks share this machine's {os.cpu_count()} cores)"))
    print(f"{'':<12} {'decode tok/s':>12} {'TPOT ms':>8} {'TTFT s':>7} {f'{concurrent} concurrent tok/s':>20}"
          + (f" {'of 2 x single':>14}" if pin else ""))
    one = [r[str(concurrent)]["tok_s"] for r in runs["single"]]
    for mode, results in runs.items():
        if not results:
            continue
        med = lambda n, k: statistics.median(r[str(n)][k] for r in results)  # noqa: E731
        # Two one-core ranks with no bubble would give twice one core's throughput.
        share = f" {med(concurrent, 'tok_s') / (2 * statistics.median(one)):>14.0%}" if pin and one else ""
        print(f"{mode:<12} {med(1, 'tok_s'):>12.1f} {med(1, 'tpot_ms'):>8.1f} {med(1, 'ttft_s'):>7.2f} "
              f"{med(concurrent, 'tok_s'):>20.1f}{share}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--spin-rank":
        pin_to_core()
        _spin_rank()
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        if os.environ.get("MACINFER_BENCH_PIN"):
            pin_to_core()
        model, mode, out, plen, new, conc = sys.argv[2:8]
        _rank(model, mode, out, int(plen), int(new), int(conc))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2 (its heads do not split in 2: "
                                                  "tensor mode is refused for it, pipeline runs)")
    ap.add_argument("--only", choices=["traffic", "measure", "spin"], default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--pin", action="store_true", help="one core per rank (see above)")
    ap.add_argument("--direct", action="store_true", help="start the ranks without mlx.launch (see above)")
    args = ap.parse_args()
    if args.only == "spin":
        spin(args.direct)
        return
    if args.only != "measure":
        traffic()
    if args.only != "traffic":
        from macinfer.loading.loader import bundled_test_model

        measure(args.model or bundled_test_model(), args.repeats, args.prompt_len, args.new_tokens, args.concurrent, args.pin,
                args.direct)


if __name__ == "__main__":
    main()
