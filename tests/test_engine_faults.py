"""Faults inside the engine: a failed forward pass, a dead engine loop, two
threads on one LLM, an interrupted generate, a wrong kernel. Faults are
injected through the runner and the kernel dispatch."""

import asyncio
import signal
import subprocess
import sys
import textwrap
import threading

import httpx
import mlx.core as mx
import pytest

import macinfer.engine.runner.execution as model_runner
from macinfer import LLM
from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.kv.cache import KVCache
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PREFIX = list(range(5, 5 + 40))  # two and a half blocks


def _lazily_failing_array(tmp_path):
    """An array whose evaluation raises (a lazy load of a file truncated after the
    load was set up): the way an out-of-memory inside a graph surfaces."""
    path = str(tmp_path / "bad.safetensors")
    mx.save_safetensors(path, {"a": mx.zeros((512, 512))})
    arr = mx.load(path)["a"]
    with open(path, "r+b") as f:
        f.truncate(100)
    return arr


def test_failed_forward_does_not_poison_the_prefix_cache(tiny_llama, tmp_path, monkeypatch):
    cold = generate(LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01)), [PREFIX + [60]], GREEDY)[0]
    engine = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01))
    # A running request not in the failing step's batch would lose its K/V too:
    # it must be recomputed and still give its own tokens.
    other_prompt = [7, 8, 9]
    other_want = generate(engine, [other_prompt], GREEDY)[0].token_ids

    real_write = KVCache.write
    fail = {"armed": True}

    def write(self, layer, slots, k, v, *plan):
        if fail["armed"] and layer == 0 and k.shape[0] > 1:  # the prefill of the long prompt
            fail["armed"] = False
            k = k + _lazily_failing_array(tmp_path)[0, 0]  # evaluates to an error, inside the pools' graph
        return real_write(self, layer, slots, k, v, *plan)

    monkeypatch.setattr(KVCache, "write", write)
    first = engine.add_request(PREFIX + [60], GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    failed = [o for o in outs if o.request_id == first and o.finished]
    assert failed and failed[0].finish_reason == "error"
    assert engine.block_manager.num_cached_blocks == 0  # nothing published from the failed step survives
    # The same prefix again: computed afresh, the same tokens as a cold engine.
    again = generate(engine, [PREFIX + [60], other_prompt], GREEDY)
    assert again[0].token_ids == cold.token_ids and again[0].finish_reason == "length"
    assert again[1].token_ids == other_want
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_engine_carries_on_after_a_failed_step(tiny_llama, monkeypatch):
    engine = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01))
    want = generate(engine, [[11, 12, 13]], GREEDY)[0].token_ids
    rid = engine.add_request([11, 12, 13], GREEDY)
    for _ in range(3):
        engine.step()  # running, with K/V in the pools
    real = model_runner.ModelRunner.step
    calls = {"n": 0}

    def step(self, scheduled, *rest):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("[metal] out of memory")  # stands in for any failed forward
        return real(self, scheduled, *rest)

    monkeypatch.setattr(model_runner.ModelRunner, "step", step)
    late = engine.add_request([21, 22, 23], GREEDY)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs[rid].finish_reason == "error" and outs[late].finish_reason == "error"  # both in the failed batch
    assert generate(engine, [[11, 12, 13]], GREEDY)[0].token_ids == want


def _app(engine, **kw):
    from macinfer.server.app import create_app

    return create_app(engine, "tiny", **kw)


def test_engine_loop_that_keeps_failing_is_declared_dead(tiny_llama, monkeypatch):
    engine = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01))
    dead = threading.Event()
    app = _app(engine, on_dead=lambda reason: dead.set())

    def broken_step():
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(engine, "step", broken_step)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
            r1 = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
            r2 = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True})
            r1, r2 = await asyncio.gather(r1, r2)
            return r1, r2, await c.get("/health"), await c.post("/v1/completions", json={"prompt": "x"})

    try:
        r1, r2, health, after = asyncio.run(go())
    finally:
        app.state.async_engine.shutdown()
    assert dead.is_set()
    assert r1.status_code == 503 and "engine stopped" in r1.json()["error"]["message"]
    # The stream ends with an error event, or (admitted after the engine died) is refused with 503.
    assert "engine stopped" in r2.text and ("data: [DONE]" in r2.text or r2.status_code == 503)
    assert health.status_code == 503 and health.json()["status"] == "error"
    assert after.status_code == 503


