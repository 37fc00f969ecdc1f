"""Paths chosen by measurement at load (`kernels/autotune.py`, `engine/choices.py`), with
injected timings: the faster path wins, the verdict is cached and read back on the next
load, a path that cannot run (failed self-check, the CPU emulator) never wins, a forced
path wins over any timing, and measuring off takes the default."""

from __future__ import annotations

import logging

import pytest

from macinfer.kernels import autotune


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MACINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MACINFER_AUTOTUNE", raising=False)
    monkeypatch.delenv("MACINFER_FORCE_ATTENTION_OPS", raising=False)  # (conftest fixes it for the other tests)


def _timer(times):
    calls = []

    def timer(fn):
        name = fn()
        calls.append(name)
        return times[name]
    return timer, calls


def _paths(*names):
    return {n: (lambda n=n: n) for n in names}


def test_the_faster_path_wins_and_the_verdict_is_cached(caplog):
    timer, calls = _timer({"metal": 0.002, "reference": 0.005})
    with caplog.at_level(logging.INFO, logger="macinfer"):
        assert autotune.choose("decode_attention", {"d": 128}, _paths("metal", "reference"), "metal", timer) == "metal"
        # the next load: read back, nothing timed
        assert autotune.choose("decode_attention", {"d": 128}, _paths("metal", "reference"), "metal", timer) == "metal"
    assert calls == ["metal", "reference"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode_attention")]
    assert lines == ["decode_attention: metal (metal 2, reference 5 ms on this device)",
                     "decode_attention: metal (metal 2, reference 5 ms on this device, cached)"]
    # another shape is measured on its own; the slower kernel loses there
    timer2, _ = _timer({"metal": 0.009, "reference": 0.005})
    assert autotune.choose("decode_attention", {"d": 64}, _paths("metal", "reference"), "metal", timer2) == "reference"


def test_the_table_mac_check_prints_lists_this_devices_verdicts():
    timer, _ = _timer({"metal": 0.002, "reference": 0.005})
    autotune.choose("decode_attention", {"d": 128}, _paths("metal", "reference"), "metal", timer)
    timer, _ = _timer({"explicit": 0.010, "fused": 0.004})
    autotune.choose("attention_ops", {"d": 64}, _paths("explicit", "fused"), "explicit", timer)
    lines = autotune.table().splitlines()
    assert [line.split()[:2] for line in lines] == [["attention_ops", "fused"], ["decode_attention", "metal"]]
    assert "(explicit 10 ms, fused 4 ms)" in lines[0] and '"d": 64' in lines[0]
    assert "(metal 2 ms, reference 5 ms)" in lines[1]


def test_the_default_stays_unless_another_path_is_clearly_faster():
    timer, _ = _timer({"explicit": 0.0100, "fused": 0.0095})  # 5% faster: noise
    assert autotune.choose("attention_ops", {"d": 1}, _paths("explicit", "fused"), "explicit", timer) == "explicit"
    timer, _ = _timer({"explicit": 0.0100, "fused": 0.0080})  # 20% faster
    assert autotune.choose("attention_ops", {"d": 2}, _paths("explicit", "fused"), "explicit", timer) == "fused"


def test_a_path_that_cannot_run_never_wins():
    timer, calls = _timer({"metal": 0.0001, "reference": 5.0})
    paths = dict(_paths("reference"), metal=None)  # the kernel failed its self-check (or is emulated)
    assert autotune.choose("decode_attention", {"d": 128}, paths, "metal", timer) == "reference"
    assert calls == []  # one viable path: nothing to time


def test_a_forced_path_wins_over_timings(monkeypatch):
    timer, calls = _timer({"kernel": 0.001, "mlx": 0.002})
    monkeypatch.setenv("MACINFER_FORCE_QMV", "mlx")
    assert autotune.choose("qmv", {"rows": 8}, _paths("kernel", "mlx"), "mlx", timer) == "mlx"
    assert calls == []
    monkeypatch.setenv("MACINFER_FORCE_QMV", "fast")
    with pytest.raises(ValueError, match="expected one of kernel, mlx"):
        autotune.choose("qmv", {"rows": 8}, _paths("kernel", "mlx"), "mlx", timer)
    monkeypatch.setenv("MACINFER_FORCE_QMV", "kernel")
    with pytest.raises(ValueError, match="cannot run here"):
        autotune.choose("qmv", {"rows": 8}, dict(_paths("mlx"), kernel=None), "mlx", timer)


def test_measuring_off_takes_the_default(monkeypatch):
    timer, calls = _timer({"explicit": 0.005, "fused": 0.001})
    off = autotune.Tuning(on=False)  # an engine's --no-autotune
    assert autotune.choose("attention_ops", {"d": 64}, _paths("explicit", "fused"), "explicit", timer,
                           tuning=off) == "explicit"
    monkeypatch.setenv("MACINFER_AUTOTUNE", "0")
    assert autotune.choose("attention_ops", {"d": 64}, _paths("explicit", "fused"), "explicit", timer) == "explicit"
    assert calls == []


def test_the_engine_takes_the_measured_attention_ops(tmp_path, monkeypatch, tiny_llama):
    """At load: the attention-ops decision timed on the model's own shapes (fused made
    faster here by an injected timer) sets the runner's op forms; --no-autotune keeps the
    CPU default (explicit)."""
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine

    def fake(fn):
        import mlx.core as mx

        mx.eval(fn())  # the candidate runs (it must work on these shapes)
        return 0.001 if fn is fake.fused else 0.002

    original = autotune.choose

    def choose(decision, shape, candidates, default, timer=None, **kw):
        fake.fused = candidates.get("fused")
        return original(decision, shape, candidates, default, fake if decision == "attention_ops" else timer
                        or autotune.median_seconds, **kw)

    monkeypatch.setattr(autotune, "choose", choose)
    engine = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01))
    assert engine.runner.explicit_ops is False and engine.runner.prefill_tile is None
    assert LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01, autotune=False)).runner.explicit_ops is True


