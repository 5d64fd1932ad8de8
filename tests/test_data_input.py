"""Bad input costs only itself: a corpus of broken rows among good ones (tests/data/bad_rows.jsonl),
an empty file, a missing file, and a lone surrogate, through the real stage entry point."""

from __future__ import annotations

import gzip
import json
import resource
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from test_data import REPO, read_rows, stage_config

from dspark.errors import UserError
from dspark.extract.data.__main__ import run
from dspark.extract.data.config import SourceConfig
from dspark.extract.data.sources import load_source
from dspark.extract.dataset import DatasetError, check_tokenizer, read_split

CORPUS = Path(__file__).parent / "data" / "bad_rows.jsonl"
# line -> why it is unusable; every other non-blank line is a good row
BAD = {
    3: "invalid JSON",
    27: "invalid JSON",
    28: "invalid JSON",  # unclosed, cut off mid-line, raw control char
    4: "not a JSON object",
    5: "not a JSON object",  # an array, null
    6: "no conversation",
    7: "no conversation",  # no messages key, messages is a string
    8: "empty conversation",
    9: "malformed message",
    10: "malformed message",
    11: "malformed message",  # string message, int content, no role
    23: "malformed message",
    30: "malformed message",  # reasoning not text, null user content
    12: "unknown role",
    13: "empty user message",
    14: "empty user message",  # empty, whitespace only
    15: "invalid Unicode",
    16: "invalid Unicode",  # lone surrogates (\ud800 in a prompt, \udfff in a reply)
    17: "not UTF-8",
    18: "no user turn",
    19: "no user turn",  # only a system prompt, only assistant turns
    20: "tool result without a call",
    21: "malformed tool call",
    22: "malformed tools",
}
GOOD = [1, 2, 25, 26, 29, 31, 32]  # 31 has no reply: read fine, dropped later with regen.enabled=false
BLANK = [24]


def jsonl(path: Path) -> SourceConfig:
    return SourceConfig("jsonl", str(path), None, "train", None, 0, None, 0.0)


def test_corpus_reading_keeps_every_good_row_and_names_every_bad_line():
    data = load_source(jsonl(CORPUS))
    assert data.rows == 32 - len(BLANK) and len(BAD) >= 15 + 5
    assert [c.sample_id for c in data.conversations] == GOOD
    examples = {r: p["examples"] for r, p in data.problems.to_dict().items()}
    for line, reason in BAD.items():
        assert sum(e.startswith(f"bad_rows.jsonl line {line}:") for e in examples[reason]) == 1, (line, reason)
    assert data.problems.total == len(BAD)
    assert "'\\ud800'" in next(e for e in examples["invalid Unicode"] if "line 15" in e)
    tool_row = next(c for c in data.conversations if c.sample_id == 25)
    assert [m["role"] for m in tool_row.messages] == ["user", "assistant", "tool", "assistant"]
    assert tool_row.tools[0]["function"]["name"] == "get_weather"
    assert tool_row.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


