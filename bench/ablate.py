"""`make ablate`: named training variants side by side, with standard errors.

A variant (see `bench/ablate.yaml`) is a delta from a named recipe (`conf/recipe/`, e.g.
`published` or `default`): a list of Hydra overrides of `python -m train`, where an entry
`@other` stands for variant `other` (its recipe and overrides), or a mapping
`{recipe: NAME, overrides: [...], against: VARIANT}`. `against` names the reference its
decision is measured against (the defaults before it; by default the first `@` it builds on).
Every variant is trained at each budget (`steps` × each of `budgets`) and each seed, on the same
stores with the same `common` overrides, then scored on the held-out store by the offline
evaluation (`eval.offline.evaluate_blocks`: full-vocabulary analytic acceptance) under the shared
held-out protocol (`conf/heldout/`, with the file's `heldout` overrides, which every run's training
gets too: the trainer's own final τ is the same figure), so every run is scored on the same blocks.
Its untrained draft (same seed, same init levers) is scored the same way. One table,
`ablations.json` + `ablations.png` in `out`:

- `tau`: held-out τ; `gain`: τ − the file's `reference` variant's τ, paired block by block;
  `gain_against`: the same against the variant's own `against`;
- `accept` / `alpha`: per-position cumulative (Π_{j≤k} α_j) and conditional (α_k) acceptance;
- `tau_per_mtok`: (τ − the reference's untrained τ) per million training tokens;
- `trained_gain`: τ − the row's own untrained τ; `gain_ratio`: the reference's `trained_gain` over the
  row's (on the `published` row: how many times the published recipe's gain the defaults gain);
- `untrained_tau`, `wall_s` (the training subprocess; the last one of a run resumed after a kill),
  `train_time_s` (its steps only, every process's) and
  `train_tokens_per_s` (training tokens per second of those steps: equal steps are not equal time).

Every figure is {mean, se, seeds}, its SE clustered by held-out conversation (`bench.ablate_stats`).
Every run records the commit and dirty flag it was trained and scored at, its resolved config's
hash and its data's fingerprints (`bench.ablate_record`); the table records the commit it was
made at. Results are written atomically.

With `bench_data: NAME` in the file (or `bench_data=NAME` on the command line) every run trains and
is scored on the stores of that fixed lever benchmark (`bench/data/NAME/`, built by `bench.lever_data`
first where missing; runs under `<runs_dir>/bench_data/NAME/`), the table names the benchmark and its
stores' fingerprints, and each row adds `by_source`: τ and the gains per held-out source (benchmark).

Usage: python -m bench.ablate [config=bench/ablate.yaml] [out=bench/results] [only=a,b] [seeds=0,1] [budgets=1,4]
       [steps=N] [bench_data=NAME]
A file whose `common` names no verifier (`target=...`) trains the benchmark's on `bench_data`.
A stored result is reused only when what produced it is unchanged (its score key); a drafter whose
results are missing or torn is re-scored; a run interrupted before its drafter resumes from its
checkpoint; anything else is retrained from step 0, a finished run of another config first moved aside
to `<run>.<its train key>` (kept, never trained over). A scored run's checkpoints are deleted
(`keep_checkpoints: true` keeps them): ~0.5 GB each on the embedded default, tens of GB over a table.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench import write_figures
from bench.ablate_record import REPO, check_name, digest, git_state, provenance, read_json, weights_digest
from bench.ablate_stats import Blocks, summarize
from bench.ablate_variants import check_variants, load_config
from dspark.entry import script_main
from dspark.errors import UserError
from dspark.lifetime import die_with_parent, how_it_ended
from dspark.run_lock import in_use

DEFAULT_CONFIG = Path(__file__).with_name("ablate.yaml")
BLOCKS_FILE = "ablate.npz"
RECORD_FILE = "ablate.json"
TRAINING_FILE = "ablate_training.json"  # written before a run trains: its train key and commit


def launcher(command: list[str]) -> list[str]:
    """`python` / `torchrun` of this interpreter's environment (the venv), other commands as given."""
    first = command[0]
    if first == "python":
        first = sys.executable
    elif first == "torchrun":
        first = str(Path(sys.executable).parent / "torchrun")
    return [first, *command[1:]]


