"""One training process per run directory: an advisory lock on `run_dir/train.lock` held for the run's life.

Two runs in one directory would overwrite each other's checkpoints (and `train.resume=restart` would
delete a live run's). The lock is a POSIX record lock (`lockf`): the kernel's, owned by the process
alone (not by the data-loader workers it forks, which may outlive it by a moment) and released when
that process ends, killed or not; the next run resumes without anything to clean up.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from dspark.errors import UserError

LOCK_FILE = "train.lock"


def try_lock(run_dir: Path) -> IO[str] | None:
    """The open, locked `run_dir/train.lock` holding this process's pid and host; None when another process
    holds it (its pid and host then stay in the file)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = open(run_dir / LOCK_FILE, "a+")  # noqa: SIM115 -- held open for the run's life
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        lock.close()
        if err.errno in (errno.EACCES, errno.EAGAIN):
            return None
        raise
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
    return lock


def _held_elsewhere(run_dir: Path) -> str:
    holder = (run_dir / LOCK_FILE).read_text().strip() or "a process"
    return (
        f"train.run_dir={run_dir} is in use by another training run ({holder}); wait for it to end or "
        "stop it (a stopped run resumes from its last checkpoint), or give this run another train.run_name"
    )


def _lock_or_refusal(run_dir: Path) -> tuple[IO[str] | None, str | None]:
    """The held lock, or None and why this process may not train in `run_dir` now."""
    try:
        lock = try_lock(run_dir)
    except OSError as err:
        return None, f"train.run_dir={run_dir}: cannot create or lock {LOCK_FILE} there ({err})"
    return lock, None if lock is not None else _held_elsewhere(run_dir)


def in_use(run_dir: Path) -> str | None:
    """Why a run may not start in `run_dir` now (another process holds its lock, or it cannot be locked), or None
    when it is free. Probed by taking and releasing the lock; creates `run_dir` and its lock file."""
    lock, refused = _lock_or_refusal(run_dir)
    if lock is not None:
        lock.close()
    return refused


@contextmanager
def holding_run_dir(run_dir: Path, accelerator: Accelerator) -> Iterator[None]:
    """Hold `run_dir` for the block on the main process; on every rank a UserError when another run holds it."""
    lock, refused = _lock_or_refusal(run_dir) if accelerator.is_main_process else (None, None)
    refused = broadcast_object_list([refused])[0]  # said on every rank: the others would wait on the broadcast
    if refused:
        raise UserError(refused)
    try:
        yield
    finally:
        if lock is not None:
            lock.close()


__all__ = ["LOCK_FILE", "holding_run_dir", "in_use", "try_lock"]
