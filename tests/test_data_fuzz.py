"""Fuzz of the data stage: seeded corruptions of valid JSONL and ShareGPT rows, mixed with good
rows, read and tokenized by the real stage (real Qwen3 tokenizer and chat template).

Each corruption is one of: the row cut short, bytes flipped, a value nested past any limit, an
integer over Python's digit limit, a lone surrogate in a string field, or a wrong type in a
field, over every field of four row shapes (ShareGPT, OpenAI messages with reasoning, tool calls
with tools, ShareGPT function calls). Whole files are also cut (plain and gzipped). Nothing may
end in a traceback, and every good row is kept, with its content, whatever is around it.
"""

from __future__ import annotations

import copy
import gzip
import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_data import read_rows, stage_config

from dspark.errors import UserError
from dspark.extract.data.__main__ import run
from dspark.extract.data.config import SourceConfig
from dspark.extract.data.sources import load_source

SEED = 20261201
WRONG_TYPES = [0, -7, 2.5, True, None, [], {}, "text", [1, "a"], {"k": "v"}]
HUGE = "7" * 4400  # over Python's 4,300-digit limit
DEEP = "[" * 50_000 + "]" * 50_000  # past the JSON decoder's recursion limit
NESTED = '{"a": ' * 150 + "1" + "}" * 150  # parses, but deeper than a kept value may be
SURROGATES = ["\ud800", "\udfff", "\udc80"]
MARK = "@@raw@@"  # stands for raw JSON text in a serialized row


def shapes(i: int) -> list[dict]:
    """Four valid rows for index `i` (distinct first prompts), covering every field the reader takes."""
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    return [
        {
            "id": f"sg-{i}",
            "conversations": [
                {"from": "human", "value": f"Question {i}: what is a prime?"},
                {"from": "gpt", "value": "A number with exactly two divisors."},
                {"from": "human", "value": "Name one."},
                {"from": "gpt", "value": "Seven."},
            ],
        },
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"Question {i}: is 91 prime?"},
                {"role": "assistant", "content": "No, 91 = 7 x 13.", "reasoning_content": "Try 7: 7 x 13 = 91."},
            ]
        },
        {
            "tools": [weather],
            "messages": [
                {"role": "user", "content": f"Question {i}: the weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": f"call_{i}",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "content": '{"temp_c": 22}'},
                {"role": "assistant", "content": "It is 22 degrees in Paris."},
            ],
        },
        {
            "conversations": [
                {"from": "human", "value": f"Question {i}: look up the tide."},
                {"from": "function_call", "value": '{"name": "tide", "arguments": {"port": "Brest"}}'},
                {"from": "observation", "value": "high at 6"},
                {"from": "gpt", "value": "High tide is at 6."},
            ]
        },
    ]


