"""Confidence-quality scores against naive implementations, and STS on a miscalibrated head."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from dspark.eval import calibration as cal


def naive_ece(pred, label, n_bins):
    total = 0.0
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        idx = [i for i, p in enumerate(pred) if (lo <= p < hi) or (b == n_bins - 1 and p == 1.0)]
        if idx:
            gap = abs(sum(pred[i] for i in idx) / len(idx) - sum(label[i] for i in idx) / len(idx))
            total += len(idx) / len(pred) * gap
    return total


def naive_soft_auroc(score, label):
    num = den = 0.0
    for i, j in itertools.product(range(len(score)), repeat=2):
        w = label[i] * (1 - label[j])
        den += w
        num += w * (1.0 if score[i] > score[j] else 0.5 if score[i] == score[j] else 0.0)
    return num / den


def test_auroc_hand_example():
    # the classic example: one positive ranked below one negative out of four pairs
    assert cal.auroc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)
    # ties count one half
    assert cal.auroc(np.array([0.5, 0.5]), np.array([1, 0])) == pytest.approx(0.5)
    assert np.isnan(cal.auroc(np.array([0.2, 0.3]), np.array([1, 1])))


@pytest.mark.parametrize("seed", [0, 1])
def test_auroc_ceiling_is_the_best_any_score_reaches(seed):
    rng = np.random.default_rng(seed)
    label = rng.beta(0.7, 0.7, size=40)  # soft labels, many near 0 or 1
    ceiling = cal.auroc(label, label)
    assert ceiling == pytest.approx(naive_soft_auroc(label.tolist(), label.tolist()))
    assert 0.5 < ceiling < 1.0
    for _ in range(200):  # no score, however it ranks, beats ranking by the label itself
        assert cal.auroc(rng.permutation(label) + rng.normal(0, 0.1, 40), label) <= ceiling + 1e-12
    assert cal.auroc(np.array([0.0, 1.0, 1.0]), np.array([0.0, 1.0, 1.0])) == 1.0  # hard labels: 1
    scores = cal.confidence_quality(np.zeros((40, 2)), np.stack([label, label], 1), np.ones((40, 2), bool), None, 10)
    assert scores["per_position"][0]["auroc_ceiling"] == pytest.approx(ceiling)


def test_brier_ece_hand_example():
    pred, label = np.array([0.9, 0.9, 0.2, 0.2]), np.array([1.0, 0.0, 0.0, 0.0])
    assert cal.brier(pred, label) == pytest.approx((0.01 + 0.81 + 0.04 + 0.04) / 4)
    # two occupied bins: |0.9 − 0.5| and |0.2 − 0| with half the mass each
    assert cal.ece(pred, label, n_bins=10) == pytest.approx(0.5 * 0.4 + 0.5 * 0.2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scores_match_naive(seed):
    rng = np.random.default_rng(seed)
    pred = rng.uniform(size=60).round(2)  # rounding creates ties
    pred[:3] = [0.0, 1.0, 0.1]  # bin edges
    label = rng.uniform(size=60)
    assert cal.ece(pred, label, 7) == pytest.approx(naive_ece(pred.tolist(), label.tolist(), 7))
    assert cal.auroc(pred, label) == pytest.approx(naive_soft_auroc(pred.tolist(), label.tolist()))
    assert cal.nll(pred, label) == pytest.approx(
        np.mean(
            [
                -(y * np.log(np.clip(p, 1e-7, 1 - 1e-7)) + (1 - y) * np.log(1 - np.clip(p, 1e-7, 1 - 1e-7)))
                for p, y in zip(pred, label)
            ]
        )
    )


def test_prefix_survival_naive():
    rng = np.random.default_rng(3)
    values = rng.uniform(size=(5, 4))
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]], bool)
    got = cal.prefix_survival(values, mask)
    for i in range(5):
        running = 1.0
        for k in range(4):
            running *= values[i, k]
            assert got[i, k] == pytest.approx(running if mask[i, k] else 0.0)


def miscalibrated_case(n=4000, blocks=4, sharpen=3.0, seed=0):
    """True per-slot acceptance sigmoid(z*); the head reports sharpen·z* (overconfident)."""
    rng = np.random.default_rng(seed)
    z_true = rng.normal(0.8, 1.5, size=(n, blocks))
    alpha = cal.sigmoid(z_true)
    lengths = rng.integers(1, blocks + 1, size=n)
    mask = np.arange(blocks)[None, :] < lengths[:, None]
    return sharpen * z_true, alpha, mask


def test_sts_recovers_temperature_and_lowers_ece():
    z, alpha, mask = miscalibrated_case()
    before = cal.confidence_quality(z, alpha, mask, None, n_bins=10)
    temps = cal.fit_sequential_temperatures(z, alpha, mask, t_min=0.05, t_max=20.0)
    after = cal.confidence_quality(z, alpha, mask, temps, n_bins=10)
    assert temps == pytest.approx([3.0] * 4, rel=0.02)
    assert after["pooled"]["ece"] < 0.2 * before["pooled"]["ece"]
    for k in range(4):
        assert after["per_position"][k]["ece"] < before["per_position"][k]["ece"]
        assert after["per_position"][k]["brier"] <= before["per_position"][k]["brier"]
    # a monotone rescaling per position keeps position-1 ranking: AUROC unchanged there
    assert after["per_position"][0]["auroc"] == pytest.approx(before["per_position"][0]["auroc"])


def test_sts_is_sequential():
    """Position 2's temperature is fitted given position 1's: a head wrong only at position 1
    gets T_1 ≠ 1 and T_2 ≈ 1."""
    z, alpha, mask = miscalibrated_case(sharpen=1.0, seed=4)
    z = z.copy()
    z[:, 0] *= 0.25  # underconfident at position 1 only
    temps = cal.fit_sequential_temperatures(z, alpha, mask, t_min=0.05, t_max=20.0)
    assert temps[0] == pytest.approx(0.25, rel=0.03)
    assert temps[1:] == pytest.approx([1.0] * 3, rel=0.03)


def test_the_served_map_recovers_a_slope_and_an_intercept_temperatures_cannot():
    """A head whose logit is 2·z* + 3 (overconfident and shifted up: most probabilities above 1/2 where
    the acceptance is not): the served map recovers a = 1/2, c = -3/2, a temperature alone cannot
    bring the mean down, and no (a, c) on a grid around it scores a lower pooled NLL."""
    z_true, _, mask = miscalibrated_case(sharpen=1.0, seed=5)
    z_true = z_true - 1.5  # acceptance mostly under 1/2
    alpha, head = cal.sigmoid(z_true), 2.0 * z_true + 3.0
    slope, intercept = cal.fit_served_scaling(head, alpha, mask)
    assert (slope, intercept) == pytest.approx((0.5, -1.5), abs=0.02)
    label = cal.prefix_survival(alpha, mask)

    def pooled_nll(a, c):
        return cal.nll(cal.prefix_survival(cal.sigmoid(a * head + c), mask)[mask], label[mask])

    best = pooled_nll(slope, intercept)
    for a, c in itertools.product(slope * np.array([0.9, 0.97, 1.03, 1.1]), intercept + np.array([-0.1, 0, 0.1])):
        assert pooled_nll(a, c) >= best - 1e-9
    served = cal.confidence_quality(slope * head + intercept, alpha, mask, None, n_bins=10)
    sts = cal.confidence_quality(head, alpha, mask, cal.fit_sequential_temperatures(head, alpha, mask, 0.05, 20.0), 10)
    assert served["pooled"]["ece"] < 0.3 * sts["pooled"]["ece"]
    assert cal.fit_served_scaling(head, alpha, np.zeros_like(mask)) == (1.0, 0.0)


def refit_case(n=3000, blocks=4, dim=6, signal=1.5, seed=0):
    """A head that reads half the signal: the true logit is 0.5·z + signal·x₀ − 0.3, the trained head's z."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.5, 1.5, size=(n, blocks))
    x = rng.normal(2.0, 3.0, size=(n, blocks, dim))  # off-centre and wide: the fit standardizes them
    alpha = cal.sigmoid(0.5 * z + signal * (x[..., 0] - 2.0) / 3.0 - 0.3)
    mask = np.arange(blocks)[None, :] < rng.integers(1, blocks + 1, size=n)[:, None]
    conversations = np.arange(n) // 10  # 10 blocks a conversation
    return z, x, alpha, mask, conversations


