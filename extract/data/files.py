"""Source files read row by row: JSONL (plain or gzipped) and JSON arrays (ShareGPT form).

A reader never raises for what is inside a row. It yields one `Row` per row: the row's
JSON text (JSONL; parsed in the row's guarded step, `sources.read_rows`), its parsed
object, or the error that stopped it being read, which the guarded step reports as that
row's reason. What fails for the file itself is not a row: a file that cannot be read at
all (missing, unreadable, not gzip) is a `UserError`; damage that stops the reading after
some rows (a truncated or corrupt gzip stream, a JSON array cut off) ends the rows with
one "damaged file" or "truncated file" row, so the rows before it are kept and the
damage is reported once, as one line.
"""

from __future__ import annotations

import codecs
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dspark.errors import UserError
from dspark.extract.data.problems import RowError

Row = tuple[int, str, Any]
"""(sample_id, where, payload): the row's JSON text as bytes, its parsed object, or the exception reading it raised."""

ROW_KEYS = ("conversations", "messages", "turns")  # the keys a conversation row holds (`sources.normalize`)
# Reading a damaged file fails with these: EOFError (a gzip stream cut short), zlib.error (not gzip,
# corrupt compressed data, a wrong checksum), OSError (an I/O error).
FILE_ERRORS = (OSError, EOFError, zlib.error)
CHUNK = 1 << 16  # bytes read at a time
GZ_CHUNK = 1 << 10  # compressed bytes decompressed at a time: damage loses at most the lines decompressed from these
_NEXT_OBJECT = re.compile(r",\s*(?=\{)")
_STRUCTURE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)  # a string, or a bracket outside one


def jsonl_rows(path: Path) -> Iterator[Row]:
    """One row per non-blank line (gunzipped for `.gz`), numbered from 1."""
    for line_no, line in _lines(path, "JSONL"):
        where = f"{path.name} line {line_no}"
        if isinstance(line, RowError):
            yield line_no, where, line
            return
        if line_no == 1:
            line = line.removeprefix(codecs.BOM_UTF8)  # a leading BOM is not data
        if line.strip():  # blank lines separate nothing and hold no row
            yield line_no, where, line


def json_array_rows(path: Path) -> Iterator[Row]:
    """Items of a JSON array file, numbered from 0, read one by one so a broken item costs only itself.

    After an item that cannot be parsed, reading resumes at the next item that can (`_resume_at`);
    only an array cut off, with nothing readable after the damage, ends the rows.
    """
    # A byte that is not UTF-8 becomes a lone surrogate in its item, which that item's check reports.
    text = _read(path, "JSON").decode("utf-8", "surrogateescape")
    pos = text.find("[")
    if pos < 0 or text[:pos].strip():
        raise UserError(f"data.path={str(path)!r}: expected a JSON array of conversations")
    decoder, pos, index = json.JSONDecoder(), pos + 1, 0
    closing = len(text.rstrip()) - 1  # where the array's closing bracket must be: last in the file
    while True:
        pos = _skip_separators(text, pos)
        where = f"{path.name} item {index}"
        if pos >= len(text):
            yield index, where, RowError("truncated file", f"array not closed at char {pos}")
            return
        if pos == closing and text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError) as err:  # JSONDecodeError, an over-long integer, deep nesting
            resume = _resume_at(text, decoder, pos, closing)
            if resume is None:
                detail = f"{type(err).__name__} at char {pos}; the last {len(text) - pos} chars are unread"
                yield index, where, RowError("truncated file", detail)
                return
            yield index, where, err
            pos = resume
        else:
            yield index, where, obj
        index += 1


def _resume_at(text: str, decoder: json.JSONDecoder, start: int, closing: int) -> int | None:
    """Where reading resumes after the item at `start` failed to parse; None: nowhere (the file is cut off).

    The next whole item is the first object after a comma that parses, holds a conversation and is
    followed by `,` or the closing bracket (an item, not a message inside one). The failed item's own
    end, where its brackets (outside strings) balance before a `,` or the closing bracket, comes first when it lies before that next
    item: the item was whole and only its content bad (an over-long number, deep nesting, a typo), and
    the item after it, maybe bad as well, is read on its own. Otherwise the damage spans everything up
    to the next whole item, or up to the closing bracket that ends the file.
    """
    following = _next_item(text, decoder, start + 1, closing)
    depth = 0
    for token in _STRUCTURE.finditer(text, start, len(text) if following is None else following):
        depth += 1 if token.group() in "[{" else -1 if token.group() in "]}" else 0
        if depth == 0:
            if _ends_item(text, token.end(), closing):
                return token.end()
            break
    if following is not None:
        return following
    return closing if closing > start and text[closing] == "]" else None


