"""Cache specs: what each layer keeps per token, and which keys its queries read.

Decided once at load, from the model itself (the caches its own `make_cache()`
builds and the K/V its layers actually write), as vLLM v1's KV cache specs are:

- an `AttentionKind` is a visibility rule: full attention, a sliding window of W
  keys, chunked local attention (Llama 4: a query reads its own chunk of C
  tokens), or the prompt and a window of what follows it (Unlimited-OCR). Its
  `key_floor` is the one place a layer's window is applied: block release, prefix
  hits, decode masks and prefill masks all ask it (the prompt-and-window kind's masks
  also ask `window_floor` and each row's prompt length).
- a `LayerKV` is one cache: the K/V one layer writes, its kind, K/V heads and head
  sizes. Later layers may read it too (Gemma 3n/4, AFM: KV sharing); they keep none.
- caches of one kind form a `CacheGroup`: one block pool, one block table per
  sequence. Caches in a group may have different shapes (Gemma 4's global layers
  are wider): block ids index each cache's own pool, so they need not match.

- a `StateSpec` is a recurrent layer's per-sequence state (conv windows, SSM or
  linear-attention state: mlx-lm's `ArraysCache` entries): fixed bytes a sequence,
  whatever its length, kept in a slot of a state pool (`kv/state.py`), not in blocks.
  Its prefix-hit rule is a snapshot taken at a block boundary (`engine/state_group.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Kind:
    """What every kind answers the block manager (the kinds below set `bounded`, whether a
    sequence's live blocks stop growing, and `holds_null`, whether its tables may hold the
    null block in place of a released or never stored one)."""
    bounded = False
    holds_null = False

    def unread_blocks(self, prompt_len: int, position: int, block_size: int) -> range:
        """Block indices no query at `position` or later reads (released as it runs)."""
        return range(0, int(self.key_floor(position)) // block_size)


@dataclass(frozen=True)
class FullAttention(_Kind):
    """Every earlier key."""
    bounded = False  # a sequence's live blocks grow with its length

    def key_floor(self, qpos):
        """Lowest key position a query at `qpos` (int or integer array) reads."""
        return qpos * 0

    def live_blocks(self, block_size: int) -> int | None:
        return None

    def stored_keys(self, num_tokens: int) -> int:
        """Positions of a sequence of `num_tokens` its block table covers (released ones included)."""
        return num_tokens

    def describe(self) -> str:
        return "full attention"


@dataclass(frozen=True)
class SlidingWindow(_Kind):
    """The last `window` keys, the query's own included (transformers' and mlx-lm's rule)."""
    window: int
    bounded = holds_null = True

    def key_floor(self, qpos):
        return np.maximum(qpos - self.window + 1, 0)

    def live_blocks(self, block_size: int) -> int | None:
        # W keys straddle at most cdiv(W - 1, bs) + 1 blocks; one more for the next token
        return cdiv(self.window - 1, block_size) + 2

    def stored_keys(self, num_tokens: int) -> int:
        """Positions of a sequence of `num_tokens` its block table covers (released ones included)."""
        return num_tokens

    def describe(self) -> str:
        return f"sliding window {self.window}"


@dataclass(frozen=True)
class ChunkedLocal(_Kind):
    """Keys of the query's own chunk of `chunk` positions (Llama 4's local layers)."""
    chunk: int
    bounded = holds_null = True

    def key_floor(self, qpos):
        return qpos // self.chunk * self.chunk

    def live_blocks(self, block_size: int) -> int | None:
        return cdiv(self.chunk, block_size) + 2

    def stored_keys(self, num_tokens: int) -> int:
        """Positions of a sequence of `num_tokens` its block table covers (released ones included)."""
        return num_tokens

    def describe(self) -> str:
        return f"chunked local attention {self.chunk}"


@dataclass(frozen=True)
class FirstTokens(_Kind):
    """Not a visibility rule: a store of the first `count` positions of a full-attention
    cache apart from it, at full precision while the cache itself is quantized
    (`--kv-quant-start`). Its blocks end at `count` (`stored_keys`); nothing is released
    before the sequence ends. The attention reads keys below `count` from here and the
    rest from the layer's own cache (`kv/attention.py`)."""
    count: int
    bounded = holds_null = True  # a sequence's blocks stop growing; beyond-count rows go to the null block

    def key_floor(self, qpos):
        return qpos * 0

    def live_blocks(self, block_size: int) -> int | None:
        return cdiv(self.count, block_size)

    def stored_keys(self, num_tokens: int) -> int:
        return min(num_tokens, self.count)

    def describe(self) -> str:
        return f"first {self.count} tokens at full precision"