@pytest.mark.slow  # ~30 s or more on 2 cores: make test, not make test-fast
def test_stage_on_the_corpus_exits_0_and_summary_names_every_bad_line(tiny_qwen3_dir, tmp_path):
    out = tmp_path / "out"
    cli = [
        sys.executable,
        "-m",
        "extract.data",
        "target=qwen3-0.6b",
        f"target.name_or_path={tiny_qwen3_dir}",
        "target.aux_layer_ids=null",
        "target.max_model_len=1024",
        f"paths.data_dir={out}",
        "data=jsonl",
        f"data.path={CORPUS}",
        "data.eval_fraction=0",
        "regen.enabled=false",
        "tokenize.min_loss_tokens=1",
    ]
    proc = subprocess.run(cli, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    dropped = summary["dropped"]["source"]
    for line, reason in BAD.items():
        assert any(e.startswith(f"bad_rows.jsonl line {line}:") for e in dropped[reason]["examples"]), (line, reason)
    named = {int(w.split()[-1]): r for r, p in dropped.items() for w in p["locations"]}
    assert named == BAD and sum(p["count"] for p in dropped.values()) == len(BAD)
    assert summary["dropped"]["samples"]["no assistant reply"]["examples"][0].startswith("sample 31:")
    assert sorted(r["sample_id"] for r in read_rows(out)) == [1, 2, 25, 26, 29, 32]

    # The same stage on a full disk (a 512-byte file-size limit): one error line, exit 2, and the
    # dataset written above is still whole (the new generation is never switched in).
    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write over the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512))

    before = (out / "summary.json").read_bytes()
    full = subprocess.run(
        [*cli[:-3], "data.eval_fraction=0.5", *cli[-2:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        preexec_fn=small_files,
    )
    assert full.returncode == 2, full.stderr[-3000:]
    assert "Traceback" not in full.stderr and "error: " in full.stderr and "rerun" in full.stderr
    assert (out / "summary.json").read_bytes() == before
    assert sorted(r["sample_id"] for r in read_rows(out)) == [1, 2, 25, 26, 29, 32]


def test_lone_surrogate_costs_its_row_only(tiny_qwen3_dir, tmp_path):
    """A prompt with "\\ud800" once stopped the whole run in the prompt fingerprint."""
    good = [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": f"Question {i}?"},
                    {"role": "assistant", "content": f"Answer number {i}."},
                ]
            }
        )
        for i in range(4)
    ]
    lines = [
        good[0],
        '{"messages": [{"role": "user", "content": "x\\ud800"}, {"role": "assistant", "content": "y"}]}',
        *good[1:],
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    summary = run(
        stage_config(
            tiny_qwen3_dir,
            tmp_path / "out",
            "data=jsonl",
            f"data.path={path}",
            "regen.enabled=false",
            "tokenize.min_loss_tokens=1",
            "data.eval_fraction=0.25",
        )
    )
    assert summary["dropped"]["source"] == {
        "invalid Unicode": {
            "count": 1,
            "examples": ["p.jsonl line 2: message 0: lone surrogate '\\ud800' at char 1"],
            "locations": ["p.jsonl line 2"],
        }
    }
    assert sorted(r["sample_id"] for r in read_rows(tmp_path / "out")) == [1, 3, 4, 5]


@pytest.mark.parametrize("name, message", [("empty.jsonl", "holds no row"), ("missing.jsonl", "no such JSONL file")])
def test_empty_or_missing_file_is_a_user_error(tiny_qwen3_dir, tmp_path, name, message):
    path = CORPUS.parent / name
    cfg = stage_config(tiny_qwen3_dir, tmp_path / "out", "data=jsonl", f"data.path={path}", "regen.enabled=false")
    with pytest.raises(UserError, match=f"data.path=.*{name}.*{message}"):
        run(cfg)
    assert not (tmp_path / "out" / "summary.json").exists()


def test_a_file_of_bad_rows_only_is_a_user_error(tiny_qwen3_dir, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"{oops\n[1]\n\xff\n")
    cfg = stage_config(tiny_qwen3_dir, tmp_path / "out", "data=jsonl", f"data.path={path}", "regen.enabled=false")
    with pytest.raises(UserError, match="no usable conversation among 3 rows"):
        run(cfg)


def test_every_bad_row_is_named_past_the_examples(tmp_path):
    path = tmp_path / "many.jsonl"
    path.write_text("{broken\n" * 25 + '{"messages": [{"role": "user", "content": "ok?"}]}\n')
    problems = load_source(jsonl(path)).problems.to_dict()["invalid JSON"]
    assert problems["count"] == 25 and len(problems["examples"]) == 20
    assert problems["locations"] == [f"many.jsonl line {n}" for n in range(1, 26)]


def test_hf_source_reads_one_data_file(tmp_path):
    """A hub repo's single file (here a local ShareGPT-style JSON array) goes through `datasets`' json builder."""
    path = tmp_path / "ShareGPT_part.json"
    path.write_text(
        json.dumps(
            [
                {"id": "a", "conversations": [{"from": "human", "value": "Hi?"}]},
                {"id": "b", "conversations": [{"from": "robot", "value": "x"}]},
            ]
        )
    )
    data = load_source(SourceConfig("hf", str(path), None, "train", None, 0, None, 0.0))
    assert [c.messages for c in data.conversations] == [[{"role": "user", "content": "Hi?"}]]
    assert data.problems.to_dict()["unknown role"]["locations"] == [f"{path} row 1"]


# ---------------------------------------------------------------- whatever is wrong inside a row costs that row


def openai_row(prompt: str, call: dict | None = None) -> dict:
    reply = {"role": "assistant", "content": None, "tool_calls": [call]} if call else {"role": "assistant"}
    return {"messages": [{"role": "user", "content": prompt}, reply | ({} if call else {"content": "An answer."})]}


def test_surrogates_in_tool_calls_cost_their_row_only(tiny_qwen3_dir, tmp_path):
    """A lone surrogate in a call's arguments or id once reached the prompt fingerprint (UnicodeEncodeError)."""
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}
    bad_calls = [
        {**call, "function": {"name": "lookup", "arguments": {"q": "x\ud800"}}},  # in an object argument
        {**call, "function": {"name": "lookup", "arguments": '{"q": "\\ud800"}'}},  # escaped inside JSON text
        {**call, "id": "call_\udfff"},  # in the call's id
        {**call, "function": {"name": "look\ud800", "arguments": {}}},  # in the function name
    ]
    rows = [openai_row(f"Question {i}?") for i in range(3)] + [openai_row("Look it up.", c) for c in bad_calls]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # json.dumps writes "\ud800" escapes
    summary = run(
        stage_config(
            tiny_qwen3_dir,
            tmp_path / "out",
            "data=jsonl",
            f"data.path={path}",
            "regen.enabled=false",
            "tokenize.min_loss_tokens=1",
            "data.eval_fraction=0",
        )
    )
    dropped = summary["dropped"]["source"]
    assert list(dropped) == ["invalid Unicode"] and dropped["invalid Unicode"]["locations"] == [
        f"p.jsonl line {n}" for n in (4, 5, 6, 7)
    ]
    examples = dropped["invalid Unicode"]["examples"]
    assert examples[0].startswith("p.jsonl line 4: message 1 tool_calls[0].function.arguments.q: lone surrogate")
    assert examples[2].startswith("p.jsonl line 6: message 1 tool_calls[0].id: lone surrogate '\\udfff'")
    assert sorted(r["sample_id"] for r in read_rows(tmp_path / "out")) == [1, 2, 3]


