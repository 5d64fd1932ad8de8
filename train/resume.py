"""Where a run starts: the checkpoint to resume, or a fresh start only where it loses nothing.

The newest complete `checkpoints/step_N` is found by listing the run dir (the `latest`
link is only a convenience). Without one, a fresh start is refused in a run dir holding
an earlier run's work (unless `train.resume=restart`, which deletes it first); with one, a
resume is refused when the config changed what the checkpoint's weights mean (target,
model), where they started or the sample plan (`fixed` keys), or how training continues (the
objective, the schedule, the held-out metric: `changes` keys, unless
`train.allow_resume_changes`; the resumed run then follows the new values). The kinds come
from the schemas (`dspark.config.resume_kinds`); docs/resume.md lists them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dspark.config import RESUME_KINDS, Checked, DraftConfig, HeldoutConfig, LossConfig, TargetConfig, resume_kinds
from dspark.errors import UserError
from dspark.train.checkpoint import CONFIG_FILE, checkpoints_root, latest_checkpoint, step_dirs
from dspark.train.config import TrainConfig
from dspark.train.reporting import METRICS_FILE
from dspark.vocab import MAPPING_GLOB

# The sections a checkpoint's config.yaml is compared on; what a resume may do with each key
# comes from the schema (`dspark.config.resume_kinds`).
RESUME_SCHEMAS: dict[str, type[Checked]] = {
    "target": TargetConfig,
    "model": DraftConfig,
    "loss": LossConfig,
    "train": TrainConfig,
    "heldout": HeldoutConfig,
}
# The identity of a draft's weights: what a warm start (train.init_from) must share with its source.
IDENTITY_SECTIONS = ("target", "model")
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


def section_values(cfg: DictConfig | dict, section: str) -> dict:
    """A section as plain values (interpolations resolved against the whole config); {} when absent."""
    node = cfg.get(section)
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})


def changed_keys(ours: DictConfig | dict, saved: DictConfig | dict, section: str) -> list[str]:
    """`section.key` names whose values differ between two configs (keys both of them have: one
    that only one side knows came with another version of the schema, not from the user)."""
    mine, theirs = (section_values(cfg, section) for cfg in (ours, saved))
    return [f"{section}.{k}" for k in sorted(set(mine) & set(theirs)) if mine[k] != theirs[k]]


def changes_by_kind(ours: DictConfig | dict, saved: DictConfig | dict, sections=tuple(RESUME_SCHEMAS)) -> dict:
    """The changed `section.key` names of `sections`, by resume kind (`fixed`, `changes`, `free`)."""
    found: dict[str, list[str]] = {kind: [] for kind in RESUME_KINDS}
    for section in sections:
        kinds = resume_kinds(RESUME_SCHEMAS[section])
        for key in changed_keys(ours, saved, section):
            found[kinds[key.split(".", 1)[1]]].append(key)
    return found


def identity_changes(ours: DictConfig | dict, saved: DictConfig | dict) -> list[str]:
    """The changed keys the meaning of a draft's weights depends on (the verifier, the architecture):
    neither a resume nor a warm start may change them."""
    return changes_by_kind(ours, saved, IDENTITY_SECTIONS)["fixed"]


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
    saved = OmegaConf.load(latest / CONFIG_FILE)
    changes = changes_by_kind(full_cfg, saved)
    if changes["fixed"]:
        raise UserError(
            f"cannot resume {latest}: {changes['fixed']} differ from its {CONFIG_FILE} (its weights, their start "
            "or its sample plan depend on them, whatever train.allow_resume_changes says); restore them or start "
            "a new train.run_name (optionally with train.init_from)"
        )
    changed = changes["changes"]
    if changed and not cfg.allow_resume_changes:
        raise UserError(
            f"cannot resume {latest}: {changed} differ from its {CONFIG_FILE} (the run would continue with "
            "another objective, schedule or held-out metric); restore them, start a new train.run_name with train.init_from, "
            "or set train.allow_resume_changes=true to continue anyway"
        )
    return latest


def clear_run(run_dir: Path) -> None:
    """`train.resume=restart`: delete what an earlier run left (checkpoints, metrics, events, drafter, and
    its draft-vocabulary mapping: a fresh start ranks its own, by this config)."""
    for name in RUN_OUTPUTS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    (run_dir / METRICS_FILE).unlink(missing_ok=True)
    for mapping in run_dir.glob(MAPPING_GLOB):
        mapping.unlink(missing_ok=True)


__all__ = [
    "RESUME_SCHEMAS",
    "changes_by_kind",
    "clear_run",
    "earlier_work",
    "identity_changes",
    "resume_point",
]
