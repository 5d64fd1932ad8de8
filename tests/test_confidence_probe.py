"""The confidence probes of `bench.confidence_probe` on blocks whose acceptance is known, and the
capture of a real drafter's head inputs on a held-out store."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from eval_fixtures import build_setup, setup_overrides

from bench.confidence_probe import capture, fit_probe, per_position_auroc, probe_table, refit_head


def known_blocks(n=600, block=4, dim=8, seed=0):
    """Features [n, B, dim]; α = sigmoid(3·x₀ − 0.5·k): only the first feature (and the position) matter."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, block, dim))
    alpha = 1 / (1 + np.exp(-(3 * x[..., 0] - 0.5 * np.arange(block))))
    mask = np.ones((n, block), bool)
    return torch.from_numpy(x), alpha, mask, np.arange(n) < n // 2


def test_linear_probe_finds_a_linear_signal_and_noise_finds_none():
    x, alpha, mask, fit = known_blocks()
    truth = per_position_auroc(np.log(alpha / (1 - alpha))[~fit], alpha[~fit], mask[~fit])
    table = probe_table({"signal": x, "noise": x[..., 1:]}, alpha, mask, fit, steps=1000)
    for got, best in zip(table["signal"]["linear"], truth):
        assert got == pytest.approx(best, abs=0.02)  # ranks as the true acceptance does
    assert all(abs(a - 0.5) < 0.08 for a in table["noise"]["linear"][:1])  # position 1: nothing to rank by
    assert set(table["noise"]) == {"linear", "mlp"}


def test_probe_is_fitted_on_the_fit_blocks_only():
    """Labels of the scored blocks inverted: a probe that saw them could not rank them well."""
    x, alpha, mask, fit = known_blocks(seed=1)
    alpha = alpha.copy()
    alpha[~fit] = 1 - alpha[~fit]
    logits = fit_probe(x, alpha, mask, fit, width=0, steps=1000, seed=0)
    assert per_position_auroc(logits[~fit], alpha[~fit], mask[~fit])[0] < 0.2


def test_refit_head_is_one_servable_map_that_finds_the_signal():
    """The refit is one weight vector and bias for every position (what vLLM serves), fitted on all
    the blocks it is given, and ranks as the true acceptance does where a shared map can."""
    x, alpha, mask, fit = known_blocks(seed=2)
    weight, bias = refit_head(x[fit], alpha[fit], mask[fit])
    assert weight.shape == (x.shape[-1],) and bias.shape == ()
    logits = (x.double() @ weight + bias).numpy()
    truth = per_position_auroc(np.log(alpha / (1 - alpha))[~fit], alpha[~fit], mask[~fit])
    assert per_position_auroc(logits[~fit], alpha[~fit], mask[~fit])[0] == pytest.approx(truth[0], abs=0.02)
    assert weight[0].abs() > 5 * weight[1:].abs().max()  # the signal's feature, in the original units
    masked = mask.copy()
    masked[:, 1:] = False  # slots past the first left out of the fit: the fit must not read them
    flipped = alpha.copy()
    flipped[:, 1:] = 1 - flipped[:, 1:]
    again, _ = refit_head(x, flipped, masked)
    np.testing.assert_allclose(again.numpy(), refit_head(x, alpha, masked)[0].numpy(), rtol=1e-5, atol=1e-6)


def test_capture_reads_what_the_head_reads(tmp_path):
    """The captured features, through the drafter's own head, give back the logits the scorer recorded,
    on the held-out store and on the store a refit reads."""
    setup = build_setup(tmp_path)
    features, table, _, _, refit = capture(str(setup.drafter), setup_overrides(setup), str(setup.store), 3)
    from dspark.export import load_drafter

    head = load_drafter(setup.drafter).confidence_head
    with torch.no_grad():
        again = head(features["both"].float()).double().numpy()
    np.testing.assert_allclose(again, table.conf_logits, rtol=1e-4, atol=1e-4)
    assert features["both"].shape[:2] == table.alpha.shape
    refit_features, refit_table = refit
    assert np.unique(refit_table.sample_id).size == 3  # the first 3 samples only
    with torch.no_grad():
        np.testing.assert_allclose(
            head(refit_features.float()).double().numpy(), refit_table.conf_logits, rtol=1e-4, atol=1e-4
        )


