"""Tokenizer: the `tokenizers` library, built from GGUF metadata or tokenizer.json.

Also owns the chat template (Jinja, rendered the way transformers does) and
the incremental detokenizer used for streaming.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

# llama.cpp's `tokenizer.ggml.pre` -> pre-tokenizer split regex (None: GPT-2's).
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_REGEX = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}

_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types that are special tokens


def _byte_level_bpe(meta: dict[str, Any]) -> Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _PRE_REGEX)
    if pre in _PRE_REGEX:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_PRE_REGEX[pre]), behavior="isolated"), byte_level]
        )
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(meta: dict[str, Any]) -> Tokenizer:
    """SentencePiece BPE (`llama` kind): merges recovered from piece scores."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores")
    scores = scores.tolist() if scores is not None else [-i for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, pid in vocab.items():
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                merges.append((scores[pid], vocab[left], vocab[right], left, right))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    unk_id = int(meta.get("tokenizer.ggml.unknown_token_id", 0))
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(m[3], m[4]) for m in merges],
            unk_token=tokens[unk_id],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    norms = [normalizers.Prepend("▁")] if add_prefix else []
    tok.normalizer = normalizers.Sequence(norms + [normalizers.Replace(" ", "▁")])
    decs = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        decs.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decs)
    return tok


def _as_int(v: Any) -> int | None:
    if v is None:
        return None
    return int(v.item() if hasattr(v, "item") else v)


class TokenizerWrapper:
    """Encode/decode, special ids and chat template for one model."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        bos_token_id: int | None,
        eos_token_ids: set[int],
        add_bos: bool,
        chat_template: str | None,
    ):
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._template = None

    # -- construction -----------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> "TokenizerWrapper":
        kind = meta.get("tokenizer.ggml.model")
        if kind == "gpt2":
            tok = _byte_level_bpe(meta)
        elif kind == "llama":
            tok = _sentencepiece_bpe(meta)
        else:
            raise ValueError(f"unsupported GGUF tokenizer kind {kind!r}; supported: gpt2, llama")
        tokens = meta["tokenizer.ggml.tokens"]
        types = meta.get("tokenizer.ggml.token_type")
        if types is not None:
            special = [
                AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(types.tolist())
                if t in (_CONTROL, _USER_DEFINED)
            ]
            tok.add_special_tokens(special)
        bos = _as_int(meta.get("tokenizer.ggml.bos_token_id"))
        eos = _as_int(meta.get("tokenizer.ggml.eos_token_id"))
        eot = _as_int(meta.get("tokenizer.ggml.eot_token_id"))
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        add_bos = bool(add_bos.item()) if add_bos is not None else kind == "llama"
        return cls(
            tok,
            bos,
            {i for i in (eos, eot) if i is not None},
            add_bos,
            meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_dir(cls, path: str, config: dict[str, Any]) -> "TokenizerWrapper":
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        tcfg: dict[str, Any] = {}
        tcfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(tcfg_path):
            with open(tcfg_path) as f:
                tcfg = json.load(f)

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return tok.token_to_id(value) if isinstance(value, str) else None

        bos = token_id(tcfg.get("bos_token"))
        eos_ids: set[int] = set()
        eos_cfg = config.get("eos_token_id")
        if isinstance(eos_cfg, int):
            eos_ids.add(eos_cfg)
        elif isinstance(eos_cfg, list):
            eos_ids.update(eos_cfg)
        if (e := token_id(tcfg.get("eos_token"))) is not None:
            eos_ids.add(e)
        template = tcfg.get("chat_template")
        jinja_path = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja_path):
            with open(jinja_path) as f:
                template = f.read()
        # tokenizer.json's post-processor adds BOS itself when the model wants it.
        return cls(tok, bos, eos_ids, False, template)

    # -- encode / decode --------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tokenizer.id_to_token(i)

    # -- chat ------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use a plain prompt")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message: str) -> None:
                raise ValueError(message)

            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
                x, indent=indent, ensure_ascii=False
            )
            self._template = env.from_string(self.chat_template)
        special = {
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(min(self.eos_token_ids) if self.eos_token_ids else None),
        }
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special, **kwargs
        )

    def _token_text(self, i: int | None) -> str:
        return (self.tokenizer.id_to_token(i) or "") if i is not None else ""

    def save(self, out_dir: str) -> None:
        """Write tokenizer.json + tokenizer_config.json (HF layout, mlx-lm loads it)."""
        self.tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._token_text(self.bos_token_id) or None,
            "eos_token": self._token_text(min(self.eos_token_ids)) if self.eos_token_ids else None,
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
            "clean_up_tokenization_spaces": False,
        }
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=2)


class IncrementalDetokenizer:
    """UTF-8-safe streaming decode: emits text only once it is complete.

    Decodes a short window of recent tokens twice (with and without the newest)
    so byte-level pieces that split a multi-byte character are held back until
    the character is whole, and a leading-space marker is rendered correctly.
    """

    def __init__(self, tokenizer: TokenizerWrapper):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever is left at the end (e.g. a truly invalid byte sequence)."""
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.read_offset = len(self.ids)
        self.prefix_offset = self.read_offset
        self.text += delta
        return delta
