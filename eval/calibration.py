"""Confidence-head quality and per-position sequential temperature scaling (STS).

The quantity judged is the prefix-survival prediction P_k = Π_{j≤k} c_j, where
c_j = sigmoid(z_j / T_j) is the confidence head's probability that slot j is accepted
given every earlier slot was. It is compared with the *analytic* realized acceptance
y_k = Π_{j≤k} α_j, α_j = Σ_v min(q_j, p_j): the exact probability that the verifier
accepts slots 1..k, so no sampling noise enters the evaluation.

With soft labels y ∈ [0, 1]:
- ECE bins P by value (equal-width bins) and averages |mean P − mean y| by bin mass;
- Brier is mean (P − y)²;
- AUROC counts every example as a positive with weight y and a negative with weight 1 − y
  (for 0/1 labels this is the usual AUROC; for soft labels it is the AUROC of the expected
  confusion counts under Bernoulli(y) acceptance); ties count one half;
- NLL is the binary cross-entropy −[y log P + (1 − y) log(1 − P)].

Under soft labels no score reaches AUROC 1: every example counts as positive and negative at
once. The best any score can do is to rank by y itself (a score that orders the examples as y
does maximizes Σ y_i (1 − y_j) over the pairs it orders), so `auroc_ceiling` = AUROC(y, y) is
reported beside each AUROC: the head's ranking is judged against it, not against 1.

STS fits one temperature per position, position 1 first: T_k minimizes the NLL of
P_{k−1}·sigmoid(z_k / T_k) against y_k with T_1..T_{k−1} already fixed, because the
product at position k can only be as good as the prefix it multiplies.

vLLM serves neither: it reads sigmoid(w·x + b) of the drafter's one confidence head, shared by
every position, as each slot's acceptance probability, and weighs the running product against
its step costs as expected accepted tokens. The map it can be given is one slope and intercept
for every position, folded into the head's weights (`fit_served_scaling`, `fold_into_head`):
a·(w·x + b) + c. A temperature alone cannot move a head whose probabilities sit on the wrong side
of 1/2 (it only pulls them toward 1/2); the intercept can.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

EPS = 1e-7


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=np.float64)))


def prefix_survival(values: np.ndarray, slot_mask: np.ndarray) -> np.ndarray:
    """Π_{j≤k} values[:, j] for valid slots, 0 where the slot is invalid. [n, B] → [n, B]."""
    v = np.where(slot_mask, np.asarray(values, dtype=np.float64), 0.0)
    return np.cumprod(v, axis=1) * slot_mask


def scaled_confidence(conf_logits: np.ndarray, temperatures: np.ndarray | list[float] | None) -> np.ndarray:
    """c_k = sigmoid(z_k / T_k); T = None means unscaled."""
    z = np.asarray(conf_logits, dtype=np.float64)
    if temperatures is None:
        return sigmoid(z)
    t = np.asarray(temperatures, dtype=np.float64)
    if t.shape != (z.shape[1],):
        raise ValueError(f"calibration: {t.size} temperatures for {z.shape[1]} block positions")
    return sigmoid(z / t)


def ece(pred: np.ndarray, label: np.ndarray, n_bins: int) -> float:
    """Expected calibration error with equal-width bins over [0, 1]."""
    pred, label = np.asarray(pred, np.float64), np.asarray(label, np.float64)
    if pred.size == 0:
        return float("nan")
    bins = np.minimum((pred * n_bins).astype(np.int64), n_bins - 1)
    count = np.bincount(bins, minlength=n_bins)
    gap = np.abs(np.bincount(bins, pred, n_bins) - np.bincount(bins, label, n_bins))
    # Σ_b (n_b / N) |mean_pred_b − mean_label_b| = Σ_b |Σ pred − Σ label| / N
    return float(gap[count > 0].sum() / pred.size)


def brier(pred: np.ndarray, label: np.ndarray) -> float:
    pred, label = np.asarray(pred, np.float64), np.asarray(label, np.float64)
    return float(np.mean((pred - label) ** 2)) if pred.size else float("nan")


def nll(pred: np.ndarray, label: np.ndarray) -> float:
    p = np.clip(np.asarray(pred, np.float64), EPS, 1 - EPS)
    y = np.asarray(label, np.float64)
    return float(np.mean(-(y * np.log(p) + (1 - y) * np.log1p(-p)))) if p.size else float("nan")


def auroc(score: np.ndarray, label: np.ndarray) -> float:
    """AUROC with soft labels (positive weight y, negative weight 1 − y); ties count ½."""
    score, y = np.asarray(score, np.float64), np.asarray(label, np.float64)
    w_pos, w_neg = y, 1.0 - y
    total_pos, total_neg = w_pos.sum(), w_neg.sum()
    if total_pos <= 0 or total_neg <= 0:
        return float("nan")
    uniq, group = np.unique(score, return_inverse=True)
    pos_g = np.bincount(group, w_pos, uniq.size)
    neg_g = np.bincount(group, w_neg, uniq.size)
    neg_below = np.cumsum(neg_g) - neg_g
    return float((pos_g * (neg_below + 0.5 * neg_g)).sum() / (total_pos * total_neg))


def reliability_curve(pred: np.ndarray, label: np.ndarray, n_bins: int) -> dict:
    """Per-bin mean prediction, mean label and count (empty bins dropped)."""
    pred, label = np.asarray(pred, np.float64), np.asarray(label, np.float64)
    bins = np.minimum((pred * n_bins).astype(np.int64), n_bins - 1)
    count = np.bincount(bins, minlength=n_bins)
    keep = count > 0
    return {
        "mean_pred": (np.bincount(bins, pred, n_bins)[keep] / count[keep]).tolist(),
        "mean_label": (np.bincount(bins, label, n_bins)[keep] / count[keep]).tolist(),
        "count": count[keep].tolist(),
    }


def _scores(pred: np.ndarray, label: np.ndarray, n_bins: int) -> dict:
    return {
        "n": int(pred.size),
        "ece": ece(pred, label, n_bins),
        "auroc": auroc(pred, label),
        "auroc_ceiling": auroc(label, label),
        "brier": brier(pred, label),
        "nll": nll(pred, label),
        "mean_pred": float(pred.mean()) if pred.size else float("nan"),
        "mean_label": float(label.mean()) if label.size else float("nan"),
    }


def confidence_quality(
    conf_logits: np.ndarray,
    alpha: np.ndarray,
    slot_mask: np.ndarray,
    temperatures: np.ndarray | list[float] | None,
    n_bins: int,
) -> dict:
    """Scores of P_k vs y_k per position and pooled over all valid slots, plus reliability curves."""
    mask = np.asarray(slot_mask, bool)
    pred = prefix_survival(scaled_confidence(conf_logits, temperatures), mask)
    label = prefix_survival(alpha, mask)
    per_position = [_scores(pred[mask[:, k], k], label[mask[:, k], k], n_bins) for k in range(mask.shape[1])]
    return {
        "per_position": per_position,
        "pooled": _scores(pred[mask], label[mask], n_bins),
        "reliability": [
            reliability_curve(pred[mask[:, k], k], label[mask[:, k], k], n_bins) for k in range(mask.shape[1])
        ],
    }


def _minimize_log_t(objective, log_lo: float, log_hi: float, grid: int = 41, iters: int = 40) -> float:
    """Grid search then golden-section refinement of a 1-D objective over log T."""
    xs = np.linspace(log_lo, log_hi, grid)
    values = [objective(x) for x in xs]
    i = int(np.argmin(values))
    a, b = xs[max(i - 1, 0)], xs[min(i + 1, grid - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = objective(c), objective(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = objective(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = objective(d)
    best = min([(values[i], xs[i]), (fc, c), (fd, d)])
    return float(best[1])


def fit_sequential_temperatures(
    conf_logits: np.ndarray,
    alpha: np.ndarray,
    slot_mask: np.ndarray,
    t_min: float,
    t_max: float,
) -> list[float]:
    """STS: T_k minimizing NLL of P_{k−1}·sigmoid(z_k/T_k) vs y_k, positions in order.

    A position with no valid slot keeps T = 1.
    """
    z = np.asarray(conf_logits, np.float64)
    mask = np.asarray(slot_mask, bool)
    label = prefix_survival(alpha, mask)
    prefix = np.ones(z.shape[0])
    temperatures: list[float] = []
    for k in range(z.shape[1]):
        rows = mask[:, k]
        if not rows.any():
            temperatures.append(1.0)
            continue
        zk, yk, pk = z[rows, k], label[rows, k], prefix[rows]
        log_t = _minimize_log_t(
            lambda lt, pk=pk, zk=zk, yk=yk: nll(pk * sigmoid(zk / math.exp(lt)), yk), math.log(t_min), math.log(t_max)
        )
        temperatures.append(math.exp(log_t))
        prefix = prefix * sigmoid(z[:, k] / temperatures[-1])
    return temperatures


def _survival_nll(logits, label, valid):
    """Mean NLL of the prefix survival Π_{j≤k} sigmoid(logits_j) against `label` over the valid slots
    (the pooled `nll` of `confidence_quality`). logits [n, B] (torch), label [valid slots], valid [n, B]."""
    import torch

    log_c = torch.nn.functional.logsigmoid(logits).masked_fill(~valid, 0.0)
    pred = log_c.cumsum(1)[valid].exp().clamp(EPS, 1 - EPS)
    return -(label * pred.log() + (1 - label) * torch.log1p(-pred)).mean()


def _lbfgs(params: list, objective) -> None:
    """Minimize `objective()` over `params` in place (full-batch L-BFGS with a strong-Wolfe line search)."""
    import torch

    opt = torch.optim.LBFGS(
        params, lr=1.0, max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-15, line_search_fn="strong_wolfe"
    )

    def closure():
        opt.zero_grad()
        value = objective()
        value.backward()
        return value

    opt.step(closure)


def fit_served_scaling(conf_logits: np.ndarray, alpha: np.ndarray, slot_mask: np.ndarray) -> tuple[float, float]:
    """(a, c), a > 0, minimizing the NLL of P_k = Π_{j≤k} sigmoid(a·z_j + c) against y_k pooled over
    every valid slot (the `nll` of `confidence_quality`'s pooled figures): one map for all positions,
    which keeps each position's ranking. (1, 0) where no slot is valid. [n, B] each."""
    import torch

    mask = np.asarray(slot_mask, bool)
    if not mask.any():
        return 1.0, 0.0
    z = torch.as_tensor(np.asarray(conf_logits, np.float64))
    valid = torch.as_tensor(mask)
    label = torch.as_tensor(prefix_survival(alpha, mask))[valid]
    params = torch.zeros(2, dtype=torch.float64, requires_grad=True)  # log a, c
    _lbfgs([params], lambda: _survival_nll(params[0].exp() * z + params[1], label, valid))
    log_a, c = params.detach().tolist()
    return math.exp(log_a), c


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
    label = torch.as_tensor(prefix_survival(alpha, mask))[valid]
    x = torch.as_tensor(np.asarray(features)).double()
    mean = x[valid].mean(0)
    std = x[valid].std(0).nan_to_num(0.0) + 1e-6
    xs = (x - mean) / std
    scale = torch.zeros(2, dtype=torch.float64, requires_grad=True)  # log a, c
    delta = torch.zeros(dim, dtype=torch.float64, requires_grad=True)
    _lbfgs(
        [scale, delta],
        lambda: _survival_nll(scale[0].exp() * z + scale[1] + xs @ delta, label, valid) + l2 * (delta * delta).sum(),
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


def plain_map(conf_logits: np.ndarray, alpha: np.ndarray, slot_mask: np.ndarray, dim: int) -> dict:
    """`fit_served_scaling`'s slope and intercept as a refit with no correction (features of `dim`)."""
    slope, intercept = fit_served_scaling(conf_logits, alpha, slot_mask)
    return {"slope": slope, "intercept": intercept, "weight_delta": np.zeros(dim), "bias_delta": 0.0}


def _candidate(l2: float | None) -> str:
    """A ridge strength's key in `refit_served_head`'s `cv_nll` ("none": the plain map)."""
    return "none" if l2 is None else repr(l2)


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
    the chosen `l2`, `cv_nll` per candidate and `out_of_fold` [n, B]: each block's logits under the
    chosen candidate fitted without its fold, what a threshold picked on these blocks must read (the
    final map has seen them, and its logits there are optimistic). Under 2 conversations per fold the
    plain map is kept, with no cross-validation and `out_of_fold` None."""
    mask = np.asarray(slot_mask, bool)
    dim = features.shape[-1]
    ids = np.random.default_rng(seed).permutation(np.unique(conversations))
    fold_of = dict(zip(ids.tolist(), np.arange(ids.size) % folds))
    block_fold = np.array([fold_of[c] for c in np.asarray(conversations).tolist()], dtype=int)
    candidates: list[float | None] = [None, *l2_grid]
    cv: dict = {}
    out_of_fold: dict = {}
    if ids.size >= 2 * folds:
        bar = tqdm(total=len(candidates) * folds, desc="refit cross-validation", unit="fit")
        for l2 in candidates:
            total, count = 0.0, 0
            held = np.zeros(mask.shape, np.float64)
            for k in range(folds):
                train, test = block_fold != k, block_fold == k
                if l2 is None:
                    part = plain_map(conf_logits[train], alpha[train], mask[train], dim)
                else:
                    part = fit_head_refit(conf_logits[train], alpha[train], mask[train], features[train], l2)
                held[test] = head_logits(conf_logits[test], features[test], part)
                pred = prefix_survival(sigmoid(held[test]), mask[test])[mask[test]]
                label = prefix_survival(alpha[test], mask[test])[mask[test]]
                total += nll(pred, label) * pred.size
                count += pred.size
                bar.update()  # a fit counts once it is scored
            cv[_candidate(l2)], out_of_fold[_candidate(l2)] = total / max(count, 1), held
        bar.close()
        best = min(candidates, key=lambda l2: cv[_candidate(l2)])
    else:
        best = None
    if best is None:
        fitted = plain_map(conf_logits, alpha, mask, dim)
    else:
        fitted = fit_head_refit(conf_logits, alpha, mask, features, best)
    return {**fitted, "l2": best, "cv_nll": cv, "out_of_fold": out_of_fold.get(_candidate(best))}


def threshold_logits(refit: dict | None, own: np.ndarray) -> np.ndarray:
    """The fit samples' logits a verification budget's threshold is picked on: a refit's out-of-fold
    logits where it was cross-validated (its own logits on the samples it was fitted on flatter it, and
    the threshold would carry over to new conversations with more τ lost), else the map's `own` [n, B]."""
    if refit is not None and refit["out_of_fold"] is not None:
        return refit["out_of_fold"]
    return own


def _truncated(keep: np.ndarray, label: np.ndarray) -> tuple[float, float]:
    """(τ, drafts sent) per block, mean over blocks, when slot k of a block is verified with weight
    `keep` [n, B] (a prefix: slot k counts only with every earlier one)."""
    return float(1.0 + (label * keep).sum(1).mean()), float(keep.sum(1).mean())


SCHEDULES = ("fixed", "confidence", "oracle")
"""`fixed` verifies the first s slots of every block whatever the head says (s fractional: slot
⌊s⌋+1 in a share s − ⌊s⌋ of the blocks, drawn independently of the blocks, so τ and drafts sent
are linear between whole s): the baseline a head must beat at the same τ. `confidence` verifies
the slots whose predicted survival P_k reaches a threshold (P is non-increasing in k, so they are
a prefix of the block); `oracle` thresholds the analytic survival y_k itself (the ceiling of any
ranking)."""


def _threshold_score(name: str, pred: np.ndarray, label: np.ndarray) -> np.ndarray:
    """What a threshold schedule ranks slots by [n, B]: the head's survival, or the true one (oracle)."""
    return pred if name == "confidence" else label


def _settings(name: str, pred: np.ndarray, label: np.ndarray, mask: np.ndarray) -> list[float]:
    """The settings a schedule is tried at: slot counts in steps of 1/100 for `fixed`, else thresholds
    (score quantiles)."""
    if name == "fixed":
        return np.linspace(0.0, mask.shape[1], 100 * mask.shape[1] + 1).tolist()
    score = _threshold_score(name, pred, label)
    return np.unique(np.quantile(score[mask], np.linspace(0.0, 1.0, 201))).tolist() if mask.any() else [0.0]


def verified_slots(name: str, setting: float, pred: np.ndarray, label: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Share of each slot [n, B] one schedule verifies at `setting` (0 or 1 but for `fixed`'s last slot)."""
    if name == "fixed":
        return mask * np.clip(setting - np.arange(mask.shape[1]), 0.0, 1.0)[None]
    return (mask & (_threshold_score(name, pred, label) >= setting)).astype(np.float64)


BOOTSTRAP_ROUNDS = 2000
"""Resamples of the scored conversations behind each verification-budget standard error."""


def _conversation_bootstrap(
    per_block: dict[str, np.ndarray], clusters: np.ndarray, rounds: int, seed: int
) -> dict[str, np.ndarray]:
    """Each per-block quantity's total [rounds] over resamples of whole conversations (with replacement).

    `per_block` maps a name to a per-block quantity [n]; blocks of one conversation (`clusters` [n])
    stay together, so the bootstrap is clustered by conversation."""
    _, cluster_of = np.unique(np.asarray(clusters), return_inverse=True)
    num = int(cluster_of.max()) + 1
    weights = np.random.default_rng(seed).multinomial(num, np.full(num, 1.0 / num), size=rounds)  # [rounds, C]
    return {k: weights @ np.bincount(cluster_of, weights=v, minlength=num) for k, v in per_block.items()}


def verification_budget(
    fit: tuple[np.ndarray, np.ndarray, np.ndarray],
    scored: tuple[np.ndarray, np.ndarray, np.ndarray],
    temperatures: list[float] | None,
    max_tau_loss: float,
    scored_conversations: np.ndarray | None = None,
    seed: int = 0,
    schedules: tuple[str, ...] = SCHEDULES,
) -> dict:
    """Draft tokens a schedule spares the verifier at a bounded loss of acceptance length.

    `fit` and `scored` are (conf_logits, alpha, slot_mask) of disjoint samples. Each schedule
    (`SCHEDULES`) takes the setting that sends the fewest drafts on the fit samples with τ at least
    (1 − max_tau_loss) of verifying every slot; the figures are that setting's on the scored samples:
    τ, drafts sent per block and the share of drafts saved, each against verifying every slot.
    This is the offline side of adaptive verification: vLLM picks the drafts to send from the same
    survival P_k, weighed by step costs profiled on the serving GPU (`eval.decode` replays that rule).

    With `scored_conversations` (the conversation of each scored block [n]) every schedule's `saved`
    and `tau_loss` get a standard error (`saved_se`, `tau_loss_se`: a bootstrap over the scored
    conversations, `BOOTSTRAP_ROUNDS` resamples from `seed`, the settings held fixed), and
    `confidence_vs_fixed` is the head's paired lead over the fixed budget in drafts saved (where both
    are among `schedules`, the ones computed)."""

    def parts(split):
        logits, alpha, slot_mask = split
        mask = np.asarray(slot_mask, bool)
        return prefix_survival(scaled_confidence(logits, temperatures), mask), prefix_survival(alpha, mask), mask

    fit_parts, scored_parts = parts(fit), parts(scored)
    floor = (1.0 - max_tau_loss) * _truncated(fit_parts[2], fit_parts[1])[0]
    full_tau, full_sent = _truncated(scored_parts[2], scored_parts[1])
    out = {"max_tau_loss": max_tau_loss, "all_slots": {"tau": full_tau, "sent": full_sent}}
    kept = {}
    for name in schedules:
        # the setting sending the fewest drafts on the fit samples within the loss (verifying every
        # slot always is), then applied as it is to the scored samples
        tried = [
            _truncated(verified_slots(name, t, *fit_parts), fit_parts[1]) + (t,) for t in _settings(name, *fit_parts)
        ]
        setting = min((sent, t) for tau, sent, t in tried if tau >= floor - 1e-12)[1]
        tau, sent = _truncated(verified_slots(name, setting, *scored_parts), scored_parts[1])
        out[name] = {
            "setting": setting,
            "tau": tau,
            "tau_loss": 1.0 - tau / full_tau,
            "sent": sent,
            "saved": 1.0 - sent / full_sent if full_sent else 0.0,
        }
        kept[name] = verified_slots(name, setting, *scored_parts)
    if scored_conversations is not None:
        _budget_errors(out, kept, scored_parts, scored_conversations, seed)
    return out


def _budget_errors(out: dict, kept: dict, scored_parts: tuple, conversations: np.ndarray, seed: int) -> None:
    """Add the bootstrap SEs of `verification_budget` to `out` (each schedule's verified slots `kept`)."""
    _, label, mask = scored_parts
    per_block = {"blocks": np.ones(len(mask)), "accepted": (label * mask).sum(1), "sent": mask.sum(1, dtype=float)}
    for name, keep in kept.items():
        per_block[f"{name}.accepted"], per_block[f"{name}.sent"] = (label * keep).sum(1), keep.sum(1)

    sums = _conversation_bootstrap(per_block, conversations, BOOTSTRAP_ROUNDS, seed)  # each [rounds]
    full_tau = 1.0 + sums["accepted"] / sums["blocks"]
    saved = {name: 1.0 - sums[f"{name}.sent"] / np.maximum(sums["sent"], 1e-12) for name in kept}
    for name in kept:
        tau_loss = 1.0 - (1.0 + sums[f"{name}.accepted"] / sums["blocks"]) / full_tau
        out[name]["tau_loss_se"], out[name]["saved_se"] = float(tau_loss.std(ddof=1)), float(saved[name].std(ddof=1))
    if not {"confidence", "fixed"} <= kept.keys():
        return
    lead = saved["confidence"] - saved["fixed"]
    out["confidence_vs_fixed"] = {
        "saved": out["confidence"]["saved"] - out["fixed"]["saved"],
        "se": float(lead.std(ddof=1)),
    }


def save_calibration(path: str | Path, temperatures: list[float], meta: dict) -> Path:
    """Write the fitted temperatures beside the drafter (json: temperatures + how they were fitted)."""
    path = Path(path)
    path.write_text(
        json.dumps({"method": "sequential_temperature_scaling", "temperatures": temperatures, **meta}, indent=2)
    )
    return path


def load_calibration(path: str | Path) -> list[float]:
    data = json.loads(Path(path).read_text())
    temps = data.get("temperatures")
    if not isinstance(temps, list) or not all(isinstance(t, (int, float)) and t > 0 for t in temps):
        raise ValueError(f"{path}: field 'temperatures' must be a list of positive numbers, got {temps!r}")
    return [float(t) for t in temps]


HEAD_WEIGHT, HEAD_BIAS = "confidence_head.proj.weight", "confidence_head.proj.bias"
"""The confidence head's tensors in a drafter's `model.safetensors`: what vLLM's DSpark model loads."""


def scaled_head(weight, bias, slope: float, intercept: float, weight_delta=None, bias_delta: float = 0.0) -> tuple:
    """The linear head (w, b) whose logit is a·(w·x + b) + c, plus a refit's correction δ·x + d
    (`refit_served_head`), in the tensors' own dtype. weight [1, F], bias [1], weight_delta [F] or None."""
    import torch

    new_weight = weight.double() * slope
    if weight_delta is not None:
        new_weight = new_weight + torch.as_tensor(np.asarray(weight_delta), dtype=torch.float64).reshape(weight.shape)
    return new_weight.to(weight.dtype), (bias.double() * slope + intercept + bias_delta).to(bias.dtype)


def fold_into_head(
    weights_file: str | Path, slope: float, intercept: float, weight_delta=None, bias_delta: float = 0.0
) -> None:
    """Rewrite the drafter's confidence head as a·(w·x + b) + c + δ·x + d (`scaled_head`; the file
    replaced whole, atomically; every other tensor and the file's metadata as they were)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = Path(weights_file)
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    if HEAD_WEIGHT not in tensors:
        raise ValueError(f"{path}: no {HEAD_WEIGHT}: the drafter has no confidence head to calibrate")
    weight = tensors[HEAD_WEIGHT]
    bias = tensors.get(HEAD_BIAS, torch.zeros(1, dtype=weight.dtype))
    tensors[HEAD_WEIGHT], tensors[HEAD_BIAS] = scaled_head(weight, bias, slope, intercept, weight_delta, bias_delta)
    tmp = path.with_name(f".{path.name}.tmp")  # hidden, as the project's other atomic writes: never loaded
    save_file(tensors, tmp, metadata=metadata)
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
