"""Tie a process's life to its parent's: the one parent-death-signal helper of the project.

Used by the vLLM server supervisor (extract/server.py), by every training rank and by `make ablate`'s
training subprocess (bench/ablate.py), so that killing a launcher (a scheduler's preemption, an OOM kill)
never leaves orphans behind.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux only).

    The signal follows the parent *thread* that forked this process. If the parent is
    already gone when this runs (the process was re-parented), `sig` is sent at once.
    Returns False where the platform has no parent-death signal (nothing is armed).
    """
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    libc.prctl(_PR_SET_PDEATHSIG, sig)
    if parent == 1 or os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def how_it_ended(returncode: int) -> str:
    """A failed process's end in words: 'exited with status 2', or 'was killed by SIGKILL' for the
    negative return code of a process a signal killed."""
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


__all__ = ["die_with_parent", "how_it_ended"]
