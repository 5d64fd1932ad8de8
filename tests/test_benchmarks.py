"""The standard eval sets: GSM8K, HumanEval and MT-Bench read from their PyPI packages, the
`data=benchmarks` preset, and τ per benchmark in the evaluation report, card and headline."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from eval_fixtures import CONF_DIR, build_setup, compose_cfg, configs, make_samples, write_store
from hydra import compose, initialize_config_dir

from dspark.config import load_section
from dspark.eval.__main__ import headline, run
from dspark.eval.card import CARD_FILE, fmt
from dspark.eval.evaluate import load_checked
from dspark.eval.offline import evaluate_blocks, held_out_refs, pick_device
from dspark.eval.online import load_prompts
from dspark.extract.data.config import SourceConfig
from dspark.extract.data.mix import ID_STRIDE, load_and_select
from dspark.extract.data.sources import load_source

BENCHMARKS = ("mtbench", "gsm8k", "humaneval")


def source_cfg(name: str) -> SourceConfig:
    return SourceConfig(name, None, None, "train", None, 0, None, 1.0)


@pytest.mark.parametrize(
    ("name", "rows", "first_id", "first_text", "turns"),
    [
        ("gsm8k", 1319, 0, "Janet\u2019s ducks lay 16 eggs per day.", 1),
        ("humaneval", 164, 0, "from typing import List\n\n\ndef has_close_elements(", 1),
        ("mtbench", 80, 81, "Compose an engaging travel blog post about a recent trip to Hawaii", 2),
    ],
)
def test_embedded_benchmark_rows(name, rows, first_id, first_text, turns):
    data = load_source(source_cfg(name))
    assert data.name == name and data.rows == rows and len(data.conversations) == rows
    assert not data.problems.to_dict()
    ids = [c.sample_id for c in data.conversations]
    assert ids[0] == first_id and ids == list(range(first_id, first_id + rows))  # the benchmark's own numbering
    first = data.conversations[0]
    assert first.source == name and first.messages[0]["content"].startswith(first_text)
    assert all(len(c.messages) == turns and {m["role"] for m in c.messages} == {"user"} for c in data.conversations)


def test_benchmarks_preset_is_held_out_in_its_own_dir():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        bench = compose("data", overrides=["data=benchmarks"])
        default = compose("data")
    assert bench.paths.data_dir == bench.paths.bench_data_dir != default.paths.data_dir
    assert default.paths.data_dir == f"{default.paths.root}/data"
    cfg = load_section(SourceConfig, bench, "data")
    assert cfg.eval_fraction == 1.0
    _, selected, parts = load_and_select(cfg)
    assert [p["selected"] for p in parts] == [16, 16, 16] and not any(p["duplicates"] for p in parts)
    for index, name in enumerate(BENCHMARKS):
        mine = [c for c in selected if c.source == name]
        assert len(mine) == 16 and all(c.sample_id // ID_STRIDE == index for c in mine)


def write_bench_data(data_dir: Path, samples) -> list[str]:
    """eval.jsonl of the benchmark set (sources in turn, mix-style ids, as the data stage writes); their sources."""
    data_dir.mkdir(parents=True, exist_ok=True)
    sources = [BENCHMARKS[i % 3] for i in range(len(samples))]
    with (data_dir / "eval.jsonl").open("w") as f:
        for i, ((ids, mask), source) in enumerate(zip(samples, sources)):
            row = {"sample_id": i, "source": source, "split": "eval", "input_ids": ids.tolist()}
            f.write(json.dumps(row | {"loss_mask": mask.tolist()}) + "\n")
    return sources


def naive_tau(alpha: np.ndarray, mask: np.ndarray) -> float:
    """Mean over blocks of 1 + Σ_k Π_{j≤k} α_j, over each block's scored slots."""
    taus = []
    for a, m in zip(alpha, mask):
        running, tau = 1.0, 1.0
        for k in range(int(m.sum())):
            running *= a[k]
            tau += running
        taus.append(tau)
    return float(np.mean(taus))


