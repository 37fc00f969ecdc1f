"""The SSD tier under the prefix cache: evicted K/V blocks and state snapshots as files.

One directory per model identity (weights fingerprint, config, dtypes, cache layout), one
file per record, named by the record's key (a cache group or the state, and the chained
block hash, which already folds in the request's isolation salt). A file is

    MAGIC | header length (u32) | header | arrays' bytes | blake2b-16

where the header (JSON) names the record's own key and identity and its arrays' dtypes and
shapes, all under the checksum: a record renamed, copied over another prompt's name or moved
to another model's folder does not name what was asked for and is a miss (dropped, counted),
never served. Anything odd in the folder (a crafted header, a link, a directory, a foreign
name) is a miss or skipped, never a crash.

Nobody else may read or plant records (they hold the prompts' K/V): folders are 0700 and
files 0600, created with O_EXCL and O_NOFOLLOW; a folder owned by another user or writable
by others turns the tier off with a warning.

Records are written by one background thread per store, ended by `close`: the engine hands
over copies already made (`put`), and the step never waits on the disk. The store is
bounded by its size, least recently used first (file times order it across restarts). A
write that fails for want of space or permission turns the tier off with one warning;
requests go on without it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import re
import secrets
import stat
import struct
import threading
import time
from collections import OrderedDict

import numpy as np

log = logging.getLogger("macinfer.kv")

MAGIC = b"MIKV2\n"
_DIGEST = 16
_MAX_HEADER = 1 << 16
_KEY = re.compile(r"^[0-9a-z]{1,8}-[0-9a-f]{8,128}$")  # `{group}-{hash}` or `s-{hash}`
_DTYPES = {"|u1", "|i1", "<u2", "<i2", "<f2", "<u4", "<i4", "<f4", "<u8", "<i8", "<f8"}
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def default_dir() -> str:
    """`kv` in macinfer's cache folder (the one the autotune verdicts live in)."""
    from macinfer.kernels.autotune import cache_dir

    return str(cache_dir() / "kv")


