"""Offline evaluation: acceptance vs a naive computation, groupings, the stage end to end, bad input."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from eval_fixtures import (
    AUX_LAYER_IDS,
    SOURCES,
    build_setup,
    compose_cfg,
    configs,
    export_tiny_drafter,
    store_target,
)
from safetensors.torch import load_file

from dspark.errors import UserError
from dspark.eval.__main__ import headline, run
from dspark.eval.evaluate import calibration_section, load_checked, save_calibration, split_samples
from dspark.eval.offline import (
    acceptance_summary,
    bucket_labels,
    evaluate_blocks,
    held_out_refs,
    open_heldout_store,
    summarize,
)
from dspark.export import load_drafter
from dspark.store import StoreWriter, bits_to_tensor


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return build_setup(tmp_path_factory.mktemp("eval"))


@pytest.fixture(scope="module")
def reduced_drafter(setup):
    return export_tiny_drafter(setup.verifier_dir, setup.root / "reduced" / "drafter", draft_vocab_size=512)


def offline_cfg(setup, *overrides):
    return configs(compose_cfg(setup, *overrides))


def naive_block_alpha(draft, verifier, sample, anchor: int, layer_ids: list[int]) -> list[float]:
    """α of each slot of one block: a forward with this one anchor, then numpy over the full vocabulary."""
    hidden = bits_to_tensor(sample.hidden).float()
    ctx = hidden[:, [layer_ids.index(i) for i in AUX_LAYER_IDS]].reshape(1, hidden.shape[0], -1)
    ids = torch.from_numpy(sample.token_ids.astype(np.int64))[None]
    anchors = torch.tensor([[anchor]])
    with torch.no_grad():
        h = draft(ctx, ids, anchors, torch.ones_like(anchors, dtype=torch.bool))[0]
        logits = draft.draft_logits(h, draft.block_tokens(ids, anchors)[0])[0].double().numpy()
        target = verifier.logits(hidden[:, -1]).double().numpy()
    out = []
    mask = sample.loss_mask.astype(bool)
    for k in range(draft.block_size):
        pos = anchor + k
        if pos + 1 >= len(mask) or not mask[pos + 1]:
            break  # the block ends at the first unscored slot
        q_draft = np.exp(logits[k] - logits[k].max())
        q_draft /= q_draft.sum()
        q = np.zeros(target.shape[1])
        vocab_ids = np.arange(q_draft.size) if draft.d2t is None else (np.arange(q_draft.size) + draft.d2t.numpy())
        q[vocab_ids] = q_draft  # the draft puts no mass outside its vocabulary
        p = np.exp(target[pos] - target[pos].max())
        p /= p.sum()
        out.append(float(np.minimum(q, p).sum()))
    return out


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
def test_alpha_matches_naive(setup, reduced_drafter, reduced):
    target, cfg, heldout = offline_cfg(setup, "heldout.anchors_per_forward=5", "heldout.anchors_per_sample=null")
    drafter = reduced_drafter if reduced else setup.drafter
    draft, verifier, store, _ = load_checked(drafter, target, cfg.store)
    refs = held_out_refs(store, max_samples=2)
    table = evaluate_blocks(draft, verifier, store, refs, heldout, torch.device("cpu"))
    layer_ids = store.target["layer_ids"]
    checked = 0
    for ref in refs:
        sample = store.read(ref)
        rows = np.flatnonzero(table.sample_id == ref.sample_id)
        # every candidate anchor is evaluated: token and next token trained
        mask = sample.loss_mask.astype(bool)
        assert table.anchor_pos[rows].tolist() == np.flatnonzero(mask[:-1] & mask[1:]).tolist()
        for row in rows[:: max(1, len(rows) // 6)]:
            naive = naive_block_alpha(draft, verifier, sample, int(table.anchor_pos[row]), layer_ids)
            assert table.slot_mask[row].sum() == len(naive)
            np.testing.assert_allclose(table.alpha[row, : len(naive)], naive, rtol=1e-4, atol=1e-6)
            assert (table.alpha[row, len(naive) :] == 0).all()
            checked += 1
    assert checked >= 8
    if reduced:
        # honest: data tokens outside the draft vocabulary are rejected mass, so α stays
        # below the verifier's probability of the draft vocabulary at that position
        assert draft.d2t is not None and table.alpha.max() < 1.0


def test_reduced_vocab_not_renormalized(setup, reduced_drafter):
    """The reduced draft's α never exceeds the target mass inside its vocabulary."""
    target, cfg, heldout = offline_cfg(setup)
    draft, verifier, store, _ = load_checked(reduced_drafter, target, cfg.store)
    ref = held_out_refs(store, 1)[0]
    table = evaluate_blocks(draft, verifier, store, [ref], heldout, torch.device("cpu"))
    sample = store.read(ref)
    with torch.no_grad():
        p = torch.softmax(verifier.logits(bits_to_tensor(sample.hidden).float()[:, -1]).double(), -1)
    inside = p[:, draft.target_ids].sum(-1).numpy()
    for row in range(table.num_blocks):
        for k in np.flatnonzero(table.slot_mask[row]):
            assert table.alpha[row, k] <= inside[table.anchor_pos[row] + k] + 1e-6