def test_delivery_failure_kills_the_engine_cleanly(tiny_llama, monkeypatch):
    engine = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01))
    app = _app(engine)
    async_engine = app.state.async_engine

    def broken_deliver(out):
        raise RuntimeError("routing bug")

    monkeypatch.setattr(async_engine, "_deliver", broken_deliver)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
            # Four steps, each failing to deliver: never an early EOS (the request would
            # then end before the third failure, and nothing would answer it).
            return await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0,
                                                         "ignore_eos": True})

    try:
        r = asyncio.run(go())
    finally:
        async_engine.shutdown()
    assert r.status_code == 503 and async_engine.dead


def test_server_process_exits_nonzero_when_the_engine_dies(tiny_llama, tmp_path):
    from tests.server_process import free_port

    port = free_port()
    script = textwrap.dedent(f"""
        import sys, threading, time, httpx
        from macinfer.engine.llm_engine import LLMEngine
        def broken(self): raise RuntimeError("injected")
        LLMEngine.step = broken
        def client():
            for _ in range(200):
                try:
                    httpx.post("http://127.0.0.1:{port}/v1/completions", json={{"prompt": "hi"}}, timeout=30)
                    return
                except httpx.TransportError:
                    time.sleep(0.1)
        threading.Thread(target=client, daemon=True).start()
        from macinfer.cli.main import main
        main(["serve", {tiny_llama!r}, "--port", "{port}", "--kv-cache-gb", "0.01"])
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "engine stopped" in p.stdout


def test_one_llm_from_two_threads(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_gb=0.01)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    want = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    results, errors = {}, []

    def worker(i):
        try:
            for _ in range(3):
                results.setdefault(i, []).append([o.token_ids for o in llm.generate(prompts, GREEDY)])
        except Exception as e:  # pragma: no cover - the failure being tested for
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    streamed = [o.token_ids for o in llm.stream([5, 6, 7], GREEDY)][-1]  # and a third caller, streaming
    for t in threads:
        t.join()
    assert not errors
    assert all(r == want for rs in results.values() for r in rs)
    assert streamed == want[0]
    assert not llm.engine.has_unfinished_requests()


def test_interrupted_generate_leaves_nothing_running(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_gb=0.01)
    long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[5, 6, 7]] * 4, long)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([5, 6, 7], GREEDY)[0].finish_reason == "length"
    assert llm.engine.block_manager.num_used_blocks == 0
    assert "LLM(model=" in repr(llm) and "RequestOutput(" in repr(llm.generate([5], GREEDY)[0])
    assert [(g["kind"], g["blocks_used"]) for g in llm.cache_groups()] == [("full attention", 0)]


def test_kernel_self_check_falls_back_when_a_kernel_is_wrong(tiny_llama, monkeypatch, caplog):
    """CPU twin of the Mac start-up check: the emulated kernels pass; a broken one
    is caught and the engine runs the reference path with the same tokens."""
    from macinfer.kernels import paged_attention

    monkeypatch.setenv("MACINFER_KERNELS", "emulate")
    good = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01))
    assert good.backend.kernel_mode == "emulate" and good.paths.decode_attention == "emulate"
    want = generate(good, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))[0].token_ids
    real = paged_attention.decode_calls

    def wrong(q, *a, **k):
        calls = real(q * 2.0, *a, **k)  # a kernel that computes the wrong thing
        return calls

    monkeypatch.setattr(paged_attention, "decode_calls", wrong)
    with caplog.at_level("WARNING"):
        engine = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01))
    assert engine.backend.kernel_mode == "reference" and engine.paths.decode_attention == "reference"
    assert good.paths.decode_attention == "emulate"  # each engine keeps its own verdict
    assert "self-check" in caplog.text and "reference MLX path" in caplog.text
    assert generate(engine, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))[0].token_ids == want
