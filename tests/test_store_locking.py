"""Two nodes on one store directory where flock does not reach across them.

The other node is a real process in its own UTS namespace with another hostname
(`unshare --uts`), so its claim and lock files carry another node identity. It leaves a
claim and a half-written shard, or the manifest lock's owner file, and exits: its flock is
gone, which is exactly what this node sees of a LIVE writer on another node when the
filesystem's flock is node-local. Nothing of it may be deleted or broken into until it is
old; a dead writer of this node is still cleaned at once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from store_samples import make_sample, new_store

from dspark.store import files as store_files

REPO = Path(__file__).resolve().parents[1]

OTHER_NODE = textwrap.dedent("""
    import os, sys
    from store_samples import new_store

    store = new_store(sys.argv[1])
    if sys.argv[2] == "claim":  # a shard claimed and half written, never committed
        name = store.next_shard_name()
        assert store._files.try_claim(name) is not None
        (store._files.root / "shards" / name).mkdir(parents=True)
        (store._files.root / "shards" / name / "zarr.json").write_text("{}")
    else:  # inside a manifest update
        held = store._files.locked()
        held.__enter__()
    print(store._files.root, flush=True)
    os._exit(0)  # no release: its flock dies with it, its files stay
""")


def run_writer(tmp_path: Path, store: Path, what: str, other_node: bool = True) -> None:
    """The writer script in a process of its own: as another host, or (other_node=False) on this one."""
    script = tmp_path / "writer.py"
    script.write_text(OTHER_NODE)
    cmd = [sys.executable, str(script), str(store), what]
    if other_node:
        if shutil.which("unshare") is None or subprocess.run(["unshare", "--uts", "true"]).returncode != 0:
            pytest.skip("needs `unshare --uts` (root, or user namespaces) to run a process as another host")
        cmd = ["unshare", "--uts", "sh", "-c", 'hostname other-node && exec "$0" "$@"', *cmd]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def age(path: Path, seconds: float) -> None:
    """Make a claim/lock file `seconds` old (its recorded time)."""
    info = json.loads(path.read_text())
    assert info["host"] == "other-node"
    path.write_text(json.dumps({**info, "time": time.time() - seconds}))


def test_cleanup_spares_another_nodes_claim_until_it_is_old(tmp_path):
    path = tmp_path / "store"
    store = new_store(path)
    store.write_shard([make_sample(0, 8)])
    run_writer(tmp_path, path, "claim")
    claim = path / ".writers" / "00001.claim"
    assert (path / "shards" / "00001").is_dir() and claim.exists()

    assert store.clean_uncommitted() == []  # its flock is free here, but it may be alive over there
    assert (path / "shards" / "00001").is_dir()
    assert store.write_shard([make_sample(1, 8)])["name"] == "00002"  # and its name stays taken

    age(claim, store_files.FOREIGN_CLAIM_STALE_S + 60)
    assert store.clean_uncommitted() == ["00001"]
    assert not (path / "shards" / "00001").exists() and not claim.exists()
    assert sorted(r.sample_id for r in store.index()) == [0, 1] and store.verify() == []


def test_a_dead_writer_of_this_node_is_cleaned_at_once(tmp_path):
    path = tmp_path / "store"
    store = new_store(path)
    run_writer(tmp_path, path, "claim", other_node=False)
    assert store.clean_uncommitted() == ["00000"]  # this kernel's flock: its writer is gone
    assert not (path / "shards" / "00000").exists()
    run_writer(tmp_path, path, "lock", other_node=False)
    assert store.write_shard([make_sample(0, 8)])["name"] == "00000"  # its lock owner file is void too


def test_manifest_lock_held_on_another_node_is_waited_for(tmp_path, monkeypatch):
    path = tmp_path / "store"
    store = new_store(path)
    run_writer(tmp_path, path, "lock")
    owner = path / ".writers" / "manifest.lock.owner"
    assert owner.exists()
    monkeypatch.setattr(store_files, "LOCK_TIMEOUT_S", 1.0)
    with pytest.raises(TimeoutError, match="held by another node"):  # the flock alone would let us in
        store.write_shard([make_sample(0, 8)])
    assert store.refresh()["shards"] == [] and not (path / "shards" / "00000").exists()

    age(owner, store_files.FOREIGN_LOCK_STALE_S + 60)
    assert store.write_shard([make_sample(0, 8)])["name"] == "00000"
    assert not owner.exists()
