"""`macinfer bench`: every mode runs end to end on a tiny model and writes JSON with
the full context plus its plots. (Numbers are not checked: benchmarks are not tests.)"""

import json
import os

import pytest
from click.testing import CliRunner

from macinfer.cli.main import main
from tests.server_process import ServerProcess

pytest.importorskip("matplotlib")


def _run(args: list[str]) -> None:
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output + repr(r.exception)
    return r.output


def test_engine_mode_against_mlx_lm_on_the_same_weights(tiny_llama, tmp_path):
    out = _run(["bench", "engine", tiny_llama, "--vs", "mlx-lm", "-c", "1", "-c", "2", "--gen-len", "4",
                "--prefill-len", "16", "--batch-gen-len", "3", "--repeats", "1", "--out", str(tmp_path)])
    assert "ratio" in out and "throughput c=2" in out
    res = json.load(open(tmp_path / "bench_engine.json"))
    ctx = res["context"]
    assert {"macinfer", "mlx", "mlx_lm", "hardware", "energy", "workload", "model_type"} <= set(ctx)
    assert {"chip", "cores", "memory_gb", "mlx_device"} <= set(ctx["hardware"])
    assert ctx["mlx_lm_weights"]  # says which weights mlx-lm was given
    assert set(res["engines"]) == {"macinfer", "mlx-lm"}
    for e in res["engines"].values():
        assert e["decode_tok_s"] > 0 and set(e["throughput"]) == {"1", "2"}
    assert os.path.getsize(tmp_path / "engine_throughput_vs_concurrency.png") > 1000
    assert set(res["spread"]) == {"decode", "prefill", "c=1", "c=2"}
    assert {"macinfer", "mlx-lm", "machine", "ratio"} <= set(res["spread"]["c=2"])


def test_a_wide_spread_is_flagged_with_its_source():
    """The paired ratio steady while both engines swing together: the machine; one engine
    swinging alone on a steady machine: the engines. Narrow spreads say nothing."""
    from macinfer.bench.engine import spread, spread_note

    def note(rates, machine):
        return spread_note({"spread": {"c=32": spread(rates, machine)}, "context": {"workload": {"repeats": 4}}})

    machine_drift = note({"macinfer": [100, 80, 120, 90], "mlx-lm": [70, 56, 84, 63]}, [200, 160, 240, 180])
    assert "c=32 spread 42%" in machine_drift and "ratio 1.43-1.43: the machine (its matmul speed varied 42%; the ratio held)" in machine_drift
    engine_noise = note({"macinfer": [100, 70, 130, 95], "mlx-lm": [70, 71, 69, 70]}, [200, 201, 199, 200])
    assert "the engines (macinfer 62%, mlx-lm 3%), not the machine" in engine_noise
    assert note({"macinfer": [100, 101, 99], "mlx-lm": [70, 71, 69]}, [200, 200, 200]) == ""


def test_step_mode_times_steps_host_and_graph_nodes(tiny_llama, tmp_path):
    out = _run(["bench", "step", tiny_llama, "--vs", "mlx-lm", "--points", "1x16", "--points", "2x40",
                "--host-points", "1x16", "--host-points", "1x64", "--repeats", "1", "--out", str(tmp_path)])
    assert "graph nodes, mlx-lm" in out
    res = json.load(open(tmp_path / "bench_step.json"))
    assert [(r["batch"], r["context"]) for r in res["steps"]] == [(1, 16), (2, 40)]
    assert all(r["macinfer_ms"] > 0 and r["mlx_lm_ms"] > 0 and r["macinfer_host_ms"] > 0 for r in res["steps"])
    assert [h["context"] for h in res["host"]] == [16, 64]
    nodes = res["nodes"]
    assert nodes["macinfer"]["total"] > 0 and nodes["mlx-lm"]["total"] > 0
    assert nodes["macinfer"]["top"]  # the op kinds, counted from an export
    assert os.path.getsize(tmp_path / "step_time.png") > 1000
    r = CliRunner().invoke(main, ["bench", "step", tiny_llama, "--points", "16by1024"])
    assert r.exit_code == 2 and "expected BATCHxCONTEXT" in r.output


