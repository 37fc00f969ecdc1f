"""What a request with images carries through the engine: where each image's placeholder
tokens sit in the prompt, the image's processed pixels (until encoded) and a content
hash that keys the prefix cache and the encoder cache."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(eq=False)
class ImageSpan:
    """One image: its `length` prompt tokens from position `offset` (what the processor
    expanded its marker into: the placeholders and any tile or frame tokens between them);
    the encoder's rows go to the placeholders, at `rows` (relative to `offset`), in order."""
    offset: int
    length: int
    rows: list[int]
    digest: bytes  # content hash of the processed pixels and the processor's outputs
    pixels: dict[str, Any] | None = None  # the encoder's inputs (ids, pixel values, extras) until encoded
    features: Any = None  # mx.array [length, hidden] once encoded (kept for recompute after preemption)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(eq=False)
class ImageInputs:
    spans: list[ImageSpan] = field(default_factory=list)
    # Multimodal RoPE: the prompt's three rotary positions per token [3, prompt length]
    # and the shift of every later position (the images' rows take fewer positions than tokens).
    rope: Any = None
    rope_delta: int = 0
    # Gemma 3's rule (transformers'): an image's placeholder tokens attend to each other both
    # ways; the rest is causal. A prompt chunk then holds an image's placeholders whole.
    both_ways: bool = False
    # A prefix LM (PaliGemma): the prompt's first `prefix` tokens (all of it) attend to each
    # other both ways, so every block of it depends on the whole prompt (`prefix_digest`).
    prefix: int = 0
    prefix_digest: bytes = b""

    def set_prefix(self, ids: list[int]) -> None:
        h = hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=16)
        for s in self.spans:
            h.update(s.digest)
        self.prefix, self.prefix_digest = len(ids), h.digest()

    def _blocks(self) -> list[tuple[int, int]]:
        """The blocks [first, last] (positions) whose tokens attend to each other both ways:
        the prefix, or each both-ways image's placeholders."""
        if self.prefix:
            return [(0, self.prefix - 1)]
        return [(s.offset + s.rows[0], s.offset + s.rows[-1]) for s in self.spans] if self.both_ways else []

    def key_ceilings(self, positions: Any) -> Any:
        """The last key each of `positions` (numpy ints) may read: itself, or inside a both-ways
        block (`_blocks`), the block's last token. None when no position is in one."""
        if not self.both_ways and not self.prefix:
            return None
        out, hit = np.asarray(positions).copy(), False
        for first, last in self._blocks():
            inside = (positions >= first) & (positions <= last)
            if inside.any():
                out[inside], hit = last, True
        return out if hit else None

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prompt chunk [start, end) may end: never inside a both-ways block (before
        it when the chunk starts before it, else after the whole block)."""
        for first, last in self._blocks():
            if first < end <= last:
                return first if first > start else last + 1
        return end

    def rope_rows(self, positions: Any) -> Any:
        """The rotary positions [axes, n] of prompt or output `positions` (numpy ints)."""
        axes, n = self.rope.shape
        inside = positions < n
        out = np.broadcast_to(positions + self.rope_delta, (axes, len(positions))).copy()
        out[:, inside] = self.rope[:, positions[inside]]
        return out

    def overlapping(self, start: int, end: int) -> list[ImageSpan]:
        return [s for s in self.spans if s.offset < end and s.end > start]

    def block_key(self, start: int, end: int) -> bytes:
        """What a prefix-cache block over positions [start, end) adds to its hash: each
        image whose placeholders it covers, by content and by where the block cuts it (in a
        prefix LM's prompt: the whole prompt, which each of its blocks depends on)."""
        if start < self.prefix:
            return self.prefix_digest + start.to_bytes(8, "little", signed=True)
        return b"".join(s.digest + (start - s.offset).to_bytes(8, "little", signed=True)
                        for s in self.overlapping(start, end))

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.spans)


def content_digest(ids: list[int], pixels: dict[str, Any]) -> bytes:
    """An image's key in the prefix and encoder caches: its expanded ids and every processor output."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(ids, dtype=np.int64).tobytes())
    for k in sorted(pixels):
        for v in pixels[k] if isinstance(pixels[k], (list, tuple)) else (pixels[k],):  # (DeepSeek-OCR's views)
            v = np.asarray(v)
            h.update(k.encode() + str(v.dtype).encode() + str(v.shape).encode())
            h.update(np.ascontiguousarray(v).tobytes())
    return h.digest()
