"""The one kind of error a user is meant to read: bad input or config, refused on purpose.

Every `python -m <stage>` entry point catches `UserError` and prints one line,
`error: <message>`, then exits with status 2, without a traceback. Anything else is a bug
and keeps its traceback. `UserError` subclasses `ValueError`, so code that already expects a
`ValueError` from a refusal keeps working.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input, config or environment that the user can fix; the message says how."""


class MissingInput(UserError, FileNotFoundError):
    """A file, directory or store the user named is not there (still a `FileNotFoundError` for callers)."""
