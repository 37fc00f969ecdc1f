"""Tokenizer directories written by the tests, with the features of the main
chat families: a Llama-3-style one, a Qwen3-style one, a Mistral/SentencePiece
one and a Gemma-style one. Vocabularies are small BPEs trained here; the chat
templates are written for these tests to exercise what real ones use
(`bos_token`, loop controls, `tojson` arguments, tools, documents, tool calls
and results, `enable_thinking`, `raise_exception`)."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "What is the weather in Paris today? It is sunny and 21 degrees.",
    "You are a helpful assistant. Call tools when you need them.",
    "def add(a, b):\n    return a + b\n",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "Bonjour, ça va? Über naïve café. 日本語のテキスト 🙂",
] * 20

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- for m in messages %}{%- if m.role == 'system' %}{%- set ns.system = m.content %}{%- break %}{%- endif %}{%- endfor %}
{%- if ns.system or tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + ns.system }}
{%- if tools %}{{- '\\nYou may call these functions:\\n' }}{%- for t in tools %}{{- t | tojson(indent=4) + '\\n' }}{%- endfor %}{%- endif %}
{%- if documents %}{%- for d in documents %}{{- 'Document: ' + d.title + '\\n' + d.text + '\\n' }}{%- endfor %}{%- endif %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}{%- continue %}{%- endif %}
{%- if m.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}
{%- elif m.tool_calls %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- for tc in m.tool_calls %}{{- '{"name": "' + tc.function.name + '", "parameters": ' + tc.function.arguments | tojson + '}' }}{%- endfor %}
{{- '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim }}
{%- if not (loop.last and m.role == 'assistant') %}{{- '<|eot_id|>' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

QWEN3_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + t | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}{%- continue %}
{%- elif m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{%- set content = m.content or '' %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{{- '<|im_start|>assistant\\n' }}{% generation %}{{- content }}{% endgeneration %}
{%- for tc in m.tool_calls or [] %}{{- '\\n<tool_call>\\n{"name": "' + tc.function.name + '", "arguments": ' + (tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}
{%- if not loop.last %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

MISTRAL_TEMPLATE = """{{- bos_token }}
{%- if tools %}{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}
{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}
{{- '[INST] ' + m.content + '[/INST]' }}
{%- elif m.role == 'assistant' %}
{%- if m.tool_calls %}{{- '[TOOL_CALLS]' + m.tool_calls | map(attribute='function') | list | tojson }}{%- else %}{{- m.content }}{%- endif %}
{%- if not loop.last %}{{- eos_token }}{%- endif %}
{%- elif m.role == 'tool' %}{{- '[TOOL_RESULTS]' + m.content + '[/TOOL_RESULTS]' }}
{%- else %}{{- raise_exception('Only user, assistant and tool roles are supported') }}
{%- endif %}
{%- endfor %}"""

GEMMA_TEMPLATE = """{{- bos_token }}
{%- if messages[0].role == 'system' %}{{- raise_exception('System role not supported') }}{%- endif %}
{%- for m in messages %}
{%- set role = 'model' if m.role == 'assistant' else m.role %}
{{- '<start_of_turn>' + role + '\\n' + m.content | trim }}
{%- if not (loop.last and m.role == 'assistant') %}{{- '<end_of_turn>\\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"""


def _byte_level(specials: list[str], added: list[str], bos: str | None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens(added)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _sentencepiece(specials: list[str], bos: str) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", *specials, *bytes_], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


FAMILIES = {
    "llama3": dict(
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
        bos="<|begin_of_text|>", eos="<|eot_id|>", template=LLAMA3_TEMPLATE,
        generation_eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    "qwen3": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        added=["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        bos=None, eos="<|im_end|>", template=QWEN3_TEMPLATE, pad="<|endoftext|>"),
    "mistral": dict(
        specials=["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
        bos="<s>", eos="</s>", template=MISTRAL_TEMPLATE, sentencepiece=True),
    "gemma": dict(
        specials=["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        bos="<bos>", eos="<eos>", template=GEMMA_TEMPLATE, sentencepiece=True,
        generation_eos=["<eos>", "<end_of_turn>"]),
}


def write_tokenizer_dir(path: str, family: str) -> str:
    spec = FAMILIES[family]
    os.makedirs(path, exist_ok=True)
    if spec.get("sentencepiece"):
        tok = _sentencepiece(spec["specials"], spec["bos"])
    else:
        tok = _byte_level(spec["specials"], spec.get("added", []), spec["bos"])
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": spec["eos"], "chat_template": spec["template"],
           "clean_up_tokenization_spaces": False}
    if spec["bos"]:
        cfg["bos_token"] = spec["bos"]
    if spec.get("pad"):
        cfg["pad_token"] = spec["pad"]
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    if spec.get("generation_eos"):
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": [tok.token_to_id(t) for t in spec["generation_eos"]]}, f)
    return path


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

TOOL_HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"},
]
