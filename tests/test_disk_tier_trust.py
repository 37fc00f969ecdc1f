"""The SSD tier a security engineer would sign (#40): a record names its own key and
identity under its checksum, so records renamed, copied across prompts, crafted or moved
are misses, never served; links are never followed; folders are private and a foreign or
open one turns the tier off; junk in the folder is skipped; the writer thread ends with
its store. Each attack is re-run against a real engine: answers equal a run without the
tier and the engine stays up."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import struct
import threading

import numpy as np
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.kv import disk_tier
from macinfer.kv.disk_tier import MAGIC, DiskStore
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [np.random.default_rng(s).integers(10, 250, 200).tolist() for s in range(4)]


def _engine(path, disk_dir=None, **kw):
    kw = {"kv_cache_gb": 0.05, "max_model_len": 1024, **kw}
    if disk_dir is not None:
        kw.update(kv_disk_gb=0.5, kv_disk_dir=str(disk_dir))
    return LLMEngine(path, EngineConfig(**kw))


@pytest.fixture(scope="module")
def plain_answers(tiny_llama):
    """What each prompt gets with no tier at all."""
    return [o.token_ids for o in generate(_engine(tiny_llama), PROMPTS, GREEDY)]


@pytest.fixture
def written(tiny_llama, tmp_path, plain_answers):
    """A tier holding the four prompts' records (written at close), and its folder."""
    engine = _engine(tiny_llama, tmp_path / "kv")
    assert [o.token_ids for o in generate(engine, PROMPTS, GREEDY)] == plain_answers
    engine.close()
    return tmp_path / "kv", engine.block_manager.disk.store.dir


def _records(d: str) -> list[str]:
    return sorted(f for f in os.listdir(d) if f.endswith(".kv"))


def _rerun(tiny_llama, root, plain_answers):
    """A restarted engine on the folder: every prompt answered as without the tier."""
    warm = _engine(tiny_llama, root)
    outs = generate(warm, PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_answers
    warm.close()
    return warm.block_manager.disk, outs



def test_records_renamed_over_each_other_are_misses(tiny_llama, written, plain_answers):
    root, d = written
    files = _records(d)
    assert len(files) >= 40
    # swap pairs of records by renaming (the attack)
    for a, b in zip(files[0::2], files[1::2]):
        os.rename(os.path.join(d, a), os.path.join(d, "swap"))
        os.rename(os.path.join(d, b), os.path.join(d, a))
        os.rename(os.path.join(d, "swap"), os.path.join(d, b))
    disk, outs = _rerun(tiny_llama, root, plain_answers)
    assert disk.store.corrupt >= 1 and disk.store.reads + disk.store.corrupt >= 1


def test_a_record_copied_over_another_prompts_name_is_a_miss(tiny_llama, written, plain_answers):
    root, d = written
    files = _records(d)
    for name in files[1:]:
        shutil.copyfile(os.path.join(d, files[0]), os.path.join(d, name))  # every name now holds one record
    disk, outs = _rerun(tiny_llama, root, plain_answers)
    assert disk.store.corrupt >= 1
    assert all(o.num_cached_tokens <= 16 for o in outs)  # at most the one true block was served


def test_a_record_moved_from_another_models_folder_is_a_miss(tiny_llama, written, plain_answers, tmp_path):
    root, d = written
    other = os.path.join(str(root), "0" * 24)
    os.makedirs(other, mode=0o700)
    name = _records(d)[0]
    shutil.copyfile(os.path.join(d, name), os.path.join(other, name))
    store = DiskStore(str(root), "0" * 24, 1 << 30)
    assert name[:-3] in store and store.get(name[:-3]) is None and store.corrupt == 1
    store.close()


def _crafted(key: str, identity: str, header: bytes, body: bytes = b"\0" * 16) -> bytes:
    payload = MAGIC + struct.pack("<I", len(header)) + header + body
    return payload + hashlib.blake2b(payload, digest_size=16).digest()


@pytest.mark.parametrize("header", [
    b'[["|V0",[4]]]', b'[["xx",[1]]]', b"5", b'{"key": 1}', b"[" * 5000 + b"]" * 5000, b"\xff\xfe",
    b'{"key": "K", "identity": "I", "arrays": [["|V0", [4]]]}',
    b'{"key": "K", "identity": "I", "arrays": [["<f4", [-1]]]}',
    b'{"key": "K", "identity": "I", "arrays": [["<f4", [1099511627775, 1099511627775]]]}',
    b'{"key": "K", "identity": "I", "arrays": [["|O", [1]]]}',
    b'{"key": "K", "identity": "I", "arrays": 5}',
    b'{"key": "K", "identity": "I", "arrays": [["<f4", [true]]]}',
    b'{"key": "K", "identity": "I", "arrays": [["<f4", [2]]]}',  # 8 bytes of a 16-byte body: too long
])
def test_crafted_records_with_valid_checksums_are_misses(tmp_path, header):
    key = "0-" + "ab" * 16
    store = DiskStore(str(tmp_path), "I", 1 << 20)
    path = os.path.join(store.dir, key + ".kv")
    with open(path, "wb") as f:
        f.write(_crafted(key, "I", header.replace(b'"K"', json.dumps(key).encode())))
    store.close()
    store = DiskStore(str(tmp_path), "I", 1 << 20)
    assert key in store
    assert store.get(key) is None and store.corrupt == 1 and not os.path.exists(path)
    store.close()


def test_crafted_records_in_a_real_folder_leave_the_engine_up(tiny_llama, written, plain_answers):
    """Every record replaced by a crafted one (the issue's headers, valid checksums): the
    engine answers, twice (a restart on the same folder too)."""
    root, d = written
    headers = [b'[["|V0",[4]]]', b'[["xx",[1]]]', b"5"]
    for i, name in enumerate(_records(d)):
        with open(os.path.join(d, name), "wb") as f:
            f.write(_crafted(name[:-3], os.path.basename(d), headers[i % 3]))
    disk, _ = _rerun(tiny_llama, root, plain_answers)
    assert disk.store.corrupt >= 1
    _rerun(tiny_llama, root, plain_answers)


def test_planted_links_are_never_followed(tiny_llama, written, plain_answers, tmp_path):
    root, d = written
    outside = tmp_path / "outside"
    outside.mkdir()
    victims = []
    for i, name in enumerate(_records(d)):
        target = outside / f"victim{i}"
        target.write_bytes(b"precious")
        victims.append(target)
        os.remove(os.path.join(d, name))
        os.symlink(target, os.path.join(d, name))  # a link where a record was
    disk, outs = _rerun(tiny_llama, root, plain_answers)  # reads skip the links; writes replace them
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert all(v.read_bytes() == b"precious" for v in victims)
    assert disk.store.skipped == len(victims)
    # the close wrote real records in place of the links
    assert all(os.path.isfile(os.path.join(d, n)) and not os.path.islink(os.path.join(d, n)) for n in _records(d))


def test_a_link_to_a_record_read_directly_is_a_miss(tmp_path):
    store = DiskStore(str(tmp_path), "I", 1 << 20)
    key = "0-" + "cd" * 16
    store.put(key, [np.ones(4, np.float32)])
    store.flush()
    real = os.path.join(store.dir, key + ".kv")
    os.rename(real, str(tmp_path / "elsewhere"))
    os.symlink(str(tmp_path / "elsewhere"), real)
    assert store.get(key) is None and store.corrupt == 1  # O_NOFOLLOW: the link is not opened
    assert (tmp_path / "elsewhere").exists()  # dropping removes the link, not its target
    store.close()


def test_files_are_private_and_an_older_open_folder_is_closed(tmp_path, tiny_llama):
    root = tmp_path / "kv"
    engine = _engine(tiny_llama, root)
    generate(engine, PROMPTS[:1], GREEDY)
    engine.close()
    d = engine.block_manager.disk.store.dir
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700 and stat.S_IMODE(os.stat(d).st_mode) == 0o700
    modes = {stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode) for f in _records(d)}
    assert modes == {0o600}
    # a folder and files left 0755/0644 (by an older version) are made private at start
    os.chmod(d, 0o755)
    for f in _records(d):
        os.chmod(os.path.join(d, f), 0o644)
    again = _engine(tiny_llama, root)
    assert again.block_manager.disk.enabled
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert {stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode) for f in _records(d)} == {0o600}
    again.close()


