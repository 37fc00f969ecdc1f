"""Each rank's part of the model: tensor parallel by mlx-lm's `shard()`, pipeline by layers.

Tensor parallel: the model's own `shard(group)` (mlx-lm writes one per family: attention
heads and MLP columns split, one all-reduce after each), then the probe runs again, so
each rank's KV pools hold its own heads. Pipeline: rank r keeps a contiguous range of
decoder layers and drops the others' weights; as in mlx-lm, rank 0 runs the last layers
(so the logits are where the sampler is) and the highest rank the first, but the ranges
are balanced by weights read, the head counted on rank 0 (`pipeline_ranges`). The hidden
state goes from each stage to the next with `send` / `recv_like` inside the forward pass,
so one step is one pass through every rank in turn; two steps in flight keep the stages
busy at once (`engine.multi_rank.pipelined_step`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from macinfer.distributed.group import DistContext
from macinfer.models.paged_layers import UnsupportedModelError


def _plain_attributes(layer: nn.Module) -> dict[str, Any]:
    """A layer's flags the model's loop reads (`use_sliding`, `is_moe`...): no modules, no arrays."""
    return {k: v for k, v in vars(layer).items() if not k.startswith("_") and isinstance(v, (bool, int, float, str))}


class _Skipped(nn.Module):
    """A layer another rank runs: the hidden state passes through (its weights are gone);
    its flags stay, for the model's loop that reads them."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        for k, v in _plain_attributes(layer).items():
            object.__setattr__(self, k, v)
        for k in layer:  # entries of the module's dict the loop may read (flags stored there)
            if isinstance(layer[k], (bool, int, float, str)):
                object.__setattr__(self, k, layer[k])

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        return x


class _Stage(nn.Module):
    """The first / last layer of this rank's range: the hidden state comes from the
    previous stage and goes to the next one."""

    def __init__(self, layer: nn.Module, group: Any, recv_from: int | None, send_to: int | None):
        super().__init__()
        self.layer = layer
        object.__setattr__(self, "_route", (group, recv_from, send_to))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # the wrapped layer's flags and submodules, for the model's loop
            if name != "layer" and "layer" in self:
                return getattr(self["layer"], name)
            raise

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        group, recv_from, send_to = self._route
        # Transfers in call order: a step's micro-batches are one graph, and two of the same
        # shape could otherwise be sent (or received) in either order.
        last = getattr(self, "_last", None)
        if last is not None:
            x = mx.depends(x, last)
        if recv_from is not None:
            x = mx.distributed.recv_like(x, recv_from, group=group)
            object.__setattr__(self, "_last", x)
        out = self.layer(x, *args, **kwargs)
        if send_to is not None:
            out = mx.distributed.send(out, send_to, group=group)
            object.__setattr__(self, "_last", out)
        return out


def layer_ranges(costs: list[float], size: int, head: float = 0.0) -> list[tuple[int, int]]:
    """[start, end) per rank, contiguous, the first layers on the highest rank and the last
    on rank 0, which also runs the head: each rank's layers (rank 0's with the head) about
    equal in `costs`, at least one layer each. Equal costs and no head: an even split."""
    total = sum(costs) + head
    ranges: list[tuple[int, int]] = [(0, 0)] * size
    end, acc = len(costs), head
    for r in range(size):
        start, later = end, size - r - 1
        if not later:
            start = 0
        while later and start - 1 >= later and (start == end or acc + costs[start - 1] / 2 <= total * (r + 1) / size):
            start -= 1
            acc += costs[start]
        ranges[r] = (start, end)
        end = start
    return ranges


def _logical_size(module: nn.Module) -> int:
    """Parameters a module holds, a quantized weight counted as the values it packs (so a
    model splits the same whether its weights are quantized, expanded or not yet loaded)."""
    total = 0
    for _, m in module.named_modules():
        local = {k: v for k, v in m.items() if isinstance(v, mx.array)}
        if "scales" in local and hasattr(m, "bits"):
            total += local.pop("weight").size * 32 // m.bits
            local.pop("scales"), local.pop("biases", None)
        total += sum(v.size for v in local.values())
    return total


