"""Multi-head latent attention over the paged latents: which form a prompt chunk takes.

The cache holds one latent + rope key a token (`LayerKV.v_in_k`). Decodes always attend
in the absorbed form (queries projected into the latent space, `kv/attention.py`): the
cache is read once a step for all heads. A prompt chunk of n queries over c keys can
instead expand the latents into per-head K and V, as mlx-lm does for prompts:

    absorbed: n*c*H*(r + rope)  scores  + n*c*H*r   values  + n*H*r*v   projection out
    expanded: c*H*r*nope        K       + c*H*r*v   V       + n*c*H*(nope + rope + v)

so past some chunk length the expanded form costs less (DeepSeek V3, r 512, nope 128:
~170 tokens by flops). Where the crossover lies on a device is measured, not assumed
(`choose_expand_from`): the two forms timed on the model's own shapes at load, the
verdict cached (`kernels/autotune.py`). `MACINFER_MLA_PREFILL` forces it: `absorbed`,
`expanded` (every chunk), or a chunk length.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import mlx.core as mx

from macinfer.kernels import autotune
from macinfer.kv.attention import AttentionMetadata, attend, gather_context, span_mask
from macinfer.kv.dense import dense_attention
from macinfer.kv.prefill_plan import PrefillSpan

log = logging.getLogger("macinfer")

ENV = "MACINFER_MLA_PREFILL"
# Chunk lengths timed at load: the crossover is the shortest from which the expanded form
# stays faster.
TIMED_LENGTHS = (16, 64, 256, 512)


def expanded_spans(meta: AttentionMetadata, layer: int) -> list[PrefillSpan]:
    """This step's prompt chunks over cache `layer` long enough for the expanded form."""
    meta = meta.for_layer(layer)
    at = meta.mla_expand_from
    return [] if at is None else [s for s in meta.prefills if s.length >= at]


def _expanded_span(q_nope: mx.array, q_rope: mx.array, meta: AttentionMetadata, layer: int, span: PrefillSpan,
                   scale: float, embed_q: Any, unembed: Any) -> mx.array:
    """One chunk in the expanded form: [n, H, v]. q_nope [n, H, nope], q_rope [n, H, rope]."""
    pool = meta.kv_cache.pool(layer)
    k, _ = gather_context(meta, layer, [span])  # [1, L, r + rope]: the latent and the rope key
    r = pool.v_head_dim
    latent = k[None, :, : span.context_len, :r]  # [1, 1, c, r], mlx-lm's cache layout
    keys = embed_q(latent, transpose=False)  # [1, H, c, nope]
    values = unembed(latent)  # [1, H, c, v]
    heads = keys.shape[1]
    k_rope = mx.broadcast_to(k[None, :, : span.context_len, r:], (1, heads, span.context_len, k.shape[-1] - r))
    keys = mx.concatenate([keys, k_rope.astype(keys.dtype)], axis=-1)
    q = mx.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1).swapaxes(0, 1)[None]  # [1, H, n, d]
    mask = meta.memo(("span_mask", span.start), lambda: span_mask(span, meta.kind))
    return dense_attention(q, keys, values, scale, mask, meta.explicit_ops, meta.prefill_tile)[0].swapaxes(0, 1)


def split_latent_attention(q_latent: mx.array, q_nope: mx.array, q_rope: mx.array, meta: AttentionMetadata,
                           layer: int, scale: float, embed_q: Any, unembed: Any) -> mx.array:
    """A step's MLA attention when some chunks take the expanded form: [T, H, v], already
    projected out. q_latent [T, H, r] (absorbed queries), q_nope [T, H, nope], q_rope [T, H, rope]."""
    meta = meta.for_layer(layer)
    at = meta.mla_expand_from
    # The rest of the step (decodes, short chunks), attended in the absorbed form as always.
    rest = meta.memo(("mla_absorbed", at), lambda: dataclasses.replace(
        meta, prefills=[s for s in meta.prefills if s.length < at], groups=[], _memo={}))
    pieces: list[tuple[int, mx.array]] = []
    if rest.num_decodes or rest.prefills:
        out = attend(mx.concatenate([q_latent, q_rope], axis=-1), rest, layer, scale)  # [rows, H, r]
        out = unembed(out[:, :, None, :])[:, :, 0, :]
        pieces.append((0, out[: rest.num_decodes]))
        at_row = rest.num_decodes
        for s in rest.prefills:
            pieces.append((s.start, out[at_row : at_row + s.length]))
            at_row += s.length
    for s in meta.prefills:
        if s.length >= at:
            rows = slice(s.start, s.start + s.length)
            pieces.append((s.start, _expanded_span(q_nope[rows], q_rope[rows], meta, layer, s, scale, embed_q,
                                                   unembed)))
    pieces.sort(key=lambda p: p[0])
    return mx.concatenate([p for _, p in pieces if p.shape[0]], axis=0)


