"""Reading the tokenized dataset (`python -m extract.data` output) for extraction, with clear errors.

A split file `<split>.jsonl` holds one JSON object per line: `sample_id` (int, unique),
`input_ids` (non-empty list of token ids < vocab size) and `loss_mask` (0/1 per token);
other keys (`source`, `split`) are ignored here. Every problem names the file and line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from dspark.errors import UserError
from dspark.extract.client import Row

SUMMARY = "summary.json"
# Too-long samples listed in the error message (the total is always given).
SHOWN = 5


class DatasetError(UserError):
    """The tokenized dataset is missing, empty, malformed or made for another target."""


@dataclass
class Split:
    """One split file, read and checked."""

    name: str
    path: Path
    rows: list[Row]
    sha256: str
    """sha256 of the file's bytes: recorded in the store so a changed dataset cannot mix into it."""


def check_tokenizer(data_dir: Path, tokenizer_sha256: str, target_name: str) -> None:
    """Refuse a dataset tokenized with another tokenizer than the target's."""
    path = Path(data_dir) / SUMMARY
    try:
        recorded = json.loads(path.read_text())["target"]["tokenizer_sha256"]
        if not isinstance(recorded, str):
            raise TypeError(f"tokenizer_sha256 is a {type(recorded).__name__}")
    except FileNotFoundError:
        raise DatasetError(
            f"{path} not found: extraction needs the tokenized dataset of `python -m extract.data` "
            f"(make data) for this target"
        ) from None
    except (ValueError, KeyError, TypeError, RecursionError, OSError) as err:  # JSON, UTF-8, unreadable
        raise DatasetError(f"{path}: no target.tokenizer_sha256 recorded ({type(err).__name__}: {err})") from err
    if recorded != tokenizer_sha256:
        raise DatasetError(
            f"{Path(data_dir)} was tokenized with another tokenizer (sha256 {recorded[:12]}...) than the "
            f"target {target_name!r} has ({tokenizer_sha256[:12]}...): rerun `make data` for this target "
            "or point extract.data_dir at its dataset"
        )


def read_split(data_dir: Path, name: str, *, max_tokens: int, vocab_size: int) -> Split:
    """Read and check `<data_dir>/<name>.jsonl`.

    Samples longer than `max_tokens` (the target's max_model_len) are an error, not a
    skip: the data stage already cuts samples to that length, so a longer one means the
    dataset was made with another setting, and silently dropping data would hide that.
    """
    path = Path(data_dir) / f"{name}.jsonl"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"{path} not found: run `make data` first, or drop {name!r} from extract.splits") from None
    except OSError as err:
        raise DatasetError(f"{path}: cannot read it ({type(err).__name__}: {err})") from None
    rows: list[Row] = []
    seen: dict[int, int] = {}
    too_long: list[str] = []
    for lineno, line_bytes in enumerate(raw.splitlines(), start=1):
        line = _decoded(line_bytes, f"{path}:{lineno}")
        if not line.strip():
            continue
        row = _parse_row(line, f"{path}:{lineno}", vocab_size)
        if row.sample_id in seen:
            raise DatasetError(f"{path}:{lineno}: sample_id {row.sample_id} already used on line {seen[row.sample_id]}")
        seen[row.sample_id] = lineno
        if len(row.input_ids) > max_tokens:
            too_long.append(f"line {lineno} (sample {row.sample_id}, {len(row.input_ids)} tokens)")
        rows.append(row)
    if too_long:
        raise DatasetError(
            f"{path}: {len(too_long)} sample(s) longer than target.max_model_len={max_tokens}: "
            f"{', '.join(too_long[:SHOWN])}{' ...' if len(too_long) > SHOWN else ''}; the dataset was made "
            "with another max length: rerun `make data` with this target"
        )
    if not rows:
        raise DatasetError(
            f"{path} has no samples: nothing to extract (drop {name!r} from extract.splits or rebuild the dataset)"
        )
    return Split(name, path, rows, hashlib.sha256(raw).hexdigest())


def _decoded(line: bytes, where: str) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DatasetError(
            f"{where}: not UTF-8 (byte 0x{line[err.start]:02x} at column {err.start + 1}); the data "
            "stage writes UTF-8 JSON lines: rebuild the dataset with `make data`"
        ) from None


def _parse_row(line: str, where: str, vocab_size: int) -> Row:
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError) as err:  # bad syntax, an over-long integer, deep nesting
        raise DatasetError(f"{where}: not valid JSON: {err}") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("sample_id", "input_ids", "loss_mask"):
        if key not in obj:
            raise DatasetError(f"{where}: missing field {key!r}")
    sample_id, ids, mask = obj["sample_id"], obj["input_ids"], obj["loss_mask"]
    if not _is_int(sample_id) or sample_id < 0:
        raise DatasetError(f"{where}: sample_id must be a non-negative integer, got {sample_id!r}")
    if not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids):
        raise DatasetError(f"{where}: input_ids must be a non-empty list of integers")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise DatasetError(f"{where}: input_ids holds {bad}, outside the target's vocabulary [0, {vocab_size})")
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(_is_int(m) and m in (0, 1) for m in mask):
        raise DatasetError(f"{where}: loss_mask must be a list of 0/1 with one entry per input id ({len(ids)})")
    return Row(sample_id=sample_id, input_ids=ids, loss_mask=mask)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


__all__ = ["DatasetError", "Split", "check_tokenizer", "read_split"]
