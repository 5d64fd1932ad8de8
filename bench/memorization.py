"""How much of a lever-benchmark run's acceptance is memorized: τ on its own training conversations
against τ held out.

Scores each named run's exported drafter (a `make ablate` run directory) under the benchmark's
held-out protocol, but on the first `samples` conversations of the training store it was trained on,
and sets that against the run's held-out τ (its `ablate.npz`). A large gap that grows with the
budget means the longer budget buys memorizing, not a better drafter. SEs are clustered by
conversation.

    python -m bench.memorization config=bench/ablate_regularize.yaml bench_data=qwen2.5-coder-0.5b \
        steps=300 runs=default:1:0,default:4:0 samples=40 out=bench/results/levers/qwen2.5-coder-0.5b/x4_regularize
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench import split_args, write_figures
from bench.ablate import compose, run_overrides, score, with_bench_data
from bench.ablate_record import store_fingerprint
from bench.ablate_stats import Blocks, clustered_mean_se
from bench.ablate_variants import check_variants, load_config
from dspark.entry import script_main
from dspark.errors import UserError

USAGE = (
    "python -m bench.memorization config=FILE bench_data=NAME [steps=N] runs=VARIANT:BUDGET:SEED,... "
    "[samples=40] out=DIR"
)


def train_set_blocks(run_dir: Path, full_cfg, samples: int) -> Blocks:
    """The run's drafter scored on the first `samples` conversations of its training store."""
    from dspark.export import load_drafter
    from dspark.store import ShardStore
    from dspark.targets import resolve_target_dir
    from dspark.verifier import VerifierHead

    draft = load_drafter(run_dir / "drafter")
    verifier = VerifierHead.from_pretrained(resolve_target_dir(full_cfg.target.name_or_path, full_cfg.target.revision))
    draft.load_verifier(verifier)
    store = ShardStore.open(full_cfg.train.train_store)  # the training split, on purpose
    return score(draft, verifier, full_cfg, store, samples)


def tau(blocks: Blocks) -> dict:
    mean, se = clustered_mean_se(blocks.tau, blocks.conversations)
    return {"mean": round(mean, 4), "se": round(se, 4), "conversations": int(len(set(blocks.conversations)))}


def main(argv: list[str]) -> int:
    args, rest = split_args(
        argv, {"config", "bench_data", "steps", "runs", "samples", "out"}, {"config", "runs", "out"}, USAGE
    )
    if rest:
        raise UserError(f"unknown argument(s) {rest}; usage: {USAGE}")
    cfg = load_config(Path(args["config"]))
    cfg["bench_data"] = args.get("bench_data") or cfg.get("bench_data")
    if "steps" in args:
        cfg["steps"] = int(args["steps"])
    samples = int(args.get("samples", 40))
    cfg, bench_data = with_bench_data(cfg)
    root = Path(os.path.expandvars(cfg["runs_dir"]))
    if bench_data is not None:
        root = root / "bench_data" / bench_data["name"]
    runs = []  # every named run checked before any is scored
    for spec in args["runs"].split(","):
        try:
            variant, budget, seed = spec.split(":")
            budget, seed = int(budget), int(seed)
        except ValueError as e:
            raise UserError(f"runs={args['runs']}: expected VARIANT:BUDGET:SEED items, got {spec!r}") from e
        check_variants(cfg, [variant])
        run_dir = root / variant / f"x{budget}_s{seed}"
        if not (run_dir / "ablate.json").is_file():
            raise UserError(f"{run_dir}: no scored run there (run `make ablate` for it first)")
        runs.append((variant, budget, seed, run_dir))
    rows = []
    for variant, budget, seed, run_dir in runs:
        record = json.loads((run_dir / "ablate.json").read_text())
        full_cfg = compose(run_overrides(cfg, variant, budget, seed, run_dir))
        held = Blocks.load(run_dir / "ablate.npz")
        train = train_set_blocks(run_dir, full_cfg, samples)
        row = {
            "variant": variant,
            "budget": budget,
            "seed": seed,
            "train_set_tau": tau(train),
            "heldout_tau": tau(held),
            "trained": record.get("trained"),
            "config_sha256": record.get("config_sha256"),
        }
        row["gap"] = round(row["train_set_tau"]["mean"] - row["heldout_tau"]["mean"], 4)
        rows.append(row)
        print(
            f"{variant} x{budget} seed {seed}: train-set tau {row['train_set_tau']['mean']:.4f} ± "
            f"{row['train_set_tau']['se']:.4f}, held-out {row['heldout_tau']['mean']:.4f} ± "
            f"{row['heldout_tau']['se']:.4f}, gap {row['gap']:+.4f}",
            flush=True,
        )
    train_store = full_cfg.train.train_store  # the same store for every run of the file
    write_figures(
        Path(args["out"]),
        "memorization",
        {
            "command": "python -m bench.memorization " + " ".join(argv),
            "train_store_fingerprint": store_fingerprint(train_store),
            "samples": samples,
            "runs": rows,
        },
    )
    return 0


if __name__ == "__main__":
    script_main(main)
