"""`--chat-template FILE|NAME`: a Jinja file, inline Jinja, or a built-in template that
replaces the one the model ships (as llama-server's and vLLM's `--chat-template` do).

Built-ins: `chatml` (Qwen, SmolLM, many fine-tunes), `llama3`, and `hermes`: ChatML that
describes `tools` in the system block and writes calls as `<tool_call>{json}</tool_call>`
(NousResearch's Hermes format, what `--tool-call-parser hermes` reads).
"""

from __future__ import annotations

import os

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

HERMES = (
    "{% set first_system = messages and messages[0]['role'] == 'system' %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if first_system %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "You may call one or more functions to assist with the user query. You are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif first_system %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if not (loop.first and first_system) %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant\n"
    "{% if m['content'] %}{{ m['content'] }}\n{% endif %}"
    "{% for tc in m['tool_calls'] %}<tool_call>\n{\"name\": {{ tc['function']['name'] | tojson }}, \"arguments\": "
    "{% if tc['function']['arguments'] is string %}{{ tc['function']['arguments'] }}"
    "{% else %}{{ tc['function']['arguments'] | tojson }}{% endif %}}\n</tool_call>\n{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BUILTIN = {"chatml": CHATML, "llama3": LLAMA3, "hermes": HERMES}


class ChatTemplateOptionError(ValueError):
    pass


def resolve_chat_template(value: str) -> str:
    """The Jinja source `--chat-template` names: a built-in, a file, or inline Jinja; checked
    to compile, so a broken template is refused at load, not on the first request."""
    if value in BUILTIN:
        source = BUILTIN[value]
    elif os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            source = f.read()
    elif "{%" in value or "{{" in value:
        source = value
    else:
        raise ChatTemplateOptionError(f"--chat-template {value!r}: not a file, not Jinja, and not a built-in "
                                      f"({', '.join(BUILTIN)})")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(source)
    except TemplateSyntaxError as e:
        raise ChatTemplateOptionError(f"--chat-template {value!r}: Jinja error at line {e.lineno}: {e.message}") from None
    return source
