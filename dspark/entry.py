"""The one wrapper of every `python -m <stage>` entry point: Hydra, with user errors as one line.

`@stage_main("extract")` replaces `@hydra.main(config_path="../conf", config_name="extract")`.
A `UserError` (bad input, config or environment, refused on purpose) prints
`error: <message>` to stderr and exits with status 2, without a traceback and without
Hydra's "Error executing job"; so does an override Hydra cannot apply (a misspelt key, a
missing config group option), checked before Hydra runs the stage. So do the `OSError`s
that name a path the user gave or the machine's state rather than a bug: a missing file,
permission denied, not a directory / is a directory, a read-only filesystem, a name too
long or a symlink loop (`USER_PATH_ERRORS`), and a full disk (or quota, or file-size
limit). Any other exception is a bug and keeps its full traceback. Every stage commits its
work atomically, so what was committed before the failure is kept and a rerun continues.
"""

from __future__ import annotations

import errno
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra.errors import HydraException
from omegaconf import DictConfig

from dspark.errors import UserError

# conf/ beside the package in a checkout; inside it (dspark/conf) in an installed wheel
_PACKAGE = Path(__file__).resolve().parent
CONF_DIR = _PACKAGE / "conf" if (_PACKAGE / "conf").is_dir() else _PACKAGE.parent / "conf"
EXIT_USER_ERROR = 2
# a write refused for lack of room: no space, over quota, over the process's file-size limit
DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# a path the user named that is not there, not theirs to read or write, or not what it must be
USER_PATH_ERRORS = {
    errno.ENOENT,
    errno.EACCES,
    errno.EPERM,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EROFS,
    errno.ENAMETOOLONG,
    errno.ELOOP,
}
PATH_ERROR_TYPES = (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError)


def fail(message: str) -> None:
    """Print one `error: ...` line (multi-line messages joined) and exit with status 2."""
    line = " | ".join(part.strip() for part in str(message).splitlines() if part.strip())
    print(f"error: {line}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USER_ERROR)


def script_main(main: Callable[[list[str]], int]) -> None:
    """Run a plain `main(argv) -> exit status` (no Hydra) on the command line, a UserError as `fail` prints it."""
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as err:
        fail(str(err))


def check_overrides(config_name: str, overrides: list[str]) -> DictConfig | None:
    """Compose the config once without running anything and return it; a user error if Hydra refuses the
    overrides.

    Command lines with Hydra flags (`--help`, `--cfg job`, `-m`) are left to Hydra itself (None).
    """
    if any(arg.startswith("-") for arg in overrides):
        return None
    try:
        with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return hydra.compose(config_name=config_name, overrides=overrides)
    except HydraException as err:
        cause = f" ({err.__cause__})" if err.__cause__ is not None else ""
        fail(f"{err}{cause}")


def stage_main(config_name: str) -> Callable[[Callable[[DictConfig], object]], Callable[[], None]]:
    """Decorator: `task(cfg)` becomes a Hydra entry point on conf/<config_name>.yaml with one-line user errors."""

    def wrap(task: Callable[[DictConfig], object]) -> Callable[[], None]:
        @functools.wraps(task)
        def guarded(cfg: DictConfig) -> None:
            try:
                task(cfg)
            except UserError as err:
                fail(str(err))
            except OSError as err:
                if err.errno in DISK_FULL:
                    fail(
                        f"{err} - the disk where the stage writes is full: what was committed is kept; "
                        "free space (or raise the quota) and rerun the same command to continue"
                    )
                if err.errno in USER_PATH_ERRORS or isinstance(err, PATH_ERROR_TYPES):
                    fail(str(err))
                raise

        hydra_main = hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base=None)(guarded)

        @functools.wraps(task)
        def main() -> None:
            check_overrides(config_name, sys.argv[1:])
            hydra_main()

        return main

    return wrap


__all__ = ["DISK_FULL", "EXIT_USER_ERROR", "USER_PATH_ERRORS", "check_overrides", "fail", "stage_main"]
