"""`make ablate`: named training variants side by side, with standard errors.

Every variant (a list of Hydra overrides of `python -m train`, see `bench/ablate.yaml`; an
entry `@other` stands for the overrides of variant `other`) is trained at each budget
(`steps` × each of `budgets`) and each seed, on the same stores with the same `common`
overrides, then scored on the held-out store by the existing
offline evaluation (`eval.offline.evaluate_blocks`: full-vocabulary analytic acceptance,
the same blocks for every run). Its untrained draft (same seed, same init levers) is
scored the same way. One table, `ablations.json` + `ablations.png` in `out`:

- `tau`: held-out τ; `gain`: τ − the reference variant's τ, paired block by block;
- `accept` / `alpha`: per-position cumulative (Π_{j≤k} α_j) and conditional (α_k) acceptance;
- `tau_per_mtok`: (τ − the reference's untrained τ) per million training tokens;
- `untrained_tau`, `wall_s` (the training subprocess) and `train_time_s` (its steps only).

Standard errors. One run's figure is a mean over held-out blocks b with SE_anchor =
sd(x_b)/√n. Over S seeds: mean of the run means, SE = √(sd_seed²/S + mean(SE_anchor²)):
the seed term is training noise (it shrinks with seeds), the anchor term is held-out
sampling noise (every seed is scored on the same blocks, so it does not shrink). Wall
times have the seed term only.

Usage: python -m bench.ablate [config=bench/ablate.yaml] [out=bench/results] [only=a,b] [seeds=0,1] [budgets=1,4]
Finished runs (their `ablate.npz`) are reused; an interrupted one resumes from its checkpoint.
A scored run's checkpoints are deleted (`keep_checkpoints: true` keeps them): ~0.5 GB each on
the embedded default, tens of GB over a table.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from bench import write_figures

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = Path(__file__).with_name("ablate.yaml")
BLOCKS_FILE = "ablate.npz"


# ----- standard errors -----
def mean_se(values: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error sd(ddof=1)/√n over one run's blocks (SE 0 for a single value)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return float("nan"), float("nan")
    se = values.std(ddof=1) / np.sqrt(values.size) if values.size > 1 else 0.0
    return float(values.mean()), float(se)


def combine_seeds(means: list[float], anchor_ses: list[float]) -> dict:
    """{mean, se, seeds}: SE = √(sd(means)²/S + mean(anchor SE²)) (see the module docstring)."""
    m = np.asarray(means, dtype=np.float64)
    a = np.asarray(anchor_ses, dtype=np.float64)
    seed_var = m.var(ddof=1) / m.size if m.size > 1 else 0.0
    return {"mean": float(m.mean()), "se": float(np.sqrt(seed_var + np.mean(a**2))), "seeds": int(m.size)}


@dataclass
class Blocks:
    """Per-block held-out results of one drafter (row = one block)."""

    alpha: np.ndarray  # [n, B] float64, 0 where unscored
    mask: np.ndarray  # [n, B] bool
    key: np.ndarray  # [n, 2] int64 (sample id, anchor position): the block's identity

    @property
    def prefix(self) -> np.ndarray:
        """Π_{j≤k} α_j per slot [n, B] (0 from the first unscored slot on)."""
        return np.cumprod(self.alpha * self.mask, axis=1)

    @property
    def tau(self) -> np.ndarray:
        """τ per block [n] = 1 + Σ_k Π_{j≤k} α_j."""
        return 1.0 + self.prefix.sum(1)

    def save(self, path: Path) -> None:
        np.savez(path, alpha=self.alpha, mask=self.mask, key=self.key)

    @classmethod
    def load(cls, path: Path) -> Blocks:
        with np.load(path) as f:
            return cls(f["alpha"], f["mask"].astype(bool), f["key"])


def per_position(blocks: list[Blocks], field: str) -> dict:
    """Per-slot mean and SE of `prefix` (cumulative) or `alpha` (conditional) over scored slots, combined over seeds."""
    width = blocks[0].mask.shape[1]
    out = {"mean": [], "se": []}
    for k in range(width):
        stats = [mean_se(getattr(b, field)[b.mask[:, k], k]) for b in blocks]
        row = combine_seeds([s[0] for s in stats], [s[1] for s in stats])
        out["mean"].append(row["mean"])
        out["se"].append(row["se"])
    return out


def summarize(runs: list[dict], blocks: dict, untrained: dict, reference: str) -> list[dict]:
    """One table row per (variant, budget): every figure as {mean, se, seeds}.

    `runs`: run records (variant, budget, seed, steps, train_tokens, wall_s, train_time_s);
    `blocks[(variant, budget, seed)]` and `untrained[(variant, seed)]`: `Blocks` on the same held-out blocks.
    """
    table = []
    for variant, budget in dict.fromkeys((r["variant"], r["budget"]) for r in runs):
        rows = sorted((r for r in runs if (r["variant"], r["budget"]) == (variant, budget)), key=lambda r: r["seed"])
        seeds = [r["seed"] for r in rows]
        mine = [blocks[variant, budget, s] for s in seeds]
        for b in [*mine, *(untrained[variant, s] for s in seeds)]:
            if not np.array_equal(b.key, mine[0].key):
                raise ValueError(f"variant {variant}: runs were scored on different held-out blocks")

        def over_seeds(values):
            stats = [mean_se(v) for v in values]
            return combine_seeds([s[0] for s in stats], [s[1] for s in stats])

        row = {
            "variant": variant,
            "budget": budget,
            "steps": rows[0]["steps"],
            "train_tokens": float(np.mean([r["train_tokens"] for r in rows])),
            "tau": over_seeds([b.tau for b in mine]),
            "untrained_tau": over_seeds([untrained[variant, s].tau for s in seeds]),
            "accept": per_position(mine, "prefix"),
            "alpha": per_position(mine, "alpha"),
        }
        if (reference, budget, seeds[0]) in blocks and all((reference, budget, s) in blocks for s in seeds):
            row["gain"] = over_seeds([b.tau - blocks[reference, budget, s].tau for b, s in zip(mine, seeds)])
        if all((reference, s) in untrained for s in seeds):
            row["tau_per_mtok"] = over_seeds(
                [
                    (b.tau - untrained[reference, s].tau) / (r["train_tokens"] / 1e6)
                    for b, s, r in zip(mine, seeds, rows)
                ]
            )
        for key in ("wall_s", "train_time_s"):
            row[key] = combine_seeds([r[key] for r in rows], [0.0] * len(rows))
        table.append(row)
    return table


# ----- runs -----
def load_config(path: Path) -> dict:
    cfg = yaml.safe_load(path.read_text())
    need = {
        "launcher",
        "runs_dir",
        "keep_checkpoints",
        "common",
        "steps",
        "budgets",
        "seeds",
        "eval",
        "reference",
        "variants",
    }
    missing = sorted(need - set(cfg or {}))
    if missing:
        raise SystemExit(f"{path}: missing keys {missing}")
    if cfg["reference"] not in cfg["variants"]:
        raise SystemExit(f"{path}: reference {cfg['reference']!r} is not one of the variants {list(cfg['variants'])}")
    cfg["variants"] = {name: expand_variant(path, cfg["variants"], name) for name in cfg["variants"]}
    return cfg


def expand_variant(path: Path, variants: dict, name: str, seen: tuple[str, ...] = ()) -> list[str]:
    """A variant's overrides, each entry `@other` replaced by the (expanded) overrides of variant `other`."""
    if name in seen:
        raise SystemExit(f"{path}: variants refer to each other in a cycle: {' -> '.join([*seen, name])}")
    out = []
    for item in variants[name]:
        if isinstance(item, str) and item.startswith("@"):
            if item[1:] not in variants:
                raise SystemExit(f"{path}: variant {name!r} refers to {item!r}, which is not a variant")
            out += expand_variant(path, variants, item[1:], (*seen, name))
        else:
            out.append(item)
    return out


