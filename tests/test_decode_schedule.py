"""The decode-schedule bench: the cost models that pin a fixed budget or trace the budget rule, its paired
figures against a hand computation, and the bench end to end on the tiny eval setup."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from eval_fixtures import build_setup, compose_cfg, configs, setup_overrides

from bench.ablate_record import file_fingerprint, store_fingerprint
from bench.decode_schedule import (
    best_within,
    fixed_costs,
    fixed_frontier,
    linear_costs,
    schedule_figures,
    versus_full,
)
from dspark.eval.evaluate import split_samples

B = 4


@pytest.mark.parametrize("k", range(1, B))
def test_fixed_costs_pin_the_budget_whatever_the_confidence(k):
    conf = np.random.default_rng(k).uniform(1e-4, 1.0, size=(64, B))
    conf[0] = 1.0  # the first step's stale confidences
    assert fixed_costs(k, B).budget(conf).tolist() == [k] * 64


def test_linear_costs_send_fewer_drafts_as_verifying_costs_more():
    conf = np.random.default_rng(0).uniform(0.05, 0.95, size=(256, B))
    budgets = [linear_costs(r, B).budget(conf) for r in (1e-6, 0.01, 0.05, 0.2, 1.0, 100.0)]
    assert budgets[0].tolist() == [B] * 256  # verifying is all but free: the whole block
    assert budgets[-1].tolist() == [0] * 256  # each verified token costs 100x the step: no draft is worth it
    for cheaper, dearer in zip(budgets, budgets[1:]):
        assert (dearer <= cheaper).all()
    assert len({int(b.sum()) for b in budgets}) == len(budgets)  # each slope moves the schedule
    # one row by hand, slope 0.2: expected tokens 1, 1.5, 1.75, 1.875, 1.9375 over costs 1.2 + 0.2k
    half = np.full((1, B), 0.5)
    ratios = [(1 + sum(0.5 ** (j + 1) for j in range(k))) / (1 + 0.2 * (1 + k)) for k in range(B + 1)]
    assert linear_costs(0.2, B).budget(half).tolist() == [int(np.argmax(ratios))]


def test_versus_full_by_hand():
    # per prompt: verifier steps, tokens produced, drafts sent
    full = np.array([[10, 20, 40], [20, 30, 80]], float)
    half = np.array([[12, 20, 20], [25, 30, 40]], float)
    one = np.array([[16, 20, 16], [30, 30, 30]], float)
    head = np.array([[11, 20, 30], [22, 30, 60]], float)
    table = versus_full({"fixed_4": full, "fixed_2": half, "fixed_1": one, "head_r1": head}, "fixed_4", seed=0)
    al_full, al_half, al_head = 50 / 30, 50 / 37, 50 / 33
    assert table["fixed_4"]["acceptance_length"]["mean"] == pytest.approx(al_full)
    assert table["fixed_4"]["acceptance_length_loss"] == {"mean": 0.0, "se": 0.0}
    assert table["fixed_2"]["acceptance_length"]["mean"] == pytest.approx(al_half)
    assert table["fixed_2"]["drafts_per_step"]["mean"] == pytest.approx(60 / 37)
    assert table["fixed_2"]["acceptance_length_loss"]["mean"] == pytest.approx(1 - al_half / al_full)
    assert table["fixed_2"]["drafts_spared"]["mean"] == pytest.approx(0.5)
    assert table["fixed_2"]["drafts_spared"]["se"] == pytest.approx(0.0, abs=1e-12)  # every resample: half
    assert table["fixed_2"]["acceptance_length_loss"]["se"] > 0
    assert "lead_at_equal_loss" not in table["fixed_2"]
    # the head loses 1 - 30/33 and spares 1/4; the fixed curve runs from (0, 0) to (1 - 30/37, 1/2)
    loss = 1 - al_head / al_full
    assert table["head_r1"]["acceptance_length_loss"]["mean"] == pytest.approx(loss)
    want = 0.25 - 0.5 * loss / (1 - al_half / al_full)
    assert table["head_r1"]["lead_at_equal_loss"]["mean"] == pytest.approx(want)


def test_best_within_spares_the_most_inside_the_loss_bound():
    def row(loss, spared):
        return {"acceptance_length_loss": {"mean": loss}, "drafts_spared": {"mean": spared}}

    table = {"a": row(0.0, 0.0), "b": row(0.008, 0.3), "c": row(0.02, 0.6), "d": row(0.01, 0.25)}
    assert best_within(table, list(table), 0.01) == "b"
    assert best_within(table, ["c"], 0.01) is None


def test_fixed_frontier_is_the_upper_hull():
    # (loss, spared): the full block, three budgets; (0.02, 0.3) lies under the segment (0.01, 0.25)-(0.05, 0.7)
    # and (0.0, 0.1) ties the full block's loss with more spared
    points = [(0.0, 0.0), (0.0, 0.1), (0.01, 0.25), (0.02, 0.3), (0.05, 0.7)]
    assert fixed_frontier(points).tolist() == [[0.0, 0.1], [0.01, 0.25], [0.05, 0.7]]


MAX_NEW = 12
SLOPES = (0.001, 0.05, 10.0)
REPO = Path(__file__).resolve().parents[1]
# the bench in a process of its own, so that it can be killed
CHILD = (
    "import json, sys; from pathlib import Path; from bench.decode_schedule import schedule_figures; "
    "a = json.loads(sys.argv[1]); schedule_figures(a['drafter'], a['overrides'], 2, a['max_new'], a['slopes'], "
    "Path(a['partial']))"
)


@pytest.fixture(scope="module")
def decoded(tmp_path_factory):
    """The bench end to end on the tiny eval setup: calibrate, split, decode under every schedule."""
    setup = build_setup(tmp_path_factory.mktemp("decode_schedule"))
    figures = schedule_figures(str(setup.drafter), setup_overrides(setup), 2, MAX_NEW, SLOPES)
    return setup, figures


def scored_rows(setup) -> list[dict]:
    """eval.jsonl's rows outside the fit half the served head was calibrated on, split here by hand."""
    rows = [json.loads(line) for line in (setup.data_dir / "eval.jsonl").read_text().splitlines()]
    _, eval_cfg, heldout = configs(compose_cfg(setup))
    fit, scored = split_samples(
        np.array([r["sample_id"] for r in rows]), eval_cfg.calibration.fit_fraction, heldout.seed
    )
    assert len(fit) + len(scored) == len(rows) and not set(fit.tolist()) & set(scored.tolist())
    return [r for r in rows if r["sample_id"] in set(scored.tolist())]