def pipeline_ranges(model: Any, size: int) -> list[tuple[int, int]]:
    """Each rank's layers, balanced by the weights a decode step reads: a stage's time is
    reading its weights, and rank 0 also reads the head (SmolLM2-135M: the head is as
    large as 8 of its 30 layers, so rank 0 takes 11 layers, rank 1 19). The one place the
    split is decided: the files a rank fetches, the weights it may lack and its stage."""
    layers = model.decoder_layers
    costs = [float(_logical_size(layer)) for layer in layers]
    mods = dict(model.named_modules())
    heads = [m for name, m in mods.items() if name.split(".")[-1] == "lm_head"]
    if not heads:  # tied: the embedding matrix is the head
        heads = [max((m for m in mods.values() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))),
                     key=_logical_size, default=None)]
    head = float(_logical_size(heads[0])) if heads[0] is not None else 0.0
    return layer_ranges(costs, size, head)


def tensor_parallel(model: Any, ctx: DistContext) -> str:
    text = model.text_model
    if not callable(getattr(text, "shard", None)):
        raise UnsupportedModelError(
            f"--distributed tensor: mlx-lm's {model.args.model_type} has no shard() (no tensor-parallel split "
            "written for it); use --distributed pipeline")
    heads = _heads(text)
    split = [h for h in heads if isinstance(h, int) and h % ctx.size]
    if split:
        raise UnsupportedModelError(
            f"--distributed tensor over {ctx.size} ranks: {heads[0]} attention heads ({heads[1]} K/V heads) do not "
            f"split evenly; use --distributed pipeline, or a group size that divides them")
    try:
        text.shard(ctx.group)
    except Exception as e:  # noqa: BLE001 - e.g. heads that do not divide by the group size
        raise UnsupportedModelError(f"--distributed tensor over {ctx.size} ranks: mlx-lm's shard() fails for this "
                                    f"model ({type(e).__name__}: {e})") from None
    model.reprobe()
    after = _heads(text)
    return (f"tensor parallel over {ctx.size} ranks: rank {ctx.rank} holds attention heads {after[0]} of "
            f"{heads[0]} (K/V heads {after[1]} of {heads[1]}) and 1/{ctx.size} of each MLP")


def _heads(text: Any) -> tuple[Any, Any]:
    layer = next((m for m in text.modules() if hasattr(m, "n_heads") or hasattr(m, "num_heads")), None)
    if layer is None:
        return "?", "?"
    q = getattr(layer, "n_heads", None) or getattr(layer, "num_heads", None)
    kv = getattr(layer, "n_kv_heads", None) or getattr(layer, "num_key_value_heads", None) or q
    return q, kv


def pipeline_parallel(model: Any, ctx: DistContext) -> str:
    layers = model.decoder_layers
    n = len(layers)
    if n < ctx.size:
        raise UnsupportedModelError(f"--distributed pipeline over {ctx.size} ranks: the model has {n} layers")
    ranges = pipeline_ranges(model, ctx.size)
    start, end = ranges[ctx.rank]
    model.fix_cache_shapes()  # every rank keeps every cache (same plan); only its layers write theirs
    recv_from = ctx.rank + 1 if ctx.rank < ctx.size - 1 else None
    send_to = ctx.rank - 1 if ctx.rank > 0 else None
    for i in range(n):
        if not start <= i < end:
            layers[i] = _Skipped(layers[i])
    if recv_from is not None or send_to is not None:
        first_last = (start, end - 1)
        if start == end - 1:
            layers[start] = _Stage(layers[start], ctx.group, recv_from, send_to)
        else:
            layers[first_last[0]] = _Stage(layers[start], ctx.group, recv_from, None)
            layers[first_last[1]] = _Stage(layers[end - 1], ctx.group, None, send_to)
    model.modules_final()
    plan = "; ".join(f"rank {r}: layers {a}-{b - 1}" for r, (a, b) in enumerate(ranges))
    return f"pipeline parallel over {ctx.size} ranks ({plan}); this is rank {ctx.rank}"


def distribute(model: Any, ctx: DistContext) -> str:
    """Cut `model` (an mlx-lm model behind the adapter) to this rank's part; the plan in words."""
    if not hasattr(model, "reprobe"):
        raise UnsupportedModelError("--distributed runs models through mlx-lm's classes")
    return tensor_parallel(model, ctx) if ctx.mode == "tensor" else pipeline_parallel(model, ctx)
