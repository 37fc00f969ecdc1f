"""The first run, as a new user meets it: picking a Python, the default KV
budget, the chat REPL."""

import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from macinfer.cli.main import main
from macinfer.engine.cache_plan import DEFAULT_TOKENS_PER_SEQ
from macinfer.engine.llm_engine import EngineConfig, LLMEngine

ROOT = Path(__file__).resolve().parent.parent


def _fake_python(bin_dir: Path, name: str, version: tuple[int, int]) -> None:
    exe = bin_dir / name
    exe.write_text(f"#!/bin/sh\n# pretends to be Python {version}\n"
                   f"exit $(( {version[0]} * 100 + {version[1]} < 310 ))\n")
    exe.chmod(0o755)


def _find_python(bin_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    return subprocess.run(["/bin/sh", str(ROOT / "scripts" / "find_python.sh")], capture_output=True, text=True,
                          env=env)


def test_make_picks_a_new_enough_python(tmp_path):
    # /usr/bin may hold a real python3: shadow every name the script tries.
    for name in ("python3.13", "python3.12", "python3.11", "python3.10", "python3", "python"):
        _fake_python(tmp_path, name, (3, 9))
    p = _find_python(tmp_path)
    assert p.returncode == 1 and "needs Python 3.10 or newer" in p.stderr and "brew install" in p.stderr
    _fake_python(tmp_path, "python3.12", (3, 12))
    p = _find_python(tmp_path)
    assert p.returncode == 0 and p.stdout.strip() == str(tmp_path / "python3.12")


def test_makefile_replaces_a_venv_from_an_old_python(tmp_path):
    """The set-up rule, run on a copy of the Makefile: a .venv whose python is 3.9 is removed
    before the new one is made (the fake `python -m venv` then stops the run)."""
    import shutil

    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'Python 3.9.6' && exit 0\nexit 1\n")
    (bin_dir / "python").chmod(0o755)
    new_python = tmp_path / "py312"
    new_python.write_text("#!/bin/sh\necho \"venv made by 3.12: $*\"\nexit 3\n")
    new_python.chmod(0o755)
    p = subprocess.run(["make", "-C", str(tmp_path), ".venv/.installed", f"PYTHON={new_python}"],
                       capture_output=True, text=True)
    assert "removing .venv: it was made by Python 3.9.6" in p.stdout
    assert "venv made by 3.12: -m venv .venv" in p.stdout
    assert not (bin_dir / "python").exists()


def test_default_kv_budget_is_sized_to_the_configuration(tiny_llama):
    engine = LLMEngine(tiny_llama, EngineConfig(max_num_seqs=8))
    want_tokens = max(engine.max_model_len, 8 * DEFAULT_TOKENS_PER_SEQ)
    assert engine.kv_cache.num_blocks * engine.kv_cache.block_size == want_tokens


def test_chat_repl_commands_and_context_trimming(tiny_llama):
    long_line = "tell me more " * 3
    script = "/help\n" + "".join(f"{long_line}{i}\n" for i in range(6)) + "/reset\nhi\n/bogus\n/exit\n"
    r = CliRunner().invoke(main, ["chat", tiny_llama, "-n", "8", "--kv-cache-gb", "0.01", "--max-model-len", "160",
                                  "--system", "be brief"], input=script)
    assert r.exit_code == 0, r.output
    assert "/reset" in r.output and "/system TEXT" in r.output  # /help
    assert "[dropped" in r.output  # the conversation outgrew 160 tokens and went on
    assert "[conversation cleared]" in r.output and "unknown command /bogus" in r.output
    assert r.output.count(">>> ") == 11


def test_chat_repl_message_longer_than_the_context(tiny_llama):
    r = CliRunner().invoke(main, ["chat", tiny_llama, "-n", "4", "--kv-cache-gb", "0.01", "--max-model-len", "64"],
                           input="x" * 500 + "\nhi\n")
    assert r.exit_code == 0, r.output
    assert "longer than the context" in r.output and r.output.count(">>> ") == 3


@pytest.mark.parametrize("where", [["--log-level", "info", "generate"], ["generate", "--log-level", "info"],
                                   ["generate", "-v"]])
def test_log_level_before_or_after_the_subcommand(tiny_llama, where):
    args = where + [tiny_llama, "-p", "hi", "-n", "2", "--kv-cache-gb", "0.01", "--no-chat-template"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "loading " in r.output and "loaded " in r.output
