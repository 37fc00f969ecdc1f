"""The Python API on a tiny model: batching, streaming, stops, errors."""

import _thread
import gc
import os
import signal
import sys
import threading
import time

import pytest

from macinfer import LLM, SamplingParams
from macinfer.engine.llm_engine import PromptTooLongError


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, kv_cache_gb=0.01, max_model_len=256, block_size=8)


def test_generate_many_prompts_in_order(llm):
    prompts = ["hello", "a much longer prompt than the first one", "x"]
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    batched = llm.generate(prompts, params)
    single = [llm.generate(p, params)[0] for p in prompts]
    assert [o.token_ids for o in batched] == [o.token_ids for o in single]
    assert all(len(o.token_ids) == 7 and o.finish_reason == "length" for o in batched)
    assert batched[1].prompt_token_ids == llm.tokenizer.encode(prompts[1])


def test_stream_deltas_add_up_to_the_text(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    chunks = list(llm.stream("stream me", params))
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert "".join(c.delta_text for c in chunks) == chunks[-1].text
    assert sum(len(c.delta_token_ids) for c in chunks) == 12
    assert chunks[-1].text == llm.generate("stream me", params)[0].text


def test_stop_strings_and_stop_token_ids(llm):
    base = llm.generate("abc", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert len(base.text) > 6
    stop = base.text[3:5]
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == base.text[: base.text.index(stop)]
    streamed = list(llm.stream("abc", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])))
    assert "".join(c.delta_text for c in streamed) == out.text  # stop text never leaks into the stream
    tok = base.token_ids[4]
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[tok]))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: base.token_ids.index(tok) + 1]


def test_logprobs_in_outputs(llm):
    out = llm.generate("lp", SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True))[0]
    assert len(out.logprobs) == 3
    for lp, tok in zip(out.logprobs, out.token_ids):
        assert lp.token_id == tok and lp.top[0][0] == tok and len(lp.top) == 2 and lp.logprob <= 0


def test_chat_applies_the_template(llm):
    msgs = [{"role": "user", "content": "hi"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert out.prompt_token_ids == llm.tokenizer.encode("<user>hi<assistant>")
    assert len(llm.chat([msgs, msgs], SamplingParams(temperature=0, max_tokens=2))) == 2


def test_generation_stops_at_the_context_length(llm):
    out = llm.generate(list(range(5, 250)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 256 - 245


def test_bad_input_is_a_clear_error(llm):
    with pytest.raises(PromptTooLongError, match="300 tokens; this engine's context is 256"):
        llm.generate([[5] * 300], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams())
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate([[1, 99999]], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("x", SamplingParams(temperature=-0.5))
    # A failed batch leaves nothing behind in the engine.
    assert not llm.engine.has_unfinished_requests()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_a_script_that_closes_its_llm_exits_cleanly(smollm2_gguf, tmp_path):
    """`llm.close()` (or a `with` block) as a script's last step, then exit: code 0. Before,
    every such run aborted ("terminate called without an active exception", 134): `join`
    returned before the engine thread's MLX thread-locals were gone, and the exit raced them."""
    import subprocess

    script = tmp_path / "s.py"
    script.write_text("from macinfer import LLM, SamplingParams\n"
                      f"with LLM({smollm2_gguf!r}, kv_cache_gb=0.05, max_model_len=256) as llm:\n"
                      "    llm.generate('hi', SamplingParams(max_tokens=2))\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "terminate" not in r.stderr, (r.returncode, r.stderr[-500:])


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_dropped_llms_free_their_engines_and_threads(smollm2_gguf):
    """A notebook re-running `llm = LLM(...)`: each dropped LLM gives back its
    engine (~900 MB of float32 weights and KV here) and its thread."""
    def one():
        llm = LLM(smollm2_gguf, kv_cache_gb=0.05, max_model_len=256)
        llm.generate("hi", SamplingParams(max_tokens=2))
        return llm

    llm = one()
    with_one, threads = _rss_mb(), threading.active_count()
    del llm
    for _ in range(5):
        llm = one()
        del llm
        gc.collect()
    time.sleep(0.5)
    assert _rss_mb() < 1.1 * with_one
    assert threading.active_count() <= threads - 1  # the last one's worker is gone too
    with LLM(smollm2_gguf, kv_cache_gb=0.05, max_model_len=256) as llm:
        assert llm.generate("hi", SamplingParams(max_tokens=2))[0].finish_reason == "length"
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("hi")


def test_a_stream_collected_on_the_worker_thread_does_not_deadlock(llm):
    it = llm.stream("hello there", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    next(it)
    holder = {"it": it}
    holder["self"] = holder  # a cycle: only the cyclic GC frees it
    del it, holder
    llm._call(gc.collect)  # the half-read stream's `finally` runs on the worker itself
    out = llm.generate("after", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert llm._call(lambda: llm.engine.num_running + llm.engine.num_waiting) == 0


@pytest.mark.parametrize("during", ["_add", "_pump"])
def test_ctrl_c_in_generate_aborts_its_requests(llm, during):
    """Ctrl-C while the requests are being added (the worker still adds them after the
    caller has gone) or while a step runs: nothing keeps decoding afterwards."""
    real = getattr(llm, during)
    # Python's own Ctrl-C handler, even where this process was started with SIGINT ignored
    # (a background job of a shell without job control): interrupt_main() goes through it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def interrupted(*args):  # Ctrl-C arrives while the caller waits on this call
        out = real(*args)
        _thread.interrupt_main()
        return out

    setattr(llm, during, interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["a long one"] * 4, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    finally:
        delattr(llm, during)
        signal.signal(signal.SIGINT, previous)
    start = time.time()
    assert llm._call(lambda: llm.engine.num_running + llm.engine.num_waiting) == 0
    assert time.time() - start < 1.0
    out = llm.generate("next", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS preloading is a Linux matter")
def test_the_python_api_loads_openblas_as_the_cli_does():
    """`import macinfer` in a plain Python (no LD_PRELOAD) binds MLX to OpenBLAS; MLX
    imported first gets one line saying how to get it."""
    import glob
    import subprocess

    if not glob.glob("/usr/lib/*/openblas-pthread/libopenblas.so.0"):
        pytest.skip("OpenBLAS is not installed here")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MACINFER_PRELOADED")}
    probe = "import macinfer; print('libopenblas' in open('/proc/self/maps').read())"
    first = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert first.stdout.strip() == "True" and "macinfer:" not in first.stderr, first.stderr
    late = subprocess.run([sys.executable, "-c", "import mlx.core; " + probe], env=env, capture_output=True,
                          text=True, timeout=120)
    assert late.stdout.strip() == "False"
    lines = [ln for ln in late.stderr.splitlines() if ln.startswith("macinfer:")]
    assert len(lines) == 1 and "LD_PRELOAD=" in lines[0]
