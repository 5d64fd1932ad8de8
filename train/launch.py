"""`make train`: torchrun, same flags, whose failure ends in one line instead of the launcher's traceback.

`python -m train.launch --standalone --nproc_per_node 2 -m train key=value ...` runs torchrun's own parser
and launcher. Each rank reports its own failure (a user error as one `error: ...` line, a bug with its
traceback, `dspark.entry`); torchrun would then add its ChildFailedError traceback and failure table on
top, burying that line. Here a failed launch prints one `train: ...` line naming the rank that failed
first and how (its exit status or the signal that killed it), then the ranks torchrun stopped after it,
and exits with the first failure's status (2 for a user error, 128 + the signal for a rank killed by
one), as the stage itself would.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import parse_args, run

from dspark.lifetime import how_it_ended

# logs the first failure as an error line of its own; the summary below names every failure
ELASTIC_API_LOGGER = "torch.distributed.elastic.multiprocessing.api"


def describe(rank: int, failure: ProcessFailure) -> str:
    """'rank 1 exited with status 2' or 'rank 0 was killed by SIGKILL'."""
    return f"rank {rank} {how_it_ended(failure.exitcode)}"


def exit_status(failure: ProcessFailure) -> int:
    """The shell's status for the failure: its exit code, or 128 + the signal that killed it."""
    return 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode or 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
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
