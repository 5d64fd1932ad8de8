"""Read-only handle of a shard store: root attrs, manifest, sample index, reads, verification."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import zarr

from dspark.errors import UserError
from dspark.store.files import LocalFiles, RemoteFiles, files_for
from dspark.store.format import (
    FORMAT_VERSIONS,
    FP8,
    MANIFEST,
    MANIFEST_ENTRY_TYPES,
    SHARDS,
    Sample,
    SampleRef,
    array_dtypes,
)
from dspark.store.fp8 import dequantize
from dspark.store.verify import verify_store

if TYPE_CHECKING:
    pass


class ShardStore:
    """A shard store (a local path or an fsspec URL), opened for reading.

    `ShardStore.open` gives a reader; `StoreWriter.create_or_open` gives a writer,
    which reads too. See `dspark.store` for the format and the multi-writer protocol.
    """

    def __init__(self, url: str, files: LocalFiles | RemoteFiles, storage_options: dict | None):
        self.url = url
        self._files = files
        self._storage_options = storage_options
        # A reader's zarr store is read-only; `StoreWriter` opens it writable (mode "r+").
        self._root = zarr.open_group(files.zarr_store(read_only=self._zarr_mode == "r"), mode=self._zarr_mode)
        self.attrs: dict = dict(self._root.attrs)
        self.target: dict = self.attrs["target"]
        version, dtype = self.attrs.get("format_version"), self.target.get("dtype")
        if version != FORMAT_VERSIONS.get(dtype):
            known = ", ".join(f"{v} = {d}" for d, v in FORMAT_VERSIONS.items())
            raise ValueError(
                f"{url}: store format_version {version!r} is not readable as target.dtype {dtype!r} "
                f"by this version (reads format_version {known} states)"
            )
        self.fp8 = dtype == FP8
        self.array_dtypes = array_dtypes(self.target)
        self.manifest: dict = self._read_manifest()
        self._arrays: dict[str, dict[str, zarr.Array]] = {}
        self._bounds: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    _zarr_mode = "r"

    @classmethod
    def open(cls, url: str | Path, storage_options: dict | None = None) -> ShardStore:
        """Open an existing store read-only."""
        url = str(url)
        files = files_for(url, storage_options)
        if files.read_bytes("zarr.json") is None:
            raise FileNotFoundError(f"no shard store at {url} (no zarr.json)")
        return ShardStore(url, files, storage_options)

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
            raise UserError(f"{self.url}/{MANIFEST} is malformed: {e}") from e
        names = [entry["name"] for entry in entries]
        if len(set(names)) != len(names):
            raise UserError(f"{self.url}/{MANIFEST} lists a shard twice")
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

    # -- reading ---------------------------------------------------------------------

    def shard_group(self, name: str) -> zarr.Group:
        """The zarr group of shard `name` (committed or not: check the manifest first)."""
        return self._root[f"{SHARDS}/{name}"]

    def _shard_arrays(self, name: str) -> dict[str, zarr.Array]:
        if name not in self._arrays:
            group = self.shard_group(name)
            self._arrays[name] = {k: group[k] for k in self.array_dtypes}
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

    def by_sample_id(self, max_samples: int | None = None) -> list[SampleRef]:
        """Every committed sample, lowest sample id first (the first `max_samples` of them; None: all), so
        reruns, other drafters and smaller training sets see the same ones."""
        return sorted(self.index(), key=lambda r: r.sample_id)[:max_samples]

    def read(self, ref: SampleRef) -> Sample:
        """The sample at `ref`: one contiguous slice of each token-wise array.

        `hidden` is bf16 bit patterns in every store: an FP8 store's are dequantized here.
        """
        arrays = self._shard_arrays(ref.shard)
        rows = slice(ref.start, ref.end)
        hidden = arrays["hidden"][rows]
        return Sample(
            sample_id=ref.sample_id,
            token_ids=arrays["token_ids"][rows],
            loss_mask=arrays["loss_mask"][rows],
            hidden=dequantize(hidden, arrays["hidden_scale"][rows]) if self.fp8 else hidden,
        )

    def read_loss_mask(self, ref: SampleRef) -> np.ndarray:
        """Only the loss mask `[T]` of the sample at `ref` (no hidden states read)."""
        return self._shard_arrays(ref.shard)["loss_mask"][ref.start : ref.end]

    def verify(self, on_shard: Callable[[str, list[str]], None] | None = None) -> list[str]:
        """Check every committed shard against the manifest; returns the problems (empty = OK).

        See `dspark.store.verify.verify_store`.
        """
        return verify_store(self, on_shard)