def paths(value, prefix: tuple = ()) -> Iterator[tuple]:
    """Every field of a row: each dict key and list index, at every depth."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield (*prefix, key)
        yield from paths(item, (*prefix, key))


def replaced(row: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(row)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


def serialized(row: dict, raw: str | None = None) -> bytes:
    """The row as one JSON line; `raw` replaces the MARK string (text json.dumps cannot write)."""
    text = json.dumps(row)
    return (text.replace(json.dumps(MARK), raw) if raw is not None else text).encode()


def corruptions(rng: random.Random, row: dict) -> Iterator[tuple[str, bytes]]:
    """(kind, bytes) of every corruption of one row: each field gets wrong types, each string field a
    surrogate, some fields deep nesting or a huge number, and the bytes get cuts and flips."""
    fields = list(paths(row))
    for path in fields:
        for wrong in rng.sample(WRONG_TYPES, 5):
            yield "wrong type", serialized(replaced(row, path, wrong))
    for path in fields:
        value = eval_path(row, path)
        if isinstance(value, str):
            at = rng.randrange(len(value) + 1)
            yield "surrogate", serialized(replaced(row, path, value[:at] + rng.choice(SURROGATES) + value[at:]))
    for path in rng.sample(fields, 5):
        yield "deep nesting", serialized(replaced(row, path, MARK), rng.choice([DEEP, NESTED]))
        yield "huge number", serialized(replaced(row, path, MARK), rng.choice([HUGE, "-" + HUGE, HUGE + ".5"]))
    whole = serialized(row)
    for _ in range(12):
        yield "cut", whole[: rng.randrange(1, len(whole) - 1)]
    for _ in range(20):
        flipped = bytearray(whole)
        for _ in range(rng.randint(1, 4)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        yield "flip", bytes(flipped)


def eval_path(row, path: tuple):
    for key in path:
        row = row[key]
    return row


def fuzz_rows(seed: int) -> tuple[list[bytes], list[bool], Counter]:
    """Lines of a fuzzed file in order, which of them are good rows, and the corruptions by kind."""
    rng = random.Random(seed)
    lines, good, index, kinds = [], [], 0, Counter()
    for shape in range(4):
        for kind, blob in corruptions(rng, shapes(10_000 + shape)[shape]):
            kinds[kind] += 1
            lines.append(blob)
            good.append(False)
            if rng.random() < 0.3:
                index += 1
                lines.append(serialized(shapes(index)[index % 4]))
                good.append(True)
    return lines, good, kinds


def good_prompt(line: bytes) -> str:
    """The first user turn of a good row: what identifies it in what was read."""
    row = json.loads(line)
    turns = row.get("conversations") or row["messages"]
    return next(t.get("value", t.get("content")) for t in turns if t.get("from", t.get("role")) in ("human", "user"))


def first_prompts(data) -> dict[str, tuple[int, list[dict]]]:
    return {
        next(m["content"] for m in c.messages if m["role"] == "user"): (c.sample_id, c.messages)
        for c in data.conversations
    }


def clean_messages(line: bytes, tmp_path: Path) -> list[dict]:
    path = tmp_path / "one.jsonl"
    path.write_bytes(line + b"\n")
    (conv,) = load_source(SourceConfig("jsonl", str(path), None, "train", None, 0, None, 0.0)).conversations
    return conv.messages


@pytest.mark.parametrize("form", ["jsonl", "sharegpt"])
def test_fuzzed_rows_cost_only_themselves_through_the_real_stage(tiny_qwen3_dir, tmp_path, form):
    lines, good, kinds = fuzz_rows(SEED + (form == "sharegpt"))
    corrupted = sum(kinds.values())
    assert corrupted >= 500 and sum(good) >= 150 and min(kinds.values()) >= 20 and len(kinds) == 6
    path = tmp_path / f"fuzz.{'jsonl' if form == 'jsonl' else 'json'}"
    if form == "jsonl":
        path.write_bytes(b"".join(line + b"\n" for line in lines))
    else:
        path.write_bytes(b"[\n" + b",\n".join(lines) + b"\n]\n")
    source = SourceConfig(form, str(path), None, "train", None, 0, None, 0.0)
    data = load_source(source)
    assert data.rows == len(data.conversations) + data.problems.total
    read = first_prompts(data)
    clean = {}
    for n, (line, is_good) in enumerate(zip(lines, good)):
        if is_good:
            prompt = good_prompt(line)
            clean[prompt] = clean_messages(line, tmp_path)
            assert read[prompt][1] == clean[prompt], prompt  # kept, and read as it reads on its own
            if form == "jsonl":  # a flipped newline adds a line: the id is the line the row is on
                assert read[prompt][0] == 1 + sum(b.count(b"\n") + 1 for b in lines[:n])
    assert data.problems.total >= corrupted // 2  # most corruptions are reported (some leave a valid row)

    summary = run(
        stage_config(
            tiny_qwen3_dir,
            tmp_path / "out",
            f"data={form}",
            f"data.path={path}",
            "data.max_samples=null",  # the ShareGPT preset draws 64 one-turn prompts
            "data.max_turns=null",
            "regen.enabled=false",
            "tokenize.min_loss_tokens=1",
            "data.eval_fraction=0",
        )
    )
    kept = {r["sample_id"] for r in read_rows(tmp_path / "out")}
    assert {read[p][0] for p in clean} <= kept  # every good row ends in the dataset
    assert summary["source"]["usable"] == len(data.conversations)


def test_cut_files_keep_every_row_before_the_cut(tmp_path):
    lines, good, _ = fuzz_rows(SEED + 2)
    lines, good = lines[:400], good[:400]
    body = b"".join(line + b"\n" for line in lines)
    ends, first_line = [], [1]  # per row: where its line ends in the file, and its line number
    for line in lines:
        ends.append((ends[-1] if ends else 0) + len(line) + 1)
        first_line.append(first_line[-1] + line.count(b"\n") + 1)
    good_rows = [(good_prompt(line), n) for n, (line, g) in enumerate(zip(lines, good)) if g]
    rng = random.Random(SEED)
    plain, packed = tmp_path / "cut.jsonl", tmp_path / "cut.jsonl.gz"
    whole_gz = gzip.compress(body)
    refused = 0
    for _ in range(25):
        at = rng.randrange(1, len(body))
        plain.write_bytes(body[:at])
        read = first_prompts(load_source(SourceConfig("jsonl", str(plain), None, "train", None, 0, None, 0.0)))
        assert {p for p, n in good_rows if ends[n] <= at} <= set(read)  # every whole line before the cut

        packed.write_bytes(whole_gz[: rng.randrange(1, len(whole_gz))])
        try:
            data = load_source(SourceConfig("jsonl", str(packed), None, "train", None, 0, None, 0.0))
        except UserError as err:  # nothing could be read before the damage: one clear refusal
            assert "cannot read the file" in str(err)
            refused += 1
            continue
        damage = data.problems.to_dict()["damaged file"]
        unread_from = int(damage["locations"][0].rsplit(" ", 1)[1])
        assert damage["count"] == 1 and f"unread from line {unread_from} on" in damage["examples"][0]
        read = first_prompts(data)
        assert {p for p, n in good_rows if first_line[n] < unread_from} <= set(read)  # all before the damage
        assert not {p for p, n in good_rows if first_line[n] >= unread_from} & set(read)  # nothing after it
    assert refused < 5

    items = b"[\n" + b",\n".join(lines) + b"\n]\n"
    item_ends, pos = [], 2
    for line in lines:
        item_ends.append(pos + len(line))
        pos += len(line) + 2
    array = tmp_path / "cut.json"
    for _ in range(25):
        at = rng.randrange(2, len(items))
        array.write_bytes(items[:at])
        data = load_source(SourceConfig("sharegpt", str(array), None, "train", None, 0, None, 0.0))
        assert {p for p, n in good_rows if item_ends[n] < at} <= set(first_prompts(data))
        assert data.problems.counts().get("truncated file", 0) <= 1