def test_summary_matches_naive_loops():
    rng = np.random.default_rng(0)
    alpha = rng.uniform(size=(50, 4))
    lengths = rng.integers(1, 5, size=50)
    mask = np.arange(4)[None] < lengths[:, None]
    got = acceptance_summary(alpha * mask, mask)
    tau, cum, cond, count = [], np.zeros(4), np.zeros(4), np.zeros(4)
    for i in range(50):
        running, t = 1.0, 1.0
        for k in range(lengths[i]):
            running *= alpha[i, k]
            t += running
            cum[k] += running
            cond[k] += alpha[i, k]
            count[k] += 1
        tau.append(t)
    assert got["tau"] == pytest.approx(np.mean(tau))
    assert got["cumulative"] == pytest.approx((cum / count).tolist())
    assert got["conditional"] == pytest.approx((cond / count).tolist())
    assert got["blocks"] == 50 and got["scored_slots"] == count.astype(int).tolist()


def test_bucket_labels():
    labels = bucket_labels(np.array([0, 63, 64, 255, 256, 5000]), [64, 256])
    assert labels.tolist() == ["<64", "<64", "64-255", "64-255", ">=256", ">=256"]


def test_groupings_partition_the_blocks(setup):
    target, cfg, heldout = offline_cfg(
        setup, "eval.offline.length_buckets=[40,60]", "eval.offline.position_buckets=[16]"
    )
    draft, verifier, store, _ = load_checked(setup.drafter, target, cfg.store)
    table = evaluate_blocks(draft, verifier, store, held_out_refs(store, None), heldout, torch.device("cpu"))
    sources = {i: SOURCES[i % 2] for i in range(8)}
    section = summarize(table, cfg.offline, sources)
    overall = section["overall"]
    assert section["samples"] == 8
    for key in ("by_length", "by_anchor_position", "by_source"):
        groups = section[key]
        assert sum(g["blocks"] for g in groups.values()) == overall["blocks"]
        # τ of the whole is the block-weighted mean of the groups' τ
        assert sum(g["tau"] * g["blocks"] for g in groups.values()) / overall["blocks"] == pytest.approx(overall["tau"])
    assert set(section["by_source"]) == set(SOURCES)
    assert list(section["by_anchor_position"]) == ["<16", ">=16"]


def test_sampled_anchors_are_reproducible(setup):
    target, cfg, heldout = offline_cfg(setup, "heldout.anchors_per_sample=5", "heldout.seed=3")
    draft, verifier, store, _ = load_checked(setup.drafter, target, cfg.store)
    refs = held_out_refs(store, 3)
    a = evaluate_blocks(draft, verifier, store, refs, heldout, torch.device("cpu"))
    b = evaluate_blocks(draft, verifier, store, refs, heldout, torch.device("cpu"))
    assert a.num_blocks == 15
    np.testing.assert_array_equal(a.anchor_pos, b.anchor_pos)
    np.testing.assert_array_equal(a.alpha, b.alpha)


