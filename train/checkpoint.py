"""Checkpoints: `run_dir/checkpoints/step_N/` plus `latest` and `best` links.

A checkpoint holds everything an exact resume needs: the trainable weights
(model.safetensors; the frozen verifier tensors are reloaded from the verifier), the
optimizer state (by parameter name), every rank's RNG states, the loop position
(trainer_state.json), the resolved config (config.yaml) and the vocab mapping. It is
written to a hidden partial directory, fsynced (files and directory) and renamed into
place, so neither a crash nor a power cut leaves a half-written `step_N`.

The newest complete `step_N/` is the truth; the `latest` link is a convenience for people
(it dangles for a moment during every save). Nothing here unpickles: weights are
safetensors and the optimizer and RNG states hold only tensors and plain Python
values, read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dspark.errors import UserError
from dspark.store.files import LocalFiles

CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "trainer_state.json"
WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
CONFIG_FILE = "config.yaml"


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def step_dirs(run_dir: Path) -> dict[int, Path]:
    """Every `checkpoints/step_N` directory of a run (complete or not), by step."""
    root = checkpoints_root(run_dir)
    found = {}
    for path in root.glob("step_*") if root.is_dir() else []:
        step = path.name.removeprefix("step_")
        if step.isdigit() and path.is_dir():
            found[int(step)] = path
    return found


def is_complete(path: Path) -> bool:
    """Whether `path` holds every file a resume reads."""
    return all((path / name).is_file() for name in (STATE_FILE, WEIGHTS_FILE, OPTIMIZER_FILE, CONFIG_FILE, rng_file(0)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete `step_N` of a run (found by itself, whatever `latest` says), or None."""
    dirs = step_dirs(run_dir)
    complete = [step for step, path in dirs.items() if is_complete(path)]
    return dirs[max(complete)].resolve() if complete else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint dir, or a run dir / checkpoints dir whose newest complete checkpoint is meant."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path.resolve()
    found = latest_checkpoint(path.parent if path.name == CHECKPOINTS_DIR else path)
    if found is not None:
        return found
    raise UserError(f"{path}: no checkpoint here ({STATE_FILE} not found, nor a complete checkpoints/step_N)")


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights training changes; frozen verifier copies are rebuilt from the verifier."""
    return {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: nn.Module, weights: dict[str, torch.Tensor], source: Path) -> None:
    """Load `weights` into the trainable parameters; every one must be present, nothing extra."""
    expected = {n for n, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
    if missing or unexpected:
        raise UserError(
            f"{source}: weights do not fit this model (missing {missing[:5]}, unexpected {unexpected[:5]}); "
            "check the model/target config against the checkpoint's config.yaml"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            if params[name].shape != value.shape:
                raise UserError(
                    f"{source}: {name} has shape {tuple(value.shape)}, the model has {tuple(params[name].shape)}"
                )
            params[name].copy_(value)


def capture_rng() -> dict[str, Any]:
    """Every RNG state of this process as tensors and plain values (loadable with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {
        "kind": kind,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(gauss),
    }
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


class CheckpointWriter:
    """Writes checkpoints collectively: every rank saves its RNG state, rank 0 the rest."""

    def __init__(self, run_dir: Path, rank: int, barrier: Callable[[], None], keep_last: int):
        self.root = checkpoints_root(run_dir)
        self.rank = rank
        self.barrier = barrier
        self.keep_last = keep_last

    def save(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
        config_yaml: str,
        files: dict[str, Path],
        best: bool,
    ) -> Path:
        """Write `step_<step>` (all ranks call this), point `latest` (and `best` if so) at it, prune."""
        final = self.root / f"step_{step}"
        partial = self.root / f".step_{step}.partial"
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        self.barrier()
        torch.save(capture_rng(), partial / rng_file(self.rank))
        if self.rank == 0:
            save_file(trainable_state(model), partial / WEIGHTS_FILE)
            torch.save({"optimizer": optimizer.state_dict()}, partial / OPTIMIZER_FILE)
            (partial / CONFIG_FILE).write_text(config_yaml)
            (partial / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=2))
            for name, src in files.items():
                shutil.copyfile(src, partial / name)
        self.barrier()
        if self.rank == 0:
            files = LocalFiles(self.root)
            files.sync_tree(partial.name)  # contents durable before the rename publishes them
            # Re-saving a step (e.g. to mark it best): move the old copy aside, not delete it
            # first, so `latest` dangles for two renames at most, never for a whole delete.
            old = self.root / f".step_{step}.old"
            shutil.rmtree(old, ignore_errors=True)
            if final.exists():
                os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old, ignore_errors=True)
            self.link("latest", final)
            if best:
                self.link("best", final)
            files.sync_tree(final.name)  # and the renames (the checkpoints directory itself)
            self.prune()
        self.barrier()
        return final

    def link(self, name: str, target: Path) -> None:
        """Atomically point `checkpoints/<name>` at `target`."""
        tmp = self.root / f".{name}.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target.name)
        os.replace(tmp, self.root / name)

    def prune(self) -> None:
        """Keep the newest `keep_last` checkpoints and the best one."""
        protected = {p.resolve() for p in (self.root / "best", self.root / "latest") if p.exists()}
        steps = sorted(self.root.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        for old in steps[: max(len(steps) - self.keep_last, 0)]:
            if old.resolve() not in protected:
                shutil.rmtree(old)


def load_plain(path: Path) -> Any:
    """A `torch.save`d file of tensors and plain values; anything else (a pickled object) is refused."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UserError(
            f"{path}: holds pickled objects, not only tensors and plain values; refusing to unpickle it "
            "(it was not written by this trainer, or by an older version). Warm-start a new run from its "
            "weights with train.init_from instead"
        ) from err


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's trainable weights (safetensors: data only, never code)."""
    return load_file(path / WEIGHTS_FILE)


def read_checkpoint(path: Path, rank: int) -> dict[str, Any]:
    """Everything in a checkpoint that a resume restores (tensors on CPU)."""
    opt = load_plain(path / OPTIMIZER_FILE)
    rng_path = path / rng_file(rank)
    return {
        "weights": read_weights(path),
        "optimizer": opt["optimizer"],
        "state": json.loads((path / STATE_FILE).read_text()),
        # A resume on more ranks than were saved: the new ranks start from rank 0's RNG state.
        "rng": load_plain(rng_path if rng_path.exists() else path / rng_file(0)),
    }


__all__ = [
    "CONFIG_FILE",
    "CheckpointWriter",
    "STATE_FILE",
    "WEIGHTS_FILE",
    "capture_rng",
    "checkpoints_root",
    "is_complete",
    "latest_checkpoint",
    "load_plain",
    "load_trainable_state",
    "read_checkpoint",
    "read_weights",
    "resolve_checkpoint",
    "restore_rng",
    "step_dirs",
    "trainable_state",
]
