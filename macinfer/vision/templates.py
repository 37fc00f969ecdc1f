"""The chat templates the engine writes for a vision family whose checkpoint ships none (its
processor writes the prompt: PaliGemma's prefix-LM form, GOT-OCR's conversation, Moondream's
query), and the edits it makes to one that leaves out what the family's processor writes
(BOS first)."""

from __future__ import annotations

from typing import Any


PREFIX_LM_TEMPLATE = (
    "{% if messages | length != 1 or messages[0]['role'] != 'user' %}{{ raise_exception('this model is a "
    "prefix LM with no chat format: it takes one user message (an instruction such as \\'caption en\\' "
    "and its images)') }}{% endif %}{% set m = messages[0] %}{% if m['content'] is string %}"
    "{{ bos_token }}{{ m['content'] }}{% else %}{% for p in m['content'] if p['type'] == 'image' %}<image>"
    "{% endfor %}{{ bos_token }}{% for p in m['content'] if p['type'] == 'text' %}{{ p['text'] }}{% endfor %}"
    "{% endif %}{{ '\\n' }}")  # (Jinja drops a template's last newline)


# GOT-OCR ships no chat template: its processor writes MPT's conversation (mlx-vlm's pieces of
# it, `processor_fixes.got_conversation`) around the user's text, an image where it says `<image>`.
def _got_template() -> str:
    from macinfer.vision.processor_fixes import got_conversation

    system, sep, user, assistant = got_conversation()
    turn = user.removesuffix("user\n")  # "<|im_start|>": a role's head is it, the role, a newline
    return ("{% if messages[0]['role'] == 'system' %}" + turn + "system\n{{ messages[0]['content'] }}"
            "{% else %}" + system + "{% endif %}" + sep +
            "{% for m in messages if m['role'] != 'system' %}" + turn + "{{ m['role'] }}\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
            + sep + "{% endfor %}{% if add_generation_prompt %}" + assistant + "{% endif %}")


def _moondream_template(tokenizer: Any) -> str:
    """Moondream's (2 and 3) query format, as its processor writes it around a question: the image (with
    BOS: its placeholder id is BOS's, the processor writes BOS and 729 of them), the question,
    its answer token. One user message; a prompt with no image starts with BOS instead."""
    from mlx_vlm.models.moondream3.processing_moondream3 import ANSWER_ID

    return ("{% if messages | length != 1 or messages[0]['role'] != 'user' %}{{ raise_exception('this model answers "
            "one question about one picture: one user message') }}{% endif %}{% set m = messages[0] %}"
            "{% if m['content'] is string %}{{ bos_token }}{% set text = m['content'] %}{% else %}"
            "{% if m['content'] | selectattr('type', 'equalto', 'image') | list %}<image>{% else %}{{ bos_token }}"
            "{% endif %}{% set text = m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
            "| join('') %}{% endif %}{{ '\\n\\nQuestion: ' + text + '\\n\\nAnswer: ' }}"
            + tokenizer.decode([ANSWER_ID]))


# Families with no chat template of their own: the engine's, written once at load.
OWN_TEMPLATES = {"got": lambda tokenizer: _got_template(), "moondream2": _moondream_template,
                 "moondream3": _moondream_template}


def bos_first(tokenizer: Any, or_eos: bool = False) -> None:
    """The template made to write BOS first (`or_eos`: EOS where the tokenizer has no BOS,
    Molmo's rule for Qwen2's tokenizer), where it does not already."""
    template, bos, name = tokenizer.chat_template, tokenizer.bos_token_id, "bos_token"
    if bos is None and or_eos:
        bos, name = tokenizer.eos_token_id, "eos_token"
    if not isinstance(template, str) or bos is None:
        return
    if tokenizer.encode_chat([{"role": "user", "content": "x"}])[:1] != [bos]:
        tokenizer.set_chat_template("{{ " + name + " }}" + template)
