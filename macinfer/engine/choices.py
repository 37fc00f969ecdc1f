"""The decisions with more than one correct path, taken at load by timing them on the
model's own shapes (`autotune.choose`), after the kernels' self-check:

- `decode_attention`: the paged decode Metal kernel, or MLX's ops (`kv/decode_attention.py`'s
  reference path). Only where the kernel runs for real (Metal, self-check passed): the CPU
  emulator is a correctness tool and is never timed.
- `qmv`: the batched quantized-matmul Metal kernel for the MLP of quantized Llama-family
  models, or `mx.quantized_matmul` (Metal only, as above).
- `attention_ops`: prompt attention written out in explicit ops (exp2 softmax, query tiles)
  or MLX's fused SDPA: the first is cheaper where SDPA is not a fused kernel (MLX's CPU),
  the second where it is; timed on every device.
- `decode_partition`: the decode kernel's split-K partition (256, 512 or 1024 tokens), timed
  on an 8 x 8k-token batch (Metal only, as above).

Each is logged in one line and cached per device, MLX version and shape. `--no-autotune`
(`MACINFER_AUTOTUNE=0`) takes the defaults (the kernels where they passed the self-check;
explicit ops on the CPU), and `MACINFER_FORCE_DECODE_ATTENTION=metal|reference`,
`MACINFER_FORCE_QMV=kernel|mlx`, `MACINFER_FORCE_ATTENTION_OPS=explicit|fused`,
`MACINFER_FORCE_DECODE_PARTITION=256|512|1024` force a path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from macinfer.kernels import autotune
from macinfer.kernels import paged_attention as paged_kernels
from macinfer.kernels import quantized as quantized_kernels
from macinfer.kernels.call import launch

# Query tile for causal prompt attention in explicit ops. Measured: a 1,024-token prompt
# 8.1 -> 5.4 s (256: 6.4 s, 64: 5.2 s).
PREFILL_TILE = 128
# Shapes the paths are timed at: a decode batch and a prompt chunk of moderate size.
DECODE_BATCH, DECODE_CONTEXT, BLOCK = 8, 1024, 16
CHUNK, CHUNK_CONTEXT = 256, 512


def attention_shape(model: Any, layer_specs: list) -> tuple[int, int, int, int, Any] | None:
    """(query heads, K/V heads, K head dim, V head dim, dtype) of the model's first K/V cache."""
    if not layer_specs:
        return None
    spec = layer_specs[0]
    heads = getattr(model, "query_heads", {}).get(0) or getattr(getattr(model, "args", None), "num_attention_heads",
                                                                   None)
    if not heads:
        return None
    return heads, spec.num_kv_heads, spec.head_dim, spec.v_head_dim, model.kv_dtype()


