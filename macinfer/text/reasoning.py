"""Reasoning split from the answer: `<think>...</think>` (Qwen3, DeepSeek-R1, QwQ,
SmolLM3...), as `reasoning_content`, whole or streamed.

Some templates open the think block in the generation prompt (the output starts
inside it and only `</think>` appears); `starts_inside` says so, from the prompt.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def _source(chat_template: str | dict | None) -> str:
    """A chat template's Jinja (all of a named set of templates)."""
    if isinstance(chat_template, dict):
        return " ".join(str(v) for v in chat_template.values())
    return chat_template or ""


def template_reasons(chat_template: str | dict | None) -> bool:
    return END in _source(chat_template)


def effort_kwargs(effort: str | None, chat_template: str | dict | None) -> dict | None:
    """Chat-template variables for a reasoning effort, as the template offers them: its own
    `reasoning_effort` (gpt-oss: low/medium/high), else `enable_thinking` (Qwen3, SmolLM3...:
    off for "none"/"minimal", on otherwise). None: the template has no thinking control."""
    if effort is None:
        return {}
    source = _source(chat_template)
    if "reasoning_effort" in source:
        return {"reasoning_effort": {"none": "low", "minimal": "low", "xhigh": "high", "max": "high"}.get(effort, effort)}
    if "enable_thinking" in source:
        return {"enable_thinking": effort not in ("none", "minimal")}
    return None


def prompt_opens_think(prompt_text: str) -> bool:
    return prompt_text.rstrip().endswith(START)


def _partial(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningStream:
    """Feed text deltas; get (reasoning delta, content delta) back."""

    def __init__(self, starts_inside: bool = False):
        self.state = "reasoning" if starts_inside else "start"  # start: no text yet
        self.pending = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        text = self.pending + delta
        self.pending = ""
        reasoning = content = ""
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(START):
                    text, self.state = stripped[len(START):], "reasoning"
                    continue
                if START.startswith(stripped) and not final:  # maybe a marker still arriving
                    self.pending = text
                    return reasoning, content
                self.state = "content"
            if self.state == "reasoning":
                at = text.find(END)
                if at >= 0:
                    reasoning += text[:at]
                    text, self.state = text[at + len(END):], "after"
                    continue
                keep = 0 if final else _partial(text, END)
                reasoning += text[: len(text) - keep]
                self.pending = text[len(text) - keep:]
                return reasoning, content
            if self.state == "after":  # the blank lines that follow </think> are not the answer
                text = text.lstrip("\n")
                if not text:
                    break
                self.state = "content"
            content += text
            text = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)


def split(text: str, starts_inside: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a complete output."""
    s = ReasoningStream(starts_inside)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2


def track_thinking(seq, tokenizer) -> None:
    """A thinking budget, after each new output token: count the think block's tokens; at
    the budget, the closing marker is forced as the next tokens (the model may close it
    earlier itself)."""
    p, out = seq.params, seq.output_token_ids
    tail = tokenizer.decode(out[-16:], skip_special_tokens=False)
    if seq.thinking == "before":
        if not p.thinking_open:  # the block opens in the output (its marker is not counted)
            if START in tail:
                seq.thinking = "open"
            elif len(out) > 16:  # no think block: nothing to budget
                seq.thinking = "closed"
            return
        seq.thinking = "open"  # opened by the prompt: this token is the block's first
    if END in tail:
        seq.thinking = "closed"
        return
    seq.thinking_tokens += 1
    if seq.thinking_tokens >= p.thinking_budget:
        seq.forced_token_ids = list(p.thinking_end)
        seq.thinking = "closed"
