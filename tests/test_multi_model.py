"""Several models behind one server: by name, loaded on demand (one load for concurrent
first requests), unloaded when idle (memory measured) or for room under a budget,
never while busy; a model that cannot fit is refused with the numbers."""

from __future__ import annotations

import asyncio
import gc
import os
import time

import httpx
import mlx.core as mx
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.server.model_pool import ModelPool, PoolError, Served
from macinfer.server.model_sources import ModelSource, discover, disk_bytes, size_text, unique
from tests.helpers import tiny_model_dir

GiB = 2**30


@pytest.fixture(scope="module")
def two_tiny(tmp_path_factory) -> tuple[str, str]:
    """Two different random models big enough that their memory shows."""
    base = tmp_path_factory.mktemp("multi")
    a, _ = tiny_model_dir(base, "llama", seed=1, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    b, _ = tiny_model_dir(base, "qwen3", seed=2, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    return a, b


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _app(sources, **pool_kw):
    from macinfer.server.app import create_app

    loads = []

    def load(src: ModelSource, limit: int | None = None) -> LLMEngine:
        loads.append(src.name)
        return LLMEngine(src.path, EngineConfig(kv_cache_gb=0.01, max_model_len=256, memory_limit_bytes=limit))

    pool = ModelPool(sources, load, kv_bytes=int(0.01 * GiB), **pool_kw)
    return create_app(pool), pool, loads


def _ask(c: httpx.AsyncClient, model: str, **kw):
    body = {"model": model, "prompt": "hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            **({} if kw.get("stream") else {"logprobs": 0}), **kw}
    return c.post("/v1/completions", json=body)


def _run(app, go):
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            try:
                return await go(c)
            finally:
                app.state.pool.shutdown()

    return asyncio.run(main())


def test_two_models_by_name_one_load_for_concurrent_first_requests(two_tiny):
    a, b = two_tiny
    app, pool, loads = _app([ModelSource("alpha", a, ("alpha-alias",)), ModelSource("beta", b)])

    async def go(c):
        listed = (await c.get("/v1/models")).json()["data"]
        rs = await asyncio.gather(*[_ask(c, "beta") for _ in range(4)], _ask(c, "alpha-alias"), _ask(c, "alpha:latest"))
        missing = await _ask(c, "gamma")
        status = (await c.get("/status", params={"model": "beta"})).json()
        return listed, rs, missing, status, (await c.get("/v1/models")).json()["data"]

    listed, rs, missing, status, after = _run(app, go)
    assert [(m["id"], m["state"]) for m in listed] == [("alpha", "unloaded"), ("beta", "unloaded")]
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    assert [r.json()["model"] for r in rs] == ["beta"] * 4 + ["alpha"] * 2
    assert sorted(loads) == ["alpha", "beta"]  # four concurrent first requests for beta: one load
    # Greedy answers are each model's own: the two random models differ (random weights
    # pick byte tokens that need not decode to text: compared by their log-probabilities).
    lp = [[round(x, 3) for x in r.json()["choices"][0]["logprobs"]["token_logprobs"]] for r in rs]
    assert lp[0] == lp[1] == lp[3] and lp[4] == lp[5] and lp[0] != lp[4]
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert "alpha, beta" in missing.json()["error"]["message"]
    assert status["model"] == "beta" and status["tokens"]["generation_tokens"] == 16
    states = {m["id"]: m for m in status["models"]}
    assert states["alpha"]["state"] == states["beta"]["state"] == "loaded"
    assert status["memory"]["used_bytes"] == sum(m["memory_bytes"] for m in status["models"])
    assert all(m["state"] == "loaded" and m["max_model_len"] == 256 and m["size_bytes"] > 0 for m in after)
    assert all(m["context_length"] == 2048 for m in listed)  # read from the config before any load


def test_idle_ttl_unloads_and_the_memory_returns(two_tiny):
    a, b = two_tiny
    app, pool, loads = _app([ModelSource("alpha", a), ModelSource("beta", b)], idle_ttl=1.0)

    async def go(c):
        pool.start()  # the reaper (ASGITransport runs no lifespan)
        gc.collect()
        mx.clear_cache()
        before = (mx.get_active_memory(), _rss())
        assert (await _ask(c, "beta")).status_code == 200
        loaded = (mx.get_active_memory(), _rss())
        size = pool.entries["beta"].known_bytes
        deadline = time.monotonic() + 15
        while pool.entries["beta"].state != "unloaded" and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # "unloading" until the step thread let go and the memory is back
        gc.collect()
        mx.clear_cache()
        after = (mx.get_active_memory(), _rss())
        state = pool.entries["beta"].state
        again = await _ask(c, "beta")
        return before, loaded, after, size, state, again

    before, loaded, after, size, state, again = _run(app, go)
    assert state == "unloaded"
    assert loaded[0] - before[0] >= 0.9 * size  # MLX's active memory grew by the model's weights and KV
    assert after[0] - before[0] < 0.05 * size, (before, loaded, after, size)  # and came back
    # (Not the RSS: in this long-lived test process, 1.3 GB after whatever tests ran before it in
    # any order, glibc may keep a 16 MB model's pages; a shuffled run saw them all kept while MLX's
    # memory was back to the byte. test_memory_budget checks a server process's own RSS over 22
    # unloads, and scripts/bench_multi_model.py --memory measures it.)
    assert again.status_code == 200 and loads == ["beta", "beta"]  # the next request loaded it again


def test_budget_evicts_the_idle_model_and_refuses_what_cannot_fit(two_tiny):
    a, b = two_tiny
    app, pool, loads = _app([ModelSource("alpha", a), ModelSource("beta", b)])

    async def go(c):
        first = await _ask(c, "alpha")
        one = pool.entries["alpha"].known_bytes
        pool.budget = int(1.5 * one)  # room for one of the two (same shapes: same size)
        second = await _ask(c, "beta")
        states = {e.name: e.state for e in pool.entries.values()}
        pool.budget = one // 2  # neither fits now
        await pool._unload(pool.entries["beta"], "test")
        refused = await _ask(c, "beta")
        return first, second, states, refused, pool.entries["beta"].known_bytes

    first, second, states, refused, need = _run(app, go)
    assert first.status_code == second.status_code == 200
    assert states == {"alpha": "unloaded", "beta": "loaded"}  # alpha was idle: unloaded for beta's room
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_too_large"
    msg = refused.json()["error"]["message"]
    assert f"needs {size_text(need)}" in msg and "memory budget" in msg and "--max-memory-gb" in msg


def test_a_busy_model_is_never_unloaded_for_room(two_tiny):
    """A stream on alpha holds it: beta's load waits (then is refused with a retry) and the
    stream finishes whole; once alpha is idle, beta loads in its place."""
    a, b = two_tiny
    app, pool, loads = _app([ModelSource("alpha", a), ModelSource("beta", b, disk_bytes=disk_bytes(b))],
                            wait_seconds=0.05)

    async def go(c):
        assert (await _ask(c, "alpha")).status_code == 200
        pool.budget = pool.entries["alpha"].known_bytes + pool.entries["beta"].source.disk_bytes // 2
        long = asyncio.ensure_future(_ask(c, "alpha", max_tokens=230, stream=True))
        while not pool.entries["alpha"].busy():
            await asyncio.sleep(0.01)
        waited = await _ask(c, "beta")
        streamed = await long
        after = await _ask(c, "beta")
        return waited, streamed, after, {e.name: e.state for e in pool.entries.values()}

    waited, streamed, after, states = _run(app, go)
    assert waited.status_code == 503 and waited.json()["error"]["code"] == "model_busy"
    assert waited.headers["retry-after"] == "5" and "alpha" in waited.json()["error"]["message"]
    assert streamed.status_code == 200 and '"finish_reason": "length"' in streamed.text and "[DONE]" in streamed.text
    assert after.status_code == 200 and states == {"alpha": "unloaded", "beta": "loaded"}


def test_a_load_failure_is_the_error_of_every_waiting_request(tmp_path, two_tiny):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')
    app, pool, loads = _app([ModelSource("alpha", two_tiny[0]), ModelSource("broken", str(broken))])

    async def go(c):
        return await asyncio.gather(*[_ask(c, "broken") for _ in range(3)]), await _ask(c, "alpha")

    rs, ok = _run(app, go)
    assert loads.count("broken") == 1
    for r in rs:
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
        assert "broken" in r.json()["error"]["message"]
    assert ok.status_code == 200  # the server goes on


class _FakeEngine:
    def __init__(self, size: int):
        self.size = size

    def memory_bytes(self) -> int:
        return self.size

    def has_unfinished_requests(self) -> bool:
        return False


class _FakeAsync:
    num_pending = 0

    def drain(self, _msg):
        pass

    def shutdown(self, leave_thread=False):
        self.closed = True

    def wait_stopped(self):
        pass


def test_pool_rules_with_injected_sizes():
    """The pool's rules alone: pinned models stay, LRU order, keep_alive, the size guess."""
    sizes = {"a": 4, "b": 4, "c": 4, "p": 2}
    pool = ModelPool([ModelSource(n, n, pinned=n == "p", disk_bytes=s * GiB) for n, s in sizes.items()],
                     lambda src, limit: _FakeEngine(sizes[src.name] * GiB), budget_bytes=11 * GiB, idle_ttl=60)
    pool.attach(lambda engine, src: Served(src.name, engine, _FakeAsync(), None))

    async def use(name):
        async with pool.use(name) as m:
            return m.name

    async def go():
        for n in ("p", "a", "b"):
            await use(n)
        await use("a")  # a is now more recent than b
        await use("c")  # 2 + 4 + 4 + 4 > 11: the least recently used idle one (b) goes; p is pinned
        state1 = {e.name: e.state for e in pool.entries.values()}
        pool.entries["a"].keep_alive = 0
        gone = await pool.unload_idle()
        with pytest.raises(PoolError) as e:
            pool.entries["p"].source.pinned = True
            pool.budget = 5 * GiB  # c alone (4) + pinned p (2) > 5
            await pool._unload(pool.entries["c"], "test")
            await use("c")
        return state1, gone, e.value

    state1, gone, err = asyncio.run(go())
    assert state1 == {"a": "loaded", "b": "unloaded", "c": "loaded", "p": "loaded"}
    assert gone == ["a"]
    assert err.code == "model_too_large" and "2.00 GiB of it held by pinned models" in err.message


def test_a_model_is_unloading_until_its_step_thread_let_go():
    """Between the unload's start and its memory's return the model is listed as
    "unloading" (Ollama's /api/ps keeps it): a client waiting for it to leave the list
    then sees the memory back, not 20 MiB of it still held (seen in CI under load)."""
    import threading

    release, seen = threading.Event(), []
    slow = _FakeAsync()
    slow.wait_stopped = lambda: release.wait(10)
    pool = ModelPool([ModelSource("a", "a", disk_bytes=GiB)], lambda src, limit: _FakeEngine(GiB), idle_ttl=60)
    pool.attach(lambda engine, src: Served(src.name, engine, slow, None))

    async def go():
        async with pool.use("a"):
            pass
        task = asyncio.ensure_future(pool._unload(pool.entries["a"], "test"))
        await asyncio.sleep(0.1)
        seen.append(pool.entries["a"].state)
        release.set()
        await task
        seen.append(pool.entries["a"].state)

    asyncio.run(go())
    assert seen == ["unloading", "unloaded"]


def test_models_dir_and_names(tmp_path, two_tiny):
    import shutil

    d = tmp_path / "models"
    d.mkdir()
    shutil.copytree(two_tiny[0], d / "coder")
    (d / "notes").mkdir()  # no model in it: left out
    unsupported = d / "weird"
    unsupported.mkdir()
    (unsupported / "config.json").write_text('{"model_type": "no_such_arch"}')
    found = discover(str(d), hf_cache=False)
    assert [(s.name, os.path.basename(s.path)) for s in found] == [("coder", "coder")]
    assert found[0].disk_bytes > 0
    srcs = unique([ModelSource("coder", "x", ("c",)), *found, ModelSource("other", "y", ("c", "o"))])
    assert [(s.name, s.aliases) for s in srcs] == [("coder", ("c",)), ("other", ("o",))]


def test_serve_several_models_from_the_command_line(smollm2_gguf, two_tiny):
    """`macinfer serve MODEL MODEL --idle-ttl`: both listed by Ollama's and OpenAI's lists,
    each answering by its name, Ollama's keep_alive 0 unloading one, metrics per model."""
    ollama = pytest.importorskip("ollama") if not os.environ.get("CI") else __import__("ollama")
    from tests.server_process import ServerProcess

    server = ServerProcess(smollm2_gguf, two_tiny[0], "--served-model-name", "smollm2", "--no-hf-cache",
                           "--idle-ttl", "600", "--kv-cache-gb", "0.05", "--max-model-len", "1024")
    try:
        tiny = os.path.basename(two_tiny[0])
        client = ollama.Client(host=server.url)
        assert [(m["id"], m["state"]) for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == \
            [("smollm2", "loaded"), (tiny, "unloaded")]  # the first MODEL loads at start, the others on demand
        assert [m.model for m in client.list().models] == ["smollm2:latest", f"{tiny}:latest"]
        answer = client.chat(model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
                             options={"temperature": 0, "num_predict": 16})
        assert "Paris" in answer.message.content and answer.load_duration == 0
        generated = client.generate(model=f"{tiny}:latest", prompt="hi", options={"temperature": 0, "num_predict": 4})
        assert generated.done and generated.model == tiny and generated.load_duration > 0
        assert {m.model for m in client.ps().models} == {"smollm2:latest", f"{tiny}:latest"}
        metrics = httpx.get(f"{server.url}/metrics").text
        assert f'macinfer_generation_tokens_total{{model="{tiny}"}} 4.0' in metrics
        assert 'macinfer_model_memory_bytes{model="smollm2"}' in metrics
        client.generate(model=tiny, prompt="", keep_alive=0)  # Ollama's unload request
        deadline = time.time() + 10
        while time.time() < deadline and [m.model for m in client.ps().models] != ["smollm2:latest"]:
            time.sleep(0.2)
        assert [m.model for m in client.ps().models] == ["smollm2:latest"]
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model="llama3:8b", messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 404 and "smollm2" in e.value.error and tiny in e.value.error
    finally:
        server.stop()


def test_serve_refuses_options_that_do_not_fit(tmp_path, two_tiny):
    from click.testing import CliRunner

    from macinfer.cli.main import main

    port = ["--port", "0"]
    cases = {("serve", *port): "give a MODEL (or several, or --models-dir DIR)",
             ("serve", two_tiny[0], "--idle-ttl", "5", *port): "--idle-ttl, --pin and --max-memory-gb are for several",
             ("serve", *two_tiny, "--distributed", "tensor", *port): "--distributed serves one model",
             ("serve", two_tiny[0], "-m", two_tiny[0], *port): "give each model once",
             ("serve", *two_tiny, "--pin", "nope", "--no-hf-cache", *port): "--pin nope: no such model",
             ("serve", "--models-dir", str(tmp_path / "missing"), "--no-hf-cache", *port): "not a directory",
             ("serve", "--models-dir", str(tmp_path), "--no-hf-cache", *port): "no servable model in"}
    for args, want in cases.items():
        r = CliRunner().invoke(main, list(args))
        assert r.exit_code in (1, 2) and want in r.output, (args, r.output)


def test_the_weights_estimate_before_a_load_covers_the_weights_as_loaded(smollm2_engine, smollm2_gguf, two_tiny):
    """The budget decides before a load from the files' headers: the GGUF's quantized
    tensors count as the float32 the CPU backend expands them to (2.6x the file here)."""
    from mlx.utils import tree_flatten

    from macinfer.loading.memory import weights_estimate

    loaded = sum(v.nbytes for _, v in tree_flatten(smollm2_engine.model.parameters()))
    estimate = weights_estimate(smollm2_gguf)
    assert loaded <= estimate <= 1.1 * loaded, (loaded, estimate, os.path.getsize(smollm2_gguf))
    assert estimate > 2 * os.path.getsize(smollm2_gguf)
    engine = LLMEngine(two_tiny[0], EngineConfig(kv_cache_gb=0.01, max_model_len=256))
    assert weights_estimate(two_tiny[0]) == sum(v.nbytes for _, v in tree_flatten(engine.model.parameters()))
    assert weights_estimate("/nonexistent") == 0


def test_an_engine_stays_within_the_memory_limit_it_is_given(two_tiny):
    from mlx.utils import tree_flatten

    probe = LLMEngine(two_tiny[0], EngineConfig(max_model_len=256))
    weights = sum(v.nbytes for _, v in tree_flatten(probe.model.parameters()))
    limit = weights + 4 * 2**20
    engine = LLMEngine(two_tiny[0], EngineConfig(max_model_len=256, memory_limit_bytes=limit))
    assert engine.memory_bytes() <= limit
    with pytest.raises(ValueError, match="memory budget leaves"):
        LLMEngine(two_tiny[0], EngineConfig(max_model_len=256, kv_cache_gb=0.01, memory_limit_bytes=limit))
    with pytest.raises(ValueError, match="more than the .* the memory budget leaves"):
        LLMEngine(two_tiny[0], EngineConfig(max_model_len=256, memory_limit_bytes=weights // 2))
