"""The statistics of `make ablate`: per-block held-out results, standard errors clustered by
conversation, and the table's rows.

Standard errors. One run's figure is a mean over held-out blocks b; the blocks of one
conversation share its text, so they are not independent, and a block-level SE
(sd/√n) is too small. The SE here is clustered by conversation c (the cluster-robust, or
sandwich, SE of a mean, with the small-sample factor C/(C−1)):

    SE² = C/(C−1) · Σ_c (Σ_{b∈c} (x_b − x̄))² / n²

over the n blocks of C conversations. With one block per conversation it is the plain sd/√n;
with equal-sized conversations it is sd(conversation means)/√C. A paired gain is the same
computation on the per-block differences (same blocks, same conversations). With fewer than
two conversations there is no estimate (NaN).

Over S seeds: the mean of the run means, with SE = √(sd_seed²/S + mean(SE_run²)): the seed
term is training noise (it shrinks with seeds), the run term is held-out sampling noise (every
seed is scored on the same blocks, so it does not shrink). Wall times have the seed term only.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import write_atomically


def clustered_mean_se(values: np.ndarray, clusters: np.ndarray) -> tuple[float, float]:
    """Mean of `values [n]` and its SE clustered by `clusters [n]` (see the module docstring)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return float("nan"), float("nan")
    mean = float(values.mean())
    _, cluster_of = np.unique(np.asarray(clusters), return_inverse=True)
    num_clusters = int(cluster_of.max()) + 1
    if num_clusters < 2:
        return mean, float("nan")
    sums = np.bincount(cluster_of, weights=values - mean, minlength=num_clusters)
    var = num_clusters / (num_clusters - 1) * float((sums**2).sum()) / values.size**2
    return mean, float(np.sqrt(var))


def combine_seeds(means: list[float], run_ses: list[float]) -> dict:
    """{mean, se, seeds}: SE = √(sd(means)²/S + mean(run SE²)) (see the module docstring)."""
    m = np.asarray(means, dtype=np.float64)
    a = np.asarray(run_ses, dtype=np.float64)
    seed_var = m.var(ddof=1) / m.size if m.size > 1 else 0.0
    return {"mean": float(m.mean()), "se": float(np.sqrt(seed_var + np.mean(a**2))), "seeds": int(m.size)}


@dataclass
class Blocks:
    """Per-block held-out results of one drafter (row = one block)."""

    alpha: np.ndarray  # [n, B] float64, 0 where unscored
    mask: np.ndarray  # [n, B] bool
    key: np.ndarray  # [n, 2] int64 (sample id, anchor position): the block's identity

    def select(self, rows: np.ndarray) -> Blocks:
        """The blocks of `rows` (a boolean mask or indices)."""
        return Blocks(self.alpha[rows], self.mask[rows], self.key[rows])

    @property
    def conversations(self) -> np.ndarray:
        """The conversation (sample id) of each block [n]: the SE's clusters."""
        return self.key[:, 0]

    @property
    def prefix(self) -> np.ndarray:
        """Π_{j≤k} α_j per slot [n, B] (0 from the first unscored slot on)."""
        return np.cumprod(self.alpha * self.mask, axis=1)

    @property
    def tau(self) -> np.ndarray:
        """τ per block [n] = 1 + Σ_k Π_{j≤k} α_j."""
        return 1.0 + self.prefix.sum(1)

    def save(self, path: Path) -> None:
        """Write atomically: a rerun finds the old file or the new one, never a torn one."""
        buffer = io.BytesIO()
        np.savez(buffer, alpha=self.alpha, mask=self.mask, key=self.key)
        write_atomically(path, buffer.getvalue())

    @classmethod
    def load(cls, path: Path) -> Blocks | None:
        """The blocks saved at `path`; None when the file is missing or unreadable (the run is redone)."""
        try:
            with np.load(path) as f:
                return cls(f["alpha"], f["mask"].astype(bool), f["key"])
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            return None


def over_seeds(values: list[np.ndarray], clusters: np.ndarray) -> dict:
    """{mean, se, seeds} of per-block values, one array per seed, all on the same blocks."""
    stats = [clustered_mean_se(v, clusters) for v in values]
    return combine_seeds([s[0] for s in stats], [s[1] for s in stats])


def ratio_over_seeds(num: list[np.ndarray], den: list[np.ndarray], clusters: np.ndarray) -> dict:
    """{mean, se, seeds} of a ratio of means, per-block values, one array per seed, all on the same
    blocks: per seed R = mean(num) / mean(den), its SE the delta method's (that of the linearized values
    (num − R·den) / mean(den), clustered by conversation); over seeds combined as every figure here
    (`combine_seeds`), so tables of one seed each merge into it exactly (`bench.ablate_merge`)."""
    ratios, ses = [], []
    for a, b in zip(num, den, strict=True):
        ratio = float(a.mean() / b.mean())
        ratios.append(ratio)
        ses.append(clustered_mean_se((a - ratio * b) / b.mean(), clusters)[1])
    return combine_seeds(ratios, ses)


def per_position(blocks: list[Blocks], field: str) -> dict:
    """Per-slot mean and SE of `prefix` (cumulative) or `alpha` (conditional) over scored slots, combined over seeds."""
    width = blocks[0].mask.shape[1]
    out = {"mean": [], "se": []}
    for k in range(width):
        stats = [clustered_mean_se(getattr(b, field)[b.mask[:, k], k], b.conversations[b.mask[:, k]]) for b in blocks]
        row = combine_seeds([s[0] for s in stats], [s[1] for s in stats])
        out["mean"].append(row["mean"])
        out["se"].append(row["se"])
    return out