def test_the_refit_recovers_what_the_features_carry_beyond_the_head():
    """The refit's map, in raw feature units, is the true one (a = 0.5, δ on x₀ only, the intercept
    absorbing x₀'s mean); its logits are a·z + c + x·δ + d computed by hand, and it ranks and
    scores better than the plain map on fresh blocks."""
    z, x, alpha, mask, conv = refit_case()
    fitted = cal.refit_served_head(z, alpha, mask, x, conv, seed=0)
    assert fitted["l2"] is not None
    assert set(fitted["cv_nll"]) == {"none", *(repr(v) for v in cal.REFIT_L2)}
    assert fitted["cv_nll"][repr(fitted["l2"])] < fitted["cv_nll"]["none"]
    assert fitted["slope"] == pytest.approx(0.5, abs=0.03)
    assert fitted["weight_delta"][0] == pytest.approx(0.5, abs=0.03)  # 1.5 / std 3
    assert np.abs(fitted["weight_delta"][1:]).max() < 0.03
    assert fitted["intercept"] + fitted["bias_delta"] == pytest.approx(-0.3 - 1.0, abs=0.1)
    hand = fitted["slope"] * z + fitted["intercept"] + np.einsum("nbf,f->nb", x, fitted["weight_delta"])
    np.testing.assert_allclose(cal.head_logits(z, x, fitted), hand + fitted["bias_delta"])

    z2, x2, alpha2, mask2, _ = refit_case(seed=1)
    a, c = cal.fit_served_scaling(z, alpha, mask)
    plain = cal.confidence_quality(a * z2 + c, alpha2, mask2, None, 10)
    refit = cal.confidence_quality(cal.head_logits(z2, x2, fitted), alpha2, mask2, None, 10)
    for k in range(4):
        assert refit["per_position"][k]["auroc"] > plain["per_position"][k]["auroc"] + 0.02
    assert refit["pooled"]["nll"] < plain["pooled"]["nll"]


