"""Held-out split by prompt fingerprint, so a prompt never lands in both train and eval.

The fingerprint is the hash of the first user turn after Unicode/case/whitespace
normalization: exact and trivially re-spaced duplicates, and conversations that open
with the same question, share a fingerprint and therefore a split. The eval set is the
`eval_fraction` of distinct fingerprints with the smallest hashes: deterministic, no
seed, and the same prompts stay held out when the sample count changes.
"""

from __future__ import annotations

import hashlib
import math
import re
import unicodedata

_SPACE = re.compile(r"\s+")


def prompt_fingerprint(messages: list[dict[str, str]]) -> str:
    """sha256 of the normalized first user turn."""
    first = next(m["content"] for m in messages if m["role"] == "user")
    text = _SPACE.sub(" ", unicodedata.normalize("NFKC", first).casefold()).strip()
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def eval_fingerprints(fingerprints: set[str], eval_fraction: float) -> set[str]:
    """The held-out fingerprints: ceil(fraction * distinct) of them, at least one when 0 < fraction."""
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"data.eval_fraction={eval_fraction}: expected a value in [0, 1]")
    count = math.ceil(eval_fraction * len(fingerprints))
    return set(sorted(fingerprints)[:count])
