"""Bad input costs only itself: a corpus of broken rows among good ones (tests/data/bad_rows.jsonl),
an empty file, a missing file, and a lone surrogate, through the real stage entry point."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_data import REPO, read_rows, stage_config

from dspark.errors import UserError
from extract.data.__main__ import run
from extract.data.config import SourceConfig
from extract.data.sources import load_source

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
