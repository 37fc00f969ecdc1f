"""The models a server can serve: a `ModelSource` (name, aliases, path, adapters) each,
found in a models folder and the Hugging Face cache (`discover`), with what can be told
without loading them (weights bytes from the files' headers, trained context)."""

from __future__ import annotations

import functools
import logging
import json
import os
import re
from dataclasses import dataclass, field

from macinfer.loading.memory import weights_estimate

log = logging.getLogger("macinfer.server")

GiB = 2**30


def size_text(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 10 else f"{n / 2**20:.1f} MiB"


@dataclass
class ModelSource:
    """A servable model: its name (the `model` field), what the engine loads, its aliases."""
    name: str
    path: str
    aliases: tuple[str, ...] = ()
    pinned: bool = False
    disk_bytes: int = 0  # the weights' files (listings)
    loras: dict[str, str] = field(default_factory=dict)  # its LoRA adapters: name -> folder, loaded with it

    @property
    def names(self) -> set[str]:
        return {self.name, *self.aliases}

    @functools.cached_property
    def weights_bytes(self) -> int:
        """The weights as they will be loaded, from the files' headers (0: unknown)."""
        return weights_estimate(self.path) if self.path else 0

    @functools.cached_property
    def context_length(self) -> int | None:
        """The trained context, read from the config or GGUF header without loading."""
        return context_length(self.path)


def no_paths(message: str) -> str:
    """A message for clients: absolute paths cut to their last part (the server's folders
    are its own business; the log keeps them whole)."""
    return re.sub(r"(?<![\w.])/(?:[^\s/:'\"`]+/)+([^\s/:'\"`]*)", r"\1", message)


def context_length(path: str) -> int | None:
    try:
        if path.endswith(".gguf"):
            from macinfer.gguf.file import GGUFFile

            meta = GGUFFile(path).metadata
            return int(meta[f"{meta['general.architecture']}.context_length"])
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        for c in (cfg, cfg.get("text_config") or {}):
            for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx"):
                if isinstance(c.get(key), int):
                    return c[key]
    except Exception:  # a listing shows no context rather than fail (the load will say why)
        pass
    return None


def disk_bytes(path: str) -> int:
    """The weights' size on disk: a file, or a folder's weight files (links to folders are
    not followed: a folder linking to itself would never end; dangling links count 0)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            if f.endswith((".safetensors", ".gguf", ".npz")):
                try:
                    total += os.path.getsize(os.path.join(root, f))
                except OSError:
                    pass
    return total


def _dir_source(models_dir: str, name: str) -> ModelSource | None:
    """The model a `--models-dir` entry holds, or None (logged) when it holds none we serve.
    Raises on files we cannot read; `discover` skips those with a warning."""
    from macinfer.loading.model_store import CachedModel, _describe_dir

    from macinfer.gguf.mmproj import is_projector_file

    path = os.path.join(models_dir, name)
    if is_projector_file(name):  # a vision projector: its model's, found beside it at load
        return None
    if name.endswith(".gguf") and os.path.isfile(path):
        from macinfer.gguf.file import GGUFFile

        GGUFFile(path)  # its header must read: a broken file is skipped here, not at a listing
        return ModelSource(name.removesuffix(".gguf"), path, (name,), disk_bytes=os.path.getsize(path))
    if not os.path.isdir(path):
        return None
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf") and not is_projector_file(f))
    m = CachedModel(name, 0, "", path, gguf_files=ggufs)
    _describe_dir(m)
    if not m.supported:
        log.warning("--models-dir: %s left out: %s", name, m.why)
        return None
    if os.path.exists(os.path.join(path, "config.json")):
        weights = [f for f in os.listdir(path) if f.endswith(".safetensors")]
        missing = [f for f in weights if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise ValueError(f"{missing[0]} is missing or a dangling link")
        return ModelSource(name, path, disk_bytes=disk_bytes(path))
    target = os.path.join(path, ggufs[0])
    from macinfer.gguf.file import GGUFFile

    GGUFFile(target)
    return ModelSource(name, target, disk_bytes=disk_bytes(target))


def discover(models_dir: str | None, hf_cache: bool) -> list[ModelSource]:
    """Servable models in a directory (MLX/HF model folders and .gguf files) and in the
    Hugging Face cache; unsupported or unreadable ones are logged with the reason and left
    out (a bad file never stops the server nor breaks a listing)."""
    from macinfer.loading.model_store import list_models

    found: list[ModelSource] = []
    if models_dir:
        if not os.path.isdir(models_dir):
            raise ValueError(f"--models-dir {models_dir}: not a directory")
        for name in sorted(os.listdir(models_dir)):
            try:
                source = _dir_source(models_dir, name)
            except Exception as e:  # a damaged or odd file: that entry only
                log.warning("--models-dir: %s left out: %s", name, e)
                continue
            if source is not None:
                found.append(source)
    if hf_cache:
        for m in list_models():
            if not m.supported:
                continue
            target = m.path if not m.gguf_files or os.path.exists(os.path.join(m.path, "config.json")) \
                else os.path.join(m.path, m.gguf_files[0])
            short = m.repo_id.rsplit("/", 1)[-1]
            found.append(ModelSource(m.repo_id, target, (short,), disk_bytes=m.size_bytes))
    return found


def unique(sources: list[ModelSource]) -> list[ModelSource]:
    """The first source of each name; an alias another model already uses is dropped."""
    out: list[ModelSource] = []
    taken: set[str] = set()
    for s in sources:
        if s.name in taken:
            log.warning("model %s (%s) left out: the name is taken", s.name, s.path)
            continue
        s.aliases = tuple(a for a in s.aliases if a not in taken and a != s.name)
        taken |= s.names
        out.append(s)
    return out
