"""The SSD tier under the prefix cache: evicted K/V blocks and state snapshots as files.

One directory per model identity (weights fingerprint, config, dtypes, cache layout), one
file per record, named by the record's key (a cache group or the state, and the chained
block hash, which already folds in the request's isolation salt). A file is

    MAGIC | header length (u32) | header (JSON: arrays' dtypes and shapes) | arrays' bytes | blake2b-16

written to a temporary name and renamed, so a reader sees a whole file or none. A file
whose checksum, length or header does not match is deleted and logged, never served.

Records are written by one background thread: the engine hands over copies already made
(`put`), and the step never waits on the disk. The store is bounded by its size, least
recently used first (file times order it across restarts). A write that fails for want
of space or permission turns the tier off with one warning; requests go on without it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict

import numpy as np

log = logging.getLogger("macinfer.kv")

MAGIC = b"MIKV1\n"
_DIGEST = 16
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def default_dir() -> str:
    """`kv` in macinfer's cache folder (the one the autotune verdicts live in)."""
    from macinfer.kernels.autotune import cache_dir

    return str(cache_dir() / "kv")


def _encode(arrays: list[np.ndarray]) -> bytes:
    header = json.dumps([[a.dtype.str, list(a.shape)] for a in arrays]).encode()
    body = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    payload = MAGIC + struct.pack("<I", len(header)) + header + body
    return payload + hashlib.blake2b(payload, digest_size=_DIGEST).digest()


def _decode(data: bytes) -> list[np.ndarray]:
    """The arrays of a file's bytes; ValueError when they are not a whole, intact record."""
    if len(data) < len(MAGIC) + 4 + _DIGEST or not data.startswith(MAGIC):
        raise ValueError("not a record (truncated or foreign)")
    payload, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.blake2b(payload, digest_size=_DIGEST).digest() != digest:
        raise ValueError("checksum mismatch")
    (n,) = struct.unpack_from("<I", payload, len(MAGIC))
    start = len(MAGIC) + 4
    layout = json.loads(payload[start:start + n])
    pos, out = start + n, []
    for dtype, shape in layout:
        dt = np.dtype(dtype)
        size = dt.itemsize * int(np.prod(shape, dtype=np.int64))
        if pos + size > len(payload):
            raise ValueError("shorter than its header says")
        out.append(np.frombuffer(payload, dt, count=size // dt.itemsize, offset=pos).reshape(shape))
        pos += size
    if pos != len(payload):
        raise ValueError("longer than its header says")
    return out


class DiskStore:
    """Records by key under `root/identity`, at most `capacity` bytes."""

    def __init__(self, root: str, identity: str, capacity: int):
        self.dir = os.path.join(root, identity)
        self.capacity = capacity
        self.enabled = True
        self.why_off = ""
        self.index: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recently used first
        self.bytes = 0
        self.writes = self.reads = self.corrupt = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=4096)
        self._writing: set[str] = set()
        try:
            os.makedirs(self.dir, exist_ok=True)
            probe = os.path.join(self.dir, ".probe")
            with open(probe, "wb") as f:
                f.write(b"ok")
            os.remove(probe)
        except OSError as e:
            self._off(f"cannot write {self.dir}: {e.strerror or e}")
            return
        self._scan()
        threading.Thread(target=self._writer, name="macinfer-kv-disk", daemon=True).start()

    def _off(self, why: str) -> None:
        if self.enabled:
            self.enabled, self.why_off = False, why
            log.warning("KV disk tier turned off: %s; requests go on without it", why)

    def _scan(self) -> None:
        found = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".kv"):
                st = entry.stat()
                found.append((st.st_mtime, entry.name[:-3], st.st_size))
            elif entry.name.endswith(".tmp"):  # a write cut short by a crash
                os.remove(entry.path)
        for _, key, size in sorted(found):
            self.index[key] = size
            self.bytes += size
        self._shrink(0)
        if self.index:
            log.info("KV disk tier: %d records (%.2f GiB) in %s", len(self.index), self.bytes / 2**30, self.dir)

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key + ".kv")

    # -- reads (the engine thread) ------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return self.enabled and (key in self.index or key in self._writing)

    def get(self, key: str) -> list[np.ndarray] | None:
        """The record's arrays, or None (absent, or corrupt: then deleted and logged)."""
        if key not in self:
            return None
        try:
            with open(self._path(key), "rb") as f:
                arrays = _decode(f.read())
        except FileNotFoundError:
            if key in self._writing:  # still queued: the writer has it
                return None
            self._forget(key)
            return None
        except (OSError, ValueError) as e:
            self.corrupt += 1
            log.warning("KV disk tier: record %s dropped (%s); its tokens are recomputed", key, e)
            self._forget(key, delete=True)
            return None
        with self._lock:
            if key in self.index:
                self.index.move_to_end(key)
        self.reads += 1
        return arrays

    def _forget(self, key: str, delete: bool = False) -> None:
        with self._lock:
            size = self.index.pop(key, None)
            if size is not None:
                self.bytes -= size
        if delete:
            try:
                os.remove(self._path(key))
            except OSError:
                pass

    # -- writes (handed to the writer thread) --------------------------------------------
    def put(self, key: str, arrays: list) -> None:
        """Queue a record (arrays: evaluated MLX or NumPy arrays, not to be changed after)."""
        if not self.enabled or key in self.index or key in self._writing:
            return
        try:
            self._queue.put_nowait((key, arrays))
            self._writing.add(key)
        except queue.Full:  # the disk is slower than evictions: drop, the step never waits
            pass

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until queued records are written (True) or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while self._writing and self.enabled and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._writing or not self.enabled

    def _writer(self) -> None:
        while True:
            key, arrays = self._queue.get()
            try:
                if self.enabled:
                    self._write(key, [np.asarray(a) for a in arrays])
            except Exception:  # never let the writer die: that record is lost, the tier goes on
                log.exception("KV disk tier: writing %s failed", key)
            finally:
                self._writing.discard(key)

    def _write(self, key: str, arrays: list[np.ndarray]) -> None:
        data = _encode(arrays)
        if len(data) > self.capacity:
            return
        self._shrink(len(data))
        tmp = self._path(key) + ".tmp"
        try:
            write_file(tmp, data)
            os.replace(tmp, self._path(key))
        except OSError as e:
            try:
                os.remove(tmp)
            except OSError:
                pass
            if e.errno in _DISK_FULL:
                self._off(f"writing to {self.dir} failed: {e.strerror or e}")
                return
            raise
        with self._lock:
            self.index[key] = len(data)
            self.bytes += len(data)
        self.writes += 1

    def _shrink(self, room: int) -> None:
        """Delete least recently used records until `room` more bytes fit."""
        while self.index and self.bytes + room > self.capacity:
            with self._lock:
                key, size = self.index.popitem(last=False)
                self.bytes -= size
            try:
                os.remove(self._path(key))
            except OSError:
                pass

    def stats(self) -> dict:
        return {"enabled": self.enabled, **({"off_because": self.why_off} if self.why_off else {}),
                "dir": self.dir, "capacity_bytes": self.capacity, "bytes": self.bytes, "records": len(self.index),
                "writes": self.writes, "reads": self.reads, "corrupt_dropped": self.corrupt}


def write_file(path: str, data: bytes) -> None:
    """One file, written whole (a seam for tests that fill the disk)."""
    with open(path, "wb") as f:
        f.write(data)
