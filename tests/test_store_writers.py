"""Shard store writers: failed writes (inside the write, and at a real file-size limit) leave
committed data intact, and several writer processes share one store."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
from store_samples import make_sample, new_store
from test_store import assert_same_sample, run_python, start_python

from dspark.store import (
    ShardStore,
)


def test_failure_inside_the_write_keeps_commits_and_removes_the_partial_shard(tmp_path, monkeypatch):
    path = tmp_path / "s"
    store = new_store(path)
    store.write_shard([make_sample(1, 30)])
    manifest = (path / "manifest.json").read_bytes()

    def disk_full(rel):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store._files, "sync_tree", disk_full)  # the shard group is on disk by now
    with pytest.raises(OSError, match="No space"):
        store.write_shard([make_sample(2, 30)])
    monkeypatch.undo()
    # The manifest replace itself fails: the old manifest must stay whole.
    monkeypatch.setattr(os, "replace", lambda *a: disk_full(None))
    with pytest.raises(OSError, match="No space"):
        store.write_shard([make_sample(3, 30)])
    monkeypatch.undo()

    assert (path / "manifest.json").read_bytes() == manifest
    assert not [p.name for p in path.iterdir() if "tmp" in p.name]
    assert sorted(os.listdir(path / "shards")) == ["00000", "zarr.json"]
    assert not list((path / ".writers").glob("*.claim"))
    reader = ShardStore.open(path)
    assert [r.sample_id for r in reader.index()] == [1]
    assert_same_sample(reader.read(reader.index()[0]), make_sample(1, 30))
    assert reader.verify() == []


def test_write_failing_at_a_real_file_size_limit_leaves_commits_intact(tmp_path):
    path = tmp_path / "s"
    store = new_store(path)
    store.write_shard([make_sample(1, 30)])
    store.write_shard([make_sample(2, 30)])
    manifest = (path / "manifest.json").read_bytes()
    # RLIMIT_FSIZE makes the kernel fail writes past 64 KiB (EFBIG), like a full disk
    # part-way through the shard; random bits do not compress, so the shard is ~200 KiB.
    res = run_python(f"""
        import resource, signal, sys
        from store_samples import make_sample, new_store
        store = new_store({str(path)!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        try:
            store.write_shard([make_sample(3, 1000)])
        except OSError as e:
            print("errno", e.errno)
            sys.exit(0)
        sys.exit("the write did not fail")
    """)
    assert res.returncode == 0, res.stderr + res.stdout
    assert f"errno {errno.EFBIG}" in res.stdout

    assert (path / "manifest.json").read_bytes() == manifest
    store = new_store(path)
    assert [r.sample_id for r in store.index()] == [1, 2]
    for ref, sid in zip(store.index(), (1, 2)):
        assert_same_sample(store.read(ref), make_sample(sid, 30))
    assert store.verify() == []
    store.clean_uncommitted()
    assert sorted(os.listdir(path / "shards")) == ["00000", "00001", "zarr.json"]
    store.write_shard([make_sample(3, 1000)])  # with space again, the rerun succeeds
    assert store.committed_sample_ids() == {1, 2, 3} and store.verify() == []


# --------------------------------------------------------------------------- verify


# --------------------------------------------------------------------------- concurrency

WRITER = """
    import sys, time
    from pathlib import Path
    from store_samples import make_sample, new_store
    path, writer, go = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    Path(f"{go}.ready{writer}").touch()
    while not go.exists():
        time.sleep(0.01)
    store = new_store(path)  # both processes create/open the same fresh store at once
    store.clean_uncommitted()
    for k in range(6):
        ids = [writer * 1000 + 3 * k + j for j in range(3)]
        store.write_shard([make_sample(i, 20 + i % 7) for i in ids])
"""


def test_two_writer_processes_share_one_store(tmp_path):
    path, go = tmp_path / "s", tmp_path / "go"
    procs = [start_python(WRITER, str(path), str(w), str(go)) for w in (1, 2)]
    deadline = time.monotonic() + 60
    while not all(Path(f"{go}.ready{w}").exists() for w in (1, 2)):  # release both at once
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
        time.sleep(0.01)
    go.touch()
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()

    store = ShardStore.open(path)
    expected = {w * 1000 + i for w in (1, 2) for i in range(18)}
    refs = store.index()
    assert sorted(r.sample_id for r in refs) == sorted(expected)  # every sample exactly once
    assert sorted(store.shard_names()) == [f"{i:05d}" for i in range(12)]
    for ref in refs:
        assert_same_sample(store.read(ref), make_sample(ref.sample_id, 20 + ref.sample_id % 7))
    assert store.verify() == []
    assert not list((path / ".writers").glob("*.claim"))


def test_clean_uncommitted_spares_a_live_writers_shard(tmp_path):
    path, ready, go = tmp_path / "s", tmp_path / "ready", tmp_path / "go"
    new_store(path).write_shard([make_sample(1, 10)])
    code = f"""
        import time
        from pathlib import Path
        from store_samples import make_sample, new_store
        from dspark.store import StoreWriter
        commit = StoreWriter._commit
        def paused_commit(self, *a, **k):  # shard written, not yet committed
            Path({str(ready)!r}).touch()
            while not Path({str(go)!r}).exists():
                time.sleep(0.01)
            return commit(self, *a, **k)
        StoreWriter._commit = paused_commit
        new_store({str(path)!r}).write_shard([make_sample(2, 10)])
    """
    proc = start_python(code)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timeout"
            time.sleep(0.02)
        store = new_store(path)
        assert store.clean_uncommitted() == []
        assert (path / "shards" / "00001" / "hidden" / "zarr.json").exists()
        assert store.write_shard([make_sample(3, 10)])["name"] == "00002"  # skips the claimed name
    finally:
        go.touch()
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    assert sorted(r.sample_id for r in store.index()) == [1, 2, 3]
    assert store.verify() == []


def test_shard_writer_commits_in_the_background_in_order_and_raises_a_failed_commit(tmp_path, monkeypatch):
    """The extraction client's writer: a full buffer is committed in a thread while samples keep
    arriving (the server is not left idle during a shard write), one commit at a time, in order;
    a commit that fails raises in the next caller that commits or flushes."""
    import asyncio
    import threading

    from dspark.extract.client import ShardWriter

    store = new_store(tmp_path / "s")
    release, started, committed = threading.Event(), threading.Event(), []
    write_shard = store.write_shard

    def slow_write(batch):  # the real write, held until the test lets it go
        started.set()
        assert release.wait(30)
        return write_shard(batch)

    monkeypatch.setattr(store, "write_shard", slow_write)
    writer = ShardWriter(store, shard_samples=2, shard_tokens=10**6, on_commit=committed.append)

    async def scenario():
        await writer.add(make_sample(1, 8))
        await writer.add(make_sample(2, 8))  # full: the commit starts, add returns at once
        assert await asyncio.to_thread(started.wait, 30)
        await writer.add(make_sample(3, 8))  # buffered while shard 1 is being written
        assert committed == [] and store.committed_sample_ids() == set()
        second = asyncio.ensure_future(writer.add(make_sample(4, 8)))  # full again: waits for shard 1
        await asyncio.sleep(0.2)
        assert not second.done()
        release.set()
        await second
        await writer.flush()

    asyncio.run(scenario())
    assert [c["n_samples"] for c in committed] == [2, 2]
    reader = ShardStore.open(tmp_path / "s")
    assert [r.sample_id for r in reader.index()] == [1, 2, 3, 4] and reader.verify() == []

    def disk_full(batch):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "write_shard", disk_full)

    async def failing():
        await writer.add(make_sample(5, 8))
        await writer.add(make_sample(6, 8))  # the commit starts and fails in its thread
        with pytest.raises(OSError, match="No space"):
            await writer.flush()
        await writer.flush()  # raised once: nothing left running or buffered

    asyncio.run(failing())
    assert [r.sample_id for r in ShardStore.open(tmp_path / "s").index()] == [1, 2, 3, 4]
