"""mlx-lm's fused Metal kernels (Muse Spark's) and their portable forms
(`macinfer/models/portable_kernels.py`): each mlx-lm wrapper's launch is captured and its
kernel source run in the project's emulator; the portable function gives the same values
(float16 and float32, so the roundings are where the kernel puts them)."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from macinfer.kernels.call import KernelCall
from macinfer.models import portable_kernels as pk

# kernel module -> (the kernel object's name, its input names, its output names)
KERNELS = {
    "qk_norm": ("_qk_norm_kernel", ["qkvg", "scale", "eps"], ["q", "k"]),
    "qk_norm_rope": ("_qk_norm_rope_kernel", ["qkvg", "scale", "eps", "offset", "seq_len", "log2_base"], ["q", "k"]),
    "rms_norm_sigmoid_gate": ("_norm_gate_kernel", ["x", "g", "eps"], ["out"]),
    "expert_routing": ("_routing_kernel", ["logits", "bias", "multiplier", "eps", "scale"], ["inds", "weights"]),
    "post_expert_norm_combine": ("_expert_combine_kernel", ["experts", "weights", "norm_w", "eps"], ["out"]),
}
NORM_ADD = ["branch", "stream", "alpha", "beta", "post_w", "post_eps"]


def _emulated(module: str, kernel: str, ins: list[str], outs: list[str], call) -> list[np.ndarray]:
    """Run mlx-lm's wrapper `call()`, its kernel launch captured and emulated."""
    from macinfer.kernels.emulator import emulate

    mod = importlib.import_module(f"mlx_lm.kernels.{module}")
    real, launches = getattr(mod, kernel), []

    def record(**kw):
        launches.append(kw)
        return [mx.zeros(s, dtype=d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    setattr(mod, kernel, record)
    try:
        call()
    finally:
        setattr(mod, kernel, real)
    kw, = launches
    launch = KernelCall(real, kw["inputs"], kw["template"], kw["grid"], kw["threadgroup"], kw["output_shapes"],
                        kw["output_dtypes"], ins, outs)
    return emulate(launch).outputs


def _close(got, want, dtype) -> None:
    tol = 2e-3 if dtype == mx.float16 else 2e-5
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g.astype(mx.float32)), np.asarray(w, dtype=np.float32), atol=tol, rtol=tol)


RNG = np.random.default_rng(0)


def _rand(*shape, dtype=mx.float32) -> mx.array:
    return mx.array(RNG.standard_normal(shape).astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_qk_norm_and_rope(dtype):
    from mlx_lm import kernels

    hq, hk, d = 4, 2, 16
    qkvg = _rand(2, 3, 2 * (hq + hk) * d, dtype=dtype)
    args = dict(n_heads=hq, n_kv_heads=hk, head_dim=d, eps=1e-5, query_scale=0.25)
    want = _emulated("qk_norm", *KERNELS["qk_norm"], lambda: kernels.qk_norm(qkvg, **args))
    _close(pk.qk_norm(qkvg, **args), want, dtype)
    for offset in (5, mx.array([3, 11], dtype=mx.int32)):
        rope = dict(args, rope_base=10000.0, offset=offset)
        want = _emulated("qk_norm_rope", *KERNELS["qk_norm_rope"], lambda: kernels.qk_norm_rope(qkvg, **rope))
        _close(pk.qk_norm_rope(qkvg, **rope), want, dtype)


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_rms_norm_sigmoid_gate(dtype):
    from mlx_lm import kernels

    x, gate = _rand(2, 4, 3, 16, dtype=dtype), _rand(2, 3, 64, dtype=dtype)
    want = _emulated("rms_norm_sigmoid_gate", *KERNELS["rms_norm_sigmoid_gate"],
                     lambda: kernels.rms_norm_sigmoid_gate(x, gate, eps=1e-6))
    _close([pk.rms_norm_sigmoid_gate(x, gate, eps=1e-6)], want, dtype)


def test_expert_routing():
    from mlx_lm import kernels

    logits, bias = _rand(5, 40), _rand(40) * 0.1
    args = dict(top_k=4, multiplier=1.5, score_eps=1e-20, route_scale=2.5)
    inds, weights = _emulated("expert_routing", *KERNELS["expert_routing"],
                              lambda: kernels.expert_routing(logits, bias, **args))
    got_inds, got_weights = pk.expert_routing(logits, bias, **args)
    np.testing.assert_array_equal(np.array(got_inds), inds)
    np.testing.assert_allclose(np.array(got_weights), weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_post_expert_norm_combine(dtype):
    from mlx_lm import kernels

    experts, weights, w = _rand(3, 4, 64, dtype=dtype), _rand(3, 4, dtype=dtype), _rand(64) * 0.5 + 1
    want = _emulated("post_expert_norm_combine", *KERNELS["post_expert_norm_combine"],
                     lambda: kernels.post_expert_norm_combine(experts, weights, norm_weight=w, eps=1e-6))
    _close([pk.post_expert_norm_combine(experts, weights, norm_weight=w, eps=1e-6)], want, dtype)


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
@pytest.mark.parametrize("post_scale", [True, False])
def test_norm_add_norm_and_pre_norm(dtype, post_scale):
    from mlx_lm import kernels

    D = 256  # threadgroups of more than one SIMD group: the block sums
    branch, stream = _rand(3, D, dtype=dtype), _rand(3, D)
    alpha, beta = _rand(D) * 0.1 + 1, _rand(D) * 0.1 + 1
    post_w = (_rand(D) * 0.1 + 1) if post_scale else None
    norm = nn.RMSNorm(D, eps=1e-5)
    norm.weight = _rand(D) * 0.1 + 1
    args = dict(alpha=alpha, beta=beta, post_weight=post_w, post_eps=1e-6)
    for next_norm, kernel, outs in ((norm, "_norm_add_norm_kernel", ["new_stream", "normed"]),
                                   (None, "_norm_add_kernel", ["new_stream"])):
        ins = NORM_ADD + (["pre_w", "pre_eps"] if next_norm is not None else [])
        want = _emulated("norm_add_norm", kernel, ins, outs,
                         lambda: kernels.norm_add_norm(branch, stream, next_norm=next_norm, **args))
        got = pk.norm_add_norm(branch, stream, next_norm=next_norm, **args)
        _close([g for g in got if g is not None], want, dtype)
    want = _emulated("norm_add_norm", "_pre_norm_kernel", ["stream", "pre_w", "pre_eps"], ["normed"],
                     lambda: kernels.pre_norm(stream, norm, dtype=dtype))
    _close([pk.pre_norm(stream, norm, dtype=dtype)], want, dtype)
