"""Tokenizer: Hugging Face fast tokenizers, built from GGUF metadata or loaded
from a model directory the way mlx-lm loads it (transformers' AutoTokenizer).

Chat prompts are rendered *and tokenized* by transformers'
`apply_chat_template(..., tokenize=True, sanitize_control_tokens=True)`:
the rendered text gets no extra special tokens (no double BOS), and special
token strings inside message content, tools or documents are encoded as plain
text, so a user cannot forge `<|im_start|>system`. The template's own markers
stay control tokens. Plain prompts (completions) are encoded with the model's
special tokens, as every OpenAI-compatible server does.

Hot paths (prompt encode, streaming decode) use a private copy of the Rust
tokenizer: transformers flips flags on its own copy while encoding chats.
"""

from __future__ import annotations

import inspect
import json
import os
import threading
from typing import Any

from tokenizers import Tokenizer

from macinfer.gguf.tokenizer import tokenizer_from_gguf

Message = dict[str, Any]


class ChatTemplateError(ValueError):
    """The template refused the conversation, or a chat option is invalid."""


def _transformers():
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" banner
    import transformers

    return transformers


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


class TokenizerWrapper:
    """Encode/decode, special ids and the chat template for one model."""

    def __init__(self, hf: Any, eos_token_ids: set[int]):
        self.hf = hf  # transformers tokenizer: chat rendering and saving
        self.tokenizer: Tokenizer = Tokenizer.from_str(hf.backend_tokenizer.to_str())
        self.bos_token_id: int | None = hf.bos_token_id
        if hf.eos_token_id is not None:
            eos_token_ids = eos_token_ids | {hf.eos_token_id}
        self.eos_token_ids = eos_token_ids
        self._lock = threading.Lock()  # transformers' tokenizer is not safe to share across threads
        self._chat_params = set(inspect.signature(hf.apply_chat_template).parameters)
        self._token_bytes: list[bytes] | None = None
        self.special_ids = frozenset(i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special)

    # -- construction -----------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> "TokenizerWrapper":
        tok, facts = tokenizer_from_gguf(meta)
        special = {k: facts[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if facts[k]}
        hf = _transformers().PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **special)
        hf.chat_template = facts["chat_template"]
        return cls(hf, facts["eos_token_ids"])

    @classmethod
    def from_dir(cls, path: str, config: dict[str, Any]) -> "TokenizerWrapper":
        """As mlx-lm loads it: AutoTokenizer on the directory; EOS ids from
        config.json, generation_config.json and the tokenizer config."""
        tf = _transformers()
        try:
            hf = tf.AutoTokenizer.from_pretrained(path)
        except Exception:  # a tokenizer class we cannot import: the tokenizer.json itself
            tcfg = _read_json(os.path.join(path, "tokenizer_config.json"))
            special = {k: v for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                       if isinstance(v := tcfg.get(k), str)}
            hf = tf.PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"), **special)
            if hf.chat_template is None:
                hf.chat_template = tcfg.get("chat_template")
        gen = _read_json(os.path.join(path, "generation_config.json"))
        return cls(hf, _ids(config.get("eos_token_id")) | _ids(gen.get("eos_token_id")))

    # -- encode / decode --------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def chat_template(self) -> str | dict | None:
        return self.hf.chat_template

    def set_chat_template(self, source: str) -> list[str]:
        """Use `source` (Jinja) instead of the model's template. Returns the `<|...|>`
        markers it writes that this vocabulary lacks as tokens (they would be spelled out
        in pieces: likely a template for another model family)."""
        import re

        self.hf.chat_template = source
        vocab = self.tokenizer.get_vocab()
        return sorted({m for m in re.findall(r"<\|[A-Za-z0-9_]+\|>", source) if m not in vocab})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tokenizer.id_to_token(i)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` stands for, with no neighbours: a byte-level piece that
        splits a multi-byte character gives its own bytes (a lone decode would give
        U+FFFD), and a SentencePiece piece keeps its leading space (its decoder strips
        one per call). Special tokens give their text."""
        table = self.token_byte_table()
        return table[i] if 0 <= i < len(table) else b""

    def token_byte_table(self) -> list[bytes]:
        """Every token's bytes, built once on first use (~0.2 s for a 49k vocabulary:
        callers on an event loop build it from a worker thread first)."""
        if self._token_bytes is None:
            with self._lock:
                if self._token_bytes is None:
                    self._token_bytes = _token_byte_table(self.tokenizer)
        return self._token_bytes

    # -- chat ------------------------------------------------------------
    def _chat(self, messages: list[Message], tokenize: bool, add_generation_prompt: bool,
              continue_final_message: bool, tools: list | None, documents: list | None,
              chat_template_kwargs: dict[str, Any] | None) -> Any:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use a plain prompt")
        kwargs = dict(chat_template_kwargs or {})
        clash = sorted((set(kwargs) & self._chat_params) | ({"messages"} & set(kwargs)))
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(clash)}")
        if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
            raise ChatTemplateError("continue_final_message needs a final assistant message")
        extra = {"sanitize_control_tokens": True, "return_dict": False} if tokenize else {}
        try:
            with self._lock:
                return self.hf.apply_chat_template(
                    messages, tools=tools, documents=documents, tokenize=tokenize,
                    add_generation_prompt=add_generation_prompt and not continue_final_message,
                    continue_final_message=continue_final_message, **extra, **kwargs,
                )
        except ChatTemplateError:
            raise
        except Exception as e:  # jinja's TemplateError, raise_exception(...) in the template, bad shapes
            raise ChatTemplateError(f"the chat template refused this conversation: {e}") from None

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False, tools: list | None = None,
                    documents: list | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of the rendered chat, as `apply_chat_template(tokenize=True)` gives them,
        with special-token strings from the caller's content encoded as text."""
        return list(self._chat(messages, True, add_generation_prompt, continue_final_message,
                               tools, documents, chat_template_kwargs))

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, tools: list | None = None,
                            documents: list | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """The rendered chat text (for display; feed `encode_chat`'s ids to the engine)."""
        return self._chat(messages, False, add_generation_prompt, continue_final_message,
                          tools, documents, chat_template_kwargs)

    def save(self, out_dir: str) -> None:
        """Write the HF tokenizer files (tokenizer.json, tokenizer_config.json, chat
        template) and generation_config.json's EOS ids; mlx-lm and transformers load them."""
        self.hf.save_pretrained(out_dir)
        eos = sorted(self.eos_token_ids)
        gen = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
        if self.bos_token_id is not None:
            gen["bos_token_id"] = self.bos_token_id
        with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
            json.dump(gen, f, indent=2)


def _decoder_kinds(decoder: dict[str, Any] | None) -> set[str]:
    if not decoder:
        return set()
    kinds = {decoder.get("type", "")}
    for d in decoder.get("decoders") or []:
        kinds |= _decoder_kinds(d)
    if decoder.get("type") == "Replace":
        kinds.add("Replace:" + str((decoder.get("pattern") or {}).get("String")))
    return kinds


def _token_byte_table(tok: Tokenizer) -> list[bytes]:
    """Every token's bytes, read off the vocabulary the way its decoder maps pieces:
    GPT-2's byte-to-unicode alphabet, or SentencePiece's `▁` and `<0xNN>` byte pieces."""
    kinds = _decoder_kinds(json.loads(tok.to_str()).get("decoder"))
    byte_level = "ByteLevel" in kinds
    metaspace = "Metaspace" in kinds or "Replace:▁" in kinds
    unicode_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    table = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        piece = tok.id_to_token(i)
        if piece is None:
            table.append(b"")
        elif piece in special:
            table.append(piece.encode())
        elif byte_level and all(c in unicode_to_byte for c in piece):
            table.append(bytes(unicode_to_byte[c] for c in piece))
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">") and "ByteFallback" in kinds:
            table.append(bytes([int(piece[3:5], 16)]))
        else:
            table.append((piece.replace("▁", " ") if metaspace else piece).encode())
    return table


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def token_text(data: bytes) -> str:
    """A token's `token` string in logprobs: its text, or OpenAI's `bytes:\\xNN` form
    when the bytes are not whole UTF-8 on their own (`bytes` then carries them exactly)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


# Prompt tokens the detokenizer starts from (vLLM's choice): enough for a decoder that
# strips a leading space per call, or merges pieces, to render the first new token as
# it renders inside the whole text.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """UTF-8-safe streaming decode: emits text only once it is complete.

    Decodes a short window of recent tokens twice (with and without the newest)
    so byte-level pieces that split a multi-byte character are held back until
    the character is whole, and a leading-space marker is rendered correctly.
    """

    def __init__(self, tokenizer: TokenizerWrapper, skip_special_tokens: bool = True,
                 prompt_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        # Seeded with the prompt's last tokens: SentencePiece decoders strip one leading
        # space per decode call, so a first token `▁The` decoded alone loses its space.
        self.ids: list[int] = _prompt_context(tokenizer, prompt_ids or [], skip_special_tokens)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever is left at the end (e.g. a truly invalid byte sequence)."""
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.read_offset = len(self.ids)
        self.prefix_offset = self.read_offset
        self.text += delta
        return delta


def _prompt_context(tokenizer: TokenizerWrapper, prompt_ids: list[int], skip: bool) -> list[int]:
    """The prompt's last few tokens, not counting special tokens the output skips, and
    never ending in a split character (which the first new token could complete)."""
    special = tokenizer.special_ids if skip else frozenset()
    start, counted = len(prompt_ids), 0
    while start > 0 and counted < PROMPT_CONTEXT_TOKENS and len(prompt_ids) - start < 4 * PROMPT_CONTEXT_TOKENS:
        start -= 1
        counted += prompt_ids[start] not in special
    tail = list(prompt_ids[start:])
    while tail and tokenizer.decode(tail, skip).endswith("\ufffd"):
        tail.pop()
    return tail
