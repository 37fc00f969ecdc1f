"""Phi-4 multimodal's vision LoRA, as transformers runs it: on for prompts with images, off
for text alone (mlx-vlm merges it into the weights at load, so its text prompts run under
it until an image switches modes). The engine keeps the base weights and serves the LoRA
per row, so image and text requests share a batch."""

from __future__ import annotations

import mlx.core as mx
import pytest

from macinfer import LLM
from macinfer.lora.adapter import LoraError
from macinfer.sampling_params import SamplingParams
from tests.vision_models import mlx_vlm_greedy, mlx_vlm_prompt, picture, tiny_vlm_dir

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def phi4mm(tmp_path_factory):
    path = tiny_vlm_dir(tmp_path_factory.mktemp("phi4mm"), "phi4mm")
    llm = LLM(path, kv_cache_gb=0.01, max_model_len=512)
    yield path, llm
    llm.close()


def _ask(text: str, *images) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": text}]}]


def _mlx_vlm_text_greedy(path: str, ids: list[int], n: int, base: bool) -> list[int]:
    """mlx-vlm's language model on a text prompt, its weights as loaded (the vision LoRA
    merged) or switched to the base ones (`apply_base_weights`, transformers' text mode)."""
    from mlx_vlm.utils import load

    model, _ = load(path)
    if base:
        model.apply_base_weights()
    out = list(ids)
    for _ in range(n):
        logits = model.language_model(mx.array([out])).logits
        out.append(int(mx.argmax(logits[0, -1]).item()))
    return out[len(ids):]


def test_text_prompts_run_the_base_weights_and_image_prompts_the_vision_lora(phi4mm):
    path, llm = phi4mm
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": "what is it"}])
    ours = llm.generate([ids], GREEDY)[0].token_ids
    assert ours == _mlx_vlm_text_greedy(path, ids, 6, base=True)
    assert ours != _mlx_vlm_text_greedy(path, ids, 6, base=False)  # (the LoRA shows on text too)
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                               {"type": "text", "text": "what is it"}]}])
    reference = mlx_vlm_greedy(path, rendered, [picture(0)], 6)[0]
    assert llm.chat(_ask("what is it", picture(0)), GREEDY).token_ids == reference


def test_image_and_text_requests_batch_as_they_run_alone(phi4mm):
    _, llm = phi4mm
    convs = [_ask("what is it", picture(i)) if i % 2 == 0 else [{"role": "user", "content": f"say {i}"}]
             for i in range(6)]
    alone = [llm.chat(c, GREEDY).token_ids for c in convs]
    together = [o.token_ids for o in llm.chat(convs, GREEDY)]  # one batch: rows under the LoRA and not
    assert together == alone
    assert len({tuple(t) for t in alone}) > 1


def test_the_vision_lora_is_the_models_own_not_a_served_adapter(phi4mm):
    _, llm = phi4mm
    engine = llm.engine
    own = engine.vision.lora.name
    assert own not in engine.loras and engine.loras.names() == []  # not routable as a model name
    with pytest.raises(LoraError):
        engine.loras.remove(own)
    ids, images = llm._chat_prompt(_ask("what is it", picture(0)))
    with pytest.raises(LoraError):  # its name is not a served adapter's
        engine.add_request(ids, GREEDY, images=images, lora=own)
    text = llm.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(LoraError):
        engine.add_request(text, GREEDY, lora=own)


def test_a_template_that_reads_strings_only_gets_mlx_vlms_image_markers(phi4mm, tmp_path):
    """Phi-4 multimodal's published chat template reads string content only (as nanoLLaVA's
    and Step 3.7's do): image parts become the text mlx-vlm's prompt format writes for them
    ("<|image_1|>" here) before the template runs, and the tokens are mlx-vlm's own on the
    prompt its `apply_chat_template` builds."""
    import shutil

    path = str(tmp_path / "phi4mm-string-template")
    shutil.copytree(phi4mm[0], path)
    with open(f"{path}/chat_template.jinja", "w") as f:
        f.write("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    llm = LLM(path, kv_cache_gb=0.01, max_model_len=512)
    try:
        assert llm.engine.vision.processor.inline_marker == "<|image_1|>"
        rendered = mlx_vlm_prompt(path, "what is it", 1)
        assert "<|image_1|>what is it" in rendered
        two = [{"role": "user", "content": [{"type": "text", "text": "compare "}, {"type": "image", "image": picture(0)},
                                            {"type": "text", "text": " and "}, {"type": "image", "image": picture(1)}]}]
        ids, images = llm._chat_prompt(two)
        first, second = images.spans
        between = llm.tokenizer.decode(ids[first.end:second.offset], skip_special_tokens=False)
        assert "compare " in llm.tokenizer.decode(ids[:first.offset]) and between == " and "  # in order
        assert llm.chat(_ask("what is it", picture(0)), GREEDY).token_ids == mlx_vlm_greedy(path, rendered,
                                                                                            [picture(0)], 6)[0]
    finally:
        llm.close()
