"""The confidence head refitted on held-out conversations against the plain served map, paired.

`make eval` folds one slope and intercept, fitted on half of the held-out conversations, into the
head vLLM serves (`eval.calibration.fit_served_scaling`). This asks what a refit of the whole head
on the same half buys: `refit_served_head` keeps the trained head's logit, rescaled,
and adds a ridge-penalized linear correction on the features the head reads (its strength, or none,
cross-validated over the fit half's conversations). Both maps are scored on the other half, with
the per-position AUROC, the pooled ECE and NLL, and the drafts the verification budget spares, each
difference paired and its SE a bootstrap over the scored conversations.

    python -m bench.confidence_refit drafter=DIR bench_data=NAME out=FILE.json [eval overrides]
"""

from __future__ import annotations

import datetime
import math

import numpy as np
from tqdm import tqdm

from bench.ablate_record import file_fingerprint, git_state, store_fingerprint
from dspark.entry import script_main
from dspark.eval import calibration as cal

ROUNDS = 500  # conversation resamples behind each paired SE


REFIT_L2 = (1.0, 1e-1, 1e-2, 1e-3)
"""Ridge strengths `refit_served_head` chooses among (on standardized features), with the plain map."""
REFIT_FOLDS = 4
"""Folds of conversations the choice is cross-validated on."""


def fit_head_refit(
    conf_logits: np.ndarray, alpha: np.ndarray, slot_mask: np.ndarray, features: np.ndarray, l2: float
) -> dict:
    """The head refitted around its own logit: a·z + c + x·δ + d, minimizing the survival NLL of
    `fit_served_scaling` plus l2·‖δ_s‖², δ_s the correction on features standardized over the valid
    slots (so l2 → ∞ gives `fit_served_scaling`'s map). conf_logits, alpha, slot_mask [n, B];
    features [n, B, F] what the head reads. Returns {slope, intercept, weight_delta [F], bias_delta}
    in the raw features' units: the head w·x + b becomes (a·w + δ)·x + a·b + c + d."""
    import torch

    mask = np.asarray(slot_mask, bool)
    dim = features.shape[-1]
    if not mask.any():
        return {"slope": 1.0, "intercept": 0.0, "weight_delta": np.zeros(dim), "bias_delta": 0.0}
    z = torch.as_tensor(np.asarray(conf_logits, np.float64))
    valid = torch.as_tensor(mask)
    label = torch.as_tensor(cal.prefix_survival(alpha, mask))[valid]
    x = torch.as_tensor(np.asarray(features)).double()
    mean = x[valid].mean(0)
    std = x[valid].std(0).nan_to_num(0.0) + 1e-6
    xs = (x - mean) / std
    scale = torch.zeros(2, dtype=torch.float64, requires_grad=True)  # log a, c
    delta = torch.zeros(dim, dtype=torch.float64, requires_grad=True)
    cal.minimize_lbfgs(
        [scale, delta],
        lambda: cal.survival_nll(scale[0].exp() * z + scale[1] + xs @ delta, label, valid) + l2 * (delta * delta).sum(),
    )
    with torch.no_grad():
        log_a, c = scale.tolist()
        weight_delta = delta / std
        return {
            "slope": math.exp(log_a),
            "intercept": c,
            "weight_delta": weight_delta.numpy(),
            "bias_delta": float(-(weight_delta * mean).sum()),
        }


def head_logits(conf_logits: np.ndarray, features: np.ndarray, refit: dict) -> np.ndarray:
    """The refitted head's logits [n, B] from the trained head's [n, B] and its features [n, B, F]."""
    correction = np.asarray(features, np.float64) @ refit["weight_delta"] + refit["bias_delta"]
    return refit["slope"] * np.asarray(conf_logits, np.float64) + refit["intercept"] + correction


