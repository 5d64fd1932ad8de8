"""Progress reporting of a training run (rank 0 only).

Three sinks: a progress bar (loss terms, τ, tokens/s, data-wait %, ETA), accelerate's
experiment trackers (`train.log_with`: TensorBoard events under `run_dir/tensorboard/`,
wandb, mlflow, ... as installed), and `run_dir/metrics.jsonl` with one JSON object per
line: `{"step": int, "split": "train" | "eval", <metric>: float, ...}` (train rows: `loss`,
each loss term, `lr`, `grad_norm`, `tokens_per_s`, `data_wait`, `epoch`; eval rows: `tau`,
`alpha_<k>` conditional and `accept_<k>` cumulative acceptance per slot and `blocks`, scored as
`make eval` scores them (the `heldout` protocol); one `data` row at step 0: `train_samples`,
`train_long_samples` (cut into windows), `train_windows` (their windows), `train_windows_left_out`
(windows with nothing to score), and `eval_samples` (the held-out samples every evaluation
scores, whole)). A resumed run first drops the rows logged after its checkpoint
(one atomic replace of the file), so the file reads as one run with every step once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from accelerate import Accelerator
from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"
BAR_KEYS = ("loss", "ce", "tv", "kl", "confidence", "hidden")


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop rows logged after `last_step` (work redone after a resume) and a torn last line."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # the write a killed run left half done
            continue
        if row["step"] <= last_step:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Reporter:
    """Rank 0's progress bar, experiment trackers and metrics.jsonl; every method is a no-op elsewhere."""

    def __init__(
        self,
        run_dir: Path,
        accelerator: Accelerator,
        *,
        run_name: str,
        total_steps: int,
        start_step: int,
        resumed: bool,
    ):
        self.enabled = accelerator.is_main_process
        self.accelerator = accelerator
        self.last_tau: float | None = None
        if not self.enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = run_dir / METRICS_FILE
        # Rows after the checkpoint were logged by work that is now redone; a fresh start
        # (a run killed before its first checkpoint) keeps none.
        truncate_metrics(self.metrics_path, start_step if resumed else -1)
        # TensorBoard drops the events a killed run logged after its checkpoint (purge_step).
        tb = {"purge_step": start_step + 1 if resumed else 0, "flush_secs": 10}
        accelerator.init_trackers(run_name, init_kwargs={"tensorboard": tb})
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def train_step(self, step: int, metrics: dict[str, float], *, log: bool) -> None:
        """Advance the bar; write `metrics` to TensorBoard and metrics.jsonl when `log`."""
        if not self.enabled:
            return
        postfix = {k: f"{metrics[k]:.4f}" for k in BAR_KEYS if k in metrics}
        if self.last_tau is not None:
            postfix["tau"] = f"{self.last_tau:.3f}"
        postfix["tok/s"] = f"{metrics['tokens_per_s']:.0f}"
        postfix["wait"] = f"{100 * metrics['data_wait']:.0f}%"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)
        if log:
            self.write(step, "train", metrics)

    def eval(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.last_tau = metrics["tau"]
        self.write(step, "eval", metrics)
        self.bar.write(
            f"eval step {step}: tau {metrics['tau']:.3f}  acceptance "
            + " ".join(f"{metrics[k]:.3f}" for k in sorted(metrics) if k.startswith("alpha_"))
        )

    def data(self, counts: dict[str, dict[str, int]]) -> None:
        """Log what the splits hold, and how many long samples were cut into windows (`data` row at step 0)."""
        if not self.enabled:
            return
        for split, c in counts.items():
            if c.get("long_samples"):
                self.message(
                    f"{split}: {c['long_samples']} of {c['samples']} samples are longer than "
                    f"train.tokens_per_micro_batch: trained as {c['windows']} windows "
                    f"({c['windows_left_out']} more had nothing to score)"
                )
        row = {f"{split}_{k}": v for split, c in counts.items() for k, v in c.items()}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({"step": 0, "split": "data", **row}) + "\n")

    def message(self, text: str) -> None:
        if self.enabled:
            self.bar.write(text)

    def write(self, step: int, split: str, metrics: dict[str, float]) -> None:
        self.accelerator.log({f"{split}/{name}": value for name, value in metrics.items()}, step=step)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({"step": step, "split": split, **metrics}) + "\n")

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            for tracker in self.accelerator.trackers:
                tracker.finish()


__all__ = ["METRICS_FILE", "Reporter", "truncate_metrics"]
