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
                      "--header-timeout", "1", "--body-timeout", "3", "--max-body-mb", "4", "-v")
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
            # closed by the server: after the header timeout, or at once past this
            # address's share of the connections (with a JSON 503)
            first = s.recv(64)
            assert first == b"" or first.startswith(b"HTTP/1.1 503"), first
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
    r = httpx.get(f"{server.url}/v1/models/other")
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


@pytest.mark.parametrize("host", ["attacker.example:8000", "localhost:80@evil.example", "127.0.0.1:1@evil.example",
                                  "localhost/x", "local host", ""])
def test_host_header_is_checked_on_loopback(server, host):
    bad = httpx.get(f"{server.url}/v1/models", headers={"host": host})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_host"
    assert httpx.get(f"{server.url}/v1/models", headers={"host": f"localhost:{server.port}"}).status_code == 200


def test_host_check_stays_on_when_listening_on_every_address(tiny_llama):
    """Bound to 0.0.0.0 (a LAN server) the DNS-rebinding defence stays: addresses and
    this machine's names are answered, other names refused unless --allowed-host."""
    s = ServerProcess(tiny_llama, "--kv-cache-gb", "0.01", "--host", "0.0.0.0", "--allowed-host", "llm.lan")
    try:
        get = lambda host: httpx.get(f"{s.url}/v1/models", headers={"host": host}).status_code  # noqa: E731
        assert get("attacker.example") == 400 and get("localhost:80@evil.example") == 400
        assert get(f"127.0.0.1:{s.port}") == 200 and get("192.168.1.20:8000") == 200 and get("[::1]:8000") == 200
        assert get(socket.gethostname()) == 200 and get("llm.lan:8000") == 200
    finally:
        out = s.stop()
    assert "Host check: answers IP addresses and" in out and "llm.lan" in out


def _slow_body(port: int, source: str, size: int = 1000) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
              f"content-length: {size}\r\n\r\n{{".encode())
    return s


def test_slow_bodies_from_one_address_leave_others_served(server):
    """40 clients trickling their bodies from one address take at most its share of
    the connections; others are answered, and the trickles end in a 408."""
    socks = []
    try:
        for _ in range(40):
            try:
                socks.append(_slow_body(server.port, "127.0.0.2"))
            except OSError:
                break
        time.sleep(0.3)
        for _ in range(3):
            r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
            assert r.status_code == 200
        answers = []
        for s in socks:
            s.settimeout(6)
            try:
                answers.append(s.recv(200))
            except OSError:
                answers.append(b"")
        assert sum(a.startswith(b"HTTP/1.1 408") for a in answers) >= 20  # the held ones: body timeout
        assert all(a.startswith((b"HTTP/1.1 408", b"HTTP/1.1 503")) for a in answers), answers
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("mb", [4.5, 32])
def test_body_over_the_limit_is_a_413_not_a_reset(server, mb):
    body = b'{"prompt": "' + b"x" * int(mb * 2**20) + b'"}'
    for _ in range(5):
        r = httpx.post(f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 413 and r.json()["error"]["message"]


def test_protocol_errors_are_json(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


def test_an_unexpected_error_is_one_json_500_logged_once(caplog):
    import asyncio

    from macinfer.server.middleware import Guard

    async def broken(scope, receive, send):
        raise RuntimeError("boom /secret/path")

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"host", b"localhost")]}
    asyncio.run(Guard(broken, [], 1 << 20, None)(scope, receive, send))  # no exception escapes to uvicorn
    assert sent[0]["status"] == 500
    assert json.loads(sent[1]["body"])["error"]["message"] == "internal server error"
    assert b"secret" not in sent[1]["body"]
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1


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
    return subprocess.run([sys.executable, "-m", "macinfer.cli.main", "serve", *args], capture_output=True, text=True,
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
    cmd = (f"ulimit -n 256 && exec {sys.executable} -m macinfer.cli.main serve {tiny_llama} --port {port} "
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
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
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
    assert r.status_code == 400 and "this model takes no images: it is a text model" in r.json()["error"]["message"]
    assert "pydantic" not in r.text and "literal_error" not in r.text


def test_head_probes_and_model_lookup(server):
    """`HEAD /` and `HEAD /health` (agents probe them), and `GET /v1/models/{id}` (what
    `client.models.retrieve` calls) with a `created` that does not change."""
    assert httpx.head(f"{server.url}/").status_code == 200
    assert httpx.head(f"{server.url}/health").status_code == 200
    listed = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    one = httpx.get(f"{server.url}/v1/models/tiny")
    assert one.status_code == 200 and one.json() == listed
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["created"] == listed["created"]
    missing = httpx.get(f"{server.url}/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_verbose_logs_each_client_error_with_its_reason(tiny_llama):
    """-v: a 4xx is logged with the message and the field, not only as an access line."""
    s = ServerProcess(tiny_llama, "-v", "--kv-cache-gb", "0.01")
    try:
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "temperature": "hot"})
        assert r.status_code == 400
    finally:
        out = s.stop()
    assert "400 on /v1/chat/completions: " in out and "(param: temperature)" in out, out[-2000:]