def test_spec_mode_compares_speculation_on_chat_tasks(tiny_llama, tmp_path):
    out = _run(["bench", "spec", tiny_llama, "--vs", "mlx-lm", "-k", "3", "--max-tokens", "12", "--repeats", "1",
                "--draft-model", tiny_llama, "--out", str(tmp_path)])
    assert "macinfer spec k=3" in out and "free writing" in out and "JSON schema" in out
    res = json.load(open(tmp_path / "bench_spec.json"))
    assert res["context"]["macinfer_flags"]["num_speculative_tokens"] == 3 and res["context"]["mlx_lm_weights"]
    from macinfer.bench.spec import TASKS

    # The byte-level tiny model's 2k context cannot hold the long file: reported, not run.
    assert set(res["skipped"]) == {"long code edit"} and "long code edit: skipped" in out
    assert set(res["tasks"]) | set(res["skipped"]) == set(TASKS)
    for task, row in res["tasks"].items():
        engines = row["engines"]
        both = {"macinfer", "macinfer spec k=3", "macinfer draft k=3", "macinfer lookup+draft k=3"}
        assert set(engines) == (both if task == "JSON schema" else both | {"mlx-lm"})  # mlx-lm has no grammars
        # greedy on the same weights: every engine produced the same tokens
        assert all(e["same_tokens"] and e["decode_tok_s"] > 0 for e in engines.values())
        assert "acceptance_rate" in engines["macinfer spec k=3"]
    assert os.path.getsize(tmp_path / "spec_decode.png") > 1000


def test_draft_mode_compares_a_draft_model_by_batch(tiny_llama, tmp_path):
    """The tiny model's first layer as its draft: each engine in its own process, the same
    tokens with and without it, acceptance and tokens per target forward reported."""
    out = _run(["bench", "draft", tiny_llama, "--draft-layers", "1", "--batch", "1", "--batch", "2",
                "--max-tokens", "6", "--repeats", "1", "--temperature", "0.8", "--out", str(tmp_path)])
    assert "mlx-lm speculative" in out and "tok/fwd" in out
    res = json.load(open(tmp_path / "bench_draft.json"))
    assert set(res["batches"]) == {"1", "2"} and res["context"]["draft"] == "the target's first 1 layers"
    for row in res["batches"].values():
        assert row["macinfer + draft"]["same_tokens"] and row["macinfer"]["decode_tok_s"] > 0
        assert row["macinfer + draft"]["tokens_per_target_forward"] >= 1.0


def test_serve_mode_against_a_url(tiny_llama, tmp_path):
    other = ServerProcess(tiny_llama, "--kv-cache-gb", "0.01", "--served-model-name", "other")
    try:
        _run(["bench", "serve", tiny_llama, "--vs", other.url + "/v1", "-c", "1", "-c", "2", "--requests", "3",
              "--rate", "4", "--input-len", "16", "--output-len", "4", "--kv-cache-gb", "0.01", "--structured", "0.5",
              "--mixed", "2", "24", "1", "4", "--out", str(tmp_path)])
    finally:
        other.stop()
    res = json.load(open(tmp_path / "bench_serve.json"))
    assert res["levels"] == ["c1", "c2", "poisson4", "mixed"]
    assert res["context"]["workload"]["structured_output"]["fraction"] == 0.5
    assert set(res["servers"]) == {"macinfer", other.url + "/v1"}
    assert res["context"]["targets"][other.url + "/v1"]["model"] == "other"
    ours = res["servers"]["macinfer"]
    for level in res["levels"][:3]:
        lv = ours[level]
        assert lv["failed"] == 0 and lv["requests"] == 3
        assert {"ttft_p50", "ttft_p95", "ttft_p99", "itl_p99", "e2e_p99", "throughput_tok_s", "requests_per_s",
                "kv_hit_rate"} <= set(lv)
        assert lv["structured_requests"] == 2  # requests 0 and 2 of 3 held to the JSON schema
    mixed = ours["mixed"]
    assert mixed["failed"] == 0 and mixed["requests"] == 2 * 3 + 1 and "long_ttft_p50" in mixed
    assert ours["peak_rss_gb"] > 0 and ours["memory_gb_over_time"]
    assert "peak_rss_gb" not in res["servers"][other.url + "/v1"]  # not our process: not measured
    for name in ("throughput_vs_concurrency", "latency_cdf", "memory"):
        assert os.path.getsize(tmp_path / f"serve_{name}.png") > 1000


def test_prefix_mode_shows_the_cache(tiny_llama, tmp_path):
    _run(["bench", "prefix", tiny_llama, "--vs", "macinfer-nocache", "--turns", "2", "--clients", "3",
          "--max-tokens", "2", "--out", str(tmp_path)])
    res = json.load(open(tmp_path / "bench_prefix.json"))
    cached = {n: r["shared_system"]["cached_tokens_mean"] for n, r in res["servers"].items()}
    assert cached["macinfer"] > 0 and cached["macinfer-nocache"] == 0
    assert os.path.getsize(tmp_path / "prefix_ttft.png") > 1000
    # after a restart, macinfer's disk tier finds the long prompt; without a prefix cache, nothing does
    restart = {n: r["restart"] for n, r in res["servers"].items()}
    from macinfer.bench.prefix import SYSTEM

    # the tiny model's tokenizer is byte-level: a character a token
    assert restart["macinfer"]["cached_tokens_after_restart"] >= 0.9 * len(SYSTEM) * restart["macinfer"]["system_prompt_repeats"]
    assert restart["macinfer-nocache"]["cached_tokens_after_restart"] == 0