def test_the_refit_keeps_the_plain_map_where_features_add_nothing_or_data_is_short():
    """Features of pure noise: whatever strength the cross-validation picks, the refit scores within
    0.5% of the plain map's NLL on fresh blocks. Under 2 conversations a fold: the plain map itself."""
    z, x, alpha, mask, conv = refit_case(signal=0.0, n=1500)
    fitted = cal.refit_served_head(z, alpha, mask, x, conv, seed=0)
    z2, x2, alpha2, mask2, _ = refit_case(signal=0.0, n=1500, seed=1)
    a, c = cal.fit_served_scaling(z, alpha, mask)
    plain = cal.confidence_quality(a * z2 + c, alpha2, mask2, None, 10)["pooled"]["nll"]
    refit = cal.confidence_quality(cal.head_logits(z2, x2, fitted), alpha2, mask2, None, 10)["pooled"]["nll"]
    assert refit < plain * 1.005

    few = conv[:70]  # 7 conversations, 4 folds
    short = cal.refit_served_head(z[:70], alpha[:70], mask[:70], x[:70], few, seed=0)
    assert short["l2"] is None and short["cv_nll"] == {}
    assert (short["slope"], short["intercept"]) == cal.fit_served_scaling(z[:70], alpha[:70], mask[:70])
    assert not short["weight_delta"].any() and short["bias_delta"] == 0.0