def _encode(key: str, identity: str, arrays: list[np.ndarray]) -> bytes:
    header = json.dumps({"key": key, "identity": identity,
                         "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}).encode()
    body = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    payload = MAGIC + struct.pack("<I", len(header)) + header + body
    return payload + hashlib.blake2b(payload, digest_size=_DIGEST).digest()


def _decode(data: bytes, key: str, identity: str) -> list[np.ndarray]:
    """The arrays of a record of `key` under `identity`; ValueError when the bytes are not
    a whole, intact record of exactly that key and identity with a well-formed header."""
    if len(data) < len(MAGIC) + 4 + _DIGEST or not data.startswith(MAGIC):
        raise ValueError("not a record (truncated, foreign or an older format)")
    payload, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.blake2b(payload, digest_size=_DIGEST).digest() != digest:
        raise ValueError("checksum mismatch")
    (n,) = struct.unpack_from("<I", payload, len(MAGIC))
    start = len(MAGIC) + 4
    if n > _MAX_HEADER or start + n > len(payload):
        raise ValueError("header length out of range")
    try:
        header = json.loads(payload[start:start + n])
    except (ValueError, RecursionError) as e:
        raise ValueError(f"header is not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict) or set(header) != {"key", "identity", "arrays"}:
        raise ValueError("header is not a record header")
    if header["key"] != key or header["identity"] != identity:
        raise ValueError("the record names another key or model (renamed, copied or moved)")
    layout = header["arrays"]
    if not isinstance(layout, list):
        raise ValueError("header's arrays are not a list")
    pos, out = start + n, []
    for entry in layout:
        if (not isinstance(entry, list) or len(entry) != 2 or entry[0] not in _DTYPES
                or not isinstance(entry[1], list) or len(entry[1]) > 8
                or not all(type(d) is int and 0 <= d < 1 << 40 for d in entry[1])):
            raise ValueError("header names an array badly")
        dt, shape = np.dtype(entry[0]), tuple(entry[1])
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        size = dt.itemsize * count
        if pos + size > len(payload):
            raise ValueError("shorter than its header says")
        out.append(np.frombuffer(payload, dt, count=count, offset=pos).reshape(shape))
        pos += size
    if pos != len(payload):
        raise ValueError("longer than its header says")
    return out


def private_dir(path: str) -> str | None:
    """Create `path` (0700) if missing; None when it may be used, else why not: it must be a
    real folder (not a link), ours, and writable by no one else."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        return f"cannot create {path}: {e.strerror or e}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a folder (a link or a file)"
    if st.st_uid != os.getuid():
        return f"{path} belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    if st.st_mode & 0o077:  # ours but readable by others (made by an older version): close it
        try:
            os.chmod(path, 0o700)
        except OSError as e:
            return f"cannot make {path} private: {e.strerror or e}"
    return None


def _read_record(path: str, limit: int) -> bytes:
    """A record's bytes: a regular file, not followed through a link, at most `limit` bytes."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > limit:
            raise ValueError("larger than the store")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)


class DiskStore:
    """Records by key under `root/identity`, at most `capacity` bytes."""

    def __init__(self, root: str, identity: str, capacity: int):
        self.dir = os.path.join(root, identity)
        self.identity = identity
        self.capacity = capacity
        self.enabled = True
        self.why_off = ""
        self.index: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recently used first
        self.bytes = 0
        self.writes = self.reads = self.corrupt = self.skipped = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=4096)
        self._writing: set[str] = set()
        self._thread: threading.Thread | None = None
        self._closed = False
        why = private_dir(root) or private_dir(self.dir)
        if why is None:
            try:
                self._probe()
            except OSError as e:
                why = f"cannot write {self.dir}: {e.strerror or e}"
        if why is not None:
            self._off(why)
            return
        self._scan()
        self._thread = threading.Thread(target=self._writer, name="macinfer-kv-disk", daemon=True)
        self._thread.start()

    def _probe(self) -> None:
        probe = os.path.join(self.dir, f".probe-{secrets.token_hex(4)}")
        write_file(probe, b"ok")
        os.remove(probe)

    def _off(self, why: str) -> None:
        if self.enabled:
            self.enabled, self.why_off = False, why
            log.warning("KV disk tier turned off: %s; requests go on without it", why)

    def _scan(self) -> None:
        """The index from the folder: regular `<key>.kv` files; a leftover `.tmp` file (a write
        cut short) is removed; anything else (links, folders, foreign names) is skipped."""
        found, odd = [], []
        try:
            entries = list(os.scandir(self.dir))
        except OSError as e:
            self._off(f"cannot list {self.dir}: {e.strerror or e}")
            return
        for entry in entries:
            try:
                regular = entry.is_file(follow_symlinks=False)
                if regular and entry.name.endswith(".tmp"):
                    os.remove(entry.path)
                elif regular and entry.name.endswith(".kv") and _KEY.match(entry.name[:-3]):
                    st = entry.stat(follow_symlinks=False)
                    if st.st_mode & 0o077:
                        os.chmod(entry.path, 0o600)
                    found.append((st.st_mtime, entry.name[:-3], st.st_size))
                else:
                    odd.append(entry.name)
            except OSError:
                odd.append(entry.name)
        for _, key, size in sorted(found):
            self.index[key] = size
            self.bytes += size
        self.skipped = len(odd)
        if odd:
            log.warning("KV disk tier: %d entries in %s are not records and were skipped (%s)", len(odd),
                        self.dir, ", ".join(sorted(odd)[:5]) + (", ..." if len(odd) > 5 else ""))
        self._shrink(0)
        if self.index:
            log.info("KV disk tier: %d records (%.2f GiB) in %s", len(self.index), self.bytes / 2**30, self.dir)

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key + ".kv")

    # -- reads (the engine thread) ------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return self.enabled and (key in self.index or key in self._writing)

    def get(self, key: str) -> list[np.ndarray] | None:
        """The record's arrays, or None: absent, or not a whole record of this key and
        identity (then dropped, counted and logged; its tokens are recomputed)."""
        if key not in self:
            return None
        try:
            arrays = _decode(_read_record(self._path(key), self.capacity), key, self.identity)
        except FileNotFoundError:
            if key in self._writing:  # still queued: the writer has it
                return None
            self._forget(key)
            return None
        except Exception as e:  # whatever a damaged or planted file does, it is a miss
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
                os.remove(self._path(key))  # a link is removed, never followed
            except OSError:
                pass

    # -- writes (handed to the writer thread) --------------------------------------------
    def put(self, key: str, arrays: list) -> None:
        """Queue a record (arrays: evaluated MLX or NumPy arrays, not to be changed after)."""
        if not self.enabled or self._closed or key in self.index or key in self._writing:
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

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued (up to `timeout`) and end the writer thread."""
        self._closed = True
        if self._thread is None:
            return
        self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, arrays = item
            try:
                if self.enabled:
                    self._write(key, [np.asarray(a) for a in arrays])
            except Exception:  # never let the writer die: that record is lost, the tier goes on
                log.exception("KV disk tier: writing %s failed", key)
            finally:
                self._writing.discard(key)

    def _write(self, key: str, arrays: list[np.ndarray]) -> None:
        data = _encode(key, self.identity, arrays)
        if len(data) > self.capacity:
            return
        self._shrink(len(data))
        tmp = f"{self._path(key)}.{secrets.token_hex(4)}.tmp"
        try:
            write_file(tmp, data)
            os.replace(tmp, self._path(key))  # replaces a planted link itself, never its target
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
                "writes": self.writes, "reads": self.reads, "corrupt_dropped": self.corrupt,
                "skipped_entries": self.skipped}


def write_file(path: str, data: bytes) -> None:
    """A new private file, written whole; never through a link nor over an existing file
    (a seam for tests that fill the disk)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
