"""Run the exact Metal source MLX generates for a kernel on the CPU.

MLX on Linux refuses to launch a Metal kernel, but tracing a call under
`mx.export_function` with `verbose=True` prints the full generated source
(signature and template instantiation). This module captures that source,
compiles it with g++ against `cpu_shim.h` into a small executable (optionally
under AddressSanitizer or ThreadSanitizer), and runs a launch grid on buffers
it exchanges through files. Outputs start poisoned (NaN / 0xFF), so an output
element the kernel forgets to write shows up.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

SHIM = Path(__file__).resolve().parent / "cpu_shim.h"
HEADER = "msl_cpu_shim.h"  # the shim as programs include it (`_header`)
CACHE = Path(os.environ.get("MACINFER_EMULATOR_CACHE", Path(tempfile.gettempdir()) / "macinfer-emulator"))

_NP_DTYPES = {mx.float32: np.float32, mx.float16: np.float16, mx.int32: np.int32,
              mx.uint32: np.uint32, mx.int64: np.int64, mx.uint8: np.uint8, mx.bool_: np.bool_}
_C_TYPES = {"float": np.float32, "float16_t": np.float16, "half": np.float16, "int": np.int32,
            "int32_t": np.int32, "uint32_t": np.uint32, "uint": np.uint32, "int64_t": np.int64,
            "size_t": np.uint64, "uint8_t": np.uint8, "bool": np.bool_}
_SANITIZE = {None: [], "address": ["-fsanitize=address", "-fno-omit-frame-pointer"],
             "thread": ["-fsanitize=thread"]}


class EmulationError(RuntimeError):
    pass


@dataclass
class Param:
    name: str
    ctype: str  # element type, e.g. "float16_t"
    text: str  # the declaration's type text, e.g. "const device float16_t*"
    is_output: bool
    by_reference: bool


def capture_source(call) -> str:
    """Generated Metal source of `call()` (a KernelCall), via export tracing."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "stdout.txt")
        sys.stdout.flush()
        saved = os.dup(1)
        with open(out_path, "w") as f:
            os.dup2(f.fileno(), 1)
            try:
                mx.export_function(os.path.join(tmp, "k.mlxfn"), lambda *xs: _traced(call, xs), *call.inputs)
            finally:
                sys.stdout.flush()
                os.dup2(saved, 1)
                os.close(saved)
        text = open(out_path).read()
    blocks = re.findall(r"Generated source code for `[^`]*`:\n```\n(.*?)```", text, re.S)
    if not blocks:
        raise EmulationError(f"MLX printed no kernel source: {text[:500]}")
    return blocks[-1]


def _traced(call, xs):
    saved = call.inputs
    call.inputs = list(xs)
    try:
        return call(verbose=True)
    finally:
        call.inputs = saved


def parse_params(src: str) -> tuple[str, list[Param], list[tuple[str, str]], str]:
    """(kernel function name, buffer params, (attribute type, name) list, instantiation)."""
    name = re.search(r"\[\[kernel\]\] void (\w+)\(", src).group(1)
    params = []
    for m in re.finditer(r"^\s+((?:const )?(?:device|constant) ([\w:]+)\s*([*&]))\s*(\w+) \[\[buffer\(\d+\)\]\]", src, re.M):
        text, ctype, ref, pname = m.groups()
        params.append(Param(pname, ctype, text, not text.startswith("const"), ref == "&"))
    attrs = re.findall(r"^\s+(uint3?|uint) (\w+) \[\[(\w+)\]\]", src, re.M)
    inst = re.search(r"decltype\((\w+<.*?>)\)", src).group(1)
    return name, params, [(t, n) for t, n, _ in attrs], inst


def _rewrite_threadgroup_arrays(src: str) -> str:
    counter = iter(range(1, 1 << 30))

    def repl(m: re.Match) -> str:
        ctype, var, count = m.groups()
        return (f"{ctype} (&{var})[{count}] = *reinterpret_cast<{ctype}(*)[{count}]>("
                f"msl_cpu::threadgroup_array({next(counter)}, sizeof({ctype}) * ({count})));")

    return re.sub(r"threadgroup\s+([\w:]+)\s+(\w+)\s*\[([^\]]+)\]\s*;", repl, src)