def launcher(command: list[str]) -> list[str]:
    """`python` / `torchrun` of this interpreter's environment (the venv), other commands as given."""
    first = command[0]
    if first == "python":
        first = sys.executable
    elif first == "torchrun":
        first = str(Path(sys.executable).parent / "torchrun")
    return [first, *command[1:]]


def run_overrides(cfg: dict, variant: str, budget: int, seed: int, run_dir: Path) -> list[str]:
    """Overrides of one training run (the variant's own last, so a variant may change anything)."""
    return [
        *cfg["common"],
        f"train.seed={seed}",
        f"train.max_steps={cfg['steps'] * budget}",
        f"train.run_dir={run_dir}",
        "train.export=true",
        "train.log_every=1",
        # continue an interrupted run from its checkpoint; one killed before any starts over
        f"train.resume={'auto' if any(run_dir.glob('checkpoints/*')) else 'restart'}",
        *cfg["variants"][variant],
    ]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return hydra_compose("train", overrides=overrides)


def score(draft, verifier, cfg: dict, full_cfg) -> Blocks:
    """The offline evaluation's per-block acceptance of `draft` on the run's held-out store."""
    from eval.config import OfflineConfig
    from eval.offline import evaluate_blocks, held_out_refs, open_heldout_store

    ev = cfg["eval"]
    offline = OfflineConfig(
        enabled=True,
        max_samples=ev["max_samples"],
        anchors_per_sample=ev["anchors_per_sample"],
        anchors_per_forward=ev["anchors_per_forward"],
        seed=0,
        length_buckets=[1],
        position_buckets=[1],
        device="cpu",
    )
    store = open_heldout_store(full_cfg.train.eval_store)
    table = evaluate_blocks(
        draft,
        verifier,
        store,
        held_out_refs(store, offline.max_samples),
        offline,
        draft.fc.weight.device,
        desc="ablate eval",
    )
    return Blocks(table.alpha, table.slot_mask, np.stack([table.sample_id, table.anchor_pos], 1))


