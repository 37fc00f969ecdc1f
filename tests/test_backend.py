"""One `Backend` per engine (`kernels/backend.py`): memory from the device MLX runs on, the
autotune key naming that device, and paths chosen at load that belong to their engine."""

from __future__ import annotations

import mlx.core as mx
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.kernels import backend as backend_module
from macinfer.kernels import paged_attention
from macinfer.kernels.backend import Backend
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate, tiny_model_dir

H100 = {"device_name": "NVIDIA H100 80GB HBM3", "architecture": "sm_90", "total_memory": 80 * 2**30}


def _fake_gpu(monkeypatch, free: int) -> None:
    monkeypatch.setattr(backend_module, "_kind", lambda: "cuda")
    monkeypatch.setattr(mx, "device_info", lambda *a: dict(H100, free_memory=free))


def test_a_gpu_backend_sizes_memory_by_the_gpu(monkeypatch):
    _fake_gpu(monkeypatch, 70 * 2**30)
    b = Backend.detect()
    assert b.kind == "cuda" and b.name == "NVIDIA H100 80GB HBM3"
    assert b.available_memory() == 70 * 2**30  # not the host's RAM
    assert "NVIDIA H100 80GB HBM3" in b.tuning.device  # verdicts are kept per GPU
    cpu = Backend("cpu", {"device_name": "Some CPU"})
    assert "Some CPU" in cpu.tuning.device and cpu.tuning.device != b.tuning.device


def test_the_kv_budget_follows_gpu_memory(monkeypatch, tiny_llama):
    """With a faked CUDA device: --kv-cache-gb is checked against GPU memory (refused beyond
    it, though the host has more), and the default budget is a share of free GPU memory."""
    probe = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01))
    weights = probe.memory_bytes() - probe.kv_cache.nbytes
    _fake_gpu(monkeypatch, weights + 8 * 2**20)
    with pytest.raises(ValueError, match="more memory than this cuda device can give"):
        LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=1))  # (the host has more than 1 GiB free)
    config = EngineConfig(max_num_seqs=64, max_model_len=2048)
    small = LLMEngine(tiny_llama, config)
    assert small.backend.kind == "cuda" and small.kv_cache.nbytes <= config.kv_cache_fraction * 8 * 2**20
    _fake_gpu(monkeypatch, 64 * 2**30)
    assert LLMEngine(tiny_llama, config).kv_cache.nbytes > 2 * small.kv_cache.nbytes


def test_two_engines_keep_their_own_paths(monkeypatch, tmp_path):
    """Two models loaded in one process with different verdicts (the emulated decode kernel
    for the first, MLX's ops for the second; prompt attention forced explicit for one and
    fused for the other): stepped in turn, each engine's forward takes its own paths."""
    path, _ = tiny_model_dir(tmp_path, "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    launches: list[int] = []
    real = paged_attention.decode_calls
    monkeypatch.setattr(paged_attention, "decode_calls", lambda *a, **k: launches.append(1) or real(*a, **k))
    monkeypatch.setenv("MACINFER_KERNELS", "emulate")
    monkeypatch.setenv("MACINFER_FORCE_ATTENTION_OPS", "explicit")
    first = LLMEngine(path, EngineConfig(kv_cache_gb=0.01))
    monkeypatch.setenv("MACINFER_KERNELS", "reference")
    monkeypatch.setenv("MACINFER_FORCE_ATTENTION_OPS", "fused")
    second = LLMEngine(path, EngineConfig(kv_cache_gb=0.01))
    assert (first.paths.decode_attention, first.paths.explicit_ops) == ("emulate", True)
    assert (second.paths.decode_attention, second.paths.explicit_ops) == ("reference", False)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for engine, kernel in ((first, True), (second, False), (first, True)):
        launches.clear()
        out = generate(engine, [[5, 6, 7, 8]], params)[0]
        assert bool(launches) == kernel, engine.paths
        assert len(out.token_ids) == 4
    assert first.backend is not second.backend and first.backend.paths is first.paths