def test_every_schedule_decodes_the_same_prompts_to_the_same_length(decoded):
    setup, figures = decoded
    B = figures["block_size"]
    rows = {name: np.array(r) for name, r in figures["per_prompt"].items()}
    assert set(rows) == {f"fixed_{k}" for k in range(1, B + 1)} | {f"head_r{r:g}" for r in SLOPES}
    sources = [r["source"] for r in scored_rows(setup)]
    assert figures["prompts"] == {s: min(2, sources.count(s)) for s in set(sources)}
    tokens = rows[f"fixed_{B}"][:, 1]
    assert (tokens == MAX_NEW - 1).all()  # the first new token is the prefill's; each later one a step's
    for name, r in rows.items():
        assert r.shape == (sum(figures["prompts"].values()), 3)
        assert (r[:, 1] == tokens).all(), name  # paired: the greedy text, so its length, is each schedule's
    for k in range(1, B + 1):
        steps, _, drafts = rows[f"fixed_{k}"].T
        assert (drafts <= k * steps).all() and (drafts >= k * (steps - 1)).all()  # k a step, the last maybe cut
    assert rows["head_r10"][:, 2].sum() < rows[f"fixed_{B}"][:, 2].sum()  # dear verification: fewer drafts


def test_the_table_is_the_per_prompt_counts_pooled(decoded):
    _, figures = decoded
    B = figures["block_size"]
    full = np.array(figures["per_prompt"][f"fixed_{B}"])
    al_full = full[:, 1].sum() / full[:, 0].sum()
    for name, r in figures["per_prompt"].items():
        steps = sum(row[0] for row in r)
        tokens = sum(row[1] for row in r)
        drafts = sum(row[2] for row in r)
        row = figures["schedules"][name]
        assert row["acceptance_length"]["mean"] == pytest.approx(tokens / steps)
        assert row["drafts_per_step"]["mean"] == pytest.approx(drafts / steps)
        assert row["acceptance_length_loss"]["mean"] == pytest.approx(1 - tokens / steps / al_full)
        assert row["drafts_spared"]["mean"] == pytest.approx(1 - drafts / full[:, 2].sum())
    assert figures["schedules"][f"fixed_{B}"]["drafts_spared"]["mean"] == 0.0
    lead = figures["at_max_loss"]
    if lead is not None:  # the picks are the most spared inside the bound, each of its kind
        for kind in ("head", "fixed"):
            inside = [
                n
                for n, row in figures["schedules"].items()
                if n.startswith(kind) and row["acceptance_length_loss"]["mean"] <= figures["max_loss"]
            ]
            spared = {n: figures["schedules"][n]["drafts_spared"]["mean"] for n in inside}
            assert spared[lead[kind]] == max(spared.values())


