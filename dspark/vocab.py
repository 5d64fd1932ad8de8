"""Reduced draft vocabulary: the most frequent trained tokens, and its on-disk mapping.

Draft id i stands for verifier id `i + d2t[i]` (d2t holds int64 offsets, the layout
speculators and vLLM read); `t2d[v]` tells whether verifier id v has a draft id. Draft ids
are the `draft_vocab_size` ids of the highest counts (ties → smaller id), sorted ascending, so
the mapping is a deterministic function of the counts: the loss-masked training tokens' counts,
or the verifier's expected counts over them (`dspark.train.vocab_counts`).

A mapping file is one safetensors file (`d2t`, `t2d`, plus JSON metadata), written next to
the tokenized data it was counted from. A training continuation must reuse the same
mapping: `check_same_mapping` refuses any other.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

MAPPING_FORMAT = "dspark-vocab-mapping"
MAPPING_FORMAT_VERSION = 1


def count_tokens(token_ids: Iterable, loss_masks: Iterable, vocab_size: int) -> np.ndarray:
    """Frequency of every verifier id over loss-masked tokens: int64 `[vocab_size]`.

    `token_ids` and `loss_masks` yield one sequence per sample (lists or arrays), in step.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    pending: list[np.ndarray] = []  # bincount per ~1M tokens, not per sample (each call is O(V))
    pending_tokens = 0
    masks = iter(loss_masks)
    for index, ids in enumerate(token_ids):
        mask = next(masks, None)
        if mask is None:
            raise ValueError(f"loss_masks has fewer samples than token_ids (none for sample {index})")
        ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask).astype(bool)
        if ids.shape != mask.shape or ids.ndim != 1:
            raise ValueError(
                f"sample {index}: token_ids shape {ids.shape} and loss_mask shape {mask.shape} "
                "must be the same 1-D length"
            )
        trained = ids[mask]
        bad = trained[(trained < 0) | (trained >= vocab_size)]
        if bad.size:
            raise ValueError(f"sample {index}: token id {int(bad[0])} outside the vocabulary [0, {vocab_size})")
        pending.append(trained)
        pending_tokens += trained.size
        if pending_tokens >= 1 << 20:
            counts += np.bincount(np.concatenate(pending), minlength=vocab_size)
            pending, pending_tokens = [], 0
    if next(masks, None) is not None:
        raise ValueError("loss_masks has more samples than token_ids")
    if pending:
        counts += np.bincount(np.concatenate(pending), minlength=vocab_size)
    return counts


def build_mapping(counts: np.ndarray | Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """`(d2t int64 [Vd], t2d bool [V])` from token counts `[V]` (integer counts or expected counts): the
    top-Vd ids, ties → smaller id."""
    counts = np.asarray(counts)
    if not np.issubdtype(counts.dtype, np.number) or not np.isfinite(counts).all():
        raise ValueError("counts must be finite numbers")
    counts = counts.astype(np.float64)  # signed and exact for any count under 2**53: -counts cannot wrap
    if counts.ndim != 1:
        raise ValueError(f"counts must be 1-D [vocab_size], got shape {counts.shape}")
    vocab_size = counts.shape[0]
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(
            f"draft_vocab_size must be in [1, {vocab_size}] (the verifier vocabulary), got {draft_vocab_size}"
        )
    # A stable sort of −count keeps equal counts in ascending id order: ties → smaller id.
    selected = np.sort(np.argsort(-counts, kind="stable")[:draft_vocab_size])
    d2t = torch.from_numpy(selected - np.arange(draft_vocab_size, dtype=np.int64))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.from_numpy(selected)] = True
    return d2t, t2d


