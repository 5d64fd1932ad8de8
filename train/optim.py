"""AdamW with its parameters grouped by name, the LR schedule, and optimizer state restored by name.

A param group is identified by its `train.lr_scales` prefix and holds its parameters' names;
a resume restores each parameter's state (AdamW's moments) by its name,
never by position, so reordering `lr_scales` (or changing it) cannot hand one parameter
another's moments. The schedule is a function of the step and the config alone.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch
from omegaconf import DictConfig

from dspark.errors import UserError
from dspark.train.config import TrainConfig


def covers(prefix: str, name: str) -> bool:
    """Whether module path `prefix` (`*` stands for any one component) covers parameter `name`."""
    want, have = prefix.split("."), name.split(".")
    return len(have) >= len(want) and all(w in ("*", h) for w, h in zip(want, have))


def lr_groups(names: list[str], scales: dict[str, float]) -> dict[str, list[str]]:
    """Parameter names by the `scales` prefix that covers them (the longest match wins), `""` for
    the rest; prefixes in `scales`' order, each listed even when it covers nothing."""
    groups: dict[str, list[str]] = {"": [], **{prefix: [] for prefix in scales}}
    for name in names:
        matches = [prefix for prefix in scales if covers(prefix, name)]
        groups[max(matches, key=lambda m: (m.count("."), -m.count("*"))) if matches else ""].append(name)
    return groups


def make_optimizer(
    named: list[tuple[str, torch.nn.Parameter]], cfg: TrainConfig, scales: dict[str, float] | None = None
) -> torch.optim.AdamW:
    """AdamW as every run uses it: the fused kernel (one pass over each parameter instead of a
    chain of foreach ops; ~10x faster on CPU at a 0.5B verifier's draft, see bench train_step).

    `cfg.lr_scales` puts the parameters under each name prefix (a module path, where `*` stands
    for any one component: `layers.*.mlp`) in a param group of its own at `cfg.lr` × its
    multiplier (the longest matching prefix wins); the rest train at `cfg.lr`. A prefix that
    matches no trainable parameter is refused. Each group carries its
    prefix (`name`, "" for the rest) and its parameters' names (`param_names`): the groups are
    ordered by name, whatever the order of `lr_scales`, and a resume restores each parameter's
    state by its name (`load_state_by_name`). `initial_lr` is a group's peak LR (`lr` × scale).
    `scales` replaces `cfg.lr_scales` where given (`with_prefix_lr`'s result).
    """
    scales = (cfg.lr_scales or {}) if scales is None else scales
    params = dict(named)
    groups = lr_groups([n for n, _ in named], scales)
    unused = sorted(prefix for prefix in cfg.lr_scales or {} if not groups[prefix])  # ones the user named
    if unused:
        raise UserError(
            f"train.lr_scales: {unused} match no trainable parameter (prefixes are module paths, e.g. layers, fc; "
            f"drop one with '~train.lr_scales.{unused[0]}')"
        )
    param_groups = [
        {"params": [(n, params[n]) for n in members], "name": group, "lr": peak, "initial_lr": peak}
        for group, members, peak in sorted(
            (p, names, cfg.lr * scales.get(p, 1.0)) for p, names in groups.items() if names
        )
    ]
    return torch.optim.AdamW(
        param_groups, lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay, fused=True
    )


COPIED_LAYERS = "layers"  # the prefix of the draft's layers, which `init_layers_from_verifier` copies
COPIED_FC = "fc"  # the aux states' projection, which `init_fc_from_last_aux` copies


def copied_layers_lr(model: torch.nn.Module, copied: list[str], ref_rms: float) -> float:
    """The LR multiplier of the draft's layers copied from the verifier (`train.copied_lr_ref_rms`): the median
    RMS of the weight matrices copied into them / `ref_rms`. AdamW moves every weight by about the LR a step
    whatever its size, so a verifier whose weights are 10x smaller (Qwen2's ~0.02 against SmolLM2's ~0.2)
    would otherwise lose its copy 10x faster; scaled, a step moves the copy by about the same fraction on
    every verifier as on the one the LR was tuned on. One number for all of them: the matrices' LRs keep
    the ratios they were tuned at (a multiplier per matrix lost on SmolLM2, docs/levers.md)."""
    params = dict(model.named_parameters())
    rms = [
        float(params[n].detach().float().pow(2).mean().sqrt())
        for n in copied
        if covers(COPIED_LAYERS, n) and params[n].ndim == 2
    ]
    return statistics.median(rms) / ref_rms


def with_prefix_lr(scales: dict[str, float] | None, prefix: str, multiplier: float) -> dict[str, float]:
    """`train.lr_scales` with the parameters under module path `prefix` (the copied layers, the copied fc), and
    every prefix inside it, at `multiplier` × their scale; `prefix`'s own entry is added at 1 when missing."""
    return {p: s * multiplier if covers(prefix, p) else s for p, s in {prefix: 1.0, **(scales or {})}.items()}


def name_unnamed_groups(saved: dict, names: list[str], saved_train: DictConfig, source: Path) -> dict:
    """A `state_dict()` saved before param groups carried names: its groups were the non-empty ones
    of `lr_groups` in the order of the checkpoint's own `train.lr_scales` (the rest first), which
    trainers of that time led with the Markov embedding projection's group."""
    prefixes = dict.fromkeys(["markov_embed_proj", *(saved_train.lr_scales or {})])
    groups = [group for group in lr_groups(names, prefixes).values() if group]
    if [len(g) for g in groups] != [len(g["params"]) for g in saved["param_groups"]]:
        raise UserError(
            f"{source}: its optimizer's param groups do not fit this model; warm-start with train.init_from"
        )
    named = [{**g, "param_names": n} for g, n in zip(saved["param_groups"], groups, strict=True)]
    return {**saved, "param_groups": named}


def load_state_by_name(optimizer: torch.optim.Optimizer, saved: dict, source: Path) -> None:
    """Restore each parameter's optimizer state (AdamW's moments) from a saved
    `state_dict()` by parameter name; the groups and their hyperparameters stay this run's."""
    saved_index = {
        name: index
        for group in saved["param_groups"]
        for name, index in zip(group["param_names"], group["params"], strict=True)
    }
    ours = [name for group in optimizer.param_groups for name in group["param_names"]]
    missing, unexpected = sorted(set(ours) - saved_index.keys()), sorted(saved_index.keys() - set(ours))
    if missing or unexpected:
        raise UserError(
            f"{source}: its optimizer state does not fit this run's trainable parameters (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}); resume with the checkpoint's model config or warm-start with train.init_from"
        )
    state = {i: saved["state"][saved_index[name]] for i, name in enumerate(ours) if saved_index[name] in saved["state"]}
    groups, start = [], 0
    for group in optimizer.param_groups:
        n = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + n))})
        start += n
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def warmup_cosine(step: int, *, total: int, warmup: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup over `warmup` steps, then cosine down to `min_ratio`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


__all__ = [
    "COPIED_FC",
    "COPIED_LAYERS",
    "copied_layers_lr",
    "covers",
    "load_state_by_name",
    "lr_groups",
    "make_optimizer",
    "name_unnamed_groups",
    "warmup_cosine",
    "with_prefix_lr",
]