def test_the_refit_gives_each_block_its_logits_from_the_fit_without_its_fold():
    """`out_of_fold` for a block is the chosen candidate fitted on the other folds' conversations (the
    folds rebuilt here from the documented rule: a seeded permutation of the conversations dealt
    round-robin); its pooled NLL is the candidate's `cv_nll`; on the blocks it was fitted on, the final
    map's own logits score better than these (what a threshold picked there must not read)."""
    z, x, alpha, mask, conv = refit_case(n=1200, dim=12)
    fitted = cal.refit_served_head(z, alpha, mask, x, conv, seed=3)
    held = fitted["out_of_fold"]
    assert held.shape == z.shape and fitted["l2"] is not None
    ids = np.random.default_rng(3).permutation(np.unique(conv))
    fold = dict(zip(ids.tolist(), np.arange(ids.size) % cal.REFIT_FOLDS))
    block_fold = np.array([fold[c] for c in conv.tolist()])
    for k in range(cal.REFIT_FOLDS):
        test = block_fold == k
        part = cal.fit_head_refit(z[~test], alpha[~test], mask[~test], x[~test], fitted["l2"])
        np.testing.assert_allclose(held[test], cal.head_logits(z[test], x[test], part), rtol=1e-6, atol=1e-6)

    def pooled_nll(logits):
        pred = cal.prefix_survival(cal.sigmoid(logits), mask)[mask]
        return cal.nll(pred, cal.prefix_survival(alpha, mask)[mask])

    assert pooled_nll(held) == pytest.approx(fitted["cv_nll"][repr(fitted["l2"])], rel=1e-9)
    assert pooled_nll(cal.head_logits(z, x, fitted)) < pooled_nll(held)

    few = cal.refit_served_head(z[:70], alpha[:70], mask[:70], x[:70], conv[:70], seed=0)
    assert few["out_of_fold"] is None  # no cross-validation, nothing held out


