"""Replace a whole directory so that a kill at any moment leaves the old one or the new one, complete.

POSIX cannot rename a directory over a non-empty one, so the swap is three steps, each
a rename or a delete that `recover_dir` can finish or undo:
1. the complete new tree is written and fsynced as `<name>.partial`;
2. the old directory is renamed aside to `<name>.old`;
3. the new one is renamed to `<name>`, then `<name>.old` is deleted.
A kill between 2 and 3 leaves no `<name>` but a complete `<name>.old`: `recover_dir` puts it
back. A kill during the delete leaves `<name>` (new) and part of `<name>.old`: it is removed.
A `<name>.partial` is never read; the next replace overwrites it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

PARTIAL_SUFFIX = ".partial"
ASIDE_SUFFIX = ".old"


def staging_dir(target: Path) -> Path:
    return target.with_name(target.name + PARTIAL_SUFFIX)


def aside_dir(target: Path) -> Path:
    return target.with_name(target.name + ASIDE_SUFFIX)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(top: Path) -> None:
    """fsync every file and directory under `top`, and `top`'s entry in its parent."""
    for dirpath, _, filenames in os.walk(top):
        for name in filenames:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))
    fsync_dir(top.parent)


def recover_dir(target: Path) -> None:
    """Finish or undo a replace that was killed midway (nothing to do after a complete one)."""
    aside = aside_dir(target)
    if not aside.exists():
        return
    if target.exists():  # killed while deleting the old tree: the new one is in place
        shutil.rmtree(aside)
    else:  # killed between the two renames: the old tree is the complete one
        os.rename(aside, target)
        fsync_dir(target.parent)


def replace_dir(staging: Path, target: Path) -> None:
    """Make the complete tree `staging` the directory `target` (see the module docstring)."""
    recover_dir(target)
    fsync_tree(staging)
    aside = aside_dir(target)
    if target.exists():
        os.rename(target, aside)
        fsync_dir(target.parent)
    os.rename(staging, target)
    fsync_dir(target.parent)
    if aside.exists():
        shutil.rmtree(aside)


__all__ = ["aside_dir", "fsync_tree", "recover_dir", "replace_dir", "staging_dir"]