def test_drafter_without_confidence_head(setup, tmp_path):
    drafter = export_tiny_drafter(setup.verifier_dir, tmp_path / "drafter", confidence_head=False)
    target, cfg, heldout = offline_cfg(setup)
    draft, verifier, store, _ = load_checked(drafter, target, cfg.store)
    table = evaluate_blocks(draft, verifier, store, held_out_refs(store, 2), heldout, torch.device("cpu"))
    assert table.conf_logits is None and calibration_section(table, cfg.calibration, seed=0) is None


def test_calibration_split_is_disjoint():
    fit, scored = split_samples(np.array([5, 5, 1, 9, 3, 3, 7]), fit_fraction=0.5, seed=0)
    assert set(fit).isdisjoint(scored) and set(fit) | set(scored) == {1, 3, 5, 7, 9}
    assert len(fit) == 2  # round(0.5 * 5)
    with pytest.raises(ValueError, match="fit_fraction"):
        split_samples(np.array([1, 2]), fit_fraction=1.0, seed=0)


def test_calibration_section_serves_the_refit_it_reports(setup):
    """With the head's inputs in the table, the served map is the cross-validated refit: the report
    holds its correction, and its scores are those of a·z + c + δ·x + d computed here; without them,
    or with `refit` off, the plain slope and intercept."""
    from dspark.eval import calibration as cal
    from dspark.eval.offline import BlockTable

    rng = np.random.default_rng(0)
    n, blocks, dim = 2000, 4, 5
    z, x = rng.normal(0.5, 1.5, (n, blocks)), rng.normal(0.0, 1.0, (n, blocks, dim))
    alpha = cal.sigmoid(0.5 * z + 1.2 * x[..., 0] - 0.3)
    mask = np.arange(blocks)[None] < rng.integers(1, blocks + 1, n)[:, None]
    ids = np.arange(n) // 20
    table = BlockTable(alpha, mask, z, ids, np.zeros(n, np.int64), np.full(n, 64), x.astype(np.float32))
    _, cfg, _ = offline_cfg(setup)
    section = calibration_section(table, cfg.calibration, seed=0)
    served = section["served"]
    assert served["refit"]["l2"] is not None and len(served["refit"]["weight_delta"]) == dim
    refit = {**served["refit"], "slope": served["slope"], "intercept": served["intercept"]}
    refit["weight_delta"] = np.array(refit["weight_delta"])
    fit_ids, scored_ids = split_samples(ids, cfg.calibration.fit_fraction, 0)
    rows = np.isin(ids, scored_ids)
    want = cal.confidence_quality(cal.head_logits(z[rows], x[rows], refit), alpha[rows], mask[rows], None, 10)
    assert served["pooled"] == pytest.approx(want["pooled"])
    plain = calibration_section(replace(table, head_inputs=None), cfg.calibration, seed=0)["served"]
    assert "refit" not in plain and plain["pooled"]["auroc"] < served["pooled"]["auroc"] - 0.02
    off = calibration_section(table, replace(cfg.calibration, refit=False), seed=0)["served"]
    assert "refit" not in off and off["slope"] == pytest.approx(plain["slope"])

    # the served budget's threshold is the one picked on the refit's out-of-fold logits of the fit half
    fit = np.isin(ids, fit_ids)
    redone = cal.refit_served_head(z[fit], alpha[fit], mask[fit], x[fit].astype(np.float32), ids[fit], seed=0)
    scored = (cal.head_logits(z[rows], x[rows].astype(np.float32), redone), alpha[rows], mask[rows])
    bound = cfg.calibration.max_tau_loss
    honest = cal.verification_budget((redone["out_of_fold"], alpha[fit], mask[fit]), scored, None, bound)
    flattered = cal.verification_budget(
        (cal.head_logits(z[fit], x[fit], redone), alpha[fit], mask[fit]), scored, None, bound
    )
    assert served["budget"]["confidence"]["setting"] == pytest.approx(honest["confidence"]["setting"])
    assert served["budget"]["threshold_on"] == "fit samples, out of fold"
    assert off["budget"]["threshold_on"] == "fit samples"
    assert honest["confidence"]["setting"] != pytest.approx(flattered["confidence"]["setting"])


