"""End-to-end check of a store: every committed shard against the manifest (`python -m extract.verify`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import zarr

from dspark.store.format import (
    MANIFEST,
    SHARDS,
    VERIFY_ROWS,
    le_bytes,
    validate_target,
)

if TYPE_CHECKING:
    from dspark.store.reader import ShardStore


def verify_store(store: ShardStore, on_shard: Callable[[str, list[str]], None] | None = None) -> list[str]:
    """Check every committed shard of `store`; returns the problems (empty = OK).

    Reads all data: array presence, dtypes, shapes, offsets, manifest/attr checksums
    against the sha256 of the bytes actually read, and sample ids unique store-wide.
    `on_shard(name, problems)` is called after each shard (for progress output).
    """
    problems = []
    try:
        validate_target(store.target)
    except ValueError as e:
        problems.append(f"root attrs: {e}")
    try:
        manifest = store.refresh()
    except (ValueError, FileNotFoundError) as e:
        return problems + [str(e)]
    if manifest.get("format_version") != store.attrs["format_version"]:
        problems.append(
            f"{MANIFEST}: format_version {manifest.get('format_version')!r} "
            f"!= root format_version {store.attrs['format_version']!r}"
        )
    owner: dict[int, str] = {}
    for entry in manifest["shards"]:
        shard_problems, sample_ids = _verify_shard(store, entry)
        for sid in sample_ids:
            if sid in owner:
                shard_problems.append(f"{SHARDS}/{entry['name']}: sample id {sid} also in {SHARDS}/{owner[sid]}")
            owner.setdefault(sid, entry["name"])
        if on_shard is not None:
            on_shard(entry["name"], shard_problems)
        problems += shard_problems
    return problems


def _verify_shard(store: ShardStore, entry: dict) -> tuple[list[str], list[int]]:
    name, target = entry["name"], store.target
    where = f"{SHARDS}/{name}"
    try:
        group = store.shard_group(name)
        arrays = {k: group[k] for k in store.array_dtypes}
        attr_sums = dict(group.attrs).get("checksums")
    except Exception as e:  # noqa: BLE001 - any failure to open is a finding, not a crash
        return [f"{where}: cannot open group/arrays: {type(e).__name__}: {e}"], []
    problems = []
    if attr_sums != entry["checksums"]:
        problems.append(f"{where}: checksums in the shard attrs differ from {MANIFEST}")
    t, n = entry["n_tokens"], entry["n_samples"]
    n_layers = len(target["layer_ids"])
    expected_shapes = {
        "hidden": (t, n_layers, target["hidden_size"]),
        "hidden_scale": (t, n_layers),
        "token_ids": (t,),
        "loss_mask": (t,),
        "offsets": (n + 1,),
        "sample_ids": (n,),
    }
    readable = {}
    for key, arr in arrays.items():
        if arr.dtype != store.array_dtypes[key]:
            problems.append(f"{where}/{key}: dtype {arr.dtype}, expected {store.array_dtypes[key]}")
        if tuple(arr.shape) != expected_shapes[key]:
            problems.append(f"{where}/{key}: shape {list(arr.shape)}, expected {list(expected_shapes[key])}")
        try:
            digest = _streamed_sha256(arr)
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
            problems.append(
                f"{where}: offsets must rise strictly from 0 to n_tokens={t} with one more entry than sample_ids"
            )
        if len(np.unique(ids)) != len(ids):
            problems.append(f"{where}: sample ids repeat within the shard")
        sample_ids = ids.tolist()
    if "loss_mask" in readable and not np.isin(readable["loss_mask"][...], (0, 1)).all():
        problems.append(f"{where}/loss_mask: values other than 0/1")
    if "hidden_scale" in readable:
        scale = readable["hidden_scale"][...]
        if not (np.isfinite(scale) & (scale > 0)).all():
            problems.append(f"{where}/hidden_scale: values that are not finite and positive")
    return problems, sample_ids


def _streamed_sha256(arr: zarr.Array) -> str:
    h = hashlib.sha256()
    for start in range(0, max(arr.shape[0], 1), VERIFY_ROWS):
        h.update(le_bytes(arr[start : start + VERIFY_ROWS]))
    return h.hexdigest()