def heldout_overrides(cfg: dict) -> list[str]:
    """The file's `heldout` mapping as Hydra overrides of the shared held-out protocol."""
    return [f"heldout.{key}={'null' if value is None else value}" for key, value in cfg["heldout"].items()]


def run_overrides(cfg: dict, variant: str, budget: int, seed: int, run_dir: Path, resume: str = "auto") -> list[str]:
    """Overrides of one training run (the variant's own after the run's, so a variant may change anything
    but the file's held-out protocol, which comes last: every run is scored on the same blocks)."""
    spec = cfg["variants"][variant]
    return [
        *cfg["common"],
        f"+recipe={spec['recipe']}",
        f"train.seed={seed}",
        f"train.max_steps={cfg['steps'] * budget}",
        f"train.run_dir={run_dir}",
        "train.export=true",
        "train.log_every=1",
        f"train.resume={resume}",
        *spec["overrides"],
        *heldout_overrides(cfg),
    ]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return hydra_compose("train", overrides=overrides)


# ----- scoring -----
def score(draft, verifier, full_cfg, store=None, max_samples: int | None = None) -> Blocks:
    """The offline evaluation's per-block acceptance of `draft` on the run's held-out store (or on
    `store`, its first `max_samples` samples), under the run's `heldout` protocol."""
    from dspark.config import HeldoutConfig, load_section
    from dspark.eval.offline import evaluate_store, open_heldout_store

    heldout = load_section(HeldoutConfig, full_cfg, "heldout")
    if store is None:
        store, max_samples = open_heldout_store(full_cfg.train.eval_store), heldout.max_samples
    device = draft.fc.weight.device
    table = evaluate_store(draft, verifier, store, heldout, device, max_samples, desc="ablate eval")
    return Blocks(table.alpha, table.slot_mask, np.stack([table.sample_id, table.anchor_pos], 1))


def write_record(run_dir: Path, record: dict, blocks: Blocks) -> None:
    """Blocks first, then the record that names them: a record on disk always has its blocks."""
    blocks.save(run_dir / BLOCKS_FILE)
    write_figures(run_dir, Path(RECORD_FILE).stem, record, stamp=False)


def stored(run_dir: Path, score_key: str) -> tuple[dict, Blocks] | None:
    """The run's stored record and blocks when both read back and were made under `score_key`."""
    record = read_json(run_dir / RECORD_FILE)
    if record is None or record.get("score_key") != score_key:
        return None
    blocks = Blocks.load(run_dir / BLOCKS_FILE)
    return None if blocks is None else (record, blocks)


def untrained_blocks(cfg: dict, variant: str, seed: int, run_dir: Path) -> Blocks:
    """Score the draft a run of this variant and seed starts from (init levers included), untrained.

    Variants that differ only in how they train (the loss, the LR, ...) start from the same draft: one
    whose weights, verifier head, stores and held-out protocol equal those of another variant's scored
    untrained draft under the same runs dir (`draft_key`) reuses its blocks instead of scoring again."""
    from dspark.config import to_dataclass
    from dspark.train.build import build_trainer, make_accelerator
    from dspark.train.config import TrainConfig

    full_cfg = compose([*run_overrides(cfg, variant, 1, seed, run_dir, "restart"), "train.data_workers=0"])
    made = provenance(full_cfg)
    found = stored(run_dir, made["score_key"])
    if found is not None:
        return found[1]
    trainer = build_trainer(full_cfg, make_accelerator(to_dataclass(TrainConfig, full_cfg["train"])))
    trainer.reporter.close()
    key = digest(
        {
            "weights": weights_digest(trainer.raw_model, trainer.verifier),
            "data": made["data"],
            "heldout": made["heldout"],
        }
    )
    record = {"variant": variant, "seed": seed, **made, "draft_key": key, "git": git_state()}
    for other in sorted(run_dir.parent.parent.glob(f"*/{run_dir.name}")):
        theirs = read_json(other / RECORD_FILE) if other != run_dir else None
        blocks = Blocks.load(other / BLOCKS_FILE) if theirs is not None and theirs.get("draft_key") == key else None
        if blocks is not None:
            print(f"{variant} seed {seed}: its untrained draft is {other.parent.name}'s, scored there", flush=True)
            write_record(run_dir, {**record, "scored_as": str(other)}, blocks)
            return blocks
    blocks = score(trainer.raw_model, trainer.verifier, full_cfg)
    write_record(run_dir, record, blocks)
    return blocks


