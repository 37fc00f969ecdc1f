"""Two CPU streams for independent work: MLX runs each stream's ops on its own thread, and
its CPU elementwise ops (dequantizing, exponentials) use one core each, so work split over
the two runs on two cores (matmuls are BLAS's, threaded already).

MLX streams belong to the thread that made them, so these are thread-local: each thread that
uses them gets its own two on first use, and MLX keeps their worker threads for the life of
the process (as it does a thread's default stream). The server runs every engine's steps on
long-lived threads, so that is two idle threads per such thread, not per request or load
(a Python `LLM` object has its own worker thread: two more per `LLM` made)."""

from __future__ import annotations

import mlx.core as mx

_STREAMS = [mx.new_thread_local_stream(mx.cpu) for _ in range(2)]


def work_streams() -> list:
    """Where independent pieces of work go: the two CPU streams when the default device is the
    CPU, else the default device's own stream alone (a GPU's work stays on the GPU)."""
    if mx.default_device() == mx.cpu:
        return _STREAMS
    return [mx.default_stream(mx.default_device())]