def test_the_record_names_what_it_decoded(decoded):
    setup, figures = decoded
    assert figures["drafter_model_safetensors_sha256"] == file_fingerprint(str(setup.drafter / "model.safetensors"))
    assert figures["eval_store_fingerprint"] == store_fingerprint(str(setup.store))
    kept = "".join(json.dumps(r) + "\n" for r in scored_rows(setup))
    assert figures["scored_rows_sha256"] == hashlib.sha256(kept.encode()).hexdigest()


FOREIGN = "another drafter"


def kept_runs(partial: Path) -> int:
    """(prompt set, schedule) runs a partial file holds for this run; 0 while missing or another run's."""
    try:
        kept = json.loads(partial.read_text())
    except (OSError, ValueError):
        return 0
    return 0 if kept["key"] == FOREIGN else sum(len(runs) for runs in kept["done"].values())


def test_a_killed_run_resumes_to_the_same_figures(decoded, tmp_path, capsys):
    setup, figures = decoded
    partial = tmp_path / "x.partial.json"
    spec = {
        "drafter": str(setup.drafter),
        "overrides": setup_overrides(setup),
        "max_new": MAX_NEW,
        "slopes": list(SLOPES),
        "partial": str(partial),
    }
    total = len(figures["prompts"]) * len(figures["per_prompt"])
    # another run's partial file at the start: not reused (its rows would show in the figures below)
    foreign = {name: [[1, 1, 1]] * len(rows) for name, rows in figures["per_prompt"].items()}
    partial.write_text(json.dumps({"key": FOREIGN, "done": {"chat": foreign, "code": foreign}}))
    for stop_at in (1, total // 2):  # killed once a run is kept, then again halfway
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(spec)],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 300
        while kept_runs(partial) < stop_at and proc.poll() is None:
            assert time.monotonic() < deadline, "the bench kept nothing in 5 minutes"
            time.sleep(0.01)
        proc.kill()
        assert proc.wait() != 0, "the bench finished before it could be killed"
    kept = kept_runs(partial)
    assert total // 2 <= kept < total
    capsys.readouterr()
    resumed = schedule_figures(str(setup.drafter), setup_overrides(setup), 2, MAX_NEW, SLOPES, partial)
    assert f"resuming: {kept} (prompt set, schedule) runs kept" in capsys.readouterr().out
    assert resumed["per_prompt"] == figures["per_prompt"]
    assert resumed["schedules"] == figures["schedules"]
    assert resumed["at_max_loss"] == figures["at_max_loss"]
