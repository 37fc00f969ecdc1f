"""Who drafts for speculative decoding: the method a config names, checked once at load
(`speculative_method`), and its batched proposer built (`load_proposer`): none for prompt
lookup (`engine/speculative.py`), a draft model (`engine/drafter.py`), a head that reads
the target's hidden states, an MTP head or an EAGLE-3 checkpoint (`engine/mtp_drafter.py`),
Gemma 4's assistant, which reads its hidden states and K/V (`engine/assistant_drafter.py`),
or a DFlash block drafter (`engine/dflash_drafter.py`)."""

from __future__ import annotations

from typing import Any

from macinfer.engine.assistant_drafter import load_assistant_drafter
from macinfer.engine.dflash_drafter import load_dflash_drafter
from macinfer.engine.drafter import DraftModel, load_drafter
from macinfer.engine.mtp_drafter import load_eagle3_drafter, load_mtp_drafter

METHODS = ("ngram", "draft", "mtp", "eagle3")


def speculative_method(cfg: Any) -> str | None:
    """Who drafts under `cfg` (EngineConfig): "ngram", "draft", "eagle3", "mtp", or None
    (speculation off); a ValueError naming the options that cannot combine."""
    method = cfg.speculative_method
    if method is not None and method not in METHODS:
        raise ValueError(f"speculative_method {method!r}: one of {', '.join(METHODS)}")
    if not cfg.num_speculative_tokens:
        if cfg.draft_model is not None:
            raise ValueError("--draft-model needs --num-speculative-tokens: the draft tokens per step (say 4)")
        if method in ("draft", "mtp", "eagle3"):
            raise ValueError(f"--speculative-method {method} needs --num-speculative-tokens: the draft tokens "
                             "per step (say 2 for an MTP head, 4 for a draft model)")
        return None
    method = method or ("draft" if cfg.draft_model is not None else "ngram")
    if method in ("draft", "eagle3") and cfg.draft_model is None:
        raise ValueError(f"--speculative-method {method} needs --draft-model: the model (or EAGLE-3 head) that drafts")
    if method not in ("draft", "eagle3") and cfg.draft_model is not None and not (method == "mtp" and
                                                                                _split_mtp(cfg.draft_model)):
        raise ValueError(f"--draft-model cannot combine with --speculative-method {method}: one drafter at a time "
                         "(an MTP head split out of a checkpoint may: mlx-vlm's split MTP drafter folders)")
    if cfg.prompt_lookup_first and method == "ngram":
        raise ValueError("--prompt-lookup-first puts prompt lookup before a drafter (--draft-model or "
                         "--speculative-method mtp); without one, prompt lookup is all there is")
    if method != "ngram" and cfg.distributed:
        raise ValueError(f"--speculative-method {method} is not run over --distributed ranks yet; serve the target "
                         "alone or use prompt lookup")
    return method


def _split_mtp(draft_model: str) -> bool:
    """Whether `--draft-model` names a local folder holding an MTP head split out of a
    checkpoint (mlx-vlm's split MTP drafters); checked before anything is fetched."""
    import os

    from macinfer.models.mtp_checkpoint import split_drafter

    path = os.path.expanduser(draft_model)
    return os.path.isdir(path) and split_drafter(path) is not None


def load_proposer(engine: Any, method: str | None, progress: Any = None, context: Any = None) -> DraftModel | None:
    """The engine's batched proposer for `method` (None for prompt lookup and no speculation),
    loaded before the target's memory plan: a drafter with a pool of its own (`allocate`)
    takes its share of the target's budget (`companion`)."""
    if method in ("draft", "eagle3"):
        from macinfer.loading.loader import resolve
        from macinfer.models.eagle3 import is_eagle3
        from macinfer.models.dflash import dflash_type
        from macinfer.models.gemma4_assistant import is_assistant
        from macinfer.models.mtp_checkpoint import split_drafter

        path = resolve(engine.config.draft_model)
        if is_eagle3(path):  # a trained head, whichever method was named
            return load_eagle3_drafter(engine)
        if dflash_type(path):  # a block drafter reading the target's layer outputs
            return load_dflash_drafter(engine)
        if split_drafter(path):  # an MTP head split out of a checkpoint (mlx-vlm's `*_mtp` folders)
            return load_mtp_drafter(engine, source=path)
        if is_assistant(path):  # Gemma 4's assistant: reads the target's K/V
            if method == "eagle3":
                raise ValueError(f"--speculative-method eagle3: {engine.config.draft_model} is a Gemma 4 "
                                 "assistant drafter; use --speculative-method draft (or none)")
            return load_assistant_drafter(engine)
        if method == "eagle3":
            raise ValueError(f"--speculative-method eagle3: {engine.config.draft_model} is not an EAGLE-3 "
                             "checkpoint (LlamaForCausalLMEagle3 or speculators' eagle3)")
        return load_drafter(engine, progress, context)
    if method == "mtp":
        from macinfer.loading.loader import resolve

        source = resolve(engine.config.draft_model) if engine.config.draft_model else None
        return load_mtp_drafter(engine, source=source)
    return None
