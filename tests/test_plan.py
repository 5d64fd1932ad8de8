"""`make plan` / `extract.dry_run`: the estimated store bytes against a store written the way
extraction writes it, on the embedded SmolLM2 with real prompts (bf16) and on a tiny Qwen3
(fp8); the printed plan, the refusal of a run that cannot fit, and the entry points."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from bench.bench_store import mtbench_prompts
from dspark.errors import UserError
from dspark.extract.client import Row, ShardWriter
from dspark.extract.config import STORE_DTYPES
from dspark.extract.plan import _inputs, before_extraction, hf_states, make_plan, shard_count
from dspark.store import ShardStore, StoreWriter
from dspark.targets import resolve_target_dir, tokenizer_sha256

REPO = Path(__file__).resolve().parents[1]


def write_dataset(data_dir: Path, model_dir: Path, rows: list[Row]) -> Path:
    data_dir.mkdir(parents=True)
    lines = [json.dumps({"sample_id": r.sample_id, "input_ids": r.input_ids, "loss_mask": r.loss_mask}) for r in rows]
    (data_dir / "train.jsonl").write_text("\n".join(lines) + "\n")
    (data_dir / "summary.json").write_text(json.dumps({"target": {"tokenizer_sha256": tokenizer_sha256(model_dir)}}))
    return data_dir


def chat_rows(model_dir: Path, n: int) -> list[Row]:
    """MT-Bench first turns in the verifier's chat template, with a short reply to train on."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for i, question in enumerate(mtbench_prompts()[:n]):
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        ids = tok.apply_chat_template(
            [{"role": "user", "content": question}, {"role": "assistant", "content": "Sure. " + question[::-1][:80]}]
        )
        prompt, ids = list(getattr(prompt, "input_ids", prompt)), list(getattr(ids, "input_ids", ids))
        rows.append(Row(i, ids, [0] * len(prompt) + [1] * (len(ids) - len(prompt))))
    return rows