# ----- runs -----
def train_run(cfg: dict, variant: str, budget: int, seed: int, run_dir: Path) -> tuple[dict, Blocks]:
    """Train (or reuse, or re-score) one run; its record and held-out blocks."""
    from dspark.export import META_FILE

    made = provenance(compose(run_overrides(cfg, variant, budget, seed, run_dir)))
    found = stored(run_dir, made["score_key"])
    if found is not None:
        return found
    training = read_json(run_dir / TRAINING_FILE)
    same_training = training is not None and training.get("train_key") == made["train_key"]
    if not (same_training and (run_dir / "drafter" / META_FILE).is_file()):
        busy = in_use(run_dir)  # before its records change: another process may be training it now
        if busy is not None:
            raise UserError(busy)
        if not same_training and (run_dir / "drafter" / META_FILE).is_file():
            set_aside(run_dir, training)
        # the same training continues from its checkpoint; another one (or none recorded) starts over
        resume = "auto" if same_training and any(run_dir.glob("checkpoints/*")) else "restart"
        for name in (RECORD_FILE, BLOCKS_FILE):
            (run_dir / name).unlink(missing_ok=True)
        if resume == "auto":  # the commit it started at stays its record's; each resume's commit is added
            training = {**training, "resumed": [*training.get("resumed", []), git_state()], "wall_s": 0.0}
        else:
            training = {"train_key": made["train_key"], "git": git_state(), "wall_s": 0.0}
        write_figures(run_dir, Path(TRAINING_FILE).stem, training, stamp=False)
        training["wall_s"] = train(cfg, variant, budget, seed, run_dir, resume)
        write_figures(run_dir, Path(TRAINING_FILE).stem, training, stamp=False)
    record, blocks = score_run(cfg, variant, budget, seed, run_dir, made)
    record.update(trained=training["git"], wall_s=training["wall_s"])
    if "resumed" in training:
        record["resumed"] = training["resumed"]
    write_record(run_dir, record, blocks)
    if not cfg["keep_checkpoints"]:  # a scored run never resumes; its drafter stays
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return record, blocks


def set_aside(run_dir: Path, training: dict | None) -> None:
    """Move a finished run of another training (and its log) to a sibling named by its train key: kept, not overwritten."""
    key = (training or {}).get("train_key", "unkeyed")[:12]
    log = run_dir.parent / f"{run_dir.name}.log"
    aside, n = run_dir.with_name(f"{run_dir.name}.{key}"), 1
    while aside.exists() or aside.with_name(f"{aside.name}.log").exists():
        aside, n = run_dir.with_name(f"{run_dir.name}.{key}.{n}"), n + 1
    run_dir.rename(aside)
    if log.is_file():
        log.rename(aside.with_name(f"{aside.name}.log"))
    print(f"  {run_dir} held a finished run of another config (train key {key}): kept as {aside}", flush=True)