def test_a_folder_writable_by_others_turns_the_tier_off(tmp_path, tiny_llama, caplog, plain_answers):
    root = tmp_path / "kv"
    probe = _engine(tiny_llama, root)
    d = probe.block_manager.disk.store.dir
    probe.close()
    os.chmod(d, 0o777)  # pre-created open to everyone (the attack)
    engine = _engine(tiny_llama, root)
    assert not engine.block_manager.disk.enabled and "writable by other users" in caplog.text
    assert [o.token_ids for o in generate(engine, PROMPTS, GREEDY)] == plain_answers
    assert not _records(d)
    engine.close()


def test_a_folder_owned_by_another_user_turns_the_tier_off(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(disk_tier.os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    store = DiskStore(str(tmp_path / "kv"), "I", 1 << 20)
    assert not store.enabled and "belongs to another user" in caplog.text
    store.put("0-" + "ab" * 8, [np.ones(2, np.float32)])  # a no-op, nothing written
    assert not os.path.exists(store.dir)  # refused at the root: nothing made inside


def test_a_root_that_is_a_link_or_a_file_turns_the_tier_off(tmp_path, caplog):
    (tmp_path / "real").mkdir(mode=0o700)
    os.symlink(tmp_path / "real", tmp_path / "link")
    store = DiskStore(str(tmp_path / "link"), "I", 1 << 20)
    assert not store.enabled and "not a folder" in caplog.text


def test_junk_entries_in_the_folder_are_skipped(tmp_path, tiny_llama, plain_answers, written):
    root, d = written
    os.symlink(str(tmp_path / "nowhere"), os.path.join(d, "x.kv"))  # a dangling link
    os.mkdir(os.path.join(d, "y.tmp"))
    os.mkdir(os.path.join(d, "0-abcdef0123456789.kv"))
    (tmp_path / "kv" / os.path.basename(d) / "notes.txt").write_text("hello")
    (tmp_path / "kv" / os.path.basename(d) / "leftover.tmp").write_bytes(b"half a record")
    disk, outs = _rerun(tiny_llama, root, plain_answers)
    assert disk.store.skipped == 4 and not os.path.exists(os.path.join(d, "leftover.tmp"))
    assert all(o.num_cached_tokens >= 176 for o in outs)  # the real records still serve


def test_the_writer_thread_ends_with_its_store(tiny_llama, tmp_path):
    def writers():
        return sum(t.name == "macinfer-kv-disk" for t in threading.enumerate())

    before = writers()
    for i in range(5):
        engine = _engine(tiny_llama, tmp_path / "kv")
        generate(engine, PROMPTS[:1], GREEDY)
        assert writers() == before + 1
        engine.close()
        assert writers() == before