@dataclass(frozen=True)
class PromptAndWindow(_Kind):
    """Every key of the sequence's prompt and the last `recent` keys after it, the query's
    own included (Unlimited-OCR's decoder, R-SWA: the whole prompt and a window of its own
    output). The keys between are not read, per row from the sequence's prompt length
    (`keeps_prompt`: the masks ask `window_floor`); none is released (the prompt is read to
    the end), so a sequence's blocks grow with it (`live_blocks`: full attention's), but
    its output's blocks behind the window are given back as it runs (`unread_blocks`).
    Only the K/V below prompt + `recent` are what a causal prompt would compute: later
    blocks are never shared (`shared_positions`)."""
    recent: int
    bounded = False
    holds_null = True
    keeps_prompt = True

    def key_floor(self, qpos):
        return qpos * 0

    def window_floor(self, qpos):
        """The first key after the prompt a query at `qpos` reads."""
        return np.maximum(qpos - self.recent + 1, 0)

    def unread_blocks(self, prompt_len: int, position: int, block_size: int) -> range:
        """The output's blocks wholly behind the window (the hole between prompt and window)."""
        return range(cdiv(prompt_len, block_size), int(self.window_floor(position)) // block_size)

    def shared_positions(self, prompt_len: int) -> int:
        """Positions of a sequence with this prompt whose K/V any sequence computes alike
        (a causal prompt's): the blocks below may be shared, the rest never are."""
        return prompt_len + self.recent

    def live_blocks(self, block_size: int) -> int | None:
        return None

    def stored_keys(self, num_tokens: int) -> int:
        return num_tokens

    def describe(self) -> str:
        return f"the prompt and a window of {self.recent}"


AttentionKind = FullAttention | SlidingWindow | ChunkedLocal | FirstTokens | PromptAndWindow


@dataclass(frozen=True)
class LayerKV:
    """One cache: the K/V rows one layer writes (later layers may read them too: KV sharing)."""
    kind: AttentionKind
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    # V is K's first v_head_dim values, not stored (multi-head latent attention: K is one
    # "head" of the compressed latent and the rope key, V the latent).
    v_in_k: bool = False

    def bytes_per_token(self, itemsize: int, quantized_bytes=None) -> int:
        """K + V bytes one token costs in this cache (`quantized_bytes`: K's and V's bytes of
        a row of d values, for a quantized cache)."""
        v = 0 if self.v_in_k else self.v_head_dim
        if quantized_bytes is not None:
            k_bytes, v_bytes = quantized_bytes
            return self.num_kv_heads * (k_bytes(self.head_dim) + (v_bytes(v) if v else 0))
        return self.num_kv_heads * (self.head_dim + v) * itemsize


@dataclass(frozen=True)
class StateSpec:
    """One recurrent cache: the arrays one sequence's state holds (shapes without the
    batch axis, and dtypes), as the layer writes them."""
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple  # mx.Dtype of each entry

    @property
    def nbytes(self) -> int:
        """Bytes of one sequence's state in this cache."""
        return sum(int(np.prod(s)) * d.size for s, d in zip(self.shapes, self.dtypes))

    def describe(self) -> str:
        return "recurrent state " + " + ".join("x".join(map(str, s)) for s in self.shapes)


@dataclass
class CacheGroup:
    """Caches of one attention kind: one block pool and one block table per sequence."""
    index: int
    kind: AttentionKind
    caches: tuple[int, ...]  # the model's caches in this group
    layers: tuple[int, ...] = ()  # the decoder layers attending over them (sharing layers too)
    num_blocks: int = 0  # set when the pools are planned (+ 1 null block where the kind holds one)
    bytes_per_block: int = 0

    def blocks_for(self, num_full_blocks: int, cap: int) -> int:
        """Blocks this group needs when the unbounded groups hold `num_full_blocks`."""
        return (min(num_full_blocks, cap) if self.kind.bounded else num_full_blocks) + self.kind.holds_null


def group_caches(caches: list[LayerKV], layer_caches: list[int] | None = None) -> tuple[list[CacheGroup], list[int]]:
    """Cache groups (unbounded kinds first, so group 0 anchors the tables when there is
    one) and each cache's group. `layer_caches`: the cache each decoder layer reads
    (default: layer i reads cache i)."""
    kinds: list[AttentionKind] = []
    for spec in caches:
        if spec.kind not in kinds:
            kinds.append(spec.kind)
    kinds.sort(key=lambda k: k.bounded)
    group_of = [kinds.index(spec.kind) for spec in caches]
    readers = list(range(len(caches))) if layer_caches is None else layer_caches
    groups = [CacheGroup(g, kind, tuple(i for i in range(len(caches)) if group_of[i] == g),
                         tuple(layer for layer, c in enumerate(readers) if group_of[c] == g))
              for g, kind in enumerate(kinds)]
    return groups, group_of


def split_first_tokens(caches: list[LayerKV], groups: list[CacheGroup], count: int
                       ) -> tuple[list[LayerKV], list[CacheGroup], dict[int, int]]:
    """Caches and groups with the first `count` positions of every full-attention cache
    stored apart (`FirstTokens`): one more cache per such cache, in one more group read
    by the same layers. Returns them and each full-attention cache's store of its first
    tokens (windows and chunks keep none: their queries soon stop reading those keys)."""
    full = [g for g in groups if isinstance(g.kind, FullAttention)]
    if not full:
        return caches, groups, {}
    kind = FirstTokens(count)
    first_of = {c: len(caches) + k for k, c in enumerate(full[0].caches)}
    caches = caches + [LayerKV(kind, caches[c].num_kv_heads, caches[c].head_dim, caches[c].v_head_dim,
                               caches[c].v_in_k) for c in full[0].caches]
    group = CacheGroup(len(groups), kind, tuple(first_of.values()), full[0].layers)
    return caches, groups + [group], first_of

