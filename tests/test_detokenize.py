"""Text that is exactly the tokenizer's: the first generated space of SentencePiece
vocabularies, streamed deltas against a decode of the whole text, and logprob bytes
that rebuild it (#20 items 1 and 3). Vocabularies are written by the tests."""

import numpy as np
from hypothesis import given, settings, strategies as st

from macinfer.gguf.file import GGUFFile
from macinfer.text.tokenizer import IncrementalDetokenizer, TokenizerWrapper, token_text
from tests.gguf_writer import write_gguf
from tests.helpers import tiny_config
from tests.tokenizer_fixtures import write_tokenizer_dir

import pytest

TEXTS = ["The quick brown fox", "日本語のテキスト 🙂 café", "def add(a, b):\n    return a + b", "Paris 21 degrees."]


@pytest.fixture(scope="module", params=["mistral", "gemma", "qwen3", "llama3"])
def tok(request, tmp_path_factory) -> TokenizerWrapper:
    return TokenizerWrapper.from_dir(write_tokenizer_dir(str(tmp_path_factory.mktemp(request.param)), request.param), {})


@pytest.fixture(scope="module")
def gguf_spm_tok(tmp_path_factory) -> TokenizerWrapper:
    """A GGUF with tokenizer model `llama` (SentencePiece), as llama.cpp writes it."""
    path = str(tmp_path_factory.mktemp("gguf") / "spm.gguf")
    write_gguf(path, tiny_config("llama", vocab_size=300), {"token_embd.weight": np.zeros((300, 64), np.float32)})
    return TokenizerWrapper.from_gguf_metadata(GGUFFile(path).metadata)


def _stream(tok: TokenizerWrapper, prompt: list[int], output: list[int]) -> str:
    d = IncrementalDetokenizer(tok, True, prompt)
    return "".join(d.add(t) for t in output) + d.flush()


def _expected(tok: TokenizerWrapper, prompt: list[int], output: list[int]) -> str:
    whole, head = tok.decode(prompt + output), tok.decode(prompt)
    assert whole.startswith(head)
    return whole[len(head):]


def test_first_generated_token_keeps_its_space(tok):
    prompt = tok.encode("The quick brown")
    output = tok.encode(" The quick", add_special_tokens=False)
    if tok.id_to_token(output[0]) == "▁":  # a lone space piece: take the word as one token
        output = output[1:]
    streamed = _stream(tok, prompt, output)
    assert streamed == _expected(tok, prompt, output)
    assert streamed.startswith(" ")  # the whole text is "The quick brown The quick"


def test_gguf_sentencepiece_first_space(gguf_spm_tok):
    tok = gguf_spm_tok
    prompt, output = [1, tok.tokenizer.token_to_id("▁tok5")], [tok.tokenizer.token_to_id("▁tok7")]
    assert _stream(tok, prompt, output) == " tok7" == _expected(tok, prompt, output)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_streamed_deltas_equal_the_decode_of_the_whole_text(tok, data):
    vocab = tok.vocab_size
    prompt = tok.encode(data.draw(st.sampled_from(TEXTS)))
    output = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24))
    if tok.decode(prompt).endswith("\ufffd"):
        return
    assert _stream(tok, prompt, output) == _expected(tok, prompt, output)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_joined_logprob_bytes_are_the_text(tok, data):
    """Any text (CJK, emoji, accents), tokenized: each token's `bytes` joined give its
    UTF-8, whatever characters the tokens split."""
    text = data.draw(st.sampled_from(TEXTS)) + data.draw(st.text(alphabet="日本語🙂éa b\n", max_size=12))
    ids = tok.encode(text, add_special_tokens=False)
    joined = b"".join(tok.token_bytes(i) for i in ids)
    prompt = tok.encode("x")
    assert joined.decode("utf-8") == _expected(tok, prompt, ids)


def test_token_strings_of_split_characters():
    assert token_text("日".encode()) == "日"
    assert token_text("🙂".encode()[:2]) == "bytes:\\xf0\\x9f"
