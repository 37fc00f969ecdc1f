"""Start-up self-check: each custom kernel against the reference MLX path on
small shapes, before any request runs. A kernel that fails or disagrees is
not used: the engine falls back to the reference path with a warning, so a
kernel that never ran on this chip cannot make a Mac silently wrong."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from macinfer.kernels import paged_attention as paged_kernels
from macinfer.kernels import quantized as quantized_kernels
from macinfer.kernels.call import launch

log = logging.getLogger("macinfer")

BLOCK = 16
TOLERANCE = 2e-3  # float32 inputs; a wrong kernel is off by O(1)


def _check_decode_attention(emulate: bool) -> float:
    from macinfer.kv.decode_attention import block_heads, decode_mask, reference_decode_attention

    rng = np.random.default_rng(0)
    kvh, gqa, d, lens = 2, 2, 64, [5, 37]
    blocks = sum(-(-n // BLOCK) for n in lens) + 1
    q = mx.array(rng.normal(size=(len(lens), kvh * gqa, d)).astype(np.float32))
    k = mx.array(rng.normal(size=(blocks, kvh, BLOCK, d)).astype(np.float32))
    v = mx.array(rng.normal(size=(blocks, kvh, BLOCK, d)).astype(np.float32))
    tables = mx.array(np.array([[3, 0, 0], [1, 4, 2]], dtype=np.int32))
    context = mx.array(np.array(lens, dtype=np.int32))
    scale = d**-0.5
    got = launch(paged_kernels.decode_calls(q, k, v, tables, context, scale, BLOCK, max(lens)), emulate=emulate)
    want = reference_decode_attention(q, k, v, block_heads(tables, kvh), decode_mask(context, 3 * BLOCK), scale)
    return float(mx.abs(got - want).max())


def _check_latent_decode_attention(emulate: bool) -> float:
    """The same kernel in its MLA form: one latent + rope "head", V its leading columns."""
    from macinfer.kv.decode_attention import block_heads, decode_mask, reference_decode_attention

    rng = np.random.default_rng(1)
    heads, latent, rope, lens = 8, 64, 32, [9, 40]
    k = mx.array(rng.normal(size=(6, 1, BLOCK, latent + rope)).astype(np.float32))
    q = mx.array(rng.normal(size=(len(lens), heads, latent + rope)).astype(np.float32))
    tables = mx.array(np.array([[5, 0, 0], [1, 4, 2]], dtype=np.int32))
    context = mx.array(np.array(lens, dtype=np.int32))
    got = launch(paged_kernels.decode_calls(q, k, k, tables, context, 0.1, BLOCK, max(lens), v_dim=latent),
                 emulate=emulate)
    want = reference_decode_attention(q, k, k, block_heads(tables, 1), decode_mask(context, 3 * BLOCK), 0.1)
    return float(mx.abs(got - want[..., :latent]).max())


def _check_quantized_decode_attention(emulate: bool, channels: bool = False) -> float:
    """The same kernel over 4-bit packed pools (a quantized KV cache), against the reference
    path's quantized matmuls over the same blocks; `channels`: keys stored per channel over
    blocks of 32 tokens (`int4c`)."""
    from macinfer.kv.decode_attention import block_heads, decode_mask, reference_decode_attention
    from macinfer.kv.cache import QuantizedBlocks

    rng = np.random.default_rng(2)
    kvh, gqa, d, lens, blocks = 2, 2, 64, [5, 37], 5
    bs = 32 if channels else BLOCK

    def packed(seed: int, by_channel: bool = False) -> QuantizedBlocks:
        rows, n = (blocks * kvh * d, bs) if by_channel else (blocks * kvh * bs, d)
        x = mx.array(np.random.default_rng(seed).normal(size=(rows, n)).astype(np.float32))
        w, s, b = mx.quantize(x, group_size=32, bits=4)
        return QuantizedBlocks(*(a.reshape(blocks * kvh, rows // (blocks * kvh), -1) for a in (w, s, b)), 32, 4, n,
                               channels=by_channel)

    k, v = packed(3, channels), packed(4)
    q = mx.array(rng.normal(size=(len(lens), kvh * gqa, d)).astype(np.float32))
    tables = mx.array(np.array([[3, 0, 0], [1, 4, 2]], dtype=np.int32))
    context = mx.array(np.array(lens, dtype=np.int32))
    got = launch(paged_kernels.quantized_decode_calls(q, k, v, kvh, tables, context, d**-0.5, bs, max(lens)),
                 emulate=emulate)
    want = reference_decode_attention(q, k, v, block_heads(tables, kvh), decode_mask(context, 3 * bs), d**-0.5)
    return float(mx.abs(got - want).max())


def _check_qmv(emulate: bool) -> float:
    mx.random.seed(0)
    gate, up = nn.QuantizedLinear(128, 64, bias=False, bits=4), nn.QuantizedLinear(128, 64, bias=False, bits=4)
    x = mx.random.normal((3, 128))
    got = launch([quantized_kernels.qmv_call(x, gate, up)], emulate=emulate)
    return float(mx.abs(got - nn.silu(gate(x)) * up(x)).max())


def self_check(backend: str) -> str:
    """The backend to use: `backend` if every kernel it would run agrees with the
    reference, else "reference"."""
    if backend == "reference":
        return backend
    emulate = backend == "emulate"
    checks = {"paged decode attention": _check_decode_attention,
              "paged latent (MLA) decode attention": _check_latent_decode_attention,
              "paged decode attention over quantized KV": _check_quantized_decode_attention,
              "paged decode attention over keys stored per channel":
                  lambda emulate: _check_quantized_decode_attention(emulate, channels=True)}
    if quantized_kernels.enabled() or backend == "metal":  # on Metal, a candidate for the load-time timing
        checks["batched quantized matmul"] = _check_qmv
    for name, check in checks.items():
        try:
            err = check(emulate)
        except Exception as e:  # a kernel that does not compile or launch on this machine
            log.warning("kernel self-check: %s failed (%s: %s); using the reference MLX path",
                        name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return "reference"
        if not err <= TOLERANCE:
            log.warning("kernel self-check: %s differs from the reference by %.3g; using the reference MLX path",
                        name, err)
            return "reference"
    log.info("kernel self-check passed (%s): %s", backend, ", ".join(checks))
    return backend