def extract_config(root: Path, data_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose(
            "extract",
            overrides=[f"paths.root={root}", f"extract.data_dir={data_dir}", "extract.splits=[train]", *overrides],
        )


def write_like_extraction(target, ex, rows: list[Row]) -> int:
    """Store `rows`' states through the extraction's own writer; returns the store's bytes on disk."""
    url = f"{ex.store_dir}/train"
    store = StoreWriter.create_or_open(
        url, target.store_attrs(STORE_DTYPES[ex.store_dtype]), target.tokenizer_sha256, extra_attrs={"split": "train"}
    )
    writer = ShardWriter(store, shard_samples=ex.shard_samples, shard_tokens=ex.shard_tokens)

    async def feed() -> None:
        for sample in hf_states(target.model_dir, target.layer_ids, rows, target.config.dtype):
            await writer.add(sample)
        await writer.flush()

    asyncio.run(feed())
    return sum(f.stat().st_size for f in Path(url).rglob("*") if f.is_file())


def check_estimate(cfg, rows: list[Row]) -> ShardStore:
    """The plan's estimate against the store then written; returns that store."""
    target, ex, scale, plan_cfg = _inputs(cfg)
    plan = make_plan(target, ex, scale, plan_cfg)
    assert plan.probe is not None and plan.probe.samples < len(rows)  # measured on a part only
    assert plan.todo_tokens == sum(len(r.input_ids) for r in rows)
    written = write_like_extraction(target, ex, rows)
    assert abs(plan.store_bytes / written - 1) < 0.05, (plan.store_bytes, written, plan.format())
    print(
        f"\n[plan] {target.name_or_path} {ex.store_dtype}: estimated {plan.store_bytes:,} B, "
        f"written {written:,} B ({plan.store_bytes / written - 1:+.2%})"
    )
    # A rerun extracts (and needs room for) nothing more.
    assert make_plan(target, ex, scale, plan_cfg).todo_tokens == 0
    return ShardStore.open(f"{ex.store_dir}/train")


@pytest.mark.slow  # ~30 s or more on 2 cores: make test, not make test-fast
def test_estimate_within_5_percent_on_smollm2_chat(tmp_path):
    model_dir = resolve_target_dir("embedded:smollm2")
    rows = chat_rows(model_dir, 24)
    data = write_dataset(tmp_path / "data", model_dir, rows)
    check_estimate(extract_config(tmp_path, data, "extract.shard_samples=6", "plan.probe_samples=5"), rows)


@pytest.mark.slow  # ~30 s or more on 2 cores: make test, not make test-fast
def test_estimate_within_5_percent_on_tiny_qwen3_fp8(tmp_path, tiny_qwen3_dir):
    import random

    rng = random.Random(0)
    rows = [Row(i, [rng.randrange(151_000) for _ in range(t)], [1] * t) for i, t in enumerate(range(40, 400, 12))]
    data = write_dataset(tmp_path / "data", tiny_qwen3_dir, rows)
    cfg = extract_config(
        tmp_path,
        data,
        "target.name=tiny",
        f"target.name_or_path={tiny_qwen3_dir}",
        "target.aux_layer_ids=[1,2]",
        "target.max_model_len=512",
        "target.dtype=float32",
        "extract.store_dtype=fp8",
        "extract.shard_tokens=2000",
        "plan.probe_samples=5",
    )
    store = check_estimate(cfg, rows)
    assert store.target["dtype"] == "float8_e4m3fn" and store.attrs["format_version"] == 2


@pytest.mark.slow  # ~30 s or more on 2 cores: make test, not make test-fast
def test_dry_run_refusal_and_shard_count(tmp_path, tiny_qwen3_dir, capsys):
    rows = [Row(i, list(range(100, 100 + t)), [1] * t) for i, t in enumerate((30, 50, 70, 90))]
    data = write_dataset(tmp_path / "data", tiny_qwen3_dir, rows)
    tiny = (
        "target.name=tiny",
        f"target.name_or_path={tiny_qwen3_dir}",
        "target.aux_layer_ids=[1,2]",
        "target.max_model_len=512",
        "target.dtype=float32",
    )
    cfg = extract_config(tmp_path, data, *tiny, "extract.dry_run=true", "plan.tokens_per_s=12")
    assert before_extraction(cfg) is True  # printed, and the stage stops there
    out = capsys.readouterr().out
    assert "4 samples, 240 tokens" in out and "store bytes: ~" in out and "free space at" in out
    assert "wall time: ~20 s at 12 tokens/s (stated: plan.tokens_per_s)" in out
    assert not (tmp_path / "store").exists()  # nothing written

    plan = make_plan(*_inputs(cfg))
    with pytest.raises(UserError, match=r"(?s)extract.space_check=false .*\n.*4 samples, 240 tokens"):
        replace(plan, free_bytes=plan.store_bytes - 1).refuse_if_full()
    replace(plan, free_bytes=plan.store_bytes).refuse_if_full()
    assert before_extraction(extract_config(tmp_path, data, *tiny)) is False  # fits: extraction goes on
    # Shards as the extraction's writers cut them: per server, on `shard_samples` or `shard_tokens`.
    assert shard_count([10] * 10, 4, 1000, 1) == 3 and shard_count([10] * 10, 4, 1000, 2) == 4
    assert shard_count([60, 60, 10], 100, 50, 1) == 3

    # The entry points, as a user runs them: `make plan` and `make extract ARGS=extract.dry_run=true`.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    args = [f"paths.root={tmp_path}", f"extract.data_dir={data}", "extract.splits=[train]", *tiny]
    for module, extra in (("extract.plan", []), ("extract", ["extract.dry_run=true"])):
        proc = subprocess.run(
            [sys.executable, "-m", module, *args, *extra],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0 and "store bytes: ~" in proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / "store").exists()
