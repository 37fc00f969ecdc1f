"""Anthropic's context editing (`context_management.edits`), applied before the prompt is
built, as Anthropic's API does server-side (Claude Code sends it):

- `clear_tool_uses_20250919`: once the prompt passes `trigger` input tokens (100,000 by
  default), the oldest tool results are replaced by a placeholder, all but the last `keep`
  tool uses (3); `exclude_tools` are never cleared; `clear_tool_inputs` also empties the
  calls' inputs; nothing is cleared unless at least `clear_at_least` tokens would be.
- `clear_thinking_20251015`: thinking blocks of earlier turns. This server never feeds
  earlier thinking to the model (chat templates drop it), whatever `keep` says; the edit
  reports the turns whose thinking was left out.

The response's `context_management.applied_edits` says what was cleared.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

PLACEHOLDER = "[tool result cleared to save context]"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class InputTokens(_Strict):
    type: Literal["input_tokens"]
    value: int = Field(ge=0)


class ToolUses(_Strict):
    type: Literal["tool_uses"]
    value: int = Field(ge=0)


class ThinkingTurns(_Strict):
    type: Literal["thinking_turns"]
    value: int = Field(ge=0)


class ClearToolUses(_Strict):
    type: Literal["clear_tool_uses_20250919"]
    trigger: InputTokens | None = None
    keep: ToolUses | None = None
    clear_at_least: InputTokens | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None


class ClearThinking(_Strict):
    type: Literal["clear_thinking_20251015"]
    keep: ThinkingTurns | Literal["all"] | None = None


class ContextManagement(_Strict):
    edits: list[ClearToolUses | ClearThinking] = Field(default_factory=list, max_length=8)


def apply(req: Any, prompt_tokens: Callable[[Any], int], tokens: Callable[[str], int]) -> tuple[Any, list[dict]]:
    """(the request with its edits applied, `applied_edits`). `prompt_tokens(req)`: the
    request's prompt length; `tokens(text)`: a text's."""
    applied = []
    for edit in req.context_management.edits:
        if isinstance(edit, ClearThinking):
            turns = sum(1 for m in req.messages if m.role == "assistant" and any(
                b["type"] in ("thinking", "redacted_thinking") for b in m.blocks()))
            if turns:
                applied.append({"type": edit.type, "cleared_thinking_turns": turns, "cleared_input_tokens": 0})
            continue
        req, cleared = _clear_tool_uses(req, edit, prompt_tokens, tokens)
        if cleared is not None:
            applied.append(cleared)
    return req, applied


def _clear_tool_uses(req: Any, edit: ClearToolUses, prompt_tokens: Callable, tokens: Callable) -> tuple[Any, dict | None]:
    trigger = edit.trigger.value if edit.trigger else 100_000
    if prompt_tokens(req) <= trigger:
        return req, None
    excluded = set(edit.exclude_tools or [])
    uses = [(i, b["id"], b["name"]) for i, m in enumerate(req.messages) if m.role == "assistant"
            for b in m.blocks() if b["type"] == "tool_use" and b["name"] not in excluded]
    keep = edit.keep.value if edit.keep else 3
    clear = {use_id: name for _, use_id, name in (uses[: len(uses) - keep] if keep else uses)}
    inputs = edit.clear_tool_inputs
    clear_inputs = {n for n in clear.values() if inputs is True or (isinstance(inputs, list) and n in inputs)}
    saved, count, messages = 0, 0, []
    for m in req.messages:
        blocks = m.blocks()
        new = []
        for b in blocks:
            if b["type"] == "tool_result" and b.get("tool_use_id") in clear:
                text = b["content"] if isinstance(b.get("content"), str) else \
                    "".join(r.get("text", "") for r in b.get("content") or [])
                saved += max(tokens(text) - tokens(PLACEHOLDER), 0)
                count += 1
                b = {**b, "content": PLACEHOLDER}
            elif b["type"] == "tool_use" and b["id"] in clear and clear[b["id"]] in clear_inputs:
                saved += tokens(str(b["input"]))
                b = {**b, "input": {}}
            new.append(b)
        messages.append(m.model_copy(update={"content": new}) if new != blocks else m)
    if not count or (edit.clear_at_least and saved < edit.clear_at_least.value):
        return req, None
    return req.model_copy(update={"messages": messages}), {
        "type": edit.type, "cleared_tool_uses": count, "cleared_input_tokens": saved}
