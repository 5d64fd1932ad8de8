"""report.json and its plots (PNG, matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

REPORT_FILE = "report.json"


def _finite(obj):
    """JSON has no NaN/Infinity: undefined figures (e.g. AUROC of one class) become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_report(report: dict, out_dir: str | Path, name: str = REPORT_FILE) -> Path:
    """Write `out_dir/name` atomically (a reader never sees half a report); NaN/inf become null."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(_finite(report), indent=2, allow_nan=False, default=str) + "\n")
    os.replace(tmp, path)
    return path


def read_report(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_acceptance_by_position(report: dict, path: Path) -> Path | None:
    """Offline cumulative / conditional acceptance per slot, and served per-position acceptance."""
    offline = (report.get("offline") or {}).get("overall")
    served = [r for r in (report.get("online") or {}).get("runs", []) if r.get("per_position_acceptance")]
    if not offline and not served:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    if offline:
        pos = range(1, len(offline["cumulative"]) + 1)
        ax.plot(pos, offline["cumulative"], "o-", label="offline cumulative Π α")
        ax.plot(pos, offline["conditional"], "s--", label="offline conditional α")
    for run in served:
        values = run["per_position_acceptance"]
        ax.plot(range(1, len(values) + 1), values, "^:", label=f"served {run['name']}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_tau_by_bucket(report: dict, path: Path) -> Path | None:
    """τ per sequence-length bucket, anchor-position bucket and source (one panel each)."""
    offline = report.get("offline") or {}
    groups = [
        (key, title)
        for key, title in (
            ("by_length", "sequence length"),
            ("by_anchor_position", "anchor position"),
            ("by_source", "source"),
        )
        if offline.get(key)
    ]
    if not groups:
        return None
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.8), squeeze=False)
    for ax, (key, title) in zip(axes[0], groups):
        names = list(offline[key])
        ax.bar(range(len(names)), [offline[key][n]["tau"] for n in names], color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.axhline(offline["overall"]["tau"], color="k", lw=0.8, ls="--", label="overall")
        ax.set_title(f"τ by {title}")
        ax.set_ylabel("τ (tokens per block)")
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_training(curves: dict, path: Path) -> Path | None:
    """Training loss and held-out τ over steps (from the run's metrics.jsonl)."""
    panels = [(k, v) for k, v in curves.items() if v]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.5), squeeze=False)
    for ax, (name, points) in zip(axes[0], panels):
        steps, values = zip(*points)
        ax.plot(steps, values, ".-" if len(points) < 50 else "-")
        ax.set_xlabel("step")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_reliability(calibration: dict, path: Path) -> Path | None:
    """Reliability curves of the prefix-survival prediction per position, before and after STS."""
    if not calibration or "before" not in calibration:
        return None
    before, after = calibration["before"]["reliability"], calibration["after"]["reliability"]
    fig, axes = plt.subplots(1, len(before), figsize=(3.2 * len(before), 3.4), squeeze=False)
    for k, ax in enumerate(axes[0]):
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8)
        for curve, style, label in ((before[k], "o-", "raw"), (after[k], "s-", "STS")):
            ax.plot(curve["mean_pred"], curve["mean_label"], style, ms=3, label=label)
        ax.set_title(f"position {k + 1}")
        ax.set_xlabel("predicted Π c")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        if k == 0:
            ax.set_ylabel("realized Π α")
            ax.legend(fontsize=8)
    return _save(fig, path)


def plot_online(report: dict, path: Path) -> Path | None:
    """Served decode speed of every run."""
    runs = (report.get("online") or {}).get("runs", [])
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(runs)), 3.5))
    ax.bar(range(len(runs)), [r["tokens_per_s"] for r in runs], color="tab:green")
    ax.set_xticks(range(len(runs)), [r["name"] for r in runs], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("output tokens / s (concurrency 1)")
    return _save(fig, path)


def write_plots(report: dict, out_dir: str | Path) -> list[str]:
    """Every plot the report has data for; returns the file names written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    made = [
        plot_acceptance_by_position(report, out_dir / "acceptance_by_position.png"),
        plot_tau_by_bucket(report, out_dir / "tau_by_bucket.png"),
        plot_training((report.get("training") or {}).get("curves", {}), out_dir / "training.png"),
        plot_reliability(report.get("calibration") or {}, out_dir / "calibration_reliability.png"),
        plot_online(report, out_dir / "online_speed.png"),
    ]
    return [p.name for p in made if p is not None]


__all__ = ["REPORT_FILE", "read_report", "write_plots", "write_report"]