def refit_served_head(
    conf_logits: np.ndarray,
    alpha: np.ndarray,
    slot_mask: np.ndarray,
    features: np.ndarray,
    conversations: np.ndarray,
    seed: int,
    l2_grid: tuple[float, ...] = REFIT_L2,
    folds: int = REFIT_FOLDS,
) -> dict:
    """`fit_head_refit` at the ridge strength (or none: the plain map, `l2` None) whose survival NLL is
    lowest over `folds` folds of whole conversations (`conversations` [n]), refitted on every block.

    Returns the map ({slope, intercept, weight_delta, bias_delta}; a zero correction for the plain map),
    the chosen `l2` and `cv_nll` per candidate. Under 2 conversations per fold the plain map is kept."""
    mask = np.asarray(slot_mask, bool)
    ids = np.random.default_rng(seed).permutation(np.unique(conversations))
    fold_of = dict(zip(ids.tolist(), np.arange(ids.size) % folds))
    block_fold = np.array([fold_of[c] for c in np.asarray(conversations).tolist()], dtype=int)
    candidates: list[float | None] = [None, *l2_grid]
    cv: dict = {}
    if ids.size >= 2 * folds:
        bar = tqdm(total=len(candidates) * folds, desc="refit cross-validation", unit="fit")
        for l2 in candidates:
            total, count = 0.0, 0
            for k in range(folds):
                bar.update()
                train, test = block_fold != k, block_fold == k
                if l2 is None:
                    a, c = cal.fit_served_scaling(conf_logits[train], alpha[train], mask[train])
                    logits = a * np.asarray(conf_logits[test], np.float64) + c
                else:
                    part = fit_head_refit(conf_logits[train], alpha[train], mask[train], features[train], l2)
                    logits = head_logits(conf_logits[test], features[test], part)
                pred = cal.prefix_survival(cal.sigmoid(logits), mask[test])[mask[test]]
                label = cal.prefix_survival(alpha[test], mask[test])[mask[test]]
                total += cal.nll(pred, label) * pred.size
                count += pred.size
            cv["none" if l2 is None else repr(l2)] = total / max(count, 1)
        bar.close()
        best = min(candidates, key=lambda l2: cv["none" if l2 is None else repr(l2)])
    else:
        best = None
    if best is None:
        a, c = cal.fit_served_scaling(conf_logits, alpha, mask)
        fitted = {"slope": a, "intercept": c, "weight_delta": np.zeros(features.shape[-1]), "bias_delta": 0.0}
    else:
        fitted = fit_head_refit(conf_logits, alpha, mask, features, best)
    return {**fitted, "l2": best, "cv_nll": cv}


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
    refit = refit_served_head(z[fit], alpha[fit], mask[fit], x[fit], table.sample_id[fit], heldout.seed)
    logits = {"served": slope * z + intercept, "refit": head_logits(z, x, refit)}
    heads, budgets = {}, {}
    for name, lg in logits.items():
        budget = cal.verification_budget(
            (lg[fit], alpha[fit], mask[fit]),
            (lg[scored], alpha[scored], mask[scored]),
            None,
            ecfg.calibration.max_tau_loss,
            scored_conversations=table.sample_id[scored],
            seed=heldout.seed,
        )
        budgets[name] = budget
        survival = cal.prefix_survival(cal.sigmoid(lg[scored]), mask[scored])
        setting = budget["confidence"]["setting"]
        heads[name] = (lg[scored], cal.verified_slots("confidence", setting, survival, None, mask[scored]))
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
            "l2": refit["l2"],
            "cv_nll": refit["cv_nll"],
            "slope": refit["slope"],
            "intercept": refit["intercept"],
            "weight_delta_norm": float(np.linalg.norm(refit["weight_delta"])),
        },
        "scored": paired(
            heads, alpha[scored], mask[scored], table.sample_id[scored], ecfg.calibration.n_bins, heldout.seed
        ),
        "budget": budgets,
    }


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
    return 0


if __name__ == "__main__":
    script_main(main)
