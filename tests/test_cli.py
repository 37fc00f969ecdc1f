"""The CLI on the real bundled model (few tokens) and its error paths."""

import json

import pytest
from click.testing import CliRunner

from macinfer.cli.main import main


@pytest.mark.slow
def test_generate_streams_text(smollm2_gguf):
    r = CliRunner().invoke(main, ["generate", smollm2_gguf, "-p", "What is the capital of France?", "-n", "8", "--kv-cache-gb", "0.05", "--max-model-len", "512"])
    assert r.exit_code == 0, r.output
    assert "Paris" in r.stdout
    assert "tokens, TTFT" in r.stderr


def test_llama_cpp_and_ollama_habits(tiny_llama):
    """-m/--model for MODEL, -c/--ctx-size for --max-model-len, `run` for `chat`."""
    args = ["-p", "hello world", "-n", "4", "--kv-cache-gb", "0.01", "--no-chat-template"]
    plain = CliRunner().invoke(main, ["generate", tiny_llama, *args, "--max-model-len", "64"])
    flag = CliRunner().invoke(main, ["generate", "-m", tiny_llama, *args, "-c", "64"])
    assert plain.exit_code == 0 and flag.exit_code == 0, flag.output
    assert flag.stdout == plain.stdout
    for bad in (["generate", *args], ["generate", tiny_llama, "-m", tiny_llama, *args]):
        r = CliRunner().invoke(main, bad)
        assert r.exit_code == 2 and "give the model once: as MODEL or as -m/--model" in r.output
    assert CliRunner().invoke(main, ["run", "--help"]).exit_code == 0
    beyond = CliRunner().invoke(main, ["generate", tiny_llama, *args, "-c", "4096"])  # trained on 2,048
    assert beyond.exit_code == 1 and "--max-model-len 4096 is beyond this model's trained context of 2048" \
        in beyond.output


def test_generate_with_speculation_prints_the_same_text(tiny_llama):
    args = ["generate", tiny_llama, "-p", "hello world", "-n", "24", "--kv-cache-gb", "0.01", "--no-chat-template"]
    plain = CliRunner().invoke(main, args)
    spec = CliRunner().invoke(main, [*args, "--num-speculative-tokens", "4"])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout and plain.stdout.strip()
    r = CliRunner().invoke(main, [*args, "--num-speculative-tokens", "-1"])
    assert r.exit_code == 2 and "num-speculative-tokens" in r.output


def test_generate_missing_model_exits_nonzero():
    r = CliRunner().invoke(main, ["generate", "./missing.gguf", "-p", "hi"])
    assert r.exit_code == 1
    assert "model path not found: ./missing.gguf" in r.output
    assert "Traceback" not in r.output


def test_generate_rejects_bad_sampling_values():
    r = CliRunner().invoke(main, ["generate", "smollm2", "-p", "hi", "--top-p", "0"])
    assert r.exit_code == 2 and "top_p" in r.output


def test_chat_reads_turns_until_eof(tiny_llama):
    r = CliRunner().invoke(main, ["chat", tiny_llama, "-n", "3", "--kv-cache-gb", "0.01"], input="hello\n/reset\nagain\n")
    assert r.exit_code == 0, r.output
    assert r.output.count(">>> ") == 4


def test_help_for_every_command():
    for cmd in ([], ["generate"], ["chat"], ["convert"]):
        r = CliRunner().invoke(main, cmd + ["--help"])
        assert r.exit_code == 0 and "Usage:" in r.output


def test_models_architectures_lists_every_model_type_with_its_source_and_verdict():
    from macinfer.models import VERDICTS, VLM_VERDICTS

    r = CliRunner().invoke(main, ["models", "architectures"], terminal_width=400)
    runs = sum(v == "runs" for v in VERDICTS.values())
    assert r.exit_code == 0 and f"mlx-lm: {runs} of {len(VERDICTS)} model types run" in r.output
    vlm_runs = sum(v == "runs" for v in VLM_VERDICTS.values())
    assert f"mlx-vlm (model types mlx-lm lacks): {vlm_runs} of {len(VLM_VERDICTS)} model types run" in r.output
    assert "  minimax_m3_vl: MiniMax M3's sparse attention" in r.output and "qwen3_5," in r.output
    assert "k2_horizon," in r.output and "  hy_v4: cache 0 is a HyV4KVCache" in r.output
    r = CliRunner().invoke(main, ["models", "architectures", "--json"])
    assert json.loads(r.output) == {"mlx-lm": VERDICTS, "mlx-vlm": VLM_VERDICTS}


def test_serve_help_lists_the_registry():
    from macinfer.models import ARCHITECTURES

    r = CliRunner().invoke(main, ["serve", "--help"], terminal_width=400)
    assert r.exit_code == 0 and all(a in r.output for a in ARCHITECTURES)


def test_the_command_binds_mlx_to_openblas_on_linux():
    """`macinfer` run directly (not through the Makefile's LD_PRELOAD) loads OpenBLAS before
    MLX: without it the CPU backend's matmuls are ~20x slower."""
    import glob
    import os
    import subprocess
    import sys

    from macinfer import OPENBLAS, openblas_to_preload

    lib = "/usr/lib/x/openblas-pthread/libopenblas.so.0"
    assert openblas_to_preload({}, "", [lib]) == (lib if sys.platform == "linux" else None)
    assert openblas_to_preload({}, "7f00 r-xp /usr/lib/x/libopenblasp-r0.3.so", [lib]) is None  # loaded already
    assert openblas_to_preload({"LD_PRELOAD": lib}, "", [lib]) is None
    assert openblas_to_preload({"MACINFER_PRELOADED": "1"}, "", [lib]) is None
    assert openblas_to_preload({"MACINFER_NO_PRELOAD": "1"}, "", [lib]) is None
    assert openblas_to_preload({}, "", []) is None
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MACINFER_PRELOADED")}
    probe = ("import sys; sys.argv = ['macinfer', '--version']; import macinfer.launch as l\n"
             "try:\n    l.main()\nexcept SystemExit:\n    pass\n"
             "print('libopenblas' in open('/proc/self/maps').read())")
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "macinfer" in r.stdout, r.stderr
    if sys.platform == "linux" and glob.glob(OPENBLAS):
        assert r.stdout.split()[-1] == "True" and "macinfer:" not in r.stderr, r.stdout + r.stderr
