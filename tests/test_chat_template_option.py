"""`--chat-template FILE|NAME` (issue #24): a built-in, a Jinja file or inline Jinja replaces
the model's template on `serve`, `generate`, `chat` and `LLM`; a bad one is refused at load."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from macinfer.text.chat_templates import BUILTIN, ChatTemplateOptionError, resolve_chat_template
from macinfer.cli.main import main
from macinfer.engine.llm_engine import EngineConfig, LLMEngine

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_resolves_builtins_files_and_inline_jinja(tmp_path):
    assert resolve_chat_template("chatml") == BUILTIN["chatml"]
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    assert resolve_chat_template(str(f)) == f.read_text()
    assert resolve_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    with pytest.raises(ChatTemplateOptionError, match="not a file, not Jinja, and not a built-in"):
        resolve_chat_template("chatmll")
    with pytest.raises(ChatTemplateOptionError, match="Jinja error at line 1"):
        resolve_chat_template("{% for m in messages %}")


def test_engine_renders_with_the_given_template(tiny_llama, tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")
    engine = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01, chat_template=str(f)))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert engine.tokenizer.apply_chat_template(msgs) == "[system] be brief\n[user] hi\n[assistant] "
    chatml = LLMEngine(tiny_llama, EngineConfig(kv_cache_gb=0.01, chat_template="chatml"))
    assert chatml.tokenizer.apply_chat_template(msgs) == \
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_hermes_describes_tools_and_writes_calls_and_results(smollm2_engine):
    tok = smollm2_engine.tokenizer
    saved = tok.hf.chat_template
    try:
        assert tok.set_chat_template(BUILTIN["hermes"]) == []  # SmolLM2's vocabulary has ChatML's markers
        msgs = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
        text = tok.apply_chat_template(msgs, tools=TOOLS)
        assert text.startswith("<|im_start|>system\nYou help.\n\nYou may call one or more functions")
        assert json.dumps(TOOLS[0], ensure_ascii=False) in text or '"get_weather"' in text
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
        assert "<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>" in text
        assert text.endswith("<|im_start|>assistant\n")
        without = tok.apply_chat_template(msgs[:2])
        assert "<tools>" not in without and without.startswith("<|im_start|>system\nYou help.<|im_end|>")
    finally:
        tok.hf.chat_template = saved


def test_cli_option_and_its_errors(tiny_llama):
    r = CliRunner().invoke(main, ["generate", tiny_llama, "-p", "hi", "-n", "2", "--kv-cache-gb", "0.01",
                                  "--chat-template", "chatml"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["generate", tiny_llama, "-p", "hi", "-n", "2", "--kv-cache-gb", "0.01",
                                  "--chat-template", "nope"])
    assert r.exit_code != 0 and "Error: --chat-template 'nope': not a file" in r.output
    assert "Traceback" not in r.output
    for cmd in ("serve", "chat", "generate"):
        assert "--chat-template FILE|NAME" in CliRunner().invoke(main, [cmd, "--help"]).output


def test_llm_takes_it(tiny_llama):
    from macinfer import LLM

    with LLM(tiny_llama, kv_cache_gb=0.01, chat_template="llama3") as llm:
        ids = llm.apply_chat_template([{"role": "user", "content": "hi"}])
        assert llm.engine.tokenizer.decode(ids, skip_special_tokens=False).endswith(
            "<|start_header_id|>assistant<|end_header_id|>\n\n")