HUGE = "9" * 5000  # over Python's 4,300-digit limit for int(): json.loads raises ValueError
DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError
# arguments as JSON text nested 150 deep: it parses, but deeper than any later step should have to walk
NESTED_ARGS = json.dumps(
    openai_row("Call it.", {"function": {"name": "f", "arguments": '{"a": ' * 150 + "1" + "}" * 150}})
)


@pytest.mark.parametrize("form", ["jsonl", "sharegpt"])
def test_huge_numbers_and_deep_nesting_cost_their_row_only(tmp_path, form):
    good = [json.dumps(openai_row(f"Question {i}?")) for i in range(3)]
    bad = [
        ("unreadable row", '{"messages": [{"role": "user", "content": "n"}], "n": ' + HUGE + "}"),
        ("unreadable row", '{"messages": [{"role": "user", "content": ' + HUGE + "}]}"),
        ("nested too deeply", '{"messages": ' + DEEP + "}"),
        ("nested too deeply", NESTED_ARGS),
        # a call's arguments as JSON text too deep to parse: that parse fails inside the row
        (
            "malformed tool call",
            json.dumps(openai_row("Call it.", {"function": {"name": "f", "arguments": "[" * 3000}})),
        ),
    ]
    items = [good[0], *(text for _, text in bad), good[1], good[2]]
    if form == "jsonl":
        path = tmp_path / "p.jsonl"
        path.write_text("\n".join(items) + "\n")
        data = load_source(jsonl(path))
        first = 1
    else:
        path = tmp_path / "p.json"
        path.write_text("[" + ",\n".join(items) + "]")
        data = load_source(SourceConfig("sharegpt", str(path), None, "train", None, 0, None, 0.0))
        first = 0
    assert data.rows == len(items)
    assert [c.sample_id for c in data.conversations] == [first, first + 6, first + 7]
    assert data.problems.counts() == dict(Counter(reason for reason, _ in bad))
    examples = {r: p["examples"] for r, p in data.problems.to_dict().items()}
    assert "4300" in examples["unreadable row"][0] and "limit" in examples["unreadable row"][0]
    assert "deeper than 100 levels" in examples["nested too deeply"][1]


