"""Two ranks on loopback (`mlx.launch -n 2 --backend ring`), as on two Macs.

Each run's greedy tokens must equal one process's: requests joining a few steps apart,
chunked prefill, a shared prefix, an abort (tests/distributed_run.py); tensor parallel
through mlx-lm's shard() (a dense and an MLA model), pipeline parallel on a dense and a
hybrid model, and `generate` on the bundled SmolLM2. A distributed `serve` answers 8 concurrent requests with
one process's tokens, and ends with an error when a rank is killed.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import make_mlx_lm_model, save_model_dir
from tests.server_process import free_port
from tests.zoo import tiny_config

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LAUNCH = [str(BIN / "mlx.launch"), "-n", "2", "--backend", "ring", "--python", sys.executable]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}

pytestmark = pytest.mark.skipif(not (BIN / "mlx.launch").exists(), reason="mlx.launch is not installed")


def _run(model: str, mode: str, tmp_path: Path, kv: str = "auto:0") -> dict:
    out = tmp_path / f"{mode}.json"
    cmd = ([] if mode == "single" else LAUNCH) + ([sys.executable] if mode == "single" else []) + [
        str(ROOT / "tests" / "distributed_run.py"), model, mode, str(out), kv]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _tiny(tmp_path: Path, model_type: str) -> str:
    config = tiny_config(model_type)
    return save_model_dir(str(tmp_path / model_type), config, make_mlx_lm_model(config, seed=7))


@pytest.mark.parametrize("model_type", ["qwen3", "deepseek_v3"])
def test_tensor_parallel_gives_single_process_tokens(tmp_path, model_type):
    """Heads split over 2 ranks by mlx-lm's shard() (DeepSeek V3: its MLA heads; the
    latent cache stays whole on each rank): the same greedy tokens as one process."""
    path = _tiny(tmp_path, model_type)
    assert _run(path, "tensor", tmp_path)["tokens"] == _run(path, "single", tmp_path)["tokens"]


@pytest.mark.parametrize("kv,modes", [("int4:16", ["tensor", "pipeline"]), ("int4c:0", ["tensor"])])
def test_quantized_kv_over_two_ranks(tmp_path, kv, modes):
    """int4 KV with each sequence's first 16 tokens at full precision (--kv-quant-start):
    each rank keeps the heads (tensor) or layers (pipeline) it computes, quantized alike;
    the same greedy tokens as one process with the same cache. int4c: keys per channel."""
    config = tiny_config("qwen3", head_dim=32)
    path = save_model_dir(str(tmp_path / "qwen3"), config, make_mlx_lm_model(config, seed=7))
    single = _run(path, "single", tmp_path, kv)["tokens"]
    for mode in modes:
        assert _run(path, mode, tmp_path, kv)["tokens"] == single, mode


def test_images_over_two_ranks(tmp_path):
    """Qwen2-VL (mlx-vlm's classes; multimodal RoPE): requests with pictures over two ranks,
    tensor and pipeline, each rank encoding the pictures it is sent with the request (every
    rank computes every step): one process's tokens and logprobs, the repeated picture a
    prefix hit."""
    from tests.vision_models import tiny_vlm_dir

    path = tiny_vlm_dir(tmp_path, "qwen2_vl")
    single = _run(path, "single", tmp_path)
    for mode in ("tensor", "pipeline"):
        two = _run(path, mode, tmp_path)
        assert two["tokens"] == single["tokens"] and two["cached"] == single["cached"], mode
        assert max(abs(a - b) for x, y in zip(two["logprobs"], single["logprobs"]) for a, b in zip(x, y)) < 1e-4
        assert two["cached"][3] > 0 and two["encoded"] == 2  # (the driver's count: the repeat hit its blocks)


def test_a_gguf_vision_model_with_its_mmproj_over_two_ranks(tmp_path):
    """A GGUF Qwen2-VL with llama.cpp's projector file beside it: each rank reads both files
    (the projector whole, its tower on every rank), and tensor and pipeline ranks give one
    process's tokens and logprobs, the repeated picture a prefix hit."""
    from tests.test_gguf_vision import build_vision_gguf

    _, out = build_vision_gguf("qwen2_vl", tmp_path)
    path = str(out / "qwen2_vl-tiny-F32.gguf")
    single = _run(path, "single", tmp_path)
    for mode in ("tensor", "pipeline"):
        two = _run(path, mode, tmp_path)
        assert two["tokens"] == single["tokens"] and two["cached"] == single["cached"], mode
        assert max(abs(a - b) for x, y in zip(two["logprobs"], single["logprobs"]) for a, b in zip(x, y)) < 1e-4
        assert two["cached"][3] > 0 and two["encoded"] == 2


def test_generate_command_over_two_ranks(smollm2_gguf):
    """`mlx.launch ... macinfer generate --distributed pipeline`: rank 0 prints one
    process's text; rank 1 prints nothing and exits when rank 0 is done."""
    args = ["generate", smollm2_gguf, "--prompt", "What is the capital of France?", "--max-tokens", "16",
            "--kv-cache-gb", "0.05"]
    single = subprocess.run([str(BIN / "macinfer"), *args], env=ENV, capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr
    two = subprocess.run(LAUNCH + [str(BIN / "macinfer"), *args, "--distributed", "pipeline"], env=ENV,
                         capture_output=True, text=True, timeout=180)
    assert "exited with code" not in two.stdout + two.stderr, two.stdout + two.stderr
    assert single.stdout.strip() and two.stdout.count(single.stdout.strip()) == 1, (single.stdout, two.stdout)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next"])
def test_pipeline_parallel_gives_single_process_tokens(tmp_path, model_type):
    """A layer range on each rank (Qwen3-Next: Gated DeltaNet and attention layers, each
    rank keeping the state of its own); SmolLM2 runs in the `generate` and `serve` tests.
    Two steps in flight (the default `pipeline_depth`; with recurrent state, one step at a
    time), and 2 micro-batches a step, give the same tokens. (One step at a time over two
    ranks: the Hub test.)"""
    path = _tiny(tmp_path, model_type)
    single = _run(path, "single", tmp_path)["tokens"]
    run = _run(path, "pipeline", tmp_path)
    assert run["tokens"] == single
    assert (run["overlapped"] > 0) == (model_type == "llama") and run["micro_batched"] == 0
    if model_type == "llama":
        run = _run(path, "pipeline-mb2", tmp_path)
        assert run["tokens"] == single and run["micro_batched"] > 0 and run["overlapped"] == 0


def test_each_pipeline_rank_fetches_only_its_own_hub_files(tmp_path):
    """A Hub model in 3 weight files (layers 0-1, layers 2-3, the rest) behind a fake Hub
    (tests/distributed_run.py: the real `snapshot_download` contract, files copied by
    pattern): over 2 pipeline ranks each fetches its own layers' file and the rest, never
    the other's; the tokens are one process's."""
    import mlx.core as mx

    from macinfer.distributed.files import layer_of

    config = tiny_config("llama", num_hidden_layers=4, layer_types=["full_attention"] * 4)
    path = Path(save_model_dir(str(tmp_path / "local"), config, make_mlx_lm_model(config, seed=7)))
    repo = tmp_path / "hub" / "test-org" / "tiny"
    repo.mkdir(parents=True)
    for f in path.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, repo / f.name)
    weights = {k: v for f in path.glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    parts = {"model-00001-of-00003.safetensors": lambda i: i in (0, 1),
             "model-00002-of-00003.safetensors": lambda i: i in (2, 3),
             "model-00003-of-00003.safetensors": lambda i: i is None}
    weight_map = {}
    for name, holds in parts.items():
        mine = {k: v for k, v in weights.items() if holds(layer_of(k))}
        mx.save_safetensors(str(repo / name), mine)
        weight_map.update(dict.fromkeys(mine, name))
    (repo / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    out = tmp_path / "hub.json"
    env = {**ENV, "MACINFER_TEST_HUB": str(tmp_path / "hub")}
    proc = subprocess.run(LAUNCH + [str(ROOT / "tests" / "distributed_run.py"), "test-org/tiny", "pipeline-d1", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    fetched = {r: json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in ("0", "1")}
    # rank 1 runs the first layers (0-1), rank 0 the last (2-3); both take the embeddings and head
    assert fetched["1"] == ["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"]
    assert fetched["0"] == ["model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]
    assert json.loads(out.read_text())["tokens"] == _run(str(path), "single", tmp_path)["tokens"]


def test_tensor_parallel_without_shard_is_refused_with_the_reason(tmp_path):
    path = _tiny(tmp_path, "gemma3_text")
    proc = subprocess.run(LAUNCH + [str(ROOT / "tests" / "distributed_run.py"), path, "tensor", str(tmp_path / "x")],
                          env=ENV, capture_output=True, text=True, timeout=120)
    # (mlx.launch itself exits 0 whatever its ranks do: the ranks' exit codes are in its warnings)
    assert "exited with code 1" in proc.stdout + proc.stderr
    assert "gemma3_text has no shard()" in proc.stdout + proc.stderr and "--distributed pipeline" in proc.stdout + proc.stderr


def test_one_process_alone_is_refused():
    from macinfer.distributed.group import DistributedError
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine

    with pytest.raises(DistributedError, match="mlx.launch -n 2"):
        LLMEngine("unused", EngineConfig(distributed="pipeline"))
    with pytest.raises(ValueError, match="pipeline only"):
        LLMEngine("unused", EngineConfig(distributed="tensor", pipeline_micro_batches=2))
    with pytest.raises(ValueError, match="--pipeline-depth applies to --distributed pipeline only"):
        LLMEngine("unused", EngineConfig(pipeline_depth=2))
    with pytest.raises(ValueError, match="choose one"):
        LLMEngine("unused", EngineConfig(distributed="pipeline", pipeline_depth=2, pipeline_micro_batches=2))


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of rank `rank` among the launcher's descendants (mlx.launch sets MLX_RANK)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"MLX_RANK={rank}".encode() in env and b"serve" in cmd and str(launcher.port).encode() in cmd:
            return int(proc.name)
    raise AssertionError(f"rank {rank} not found")


def _start_server(model: str, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = LAUNCH + [str(BIN / "macinfer"), "serve", model, "--port", str(port), *args]
    launcher = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    launcher.port = port
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        assert launcher.poll() is None, launcher.stdout.read()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return launcher, url
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "the distributed server did not come up"
        time.sleep(0.5)


def _end(launcher: subprocess.Popen) -> None:
    if launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.communicate()


def test_a_rank_that_hangs_ends_the_server_with_an_error(tmp_path):
    """Rank 1 stopped (SIGSTOP: alive, silent): the idle heartbeat's round trip waits,
    and after --distributed-timeout the server ends with an error naming the hang."""
    launcher, url = _start_server(_tiny(tmp_path, "qwen3"), "--distributed", "tensor", "--distributed-timeout", "5",
                                  "--kv-cache-gb", "0.01")
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        driver, worker = _rank_pid(launcher, 0), _rank_pid(launcher, 1)
        os.kill(worker, signal.SIGSTOP)
        stopped = time.time()
        while Path(f"/proc/{driver}").exists() and time.time() - stopped < 30:
            time.sleep(0.2)
        assert not Path(f"/proc/{driver}").exists(), "rank 0 still runs 30 s after rank 1 stopped"
        os.kill(worker, signal.SIGKILL)  # a stopped process cannot take mlx.launch's SIGTERM
        out, _ = launcher.communicate(timeout=60)
        assert "did not finish in 5 s (a rank hangs or the network is down)" in out, out[-2000:]
    finally:
        _end(launcher)


@pytest.mark.slow
def test_distributed_serve_answers_concurrent_requests_and_ends_when_a_rank_dies(smollm2_gguf, smollm2_engine):
    """`mlx.launch ... macinfer serve --distributed pipeline`: 8 concurrent greedy requests
    get one process's tokens (two steps in flight); /status shows each rank's layers and
    memory; rank 1 killed,
    the server exits with an error within 30 s."""
    from macinfer.sampling_params import SamplingParams
    from tests.helpers import generate

    launcher, url = _start_server(smollm2_gguf, "--distributed", "pipeline", "--kv-cache-gb", "0.1",
                                  "--max-model-len", "1024")
    try:
        status = httpx.get(f"{url}/status", timeout=10).json()["distributed"]
        assert status["mode"] == "pipeline" and [r["rank"] for r in status["ranks"]] == [0, 1]
        assert status["steps_in_flight"] == 2
        assert "rank 0: layers 19-29; rank 1: layers 0-18" in status["ranks"][0]["plan"]  # the head weighs 8 layers
        assert all(r["weights_bytes"] > 0 and r["kv_bytes"] > 0 for r in status["ranks"])

        prompts = [f"Count from {i} to {i + 5}:" for i in range(8)]

        def complete(prompt):
            r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0},
                           timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(complete, prompts))
        tok = smollm2_engine.tokenizer
        want = generate(smollm2_engine, [tok.encode(p) for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12))
        assert texts == [o.text for o in want]

        os.kill(_rank_pid(launcher, 1), signal.SIGKILL)
        killed = time.time()
        out, _ = launcher.communicate(timeout=60)
        assert time.time() - killed < 30
        assert "rank 1 exited" in out or "macinfer: error: distributed" in out, out[-2000:]
    finally:
        _end(launcher)


def test_rank_file_selection_rules():
    from macinfer.distributed.files import check_missing, layer_of, rank_files

    wm = {"model.embed_tokens.weight": "c", "model.layers.0.mlp.weight": "a", "model.layers.1.mlp.weight": "a",
          "model.layers.2.mlp.weight": "b", "model.layers.3.mlp.weight": "b", "model.norm.weight": "c",
          "transformer.h.10.attn.weight": "d"}
    assert layer_of("transformer.h.10.attn.weight") == 10 and layer_of("lm_head.weight") is None
    assert rank_files(wm, (0, 2)) == ["a", "c"] and rank_files(wm, (2, 4)) == ["b", "c"]
    check_missing(["model.layers.0.mlp.weight"], (2, 4), 0)  # another rank's layer: fine
    with pytest.raises(ValueError, match="rank 0: weights missing for this rank's part: model.layers.3.mlp.weight"):
        check_missing(["model.layers.3.mlp.weight"], (2, 4), 0)
    with pytest.raises(ValueError, match="model.norm.weight"):
        check_missing(["model.norm.weight"], (0, 2), 1)


def test_pipeline_ranges_balance_the_weights_a_step_reads():
    """Contiguous ranges, the first layers on the highest rank; equal layers and no head: an
    even split (extra layers to the lower ranks); rank 0's head counts as layers; every
    rank keeps a layer, however large the head."""
    from macinfer.distributed.sharding import layer_ranges

    assert layer_ranges([1.0] * 30, 2) == [(15, 30), (0, 15)]
    assert layer_ranges([1.0] * 5, 2) == [(2, 5), (0, 2)]
    assert layer_ranges([1.0] * 30, 2, head=8.0) == [(19, 30), (0, 19)]  # SmolLM2-135M's proportions
    assert layer_ranges([1.0] * 8, 3, head=1.0) == [(6, 8), (3, 6), (0, 3)]
    assert layer_ranges([1.0] * 3, 3, head=100.0) == [(2, 3), (1, 2), (0, 1)]
    assert layer_ranges([4.0, 4.0, 1.0, 1.0, 1.0, 1.0], 2) == [(1, 6), (0, 1)]  # dense first layers weigh more


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_server_sleeps_and_ends_with_its_launcher(tmp_path):
    """A distributed server after a request: over 10 s of idleness each rank uses under 3%
    of a core (40-60% before: the worker waited in a receive, which MLX's ring transport
    spins on; scripts/distributed_idle.py measures 30 s); then SIGTERM to the launcher alone
    (what a supervisor sends, not to the group): both ranks are gone within 15 s and the
    port is closed."""
    launcher, url = _start_server(_tiny(tmp_path, "qwen3"), "--distributed", "pipeline", "--kv-cache-gb", "0.01")
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        ranks = [_rank_pid(launcher, 0), _rank_pid(launcher, 1)]
        time.sleep(2)  # the request's last step and its bookkeeping
        before, start = [_cpu_seconds(p) for p in ranks], time.monotonic()
        time.sleep(10)
        used = [(_cpu_seconds(p) - b) / (time.monotonic() - start) for p, b in zip(ranks, before)]
        assert all(u < 0.03 for u in used), f"share of a core while idle, rank 0 and rank 1: {used}"

        launcher.send_signal(signal.SIGTERM)  # the launcher alone
        sent = time.time()
        while any(Path(f"/proc/{p}").exists() and "zombie" not in _state(p) for p in ranks) and time.time() - sent < 15:
            time.sleep(0.2)
        assert not [p for p in ranks if Path(f"/proc/{p}").exists() and "zombie" not in _state(p)], \
            "a rank outlived its launcher by 15 s"
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        _end(launcher)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"
