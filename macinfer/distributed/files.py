"""Each rank fetches only its own weights (pipeline mode), as mlx-lm's `sharded_load` does.

A Hub model over several Macs: first the small files (config, the safetensors index,
tokenizer), then, from the index's weight map, only the files that hold this rank's
layers and the tensors outside any layer (embeddings, final norm, head: each rank takes
those, they are small beside the layers). Tensor mode needs a slice of every tensor, so
every file. A model with no index (one file) is fetched whole.

Loading then accepts the other ranks' layers missing from disk (`check_missing`): those
layers are cut from this rank's model before anything is evaluated.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from macinfer.distributed.sharding import pipeline_ranges

META = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]
INDEX = "model.safetensors.index.json"
LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def layer_of(key: str) -> int | None:
    """The decoder layer a tensor belongs to (`model.layers.3.mlp...` -> 3), or None."""
    m = LAYER.search(key)
    return int(m.group(1)) if m else None


def config_ranges(config: dict[str, Any], size: int) -> list[tuple[int, int]]:
    """Each rank's layers, from the model built (lazily, nothing evaluated) with mlx-lm's
    class, as the rank will build it (a config's count can differ: layer_types, MTP layers
    that sanitize drops)."""
    from macinfer.models import build_model

    return pipeline_ranges(build_model(config, "mlx-lm"), size)


def rank_files(weight_map: dict[str, str], layers: tuple[int, int]) -> list[str]:
    """The weight files a pipeline rank running decoder `layers` [start, end) needs."""
    start, end = layers
    return sorted({f for key, f in weight_map.items()
                   if (i := layer_of(key)) is None or start <= i < end})


def fetch_for_rank(repo: str, mode: str, rank: int, size: int) -> str:
    """Download what this rank needs of a Hub repo; returns the local snapshot directory."""
    from huggingface_hub import snapshot_download

    meta = snapshot_download(repo, allow_patterns=META)
    index = os.path.join(meta, INDEX)
    config_path = os.path.join(meta, "config.json")
    patterns = ["*.safetensors"]
    if mode == "pipeline" and os.path.exists(index) and os.path.exists(config_path):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        with open(config_path) as f:
            patterns = rank_files(weight_map, config_ranges(json.load(f), size)[rank])
    return snapshot_download(repo, allow_patterns=META + patterns)


def check_missing(missing: list[str], layers: tuple[int, int], rank: int) -> None:
    """Tensors absent from disk are allowed only in the other ranks' layers (this rank
    runs decoder `layers` [start, end))."""
    start, end = layers
    mine = [k for k in missing if (i := layer_of(k)) is None or start <= i < end]
    if mine:
        raise ValueError(f"rank {rank}: weights missing for this rank's part: {', '.join(mine[:5])}"
                         + (f" and {len(mine) - 5} more" if len(mine) > 5 else ""))
