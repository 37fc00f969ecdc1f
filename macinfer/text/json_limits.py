"""How deep client JSON may nest, decided once: request bodies (checked at the server's
edge), JSON schemas (the Python API's too) and JSON-in-a-string tool-call arguments.

Python's JSON parser and our schema walkers recurse once per level: a body nested a
thousand deep is a RecursionError (a 500) somewhere. Nothing real nests this deep: tool
schemas of coding agents reach about 15 levels."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

MAX_JSON_DEPTH = 100

# A JSON string literal (escapes included), unrolled so that megabytes match in C.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_OPEN = np.zeros(256, np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


class JSONTooDeep(ValueError):
    pass


def json_depth(data: bytes | str) -> int:
    """How deep the JSON text nests (brackets outside strings), without parsing it."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    steps = _OPEN[np.frombuffer(_STRING.sub(b'""', raw), np.uint8)]
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


def check_depth(data: bytes | str, what: str = "the JSON body") -> None:
    if json_depth(data) > MAX_JSON_DEPTH:
        raise JSONTooDeep(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")


def value_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep an already parsed value nests (stops counting past `limit`), iteratively."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def loads(text: str | bytes, what: str = "the JSON") -> Any:
    """`json.loads` of client text, refused (JSONTooDeep, a ValueError) past MAX_JSON_DEPTH."""
    check_depth(text, what)
    return json.loads(text)
