"""Stored `make ablate` runs of two arms, paired block by block:
`python -m bench.ablate_pair new=RUN[,RUN] old=RUN[,RUN] out=DIR [bench_data=NAME] [equal_time=true]`.

A table of `make ablate` pairs the variants it trains together. An arm stored under an older config key
(trained before a config key was added, at an earlier commit) is not reused by it and would be trained
again; this pairs it from its stored blocks instead. Each RUN is a run dir of `make ablate` (its
`ablate.json` and `ablate.npz`); the i-th `new` run is paired with the i-th `old` one, which must be of
the same seed and budget and scored on the same blocks of the same stores under the same held-out
protocol (else a UserError, nothing written); with `equal_time=true` the two may differ in steps (an arm
trained for another arm's training time, where one's step is heavier: the equal-time half of a lever's
decision), and the record says so. Figures as `make ablate`'s (`bench.ablate_stats`): the gain
paired per seed, SE clustered by held-out conversation, seeds combined; per seed; and per held-out
source with `bench_data` (`by_source`, as in a table's rows). Where every run's untrained draft is stored
beside it (`untrained_s<seed>`, as `make ablate` keeps it, on the same blocks), each arm adds its
`trained_gain` (τ over its own untrained draft, paired) and the pair adds `gain_ratio`: the new arm's
trained gain over the old arm's (`ratio_over_seeds`; the table's `gain_ratio` with the arms swapped).
`DIR/paired.json` records both arms' run records (commits, config hashes, data fingerprints) and the
commit it was paired at.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench import split_args, write_figures
from bench.ablate import BLOCKS_FILE, RECORD_FILE
from bench.ablate_record import read_json
from bench.ablate_stats import Blocks, by_source, over_seeds, paired_gain, ratio_over_seeds
from dspark.entry import script_main
from dspark.errors import UserError

USAGE = "python -m bench.ablate_pair new=RUN[,RUN] old=RUN[,RUN] out=DIR [bench_data=NAME] [equal_time=true]"
MATCHED = ("seed", "steps", "data", "heldout")  # what the two arms of one pair must share


def read_run(path: Path) -> tuple[dict, Blocks]:
    """A stored run's record and blocks (a UserError when either is missing or torn)."""
    record, blocks = read_json(path / RECORD_FILE), Blocks.load(path / BLOCKS_FILE)
    if record is None or blocks is None:
        raise UserError(f"{path}: not a scored make ablate run ({RECORD_FILE} and {BLOCKS_FILE})")
    return record, blocks


def untrained_of(run: Path, record: dict, blocks: Blocks) -> Blocks | None:
    """The blocks of the untrained draft `make ablate` stored beside a run, when scored on the same blocks."""
    found = Blocks.load(run.parent / f"untrained_s{record['seed']}" / BLOCKS_FILE)
    return found if found is not None and np.array_equal(found.key, blocks.key) else None


def pair(new: list[Path], old: list[Path], sources: dict[int, str], equal_time: bool = False) -> dict:
    """The paired figures of runs `new` against runs `old` (one pair per seed; `equal_time`: of any steps)."""
    if not new or len(new) != len(old):
        raise UserError(f"new= and old= name the same number of runs, one pair per seed ({len(new)} and {len(old)})")
    arms = [[read_run(p) for p in side] for side in (new, old)]
    for (mine, a), (theirs, b), path in zip(*arms, new, strict=True):
        differ = [k for k in MATCHED if mine.get(k) != theirs.get(k) and not (equal_time and k == "steps")]
        if differ or a.key.shape != b.key.shape or not (a.key == b.key).all():
            raise UserError(f"{path} and its old run differ in {differ or ['their held-out blocks']}: not a pair")
    seeds = [r["seed"] for r, _ in arms[0]]
    if len(set(seeds)) != len(seeds):
        raise UserError(f"one pair per seed: seeds {seeds}")
    a = [blocks for _, blocks in arms[0]]
    theirs = {("old", 0, s): blocks for s, (_, blocks) in zip(seeds, arms[1], strict=True)}
    conversations = a[0].conversations
    result = {
        "equal_time": equal_time,
        "new": {"tau": over_seeds([x.tau for x in a], conversations), "runs": [r for r, _ in arms[0]]},
        "old": {"tau": over_seeds([y.tau for y in theirs.values()], conversations), "runs": [r for r, _ in arms[1]]},
        "gain": paired_gain(a, theirs, "old", 0, seeds),
        "gain_per_seed": {str(s): paired_gain([x], theirs, "old", 0, [s]) for s, x in zip(seeds, a, strict=True)},
    }
    untrained = [
        [untrained_of(p, r, b) for p, (r, b) in zip(side, arm, strict=True)]
        for side, arm in zip((new, old), arms, strict=True)
    ]
    if all(u is not None for side in untrained for u in side):
        gained = [
            [b.tau - u.tau for (_, b), u in zip(arm, side, strict=True)]
            for arm, side in zip(arms, untrained, strict=True)
        ]
        for name, gains in zip(("new", "old"), gained, strict=True):
            result[name]["trained_gain"] = over_seeds(gains, conversations)
        result["gain_ratio"] = ratio_over_seeds(*gained, conversations)
    if sources:
        labels = np.array([sources.get(int(c), "unknown") for c in conversations], dtype=object)
        result["by_source"] = by_source(a, theirs, {"gain": "old"}, 0, seeds, labels)
    return result


def main(argv: list[str]) -> int:
    args, rest = split_args(argv, {"new", "old", "out", "bench_data", "equal_time"}, {"new", "old", "out"}, USAGE)
    if rest or args.get("equal_time", "false") not in ("true", "false"):
        raise UserError(f"unknown arguments {rest or [args['equal_time']]}; usage: {USAGE}")
    sources = {}
    if args.get("bench_data"):
        from bench import lever_data
        from dspark.eval.offline import read_sources

        sources = read_sources(lever_data.materialize(args["bench_data"])["data_dir"])
    arms = (paths(args[k]) for k in ("new", "old"))
    result = write_figures(Path(args["out"]), "paired", pair(*arms, sources, args.get("equal_time") == "true"))
    gain, taus = result["gain"], [result[k]["tau"]["mean"] for k in ("new", "old")]
    print(
        f"gain {gain['mean']:+.4f} ± {gain['se']:.4f} over {gain['seeds']} seed(s) ({taus[0]:.4f} against "
        f"{taus[1]:.4f})"
        + (f", gain ratio {ratio['mean']:.2f}x ± {ratio['se']:.2f}" if (ratio := result.get("gain_ratio")) else "")
        + f": {Path(args['out']) / 'paired.json'}"
    )
    return 0


def paths(value: str) -> list[Path]:
    return [Path(p) for p in value.split(",") if p]


if __name__ == "__main__":
    script_main(main)
