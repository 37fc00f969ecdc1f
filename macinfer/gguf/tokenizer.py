"""Build a `tokenizers.Tokenizer` from GGUF metadata, the way llama.cpp reads it.

llama.cpp stores the vocabulary, merges (or SentencePiece scores), token types,
the pre-tokenizer's name and the BOS/EOS flags. This module turns them into a
Hugging Face fast tokenizer whose post-processor adds BOS when the file says
so, so the tokenizer saved by `macinfer convert` behaves the same in
transformers and mlx-lm.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# llama.cpp's `tokenizer.ggml.pre` -> pre-tokenizer split regex.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3.5: Qwen2's, with combining marks (\p{M}) kept with their letters.
_QWEN35_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek V3 (and R1, V3.1): three splits in turn: digits in threes, CJK runs, then the words.
_DEEPSEEK3_REGEXES = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# GPT-4o's (o200k), which MiniMax M2 uses: cased words keep their contraction, digits in threes.
_O200K_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(*regexes: str):
    return lambda: pre_tokenizers.Sequence(
        [*(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _gpt2():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2():
    # StarCoder-style: every digit on its own, then GPT-2's split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


# llama.cpp's `tokenizer.ggml.pre` name -> the equivalent pre-tokenizer.
PRE_TOKENIZERS = {
    "default": _gpt2,
    "gpt-2": _gpt2,
    "gpt2": _gpt2,
    "olmo": _gpt2,  # (OLMo's: GPT-2's split, as llama.cpp's vocab reads it)
    "llama-bpe": _split_then_bytes(_LLAMA3_REGEX),
    "llama3": _split_then_bytes(_LLAMA3_REGEX),
    "llama-v3": _split_then_bytes(_LLAMA3_REGEX),
    # llama.cpp gives these Llama 3's split too
    "lfm2": _split_then_bytes(_LLAMA3_REGEX),
    "falcon-h1": _split_then_bytes(_LLAMA3_REGEX),
    "falcon3": _split_then_bytes(_LLAMA3_REGEX),
    "glm4": _split_then_bytes(_LLAMA3_REGEX),
    "chatglm-bpe": _split_then_bytes(_LLAMA3_REGEX),
    "qwen35": _split_then_bytes(_QWEN35_REGEX),
    "deepseek-v3": _split_then_bytes(*_DEEPSEEK3_REGEXES),
    "gpt-4o": _split_then_bytes(_O200K_REGEX),
    "minimax-m2": _split_then_bytes(_O200K_REGEX),
    "smaug-bpe": _split_then_bytes(_LLAMA3_REGEX),
    "dbrx": _split_then_bytes(_LLAMA3_REGEX),  # (OLMo 2's and DBRX's: Llama 3's split in llama.cpp)
    "qwen2": _split_then_bytes(_QWEN2_REGEX),
    "deepseek-r1-qwen": _split_then_bytes(_QWEN2_REGEX),
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "refact": _digits_then_gpt2,
    "command-r": _digits_then_gpt2,  # (llama.cpp splits Command R's digits one by one, then GPT-2's rule)
}

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Control tokens llama.cpp also treats as end-of-generation when the file names
# only one EOS: chat models end turns with these.
_EOG_TEXTS = {
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>", "<｜end▁of▁sentence｜>",
}


class UnsupportedTokenizerError(ValueError):
    pass


def _as_int(v: Any) -> int | None:
    if v is None:
        return None
    return int(v.item() if hasattr(v, "item") else v)


def _as_bool(v: Any, default: bool) -> bool:
    if v is None:
        return default
    return bool(v.item() if hasattr(v, "item") else v)


def _as_list(v: Any) -> list:
    return v.tolist() if hasattr(v, "tolist") else list(v)


def _byte_level_bpe(meta: dict[str, Any]) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedTokenizerError(
            f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: "
            + ", ".join(sorted(PRE_TOKENIZERS))
            + ". Its split rules are unknown here, and a guess would tokenize text differently from the model's training."
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]  # (a byte vocabulary has none)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(meta: dict[str, Any]) -> Tokenizer:
    """SentencePiece BPE (`llama` kind): merges recovered from piece scores."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores")
    scores = _as_list(scores) if scores is not None else [-i for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, pid in vocab.items():
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                merges.append((scores[pid], vocab[left], vocab[right], left, right))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    unk_id = _as_int(meta.get("tokenizer.ggml.unknown_token_id")) or 0
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(m[3], m[4]) for m in merges],
            unk_token=tokens[unk_id],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_prefix = _as_bool(meta.get("tokenizer.ggml.add_space_prefix"), True)
    norms = [normalizers.Prepend("▁")] if add_prefix else []
    tok.normalizer = normalizers.Sequence(norms + [normalizers.Replace(" ", "▁")])
    decs = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        decs.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decs)
    return tok


