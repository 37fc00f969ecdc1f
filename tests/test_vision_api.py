"""Images through every API, sent by the official clients as their docs show (OpenAI chat
`image_url` and Responses `input_image` data URLs, Anthropic base64 `image` blocks, Ollama
`images`), against `macinfer serve` on a tiny random Qwen2-VL (its processor loaded in a fresh
process, multimodal RoPE through the server): each answers with the tokens the
engine gives the same picture; bad images are a 400 that says which and why."""

from __future__ import annotations

import base64
import io

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.server_process import ServerProcess
from tests.vision_models import picture, tiny_vlm_dir


def _png(seed: int, size=(40, 50)) -> bytes:
    buf = io.BytesIO()
    picture(seed, size).save(buf, format="PNG")
    return buf.getvalue()


def _b64(seed: int) -> str:
    return base64.b64encode(_png(seed)).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tiny_vlm_dir(tmp_path_factory.mktemp("vlm"), "qwen2_vl")
    s = ServerProcess(path, "--served-model-name", "tiny-llava", "--temperature", "0", "--max-tokens-default", "6")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(server):
    """The tokens (as text) for picture 0 and picture 1 with the same question, by OpenAI chat."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

    def ask(seed):
        r = client.chat.completions.create(model="tiny-llava", max_tokens=6, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_b64(seed)}"}},
            {"type": "text", "text": "what is it"}]}])
        return r.choices[0].message.content
    return ask(0), ask(1)


def test_openai_chat_takes_an_image_and_uses_it(reference):
    a, b = reference
    assert a and a != b


def test_models_list_says_it_takes_images(server):
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["input_modalities"] == ["text", "image"]
    assert "vision" in ollama.Client(host=server.url).show("tiny-llava").capabilities


def test_responses_anthropic_and_ollama_send_the_same_image(server, reference):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    r = client.responses.create(model="tiny-llava", max_output_tokens=6, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": f"data:image/png;base64,{_b64(0)}"},
        {"type": "input_text", "text": "what is it"}]}])
    assert r.output_text == reference[0]
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    m = claude.messages.create(model="tiny-llava", max_tokens=6, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(0)}},
        {"type": "text", "text": "what is it"}]}])
    assert m.content[0].text == reference[0]
    o = ollama.Client(host=server.url).chat(model="tiny-llava", options={"num_predict": 6, "temperature": 0},
                                            messages=[{"role": "user", "content": "what is it", "images": [_png(0)]}])
    assert o.message.content == reference[0]
    g = ollama.Client(host=server.url).generate(model="tiny-llava", prompt="what is it", images=[_png(0)],
                                                options={"num_predict": 6, "temperature": 0})
    assert g.response == reference[0]


@pytest.mark.parametrize("part, why", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "not an image"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "does not decode"),
    ({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}, "not an image"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "--allow-image-urls"),
    ({"type": "image_url", "image_url": {"url": "data:image/tiff;base64," + base64.b64encode(
        (lambda b: (picture(0).save(b, format="TIFF"), b.getvalue())[1])(io.BytesIO())).decode()}}, "format"),
    ({"type": "image_url", "image_url": {"url": "/etc/passwd"}}, "only data: URLs"),
    ({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_b64(0)}", "detail": "low"}}, "detail"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio input is not supported"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "video input is not supported"),
])
def test_a_bad_image_is_a_400_that_says_why(server, part, why):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": "tiny-llava", "max_tokens": 2, "messages": [{"role": "user", "content": [part, {"type": "text",
                                                                                               "text": "hi"}]}]})
    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text


def test_a_decompression_bomb_and_a_truncated_file_are_refused(server):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (12000, 12000)).save(buf, format="PNG")  # 144 Mpixels in ~150 KB
    png = _png(0)
    for data, why in ((buf.getvalue(), "pixel"), (png[: len(png) // 2], "damaged")):
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny-llava", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {
                "url": "data:image/png;base64," + base64.b64encode(data).decode()}}]}]})
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_metrics_count_images_and_the_encoder_cache(server):
    def metrics():
        return server.metrics()

    def ask(text, seed, history=()):
        return httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny-llava", "max_tokens": 3, "messages": [
            *history, {"role": "user", "content": [{"type": "image_url", "image_url": {
                "url": f"data:image/png;base64,{_b64(seed)}"}}, {"type": "text", "text": text}]}]}).json()

    first = ask("a question about picture nine", 9)
    m0 = metrics()
    ask("another question about picture nine", 9)  # the same picture, no prefix hit past it: the encoder cache
    m1 = metrics()
    assert m1["macinfer_encoder_cache_hits_total"] == m0["macinfer_encoder_cache_hits_total"] + 1
    assert m1["macinfer_images_encoded_total"] == m0["macinfer_images_encoded_total"]
    turn = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_b64(9)}"}},
                                         {"type": "text", "text": "a question about picture nine"}]},
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny-llava", "max_tokens": 3, "messages": [
        *turn, {"role": "user", "content": "and then?"}]})
    assert r.status_code == 200
    m2 = metrics()  # the next turn: its prefix (the picture's positions) cached, nothing encoded or looked up
    assert m2["macinfer_encoder_cache_hits_total"] == m1["macinfer_encoder_cache_hits_total"]
    assert m2["macinfer_images_encoded_total"] == m1["macinfer_images_encoded_total"]
    assert m2["macinfer_images_total"] == m1["macinfer_images_total"] + 1
    per_image = m1["macinfer_image_tokens_total"] - m0["macinfer_image_tokens_total"]  # the same picture's tokens
    assert per_image > 0 and m2["macinfer_image_tokens_total"] == m1["macinfer_image_tokens_total"] + per_image