def test_confidence_report_records_the_head_and_its_provenance(tmp_path):
    """`bench.confidence_report` on a real drafter and held-out store: the eval's calibration section,
    the budget with its SEs, and the hashes that make the file re-makeable."""
    from bench.ablate_record import file_fingerprint, store_fingerprint
    from bench.confidence_report import confidence_figures

    setup = build_setup(tmp_path)
    figures = confidence_figures(str(setup.drafter), setup_overrides(setup))
    assert figures["drafter_model_safetensors_sha256"] == file_fingerprint(f"{setup.drafter}/model.safetensors")
    assert figures["eval_store_fingerprint"] == store_fingerprint(str(setup.store))
    assert "eval.online.enabled=false" in figures["command"] and figures["command"].count("eval.out_dir") == 0
    positions = figures["calibration"]["before"]["per_position"]
    assert len(positions) == 4 and all(0.0 <= p["auroc"] <= 1.0 for p in positions)
    budget = figures["calibration"]["budget"]
    assert budget["confidence"]["saved_se"] >= 0 and "se" in budget["confidence_vs_fixed"]
    assert figures["offline_tau"] >= 1.0
    assert not (setup.drafter / "calibration.json").exists()  # the drafter is read, not changed


def test_bench_scripts_split_their_own_arguments_from_the_overrides():
    from bench import split_args
    from dspark.errors import UserError

    args, rest = split_args(
        ["drafter=d", "steps=5", "heldout.seed=1", "out=o.json"],
        {"drafter", "out", "steps"},
        {"drafter", "out"},
        "python -m x drafter=DIR out=FILE",
    )
    assert args == {"drafter": "d", "steps": "5", "out": "o.json"} and rest == ["heldout.seed=1"]
    with pytest.raises(UserError, match="usage: python -m x drafter=DIR out=FILE"):
        split_args(
            ["drafter=d", "heldout.seed=1"], {"drafter", "out"}, {"drafter", "out"}, "python -m x drafter=DIR out=FILE"
        )


def test_confidence_refit_pairs_the_two_heads_on_the_scored_conversations(tmp_path):
    """`bench.confidence_refit` on a real drafter: the tiny store's 4 fit conversations are too few to
    cross-validate, so the refit is the plain map and every paired difference is exactly 0; on blocks
    where a feature carries the acceptance, `paired` gives the AUROC gain computed directly."""
    from bench.confidence_refit import paired, refit_figures
    from dspark.eval import calibration as cal

    setup = build_setup(tmp_path)
    figures = refit_figures(str(setup.drafter), setup_overrides(setup))
    assert figures["refit"]["l2"] is None and figures["refit"]["weight_delta_norm"] == 0.0
    assert figures["fit_conversations"] + figures["scored_conversations"] == 8
    for name, diff in figures["scored"]["refit_minus_served"].items():
        assert diff == {"value": 0.0, "se": 0.0}, name
    # thresholds picked on the scored half itself keep its τ loss within the bound, the same for both maps
    equal = figures["at_equal_tau_loss"]
    assert equal["tau_loss"]["refit"] == equal["tau_loss"]["served"] <= 0.01 + 1e-12
    assert equal["refit_minus_served"] == {"value": 0.0, "se": 0.0}

    x, alpha, mask, _ = known_blocks(n=400, seed=3)
    alpha, x = alpha.copy(), x.numpy()
    weak, strong = 0.3 * x[..., 0] + x[..., 1], 3 * x[..., 0]  # the second ranks as α does
    none = np.zeros(mask.shape)
    conversations = np.arange(400) // 4
    out = paired({"weak": (weak, none), "strong": (strong, none)}, alpha, mask, conversations, 10, seed=0)
    for k in range(4):
        direct = [
            cal.auroc(cal.prefix_survival(cal.sigmoid(lg), mask)[:, k], cal.prefix_survival(alpha, mask)[:, k])
            for lg in (weak, strong)
        ]
        got = out["strong_minus_weak"][f"auroc_{k + 1}"]
        assert got["value"] == pytest.approx(direct[1] - direct[0]) and 0 < got["se"] < got["value"]
    # neither verifies a slot here: both spare every draft, and no difference
    assert out["strong"]["saved"] == 1.0 and out["strong_minus_weak"]["saved"] == {"value": 0.0, "se": 0.0}