def test_stage_end_to_end(setup):
    cfg = compose_cfg(setup)
    head = load_file(setup.drafter / "model.safetensors")
    report = run(cfg)
    out = setup.root / "eval"
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["offline"]["overall"]["tau"] == pytest.approx(report["offline"]["overall"]["tau"])
    assert 1.0 <= report["offline"]["overall"]["tau"] <= 1.0 + 4
    assert set(report["offline"]["by_source"]) == set(SOURCES)
    for name in ("acceptance_by_position.png", "tau_by_bucket.png", "training.png", "calibration_reliability.png"):
        assert name in report["plots"]
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cal = json.loads((setup.drafter / "calibration.json").read_text())
    assert cal["temperatures"] == pytest.approx(report["calibration"]["temperatures"])
    assert len(cal["temperatures"]) == 4 and all(t > 0 for t in cal["temperatures"])
    # the served map, fitted on the fit half, is folded into the head vLLM loads, and recorded
    served = report["calibration"]["served"]
    # 4 fit conversations: too few to cross-validate a refit, so the plain map, and a zero correction
    assert served["refit"]["l2"] is None and served["refit"]["cv_nll"] == {}
    assert not any(served["refit"]["weight_delta"]) and served["refit"]["bias_delta"] == 0.0
    assert cal["folds"] == [
        {
            "slope": served["slope"],
            "intercept": served["intercept"],
            "refit": {"l2": None, "weight_delta_norm": 0.0, "bias_delta": 0.0},
        }
    ]
    assert served["slope"] > 0
    folded = load_file(setup.drafter / "model.safetensors")
    w, b = (head[f"confidence_head.proj.{k}"].double() for k in ("weight", "bias"))
    torch.testing.assert_close(
        folded["confidence_head.proj.weight"].double(), served["slope"] * w, rtol=1e-6, atol=1e-7
    )
    torch.testing.assert_close(
        folded["confidence_head.proj.bias"].double(), served["slope"] * b + served["intercept"], rtol=1e-6, atol=1e-6
    )
    assert all(torch.equal(folded[k], v) for k, v in head.items() if not k.startswith("confidence_head."))
    assert len(served["per_position"]) == 4 and 0 <= served["pooled"]["ece"] <= 1
    # the budget of the head as served, beside the STS one's: every slot is every slot, whatever the head
    assert served["budget"]["all_slots"] == report["calibration"]["budget"]["all_slots"]
    assert 0.0 <= served["budget"]["confidence"]["saved"] <= 1.0 and served["budget"]["confidence"]["saved_se"] >= 0
    assert report["calibration"]["fit_samples"] + report["calibration"]["scored_samples"] == 8
    budget = report["calibration"]["budget"]
    for name in ("fixed", "confidence", "oracle"):  # a setting never sends more than every slot
        assert 0.0 <= budget[name]["saved"] <= 1.0 and budget[name]["sent"] <= budget["all_slots"]["sent"]
        assert budget[name]["saved_se"] >= 0.0  # bootstrapped over the scored conversations
    assert "### Verification budget" in (setup.drafter / "README.md").read_text()
    assert "verification budget" in headline(report) and "the head's lead" in headline(report)
    # the headline's budget is the head's as served (what vLLM schedules on), not the STS one's
    assert f"head saves {served['budget']['confidence']['saved']:.1%}" in headline(report)
    assert report["training"]["steps"] == 20 and len(report["training"]["curves"]["train loss"]) == 20
    assert report["data"]["heldout_store"]["samples"] == 8
    assert (setup.drafter / "README.md").is_file()
    assert "offline τ" in headline(report)


# ------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------