@pytest.mark.slow  # ~30 s or more on 2 cores: make test, not make test-fast
def test_eval_reports_tau_per_benchmark(tmp_path):
    setup = build_setup(tmp_path)
    samples = make_samples(9, seed=11)
    bench_data = tmp_path / "bench-data"
    bench_store = tmp_path / "bench-store" / "eval"  # where paths.bench_store_dir puts it (paths.root=tmp_path)
    write_store(bench_store, setup.verifier_dir, samples, extra_attrs={"split": "eval"})
    sources = write_bench_data(bench_data, samples)

    cfg = compose_cfg(setup)
    target, eval_cfg, heldout = configs(cfg)
    assert Path(eval_cfg.bench_store) == bench_store and Path(eval_cfg.bench_data_dir) == bench_data
    report = run(cfg)

    # independent: the blocks of the benchmark store, grouped by hand, τ by a plain loop
    draft, verifier, store, _ = load_checked(setup.drafter, target, str(bench_store))
    table = evaluate_blocks(
        draft, verifier, store, held_out_refs(store, None), heldout, pick_device(eval_cfg.offline.device)
    )
    bench = report["benchmarks"]
    assert list(bench["by_benchmark"]) == list(BENCHMARKS) and bench["samples"] == 9
    for name in BENCHMARKS:
        rows = np.isin(table.sample_id, [i for i, s in enumerate(sources) if s == name])
        got = bench["by_benchmark"][name]
        assert got["blocks"] == int(rows.sum()) > 0
        assert got["tau"] == pytest.approx(naive_tau(table.alpha[rows], table.slot_mask[rows]))
        assert 1.0 < got["tau"] < 5.0
    assert bench["overall"]["tau"] == pytest.approx(naive_tau(table.alpha, table.slot_mask))
    assert report["offline"]["samples"] == 8  # the held-out store of the training data is evaluated as before

    card = (setup.drafter / CARD_FILE).read_text()
    assert "## Acceptance per benchmark (offline)" in card
    assert "| figure | MT-Bench | GSM8K | HumanEval | all |" in card
    taus = [bench["by_benchmark"][n]["tau"] for n in BENCHMARKS] + [bench["overall"]["tau"]]
    assert "| τ | " + " | ".join(fmt(t) for t in taus) + " |" in card
    on_disk = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert on_disk["benchmarks"]["by_benchmark"]["gsm8k"]["tau"] == pytest.approx(bench["by_benchmark"]["gsm8k"]["tau"])
    line = next(x for x in headline(report).splitlines() if "per benchmark" in x)
    assert all(
        f"{name} {bench['by_benchmark'][key]['tau']:.3f}" in line
        for key, name in zip(BENCHMARKS, ("MT-Bench", "GSM8K", "HumanEval"))
    )


@pytest.mark.slow  # ~30 s or more on 2 cores: make test, not make test-fast
def test_eval_without_benchmark_store(tmp_path):
    setup = build_setup(tmp_path, n_samples=4)
    report = run(compose_cfg(setup, "eval.calibration.enabled=false"))
    assert report["benchmarks"] is None and "per benchmark" not in headline(report)
    assert "per benchmark" not in (setup.drafter / CARD_FILE).read_text()


def test_online_prompts_from_the_benchmark_set(tmp_path):
    samples = [(np.arange(10, 10 + n), np.array([0] * p + [1] * (n - p))) for n, p in [(8, 3), (8, 4), (8, 5), (8, 6)]]
    sources = write_bench_data(tmp_path, samples)
    assert sources == ["mtbench", "gsm8k", "humaneval", "mtbench"]
    # tokenized rows give their prompt (tokens before the first trained one), one benchmark after the other
    prompts = load_prompts(str(tmp_path / "eval.jsonl"), "unused", num_prompts=3, max_prompt_tokens=64)
    assert prompts == [[10, 11, 12], [10, 11, 12, 13], [10, 11, 12, 13, 14]]
    assert load_prompts(None, tmp_path, num_prompts=4, max_prompt_tokens=64)[3] == list(range(10, 16))
