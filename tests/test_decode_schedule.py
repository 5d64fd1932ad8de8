"""The decode-schedule bench's pieces: the cost models that pin a fixed budget or trace the budget rule,
and its paired figures against a hand computation."""

from __future__ import annotations

import numpy as np
import pytest

from bench.decode_schedule import best_within, fixed_costs, fixed_frontier, linear_costs, versus_full

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
