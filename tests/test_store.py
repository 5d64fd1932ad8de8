"""Shard store: exact bf16 round trip, the public layout, atomic commits, refusal of a
store made for something else, corruption detection, fsspec URLs. Writers that fail or run
side by side: tests/test_store_writers.py."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
import zarr
from store_samples import EXTRA, TARGET, TOKENIZER, make_sample, new_store

from dspark import store as store_mod
from dspark.store import (
    Sample,
    ShardStore,
    StoreMismatchError,
    StoreWriter,
    bf16_to_bits,
    bits_to_tensor,
)
from dspark.store import files as store_files

REPO = Path(__file__).resolve().parents[1]


def assert_same_sample(got: Sample, want: Sample) -> None:
    assert got.sample_id == want.sample_id
    for key in ("token_ids", "loss_mask", "hidden"):
        a, b = getattr(got, key), getattr(want, key)
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert np.array_equal(a, b), key


def start_python(code: str, *args: str, **kw) -> subprocess.Popen:
    """Start `code` in a fresh interpreter that can import this test module's helpers."""
    prelude = f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", prelude + textwrap.dedent(code), *args],
        env=env,
        cwd=REPO,
        text=True,
        stderr=subprocess.PIPE,
        **kw,
    )


def run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = start_python(code, *args, stdout=subprocess.PIPE)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def verify_cli(path: Path) -> subprocess.CompletedProcess:
    """`python -m extract.verify store=<path>`, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "extract.verify", f"store={path}"],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# --------------------------------------------------------------------------- bf16 bits


def test_bf16_bits_round_trip_every_pattern():
    every = np.arange(1 << 16, dtype=np.uint16)  # all bf16 values: ±0, subnormals, ±inf, NaNs
    t = bits_to_tensor(every)
    assert t.dtype == torch.bfloat16
    assert np.array_equal(bf16_to_bits(t), every)
    # Independent anchors: IEEE bf16 encodings by hand.
    special = torch.tensor([1.0, -0.0, float("inf"), float("-inf"), -2.0], dtype=torch.bfloat16)
    assert bf16_to_bits(special).tolist() == [0x3F80, 0x8000, 0x7F80, 0xFF80, 0xC000]
    assert torch.isnan(bits_to_tensor(np.array([0x7FC1, 0xFFFF], np.uint16))).all()
    # fp32 input is rounded exactly like torch's own cast.
    x = torch.randn(1000) * 1e3
    assert np.array_equal(bf16_to_bits(x), bf16_to_bits(x.to(torch.bfloat16)))
    with pytest.raises(TypeError, match="floating"):
        bf16_to_bits(torch.arange(3))
    with pytest.raises(TypeError, match="uint16"):
        bits_to_tensor(np.zeros(3, np.int32))


def test_every_bf16_pattern_survives_the_store(tmp_path):
    store = new_store(tmp_path / "s")
    n_tokens = (1 << 16) // (3 * 32)  # 682 tokens x 3 layers x 32 = all patterns but a few
    pattern = np.arange(n_tokens * 3 * 32, dtype=np.uint16).reshape(n_tokens, 3, 32)
    pattern[-1, -1, -4:] = [0x7FC1, 0xFFFF, 0x8000, 0xFF80]  # NaN payloads, -0, -inf
    sample = Sample(7, np.arange(n_tokens, dtype=np.int32), np.ones(n_tokens, np.uint8), pattern)
    store.write_shard([sample])
    got = ShardStore.open(tmp_path / "s").read(store.index()[0])
    assert_same_sample(got, sample)
    back = bits_to_tensor(got.hidden)
    assert torch.equal(back.view(torch.int16), torch.from_numpy(pattern.view(np.int16)))


# --------------------------------------------------------------------------- layout


def test_layout_manifest_and_reads(tmp_path, capsys):
    path = tmp_path / "s"
    store = new_store(path)
    samples = [make_sample(i, n, gaussian=True) for i, n in zip(range(10, 17), (5, 300, 1, 257, 40, 513, 9))]
    e0 = store.write_shard(samples[:4])
    e1 = store.write_shard(samples[4:])
    assert (e0["name"], e1["name"]) == ("00000", "00001")

    # The public format, read with plain zarr/json as a user's tool would.
    root = zarr.open_group(str(path), mode="r")
    assert root.attrs["format_version"] == store_mod.FORMAT_VERSION == 1
    assert root.attrs["target"] == TARGET and root.attrs["tokenizer_sha256"] == TOKENIZER
    assert root.attrs["split"] == "train"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == 1
    assert [s["name"] for s in manifest["shards"]] == ["00000", "00001"]
    assert [(s["n_samples"], s["n_tokens"]) for s in manifest["shards"]] == [(4, 563), (3, 562)]
    for entry, part in ((manifest["shards"][0], samples[:4]), (manifest["shards"][1], samples[4:])):
        g = root[f"shards/{entry['name']}"]
        want = {
            "hidden": np.concatenate([s.hidden for s in part]),
            "token_ids": np.concatenate([s.token_ids for s in part]),
            "loss_mask": np.concatenate([s.loss_mask for s in part]),
            "offsets": np.cumsum([0] + [len(s.token_ids) for s in part]).astype(np.int64),
            "sample_ids": np.array([s.sample_id for s in part], np.int64),
        }
        for key, arr in want.items():
            assert g[key].dtype == arr.dtype and np.array_equal(g[key][...], arr), key
            assert entry["checksums"][key] == hashlib.sha256(arr.tobytes()).hexdigest()
        assert g.attrs["checksums"] == entry["checksums"]
        assert g["hidden"].chunks == (store_mod.HIDDEN_CHUNK_TOKENS, 3, 32)  # chunked along T
        assert g["hidden"].shards is not None  # sharding codec: a handful of files per shard
        assert sum(1 for f in (path / "shards" / entry["name"]).rglob("*") if f.is_file()) <= 11

    refs = store.index()
    assert [r.sample_id for r in refs] == [s.sample_id for s in samples]
    assert [(r.shard, r.start, r.end) for r in refs[:2]] == [("00000", 0, 5), ("00000", 5, 305)]
    for ref, want_sample in zip(refs, samples):
        assert_same_sample(store.read(ref), want_sample)
        assert np.array_equal(store.read_loss_mask(ref), want_sample.loss_mask)
    assert store.committed_sample_ids() == set(range(10, 17))
    assert store.verify() == []

    raw = sum(s.hidden.nbytes for s in samples)
    stored = sum(dir_bytes(path / "shards" / n / "hidden") for n in ("00000", "00001"))
    n_tokens = sum(len(s.token_ids) for s in samples)
    with capsys.disabled():
        print(
            f"\n[store] gaussian bf16 hidden: {stored / n_tokens:.0f} B/token stored vs {raw / n_tokens:.0f} raw "
            f"({raw / stored:.2f}x)"
        )
    assert raw / stored > 1.2  # lossless compression is on (exactness is asserted above)


def test_reader_is_picklable_and_read_only(tmp_path):
    import pickle

    store = new_store(tmp_path / "s")
    store.write_shard([make_sample(1, 20)])
    clone = pickle.loads(pickle.dumps(store))
    assert type(clone) is ShardStore and clone.index() == store.index()
    assert isinstance(store, StoreWriter) and not hasattr(clone, "write_shard")  # a reader cannot write


# --------------------------------------------------------------------------- refusal / bad input


def test_refuses_store_of_another_target_layers_tokenizer_or_data(tmp_path):
    path = tmp_path / "s"
    new_store(path).write_shard([make_sample(1, 10)])
    again = StoreWriter.create_or_open(str(path), {**TARGET, "layer_ids": (1, 3, 4)}, TOKENIZER, EXTRA)
    assert again.committed_sample_ids() == {1}  # same identity (a tuple is fine) reopens

    cases = [
        ({**TARGET, "layer_ids": [0, 2, 4]}, TOKENIZER, EXTRA, "target.layer_ids"),
        ({**TARGET, "name_or_path": "other/model"}, TOKENIZER, EXTRA, "target.name_or_path"),
        (TARGET, "ef" * 32, EXTRA, "tokenizer_sha256"),
        (TARGET, TOKENIZER, {**EXTRA, "data_config_sha256": "00"}, "data_config_sha256"),
    ]
    for target, tok, extra, field in cases:
        with pytest.raises(StoreMismatchError, match=field) as info:
            StoreWriter.create_or_open(str(path), target, tok, extra)
        assert str(path) in str(info.value)
    assert ShardStore.open(path).committed_sample_ids() == {1}

    bad_targets = [
        ({**TARGET, "layer_ids": [1, 3]}, "final layer 4"),
        ({**TARGET, "layer_ids": [3, 1, 4]}, "ascending"),
        ({**TARGET, "dtype": "float16"}, "target.dtype"),
        ({k: v for k, v in TARGET.items() if k != "hidden_size"}, "hidden_size"),
    ]
    for target, msg in bad_targets:
        with pytest.raises(ValueError, match=msg):
            StoreWriter.create_or_open(str(tmp_path / "new"), target, TOKENIZER)
    zarr.open_group(str(path), mode="r+").attrs["format_version"] = 2
    with pytest.raises(ValueError, match="format_version 2 is not readable"):
        ShardStore.open(path)
    (tmp_path / "notastore").mkdir()
    (tmp_path / "notastore" / "x.txt").write_text("hi")
    with pytest.raises(FileExistsError, match="not a shard store"):
        new_store(tmp_path / "notastore")
    with pytest.raises(FileNotFoundError, match="no shard store"):
        ShardStore.open(tmp_path / "missing")


def test_bad_samples_are_refused_naming_the_field(tmp_path):
    store = new_store(tmp_path / "s")
    store.write_shard([make_sample(1, 10)])
    before = (tmp_path / "s" / "manifest.json").read_bytes()
    good = make_sample(2, 10)
    bad = [
        (
            Sample(2, good.token_ids, good.loss_mask, good.hidden[:, :2]),
            ValueError,
            r"sample 2: hidden has shape \[10, 2, 32\]",
        ),
        (
            Sample(2, good.token_ids, good.loss_mask, good.hidden.astype(np.float32)),
            TypeError,
            "sample 2: hidden must be uint16",
        ),
        (Sample(2, good.token_ids[:5], good.loss_mask, good.hidden), ValueError, "sample 2: token_ids"),
        (Sample(2, good.token_ids, good.loss_mask + 2, good.hidden), ValueError, "sample 2: loss_mask"),
        (make_sample(1, 4), ValueError, r"already committed .*\[1\]"),
    ]
    for sample, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            store.write_shard([sample])
    with pytest.raises(ValueError, match="repeat"):
        store.write_shard([good, good])
    with pytest.raises(ValueError, match="no samples"):
        store.write_shard([])
    assert (tmp_path / "s" / "manifest.json").read_bytes() == before
    assert sorted(os.listdir(tmp_path / "s" / "shards")) == ["00000", "zarr.json"]


# --------------------------------------------------------------------------- atomic commit / failures


def test_shard_written_but_not_in_manifest_is_invisible_and_cleaned(tmp_path):
    path = tmp_path / "s"
    new_store(path).write_shard([make_sample(1, 30)])
    # A writer that dies after writing its shard group, before the manifest commit.
    res = run_python(f"""
        import os
        from store_samples import make_sample, new_store
        from dspark.store import StoreWriter
        StoreWriter._commit = lambda *a, **k: os._exit(3)
        new_store({str(path)!r}).write_shard([make_sample(2, 40), make_sample(3, 50)])
    """)
    assert res.returncode == 3, res.stderr
    assert (path / "shards" / "00001" / "hidden" / "zarr.json").exists()  # written ...
    store = new_store(path)
    assert [r.sample_id for r in store.index()] == [1]  # ... but does not exist
    assert store.committed_sample_ids() == {1} and store.verify() == []
    assert store.next_shard_name() == "00002"  # the leftover's name is not reused blindly

    assert store.clean_uncommitted() == ["00001"]
    assert not (path / "shards" / "00001").exists()
    assert not list((path / ".writers").glob("*.claim"))
    # The rerun redoes the lost samples.
    store.write_shard([make_sample(2, 40), make_sample(3, 50)])
    assert sorted(r.sample_id for r in store.index()) == [1, 2, 3]
    assert store.verify() == []


def test_verify_detects_flipped_byte_and_truncated_file(tmp_path):
    path = tmp_path / "s"
    store = new_store(path)
    store.write_shard([make_sample(i, 200 + i, gaussian=True) for i in range(3)])
    store.write_shard([make_sample(i, 100, gaussian=True) for i in range(3, 5)])
    assert store.verify() == []
    hidden_file = path / "shards/00000/hidden/c/0/0/0"
    tokens_file = path / "shards/00001/token_ids/c/0"
    hidden_bytes, token_bytes = hidden_file.read_bytes(), tokens_file.read_bytes()

    for pos in (len(hidden_bytes) // 3, len(hidden_bytes) - 3):  # in a chunk; in the shard index
        flipped = bytearray(hidden_bytes)
        flipped[pos] ^= 0x10
        hidden_file.write_bytes(bytes(flipped))
        problems = ShardStore.open(path).verify()
        assert len(problems) == 1 and problems[0].startswith("shards/00000/hidden"), problems
    hidden_file.write_bytes(hidden_bytes)

    tokens_file.write_bytes(token_bytes[: len(token_bytes) // 2])
    seen = {}
    problems = ShardStore.open(path).verify(on_shard=lambda name, p: seen.setdefault(name, p))
    assert len(problems) == 1 and problems[0].startswith("shards/00001/token_ids"), problems
    assert seen == {"00000": [], "00001": problems}

    cli = verify_cli(path)
    assert cli.returncode == 1, cli.stderr
    assert "OK      shards/00000" in cli.stdout and "PROBLEM shards/00001/token_ids" in cli.stdout

    tokens_file.write_bytes(token_bytes)
    cli = verify_cli(path)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "all OK" in cli.stdout

    manifest = json.loads((path / "manifest.json").read_text())
    manifest["shards"][1]["n_tokens"] += 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    problems = ShardStore.open(path).verify()
    assert {p.split(":")[0] for p in problems} == {
        "shards/00001/hidden",
        "shards/00001/token_ids",
        "shards/00001/loss_mask",
        "shards/00001",
    }, problems


# --------------------------------------------------------------------------- fsspec URLs


def test_fsspec_urls(tmp_path):
    url = f"memory://store-test-{uuid.uuid4().hex}/s"
    store = new_store(url)
    samples = [make_sample(i, 50 + i) for i in range(4)]
    store.write_shard(samples[:2])
    store.write_shard(samples[2:])
    reader = ShardStore.open(url)
    assert [r.sample_id for r in reader.index()] == [0, 1, 2, 3]
    for ref, want in zip(reader.index(), samples):
        assert_same_sample(reader.read(ref), want)
    assert reader.verify() == []
    with pytest.raises(StoreMismatchError, match="target.hidden_size"):
        StoreWriter.create_or_open(url, {**TARGET, "hidden_size": 64}, TOKENIZER, EXTRA)

    fs, root = fsspec.core.url_to_fs(url)
    assert not [p for p in fs.ls(f"{root}/.writers", detail=False) if p.endswith((".claim", ".lock"))]
    # Remote claims cannot die with their writer: an unfinished shard is cleaned only once
    # its claim is stale, and stays invisible until then.
    for name, age in (("00002", store_files.REMOTE_CLAIM_STALE_S + 60), ("00003", 0.0)):
        fs.pipe_file(f"{root}/.writers/{name}.claim", json.dumps({"time": time.time() - age}).encode())
        fs.pipe_file(f"{root}/shards/{name}/zarr.json", b"{}")
    assert len(store.index()) == 4
    assert store.clean_uncommitted() == ["00002"]
    assert not fs.exists(f"{root}/shards/00002") and fs.exists(f"{root}/shards/00003")
    assert store.write_shard([make_sample(9, 5)])["name"] == "00004"

    file_url = f"file://{tmp_path}/f"
    new_store(file_url).write_shard(samples[:1])
    assert_same_sample(ShardStore.open(tmp_path / "f").read(ShardStore.open(file_url).index()[0]), samples[0])
