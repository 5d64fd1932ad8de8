"""The model card shows the report's figures and nothing else."""

from __future__ import annotations

import json
import re

import pytest
from eval_fixtures import build_setup, compose_cfg

from dspark.eval.__main__ import run
from dspark.eval.card import fmt, render_card
from dspark.eval.report import read_report, write_report

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]\d+)?")

ONLINE = {
    "device": "cuda",
    "vllm_version": "0.32.0",
    "prompts": 16,
    "max_tokens": 256,
    "concurrency": 1,
    "skipped": None,
    "runs": [
        {
            "name": "baseline",
            "speculative_config": None,
            "tokens_per_s": 101.25,
            "requests": 16,
            "output_tokens": 4096,
            "seconds": 40.45,
            "mean_latency_s": 2.53,
            "server_generation_tokens": 4096,
        },
        {
            "name": "dspark k=4",
            "speculative_config": {"method": "dspark", "num_speculative_tokens": 4},
            "tokens_per_s": 263.5,
            "speedup": 2.6024691358,
            "acceptance_length": 3.4117,
            "drafts": 1200,
            "per_position_acceptance": [0.9125, 0.75, 0.5, 0.2492],
            "requests": 16,
            "output_tokens": 4096,
            "seconds": 15.54,
            "mean_latency_s": 0.97,
            "server_generation_tokens": 4096,
        },
    ],
}


def numeric_leaves(obj):
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, (int, float)):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from numeric_leaves(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from numeric_leaves(v)


def table_rows(card: str) -> list[list[str]]:
    rows = []
    for line in card.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


@pytest.fixture(scope="module")
def report_and_card(tmp_path_factory):
    setup = build_setup(tmp_path_factory.mktemp("card"))
    report = run(compose_cfg(setup))
    report["online"] = ONLINE
    report = read_report(write_report(report, setup.root / "eval"))  # as the stage does: card from the file
    return report, render_card(report), setup


def test_every_number_in_the_tables_is_a_report_figure(report_and_card):
    report, card, _ = report_and_card
    figures = {fmt(v) for v in numeric_leaves(report)}
    checked = 0
    for row in table_rows(card)[1:]:
        for cell in row[1:]:  # the first column labels the row
            if NUMBER.fullmatch(cell):
                assert cell in figures, f"card shows {cell!r}, which is no figure of report.json"
                checked += 1
    assert checked > 40


def test_card_figures_match_their_report_fields(report_and_card):
    report, card, _ = report_and_card
    rows = {r[0]: r[1:] for r in table_rows(card)}
    off = report["offline"]["overall"]
    assert rows["τ"] == [fmt(off["tau"])]
    assert rows["blocks"] == [fmt(off["blocks"])]
    # per-position table: position | cumulative | conditional
    per_pos = [r for r in table_rows(card) if r[0].isdigit() and len(r) == 3]
    assert [r[1:] for r in per_pos[:4]] == [[fmt(c), fmt(a)] for c, a in zip(off["cumulative"], off["conditional"])]
    cal = report["calibration"]
    cal_rows = [r for r in table_rows(card) if len(r) == 9 and r[0] != "position"]
    assert [float(r[1]) for r in cal_rows[:4]] == pytest.approx(cal["temperatures"], abs=5e-4)
    assert cal_rows[-1][2:4] == [fmt(cal["before"]["pooled"]["ece"]), fmt(cal["after"]["pooled"]["ece"])]
    ceilings = [p["auroc_ceiling"] for p in cal["before"]["per_position"]] + [cal["before"]["pooled"]["auroc_ceiling"]]
    assert [r[6] for r in cal_rows] == [fmt(c) for c in ceilings]
    assert rows["dspark k=4"] == [fmt(263.5), fmt(2.6024691358), fmt(3.4117)]
    assert rows["baseline"] == [fmt(101.25), "not recorded", "not recorded"]
    assert rows["steps"] == [fmt(report["training"]["steps"])] and rows["world_size"] == ["2"]
    assert rows["train_time_s"] == ["not recorded"]  # absent from the run: said so, never invented
    assert rows["eval.samples"] == [fmt(report["data"]["splits"]["eval"]["samples"])]
    assert rows["regeneration.temperature"] == [fmt(0.7)]
    assert f"fitted on {fmt(cal['fit_samples'])} held-out samples" in card
    served = cal["served"]
    assert f"slope {fmt(served['slope'])}, intercept {fmt(served['intercept'])}" in card
    assert f"scored samples: {fmt(served['pooled']['ece'])} (raw {fmt(cal['before']['pooled']['ece'])}" in card
    assert f"as served, it spares {fmt(served['budget']['confidence']['saved'])} of the drafts" in card
    # the tiny report's 4 fit samples are too few to cross-validate a refit: the card says so
    assert "no correction (a refit of the head was tried: too few conversations to cross-validate)" in card
    assert "AUROC per position " + " / ".join(fmt(p["auroc"]) for p in served["per_position"]) + "." in card
    assert "16 prompts, 256 greedy tokens each" in card


def test_card_usage_and_file(report_and_card):
    report, card, setup = report_and_card
    drafter = report["drafter"]
    assert "vllm serve <this directory>\n" in card
    spec = json.loads(re.search(r"--speculative-config '(.*)'", card).group(1))
    assert spec == {"method": "dspark", "model": "<this directory>", "num_speculative_tokens": 4}
    # no absolute path of the machine that made the drafter: the verifier by hub id or a placeholder
    assert drafter["path"] not in card and not re.search(r"(^|[\s`|(])/(tmp|home|root|work)/", card, re.M)
    verifier = drafter["verifier"]
    assert f"vllm serve {verifier if not verifier.startswith('/') else '<path to verifier>'} --spec" in card
    # the stage wrote the same card (without the online section added here) into the drafter dir
    written = (setup.drafter / "README.md").read_text()
    assert written.split("## Acceptance")[0] == card.split("## Acceptance")[0]