def train(cfg: dict, variant: str, budget: int, seed: int, run_dir: Path, resume: str) -> float:
    """Run the training subprocess (its log beside the run dir); its wall time."""
    overrides = run_overrides(cfg, variant, budget, seed, run_dir, resume)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    log = run_dir.parent / f"{run_dir.name}.log"
    with log.open("a") as out:
        proc = subprocess.run(
            [*launcher(cfg["launcher"]), *overrides],
            check=False,
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            # a killed make ablate takes its training along (it resumes from its checkpoint next time),
            # rather than leaving it to train on, holding the run dir
            preexec_fn=functools.partial(die_with_parent, signal.SIGTERM),
        )
    if proc.returncode:
        oom = " (out of memory?)" if proc.returncode == -signal.SIGKILL else ""
        raise UserError(
            f"{variant} x{budget} seed {seed}: its training {how_it_ended(proc.returncode)}{oom} (its log: {log}); the runs "
            "finished before it are kept, and the same command continues from there"
        )
    return time.perf_counter() - start


def score_run(cfg: dict, variant: str, budget: int, seed: int, run_dir: Path, made: dict) -> tuple[dict, Blocks]:
    """Score a run's exported drafter; its record (without the training's git state and wall time)."""
    from dspark.export import META_FILE, load_drafter
    from dspark.targets import resolve_target_dir
    from dspark.verifier import VerifierHead

    overrides = run_overrides(cfg, variant, budget, seed, run_dir)
    full_cfg = compose(overrides)
    draft = load_drafter(run_dir / "drafter")
    verifier = VerifierHead.from_pretrained(resolve_target_dir(full_cfg.target.name_or_path, full_cfg.target.revision))
    draft.load_verifier(verifier)
    blocks = score(draft, verifier, full_cfg)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    meta = json.loads((run_dir / "drafter" / META_FILE).read_text())
    steps = max(r["step"] for r in rows if r["split"] == "train")  # fewer than asked when the epochs run out
    record = {
        "variant": variant,
        "budget": budget,
        "seed": seed,
        "steps": steps,
        "train_tokens": float(sum(r["num_tokens"] for r in rows if r["split"] == "train")),
        "train_time_s": float(meta["train_time_s"]),
        "recipe": cfg["variants"][variant]["recipe"],
        "overrides": overrides,
        **made,
        "scored": git_state(),
    }
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


def with_bench_data(cfg: dict) -> tuple[dict, dict | None]:
    """`cfg` with every run on the stores of its lever benchmark (`bench_data`, built first if missing),
    and the benchmark's record (`bench.lever_data`); `cfg` itself and None without one."""
    name = cfg.get("bench_data")
    if not name:
        return cfg, None
    from bench import lever_data

    manifest = lever_data.load_manifest(lever_data.bench_dir(name))
    common = list(cfg["common"])
    if not any(item.lstrip("+~").startswith("target") for item in common):
        # a file that names no verifier trains the benchmark's (as it was made: its target overrides)
        common += manifest["target"]["overrides"]
    target = compose(common).target
    if target.name_or_path != manifest["target"]["name_or_path"]:
        raise UserError(
            f"bench_data={name} holds data of the verifier {manifest['target']['name_or_path']!r}; "
            f"the runs' `common` overrides train on {target.name_or_path!r}"
        )
    record = lever_data.materialize(name)
    return {**cfg, "common": [*common, *lever_data.train_overrides(record)]}, record


