"""What every tiny vision checkpoint shares: a chat template that renders image parts as the
family's marker, the tiny language model's sizes, and an offline byte tokenizer."""

from __future__ import annotations

from tests.helpers import byte_tokenizer


# A chat template that renders image parts as the family's marker (real checkpoints ship their own).
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}MARKER{% else %}"
            "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}<assistant>")


TEXT = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 300,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "tie_word_embeddings": False}


def _tokenizer(specials: list[str], marker: str, named: dict | None = None):
    from transformers import PreTrainedTokenizerFast

    tok = byte_tokenizer()
    tok.add_special_tokens(specials)
    # Every id the 300-row model can emit is a token (mlx-vlm's detokenizer fails on others).
    tok.add_tokens([f"<unused_{i}>" for i in range(300 - tok.get_vocab_size())])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<unk>",
                                   **({"extra_special_tokens": named} if named else {}))
    fast.chat_template = TEMPLATE.replace("MARKER", marker)
    return fast
