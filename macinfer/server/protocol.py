"""OpenAI request/response schemas (the subset macinfer serves)."""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

_INT64 = 2**63


# Fields that would change what a response means, refused (400 naming the field) unless
# given their no-op value: never silently ignored.
_NOOP_VALUES: dict[str, tuple] = {
    "functions": (None, []), "function_call": (None, "none", "auto"),  # the legacy form of `tools`
    "best_of": (None, 1), "suffix": (None, ""),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
    "top_logprobs_per_token": (None,),
}
# Accepted and without effect on the output: bookkeeping and routing hints.
_HARMLESS = {"store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key"}


class _Request(BaseModel):
    # extra: checked in _refuse_unsupported. strict: "2" is not a number, "yes" not a boolean.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # None: the server's default (`serve --temperature/--top-p/--top-k`, else 1.0 / 1.0 / off)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=1 << 20)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    seed: int | None = Field(default=None, ge=-_INT64, lt=2 * _INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)  # vLLM's: no EOS or stop before this many tokens
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        """JSON may carry "\\ud800" escapes that are not text: refuse them by field,
        before they reach the tokenizer (or an error message)."""
        def walk(value: Any, path: str) -> None:
            if isinstance(value, str):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError(f"{path or 'body'} contains an unpaired UTF-16 surrogate (invalid Unicode)") from None
            elif isinstance(value, dict):
                for k, v in value.items():
                    walk(k, path)
                    walk(v, f"{path}.{k}" if path else str(k))
            elif isinstance(value, list):
                for i, v in enumerate(value):
                    walk(v, f"{path}[{i}]")

        walk(data, "")
        return data

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in _HARMLESS:
                continue
            if name in _NOOP_VALUES and value in _NOOP_VALUES[name]:
                continue
            raise ValueError(f"`{name}` is not supported by this server" +
                             (f" (only {_NOOP_VALUES[name][1:]!r} or null)" if len(_NOOP_VALUES.get(name, ())) > 1 else ""))
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # an option we do not implement is a 400, not ignored

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk (with include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    url: str
    detail: Literal["auto", "low", "high"] | None = None  # refused unless auto (`vision/messages.py`)


class ImagePart(BaseModel):
    """OpenAI's image part; the other APIs' images arrive here as data URLs."""
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["image_url"]
    image_url: ImageURL


_NO_INPUT = {"input_audio": "audio", "audio": "audio", "video_url": "video", "video": "video",
             "file": "file", "input_file": "file"}


def check_text_parts(data: Any) -> Any:
    """A message dict whose content, if a list of parts, holds text and image parts only
    (audio, video and file parts get a message saying no model here takes them)."""
    if isinstance(data, dict) and isinstance(data.get("content"), list):
        for i, part in enumerate(data["content"]):
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(kind, str):
                raise ValueError(f"content[{i}]: a part needs a string `type`, got {kind!r:.40}")
            if kind in _NO_INPUT:
                raise ValueError(f"content[{i}] is a {kind} part: {_NO_INPUT[kind]} input is not supported")
            if kind not in ("text", "image_url"):
                raise ValueError(f"content[{i}]: unsupported content part type {kind!r} (only 'text', 'image_url')")
    return data


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class AssistantToolCall(BaseModel):
    """A tool call in an earlier assistant message (what the client got back before)."""
    model_config = ConfigDict(extra="forbid", strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        return check_text_parts(data)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(isinstance(p, ImagePart) for p in self.content)

    def template_content(self) -> Any:
        """What the chat template gets: the text, or the parts in order when images are among them."""
        if not self.has_images():
            return self.text()
        return [p.model_dump(exclude_none=True) for p in self.content]


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments follow the schema exactly: always so when a call is forced


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionSpec


class _FunctionName(BaseModel):
    model_config = ConfigDict(strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: _FunctionName


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:  # OpenAI refuses it too; ignoring it would drop output
            raise ValueError("`top_logprobs` needs `logprobs: true`")
        return self
    # vLLM's extensions for chat templates.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # How much to think: mapped onto what the chat template offers (`reasoning.py`).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # Most tokens of thinking before the think block is closed (Anthropic's budget_tokens).
    thinking_budget: int | None = Field(default=None, ge=1)


class CompletionRequest(_Request):
    prompt: str | list[StrictInt] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: `prompt`, or `messages` rendered by the chat template."""
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[StrictInt]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: None = None  # models here have one size; a value is refused
    user: str | None = None


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()


# pydantic's names for union members in an error's location: `str`, `list[...]`,
# `function-after[...]`, `json-or-python[...]`, model class names. Never a field name.
_TYPE_TAGS = re.compile(r"^(str|int|float|bool|dict|list|none|bytes)$|^[a-z-]+\[|^[A-Z][A-Za-z]+$")


def describe_validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(message, field) for a client, in its own terms: the field's path as the client
    wrote it (no pydantic union-member tags such as `content.str`), the reason without
    pydantic's "Value error, " prefix, no model class names."""
    err = errors[0]
    loc = [p for p in err.get("loc", []) if p != "body"]
    path = ""
    for p in loc:
        if isinstance(p, int):
            path += f"[{p}]"
        elif not _TYPE_TAGS.match(str(p)):
            path += f".{p}" if path else str(p)
    msg = str(err.get("msg", "")).removeprefix("Value error, ")
    field = path or None
    if field is None and (named := re.match(r"`(\w+)`", msg)):  # a whole-request check naming its field
        return msg, named.group(1)
    return (f"{field}: {msg}" if field else msg), field


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def now() -> int:
    return int(time.time())