def untrained_blocks(cfg: dict, variant: str, seed: int, run_dir: Path) -> Blocks:
    """Score the draft a run of this variant and seed starts from (init levers included), untrained."""
    path = run_dir / BLOCKS_FILE
    if path.exists():
        return Blocks.load(path)
    from dspark.config import to_dataclass
    from train.build import build_trainer, make_accelerator
    from train.config import TrainConfig

    full_cfg = compose([*run_overrides(cfg, variant, 1, seed, run_dir), "train.data_workers=0"])
    trainer = build_trainer(full_cfg, make_accelerator(to_dataclass(TrainConfig, full_cfg["train"])))
    trainer.reporter.close()
    blocks = score(trainer.raw_model, trainer.verifier, cfg, full_cfg)
    blocks.save(path)
    return blocks


def train_run(cfg: dict, variant: str, budget: int, seed: int, run_dir: Path) -> tuple[dict, Blocks]:
    """Train (or reuse) one run; its record and held-out blocks."""
    record_path, blocks_path = run_dir / "ablate.json", run_dir / BLOCKS_FILE
    if record_path.exists() and blocks_path.exists():
        return json.loads(record_path.read_text()), Blocks.load(blocks_path)
    overrides = run_overrides(cfg, variant, budget, seed, run_dir)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    log = run_dir.parent / f"{run_dir.name}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        proc = subprocess.run(
            [*launcher(cfg["launcher"]), *overrides],
            check=False,
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    if proc.returncode:
        raise RuntimeError(f"{variant} x{budget} seed {seed} failed (exit {proc.returncode}); see {log}")
    wall = time.perf_counter() - start
    from dspark.export import META_FILE, load_drafter
    from dspark.targets import resolve_target_dir
    from dspark.verifier import VerifierHead

    full_cfg = compose(overrides)
    draft = load_drafter(run_dir / "drafter")
    verifier = VerifierHead.from_pretrained(resolve_target_dir(full_cfg.target.name_or_path, full_cfg.target.revision))
    draft.load_verifier(verifier)
    blocks = score(draft, verifier, cfg, full_cfg)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    meta = json.loads((run_dir / "drafter" / META_FILE).read_text())
    steps = max(r["step"] for r in rows if r["split"] == "train")  # fewer than asked when the epochs run out
    record = {
        "variant": variant,
        "budget": budget,
        "seed": seed,
        "steps": steps,
        "train_tokens": float(sum(r["num_tokens"] for r in rows if r["split"] == "train")),
        "wall_s": wall,
        "train_time_s": float(meta["train_time_s"]),
        "overrides": overrides,
    }
    blocks.save(blocks_path)
    record_path.write_text(json.dumps(record, indent=2))
    if not cfg["keep_checkpoints"]:  # a scored run never resumes; its drafter stays
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return record, blocks


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant in dict.fromkeys(r["variant"] for r in table):
        rows = [r for r in table if r["variant"] == variant]
        left.errorbar(
            [r["train_tokens"] / 1e6 for r in rows],
            [r["tau"]["mean"] for r in rows],
            yerr=[2 * r["tau"]["se"] for r in rows],
            marker="o",
            capsize=3,
            label=variant,
        )
        last = rows[-1]
        k = np.arange(len(last["accept"]["mean"]))
        right.errorbar(
            k,
            last["accept"]["mean"],
            yerr=2 * np.asarray(last["accept"]["se"]),
            marker="o",
            capsize=3,
            label=f"{variant} ({last['steps']} steps)",
        )
    left.set(xlabel="training tokens (M)", ylabel="held-out τ (±2 SE)", title="τ by budget")
    right.set_xticks(range(len(table[0]["accept"]["mean"])))
    right.set(xlabel="slot k", ylabel="P(slots 0..k accepted) (±2 SE)", title="per-position acceptance")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_ablation(cfg: dict, out_dir: Path, only: list[str] | None = None) -> dict:
    variants = only or list(cfg["variants"])
    unknown = sorted(set(variants) - set(cfg["variants"]))
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; have {list(cfg['variants'])}")
    root = Path(os.path.expandvars(cfg["runs_dir"]))
    runs, blocks, untrained = [], {}, {}
    total = len(variants) * len(cfg["seeds"]) * len(cfg["budgets"])
    for variant in variants:
        for seed in cfg["seeds"]:
            untrained[variant, seed] = untrained_blocks(cfg, variant, seed, root / variant / f"untrained_s{seed}")
            for budget in cfg["budgets"]:
                run_dir = root / variant / f"x{budget}_s{seed}"
                print(f"[{len(runs) + 1}/{total}] {variant} x{budget} seed {seed} (log: {run_dir}.log)", flush=True)
                record, blocks[variant, budget, seed] = train_run(cfg, variant, budget, seed, run_dir)
                runs.append(record)
                print(
                    f"[{len(runs)}/{total}] {variant} x{budget} seed {seed}: "
                    f"tau {blocks[variant, budget, seed].tau.mean():.4f} ({record['wall_s']:.0f} s)",
                    flush=True,
                )
    table = summarize(runs, blocks, untrained, cfg["reference"])
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(table, out_dir / "ablations.png")
    return write_figures(out_dir, "ablations", {"config": cfg, "runs": runs, "table": table})


def main(argv: list[str]) -> int:
    args = {}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in {"config", "out", "only", "seeds", "budgets"}:
            raise SystemExit(
                f"unknown argument {item!r}; expected config=FILE, out=DIR, only=a,b, seeds=0,1 or budgets=1,4"
            )
        args[key] = value
    cfg = load_config(Path(args.get("config", DEFAULT_CONFIG)))
    for key in ("seeds", "budgets"):
        if key in args:
            cfg[key] = [int(v) for v in args[key].split(",")]
    result = run_ablation(
        cfg, Path(args.get("out", "bench/results")), args["only"].split(",") if "only" in args else None
    )
    for row in result["table"]:
        gain = row.get("gain", {"mean": float("nan"), "se": float("nan")})
        print(
            f"{row['variant']:>24} x{row['budget']}: tau {row['tau']['mean']:.4f} ± {row['tau']['se']:.4f}  "
            f"gain {gain['mean']:+.4f} ± {gain['se']:.4f}  wall {row['wall_s']['mean']:.0f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
