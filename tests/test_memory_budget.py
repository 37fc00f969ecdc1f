"""Several models under one memory budget (#40): concurrent first requests never take the
server over `--max-memory-gb`, load/unload cycles leave threads and memory flat (the disk
tier on), a per-request keep_alive, and a models folder with broken files that neither
stops the server nor breaks its listings. One server process serves the module."""

from __future__ import annotations

import asyncio
import os
import struct
import threading
import time

import httpx
import pytest

from tests.helpers import tiny_model_dir
from tests.server_process import ServerProcess

GiB = 2**30
BUDGET_GB = 0.19  # about two of the three models below (~93 MiB each): one must go before the third loads
MARGIN = 48 * 2**20  # a load's transient buffers and MLX's allocator slack, stated (a third model is ~93 MiB)


def _proc(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * (1024 if field == "VmRSS" else 1)
    raise KeyError(field)


def _bad_gguf(path, alignment) -> None:
    """A GGUF header with no tensors and a `general.alignment` of the given value."""
    key = b"general.alignment"
    vtype, value = (4, struct.pack("<I", alignment)) if isinstance(alignment, int) else \
        (8, struct.pack("<Q", len(alignment)) + alignment.encode())
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<I", vtype) + value)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    for i, name in enumerate(("a", "b", "c")):  # ~84 MB of float32 weights each
        path, _ = tiny_model_dir(d, "llama", seed=i, hidden_size=512, intermediate_size=1024, num_hidden_layers=8)
        os.rename(path, d / name)
    _bad_gguf(d / "zero-align.gguf", 0)
    _bad_gguf(d / "text-align.gguf", "abc")
    dangling = d / "dangling"
    dangling.mkdir()
    (dangling / "config.json").write_text((d / "a" / "config.json").read_text())
    os.symlink(d / "nowhere.safetensors", dangling / "model.safetensors")
    loop = d / "loop"
    loop.mkdir()
    os.symlink(loop, loop / "self1")
    os.symlink(loop, loop / "self2")
    return d


@pytest.fixture(scope="module")
def server(models_dir, tmp_path_factory):
    s = ServerProcess(f"--models-dir={models_dir}", "--no-hf-cache", "--pin", "a", "--max-memory-gb",
                      str(BUDGET_GB), "--kv-cache-gb", "0.02", "--max-model-len", "512", "--idle-ttl", "600",
                      "--kv-disk-gb", "0.2", "--kv-disk-dir", str(tmp_path_factory.mktemp("kv")), timeout=180)
    yield s
    s.stop()


def _ask(url: str, model: str, max_tokens: int = 4, **kw) -> httpx.Response:
    body = {"model": model, "prompt": "one two three four five", "stream": False,
            "options": {"temperature": 0, "num_predict": max_tokens}, **kw}
    return httpx.post(f"{url}/api/generate", json=body, timeout=300)


def test_bad_files_in_the_models_folder_are_skipped_and_listings_answer(server):
    assert server.proc.poll() is None  # it started: none of the four bad entries stopped it
    listed = httpx.get(f"{server.url}/v1/models", timeout=30)
    assert listed.status_code == 200
    assert sorted(m["id"] for m in listed.json()["data"]) == ["a", "b", "c"]
    for route in ("/status", "/api/tags", "/api/ps"):
        assert httpx.get(f"{server.url}{route}", timeout=30).status_code == 200, route


def _unloaded(server, *names: str) -> None:
    """Ollama's unload (no prompt, keep_alive 0) for each, then wait until their memory is back."""
    for name in names:
        r = httpx.post(f"{server.url}/api/generate", json={"model": name, "keep_alive": 0})
        assert r.status_code == 200, r.text
    deadline = time.time() + 30
    while time.time() < deadline and {f"{n}:latest" for n in names} & {
            m["name"] for m in httpx.get(f"{server.url}/api/ps").json()["models"]}:
        time.sleep(0.1)
    states = {m["id"]: m["state"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert all(states[n] == "unloaded" for n in names), states


def test_concurrent_first_requests_never_take_the_server_over_its_budget(server):
    """a is pinned and loaded; b and c are asked for at once. Resident memory (RSS, every
    100 ms) stays under the budget plus MARGIN over what the process held with no model
    beyond a: the second load waits for the first model's request, then unloads it."""
    _unloaded(server, "b", "c")  # whatever tests ran before: a alone is loaded
    pid = server.proc.pid
    base = _proc(pid, "VmRSS")  # the process, a's weights and KV
    a_bytes = next(m for m in httpx.get(f"{server.url}/v1/models").json()["data"] if m["id"] == "a")["size_bytes"]
    peak, stop = [base], threading.Event()

    def sample():
        while not stop.is_set():
            peak.append(_proc(pid, "VmRSS"))
            time.sleep(0.1)

    t = threading.Thread(target=sample)
    t.start()
    try:
        async def both():
            return await asyncio.gather(*(asyncio.to_thread(_ask, server.url, m, 48) for m in ("b", "c")))
        rs = asyncio.run(both())
    finally:
        stop.set()
        t.join()
    assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
    limit = base - a_bytes + BUDGET_GB * GiB + MARGIN
    print(f"\nbase {base / 2**20:.0f} MiB, a {a_bytes / 2**20:.0f} MiB, peak {max(peak) / 2**20:.0f} MiB, "
          f"limit {limit / 2**20:.0f} MiB ({len(peak)} samples)")
    assert max(peak) <= limit
    loaded = {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"] if m["state"] == "loaded"}
    assert "a" in loaded and len(loaded) == 2


def test_keep_alive_is_per_request_and_odd_values_never_break_ps(server):
    for value in (1e19, 1e308, "1e19", -1, "5m"):
        assert _ask(server.url, "b", keep_alive=value).status_code == 200, value
        assert httpx.get(f"{server.url}/api/ps").status_code == 200
    for value in ("Infinity", "NaN", "inf", True, "five minutes"):
        r = _ask(server.url, "b", keep_alive=value)
        assert r.status_code == 400 and "keep_alive" in r.json()["error"], (value, r.text)
    bodies = ['{"model": "b", "prompt": "x", "stream": false, "keep_alive": Infinity}',
              '{"model": "b", "prompt": "x", "stream": false, "keep_alive": NaN}']
    for body in bodies:
        r = httpx.post(f"{server.url}/api/generate", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
    assert httpx.get(f"{server.url}/api/ps").status_code == 200
    # keep_alive 0 unloads after its request; the model's next request (none given) keeps it loaded
    assert _ask(server.url, "b", keep_alive=0).status_code == 200
    assert _ask(server.url, "b").status_code == 200
    time.sleep(1.5)  # the reaper runs every 0.5 s
    assert "b:latest" in {m["name"] for m in httpx.get(f"{server.url}/api/ps").json()["models"]}


def test_twenty_load_unload_cycles_leave_threads_and_memory_flat(server):
    """keep_alive 0 on every request (Ollama's unload) with the disk tier on: 22 loads and
    unloads of c (~93 MiB each). After each unload: MLX's allocated memory (/status) is back
    where it was after the first, to the MiB; threads are flat; RSS keeps its floor within one
    model (glibc's arenas make single samples swing by more than a model: 235-369 MiB measured
    over 80 cycles with no trend, so the least of the last six is compared with the least of
    the first six). A writer thread left per load would be +20 threads, an engine left, +93 MiB."""
    pid = server.proc.pid
    threads, samples, active = None, [], []
    for i in range(22):
        assert _ask(server.url, "c", keep_alive=0).status_code == 200
        deadline = time.time() + 20
        while time.time() < deadline and "c:latest" in {m["name"] for m in httpx.get(f"{server.url}/api/ps").json()["models"]}:
            time.sleep(0.05)
        if i == 1:
            threads = _proc(pid, "Threads")  # after a warm cycle: executor threads started
        samples.append(_proc(pid, "VmRSS"))
        active.append(httpx.get(f"{server.url}/status").json()["memory"]["device_active_bytes"])
    threads2 = _proc(pid, "Threads")
    early, late = min(samples[:6]), min(samples[-6:])
    print(f"\nthreads {threads} -> {threads2}, RSS floor {early / 2**20:.0f} -> {late / 2**20:.0f} MiB, "
          f"MLX active {active[0] / 2**20:.1f} -> {max(active[1:]) / 2**20:.1f} MiB")
    assert max(active[1:]) - active[0] < 2**20
    # asyncio's default executor may add a worker or two up to its fixed bound (min(32, cores + 4))
    assert threads2 - threads <= 3 and late <= early + 93 * 2**20