def _decode_case(h: int, kvh: int, d: int, dv: int, dtype: Any, context: int = DECODE_CONTEXT) -> tuple:
    """A decode batch's queries, scattered K/V blocks, tables and lengths at `context`."""
    rng = np.random.default_rng(0)
    blocks = DECODE_BATCH * context // BLOCK
    q = mx.array(rng.normal(size=(DECODE_BATCH, h, d)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.normal(size=(blocks, kvh, BLOCK, d)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.normal(size=(blocks, kvh, BLOCK, dv)).astype(np.float32)).astype(dtype)
    tables = mx.array(rng.permutation(blocks).reshape(DECODE_BATCH, -1).astype(np.int32))
    lens = mx.full((DECODE_BATCH,), context, dtype=mx.int32)
    mx.eval(q, k, v, tables)
    return q, k, v, tables, lens


def choose_decode_attention(model: Any, layer_specs: list, mode: str, tuning: autotune.Tuning = autotune.Tuning()
                            ) -> str:
    """'metal' or 'reference' where the self-checked kernel `mode` is 'metal'; else `mode`."""
    shape = attention_shape(model, layer_specs)
    if mode != "metal" or shape is None:
        return mode
    from macinfer.kv.decode_attention import block_heads, decode_mask, reference_decode_attention

    h, kvh, d, dv, dtype = shape
    if not paged_kernels.supported(d, h // kvh, dv):
        return mode
    q, k, v, tables, lens = _decode_case(h, kvh, d, dv, dtype)
    heads, mask, scale = block_heads(tables, kvh), decode_mask(lens, DECODE_CONTEXT), d ** -0.5
    candidates = {
        "metal": lambda: launch(paged_kernels.decode_calls(q, k, v, tables, lens, scale, BLOCK, DECODE_CONTEXT)),
        "reference": lambda: reference_decode_attention(q, k, v, heads, mask, scale),
    }
    return autotune.choose("decode_attention", dict(heads=h, kv_heads=kvh, d=d, dv=dv, dtype=str(dtype),
                                                    batch=DECODE_BATCH, context=DECODE_CONTEXT),
                           candidates, default="metal", tuning=tuning)


PARTITIONS = (256, 512, 1024)  # split-K partition sizes timed, in tokens
PARTITION_CONTEXT = 8192  # long enough that each size splits it


def choose_decode_partition(model: Any, layer_specs: list, mode: str,
                            tuning: autotune.Tuning = autotune.Tuning()) -> int:
    """The decode kernel's split-K partition: each size timed on a long context (Metal
    only: elsewhere the kernel does not run for real, and the default stands)."""
    shape = attention_shape(model, layer_specs)
    if mode != "metal" or shape is None:
        return paged_kernels.PARTITION_SIZE
    h, kvh, d, dv, dtype = shape
    if not paged_kernels.supported(d, h // kvh, dv):
        return paged_kernels.PARTITION_SIZE
    q, k, v, tables, lens = _decode_case(h, kvh, d, dv, dtype, PARTITION_CONTEXT)
    candidates = {str(p): (lambda p=p: launch(paged_kernels.decode_calls(
        q, k, v, tables, lens, d ** -0.5, BLOCK, PARTITION_CONTEXT, partition_size=p))) for p in PARTITIONS}
    shape_key = dict(heads=h, kv_heads=kvh, d=d, dv=dv, dtype=str(dtype), batch=DECODE_BATCH, context=PARTITION_CONTEXT)
    return int(autotune.choose("decode_partition", shape_key, candidates, default=str(paged_kernels.PARTITION_SIZE),
                               tuning=tuning))


def choose_qmv(model: Any, mode: str, tuning: autotune.Tuning = autotune.Tuning()) -> bool:
    """Whether quantized MLPs use the batched qmv kernel (False: `mx.quantized_matmul`)."""
    if mode != "metal":
        return False
    mlp = next((m for _, m in model.named_modules() if isinstance(getattr(m, "gate_proj", None), nn.QuantizedLinear)
                and isinstance(getattr(m, "up_proj", None), nn.QuantizedLinear)), None)
    if mlp is None or not quantized_kernels.supported(mlp.gate_proj, DECODE_BATCH):
        return False
    x = mx.random.normal((DECODE_BATCH, mlp.gate_proj.weight.shape[1] * 32 // mlp.gate_proj.bits))
    x = x.astype(mlp.gate_proj.scales.dtype)
    candidates = {
        "kernel": lambda: launch([quantized_kernels.qmv_call(x, mlp.gate_proj, mlp.up_proj)]),
        "mlx": lambda: nn.silu(mlp.gate_proj(x)) * mlp.up_proj(x),
    }
    shape = dict(rows=DECODE_BATCH, w=list(mlp.gate_proj.weight.shape), bits=mlp.gate_proj.bits,
                 group=mlp.gate_proj.group_size)
    return autotune.choose("qmv", shape, candidates, default="mlx", tuning=tuning) == "kernel"


def choose_attention_ops(model: Any, layer_specs: list, tuning: autotune.Tuning = autotune.Tuning()) -> bool:
    """Whether prompt attention is written out in explicit ops (True) or MLX's fused SDPA."""
    from macinfer.kv.dense import dense_attention

    cpu = mx.default_device() == mx.cpu
    shape = attention_shape(model, layer_specs)
    if shape is None:
        return cpu
    h, kvh, d, dv, dtype = shape
    rng = np.random.default_rng(1)
    q = mx.array(rng.normal(size=(1, h, CHUNK, d)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.normal(size=(1, kvh, CHUNK_CONTEXT, d)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.normal(size=(1, kvh, CHUNK_CONTEXT, dv)).astype(np.float32)).astype(dtype)
    mx.eval(q, k, v)
    candidates = {
        "explicit": lambda: dense_attention(q, k, v, d ** -0.5, "causal", True, PREFILL_TILE),
        "fused": lambda: dense_attention(q, k, v, d ** -0.5, "causal", False, None),
    }
    shape_key = dict(heads=h, kv_heads=kvh, d=d, dv=dv, dtype=str(dtype), chunk=CHUNK, context=CHUNK_CONTEXT)
    return autotune.choose("attention_ops", shape_key, candidates, default="explicit" if cpu else "fused",
                           tuning=tuning) == "explicit"


@dataclass(frozen=True)
class Paths:
    """Every path decided at load, carried from there (the runner's metadata reads them)."""
    decode_attention: str  # "metal" | "reference" | "emulate" (the backend's self-checked mode, or timed)
    qmv_kernel: bool
    explicit_ops: bool  # prompt attention (and RoPE tables) written out in explicit ops
    prefill_tile: int | None  # query tile of explicit causal prompt attention
    mla_expand_from: int | None  # MLA prompt chunks this long take the expanded form
    decode_partition: int = paged_kernels.PARTITION_SIZE  # the decode kernel's split-K partition (tokens)

    def describe(self) -> dict[str, Any]:
        return {"decode_attention": self.decode_attention, "qmv_kernel": self.qmv_kernel,
                "attention_ops": "explicit" if self.explicit_ops else "fused",
                "mla_prompt_expanded_from": self.mla_expand_from, "decode_partition": self.decode_partition}


def choose_paths(model: Any, layer_specs: list, kv_dtype: Any, backend: Any) -> Paths:
    """Each decision in turn, on `backend` (a `Backend`: its self-checked kernel mode, its
    measuring); the paths are the backend's from here on."""
    from macinfer.kv.mla import choose_expand_from

    tuning, mode = backend.tuning, backend.kernel_mode
    decode = choose_decode_attention(model, layer_specs, mode, tuning)
    explicit = choose_attention_ops(model, layer_specs, tuning)
    tile = PREFILL_TILE if explicit else None
    # The emulated qmv kernel runs where it is asked for (MACINFER_QMV_KERNEL=1): a correctness check.
    qmv = choose_qmv(model, decode, tuning) or (decode == "emulate" and quantized_kernels.enabled())
    backend.paths = Paths(decode, qmv, explicit, tile,
                          choose_expand_from(model, kv_dtype, explicit, tile, tuning),
                          choose_decode_partition(model, layer_specs, decode, tuning))
    return backend.paths
