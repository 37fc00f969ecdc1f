"""The batched decode quantized matmul / fused SwiGLU kernel, emulated on the CPU."""

import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from macinfer.kernels.emulator import emulate
from macinfer.kernels.quantized import qmv_call, supported

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the CPU emulator needs g++")


def _layer(K, N, bits, gs, seed):
    mx.random.seed(seed)
    layer = nn.QuantizedLinear.from_linear(nn.Linear(K, N, bias=False), gs, bits)
    mx.eval(layer.parameters())
    return layer


def _dense(layer) -> np.ndarray:
    w = mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
    return np.array(w).astype(np.float64)


@pytest.mark.parametrize("M,K,N,bits,gs", [
    (1, 256, 16, 4, 32), (2, 576, 24, 4, 32), (5, 512, 32, 8, 64), (8, 768, 16, 4, 64),
    (13, 320, 8, 8, 32), (32, 256, 16, 4, 64),
])
@pytest.mark.parametrize("fused", [False, True])
def test_qmv_matches_float64(M, K, N, bits, gs, fused):
    gate, up = _layer(K, N, bits, gs, 0), _layer(K, N, bits, gs, 1)
    assert supported(gate, M)
    x = mx.random.normal((M, K))
    y = emulate(qmv_call(x, gate, up if fused else None)).outputs[0]
    xn = np.array(x).astype(np.float64)
    ref = xn @ _dense(gate).T
    if fused:
        ref = ref / (1 + np.exp(-ref)) * (xn @ _dense(up).T)
    assert not np.isnan(y).any()
    np.testing.assert_allclose(y, ref, atol=1e-4, rtol=1e-4)


def test_qmv_float16_and_address_sanitizer():
    gate = _layer(512, 16, 4, 64, 0)
    gate.scales, gate.biases = gate.scales.astype(mx.float16), gate.biases.astype(mx.float16)
    x = mx.random.normal((3, 512)).astype(mx.float16)
    res = emulate(qmv_call(x, gate), sanitize="address")
    assert "AddressSanitizer" not in res.stderr and res.outputs[0].dtype == np.float16
    ref = np.array(x).astype(np.float64) @ _dense(gate).T
    np.testing.assert_allclose(res.outputs[0].astype(np.float64), ref, atol=0.05, rtol=5e-3)


def test_engine_with_emulated_qmv_equals_reference(tmp_path, monkeypatch):
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine
    from macinfer.sampling_params import SamplingParams
    from tests.helpers import tiny_model_dir

    path, _ = tiny_model_dir(tmp_path, "llama", quantize={"group_size": 32, "bits": 4}, hidden_size=128,
                             num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
    monkeypatch.setenv("MACINFER_CPU_WEIGHTS", "quantized")
    monkeypatch.setenv("MACINFER_QMV_KERNEL", "1")
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=5, ignore_eos=True)

    def run(mode):
        monkeypatch.setenv("MACINFER_KERNELS", mode)
        engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01))
        assert isinstance(engine.model.layers[0].mlp.gate_proj, nn.QuantizedLinear)
        ids = [engine.add_request(p, params) for p in ([5, 6, 7], [9, 10, 11, 12, 13])]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return [done[i] for i in ids]

    ref, emu = run("reference"), run("emulate")
    assert [o.token_ids for o in emu] == [o.token_ids for o in ref]
