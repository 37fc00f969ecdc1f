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


def weights_estimate(path: str) -> int:
    """The bytes a model's weights will hold once loaded, read from the files' headers
    (no tensor is read): quantized tensors count as float32 where the CPU backend expands
    them (`loader.should_dequantize`), else as stored. An upper bound, for a server's
    budget to decide before a load; 0 when the files cannot be read (the load will say why)."""
    import json
    import os
    import struct

    import mlx.core as mx

    expand = os.environ.get("MACINFER_CPU_WEIGHTS", "") != "quantized" and mx.default_device() == mx.cpu
    try:
        if os.path.isfile(path) and path.endswith(".gguf"):
            from macinfer.gguf.file import GGUFFile

            total = 0
            for t in GGUFFile(path).tensors.values():
                count = 1
                for d in t.shape:
                    count *= d
                floating = t.type_name in ("F32", "F16", "BF16", "F64")
                total += t.nbytes if floating else (4 * count if expand else t.nbytes)
            return total
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        quant = config.get("quantization") or config.get("quantization_config") or {}
        bits = quant.get("bits", 4) if isinstance(quant, dict) else 4
        total = 0
        for name in files:
            with open(os.path.join(path, name), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(min(n, 1 << 27)))
            for key, t in header.items():
                if key == "__metadata__" or not isinstance(t, dict):
                    continue
                start, end = t["data_offsets"]
                nbytes = end - start
                packed = t["dtype"] == "U32" and key.endswith(".weight") and f"{key[:-7]}.scales" in header
                total += nbytes * (32 // max(int(bits), 1)) if packed and expand else nbytes
        return total
    except (OSError, ValueError, KeyError, TypeError, struct.error, ImportError):
        return 0
