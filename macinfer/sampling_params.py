"""Per-request sampling parameters (OpenAI / vLLM semantics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop.

    temperature 0 means greedy. top_k 0 (or -1) disables top-k. A seed makes
    sampling reproducible: the same seed gives the same text whether the
    request runs alone or inside a batch (the random stream is keyed by
    seed and output position, not by the batch).
    """

    n: int = 1
    max_tokens: int | None = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI semantics)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS, stop token ids and stop strings cannot end the output before this many tokens
    logprobs: int | None = None  # number of top alternatives; 0 = sampled token only
    # Logprob of each prompt token given the ones before it, with this many top
    # alternatives (vLLM's `prompt_logprobs`). Such a request skips prefix-cache hits:
    # a cached prefix has no logits.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # OpenAI servers refuse prompt + max_tokens beyond the context; offline use
    # (the default) just stops at the context length.
    strict_max_tokens: bool = False
    # Constrained decoding: an llguidance grammar (see engine/structured.py:
    # json_schema_grammar, or llguidance's grammar_from_regex / grammar_from_lark).
    grammar: str | None = None
    # A thinking budget: once the think block is open (`<think>` in the output, or
    # `thinking_open`: the prompt opened it), at most this many output tokens before
    # `thinking_end` (the closing marker's ids) is forced, unless the model closed it itself.
    thinking_budget: int | None = None
    thinking_end: tuple[int, ...] = ()
    thinking_open: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, (tuple, type(None))):
            self.stop = list(self.stop or [])
        if isinstance(self.stop_token_ids, (tuple, type(None))):
            self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()
        if 0.0 < self.temperature < _MIN_TEMPERATURE:  # below float precision of the logits: greedy
            self.temperature = 0.0

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return InvalidSamplingParamsError(name, f"{name} {why}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise bad(name, f"must be a number, got {value!r}")
        for name in ("stop", "stop_token_ids"):
            if not isinstance(getattr(self, name), list):
                raise bad(name, f"must be a list, got {getattr(self, name)!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            raise bad("top_k", f"must be -1, 0 (disabled) or an integer in [1, {MAX_TOP_K}], got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**64):
            raise bad("seed", f"must be an integer in [-2^63, 2^64), got {self.seed!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        # Every stop string is searched in every new token's text, and text that
        # could still become one is held back from streams: keep both bounded.
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise bad("stop", f"strings may be at most {MAX_STOP_LENGTH} characters")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS or any(
                    not isinstance(k, int) or k < 0 or not -100 <= v <= 100 for k, v in self.logit_bias.items()):
                raise bad("logit_bias", f"maps at most {MAX_LOGIT_BIAS} token ids (integers >= 0) to values in [-100, 100]")
        if len(self.stop_token_ids) > MAX_STOP_STRINGS * 4:
            raise bad("stop_token_ids", f"takes at most {MAX_STOP_STRINGS * 4} ids")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be token ids (integers >= 0), got {list(self.stop_token_ids)!r}")
        if self.thinking_budget is not None:
            if not isinstance(self.thinking_budget, int) or self.thinking_budget < 1 or not self.thinking_end:
                raise bad("thinking_budget", "must be an integer >= 1, with the closing marker's token ids")
            if self.grammar is not None:
                raise bad("thinking_budget", "cannot be combined with a grammar")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


_MIN_TEMPERATURE = 1e-5  # as vLLM: smaller temperatures only overflow the scaled logits
MAX_TOP_K = 1 << 20
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_LOGIT_BIAS = 1024


class InvalidSamplingParamsError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