def paired_gain(mine: list[Blocks], theirs: dict, variant: str, budget: int, seeds: list[int]) -> dict | None:
    """τ − `variant`'s τ, paired block by block per seed; None unless `variant` ran on every one of `seeds`."""
    if not all((variant, budget, s) in theirs for s in seeds):
        return None
    return over_seeds([b.tau - theirs[variant, budget, s].tau for b, s in zip(mine, seeds)], mine[0].conversations)


def by_source(
    mine: list[Blocks], blocks: dict, names: dict[str, str | None], budget: int, seeds: list[int], labels: np.ndarray
) -> dict:
    """Per held-out source: its conversations and blocks, τ, and each gain of `names` ({column: variant})."""
    out = {}
    for label in sorted(set(labels.tolist())):
        rows = labels == label
        part = [b.select(rows) for b in mine]
        conversations = part[0].conversations
        figures = {
            "heldout_conversations": int(np.unique(conversations).size),
            "heldout_blocks": int(conversations.size),
            "tau": over_seeds([b.tau for b in part], conversations),
        }
        for column, variant in names.items():
            theirs = {
                (variant, budget, s): blocks[variant, budget, s].select(rows)
                for s in seeds
                if (variant, budget, s) in blocks
            }
            gain = None if variant is None else paired_gain(part, theirs, variant, budget, seeds)
            if gain is not None:
                figures[column] = gain
        out[str(label)] = figures
    return out


def summarize(
    runs: list[dict],
    blocks: dict,
    untrained: dict,
    reference: str,
    against: dict[str, str],
    sources: dict[int, str] | None = None,
) -> list[dict]:
    """One table row per (variant, budget): every figure as {mean, se, seeds}.

    `runs`: run records (variant, budget, seed, steps, train_tokens, wall_s, train_time_s); each row adds
    `train_tokens_per_s` (training tokens over the steps' time);
    `blocks[(variant, budget, seed)]` and `untrained[(variant, seed)]`: `Blocks` on the same held-out blocks;
    `reference`: the variant every `gain` is paired against; `against[variant]`: the variant its own
    decision is measured against (`gain_against`), where it names one. `trained_gain`: τ − the row's own
    untrained τ, paired; `gain_ratio` (rows other than the reference's, where it ran the same seeds): the
    reference's `trained_gain` over this row's, per seed (`ratio_over_seeds`). With `sources` (sample id ->
    source) naming more than one source, each row adds `by_source`: τ and the gains per source, their
    SEs clustered by conversation within it.
    """
    table = []
    for variant, budget in dict.fromkeys((r["variant"], r["budget"]) for r in runs):
        rows = sorted((r for r in runs if (r["variant"], r["budget"]) == (variant, budget)), key=lambda r: r["seed"])
        seeds = [r["seed"] for r in rows]
        mine = [blocks[variant, budget, s] for s in seeds]
        for b in [*mine, *(untrained[variant, s] for s in seeds)]:
            if not np.array_equal(b.key, mine[0].key):
                raise ValueError(f"variant {variant}: runs were scored on different held-out blocks")
        conversations = mine[0].conversations
        row = {
            "variant": variant,
            "budget": budget,
            "steps": rows[0]["steps"],
            "train_tokens": float(np.mean([r["train_tokens"] for r in rows])),
            "heldout_conversations": int(np.unique(conversations).size),
            "heldout_blocks": int(conversations.size),
            "tau": over_seeds([b.tau for b in mine], conversations),
            "untrained_tau": over_seeds([untrained[variant, s].tau for s in seeds], conversations),
            "accept": per_position(mine, "prefix"),
            "alpha": per_position(mine, "alpha"),
        }
        gained = [b.tau - untrained[variant, s].tau for b, s in zip(mine, seeds)]
        row["trained_gain"] = over_seeds(gained, conversations)
        gain = paired_gain(mine, blocks, reference, budget, seeds)
        if gain is not None:
            row["gain"] = gain
            if variant != reference and all((reference, s) in untrained for s in seeds):
                theirs = [blocks[reference, budget, s].tau - untrained[reference, s].tau for s in seeds]
                row["gain_ratio"] = ratio_over_seeds(theirs, gained, conversations)
        if variant in against:
            row["against"] = against[variant]
            gain = paired_gain(mine, blocks, against[variant], budget, seeds)
            if gain is not None:
                row["gain_against"] = gain
        if all((reference, s) in untrained for s in seeds):
            row["tau_per_mtok"] = over_seeds(
                [
                    (b.tau - untrained[reference, s].tau) / (r["train_tokens"] / 1e6)
                    for b, s, r in zip(mine, seeds, rows)
                ],
                conversations,
            )
        for key in ("wall_s", "train_time_s"):
            row[key] = combine_seeds([r[key] for r in rows], [0.0] * len(rows))
        # what a lever costs: equal steps are not equal GPU-hours when a lever slows the step
        speeds = [r["train_tokens"] / r["train_time_s"] if r["train_time_s"] > 0 else float("nan") for r in rows]
        row["train_tokens_per_s"] = combine_seeds(speeds, [0.0] * len(rows))
        labels = np.array([(sources or {}).get(int(c), "unknown") for c in conversations], dtype=object)
        if sources and len(set(labels.tolist())) > 1:
            names = {"gain": reference, "gain_against": against.get(variant)}
            row["by_source"] = by_source(mine, blocks, names, budget, seeds, labels)
        table.append(row)
    return table
