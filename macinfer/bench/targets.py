"""The servers a benchmark talks to: `macinfer serve` and `mlx_lm.server` started
here on loopback ports, or any OpenAI-compatible server already running (a URL)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from macinfer.bench.common import MemorySampler


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Target:
    name: str
    url: str
    model: str  # the model id requests name
    proc: subprocess.Popen | None = None
    memory: MemorySampler | None = None
    info: dict = field(default_factory=dict)

    def status(self) -> dict | None:
        """macinfer's /status (KV usage, prefix-cache counters); None for other servers."""
        if not self.name.startswith("macinfer"):
            return None
        try:
            return httpx.get(f"{self.url}/status", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return None

    def stop(self) -> None:
        if self.memory is not None:
            self.memory.stop()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def restart(self) -> bool:
        """Stop the server and start it again with the same command (a server this
        benchmark started); False for one it did not start."""
        if self.proc is None:
            return False
        peak = self.memory.peak_gb if self.memory is not None else None
        self.stop()  # SIGTERM: a graceful shutdown (macinfer writes its prefix cache to disk)
        cmd = [sys.executable, *self.info["command"]]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait(self.proc, self.url, self.name, cmd)
        self.memory = MemorySampler(self.proc.pid)
        self.info["peak_rss_gb_before_restart"] = peak
        return True


def _wait(proc: subprocess.Popen, url: str, name: str, cmd: list[str], timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{name} did not start within {timeout:.0f} s")


def start(spec: str, model: str, mlx_dir: str | None, macinfer_args: list[str]) -> Target:
    """spec: "macinfer", "macinfer-nocache", "mlx-lm" or an http(s) URL."""
    if spec.startswith(("http://", "https://")):
        url = spec.rstrip("/").removesuffix("/v1")
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        return Target(spec, url, models[0]["id"], info={"models": [m["id"] for m in models]})
    port = free_port()
    if spec.startswith("macinfer"):
        args = list(macinfer_args)
        if spec == "macinfer-nocache":  # no prefix cache, so no disk tier under it either
            for flag in ("--kv-disk-gb", "--kv-disk-dir"):
                if flag in args:
                    del args[args.index(flag):args.index(flag) + 2]
            args.append("--no-prefix-caching")
        cmd = [sys.executable, "-m", "macinfer.cli.main", "serve", model, "--port", str(port), "--served-model-name",
               "bench", *args]
        served = "bench"
    elif spec == "mlx-lm":
        assert mlx_dir is not None
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", mlx_dir, "--port", str(port),
               "--log-level", "ERROR"]
        served = mlx_dir
    else:
        raise ValueError(f"unknown target {spec!r}: macinfer, macinfer-nocache, mlx-lm or a URL")
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait(proc, url, spec, cmd)
    return Target(spec, url, served, proc, MemorySampler(proc.pid), {"command": cmd[1:]})


async def sse_events(client: httpx.AsyncClient, url: str, body: dict):
    """The JSON payloads of one streaming request's server-sent events."""
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])