def forced_expand_from() -> tuple[bool, int | None]:
    """(forced?, chunk length) from MACINFER_MLA_PREFILL."""
    choice = os.environ.get(ENV, "auto").strip().lower()
    if choice == "auto":
        return False, None
    if choice == "absorbed":
        return True, None
    if choice == "expanded":
        return True, 1
    if choice.isdigit() and int(choice) > 0:
        return True, int(choice)
    raise ValueError(f"{ENV}={choice!r}; expected auto, absorbed, expanded or a chunk length")


def measure_forms(embed_q: Any, unembed: Any, dims: dict[str, int], dtype: mx.Dtype, explicit_ops: bool,
                  prefill_tile: int | None, lengths: tuple[int, ...] = TIMED_LENGTHS) -> dict[int, tuple[float, float]]:
    """Seconds for one chunk of n tokens over n keys (a prompt's first chunk), absorbed and
    expanded, on one layer's own projections: {n: (absorbed, expanded)}."""
    heads, r, nope, rope = dims["heads"], dims["r"], dims["nope"], dims["rope"]
    out: dict[int, tuple[float, float]] = {}
    for n in lengths:
        mx.random.seed(n)
        cache = mx.random.normal((1, 1, n, r + rope)).astype(dtype)
        q_nope = mx.random.normal((1, heads, n, nope)).astype(dtype)
        q_rope = mx.random.normal((1, heads, n, rope)).astype(dtype)
        mx.eval(cache, q_nope, q_rope)

        def absorbed():
            q = mx.concatenate([embed_q(q_nope), q_rope], axis=-1)
            o = dense_attention(q, cache, cache, 0.1, "causal", explicit_ops, prefill_tile)
            return unembed(o[..., :r])

        def expanded():
            latent = cache[..., :r]
            keys = mx.concatenate([embed_q(latent, transpose=False),
                                   mx.broadcast_to(cache[..., r:], (1, heads, n, rope))], axis=-1)
            q = mx.concatenate([q_nope, q_rope], axis=-1)
            return dense_attention(q, keys, unembed(latent), 0.1, "causal", explicit_ops, prefill_tile)

        out[n] = (autotune.median_seconds(absorbed), autotune.median_seconds(expanded))
    return out


def crossover(timings: dict[int, tuple[float, float]]) -> int | None:
    """The shortest timed chunk length from which the expanded form is faster at every
    longer one (None: never)."""
    at = None
    for n in sorted(timings, reverse=True):
        absorbed, expanded = timings[n]
        if expanded >= absorbed:
            break
        at = n
    return at


def choose_expand_from(model: Any, dtype: mx.Dtype, explicit_ops: bool, prefill_tile: int | None,
                       tuning: autotune.Tuning = autotune.Tuning(), measure=measure_forms) -> int | None:
    """The chunk length from which prompt chunks take the expanded form on this device
    (None: never), decided once at load."""
    projections = getattr(model, "mla_projections", None)  # the adapter's probe: (embed_q, unembed_out, dims)
    if projections is None:
        return None
    forced, at = forced_expand_from()
    if forced:
        return at
    embed_q, unembed, dims = projections
    shape = dict(dims, v=list(unembed.weight.shape), dtype=str(dtype), bits=getattr(embed_q, "bits", None),
                 explicit=explicit_ops, tile=prefill_tile)

    def run() -> dict:
        timings = measure(embed_q, unembed, dims, dtype, explicit_ops, prefill_tile)
        return {"expand_from": crossover(timings),
                "ms": {str(n): [round(a * 1e3, 3), round(e * 1e3, 3)] for n, (a, e) in timings.items()}}

    verdict = autotune.verdict("mla_prefill", shape, run, tuning)
    if verdict is None:  # autotuning off: the absorbed form, as before it was measured
        return None
    figures = ", ".join(f"{n}: {a:g}/{e:g} ms" for n, (a, e) in verdict["ms"].items())
    log.info("MLA prompt chunks: expanded form from %s tokens (absorbed/expanded per chunk length: %s)%s",
             verdict["expand_from"] or "never", figures, " (cached)" if verdict.get("cached") else "")
    return verdict["expand_from"]
