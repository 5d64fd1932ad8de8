"""The store's format: version, names, array dtypes and codecs, `Sample`, bf16 bits, attr checks.

See `dspark.store` for the layout; readers and writers both build on these definitions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from zarr.codecs import BloscCodec, BloscShuffle, ZstdCodec

from dspark.errors import UserError

if TYPE_CHECKING:  # torch is imported on use: readers and `extract.verify` need only numpy + zarr
    import torch

BF16 = "bfloat16"
FP8 = "float8_e4m3fn"
# A store's `target.dtype` fixes its format_version: bf16 stores stay version 1 (readable by
# every release), FP8 stores (hidden as e4m3 bits + a scale per token and layer) are version 2.
FORMAT_VERSIONS = {BF16: 1, FP8: 2}
FORMAT_VERSION = FORMAT_VERSIONS[BF16]
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
FP8_ARRAY_DTYPES = {**ARRAY_DTYPES, "hidden": np.dtype(np.uint8), "hidden_scale": np.dtype(np.float32)}
# A sample (hundreds to a few thousand tokens) spans a few hidden chunks; one chunk of
# Qwen3-0.6B's 4 stored layers x 1024 is 2 MiB, big enough for zstd to find structure.
HIDDEN_CHUNK_TOKENS = 256
# Token-wise 1-D arrays are tiny per token: larger chunks keep the shard index short.
TOKEN_CHUNK_TOKENS = 4096
# Byte shuffle puts the bf16 sign/exponent bytes together, which zstd compresses well
# (the mantissa bytes are close to random). On SmolLM2 hidden states (bench/bench_store.py)
# it stores 1.54x fewer bytes than raw bf16, plain zstd 1.43x. 1 MiB blocks instead of
# Blosc's small default compress ~8% better. zstd level 1 stores the same bytes as level 3
# (0.648 against 0.650 of raw) at about half the CPU time (bench/bench_store.py), which
# matters where compression shares the cores with the verifier (extraction on CPU). Blosc
# is a core zarr v3 codec, so other zarr implementations read the store too; each array
# records its codec, so stores written at another level read the same.
HIDDEN_CODEC = BloscCodec(cname="zstd", clevel=1, shuffle=BloscShuffle.shuffle, typesize=2, blocksize=1 << 20)
# e4m3 bytes: zstd's entropy coder squeezes the skewed exponent bits (bench/bench_fp8.py
# compares levels and filters: level 1 stores what level 3 does); byte shuffle is a no-op at typesize 1.
FP8_HIDDEN_CODEC = BloscCodec(cname="zstd", clevel=1, shuffle=BloscShuffle.noshuffle, typesize=1, blocksize=1 << 20)
SMALL_CODEC = ZstdCodec(level=3)
# Hashing/verifying reads this many rows at a time so memory stays ~ a few chunks.
VERIFY_ROWS = 16 * HIDDEN_CHUNK_TOKENS


class StoreMismatchError(UserError):
    """The store on disk was made for another target, layer ids, tokenizer or data."""


@dataclass
class Sample:
    """One sample: token-aligned arrays with T rows each."""

    sample_id: int
    token_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    hidden: np.ndarray  # uint16 [T, L, H], bf16 bit patterns (what an FP8 store's reader dequantizes to)


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
    h.update(le_bytes(a))
    return h.hexdigest()


def le_bytes(a: np.ndarray) -> memoryview:
    """The array's C-order little-endian bytes, without a copy where it already is one."""
    return memoryview(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).reshape(-1).view(np.uint8))


def normalized(obj: Any) -> Any:
    """What `obj` looks like after a JSON round trip (tuples -> lists), for comparisons."""
    return json.loads(json.dumps(obj))


def shard_name(index: int) -> str:
    return f"{index:05d}"


def shard_indices(names: Iterable[str]) -> set[int]:
    return {int(n) for n in names if n.isdigit()}


def array_dtypes(target: dict) -> dict[str, np.dtype]:
    """The arrays of every shard group of a store with this `target`, and their dtypes."""
    return FP8_ARRAY_DTYPES if target.get("dtype") == FP8 else ARRAY_DTYPES


def validate_target(target: dict) -> dict:
    """Check the store's `target` attrs; returns them JSON-normalized. Errors name the field."""
    missing = [k for k in TARGET_KEYS if k not in target]
    if missing:
        raise ValueError(f"target: missing keys {missing} (needs {list(TARGET_KEYS)})")
    t = normalized(target)
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
            f"target.layer_ids must end with the final layer {t['num_hidden_layers']} (= num_hidden_layers), got {ids}"
        )
    if t["dtype"] not in FORMAT_VERSIONS:
        raise ValueError(
            f"target.dtype must be one of {list(FORMAT_VERSIONS)} (how hidden is stored), got {t['dtype']!r}"
        )
    return t


def identity_differences(stored: dict, wanted: dict) -> list[str]:
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
