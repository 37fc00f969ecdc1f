"""What a request with images carries through the engine: where each image's placeholder
tokens sit in the prompt, the image's processed pixels (until encoded) and a content
hash that keys the prefix cache and the encoder cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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

    def rope_rows(self, positions: Any) -> Any:
        """The three rotary positions [3, n] of prompt or output `positions` (numpy ints)."""
        import numpy as np

        n = self.rope.shape[1]
        inside = positions < n
        out = np.broadcast_to(positions + self.rope_delta, (3, len(positions))).copy()
        out[:, inside] = self.rope[:, positions[inside]]
        return out

    def overlapping(self, start: int, end: int) -> list[ImageSpan]:
        return [s for s in self.spans if s.offset < end and s.end > start]

    def block_key(self, start: int, end: int) -> bytes:
        """What a prefix-cache block over positions [start, end) adds to its hash: each
        image whose placeholders it covers, by content and by where the block cuts it."""
        return b"".join(s.digest + (start - s.offset).to_bytes(8, "little", signed=True)
                        for s in self.overlapping(start, end))

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.spans)
