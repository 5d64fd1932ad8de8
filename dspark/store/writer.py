"""Writing a shard store: create/open with an identity check, shard-name claims, atomic commit, cleanup."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

import numpy as np
import zarr

from dspark.store.files import WRITERS, LocalClaim, RemoteClaim, files_for, json_bytes
from dspark.store.format import (
    FORMAT_VERSIONS,
    FP8_HIDDEN_CODEC,
    HIDDEN_CHUNK_TOKENS,
    HIDDEN_CODEC,
    MANIFEST,
    SHARDS,
    SMALL_CODEC,
    TOKEN_CHUNK_TOKENS,
    Sample,
    StoreMismatchError,
    identity_differences,
    normalized,
    sha256_of,
    shard_indices,
    shard_name,
    validate_target,
)
from dspark.store.fp8 import quantize
from dspark.store.reader import ShardStore

MAX_CLAIM_ATTEMPTS = 1000


class StoreWriter(ShardStore):
    """A shard store opened for writing (and reading); made by `create_or_open`."""

    _zarr_mode = "r+"

    @classmethod
    def create_or_open(
        cls,
        url: str | Path,
        target: dict,
        tokenizer_sha256: str,
        extra_attrs: dict | None = None,
        *,
        storage_options: dict | None = None,
    ) -> StoreWriter:
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
        target = validate_target(target)
        version = FORMAT_VERSIONS[target["dtype"]]
        identity = normalized(
            {
                "format_version": version,
                "target": target,
                "tokenizer_sha256": tokenizer_sha256,
                **(extra_attrs or {}),
            }
        )
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
                files.replace_atomically(MANIFEST, json_bytes({"format_version": version, "shards": []}))
        store = cls(url, files, storage_options)
        diffs = identity_differences(normalized(store.attrs), identity)
        if diffs:
            raise StoreMismatchError(
                f"shard store {url} was made for something else; use another store path "
                "(or delete this one) for this extraction:\n  " + "\n  ".join(diffs)
            )
        return store

    def next_shard_name(self) -> str:
        """The lowest name above every committed, claimed or leftover shard name."""
        used = shard_indices(
            [s["name"] for s in self.refresh()["shards"]] + self._files.names_in(SHARDS) + self._files.claimed_names()
        )
        return shard_name(max(used) + 1 if used else 0)

    def write_shard(self, samples: Sequence[Sample]) -> dict:
        """Write `samples` as a new shard group, then commit it to the manifest.

        Returns the manifest entry. If anything fails before the commit, the group is
        removed (or, if even that fails, left invisible for `clean_uncommitted`); the
        committed shards and the manifest are never touched by a failed write.
        """
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
        """Validate samples and concatenate them into the shard's arrays (FP8: quantized per sample)."""
        if not samples:
            raise ValueError("write_shard: no samples given")
        n_layers, hidden_size = len(self.target["layer_ids"]), self.target["hidden_size"]
        hidden, scales, token_ids, loss_mask = [], [], [], []
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
                raise ValueError(
                    f"{where}: token_ids must be integers of shape [{t}], got {ids.dtype} {list(ids.shape)}"
                )
            if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
                raise ValueError(f"{where}: token_ids outside [0, 2^31): min {ids.min()}, max {ids.max()}")
            mask = np.asarray(s.loss_mask)
            if mask.shape != (t,) or not (mask.dtype == bool or np.issubdtype(mask.dtype, np.integer)):
                raise ValueError(
                    f"{where}: loss_mask must be bool/int of shape [{t}], got {mask.dtype} {list(mask.shape)}"
                )
            if not np.isin(mask, (0, 1)).all():
                raise ValueError(f"{where}: loss_mask must hold only 0/1")
            if self.fp8:
                try:
                    h, scale = quantize(h)
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from e
                scales.append(scale)
            hidden.append(h)
            token_ids.append(ids.astype(np.int32))
            loss_mask.append(mask.astype(np.uint8))
        sample_ids = np.array([int(s.sample_id) for s in samples], dtype=np.int64)
        if len(np.unique(sample_ids)) != len(sample_ids):
            raise ValueError("write_shard: sample ids repeat within the shard")
        lengths = [len(t) for t in token_ids]
        return {
            "hidden": np.concatenate(hidden),
            **({"hidden_scale": np.concatenate(scales)} if self.fp8 else {}),
            "token_ids": np.concatenate(token_ids),
            "loss_mask": np.concatenate(loss_mask),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "sample_ids": sample_ids,
        }

    def _check_new_ids(self, sample_ids: np.ndarray, manifest: dict) -> None:
        dup = sorted(set(sample_ids.tolist()) & self._committed_ids(manifest))
        if dup:
            raise ValueError(
                f"write_shard: sample ids already committed in {self.url}: {dup[:10]}"
                + (f" (+{len(dup) - 10} more)" if len(dup) > 10 else "")
            )

    def _claim_name(self) -> tuple[str, LocalClaim | RemoteClaim]:
        for _ in range(MAX_CLAIM_ATTEMPTS):
            name = self.next_shard_name()
            claim = self._files.try_claim(name)
            if claim is not None:
                return name, claim
        raise RuntimeError(f"{self.url}: could not claim a shard name in {MAX_CLAIM_ATTEMPTS} attempts")

    def _write_group(self, name: str, arrays: dict[str, np.ndarray], checksums: dict[str, str]) -> None:
        # overwrite: a dead writer may have left a group under a name we now hold.
        group = self._root.require_group(SHARDS).create_group(name, overwrite=True, attributes={"checksums": checksums})
        for key, data in arrays.items():
            if key == "hidden":
                codec = FP8_HIDDEN_CODEC if self.fp8 else HIDDEN_CODEC
                chunk, dims = HIDDEN_CHUNK_TOKENS, ("token", "layer", "hidden")
            elif key == "hidden_scale":  # chunked like hidden: a sample's read decodes only its own rows
                chunk, codec, dims = HIDDEN_CHUNK_TOKENS, SMALL_CODEC, ("token", "layer")
            elif key in ("token_ids", "loss_mask"):
                chunk, codec, dims = TOKEN_CHUNK_TOKENS, SMALL_CODEC, ("token",)
            else:
                chunk, codec, dims = len(data), SMALL_CODEC, ("sample_boundary" if key == "offsets" else "sample",)
            # One zarr shard (file) per array: the group stays a handful of files.
            rows = -(-len(data) // chunk) * chunk
            arr = group.create_array(
                key,
                shape=data.shape,
                dtype=data.dtype,
                chunks=(chunk, *data.shape[1:]),
                shards=(rows, *data.shape[1:]),
                compressors=[codec],
                dimension_names=dims,
            )
            arr[...] = data

    def _commit(self, name: str, arrays: dict[str, np.ndarray], checksums: dict[str, str]) -> dict:
        entry = {
            "name": name,
            "n_samples": len(arrays["sample_ids"]),
            "n_tokens": len(arrays["token_ids"]),
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
