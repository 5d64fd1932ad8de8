"""The dataset directory switches as one unit (a real SIGKILL between its file writes leaves
the old dataset whole), and mixed sources (weights, cross-source dedup, recorded sources)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from test_data import REPO, read_rows, sharegpt, stage_config, write_lines

from dspark.extract.data.__main__ import run
from dspark.extract.data.config import MixPart
from dspark.extract.data.mix import ID_STRIDE, _quotas
from dspark.extract.data.output import FILES
from dspark.extract.data.split import prompt_fingerprint

# Runs the stage, SIGKILLing itself when the new generation's summary.json is about to be
# written (train.jsonl, eval.jsonl and token_freqs.npy of the new set are already on disk).
KILL_AT_SUMMARY = """
import os, signal, sys
import dspark.extract.data.output as output
from dspark.extract.data.__main__ import main
real = output.write_file
def write_file(path, chunks):
    if path.name == "summary.json":
        os.kill(os.getpid(), signal.SIGKILL)
    real(path, chunks)
output.write_file = write_file
sys.argv = ["extract.data", *sys.argv[1:]]
main()
"""


def digests(data_dir: Path) -> dict[str, str]:
    return {f: hashlib.sha256((data_dir / f).read_bytes()).hexdigest() for f in FILES}


def prompts(path: Path, tag: str, n: int) -> Path:
    return write_lines(path, [sharegpt(f"{tag} question {i}?", f"{tag} answer {i} " + "word " * 6) for i in range(n)])


def test_killed_between_file_writes_leaves_the_old_dataset_whole(tiny_qwen3_dir, tmp_path):
    out = tmp_path / "data"
    out.mkdir()
    for f in FILES:  # a dataset of plain files, as older versions wrote it
        (out / f).write_text("old layout")
    args = ["regen.enabled=false", "tokenize.min_loss_tokens=1", "data.eval_fraction=0.2", "data=jsonl"]
    run(stage_config(tiny_qwen3_dir, out, *args, f"data.path={prompts(tmp_path / 'a.jsonl', 'A', 10)}"))
    before = digests(out)
    assert all((out / f).is_symlink() for f in FILES) and len(list((out / ".generations").iterdir())) == 1

    second = [f"data.path={prompts(tmp_path / 'b.jsonl', 'B', 12)}"]
    cli = [
        sys.executable,
        "-c",
        KILL_AT_SUMMARY,
        "target=qwen3-0.6b",
        f"target.name_or_path={tiny_qwen3_dir}",
        "target.aux_layer_ids=null",
        "target.max_model_len=1024",
        f"paths.data_dir={out}",
        *args,
        *second,
    ]
    proc = subprocess.run(cli, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    (partial,) = (out / ".generations").glob("*.partial")  # the new set was half written...
    assert {p.name for p in partial.iterdir()} == {"train.jsonl", "eval.jsonl", "token_freqs.npy"}
    assert digests(out) == before  # ...and nothing of it is visible
    assert {r["sample_id"] for r in read_rows(out)} == set(range(1, 11))

    summary = run(stage_config(tiny_qwen3_dir, out, *args, *second))  # the rerun switches to the new set
    assert json.loads((out / "summary.json").read_text()) == summary
    assert {r["sample_id"] for r in read_rows(out)} == set(range(1, 13))
    assert all(digests(out)[f] != before[f] for f in FILES)
    assert [p.name for p in (out / ".generations").iterdir()] == [os.readlink(out / "current").split("/")[-1]]


def test_quotas_follow_weights_with_largest_remainder():
    parts = [MixPart("jsonl", "a", weight=2), MixPart("jsonl", "b", weight=1), MixPart("jsonl", "c", weight=1)]
    assert _quotas(parts, 20) == [10, 5, 5]
    assert _quotas(parts, 7) == [3, 2, 2]  # 3.5, 1.75, 1.75
    assert _quotas([MixPart("mtbench", samples=4), MixPart("sharegpt", samples=9)], None) == [4, 9]


def test_mix_of_three_sources_counts_dedup_and_splits(tiny_qwen3_dir, tmp_path):
    a = prompts(tmp_path / "a.jsonl", "A", 30)
    # b repeats 6 of a's prompts (re-spaced and re-cased: same fingerprint), c repeats 4 of b's
    b = write_lines(
        tmp_path / "b.jsonl",
        [sharegpt(f"  a QUESTION {i}? ", "dup " * 8) for i in range(6)]
        + [sharegpt(f"B question {i}?", "B answer " + "word " * 6) for i in range(24)],
    )
    c = write_lines(
        tmp_path / "c.jsonl",
        [sharegpt(f"b question {i}?", "dup " * 8) for i in range(4)]
        + [sharegpt(f"C question {i}?", "C answer " + "word " * 6) for i in range(26)],
    )
    sources = (
        f"[{{source: jsonl, path: '{a}', weight: 2}}, {{source: jsonl, path: '{b}', weight: 1}}, "
        f"{{source: jsonl, path: '{c}', weight: 1}}]"
    )
    out = tmp_path / "out"
    summary = run(
        stage_config(
            tiny_qwen3_dir,
            out,
            "data=mix",
            f"data.sources={sources}",
            "data.max_samples=40",
            "data.max_turns=1",
            "data.eval_fraction=0.25",
            "regen.enabled=false",
            "tokenize.min_loss_tokens=1",
        )
    )
    parts = summary["source"]["sources"]
    assert [(p["name"], p["requested"], p["selected"], p["duplicates"]) for p in parts] == [
        ("jsonl:a.jsonl", 20, 20, 0),
        ("jsonl:b.jsonl", 10, 10, 6),
        ("jsonl:c.jsonl", 10, 10, 4),
    ]
    assert summary["dropped"]["source"]["duplicate prompt across sources"]["count"] == 10
    rows = read_rows(out)
    assert len(rows) == 40
    by_source = {}
    for row in rows:
        by_source.setdefault(row["source"], []).append(row["sample_id"])
    assert {s: len(ids) for s, ids in by_source.items()} == {
        "jsonl:a.jsonl": 20,
        "jsonl:b.jsonl": 10,
        "jsonl:c.jsonl": 10,
    }
    for index, name in enumerate(["jsonl:a.jsonl", "jsonl:b.jsonl", "jsonl:c.jsonl"]):
        assert all(i // ID_STRIDE == index for i in by_source[name])
    files = {0: a, 1: b, 2: c}
    split_of: dict[str, set[str]] = {}
    for row in rows:
        line = files[row["sample_id"] // ID_STRIDE].read_text().splitlines()[row["sample_id"] % ID_STRIDE - 1]
        messages = [{"role": "user", "content": json.loads(line)["conversations"][0]["value"]}]
        split_of.setdefault(prompt_fingerprint(messages), set()).add(row["split"])
    assert len(split_of) == 40 and all(len(s) == 1 for s in split_of.values())  # no prompt twice, none in two splits
    assert summary["splits"]["eval"]["samples"] == 10
