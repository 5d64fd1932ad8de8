"""Zarr v3 shard store of verifier hidden states: the hand-off from extraction to training.

Layout (a public format, read by users' own tools too; documented in the README):

    <store>/zarr.json        root group; attrs `format_version` (int), `target` = {`name_or_path`,
                             `hidden_size`, `num_hidden_layers`, `layer_ids` (ascending, last =
                             `num_hidden_layers`), `dtype`: "bfloat16"}, `tokenizer_sha256`, extra attrs
    <store>/manifest.json    {"format_version", "shards": [{"name", "n_samples", "n_tokens", "checksums"}]}
    <store>/shards/00000/    one group per shard, written by one writer, never modified after commit:
        hidden     [T, L, H] uint16  bf16 bit patterns, layers in `layer_ids` order
        token_ids  [T]       int32
        loss_mask  [T]       uint8
        offsets    [n+1]     int64   sample i owns rows offsets[i]:offsets[i+1]
        sample_ids [n]       int64
        attrs `checksums` = {array name: sha256 hex of its C-order little-endian bytes}
    <store>/.writers/        shard-name claims and the manifest lock (bookkeeping, not data)

A shard exists only once `manifest.json` lists it. A writer writes its whole shard group
first, then adds it to the manifest; a crash or full disk before that leaves an invisible
group that `clean_uncommitted` deletes and a rerun redoes.

Several writers (one per server or node) may share a store. A writer reserves a shard
name by exclusively creating `.writers/<name>.claim` before it creates the group, so
names stay `00000, 00001, ...` without ranges per writer; manifest updates are merged
under a lock. On a local or NFS path the claim and the lock are held with `flock`, which
the kernel releases when the process dies, so `clean_uncommitted` can tell a live
writer's unfinished shard from a dead one's at any time. On object storage (any other
fsspec URL) claims and the lock are exclusive creates (`pipe_file(mode="create")`):
safe only where the backend makes that a conditional write (local, memory, S3 with
If-None-Match, GCS generation preconditions); fsspec's generic fallback checks then
writes, which two writers can race. Liveness there is judged by age
(`store_files.REMOTE_CLAIM_STALE_S`, `REMOTE_LOCK_STALE_S`), so a dead writer's leftover is cleaned
only once it is old; it stays invisible meanwhile.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, BloscShuffle, ZstdCodec

from dspark.store_files import (
    WRITERS,
    LocalClaim,
    LocalFiles,
    RemoteClaim,
    RemoteFiles,
    files_for,
    json_bytes,
)

if TYPE_CHECKING:  # torch is imported on use: readers and `extract.verify` need only numpy + zarr
    import torch

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARDS = "shards"
TARGET_KEYS = ("name_or_path", "hidden_size", "num_hidden_layers", "layer_ids", "dtype")
MANIFEST_ENTRY_TYPES = {"name": str, "n_samples": int, "n_tokens": int, "checksums": dict}
ARRAY_DTYPES = {
    "hidden": np.dtype(np.uint16),
    "token_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.uint8),
    "offsets": np.dtype(np.int64),
    "sample_ids": np.dtype(np.int64),
}
# A sample (hundreds to a few thousand tokens) spans a few hidden chunks; one chunk of
# Qwen3-0.6B's 4 stored layers x 1024 is 2 MiB, big enough for zstd to find structure.
HIDDEN_CHUNK_TOKENS = 256
# Token-wise 1-D arrays are tiny per token: larger chunks keep the shard index short.
TOKEN_CHUNK_TOKENS = 4096
# Byte shuffle puts the bf16 sign/exponent bytes together, which zstd compresses well
# (the mantissa bytes are close to random). On SmolLM2 hidden states (bench/bench_store.py)
# it stores 1.54x fewer bytes than raw bf16, plain zstd 1.43x. 1 MiB blocks instead of
# Blosc's small default compress ~8% better. Blosc is a core zarr v3 codec, so other
# zarr implementations read the store too.
HIDDEN_CODEC = BloscCodec(
    cname="zstd", clevel=3, shuffle=BloscShuffle.shuffle, typesize=2, blocksize=1 << 20
)
SMALL_CODEC = ZstdCodec(level=3)
# Hashing/verifying reads this many rows at a time so memory stays ~ a few chunks.
VERIFY_ROWS = 16 * HIDDEN_CHUNK_TOKENS
MAX_CLAIM_ATTEMPTS = 1000


class StoreMismatchError(ValueError):
    """The store on disk was made for another target, layer ids, tokenizer or data."""


@dataclass
class Sample:
    """One sample: token-aligned arrays with T rows each."""

    sample_id: int
    token_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    hidden: np.ndarray  # uint16 [T, L, H], bf16 bit patterns


@dataclass(frozen=True)
class SampleRef:
    """Where a committed sample lives: rows start:end of shard group `shards/<shard>`."""

    shard: str
    start: int
    end: int
    sample_id: int

    @property
    def n_tokens(self) -> int:
        return self.end - self.start


def bf16_to_bits(t: torch.Tensor) -> np.ndarray:
    """bf16 bit patterns of `t` as uint16, exact for bf16 input.

    Other float dtypes are first rounded to bf16 (torch's round-to-nearest-even).
    """
    import torch

    if not t.is_floating_point():
        raise TypeError(f"bf16_to_bits needs a floating tensor, got {t.dtype}")
    bf16 = t.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
    return bf16.view(torch.int16).numpy().view(np.uint16)


def bits_to_tensor(a: np.ndarray) -> torch.Tensor:
    """bf16 tensor whose bit patterns are the uint16 array `a` (exact inverse of bf16_to_bits)."""
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype != np.uint16:
        raise TypeError(f"bits_to_tensor needs uint16 bf16 bit patterns, got {a.dtype}")
    if not a.flags.writeable:  # torch.from_numpy refuses to share read-only memory silently
        a = a.copy()
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)


def sha256_of(a: np.ndarray) -> str:
    """sha256 hex of an array's C-order little-endian bytes (the checksum format of the store)."""
    h = hashlib.sha256()
    h.update(_le_bytes(a))
    return h.hexdigest()


def _le_bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()


def _normalized(obj: Any) -> Any:
    """What `obj` looks like after a JSON round trip (tuples -> lists), for comparisons."""
    return json.loads(json.dumps(obj))


def _shard_name(index: int) -> str:
    return f"{index:05d}"


def _shard_indices(names: Iterable[str]) -> set[int]:
    return {int(n) for n in names if n.isdigit()}




def validate_target(target: dict) -> dict:
    """Check the store's `target` attrs; returns them JSON-normalized. Errors name the field."""
    missing = [k for k in TARGET_KEYS if k not in target]
    if missing:
        raise ValueError(f"target: missing keys {missing} (needs {list(TARGET_KEYS)})")
    t = _normalized(target)
    for key in ("hidden_size", "num_hidden_layers"):
        if not isinstance(t[key], int) or t[key] <= 0:
            raise ValueError(f"target.{key} must be a positive int, got {t[key]!r}")
    ids = t["layer_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"target.layer_ids must be a non-empty list of ints, got {ids!r}")
    if ids != sorted(set(ids)) or ids[0] < 0:
        raise ValueError(f"target.layer_ids must be unique, ascending and >= 0, got {ids}")
    if ids[-1] != t["num_hidden_layers"]:
        raise ValueError(
            f"target.layer_ids must end with the final layer {t['num_hidden_layers']} "
            f"(= num_hidden_layers), got {ids}"
        )
    if t["dtype"] != "bfloat16":
        raise ValueError(f"target.dtype must be 'bfloat16' (hidden is stored as bf16 bits), got {t['dtype']!r}")
    return t


def _identity_differences(stored: dict, wanted: dict) -> list[str]:
    diffs = []
    for key in sorted(set(stored) | set(wanted)):
        a, b = stored.get(key), wanted.get(key)
        if key == "target" and isinstance(a, dict) and isinstance(b, dict):
            diffs += [
                f"target.{k}: store has {a.get(k)!r}, given {b.get(k)!r}"
                for k in sorted(set(a) | set(b))
                if a.get(k) != b.get(k)
            ]
        elif a != b:
            diffs.append(f"{key}: store has {a!r}, given {b!r}")
    return diffs


class ShardStore:
    """Reader and writer of one shard store (a local path or an fsspec URL).

    Make one with `create_or_open` (writers) or `open` (readers); see the module docstring
    for the format and the multi-writer protocol.
    """

    def __init__(self, url: str, files: LocalFiles | RemoteFiles, *, read_only: bool,
                 storage_options: dict | None):
        self.url = url
        self.read_only = read_only
        self._files = files
        self._storage_options = storage_options
        self._root = zarr.open_group(files.zarr_store(read_only=read_only), mode="r" if read_only else "r+")
        self.attrs: dict = dict(self._root.attrs)
        version = self.attrs.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ValueError(
                f"{url}: store format_version {version!r} is not readable by this version "
                f"(reads format_version <= {FORMAT_VERSION})"
            )
        self.target: dict = self.attrs["target"]
        self.manifest: dict = self._read_manifest()
        self._arrays: dict[str, dict[str, zarr.Array]] = {}
        self._bounds: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    # -- opening ---------------------------------------------------------------------

    @classmethod
    def create_or_open(cls, url: str | Path, target: dict, tokenizer_sha256: str,
                       extra_attrs: dict | None = None, *,
                       storage_options: dict | None = None) -> ShardStore:
        """Open the store at `url` for writing, creating it if absent.

        Refuses (StoreMismatchError naming every differing field) a store whose target,
        layer ids, tokenizer hash or extra attrs differ from the given ones: mixing
        hidden states of two verifiers or datasets in one store would be silent garbage.
        """
        url = str(url)
        reserved = {"format_version", "target", "tokenizer_sha256"} & set(extra_attrs or {})
        if reserved:
            raise ValueError(f"extra_attrs may not set the reserved root attrs {sorted(reserved)}")
        if not isinstance(tokenizer_sha256, str) or not tokenizer_sha256:
            raise ValueError(f"tokenizer_sha256 must be a non-empty string, got {tokenizer_sha256!r}")
        identity = _normalized({
            "format_version": FORMAT_VERSION,
            "target": validate_target(target),
            "tokenizer_sha256": tokenizer_sha256,
            **(extra_attrs or {}),
        })
        files = files_for(url, storage_options)
        files.prepare()
        # Under the manifest lock so that two writers starting together create it once.
        with files.locked():
            if files.read_bytes("zarr.json") is None:
                others = sorted(set(files.names_in("")) - {WRITERS})
                if others:
                    raise FileExistsError(f"{url} is not a shard store (no zarr.json) and not empty: {others[:5]}")
                root = zarr.open_group(files.zarr_store(read_only=False), mode="a", attributes=identity)
                root.create_group(SHARDS)
                files.replace_atomically(MANIFEST, json_bytes({"format_version": FORMAT_VERSION, "shards": []}))
        store = cls(url, files, read_only=False, storage_options=storage_options)
        diffs = _identity_differences(_normalized(store.attrs), identity)
        if diffs:
            raise StoreMismatchError(
                f"shard store {url} was made for something else; use another store path "
                "(or delete this one) for this extraction:\n  " + "\n  ".join(diffs)
            )
        return store

    @classmethod
    def open(cls, url: str | Path, storage_options: dict | None = None) -> ShardStore:
        """Open an existing store read-only."""
        url = str(url)
        files = files_for(url, storage_options)
        if files.read_bytes("zarr.json") is None:
            raise FileNotFoundError(f"no shard store at {url} (no zarr.json)")
        return cls(url, files, read_only=True, storage_options=storage_options)

    def __reduce__(self):
        # DataLoader workers and DDP ranks get a fresh read-only handle, not open files.
        return (ShardStore.open, (self.url, self._storage_options))

    # -- manifest --------------------------------------------------------------------

    def _read_manifest(self) -> dict:
        raw = self._files.read_bytes(MANIFEST)
        if raw is None:
            raise FileNotFoundError(f"{self.url}: {MANIFEST} is missing")
        try:
            manifest = json.loads(raw)
            entries = manifest["shards"]
            for i, entry in enumerate(entries):
                bad = [k for k, kind in MANIFEST_ENTRY_TYPES.items() if not isinstance(entry.get(k), kind)]
                if bad:
                    raise ValueError(f"shards[{i}] has missing or mistyped {bad}")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.url}/{MANIFEST} is malformed: {e}") from e
        names = [entry["name"] for entry in entries]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.url}/{MANIFEST} lists a shard twice")
        return manifest

    def refresh(self) -> dict:
        """Re-read the manifest (to see shards other writers committed since)."""
        self.manifest = self._read_manifest()
        return self.manifest

    def shard_names(self) -> list[str]:
        """Committed shard names, in commit order."""
        return [s["name"] for s in self.manifest["shards"]]

    def committed_sample_ids(self) -> set[int]:
        """Sample ids of every committed shard (fresh from the manifest)."""
        return self._committed_ids(self.refresh())

    def _committed_ids(self, manifest: dict) -> set[int]:
        ids: set[int] = set()
        for s in manifest["shards"]:
            ids.update(self._boundaries(s["name"])[1].tolist())
        return ids

    def next_shard_name(self) -> str:
        """The lowest name above every committed, claimed or leftover shard name."""
        used = _shard_indices(
            [s["name"] for s in self.refresh()["shards"]]
            + self._files.names_in(SHARDS)
            + self._files.claimed_names()
        )
        return _shard_name(max(used) + 1 if used else 0)

    # -- writing ---------------------------------------------------------------------

    def write_shard(self, samples: Sequence[Sample]) -> dict:
        """Write `samples` as a new shard group, then commit it to the manifest.

        Returns the manifest entry. If anything fails before the commit, the group is
        removed (or, if even that fails, left invisible for `clean_uncommitted`); the
        committed shards and the manifest are never touched by a failed write.
        """
        if self.read_only:
            raise PermissionError(f"{self.url} was opened read-only (use ShardStore.create_or_open to write)")
        arrays = self._pack(samples)
        self._check_new_ids(arrays["sample_ids"], self.refresh())
        checksums = {k: sha256_of(v) for k, v in arrays.items()}
        name, claim = self._claim_name()
        try:
            self._write_group(name, arrays, checksums)
            self._files.sync_tree(f"{SHARDS}/{name}")
            return self._commit(name, arrays, checksums)
        except BaseException:
            self._discard_if_uncommitted(name)
            raise
        finally:
            claim.release()

    def _pack(self, samples: Sequence[Sample]) -> dict[str, np.ndarray]:
        """Validate samples and concatenate them into the shard's arrays."""
        if not samples:
            raise ValueError("write_shard: no samples given")
        n_layers, hidden_size = len(self.target["layer_ids"]), self.target["hidden_size"]
        hidden, token_ids, loss_mask = [], [], []
        for s in samples:
            where = f"sample {s.sample_id}"
            h = np.asarray(s.hidden)
            if h.dtype != np.uint16:
                raise TypeError(f"{where}: hidden must be uint16 bf16 bit patterns (see bf16_to_bits), got {h.dtype}")
            if h.ndim != 3 or h.shape[1:] != (n_layers, hidden_size) or h.shape[0] == 0:
                raise ValueError(
                    f"{where}: hidden has shape {list(h.shape)}, expected [T>0, {n_layers}, {hidden_size}] "
                    f"(layer_ids {self.target['layer_ids']}, hidden_size {hidden_size})"
                )
            t = h.shape[0]
            ids = np.asarray(s.token_ids)
            if ids.shape != (t,) or not np.issubdtype(ids.dtype, np.integer):
                raise ValueError(f"{where}: token_ids must be integers of shape [{t}], got {ids.dtype} {list(ids.shape)}")
            if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
                raise ValueError(f"{where}: token_ids outside [0, 2^31): min {ids.min()}, max {ids.max()}")
            mask = np.asarray(s.loss_mask)
            if mask.shape != (t,) or not (mask.dtype == bool or np.issubdtype(mask.dtype, np.integer)):
                raise ValueError(f"{where}: loss_mask must be bool/int of shape [{t}], got {mask.dtype} {list(mask.shape)}")
            if not np.isin(mask, (0, 1)).all():
                raise ValueError(f"{where}: loss_mask must hold only 0/1")
            hidden.append(h)
            token_ids.append(ids.astype(np.int32))
            loss_mask.append(mask.astype(np.uint8))
        sample_ids = np.array([int(s.sample_id) for s in samples], dtype=np.int64)
        if len(np.unique(sample_ids)) != len(sample_ids):
            raise ValueError("write_shard: sample ids repeat within the shard")
        lengths = [len(t) for t in token_ids]
        return {
            "hidden": np.concatenate(hidden),
            "token_ids": np.concatenate(token_ids),
            "loss_mask": np.concatenate(loss_mask),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "sample_ids": sample_ids,
        }

    def _check_new_ids(self, sample_ids: np.ndarray, manifest: dict) -> None:
        dup = sorted(set(sample_ids.tolist()) & self._committed_ids(manifest))
        if dup:
            raise ValueError(f"write_shard: sample ids already committed in {self.url}: {dup[:10]}"
                             + (f" (+{len(dup) - 10} more)" if len(dup) > 10 else ""))

    def _claim_name(self) -> tuple[str, LocalClaim | RemoteClaim]:
        for _ in range(MAX_CLAIM_ATTEMPTS):
            name = self.next_shard_name()
            claim = self._files.try_claim(name)
            if claim is not None:
                return name, claim
        raise RuntimeError(f"{self.url}: could not claim a shard name in {MAX_CLAIM_ATTEMPTS} attempts")

    def _write_group(self, name: str, arrays: dict[str, np.ndarray], checksums: dict[str, str]) -> None:
        # overwrite: a dead writer may have left a group under a name we now hold.
        group = self._root.require_group(SHARDS).create_group(
            name, overwrite=True, attributes={"checksums": checksums})
        for key, data in arrays.items():
            if key == "hidden":
                chunk, codec, dims = HIDDEN_CHUNK_TOKENS, HIDDEN_CODEC, ("token", "layer", "hidden")
            elif key in ("token_ids", "loss_mask"):
                chunk, codec, dims = TOKEN_CHUNK_TOKENS, SMALL_CODEC, ("token",)
            else:
                chunk, codec, dims = len(data), SMALL_CODEC, ("sample_boundary" if key == "offsets" else "sample",)
            # One zarr shard (file) per array: the group stays a handful of files.
            rows = -(-len(data) // chunk) * chunk
            arr = group.create_array(
                key, shape=data.shape, dtype=data.dtype, chunks=(chunk, *data.shape[1:]),
                shards=(rows, *data.shape[1:]), compressors=[codec], dimension_names=dims,
            )
            arr[...] = data

    def _commit(self, name: str, arrays: dict[str, np.ndarray], checksums: dict[str, str]) -> dict:
        entry = {
            "name": name,
            "n_samples": int(len(arrays["sample_ids"])),
            "n_tokens": int(len(arrays["token_ids"])),
            "checksums": checksums,
        }
        with self._files.locked():
            manifest = self._read_manifest()
            self._check_new_ids(arrays["sample_ids"], manifest)  # another writer may have committed them meanwhile
            manifest["shards"].append(entry)
            self._files.replace_atomically(MANIFEST, json_bytes(manifest))
        self.manifest = manifest
        return entry

    def _discard_if_uncommitted(self, name: str) -> None:
        with suppress(Exception):  # best effort: a leftover group is invisible anyway
            if name not in {s["name"] for s in self._read_manifest()["shards"]}:
                self._files.remove_tree(f"{SHARDS}/{name}")

    def clean_uncommitted(self) -> list[str]:
        """Delete shard groups (and claims) not in the manifest whose writer is gone.

        Safe while other writers run: their unfinished shards are still claimed and are
        kept. Returns the names removed.
        """
        if self.read_only:
            raise PermissionError(f"{self.url} was opened read-only")
        removed = []
        # Hold the manifest lock so no shard gets committed (and its claim released)
        # between reading the manifest and judging the claims.
        with self._files.locked():
            self.refresh()
            committed = set(self.shard_names())
            leftovers = {n for n in self._files.names_in(SHARDS) if n.isdigit()} | set(self._files.claimed_names())
            for name in sorted(leftovers - committed):
                claim = self._files.take_over(name)
                if claim is None:
                    continue  # a live writer is still on it
                try:
                    self._files.remove_tree(f"{SHARDS}/{name}")
                    removed.append(name)
                finally:
                    claim.release()
        return removed

    # -- reading ---------------------------------------------------------------------

    def _shard_arrays(self, name: str) -> dict[str, zarr.Array]:
        if name not in self._arrays:
            group = self._root[f"{SHARDS}/{name}"]
            self._arrays[name] = {k: group[k] for k in ARRAY_DTYPES}
        return self._arrays[name]

    def _boundaries(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, sample_ids) of a committed shard; cached, shards never change."""
        if name not in self._bounds:
            arrays = self._shard_arrays(name)
            self._bounds[name] = (arrays["offsets"][...], arrays["sample_ids"][...])
        return self._bounds[name]

    def index(self) -> list[SampleRef]:
        """Every committed sample (fresh from the manifest), in commit order."""
        refs = []
        self.refresh()
        for name in self.shard_names():
            offsets, ids = self._boundaries(name)
            refs += [SampleRef(name, int(offsets[i]), int(offsets[i + 1]), int(ids[i])) for i in range(len(ids))]
        return refs

    def read(self, ref: SampleRef) -> Sample:
        """The sample at `ref`: one contiguous slice of each token-wise array."""
        arrays = self._shard_arrays(ref.shard)
        rows = slice(ref.start, ref.end)
        return Sample(
            sample_id=ref.sample_id,
            token_ids=arrays["token_ids"][rows],
            loss_mask=arrays["loss_mask"][rows],
            hidden=arrays["hidden"][rows],
        )

    # -- verification ----------------------------------------------------------------

    def verify(self, on_shard: Callable[[str, list[str]], None] | None = None) -> list[str]:
        """Check every committed shard against the manifest; returns the problems (empty = OK).

        Reads all data: array presence, dtypes, shapes, offsets, manifest/attr checksums
        against the sha256 of the bytes actually read, and sample ids unique store-wide.
        `on_shard(name, problems)` is called after each shard (for progress output).
        """
        problems = []
        try:
            validate_target(self.target)
        except ValueError as e:
            problems.append(f"root attrs: {e}")
        try:
            manifest = self.refresh()
        except (ValueError, FileNotFoundError) as e:
            return problems + [str(e)]
        if manifest.get("format_version") != self.attrs["format_version"]:
            problems.append(f"{MANIFEST}: format_version {manifest.get('format_version')!r} "
                            f"!= root format_version {self.attrs['format_version']!r}")
        owner: dict[int, str] = {}
        for entry in manifest["shards"]:
            shard_problems, sample_ids = self._verify_shard(entry)
            for sid in sample_ids:
                if sid in owner:
                    shard_problems.append(f"{SHARDS}/{entry['name']}: sample id {sid} also in {SHARDS}/{owner[sid]}")
                owner.setdefault(sid, entry["name"])
            if on_shard is not None:
                on_shard(entry["name"], shard_problems)
            problems += shard_problems
        return problems

    def _verify_shard(self, entry: dict) -> tuple[list[str], list[int]]:
        name = entry["name"]
        where = f"{SHARDS}/{name}"
        try:
            group = self._root[f"{SHARDS}/{name}"]
            arrays = {k: group[k] for k in ARRAY_DTYPES}
            attr_sums = dict(group.attrs).get("checksums")
        except Exception as e:  # noqa: BLE001 - any failure to open is a finding, not a crash
            return [f"{where}: cannot open group/arrays: {type(e).__name__}: {e}"], []
        problems = []
        if attr_sums != entry["checksums"]:
            problems.append(f"{where}: checksums in the shard attrs differ from {MANIFEST}")
        t, n = entry["n_tokens"], entry["n_samples"]
        expected_shapes = {
            "hidden": (t, len(self.target["layer_ids"]), self.target["hidden_size"]),
            "token_ids": (t,), "loss_mask": (t,), "offsets": (n + 1,), "sample_ids": (n,),
        }
        readable = {}
        for key, arr in arrays.items():
            if arr.dtype != ARRAY_DTYPES[key]:
                problems.append(f"{where}/{key}: dtype {arr.dtype}, expected {ARRAY_DTYPES[key]}")
            if tuple(arr.shape) != expected_shapes[key]:
                problems.append(f"{where}/{key}: shape {list(arr.shape)}, expected {list(expected_shapes[key])}")
            try:
                digest = self._streamed_sha256(arr)
            except Exception as e:  # noqa: BLE001 - corrupt/truncated files raise all sorts
                problems.append(f"{where}/{key}: unreadable (corrupt or truncated file): {type(e).__name__}: {e}")
                continue
            if digest != entry["checksums"].get(key):
                problems.append(f"{where}/{key}: sha256 of the stored data does not match {MANIFEST}")
            else:
                readable[key] = arr
        sample_ids: list[int] = []
        if "offsets" in readable and "sample_ids" in readable:
            offsets, ids = readable["offsets"][...], readable["sample_ids"][...]
            if len(offsets) != len(ids) + 1 or offsets[0] != 0 or offsets[-1] != t or (np.diff(offsets) <= 0).any():
                problems.append(f"{where}: offsets must rise strictly from 0 to n_tokens={t} with one more "
                                f"entry than sample_ids")
            if len(np.unique(ids)) != len(ids):
                problems.append(f"{where}: sample ids repeat within the shard")
            sample_ids = ids.tolist()
        if "loss_mask" in readable and not np.isin(readable["loss_mask"][...], (0, 1)).all():
            problems.append(f"{where}/loss_mask: values other than 0/1")
        return problems, sample_ids

    @staticmethod
    def _streamed_sha256(arr: zarr.Array) -> str:
        h = hashlib.sha256()
        for start in range(0, max(arr.shape[0], 1), VERIFY_ROWS):
            h.update(_le_bytes(arr[start:start + VERIFY_ROWS]))
        return h.hexdigest()


__all__ = [
    "FORMAT_VERSION",
    "Sample",
    "SampleRef",
    "ShardStore",
    "StoreMismatchError",
    "bf16_to_bits",
    "bits_to_tensor",
    "sha256_of",
    "validate_target",
]
