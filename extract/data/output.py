"""The dataset directory replaced as one unit.

`train.jsonl`, `eval.jsonl`, `token_freqs.npy` and `summary.json` in `data_dir` are
symlinks into `current/`, itself a symlink to one complete generation under
`.generations/`. A run writes a new generation into `<host>-<pid>-<uuid>.partial`, fsyncs
it, renames it complete, and switches `current` to it with one rename: a reader (or a
kill at any moment) sees either the old dataset or the new one, never files of both.
The generation `current` pointed to before is removed after the switch; so are partial
ones left by killed runs on this host. Several nodes may publish at once: each switch is
whole, the last one wins. The symlinks are relative, so a copied directory still works.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from dspark.vocab import count_tokens

SPLITS = ("train", "eval")
FILES = ("train.jsonl", "eval.jsonl", "token_freqs.npy", "summary.json")
GENERATIONS = ".generations"
CURRENT = "current"
PARTIAL = ".partial"


def publish(data_dir: Path, rows: dict[str, list[dict]], vocab_size: int, summary: dict[str, Any]) -> None:
    """Write the dataset as a new generation of `data_dir` and switch to it in one rename."""
    generations = data_dir / GENERATIONS
    generations.mkdir(parents=True, exist_ok=True)
    name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    partial = generations / f"{name}{PARTIAL}"
    partial.mkdir()
    for split in SPLITS:
        write_file(partial / f"{split}.jsonl", (json.dumps(r, separators=(",", ":")) + "\n" for r in rows[split]))
    train = rows["train"]
    freqs = count_tokens((r["input_ids"] for r in train), (r["loss_mask"] for r in train), vocab_size)
    with open(partial / "token_freqs.npy", "wb") as f:
        np.save(f, freqs)
        f.flush()
        os.fsync(f.fileno())
    write_file(partial / "summary.json", [json.dumps(summary, indent=2) + "\n"])
    _fsync_dir(partial)
    complete = generations / name
    os.replace(partial, complete)
    _fsync_dir(generations)
    _link_files(data_dir)
    current = data_dir / CURRENT
    previous = os.readlink(current) if current.is_symlink() else None
    _replace_link(current, f"{GENERATIONS}/{name}")  # the switch
    if previous and Path(previous).name != name:
        shutil.rmtree(data_dir / previous, ignore_errors=True)
    _remove_stale_partials(generations)


def write_file(path: Path, chunks: Iterable[str]) -> None:
    """Write `chunks` to `path` and fsync it."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(chunks)
        f.flush()
        os.fsync(f.fileno())


def _link_files(data_dir: Path) -> None:
    """Make every dataset file a link through `current` (once; a dataset of plain files is retired first).

    The summary goes first: until every link is in place a reader finds no dataset,
    rather than a mix of the old files and the new.
    """
    wanted = {f: f"{CURRENT}/{f}" for f in FILES}
    if all((data_dir / f).is_symlink() and os.readlink(data_dir / f) == t for f, t in wanted.items()):
        return
    for f in ("summary.json", *FILES[:-1]):
        if (data_dir / f).exists() or (data_dir / f).is_symlink():
            (data_dir / f).unlink()
    _fsync_dir(data_dir)
    for f, target in wanted.items():
        _replace_link(data_dir / f, target)


def _replace_link(path: Path, target: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.link")
    os.symlink(target, tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _remove_stale_partials(generations: Path) -> None:
    """Partial generations of dead processes on this host (killed runs); other hosts' may be in progress."""
    host = socket.gethostname()
    for path in generations.glob(f"{host}-*{PARTIAL}"):
        pid = path.name[len(host) + 1 :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
