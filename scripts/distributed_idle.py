#!/usr/bin/env python
"""An idle distributed server's CPU, and how it stops with its launcher (issue #47).

    python scripts/distributed_idle.py [MODEL] [--seconds 30] [--mode pipeline]

Starts `mlx.launch -n 2 --backend ring ... macinfer serve MODEL --distributed MODE` on
loopback, sends one request, then reads each rank's CPU time from /proc/<pid>/stat over
`--seconds` of idleness (the launcher's own CPU too: its output relay), sends SIGTERM to
the launcher alone (as a supervisor does, not to the process group) and times until both
ranks are gone and the port is closed. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except (OSError, IndexError):
        return False


def rank_pid(port: int, rank: int) -> int:
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                env, cmd = (proc / "environ").read_bytes().split(b"\0"), (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if f"MLX_RANK={rank}".encode() in env and b"serve" in cmd and str(port).encode() in cmd:
                return int(proc.name)
    raise RuntimeError(f"rank {rank} not found")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--mode", default="pipeline", choices=["pipeline", "tensor"])
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(BIN / "mlx.launch"), "-n", "2", "--backend", "ring", "--python", sys.executable,
           str(BIN / "macinfer"), "serve", args.model, "--port", str(port), "--distributed", args.mode,
           "--kv-cache-gb", "0.1"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(360):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 8}, timeout=120)
        print(f"one request: HTTP {r.status_code}")
        ranks = [rank_pid(port, 0), rank_pid(port, 1)]
        time.sleep(2)
        pids = [*ranks, launcher.pid]
        before, start = [cpu_seconds(p) for p in pids], time.monotonic()
        time.sleep(args.seconds)
        took = time.monotonic() - start
        shares = [(cpu_seconds(p) - b) / took for p, b in zip(pids, before)]
        print(f"idle {took:.1f} s, share of a core: rank 0 {shares[0]:.2%}, rank 1 {shares[1]:.2%}, "
              f"mlx.launch {shares[2]:.2%}")
        launcher.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        while any(alive(p) for p in ranks) and time.monotonic() - sent < 60:
            time.sleep(0.1)
        gone = time.monotonic() - sent
        try:
            httpx.get(f"{url}/health", timeout=2)
            port_state = "still answers"
        except httpx.TransportError:
            port_state = "closed"
        print(f"SIGTERM to the launcher alone: ranks gone after {gone:.1f} s "
              f"({'both' if not any(alive(p) for p in ranks) else 'NOT all'}), port {port_state}")
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
