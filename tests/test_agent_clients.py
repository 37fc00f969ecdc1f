"""Claude Code and Codex CLI, installed from npm by `make setup`, run against
`macinfer serve` on the bundled SmolLM2 with their defaults: only a base URL and a
dummy key (Claude Code: `claude --bare -p`), a provider block (Codex: `codex exec`).
Every request they send goes through a recording proxy and must get a 2xx with a
complete answer.

Claude Code's server samples greedily (`serve --temperature 0`: the agents send
no temperature). Greedy SmolLM2 answers every Claude Code prompt tried with a
tool call, again after each result, so the agent loop never ends: the run with
its default tools is checked over its first turns (each a valid call of a listed
tool, fed back as a tool result), and the run that must exit 0 with a printed
answer is the same command with `--tools ""`. Whether greedy SmolLM2 ends that
answer or repeats itself to Claude Code's 128,000-token cap depends on the prompt,
which carries the working directory and the date, and on the last bits of the
weights (it flipped when their float32 expansion changed), so a run still going after
CLAUDE_SECONDS is stopped and the next of three prompts is tried: one must exit 0.
Greedy SmolLM2 under Codex's
prompt repeats itself for thousands of tokens, so Codex's server samples with a fixed
seed (`--seed 0`, temperature 1: the same prompt gives the same run) and caps answers at
512 tokens. Codex's prompt carries the date and the working directory, so the run still
changes from day to day; replayed on a recorded request with 8 seeds, about one answer
in eight runs on to the cap (a tool call's JSON that never closes: 0 of 8 at temperature
1, 1 with top-p 0.9, 2 with top-k 40, 4 at temperature 0.7), and a run may also call
tools turn after turn. Codex ends the first case with its `max_output_tokens` error; the
server has answered in full in both, so such a run is followed by `codex exec` with the
next of three prompts (Codex's 9k-token instructions come from the prefix cache), and
one of them must exit 0 and print an answer, every request of every run a 2xx.

Codex's own prompt (instructions and ~40 tools) is ~9,000 tokens, more than
SmolLM2's 8,192-token trained context, so its server stretches RoPE to 16k with
YaRN (`-c 16384 --rope-scaling yarn`), as a user of this model would. Its prompt takes
~100 s to the first token on two idle cores (more with a CPU hog beside the suite: hence
Codex's 900 s)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from tests.recording_proxy import RecordingProxy
from tests.server_process import ServerProcess

pytestmark = pytest.mark.slow
CODEX_MAX_TOKENS = 512
CODEX_MAX_TURNS = 6
CODEX_PROMPTS = ("Say hello in one word.", "Reply with the one word hello.", "Greet me in one word.")
CLAUDE_PROMPTS = ("What is 2+2?", "Say hello in one word.", "Reply with the one word hello.")
CLAUDE_SECONDS = 60  # a short answer takes ~5 s
BIN = os.path.join(os.path.dirname(__file__), "agent_clients", "node_modules", ".bin")


def _client(name: str) -> str:
    path = os.path.join(BIN, name)
    if not os.path.exists(path):
        message = f"{name} is not installed (make setup installs it with npm into tests/agent_clients)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def _run(cmd: list[str], env: dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def _summary(proxy: RecordingProxy) -> list[tuple]:
    """Each request: method, path, status (None: no answer yet), seconds (None: in flight), bytes
    relayed, response tail."""
    return [(r["method"], r["path"], r["status"], r.get("seconds"), r.get("bytes", 0), r.get("response", "")[-300:])
            for r in list(proxy.records) + list(proxy.in_flight)]


def _check(proxy: RecordingProxy, result: subprocess.CompletedProcess, api_path: str) -> None:
    summary = _summary(proxy)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-2000:], summary)
    assert [r for r in proxy.records if r["path"].startswith(api_path)], summary
    failed = [s for s in summary if not (s[2] and 200 <= s[2] < 300)]
    assert not failed, failed


def _env(home: str) -> dict[str, str]:
    keep = ("PATH", "LANG", "TMPDIR", "SYSTEMROOT")
    return {**{k: os.environ[k] for k in keep if k in os.environ}, "HOME": home, "NO_COLOR": "1"}


def _claude_env(home: str, proxy: RecordingProxy) -> dict[str, str]:
    return {**_env(home), "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{proxy.port}", "ANTHROPIC_API_KEY": "sk-dummy"}


def _sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_claude_code_with_its_defaults(tmp_path):
    claude = _client("claude")
    server = ServerProcess("smollm2", "--temperature", "0")
    proxy = RecordingProxy(server.port)
    try:
        # Its default tools: followed over three model turns (the agent loop does not end, see above).
        proc = subprocess.Popen([claude, "--bare", "-p", "Say hello in one word."], env=_claude_env(str(tmp_path), proxy),
                                cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 240
        turns = lambda: [r for r in proxy.records if r["path"].startswith("/v1/messages")]  # noqa: E731
        while len(turns()) < 3 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        proc.kill()
        out, err = proc.communicate()
        assert proc.returncode == 0 or len(turns()) >= 3, (out[-2000:], err[-2000:], proxy.records)
        statuses = [(r["method"], r["path"], r["status"]) for r in proxy.records]
        assert all(200 <= s < 300 for *_, s in statuses), statuses
        listed = {t["name"] for t in turns()[0]["body"]["tools"]}
        for i, turn in enumerate(turns()[:3]):
            events = _sse_events(turn["response"])
            assert events[-1]["type"] == "message_stop", turn["response"][-500:]
            calls = [e["content_block"] for e in events if e["type"] == "content_block_start"
                     and e["content_block"]["type"] == "tool_use"]
            assert {c["name"] for c in calls} <= listed
            if i and calls:  # Claude Code ran the previous call and sent its result back
                assert any(b.get("type") == "tool_result" for m in turn["body"]["messages"]
                           if isinstance(m["content"], list) for b in m["content"])

        # The same command without tools: exits 0 and prints the answer.
        tried = []
        for prompt in CLAUDE_PROMPTS:
            proxy.records.clear()
            result, why = _attempt([claude, "--bare", "--tools", "", "-p", prompt], _claude_env(str(tmp_path), proxy),
                                   str(tmp_path), proxy, server, "/v1/messages", seconds=CLAUDE_SECONDS)
            if result is not None:
                break
            _answered(proxy)
            tried.append((prompt, why))
        assert result is not None, tried
        _check(proxy, result, "/v1/messages")
        assert result.stdout.strip()  # the model's answer, printed
    finally:
        proxy.close()
        server.stop()


def _attempt(cmd: list[str], env: dict[str, str], cwd: str, proxy: RecordingProxy, server: ServerProcess,
             api_path: str, max_turns: int | None = None, seconds: float | None = None
             ) -> tuple[subprocess.CompletedProcess | None, str]:
    """One agent run: (its result, "") when it ended by itself, or (None, why) when the model
    kept calling tools past `max_turns` model requests or the run went on past `seconds`
    (the run is then stopped). Past 900 s the test fails."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    turns = lambda: [r for r in list(proxy.records) if r["path"].startswith(api_path)]  # noqa: E731
    start = time.time()
    soft = start + (seconds if seconds is not None else 900)
    while proc.poll() is None and (max_turns is None or len(turns()) <= max_turns) and time.time() < soft:
        time.sleep(0.5)
    if proc.poll() is None:
        proc.kill()
        out, err = proc.communicate()
        if seconds is None and time.time() >= soft:
            pytest.fail(f"{os.path.basename(cmd[0])} ran past 900 s; its stderr: {err[-1500:]!r}; the requests: "
                        f"{_summary(proxy)}; the server's log: {server.stop()[-3000:]}")
        if time.time() >= soft:
            return None, f"still answering after {seconds} s"
        return None, f"still calling tools after {len(turns())} model requests"
    out, err = proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), ""