def test_folding_the_map_into_the_head_serves_it_and_leaves_the_rest(tmp_path):
    """sigmoid of the folded head's logit is sigmoid(a·(w·x + b) + c) on any input; every other tensor,
    and the file's metadata, stay as they were."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {
        cal.HEAD_WEIGHT: torch.randn(1, 6, generator=gen),
        cal.HEAD_BIAS: torch.randn(1, generator=gen),
        "markov_head.markov_w1.weight": torch.randn(5, 3, generator=gen),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt", "made_by": "elsewhere"})
    cal.fold_into_head(path, 0.4, -1.25)
    got = load_file(path)
    x = torch.randn(7, 6, generator=gen, dtype=torch.float64)
    want = 0.4 * (x @ tensors[cal.HEAD_WEIGHT].double().T + tensors[cal.HEAD_BIAS].double()) - 1.25
    torch.testing.assert_close(x @ got[cal.HEAD_WEIGHT].double().T + got[cal.HEAD_BIAS].double(), want)
    assert torch.equal(got["markov_head.markov_w1.weight"], tensors["markov_head.markov_w1.weight"])
    assert got[cal.HEAD_WEIGHT].dtype == torch.float32
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt", "made_by": "elsewhere"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no temporary left
    del got[cal.HEAD_WEIGHT]
    save_file(got, path)
    with pytest.raises(ValueError, match="no confidence head"):
        cal.fold_into_head(path, 1.0, 0.0)


def test_calibration_file_roundtrip_and_errors(tmp_path):
    path = cal.save_calibration(tmp_path / "calibration.json", [1.5, 2.0], {"objective": "nll"})
    assert cal.load_calibration(path) == [1.5, 2.0]
    path.write_text(json.dumps({"temperatures": [1.0, -2.0]}))
    with pytest.raises(ValueError, match="temperatures"):
        cal.load_calibration(path)
    with pytest.raises(ValueError, match="3 temperatures for 2"):
        cal.scaled_confidence(np.zeros((1, 2)), [1.0, 1.0, 1.0])


def logit(p):
    p = np.asarray(p, np.float64)
    return np.log(p / (1 - p))


def test_verification_budget_hand_example():
    """Two blocks of 2 slots: one sure (α 0.9, 0.9), one hopeless (α 0.1, 0.1), the head knowing which.

    Verifying every slot: τ = 1 + ((0.9 + 0.81) + (0.1 + 0.01)) / 2 = 1.91, 2 drafts a block. Within a
    1% loss (τ ≥ 1.8909) the head can drop the hopeless block's second slot (τ 1.905, 1.5 drafts: 25%
    saved). A fixed budget of s = 1 + f slots has τ = 1.5 + f (0.81 + 0.01) / 2, within the loss from
    f = 0.3909 / 0.41 = 0.9534 on: 1.96 slots on its grid of 1/100, 2% saved."""
    alpha = np.array([[0.9, 0.9], [0.1, 0.1]])
    mask = np.ones_like(alpha, bool)
    data = (logit(alpha), alpha, mask)
    out = cal.verification_budget(data, data, None, max_tau_loss=0.01)
    assert out["all_slots"] == pytest.approx({"tau": 1.91, "sent": 2.0})
    assert out["confidence"]["saved"] == pytest.approx(0.25) and out["confidence"]["tau"] == pytest.approx(1.905)
    assert out["confidence"]["tau_loss"] == pytest.approx(1 - 1.905 / 1.91)
    assert out["fixed"]["setting"] == pytest.approx(1.96) and out["fixed"]["saved"] == pytest.approx(0.02)
    assert out["fixed"]["tau"] == pytest.approx(1.5 + 0.96 * 0.41)
    assert out["oracle"]["saved"] == pytest.approx(0.25)
    # with no loss allowed nothing can be dropped; with 30% (τ ≥ 1.337) the fixed budget gets below one
    # slot: τ = 1 + 0.5 s from s = 0.674 on, 0.68 on its grid
    assert cal.verification_budget(data, data, None, 0.0)["confidence"]["saved"] == 0.0
    loose = cal.verification_budget(data, data, None, 0.3)["fixed"]
    assert loose["setting"] == pytest.approx(0.68) and loose["tau"] == pytest.approx(1.34)


def test_verification_budget_picks_on_fit_and_reports_on_scored():
    """The setting comes from the fit samples; the scored samples only apply it. A head that is
    right on fit and inverted on scored keeps its fit threshold and loses τ on scored."""
    alpha = np.array([[0.9, 0.9], [0.1, 0.1]])
    mask = np.ones_like(alpha, bool)
    fit = (logit(alpha), alpha, mask)
    scored = (logit(alpha[::-1]), alpha, mask)  # the head swaps the two blocks
    out = cal.verification_budget(fit, scored, None, max_tau_loss=0.01)
    # fit threshold: survival ≥ 0.1 (keeps 3 of 4 slots); on scored the sure block's second slot
    # has survival 0.01 and is dropped: τ = 1 + (0.9 + 0.1 + 0.01) / 2
    assert out["confidence"]["tau"] == pytest.approx(1 + (0.9 + 0.1 + 0.01) / 2)
    assert out["confidence"]["tau_loss"] > 0.01


def test_verification_budget_computes_only_the_schedules_asked():
    """`schedules` leaves the others out (and the lead over the fixed budget, which needs both); what
    it computes is what the full call gives, SEs included."""
    rng = np.random.default_rng(2)
    alpha = rng.beta(2, 3, size=(200, 4))
    mask = np.arange(4)[None] < rng.integers(1, 5, size=(200, 1))
    data = (rng.normal(size=alpha.shape) + logit(np.clip(alpha, 1e-6, 1 - 1e-6)), alpha, mask)
    conversations = np.arange(200) // 5
    full = cal.verification_budget(data, data, None, 0.02, scored_conversations=conversations)
    one = cal.verification_budget(data, data, None, 0.02, scored_conversations=conversations, schedules=("confidence",))
    assert set(one) == {"max_tau_loss", "all_slots", "confidence"}
    assert one["confidence"] == pytest.approx(full["confidence"])
    assert "confidence_vs_fixed" in full


@pytest.mark.parametrize("seed", [0, 1])
def test_verification_budget_ranks_schedules(seed):
    """On random blocks (ragged masks): a head equal to the acceptance saves what the oracle saves;
    a head of noise saves no more than it; the saved shares match a naive per-block count."""
    rng = np.random.default_rng(seed)
    alpha = rng.beta(2, 3, size=(300, 4))
    mask = np.arange(4)[None] < rng.integers(1, 5, size=(300, 1))
    data = (logit(np.clip(alpha, 1e-6, 1 - 1e-6)), alpha, mask)
    exact = cal.verification_budget(data, data, None, 0.02)
    assert exact["confidence"]["saved"] == pytest.approx(exact["oracle"]["saved"], abs=0.02)
    noisy = (rng.normal(size=alpha.shape), alpha, mask)
    assert cal.verification_budget(noisy, noisy, None, 0.02)["confidence"]["saved"] <= exact["oracle"]["saved"] + 1e-9
    # naive: the fixed schedule's τ and drafts sent at its setting, block by block, its last slot
    # verified in a share of the blocks
    s = exact["fixed"]["setting"]
    taus, sent = [], []
    for a, m in zip(alpha, mask):
        run, tau, n = 1.0, 1.0, 0.0
        for j in range(int(m.sum())):
            share = min(1.0, max(0.0, s - j))
            run *= a[j]
            tau, n = tau + share * run, n + share
        taus.append(tau)
        sent.append(n)
    assert exact["fixed"]["tau"] == pytest.approx(np.mean(taus))
    assert exact["fixed"]["saved"] == pytest.approx(1 - np.mean(sent) / mask.sum(1).mean())
    assert exact["fixed"]["tau_loss"] <= 0.02 + 1e-9  # fit == scored here


def _random_blocks(rng, n, block=4):
    alpha = rng.beta(2, 3, size=(n, block))
    mask = np.arange(block)[None] < rng.integers(1, block + 1, size=(n, 1))
    head = logit(np.clip(alpha + rng.normal(0, 0.2, size=alpha.shape), 0.02, 0.98))
    return head, alpha, mask


def test_verification_budget_se_matches_the_clustered_delta_method():
    """The bootstrap SE of the share saved (a ratio of sums) against the linearized (delta-method)
    SE clustered by conversation, computed independently by `bench.ablate_stats`; the head's lead over
    the fixed budget is paired (its SE is that of the per-block difference, not the sum of the two)."""
    from bench.ablate_stats import clustered_mean_se

    rng = np.random.default_rng(3)
    fit, scored = _random_blocks(rng, 400), _random_blocks(rng, 400)
    conversations = np.repeat(np.arange(40), 10)
    out = cal.verification_budget(fit, scored, None, 0.02, scored_conversations=conversations)
    _, alpha, mask = scored
    full = mask.sum(1).astype(float)

    surv_head = cal.prefix_survival(cal.sigmoid(scored[0]), mask)
    setting = out["confidence"]["setting"]
    sent_conf = (mask & (surv_head >= setting)).sum(1).astype(float)
    ratio = sent_conf.sum() / full.sum()
    assert out["confidence"]["saved"] == pytest.approx(1 - ratio)
    _, delta_se = clustered_mean_se((sent_conf - ratio * full) / full.mean(), conversations)
    assert out["confidence"]["saved_se"] == pytest.approx(delta_se, rel=0.15)
    fixed = out["fixed"]["setting"]
    sent_fixed = (mask * np.clip(fixed - np.arange(4), 0, 1)[None]).sum(1)
    lead_ratio = (sent_fixed.sum() - sent_conf.sum()) / full.sum()
    lead = (sent_fixed - sent_conf - lead_ratio * full) / full.mean()
    _, lead_se = clustered_mean_se(lead, conversations)
    assert out["confidence_vs_fixed"]["saved"] == pytest.approx(out["confidence"]["saved"] - out["fixed"]["saved"])
    assert out["confidence_vs_fixed"]["se"] == pytest.approx(lead_se, rel=0.15)
    assert out["oracle"]["saved_se"] > 0 and out["fixed"]["tau_loss_se"] > 0


def test_verification_budget_se_is_clustered_by_conversation():
    """Ten copies of each block: counted as one conversation the copies add nothing (the SE stays that
    of the originals), counted as ten conversations they shrink it by about √10."""
    rng = np.random.default_rng(4)
    fit, scored = _random_blocks(rng, 300), _random_blocks(rng, 60)
    copies = tuple(np.repeat(a, 10, axis=0) for a in scored)
    once = cal.verification_budget(fit, scored, None, 0.02, scored_conversations=np.arange(60))
    together = cal.verification_budget(fit, copies, None, 0.02, scored_conversations=np.repeat(np.arange(60), 10))
    apart = cal.verification_budget(fit, copies, None, 0.02, scored_conversations=np.arange(600))
    assert together["confidence"]["saved"] == pytest.approx(once["confidence"]["saved"])
    assert together["confidence"]["saved_se"] == pytest.approx(once["confidence"]["saved_se"], rel=0.1)
    assert apart["confidence"]["saved_se"] == pytest.approx(once["confidence"]["saved_se"] / np.sqrt(10), rel=0.15)
    assert "saved_se" not in cal.verification_budget(fit, scored, None, 0.02)["confidence"]
