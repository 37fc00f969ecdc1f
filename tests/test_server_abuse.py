"""A real `macinfer serve` process under abuse: gone clients, huge prompts,
connection floods, malformed values, side channels, signals, first-run errors.
Every load here is bounded in count and time and goes to loopback only."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server_process import ServerProcess, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = ServerProcess(tiny_llama, "--served-model-name", "tiny", "--kv-cache-gb", "0.05", "--max-connections", "64",
                      "--header-timeout", "1", "-v")
    httpx.get(f"{s.url}/v1/models")  # one request the access log must show
    yield s
    out = s.stop()
    assert "Traceback" not in out, out
    assert len(out) < 200_000  # the connection flood did not become a log flood
    assert '"GET /v1/models HTTP/1.1" 200' in out  # -v after the subcommand: a request log


def _running(server) -> float:
    return server.metrics()["macinfer_requests_running"]


LONG = {"prompt": "hello", "max_tokens": 1900, "ignore_eos": True, "temperature": 0}


def test_non_streaming_request_is_aborted_when_its_client_goes_away(server):
    for _ in range(2):  # an SDK retrying after its timeout
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=httpx.Timeout(10, read=0.5))
    deadline = time.time() + 3
    while _running(server) and time.time() < deadline:
        time.sleep(0.1)
    assert _running(server) == 0


def test_huge_prompt_does_not_stall_other_streams(server):
    gaps, stop = [], threading.Event()

    def stream():
        last = None
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True, "max_tokens": 400},
                          timeout=60) as r:
            for line in r.iter_lines():
                now = time.perf_counter()
                if line.startswith("data: {") and last is not None and not stop.is_set():
                    gaps.append(now - last)
                last = now

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.5)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "word " * 780_000, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    time.sleep(0.3)
    stop.set()
    t.join()
    assert gaps and max(gaps) < 0.5, max(gaps)


def test_connection_flood_is_bounded(server):
    socks = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            socks.append(s)
        # New clients are answered at once (served, or 503 while at the limit), never left hanging ...
        t = time.perf_counter()
        r = httpx.get(f"{server.url}/v1/models", timeout=5)
        assert r.status_code in (200, 503) and time.perf_counter() - t < 2
        # ... and idle connections that never send a request are closed after the header timeout.
        time.sleep(1.5)
        assert httpx.get(f"{server.url}/v1/models", timeout=5).status_code == 200
        for s in socks:
            s.settimeout(2)
            assert s.recv(1) == b""  # closed by the server
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("body,status,where", [
    ({"prompt": "a\ud800b"}, 400, "prompt"),
    ({"prompt": "hi", "model": "m\udfff"}, 400, "model"),
    ({"prompt": "hi", "top_k": 2**64}, 400, "top_k"),
    ({"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ({"prompt": [True, 2]}, 400, "prompt"),
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ({"prompt": "hi", "stop": ["x" * 300]}, 400, "stop"),
])
def test_bad_values_are_400s(server, body, status, where):
    raw = json.dumps(body, ensure_ascii=True).encode()  # \ud800 escapes survive as JSON
    r = httpx.post(f"{server.url}/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert where in json.dumps(r.json()["error"])
    assert httpx.get(f"{server.url}/health").status_code == 200  # and the server is fine


def test_tiny_temperature_is_greedy(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "temperature": 1e-300, "max_tokens": 4})
    g = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "temperature": 0, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == g.json()["choices"][0]["text"]


def test_chunked_body_over_the_limit_is_413(server):
    def chunks():
        for _ in range(5):
            yield b"x" * 2**20

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_errors_do_not_leak_paths(server, tiny_llama):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "model": "other"})
    assert r.status_code == 404 and tiny_llama not in r.text
    assert tiny_llama not in httpx.get(f"{server.url}/v1/models").text


def test_prefix_cache_is_isolated_per_user(server):
    prompt = "The secret PIN is 4821. " * 8

    def cached(user):
        body = {"prompt": prompt, "max_tokens": 1, **({"user": user} if user else {})}
        return httpx.post(f"{server.url}/v1/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alice") == 0
    assert cached("alice") > 0  # the same user reuses her prefix
    assert cached("mallory") == 0  # another user learns nothing from cached_tokens
    assert cached(None) == 0


def test_host_header_is_checked_on_loopback(server):
    bad = httpx.get(f"{server.url}/v1/models", headers={"host": "attacker.example:8000"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_host"
    assert httpx.get(f"{server.url}/v1/models", headers={"host": f"localhost:{server.port}"}).status_code == 200


def test_non_ascii_bearer_is_401(tiny_llama):
    s = ServerProcess(tiny_llama, "--kv-cache-gb", "0.01", "--api-key", "sekret")
    try:
        r = httpx.get(f"{s.url}/v1/models", headers=[(b"authorization", "Bearer sécret".encode())])
        assert r.status_code == 401
        assert httpx.get(f"{s.url}/v1/models", headers={"x-api-key": "sekret"}).status_code == 200
    finally:
        out = s.stop()
    assert "Traceback" not in out


def test_sigterm_under_load_ends_requests_cleanly(tiny_llama):
    s = ServerProcess(tiny_llama, "--kv-cache-gb", "0.05")
    results = {}

    def plain(i):
        results[f"plain{i}"] = httpx.post(f"{s.url}/v1/completions", json=LONG, timeout=60)

    def streamed(i):
        with httpx.stream("POST", f"{s.url}/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
            results[f"stream{i}"] = "".join(r.iter_text())

    threads = [threading.Thread(target=f, args=(i,)) for f in (plain, streamed) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    s.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=30)
    out, _ = s.proc.communicate(timeout=30)
    assert s.proc.returncode == 0, out  # a shutdown asked for is a clean exit (uvicorn would re-raise: 143)
    assert "Traceback" not in out
    for i in range(2):
        r = results[f"plain{i}"]
        assert r.status_code == 503 and r.json()["error"]["message"] == "the server is shutting down"
        assert "the server is shutting down" in results[f"stream{i}"] and "data: [DONE]" in results[f"stream{i}"]


def _serve(args, timeout=60):
    return subprocess.run([sys.executable, "-m", "macinfer.cli", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_port_in_use_fails_before_loading(tiny_llama):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t = time.perf_counter()
        p = _serve([tiny_llama, "--port", str(port)])
    assert p.returncode == 1 and "cannot listen on 127.0.0.1" in p.stderr
    assert "loading" not in p.stderr and "serving" not in p.stdout
    assert time.perf_counter() - t < 15


def test_kv_budget_beyond_memory_is_refused(tiny_llama):
    p = _serve([tiny_llama, "--port", str(free_port()), "--kv-cache-gb", "100000"])
    assert p.returncode == 1 and "--kv-cache-gb 100000 is more memory" in p.stderr
    assert "Traceback" not in p.stderr


def test_server_starts_under_a_low_fd_limit(tiny_llama):
    port = free_port()
    cmd = (f"ulimit -n 256 && exec {sys.executable} -m macinfer.cli serve {tiny_llama} --port {port} "
           "--kv-cache-gb 0.01")
    p = subprocess.Popen(["bash", "-c", cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert p.poll() is None, p.stdout.read()
                time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        p.terminate()
        out, _ = p.communicate(timeout=30)
    assert "Traceback" not in out


@pytest.mark.parametrize("extra,field", [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_unimplemented_fields_are_refused_by_name(server, extra, field):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "not supported" in r.json()["error"]["message"]


def test_no_op_values_and_bookkeeping_fields_are_accepted(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [], "tool_choice": "none",
        "response_format": {"type": "text"}, "logit_bias": {}, "store": False, "metadata": {"a": "b"}})
    assert r.status_code == 200, r.text


def test_image_parts_get_a_clear_400(server):
    msg = {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                       {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [msg]})
    assert r.status_code == 400 and "no vision input" in r.json()["error"]["message"]
    assert "pydantic" not in r.text and "literal_error" not in r.text
