"""Paths chosen by measurement at load (`kernels/autotune.py`, `kernels/choices.py`), with
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
    autotune.configure(None)


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
    autotune.configure(False)  # --no-autotune
    assert autotune.choose("attention_ops", {"d": 64}, _paths("explicit", "fused"), "explicit", timer) == "explicit"
    autotune.configure(None)
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

    def choose(decision, shape, candidates, default, timer=None):
        fake.fused = candidates.get("fused")
        return original(decision, shape, candidates, default, fake if decision == "attention_ops" else timer
                        or autotune.median_seconds)

    monkeypatch.setattr(autotune, "choose", choose)
    engine = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01))
    assert engine.runner.explicit_ops is False and engine.runner.prefill_tile is None
    assert LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01, autotune=False)).runner.explicit_ops is True