def program(src: str) -> tuple[str, list[Param]]:
    """C++ translation unit: shim + kernel + a main() that runs one grid on file buffers."""
    _, params, attrs, inst = parse_params(src)
    body = re.sub(r"^template \[\[host_name.*$", "", src, flags=re.M)
    body = _rewrite_threadgroup_arrays(body)
    args = []
    for i, p in enumerate(params):
        cast = p.text.replace("&", "*")
        args.append(f"*({cast})bufs[{i}]" if p.by_reference else f"({cast})bufs[{i}]")
    for ctype, attr in attrs:
        if attr == "simdgroup_index_in_threadgroup":
            args.append("ids.thread_index_in_threadgroup / 32")
        elif attr == "thread_index_in_simdgroup":
            args.append("ids.thread_index_in_threadgroup % 32")
        elif attr == "threads_per_simdgroup":
            args.append("32u")
        elif attr == "thread_index_in_threadgroup":
            args.append("ids.thread_index_in_threadgroup")
        else:
            args.append(f"ids.{attr}" + (".x" if ctype == "uint" else ""))
    n = len(params)
    main = f"""
int main(int argc, char** argv) {{
  if (argc != 8) return 2;
  std::string dir = argv[1];
  std::vector<std::vector<char>> data({n});
  void* bufs[{n} + 1];
  for (int i = 0; i < {n}; i++) {{
    FILE* f = std::fopen((dir + "/" + std::to_string(i) + ".bin").c_str(), "rb");
    if (!f) return 3;
    std::fseek(f, 0, SEEK_END); long size = std::ftell(f); std::fseek(f, 0, SEEK_SET);
    data[i].resize(size + 16);
    if (std::fread(data[i].data(), 1, size, f) != (size_t)size) return 4;
    std::fclose(f);
    data[i].resize(size);
    bufs[i] = data[i].data();
  }}
  uint3 grid{{(uint)std::stoul(argv[2]), (uint)std::stoul(argv[3]), (uint)std::stoul(argv[4])}};
  uint3 tg{{(uint)std::stoul(argv[5]), (uint)std::stoul(argv[6]), (uint)std::stoul(argv[7])}};
  msl_cpu::run_grid(grid, tg, [&](const msl_cpu::ThreadIds& ids) {{
    {inst}({", ".join(args)});
  }});
  for (int i = 0; i < {n}; i++) {{
    FILE* f = std::fopen((dir + "/" + std::to_string(i) + ".out").c_str(), "wb");
    std::fwrite(data[i].data(), 1, data[i].size(), f);
    std::fclose(f);
  }}
  return 0;
}}
"""
    return f'#include "{HEADER}"\n' + body + main, params


def _header(flags: list[str]) -> Path:
    """The folder holding the shim (and the headers every program includes) with a precompiled
    copy for these flags: g++ then parses the C++ standard headers once, not once a kernel
    (a kernel's compile ~1.0 -> 0.6 s). Named by content, so checkouts share it; a stale or
    unusable precompiled header is skipped by g++ and the text header is read instead."""
    text = SHIM.read_text().replace("#pragma once\n", "") + "#include <cstdio>\n#include <memory>\n#include <string>\n"
    folder = CACHE / ("h-" + hashlib.sha256((text + " ".join(flags)).encode()).hexdigest()[:20])
    if not (folder / (HEADER + ".gch")).exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{HEADER}.{os.getpid()}"  # whole or absent for another process (pytest's workers)
        tmp.write_text(text)
        os.replace(tmp, folder / HEADER)
        tmp = folder / f"{HEADER}.gch.{os.getpid()}"
        r = subprocess.run(["g++", *flags, "-x", "c++-header",
                            str(folder / HEADER), "-o", str(tmp)], capture_output=True, text=True)
        if r.returncode:
            raise EmulationError(f"g++ failed on the kernel shim:\n{r.stderr[:6000]}")
        os.replace(tmp, folder / (HEADER + ".gch"))
    return folder


