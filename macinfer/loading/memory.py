"""Giving freed model memory back to the system (an LLM dropped, a served model unloaded)."""

from __future__ import annotations

import gc


def trim_malloc() -> None:
    """Give freed heap pages back to the OS: glibc keeps them (its mmap threshold rises with
    the large buffers a model frees: ~200 MB more RSS per dropped SmolLM2, 700 MB after an
    unload). No-op where there is no malloc_trim (macOS returns large frees by itself)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass


def release_freed() -> None:
    """After the last reference to a model went: collect it, empty MLX's buffer cache,
    trim the heap."""
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    trim_malloc()
