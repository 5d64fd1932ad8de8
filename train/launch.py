"""`make train`: torchrun, same flags, whose failure ends in one line instead of the launcher's traceback.

`python -m train.launch --standalone --nproc_per_node 2 -m train key=value ...` runs torchrun's own parser
and launcher. Each rank reports its own failure (a user error as one `error: ...` line, a bug with its
traceback, `dspark.entry`); torchrun would then add its ChildFailedError traceback and failure table on
top, burying that line. Here a failed launch prints one `train: ...` line naming the rank that failed
first and how (its exit status or the signal that killed it), then the ranks torchrun stopped after it,
and exits with the first failure's status (2 for a user error, 128 + the signal for a rank killed by
one), as the stage itself would.

A launch of the train stage (`-m train`) first composes and checks its config here, once: a misspelt key
or a bad value is one `error: ...` line and status 2 before any rank starts, not the same line from
every rank after each has imported torch.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import parse_args, run

from dspark.entry import check_overrides, fail
from dspark.errors import UserError
from dspark.lifetime import how_it_ended
from dspark.train.config import load_sections

# the stage whose config the launcher checks before starting its ranks (`-m train`; installed: dspark.train)
TRAIN_MODULES = {"train", "dspark.train"}
# logs the first failure as an error line of its own; the summary below names every failure
ELASTIC_API_LOGGER = "torch.distributed.elastic.multiprocessing.api"


def describe(rank: int, failure: ProcessFailure) -> str:
    """'rank 1 exited with status 2' or 'rank 0 was killed by SIGKILL'."""
    return f"rank {rank} {how_it_ended(failure.exitcode)}"


def exit_status(failure: ProcessFailure) -> int:
    """The shell's status for the failure: its exit code, or 128 + the signal that killed it."""
    return 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode or 1


def check_train_config(module: bool, script: str, script_args: list[str]) -> None:
    """For `-m train key=value ...`: the config every rank would compose, checked section by section; a user
    error exits with one line (`dspark.entry.fail`). Other scripts are left to themselves."""
    if not module or script not in TRAIN_MODULES:
        return
    cfg = check_overrides("train", script_args)
    if cfg is None:  # Hydra's own flags (--help, --cfg job): the ranks answer them
        return
    try:
        load_sections(cfg)
    except UserError as err:
        fail(str(err))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    check_train_config(args.module, args.training_script, list(args.training_script_args))
    logging.getLogger(ELASTIC_API_LOGGER).setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as err:
        rank, first = err.get_first_failure()
        why = (
            " (killed from outside: the OOM killer, a preemption or a user)"
            if first.exitcode < 0
            else " (its output above says why)"
        )
        after = [describe(r, f) for r, f in sorted(err.failures.items()) if r != rank]
        then = f"; then {', '.join(after)}" if after else ""
        print(f"train: {describe(rank, first)}{why}{then}", file=sys.stderr, flush=True)
        return exit_status(first)
    return 0


if __name__ == "__main__":
    sys.exit(main())