def run_ablation(cfg: dict, out_dir: Path, only: list[str] | None = None) -> dict:
    cfg, bench_data = with_bench_data(cfg)
    variants = only or list(cfg["variants"])
    check_variants(cfg, variants)
    against = {name: spec["against"] for name, spec in cfg["variants"].items() if spec["against"] is not None}
    for name in variants:
        if name in against and against[name] not in variants:
            print(f"note: {name} is measured against {against[name]}, not in this run: no gain_against", flush=True)
    root = Path(os.path.expandvars(cfg["runs_dir"]))
    if bench_data is not None:  # runs on the benchmark's stores, beside (not over) those on the default stores
        root = root / "bench_data" / bench_data["name"]
    runs, blocks, untrained = [], {}, {}
    total = len(variants) * len(cfg["seeds"]) * len(cfg["budgets"])
    for variant in variants:
        for seed in cfg["seeds"]:
            untrained[variant, seed] = untrained_blocks(cfg, variant, seed, root / variant / f"untrained_s{seed}")
            for budget in cfg["budgets"]:
                run_dir = root / variant / f"x{budget}_s{seed}"
                print(f"[{len(runs) + 1}/{total}] {variant} x{budget} seed {seed} (log: {run_dir}.log)", flush=True)
                record, blocks[variant, budget, seed] = train_run(cfg, variant, budget, seed, run_dir)
                runs.append({**record, "variant": variant})  # a stored run may have been made under another name
                print(
                    f"[{len(runs)}/{total}] {variant} x{budget} seed {seed}: "
                    f"tau {blocks[variant, budget, seed].tau.mean():.4f} ({record['wall_s']:.0f} s)",
                    flush=True,
                )
    sources = None
    if bench_data is not None:
        from dspark.eval.offline import read_sources

        sources = read_sources(bench_data["data_dir"])
    table = summarize(runs, blocks, untrained, cfg["reference"], against, sources)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(table, out_dir / "ablations.png")
    result = {"made": git_state(), "config": cfg, "runs": runs, "table": table}
    if bench_data is not None:
        result["bench_data"] = {
            "name": bench_data["name"],
            "manifest_sha256": bench_data["manifest_sha256"],
            "stores": {
                split: {k: store[k] for k in ("fingerprint", "matches_reference")}
                for split, store in bench_data["stores"].items()
            },
        }
    return write_figures(out_dir, "ablations", result)


def _signed(stat: dict | None) -> str:
    """`+mean ± se` of a gain, or `—` where there is none (the reference's own row, or a reference not run)."""
    return "—" if stat is None else f"{stat['mean']:+.4f} ± {stat['se']:.4f}"


def print_table(table: list[dict]) -> None:
    """Each row's τ, gains, speed and wall time, and its per-source figures, one line each."""
    for row in table:
        against = row.get("against", "-")
        print(
            f"{row['variant']:>24} x{row['budget']}: tau {row['tau']['mean']:.4f} ± {row['tau']['se']:.4f}  "
            f"gain {_signed(row.get('gain'))}  vs {against} {_signed(row.get('gain_against'))}  "
            f"{row['train_tokens_per_s']['mean']:.0f} tok/s  wall {row['wall_s']['mean']:.0f} s"
            + (f"  gain ratio {ratio['mean']:.2f}x ± {ratio['se']:.2f}" if (ratio := row.get("gain_ratio")) else "")
        )
        for source, part in row.get("by_source", {}).items():
            print(
                f"{source:>26}: tau {part['tau']['mean']:.4f} ± {part['tau']['se']:.4f}  "
                f"gain {_signed(part.get('gain'))}  vs {against} {_signed(part.get('gain_against'))}  "
                f"({part['heldout_conversations']} conversations)"
            )


def main(argv: list[str]) -> int:
    args = {}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in {"config", "out", "only", "seeds", "budgets", "steps", "bench_data"}:
            raise UserError(
                f"unknown argument {item!r}; expected config=FILE, out=DIR, only=a,b, seeds=0,1, budgets=1,4, "
                "steps=N or bench_data=NAME"
            )
        args[key] = value
    cfg = load_config(Path(args.get("config", DEFAULT_CONFIG)))
    if "bench_data" in args:  # empty: the stores of `common` (make data extract)
        cfg["bench_data"] = check_name("benchmark", args["bench_data"]) if args["bench_data"] else None
    for key in ("seeds", "budgets"):
        if key in args:
            try:
                cfg[key] = [int(v) for v in args[key].split(",")]
            except ValueError as e:
                raise UserError(f"{key}={args[key]}: expected integers separated by commas") from e
    if "steps" in args:
        if not args["steps"].isdigit() or int(args["steps"]) < 1:
            raise UserError(f"steps={args['steps']}: expected a positive integer (the 1x budget's steps)")
        cfg["steps"] = int(args["steps"])
    result = run_ablation(
        cfg, Path(args.get("out", "bench/results")), args["only"].split(",") if "only" in args else None
    )
    print_table(result["table"])
    return 0


if __name__ == "__main__":
    script_main(main)