def _answered(proxy: RecordingProxy) -> None:
    """The model's doing, not the server's, when a run is stopped: every finished request was
    answered in full (a stopped run may leave one in flight, which its disconnect aborts)."""
    failed = [(r["path"], r["status"]) for r in list(proxy.records) if not 200 <= r["status"] < 300]
    assert not failed, (failed, _summary(proxy))


def test_codex_exec_with_its_defaults(tmp_path):
    codex = _client("codex")
    server = ServerProcess("smollm2", "--seed", "0", "--max-tokens-default", str(CODEX_MAX_TOKENS), "-c", "16384",
                           "--rope-scaling", "yarn")
    proxy = RecordingProxy(server.port)
    try:
        home, work = tmp_path / "home", tmp_path / "work"
        (home / ".codex").mkdir(parents=True)
        work.mkdir()
        (home / ".codex" / "config.toml").write_text(
            'model = "smollm2"\nmodel_provider = "macinfer"\n\n[model_providers.macinfer]\nname = "macinfer"\n'
            f'base_url = "http://127.0.0.1:{proxy.port}/v1"\nwire_api = "responses"\n'
            # A CPU-served model may stream nothing for minutes (its 9k-token prompt, an answer held
            # back while it may be a tool call): Codex's 5-minute idle timeout then retries (seen in CI).
            'stream_idle_timeout_ms = 1800000\n')
        if shutil.which("git"):  # codex exec runs in a git repository unless told otherwise
            subprocess.run(["git", "init", "-q"], cwd=work, check=True)
        tried = []
        for prompt in CODEX_PROMPTS:
            proxy.records.clear()
            result, why = _attempt([codex, "exec", prompt], _env(str(home)), str(work), proxy, server,
                                   "/v1/responses", max_turns=CODEX_MAX_TURNS)
            if result is not None:
                capped = result.returncode != 0 and "reason: max_output_tokens" in result.stdout + result.stderr
                if not capped:
                    break
                why = f"an answer ran to the {CODEX_MAX_TOKENS}-token cap"
            _answered(proxy)
            tried.append((prompt, why))
        assert result is not None and len(tried) < len(CODEX_PROMPTS), tried
        _check(proxy, result, "/v1/responses")
        assert result.stdout.strip()  # codex exec prints the final answer on stdout
    finally:
        proxy.close()
        server.stop()
