"""The confidence head refitted on held-out conversations against the plain served map, paired.

`make eval` folds one slope and intercept, fitted on half of the held-out conversations, into the
head vLLM serves (`eval.calibration.fit_served_scaling`). This asks what a refit of the whole head
on the same half buys: `eval.calibration.refit_served_head` keeps the trained head's logit, rescaled,
and adds a ridge-penalized linear correction on the features the head reads (its strength, or none,
cross-validated over the fit half's conversations). Both maps are scored on the other half, with
the per-position AUROC, the pooled ECE and NLL, and the drafts the verification budget spares, each
difference paired and its SE a bootstrap over the scored conversations. Each budget's threshold is
picked on the fit half as `make eval` picks it: on the refit's out-of-fold logits, on the plain map's
own. A threshold picked on the fit half carries over to the scored half with some τ loss of its own,
which differs between the maps, so `at_equal_tau_loss` also compares the drafts spared at the threshold
each map needs on the scored half itself to lose the same τ (the ranking alone; its SE holds those
thresholds fixed).

    python -m bench.confidence_refit drafter=DIR bench_data=NAME out=FILE.json [eval overrides]
"""

from __future__ import annotations

import datetime

import numpy as np

from bench.ablate_record import file_fingerprint, git_state, store_fingerprint
from dspark.entry import script_main
from dspark.eval import calibration as cal

ROUNDS = 500  # conversation resamples behind each paired SE


def _scores(logits: np.ndarray, alpha: np.ndarray, mask: np.ndarray, kept: np.ndarray, n_bins: int) -> np.ndarray:
    """[AUROC per position..., pooled ECE, pooled NLL, drafts saved] of one head on some blocks."""
    pred = cal.prefix_survival(cal.sigmoid(logits), mask)
    label = cal.prefix_survival(alpha, mask)
    aurocs = [cal.auroc(pred[mask[:, k], k], label[mask[:, k], k]) for k in range(mask.shape[1])]
    saved = 1.0 - kept.sum() / max(mask.sum(), 1)
    return np.array([*aurocs, cal.ece(pred[mask], label[mask], n_bins), cal.nll(pred[mask], label[mask]), saved])


def paired(heads: dict, alpha, mask, conversations, n_bins: int, seed: int) -> dict:
    """Each head's scores on the scored blocks and the last head's difference from the first, with
    bootstrap SEs over whole conversations. `heads`: name -> (logits [n, B], verified slots [n, B])."""
    names = [f"auroc_{k + 1}" for k in range(mask.shape[1])] + ["ece", "nll", "saved"]
    point = {h: _scores(lg, alpha, mask, kept, n_bins) for h, (lg, kept) in heads.items()}
    ids, inverse = np.unique(conversations, return_inverse=True)
    members = [np.flatnonzero(inverse == i) for i in range(ids.size)]
    rng = np.random.default_rng(seed)
    draws = {h: [] for h in heads}
    for _ in range(ROUNDS):
        idx = np.concatenate([members[i] for i in rng.integers(0, ids.size, ids.size)])
        for h, (lg, kept) in heads.items():
            draws[h].append(_scores(lg[idx], alpha[idx], mask[idx], kept[idx], n_bins))
    first, last = list(heads)
    diff = np.array(draws[last]) - np.array(draws[first])
    out = {h: {n: float(v) for n, v in zip(names, point[h], strict=True)} for h in heads}
    out[f"{last}_minus_{first}"] = {
        n: {"value": float(point[last][i] - point[first][i]), "se": float(diff[:, i].std(ddof=1))}
        for i, n in enumerate(names)
    }
    return out