def test_truncated_gzip_keeps_the_rows_before_the_damage_and_a_corrupt_one_is_refused(tmp_path):
    lines = [json.dumps(openai_row(f"Question {i} " + "word " * (i % 50))) for i in range(3000)]
    whole = gzip.compress(("\n".join(lines) + "\n").encode())
    path = tmp_path / "p.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    data = load_source(jsonl(path))
    kept = [c.sample_id for c in data.conversations]
    assert 1000 < len(kept) < 3000 and kept == list(range(1, len(kept) + 1))  # every row before the damage
    damage = data.problems.to_dict()["damaged file"]
    assert damage["locations"] == [f"p.jsonl.gz line {len(kept) + 1}"]  # the line the cut goes through
    assert f"unread from line {len(kept) + 1} on" in damage["examples"][0] and "cut short" in damage["examples"][0]
    assert data.problems.counts() == {"damaged file": 1}
    # Bytes changed in the middle: the checksum at the end disagrees, so no row read before it can be trusted.
    path.write_bytes(whole[: len(whole) // 2] + b"\0" * 16 + whole[len(whole) // 2 + 16 :])
    with pytest.raises(UserError, match="checksum does not match: no row of it can be trusted"):
        load_source(jsonl(path))


@pytest.mark.parametrize(
    "source, name, content, message",
    [
        ("jsonl", "plain.jsonl.gz", b'{"messages": []}\n', "cannot read the file \\(it is not gzip-compressed"),
        (
            "jsonl",
            "cut.jsonl.gz",
            gzip.compress(b"x" * 100, mtime=0)[:15],
            "cannot read the file: EOFError: .* cut short",
        ),
        ("sharegpt", "missing.json", None, "no such JSON file"),
        ("sharegpt", "a_dir", "dir", "no such JSON file"),
    ],
)
def test_a_file_that_cannot_be_read_is_one_user_error(tiny_qwen3_dir, tmp_path, source, name, content, message):
    path = tmp_path / name
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    cfg = stage_config(tiny_qwen3_dir, tmp_path / "out", f"data={source}", f"data.path={path}", "regen.enabled=false")
    with pytest.raises(UserError, match=f"data.path='{path}': {message}"):
        run(cfg)


def test_a_damaged_tokenized_split_is_one_dataset_error(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"sample_id": 0, "input_ids": [1], "loss_mask": [1]}\n' + DEEP + "\n")
    with pytest.raises(DatasetError, match=r"train\.jsonl:2: not valid JSON: maximum recursion depth"):
        read_split(tmp_path, "train", max_tokens=8, vocab_size=10)
    (tmp_path / "summary.json").write_text('{"target": {"tokenizer_sha256": ' + HUGE + "}}")
    with pytest.raises(DatasetError, match="no target.tokenizer_sha256 recorded"):
        check_tokenizer(tmp_path, "abc", "t")
