"""Where a step's time goes, on the host: scheduling, building the batch's metadata,
building the forward graph, the device running it, sampling, turning tokens into
outputs, and in the server's engine thread taking new requests and handing outputs to
the event loop (`macinfer bench profile`). Off unless asked for: two clock reads a phase."""

from __future__ import annotations

import time
from contextlib import contextmanager

PHASES = ("requests", "schedule", "metadata", "graph", "device", "sampler", "outputs", "delivery")


class StepProfile:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def per_step_ms(self) -> dict[str, float]:
        return {k: 1e3 * v / max(self.steps, 1) for k, v in self.seconds.items()}

    def table(self) -> str:
        total = sum(self.seconds.values()) or 1.0
        rows = [f"{'phase':<10}{'ms/step':>10}{'share':>8}"]
        for name, ms in self.per_step_ms().items():
            rows.append(f"{name:<10}{ms:>10.2f}{100 * self.seconds[name] / total:>7.1f}%")
        rows.append(f"{'all':<10}{1e3 * total / max(self.steps, 1):>10.2f}  over {self.steps} steps")
        return "\n".join(rows)


@contextmanager
def maybe(profile: StepProfile | None, name: str):
    """`profile.phase(name)`, or nothing when not profiling."""
    if profile is None:
        yield
    else:
        with profile.phase(name):
            yield