def test_the_split_k_partition_is_timed_on_metal_only(monkeypatch, tiny_llama):
    """On the CPU the default stands, untimed; where the kernel runs for real each size is
    timed (here: injected timings, the launches stubbed) and the fastest taken."""
    from macinfer.engine import choices
    from macinfer.loading.loader import load

    model = load(tiny_llama).model
    assert choices.choose_decode_partition(model, model.layer_specs, "reference") == 512
    assert "no verdicts" in autotune.table()
    monkeypatch.setattr(choices.paged_kernels, "supported", lambda *a: True)
    monkeypatch.setattr(choices, "launch", lambda calls: dict(calls[0].template)["PART"])
    real = autotune.choose
    for times, want in (({256: 4.0, 512: 3.0, 1024: 2.0}, 1024), ({256: 1.0, 512: 3.0, 1024: 2.0}, 256)):
        monkeypatch.setattr(choices.autotune, "choose",
                            lambda *a, times=times, **k: real(*a, **k, timer=lambda fn: times[fn()] * 1e-3))
        assert choices.choose_decode_partition(model, model.layer_specs, "metal") == want
        (autotune.cache_dir() / "autotune.json").unlink()


def test_the_chosen_partition_reaches_the_kernel(tmp_path, monkeypatch):
    """The partition decided at load is the one the engine's decode launches use: the
    emulated kernel split into 16-token partitions gives the reference path's tokens."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("the CPU emulator needs g++")
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.kernels import paged_attention as paged_kernels
    from macinfer.sampling_params import SamplingParams
    from tests.helpers import generate, tiny_model_dir

    path, _ = tiny_model_dir(tmp_path, "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    parts = []
    original = paged_kernels.decode_calls
    monkeypatch.setattr(paged_kernels, "decode_calls",
                        lambda *a, **kw: parts.append(kw.get("partition_size")) or original(*a, **kw))
    prompts, params = [list(range(10, 50)), list(range(60, 75))], SamplingParams(temperature=0, max_tokens=5,
                                                                                 ignore_eos=True)

    def run(mode, partition=None):
        monkeypatch.setenv("MACINFER_KERNELS", mode)
        engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01))
        if partition:
            engine.runner.decode_partition = partition
        parts.clear()
        return [o.token_ids for o in generate(engine, prompts, params)]

    want = run("reference")
    assert run("emulate", 16) == want and parts and set(parts) == {16}
