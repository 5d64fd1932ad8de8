"""Rows that could not be used, counted by reason, with where they came from.

Every stage of data preparation (reading, regenerating, tokenizing) reports what it
skipped here instead of dropping it silently; the tallies end up in summary.json and on
the console.
"""

from __future__ import annotations

import json
from collections import defaultdict

from dspark.errors import UserError

EXAMPLES_KEPT = 20  # locations listed with their detail per reason; every location is listed without it


class RowError(UserError):
    """A single row/sample is unusable; `reason` is the short tally key, the message says why."""

    def __init__(self, reason: str, detail: str | None = None):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def row_error(err: Exception) -> RowError:
    """What failed inside one row, as that row's reason: a RowError as it is, any other error by its kind."""
    if isinstance(err, RowError):
        return err
    if isinstance(err, json.JSONDecodeError):
        at = f"column {err.colno}" if err.lineno == 1 else f"line {err.lineno} column {err.colno}"
        return RowError("invalid JSON", f"{err.msg} at {at}")
    if isinstance(err, UnicodeDecodeError):
        return RowError("not UTF-8", f"byte 0x{err.object[err.start]:02x} at column {err.start + 1}")
    reason = next((r for kind, r in _REASONS if isinstance(err, kind)), "unreadable row")
    return RowError(reason, f"{type(err).__name__}: {err}"[:DETAIL_CHARS])


_REASONS = ((RecursionError, "nested too deeply"), (UnicodeError, "invalid Unicode"))
DETAIL_CHARS = 300


class Problems:
    """Tally of skipped rows: reason -> count, every location, and the first few with their detail."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = defaultdict(int)
        self._examples: dict[str, list[str]] = defaultdict(list)
        self._locations: dict[str, list[str]] = defaultdict(list)

    def add(self, reason: str, where: str, detail: str | None = None) -> None:
        self._counts[reason] += 1
        self._locations[reason].append(where)
        if len(self._examples[reason]) < EXAMPLES_KEPT:
            self._examples[reason].append(f"{where}: {detail}" if detail else where)

    def add_error(self, err: RowError, where: str) -> None:
        self.add(err.reason, where, err.detail)

    def merge(self, other: Problems) -> None:
        """Add another tally's counts and examples to this one."""
        for reason, count in other._counts.items():
            self._counts[reason] += count
            room = EXAMPLES_KEPT - len(self._examples[reason])
            self._examples[reason].extend(other._examples[reason][:room])
            self._locations[reason].extend(other._locations[reason])

    def __bool__(self) -> bool:
        return bool(self._counts)

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    def counts(self) -> dict[str, int]:
        return dict(sorted(self._counts.items()))

    def to_dict(self) -> dict[str, dict]:
        return {
            r: {"count": c, "examples": self._examples[r], "locations": self._locations[r]}
            for r, c in sorted(self._counts.items())
        }

    def report(self, title: str) -> str:
        lines = [f"{title}: {self.total} skipped"]
        for reason, count in sorted(self._counts.items()):
            shown = self._examples[reason]
            more = f" (+{count - len(shown)} more)" if count > len(shown) else ""
            lines.append(f"  {reason}: {count} — " + "; ".join(shown[:5]) + (" ..." if len(shown) > 5 else "") + more)
        return "\n".join(lines)