def validate_mapping(
    d2t: Tensor,
    t2d: Tensor,
    *,
    target_vocab_size: int | None = None,
    draft_vocab_size: int | None = None,
    source: str = "vocab mapping",
) -> None:
    """Raise a ValueError naming the field when the mapping is malformed or the wrong size."""
    if d2t.dim() != 1 or d2t.dtype != torch.int64:
        raise ValueError(f"{source}: d2t must be 1-D int64, got {d2t.dtype} of shape {list(d2t.shape)}")
    if t2d.dim() != 1 or t2d.dtype != torch.bool:
        raise ValueError(f"{source}: t2d must be 1-D bool, got {t2d.dtype} of shape {list(t2d.shape)}")
    if draft_vocab_size is not None and d2t.shape[0] != draft_vocab_size:
        raise ValueError(f"{source}: d2t has {d2t.shape[0]} entries but draft_vocab_size is {draft_vocab_size}")
    if target_vocab_size is not None and t2d.shape[0] != target_vocab_size:
        raise ValueError(
            f"{source}: t2d has {t2d.shape[0]} entries but the verifier vocabulary has {target_vocab_size}"
        )
    d2t, t2d = d2t.cpu(), t2d.cpu()
    ids = torch.arange(d2t.shape[0]) + d2t
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t2d.shape[0]):
        raise ValueError(f"{source}: d2t maps to target ids outside [0, {t2d.shape[0]}) (the size of t2d)")
    if not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{source}: d2t target ids must be strictly ascending")
    if int(t2d.sum()) != d2t.shape[0] or not bool(t2d[ids].all()):
        raise ValueError(f"{source}: t2d marks {int(t2d.sum())} ids, not exactly the {d2t.shape[0]} ids of d2t")


MAPPING_NAME = "vocab_map_{}.safetensors"
"""A mapping file's name, by its draft vocabulary size."""
MAPPING_GLOB = MAPPING_NAME.format("*")
"""The names `mapping_path` gives, of any size."""


def mapping_path(data_dir: str | Path, draft_vocab_size: int) -> Path:
    """Where the mapping of a given size lives, next to the tokenized data it was counted from."""
    return Path(data_dir) / MAPPING_NAME.format(draft_vocab_size)


def save_mapping(path: str | Path, d2t: Tensor, t2d: Tensor, meta: dict[str, Any] | None = None) -> Path:
    """Write the mapping atomically (temp file, then rename); `meta` must be JSON-serializable."""
    validate_mapping(d2t, t2d)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    header = {
        "format": MAPPING_FORMAT,
        "format_version": str(MAPPING_FORMAT_VERSION),
        "meta": json.dumps(meta or {}, sort_keys=True),
    }
    save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(tmp), metadata=header)
    os.replace(tmp, path)
    return path


def load_mapping(
    path: str | Path,
    *,
    target_vocab_size: int | None = None,
    draft_vocab_size: int | None = None,
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """Read `(d2t, t2d, meta)`, checked (and against the expected sizes when given)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"vocab mapping {path} does not exist")
    with safe_open(str(path), framework="pt") as f:
        header = f.metadata() or {}
        if header.get("format") != MAPPING_FORMAT:
            raise ValueError(f"{path}: not a vocab mapping (metadata format={header.get('format')!r})")
        missing = [name for name in ("d2t", "t2d") if name not in f.keys()]
        if missing:
            raise ValueError(f"{path}: missing tensor(s) {missing}")
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    validate_mapping(d2t, t2d, target_vocab_size=target_vocab_size, draft_vocab_size=draft_vocab_size, source=str(path))
    return d2t, t2d, json.loads(header.get("meta", "{}"))


def check_same_mapping(
    a: Sequence[Tensor], b: Sequence[Tensor], names: tuple[str, str] = ("expected", "found")
) -> None:
    """Raise a ValueError describing the first difference between two `(d2t, t2d, ...)` mappings."""
    (d2t_a, t2d_a), (d2t_b, t2d_b) = a[:2], b[:2]
    where = f"vocab mapping mismatch ({names[0]} vs {names[1]})"
    if d2t_a.shape != d2t_b.shape:
        raise ValueError(f"{where}: d2t has {d2t_a.shape[0]} vs {d2t_b.shape[0]} entries (draft_vocab_size)")
    if t2d_a.shape != t2d_b.shape:
        raise ValueError(f"{where}: t2d has {t2d_a.shape[0]} vs {t2d_b.shape[0]} entries (verifier vocabulary)")
    differ = (d2t_a.cpu().long() != d2t_b.cpu().long()).nonzero().flatten()
    if differ.numel():
        i = int(differ[0])
        raise ValueError(
            f"{where}: d2t differs at {differ.numel()} draft id(s); draft id {i} is target id "
            f"{i + int(d2t_a[i])} vs {i + int(d2t_b[i])}. A continuation must reuse the same mapping."
        )
    if not torch.equal(t2d_a.cpu().bool(), t2d_b.cpu().bool()):
        raise ValueError(f"{where}: t2d differs although d2t is the same (malformed mapping)")


__all__ = [
    "MAPPING_FORMAT",
    "build_mapping",
    "check_same_mapping",
    "count_tokens",
    "load_mapping",
    "mapping_path",
    "save_mapping",
    "validate_mapping",
]