def compile_source(src: str, sanitize: str | None = None) -> tuple[Path, list[Param]]:
    code, params = program(src)
    # Debug info only where a sanitizer's report needs line numbers (it costs ~0.6 s a compile).
    flags = ["-std=c++20", "-O1", "-Wno-attributes", "-pthread", *(["-g"] if sanitize else []),
             *_SANITIZE[sanitize]]
    include = _header(flags)
    key = hashlib.sha256((code + include.name + " ".join(flags)).encode()).hexdigest()[:20]
    exe = CACHE / f"k-{key}"
    if not exe.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        cpp = CACHE / f"k-{key}.{os.getpid()}.cpp"
        cpp.write_text(code)
        r = subprocess.run(["g++", *flags, "-I", str(include), str(cpp), "-o", f"{exe}.{os.getpid()}"],
                           capture_output=True, text=True)
        if r.returncode:
            raise EmulationError(f"g++ failed on the generated kernel:\n{r.stderr[:6000]}")
        os.replace(f"{exe}.{os.getpid()}", exe)
    return exe, params


def _buffer(p: Param, call, outputs: dict[str, tuple[tuple, np.dtype]]) -> np.ndarray:
    names = call.kernel_input_names
    if p.name in outputs:
        shape, dtype = outputs[p.name]
        a = np.empty(shape, dtype=dtype)
        a.view(np.uint8)[...] = 0xFF  # poison: NaN for floats
        return a
    for suffix, conv in (("_shape", lambda x: np.array(x.shape, dtype=_C_TYPES[p.ctype])),
                         ("_strides", lambda x: np.array(_strides(x), dtype=_C_TYPES[p.ctype])),
                         ("_ndim", lambda x: np.array(x.ndim, dtype=_C_TYPES[p.ctype]))):
        base = p.name[: -len(suffix)]
        if p.name.endswith(suffix) and base in names:
            return conv(call.inputs[names.index(base)])
    if p.name in names:
        x = call.inputs[names.index(p.name)]
        return np.ascontiguousarray(np.array(x, dtype=_NP_DTYPES[x.dtype]))
    raise EmulationError(f"no buffer for kernel parameter {p.name!r}")


def _strides(x: mx.array) -> list[int]:
    strides, acc = [], 1
    for d in reversed(x.shape):
        strides.append(acc)
        acc *= d
    return strides[::-1]


@dataclass
class EmulationResult:
    outputs: list[np.ndarray]
    stderr: str


def emulate(call, sanitize: str | None = None, timeout: float = 300, source: str | None = None) -> EmulationResult:
    """Run one KernelCall on the CPU; outputs as numpy arrays in output order."""
    src = source or capture_source(call)
    exe, params = compile_source(src, sanitize)
    out_names = call.kernel_output_names
    outputs = {n: (tuple(s), _NP_DTYPES[d]) for n, s, d in zip(out_names, call.output_shapes, call.output_dtypes)}
    bufs = [_buffer(p, call, outputs) for p in params]
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # sanitizer runtimes must load first; the kernel needs nothing else
    if sanitize == "thread":
        env["TSAN_OPTIONS"] = "halt_on_error=0 exitcode=0 report_signal_unsafe=0 " + env.get("TSAN_OPTIONS", "")
    if sanitize == "address":
        env["ASAN_OPTIONS"] = "detect_leaks=0 " + env.get("ASAN_OPTIONS", "")
    with tempfile.TemporaryDirectory() as tmp:
        for i, b in enumerate(bufs):
            b.tofile(os.path.join(tmp, f"{i}.bin"))
        argv = [str(exe), tmp, *map(str, call.grid), *map(str, call.threadgroup)]
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            raise EmulationError("kernel did not finish (divergent simd op or barrier deadlock?)") from None
        if r.returncode != 0:
            raise EmulationError(f"kernel run failed ({r.returncode}):\n{r.stderr[-6000:]}")
        results = []
        for name in out_names:
            i = next(k for k, p in enumerate(params) if p.name == name)
            shape, dtype = outputs[name]
            results.append(np.fromfile(os.path.join(tmp, f"{i}.out"), dtype=dtype).reshape(shape))
    return EmulationResult(results, r.stderr)


def emulate_calls(calls, sanitize: str | None = None) -> tuple[np.ndarray, str]:
    """Run a chain of launches (split + merge) on the CPU; returns (output, sanitizer stderr)."""
    res = emulate(calls[0], sanitize)
    stderr = res.stderr
    for call in calls[1:]:
        call.inputs = [mx.array(o) for o in res.outputs]
        res = emulate(call, sanitize)
        stderr += res.stderr
    return res.outputs[0], stderr