def refit_figures(drafter: str, overrides: list[str]) -> dict:
    """The plain served map and the refit of `drafter`'s head, fitted on the fit half of `python -m eval`'s
    held-out store (under `overrides`) and scored on the other half, paired; with their provenance."""
    from bench.confidence_probe import capture
    from dspark.eval.evaluate import split_samples

    features, table, ecfg, heldout, _ = capture(drafter, overrides)
    x = features["both"].double().numpy()
    fit_ids, _ = split_samples(table.sample_id, ecfg.calibration.fit_fraction, heldout.seed)
    fit = np.isin(table.sample_id, fit_ids)
    scored = ~fit
    z, alpha, mask = np.asarray(table.conf_logits, np.float64), table.alpha, np.asarray(table.slot_mask, bool)
    slope, intercept = cal.fit_served_scaling(z[fit], alpha[fit], mask[fit])
    refit = cal.refit_served_head(z[fit], alpha[fit], mask[fit], x[fit], table.sample_id[fit], heldout.seed)
    logits = {"served": slope * z + intercept, "refit": cal.head_logits(z, x, refit)}
    conversations, bound = table.sample_id[scored], ecfg.calibration.max_tau_loss
    heads, budgets, matched_heads, matched_loss = {}, {}, {}, {}
    # each threshold is picked on the fit half as `make eval` picks it
    on_fit = {"served": logits["served"][fit], "refit": cal.threshold_logits(refit, logits["refit"][fit])}
    for name, lg in logits.items():
        own = (lg[scored], alpha[scored], mask[scored])
        budgets[name] = cal.verification_budget(
            (on_fit[name], alpha[fit], mask[fit]),
            own,
            None,
            bound,
            scored_conversations=conversations,
            seed=heldout.seed,
        )
        heads[name] = (lg[scored], _verified(lg[scored], mask[scored], budgets[name]))
        # the threshold each map would need on the scored half itself to lose the same τ: drafts spared
        # at an equal τ loss, whatever either map's threshold carries over from the fit half
        matched = cal.verification_budget(own, own, None, bound, schedules=("confidence",))
        matched_heads[name] = (lg[scored], _verified(lg[scored], mask[scored], matched))
        matched_loss[name] = matched["confidence"]["tau_loss"]
    n_bins = ecfg.calibration.n_bins
    at_equal_loss = paired(matched_heads, alpha[scored], mask[scored], conversations, n_bins, heldout.seed)
    store = ecfg.store
    return {
        "made": {**git_state(), "date": datetime.date.today().isoformat()},
        "drafter": drafter,
        "drafter_model_safetensors_sha256": file_fingerprint(f"{drafter}/model.safetensors"),
        "eval_overrides": list(overrides),
        "eval_store": store,
        "eval_store_fingerprint": store_fingerprint(store),
        "fit_conversations": int(fit_ids.size),
        "scored_conversations": int(np.unique(table.sample_id[scored]).size),
        "served_map": {"slope": slope, "intercept": intercept},
        "refit": {
            "threshold_on": "fit half, out of fold" if refit["out_of_fold"] is not None else "fit half",
            "l2": refit["l2"],
            "cv_nll": refit["cv_nll"],
            "slope": refit["slope"],
            "intercept": refit["intercept"],
            "weight_delta_norm": float(np.linalg.norm(refit["weight_delta"])),
        },
        "scored": paired(heads, alpha[scored], mask[scored], conversations, n_bins, heldout.seed),
        "budget": budgets,
        "at_equal_tau_loss": {
            "tau_loss": matched_loss,
            "saved": {name: at_equal_loss[name]["saved"] for name in logits},
            "refit_minus_served": at_equal_loss["refit_minus_served"]["saved"],
        },
    }


def _verified(logits: np.ndarray, mask: np.ndarray, budget: dict) -> np.ndarray:
    """The slots [n, B] the confidence schedule of `budget` verifies of blocks with these head logits [n, B]."""
    survival = cal.prefix_survival(cal.sigmoid(logits), mask)
    return cal.verified_slots("confidence", budget["confidence"]["setting"], survival, None, mask)


def main(argv: list[str]) -> int:
    from bench import lever_data

    figures = lever_data.write_report(
        argv,
        "python -m bench.confidence_refit drafter=DIR bench_data=NAME out=FILE.json [eval overrides]",
        refit_figures,
    )
    refit = figures["refit"]
    print(f"refit l2 {refit['l2']} (cv nll {refit['cv_nll']})")
    for name in ("served", "refit"):
        print(f"{name:>7}: " + ", ".join(f"{k} {v:.4f}" for k, v in figures["scored"][name].items()))
    diff = figures["scored"]["refit_minus_served"]
    print("refit - served: " + ", ".join(f"{k} {v['value']:+.4f} ± {v['se']:.4f}" for k, v in diff.items()))
    equal = figures["at_equal_tau_loss"]
    print(
        "at an equal tau loss on the scored half ("
        + ", ".join(f"{k} {v:.4f}" for k, v in equal["tau_loss"].items())
        + f"): saved refit - served {equal['refit_minus_served']['value']:+.4f} ± {equal['refit_minus_served']['se']:.4f}"
    )
    return 0


if __name__ == "__main__":
    script_main(main)