def test_each_fold_is_recorded_for_the_weights_it_made(setup, tmp_path):
    """A second `make eval` folds its map over the first and both are recorded; weights exported again
    (or folded with no record left, by a kill) start the record afresh. The loaded draft serves what
    the file holds."""
    drafter = tmp_path / "drafter"
    shutil.copytree(setup.drafter, drafter)
    (drafter / "calibration.json").unlink(missing_ok=True)  # as exported: no make eval yet
    exported = (drafter / "model.safetensors").read_bytes()
    trained = load_file(drafter / "model.safetensors")
    draft = load_drafter(drafter)

    def fold(slope, intercept, refit=None):
        calibration = {
            "served": {"slope": slope, "intercept": intercept, "pooled": {"ece": 0.1}, **(refit or {})},
            "temperatures": [1.0] * 4,
            "fit_samples": 4,
            "before": {"pooled": {"ece": 0.2}},
            "after": {"pooled": {"ece": 0.15}},
        }
        save_calibration(drafter, draft, calibration)
        record = json.loads((drafter / "calibration.json").read_text())
        head = load_file(drafter / "model.safetensors")
        for k in ("weight", "bias"):
            torch.testing.assert_close(
                getattr(draft.confidence_head.proj, k).detach(), head[f"confidence_head.proj.{k}"]
            )
        return record, head

    w, b = (trained[f"confidence_head.proj.{k}"].double() for k in ("weight", "bias"))
    record, _ = fold(0.5, -1.0)
    assert record["folds"] == [{"slope": 0.5, "intercept": -1.0}]
    record, head = fold(2.0, 0.5)
    assert record["folds"] == [{"slope": 0.5, "intercept": -1.0}, {"slope": 2.0, "intercept": 0.5}]
    torch.testing.assert_close(head["confidence_head.proj.weight"].double(), w)
    torch.testing.assert_close(head["confidence_head.proj.bias"].double(), 2.0 * (0.5 * b - 1.0) + 0.5)
    (drafter / "model.safetensors").write_bytes(exported)  # exported again
    draft = load_drafter(drafter)
    record, _ = fold(0.8, 0.1)
    assert record["folds"] == [{"slope": 0.8, "intercept": 0.1}]
    # a refit's correction: w → a·w + δ, b → a·b + c + d, recorded by its size
    w, b = (load_file(drafter / "model.safetensors")[f"confidence_head.proj.{k}"].double() for k in ("weight", "bias"))
    delta = torch.linspace(-0.5, 0.5, w.shape[1], dtype=torch.float64)
    refit = {"refit": {"l2": 0.01, "cv_nll": {}, "weight_delta": delta.tolist(), "bias_delta": 0.25}}
    record, head = fold(0.5, -0.2, refit)
    assert record["folds"][-1] == {
        "slope": 0.5,
        "intercept": -0.2,
        "refit": {"l2": 0.01, "weight_delta_norm": pytest.approx(float(delta.norm())), "bias_delta": 0.25},
    }
    torch.testing.assert_close(head["confidence_head.proj.weight"].double(), 0.5 * w + delta, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(head["confidence_head.proj.bias"].double(), 0.5 * b - 0.2 + 0.25, rtol=1e-6, atol=1e-6)


def test_drafter_for_another_verifier(setup, tmp_path):
    other = export_tiny_drafter(setup.verifier_dir, tmp_path / "drafter", verifier_name="Qwen/Qwen3-8B")
    target, cfg, _ = offline_cfg(setup)
    with pytest.raises(ValueError, match="trained for verifier 'Qwen/Qwen3-8B'"):
        load_checked(other, target, cfg.store)


def test_store_of_another_target(setup, tmp_path):
    target, cfg, _ = offline_cfg(setup, "target.name_or_path=Qwen/Qwen3-0.6B")
    with pytest.raises(ValueError, match="holds states of"):
        load_checked(setup.drafter, target, cfg.store)


def test_missing_heldout_store(setup, tmp_path):
    with pytest.raises(FileNotFoundError, match="no held-out shard store"):
        open_heldout_store(str(tmp_path / "store" / "eval"))
    cfg = compose_cfg(setup, f"eval.store={tmp_path / 'nowhere'}")
    with pytest.raises(FileNotFoundError, match="eval.store="):
        run(cfg)


def test_store_not_held_out_or_empty(setup, tmp_path):
    target = store_target(setup.verifier_dir)
    empty = StoreWriter.create_or_open(tmp_path / "empty", target, "x" * 64)
    with pytest.raises(ValueError, match="no committed samples"):
        open_heldout_store(empty.url)
    train = StoreWriter.create_or_open(tmp_path / "train", target, "x" * 64, extra_attrs={"split": "train"})
    with pytest.raises(ValueError, match="'train' split, not held-out"):
        open_heldout_store(train.url)


def test_missing_drafter(setup, tmp_path):
    with pytest.raises(UserError, match="not an exported drafter"):
        run(compose_cfg(setup, f"drafter={tmp_path}"))