def _gemma4_bpe(meta: dict[str, Any]) -> Tokenizer:
    """Gemma 4's (`gemma4` kind): BPE by the file's merges over the text's own UTF-8 (no GPT-2
    byte mapping), spaces as "▁" with none prepended, bytes the vocabulary lacks as <0xXX>."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    if not merges:
        raise UnsupportedTokenizerError("a gemma4 GGUF tokenizer without merges (tokenizer.ggml.merges)")
    unk_id = _as_int(meta.get("tokenizer.ggml.unknown_token_id"))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, byte_fallback=True,
                               unk_token=tokens[unk_id] if unk_id is not None else None, fuse_unk=False))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def tokenizer_from_gguf(meta: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer plus its special-token facts: bos/eos/unk/pad texts, EOS ids."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = _byte_level_bpe(meta)
    elif kind == "llama":
        tok = _sentencepiece_bpe(meta)
    elif kind == "gemma4":
        tok = _gemma4_bpe(meta)
    else:
        raise UnsupportedTokenizerError(
            f"unsupported GGUF tokenizer kind {kind!r} (tokenizer.ggml.model); supported: gpt2, llama, gemma4"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type")
    types = _as_list(types) if types is not None else [_NORMAL] * len(tokens)
    # CONTROL tokens are special (skipped when decoding); USER_DEFINED ones
    # (`<think>`, `<tool_call>`) are matched in text but decode as text, as in llama.cpp.
    added = [
        AddedToken(tokens[i], special=t == _CONTROL, normalized=False)
        for i, t in enumerate(types)
        if t in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_tokens(added)

    bos = _as_int(meta.get("tokenizer.ggml.bos_token_id"))
    eos = _as_int(meta.get("tokenizer.ggml.eos_token_id"))
    eog = {i for i in (eos, _as_int(meta.get("tokenizer.ggml.eot_token_id")),
                       _as_int(meta.get("tokenizer.ggml.eom_token_id"))) if i is not None}
    eog |= {i for i, t in enumerate(types) if t == _CONTROL and tokens[i] in _EOG_TEXTS}
    add_bos = _as_bool(meta.get("tokenizer.ggml.add_bos_token"), kind == "llama") and bos is not None
    add_eos = _as_bool(meta.get("tokenizer.ggml.add_eos_token"), False) and eos is not None
    if add_bos or add_eos:
        single = ([f"{tokens[bos]}:0"] if add_bos else []) + ["$A:0"] + ([f"{tokens[eos]}:0"] if add_eos else [])
        pair = single + ["$B:1"] + ([f"{tokens[eos]}:1"] if add_eos else [])
        specials = [(tokens[i], i) for i in {bos if add_bos else None, eos if add_eos else None} if i is not None]
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    def text(key: str) -> str | None:
        i = _as_int(meta.get(key))
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    facts = {
        "bos_token": text("tokenizer.ggml.bos_token_id"),
        "eos_token": text("tokenizer.ggml.eos_token_id"),
        "unk_token": text("tokenizer.ggml.unknown_token_id"),
        "pad_token": text("tokenizer.ggml.padding_token_id"),
        "eos_token_ids": eog,
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return tok, facts
