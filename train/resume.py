"""Where a run starts: the checkpoint to resume, or a fresh start only where it loses nothing.

The newest complete `checkpoints/step_N` is found by listing the run dir (the `latest`
link is only a convenience). Without one, a fresh start is refused in a run dir holding
an earlier run's work (unless `train.resume=restart`, which deletes it first); with one, a
resume is refused when the config changed what the checkpoint's weights mean (target,
model) or how training continues (loss, schedule; unless `train.allow_resume_changes`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dspark.errors import UserError
from train.checkpoint import CONFIG_FILE, checkpoints_root, latest_checkpoint, step_dirs
from train.config import TrainConfig
from train.reporting import METRICS_FILE

# The objective and the schedule: a resume may change them only with train.allow_resume_changes
# (besides every loss.* key). max_steps may change: it stops the run, the schedule stays.
SCHEDULE_KEYS = (
    "lr",
    "lr_scales",
    "markov_embed_proj_lr_scale",
    "weight_decay",
    "adam_betas",
    "warmup_ratio",
    "min_lr_ratio",
    "epochs",
    "grad_clip",
    "seed",
    "tokens_per_step",
    "tokens_per_micro_batch",
)
# What an earlier run leaves in its run dir (deleted by train.resume=restart).
RUN_OUTPUTS = ("checkpoints", "tensorboard", "drafter")


def first_save_step(cfg: TrainConfig) -> int:
    """The step of a run's first checkpoint (its first evaluation saves, as the best so far)."""
    if cfg.eval_every and cfg.eval_store is not None:
        return min(cfg.save_every, cfg.eval_every)
    return cfg.save_every


def logged_steps(path: Path) -> list[int]:
    """Steps of the readable rows of a metrics.jsonl (a torn last line is skipped)."""
    steps = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return steps


def earlier_work(run_dir: Path, cfg: TrainConfig) -> list[str]:
    """What in `run_dir` a fresh start would overwrite, beyond what a run killed before its first
    checkpoint leaves (metrics up to that checkpoint's step, a hidden partial checkpoint)."""
    found = [str(p) for _, p in sorted(step_dirs(run_dir).items())]
    if (run_dir / "drafter").exists():
        found.append(str(run_dir / "drafter"))
    steps = logged_steps(run_dir / METRICS_FILE)
    if steps and max(steps) > first_save_step(cfg):
        found.append(f"{run_dir / METRICS_FILE} (steps up to {max(steps)})")
    return found


def changed_keys(ours: DictConfig, saved: DictConfig, section: str, keys: tuple[str, ...] | None = None) -> list[str]:
    """`section.key` names (all keys of the section, or `keys`) whose values differ between two configs."""
    mine = OmegaConf.to_container(ours[section], resolve=True) if section in ours else {}
    theirs = OmegaConf.to_container(saved[section], resolve=True) if section in saved else {}
    names = keys if keys is not None else sorted(set(mine) | set(theirs))
    return [f"{section}.{k}" for k in names if mine.get(k) != theirs.get(k)]


def resume_point(cfg: TrainConfig, run_dir: Path, full_cfg: DictConfig) -> Path | None:
    """The checkpoint to continue from (per `train.resume`), checked against this config; None = step 0."""
    latest = latest_checkpoint(run_dir)
    if cfg.resume == "restart":
        return None
    if cfg.resume == "never" and latest is not None:
        raise UserError(
            f"train.resume=never but {checkpoints_root(run_dir)} has checkpoints; pick another train.run_name"
        )
    if cfg.resume == "must" and latest is None:
        raise UserError(f"train.resume=must but {checkpoints_root(run_dir)} has no complete checkpoint")
    if latest is None:
        earlier = earlier_work(run_dir, cfg)
        if earlier:
            raise UserError(
                f"{run_dir} holds an earlier run ({', '.join(earlier)}) but no complete checkpoint to resume; "
                "a fresh start would overwrite it. Pick another train.run_name, or set train.resume=restart "
                "to delete it and start over"
            )
        return None
    if cfg.init_from is not None:
        raise UserError(
            f"train.init_from is set but {run_dir} already has checkpoints to resume; use a new train.run_name"
        )
    saved = OmegaConf.load(latest / CONFIG_FILE)
    for section in ("target", "model"):
        changed = changed_keys(full_cfg, saved, section)
        if changed:
            raise UserError(
                f"cannot resume {latest}: {changed} differ from its {CONFIG_FILE}; "
                "restore them or start a new train.run_name (optionally with train.init_from)"
            )
    changed = changed_keys(full_cfg, saved, "loss") + changed_keys(full_cfg, saved, "train", SCHEDULE_KEYS)
    if changed and not cfg.allow_resume_changes:
        raise UserError(
            f"cannot resume {latest}: {changed} differ from its {CONFIG_FILE} (the run would continue with "
            "another objective or schedule); restore them, start a new train.run_name with train.init_from, "
            "or set train.allow_resume_changes=true to continue anyway"
        )
    return latest


def clear_run(run_dir: Path) -> None:
    """`train.resume=restart`: delete what an earlier run left (checkpoints, metrics, events, drafter)."""
    for name in RUN_OUTPUTS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    (run_dir / METRICS_FILE).unlink(missing_ok=True)


__all__ = ["SCHEDULE_KEYS", "clear_run", "earlier_work", "resume_point"]
