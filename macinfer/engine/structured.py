"""Constrained decoding with llguidance: one grammar matcher per request, and a
token mask per row of the step, applied to the logits before sampling.

Why llguidance (against xgrammar and outlines-core): abi3 wheels for macOS arm64
and Linux x86-64 with no dependencies (xgrammar pulls in torch), masks computed
lazily per step in ~tens of microseconds with no ahead-of-time index over the
vocabulary (outlines-core builds one per schema, slow for large schemas), and it
takes JSON schema, regex and Lark grammars. The mask is computed on the host
while the forward pass runs on the device; applying it is three MLX ops.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import mlx.core as mx
import numpy as np

from macinfer.engine.sequence import Sequence
from macinfer.text.json_limits import MAX_JSON_DEPTH, value_depth
from macinfer.text.tokenizer import TokenizerWrapper


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot compile (the request's fault)."""


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """An llguidance grammar for JSON matching `schema` (None: any JSON object)."""
    import llguidance

    if schema is not None and value_depth(schema) > MAX_JSON_DEPTH:
        raise GrammarError(f"the JSON schema nests deeper than {MAX_JSON_DEPTH} levels")
    schema = {"type": "object"} if schema is None else _bounded_integers(schema)
    try:
        # Compact JSON: no free whitespace, which a small model can loop on.
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    except ValueError as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


SAFE_INTEGER = 2**53 - 1  # JSON parsers (JavaScript's among them) read integers exactly up to here


def _bounded_integers(schema: Any) -> Any:
    """The schema with every unbounded `integer` held to +-(2^53 - 1): a small model
    can otherwise write digits until llguidance's parser gives up (a ~600-digit
    number), and no client reads such a number exactly anyway. Bounds the schema
    gives are kept."""
    if isinstance(schema, list):
        return [_bounded_integers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded_integers(v) if k not in ("const", "enum", "default", "examples") else v
           for k, v in schema.items()}
    kinds = schema.get("type")
    if kinds == "integer" or (isinstance(kinds, list) and "integer" in kinds):
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            out["maximum"] = SAFE_INTEGER
    return out


class StructuredOutputs:
    """The llguidance view of the model's vocabulary (built once, on first use: ~1 s)."""

    CACHE_SIZE = 64

    def __init__(self, tokenizer: TokenizerWrapper, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll = None
        self._executor = None
        # grammar -> a fresh matcher to copy: compiled once (tool schemas repeat), and
        # off the engine thread (validation runs in the server's worker threads).
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        with self._lock:
            return self._ll_tokenizer()

    def _ll_tokenizer(self):
        if self._ll is None:
            import llguidance

            eos = sorted(self._tokenizer.eos_token_ids)
            self._ll = llguidance.LLTokenizer(self._tokenizer.tokenizer.to_str(), n_vocab=self.vocab_size,
                                              eos_token=eos[0] if len(eos) == 1 else eos)
            self._executor = llguidance.LLExecutor()
        return self._ll

    def _fresh(self, grammar: str):
        """A matcher in its start state, compiled at most once per grammar (LRU)."""
        import llguidance

        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled.deep_copy()
            tokenizer = self._ll_tokenizer()
        compiled = llguidance.LLMatcher(tokenizer, grammar, log_level=0)  # may take a while: unlocked
        if compiled.is_error():
            raise GrammarError(f"invalid grammar: {compiled.get_error()}")
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > self.CACHE_SIZE:
                self._compiled.popitem(last=False)
            return compiled.deep_copy()

    def validate(self, grammar: str) -> None:
        """Compile (and cache) the grammar; GrammarError if it is invalid."""
        self._fresh(grammar)

    def matcher(self, grammar: str):
        """A fresh matcher for one request; GrammarError if the grammar is invalid."""
        return self._fresh(grammar)

    def bitmask(self, seqs: list[Sequence]) -> np.ndarray | None:
        """[N, ceil(vocab/32)] int32, bit t of row i set when token t is allowed for
        seqs[i]; rows without a grammar allow everything. None when no row has one.
        A speculating sequence's rows follow it, one per draft token: each gets the
        mask of the grammar state after the drafts before it (the matcher itself
        does not move)."""
        rows, drafted = [], []
        for i, s in enumerate(seqs):
            if s.matcher is None:
                continue
            if s.spec_token_ids:
                drafted.append((s.matcher, i, s.spec_token_ids))
            else:
                rows.append((s.matcher, i))
        if not rows and not drafted:
            return None
        from llguidance.numpy import (allocate_token_bitmask, fill_next_token_bitmask_par,
                                      fill_next_token_bitmask_par_with_draft_tokens)

        mask = allocate_token_bitmask(len(seqs), self.vocab_size)
        self.ll_tokenizer  # noqa: B018 (the executor is made with it)
        if rows:
            fill_next_token_bitmask_par(self._executor, rows, mask)
        if drafted:
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, mask)
        return mask


def allowed_tokens(mask: np.ndarray, vocab: int) -> mx.array:
    """The bitmask as bool [N, vocab]. Plain MLX ops: the same on every backend."""
    n = mask.shape[0]
    words = mx.array(mask.view(np.uint32))  # [N, W]
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1  # [N, W, 32]
    return bits.reshape(n, -1)[:, :vocab].astype(mx.bool_)


def apply_bitmask(logits: mx.array, mask: np.ndarray) -> mx.array:
    """Disallowed tokens to -inf."""
    allowed = allowed_tokens(mask, logits.shape[1])
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))