def test_bad_target_is_a_usage_error():
    r = CliRunner().invoke(main, ["bench", "serve", "--vs", "llama.cpp"])
    assert r.exit_code == 2 and "expected mlx-lm, macinfer-nocache or an http(s) URL" in r.output


def test_profile_mode_splits_a_steps_host_time(tiny_llama, tmp_path):
    out = _run(["bench", "profile", tiny_llama, "-c", "3", "--prompt-len", "8", "--gen-len", "5",
                "--out-dir", str(tmp_path)])
    assert "3 concurrent" in out and "paths: decode_attention reference, attention_ops" in out
    res = json.load(open(tmp_path / "bench_profile.json"))
    ms = res["ms_per_step"]
    engine_phases = {"schedule", "metadata", "graph", "device", "sampler", "outputs"}
    assert set(ms) == engine_phases | {"requests", "delivery"}
    assert res["steps"] >= 5 and all(ms[k] > 0 for k in engine_phases) and res["tok_s"] > 0
    assert ms["requests"] == ms["delivery"] == 0  # offline: no server thread
    assert res["context"]["workload"]["concurrency"] == 3
    assert res["async_scheduling"] and res["tokens_from_lookahead"] > 0.5
    split = res["device_split_ms_per_step"]
    assert set(split) == {"attention", "matmul", "rest"} and all(v > 0 for v in split.values())
    assert "device by kind" in out


def test_profile_through_the_server_thread_times_requests_and_delivery(tiny_llama, tmp_path):
    """`--through-server`: the requests go to the server's engine thread and come back as
    streams; taking them and handing outputs on are timed too. Without async scheduling no
    token comes from a lookahead."""
    _run(["bench", "profile", tiny_llama, "-c", "3", "--prompt-len", "8", "--gen-len", "5", "--through-server",
          "--no-async-scheduling", "--out-dir", str(tmp_path)])
    res = json.load(open(tmp_path / "bench_profile.json"))
    ms = res["ms_per_step"]
    assert ms["requests"] > 0 and ms["delivery"] > 0 and ms["device"] > 0 and res["tok_s"] > 0
    assert res["context"]["workload"]["through_server"] is True
    assert not res["async_scheduling"] and res["tokens_from_lookahead"] == 0


def test_the_device_split_changes_no_output_and_counts_every_kind(tiny_llama, tmp_path):
    """Barriers around attention and matmuls evaluate earlier, never differently; the
    patched classes are restored after."""
    import mlx.nn as nn

    from macinfer.engine.device_split import DeviceSplit
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.sampling_params import SamplingParams
    from tests.helpers import generate

    engine = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01, enable_prefix_caching=False))
    prompts = [list(range(10, 30)), list(range(40, 52))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = [o.token_ids for o in generate(engine, prompts, params)]
    linear = nn.Linear.__call__
    with DeviceSplit() as split:
        timed = [o.token_ids for o in generate(engine, prompts, params)]
    assert timed == plain and nn.Linear.__call__ is linear
    assert all(split.seconds[k] > 0 for k in ("attention", "matmul", "rest"))


def test_the_compared_engine_runs_in_a_process_of_its_own():
    """macinfer's allocator settings are this process's; the engine it is compared
    with gets MLX's defaults in its own process, and its errors come back."""
    import subprocess
    import sys

    import mlx.core as mx

    from macinfer.bench.isolated import Isolated

    default = int(subprocess.check_output([sys.executable, "-c", "import mlx.core as mx; print(mx.set_cache_limit(0))"]))
    ours = mx.set_cache_limit(default + (1 << 30))
    try:
        with Isolated("tests.helpers:ProcessProbe", "mlx-lm", name="probe") as child:
            tag, pid, limit = child.where()
            assert (tag, limit) == ("mlx-lm", default) and pid != os.getpid()
            assert child.peak_rss_gb() > 0
            with pytest.raises(RuntimeError, match="probe failed on purpose"):
                child.fail()
            assert child.where()[1] == pid  # an error does not end the child
    finally:
        mx.set_cache_limit(ours)
    assert child._proc.poll() == 0
    with pytest.raises(RuntimeError, match="No module named"):
        Isolated("no_such_module:Thing")