def _next_item(text: str, decoder: json.JSONDecoder, pos: int, closing: int) -> int | None:
    for match in _NEXT_OBJECT.finditer(text, pos):
        try:
            obj, end = decoder.raw_decode(text, match.end())
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict) and any(k in obj for k in ROW_KEYS) and _ends_item(text, end, closing):
            return match.end()
    return None


def _ends_item(text: str, pos: int, closing: int) -> bool:
    """A `,` or the array's closing bracket follows `pos` (after whitespace)."""
    after = _skip_separators(text, pos, " \t\r\n")
    return text[after : after + 1] == "," or (after == closing and text[after] == "]")


def _skip_separators(text: str, pos: int, chars: str = " \t\r\n,") -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _lines(path: Path, kind: str) -> Iterator[tuple[int, bytes | RowError]]:
    """(line number, line) of a source file; damage after some lines ends them with a "damaged file" RowError."""
    _check_file(path, kind)
    line_no, rest = 0, b""
    try:
        for chunk in _chunks(path):
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
                line_no += 1
                yield line_no, line + b"\n"
    except FILE_ERRORS as err:
        if line_no == 0 or _checksum_mismatch(err):
            raise _unreadable(path, err) from None
        detail = f"{_describe(err)}; the file is unread from line {line_no + 1} on (lines 1-{line_no} were read)"
        yield line_no + 1, RowError("damaged file", detail)
        return
    if rest:
        yield line_no + 1, rest


def _chunks(path: Path) -> Iterator[bytes]:
    """The file's bytes (gunzipped for `.gz`) in pieces, as far as they can be read.

    zlib rather than `gzip.open`: that one decompresses ahead in blocks and loses every line of
    the block where the damage is; here each piece comes out before the next is decompressed.
    """
    with open(path, "rb") as f:
        if path.suffix != ".gz":
            yield from iter(lambda: f.read(CHUNK), b"")
            return
        stream, fed = zlib.decompressobj(wbits=31), False  # wbits=31: gzip header and trailer (CRC, size)
        while chunk := f.read(GZ_CHUNK):
            while chunk:
                fed = True
                yield stream.decompress(chunk)
                chunk = b""
                if stream.eof:  # a member ended; what follows is the next member
                    chunk, stream, fed = stream.unused_data, zlib.decompressobj(wbits=31), False
        if fed:
            raise EOFError("the compressed stream ends before its end-of-stream marker (the file is cut short)")


def _read(path: Path, kind: str) -> bytes:
    _check_file(path, kind)
    try:
        return path.read_bytes()
    except FILE_ERRORS as err:
        raise _unreadable(path, err) from None


def _check_file(path: Path, kind: str) -> None:
    if not path.is_file():
        raise UserError(f"data.path={str(path)!r}: no such {kind} file")


def _checksum_mismatch(err: BaseException) -> bool:
    """The gzip trailer's CRC or length disagrees: the damage is somewhere in what was read, so none of it counts."""
    return isinstance(err, zlib.error) and ("incorrect data check" in str(err) or "incorrect length check" in str(err))


def _unreadable(path: Path, err: BaseException) -> UserError:
    if _checksum_mismatch(err):
        hint = " (its checksum does not match: no row of it can be trusted; re-create or re-download it)"
    else:
        not_gzip = path.suffix == ".gz" and "incorrect header check" in str(err)
        hint = " (it is not gzip-compressed: drop the .gz suffix or compress it)" if not_gzip else ""
    return UserError(f"data.path={str(path)!r}: cannot read the file{hint}: {_describe(err)}")


def _describe(err: BaseException) -> str:
    kind = "corrupt compressed data (zlib)" if isinstance(err, zlib.error) else type(err).__name__
    return f"{kind}: {err}"
