"""One ablation table from tables of one seed each: `python -m bench.ablate_merge out=DIR TABLE ...`.

The seeds of one ablation are often trained apart: on other machines, on other days, or after the
runs of an earlier seed are gone (a Qwen run at 4x is over an hour of a core). `make ablate ...
seeds=S out=...` then writes one table per seed. Over seeds every figure of a table depends only on
each seed's run mean and the run's clustered SE (`bench.ablate_stats.combine_seeds`), and a gain is
paired within its seed, so tables of one seed each merge exactly into the table that `make ablate
seeds=S1,S2,...` would write from all the runs at once.

Each TABLE is an `ablations.json` (or the folder holding one). A row (variant, budget) is merged when
every table holds it; a figure when every table's row has it. Refused with a UserError, nothing
written: a row of more than one seed, a seed in two tables, tables on other stores (the benchmark's
fingerprints, or each run's data fingerprints), or under another reference, held-out protocol,
schedule, `common` overrides or definition of a merged variant. The table records the commit it was
merged at and each input's path, sha256 and `made`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from bench import write_figures
from bench.ablate import plot, print_table
from bench.ablate_record import git_state
from bench.ablate_stats import combine_seeds
from dspark.entry import script_main
from dspark.errors import UserError

USAGE = "python -m bench.ablate_merge out=DIR TABLE [TABLE ...]  (TABLE: an ablations.json of one seed, or its folder)"
SAME_CONFIG = ("reference", "heldout", "steps", "common", "recipe")


def read_table(path: Path) -> tuple[Path, dict]:
    path = path / "ablations.json" if path.is_dir() else path
    try:
        return path, json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not a readable ablations.json ({e})") from e


def merge_figure(key: str, parts: list, where: str):
    """One figure of a row over the tables' rows: a {mean, se} of one seed each combined over seeds
    (per position where its mean is a list), a mapping figure by figure, `train_tokens` averaged, anything
    else (variant, budget, steps, held-out counts, `against`) the same in every table."""
    first = parts[0]
    if isinstance(first, dict) and {"mean", "se"} <= set(first):
        if any(p.get("seeds", 1) != 1 for p in parts):
            raise UserError(f"{where}: a table holds more than one seed here; merge tables of one seed each")
        if isinstance(first["mean"], list):  # per position: {mean: [...], se: [...]}
            means, ses = np.array([p["mean"] for p in parts]), np.array([p["se"] for p in parts])
            slots = [combine_seeds(list(means[:, k]), list(ses[:, k])) for k in range(means.shape[1])]
            return {"mean": [s["mean"] for s in slots], "se": [s["se"] for s in slots]}
        return combine_seeds([p["mean"] for p in parts], [p["se"] for p in parts])
    if isinstance(first, dict):
        shared = [k for k in first if all(k in p for p in parts)]
        return {k: merge_figure(k, [p[k] for p in parts], f"{where}.{k}") for k in shared}
    if key == "train_tokens":
        return float(np.mean(parts))
    if any(p != first for p in parts):
        raise UserError(f"{where}: the tables differ ({', '.join(map(repr, parts))}); they are not one ablation")
    return first


def check_same_ablation(tables: list[tuple[Path, dict]], variants: list[str]) -> None:
    (first_path, first), rest = tables[0], tables[1:]
    for path, table in rest:
        for key in SAME_CONFIG:
            if table["config"].get(key) != first["config"].get(key):
                raise UserError(f"{path}: another {key} than {first_path}; not one ablation")
        for variant in variants:
            if table["config"]["variants"][variant] != first["config"]["variants"][variant]:
                raise UserError(f"{path}: variant {variant} is defined otherwise than in {first_path}")
        stores = (table.get("bench_data") or {}).get("stores"), (first.get("bench_data") or {}).get("stores")
        if stores[0] != stores[1]:
            raise UserError(f"{path}: made on other stores than {first_path} ({stores[0]} against {stores[1]})")
    data = {json.dumps(run["data"], sort_keys=True) for _, table in tables for run in table["runs"]}
    if len(data) > 1:
        raise UserError("the tables' runs trained or were scored on other data (their data fingerprints differ)")


def merge(paths: list[Path]) -> dict:
    """The merged ablation: `table` rows as `make ablate` writes them, over every input's seed."""
    if len(paths) < 2:
        raise UserError(f"two tables or more to merge; usage: {USAGE}")
    tables = [read_table(p) for p in paths]
    rows = [{(r["variant"], r["budget"]): r for r in t["table"]} for _, t in tables]
    keys = [k for k in rows[0] if all(k in r for r in rows[1:])]
    if not keys:
        raise UserError("the tables share no (variant, budget) row")
    variants = list(dict.fromkeys(v for v, _ in keys))
    check_same_ablation(tables, variants)
    runs = []
    for key in keys:
        mine = [run for _, t in tables for run in t["runs"] if (run["variant"], run["budget"]) == key]
        seeds = [run["seed"] for run in mine]
        if len(seeds) != len(tables):
            raise UserError(f"{key[0]} x{key[1]}: each table must hold one seed of it (seeds {seeds})")
        if len(set(seeds)) < len(seeds):
            raise UserError(f"{key[0]} x{key[1]}: seed {max(seeds, key=seeds.count)} is in two tables")
        runs += mine
    table = [merge_figure("row", [r[key] for r in rows], f"{key[0]} x{key[1]}") for key in keys]
    first = tables[0][1]
    config = {**first["config"], "seeds": sorted({run["seed"] for run in runs})}
    config["variants"] = {v: first["config"]["variants"][v] for v in variants}
    result = {
        "made": git_state(),
        "merged_from": [
            {"path": str(p), "sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "made": t["made"]} for p, t in tables
        ],
        "config": config,
        "runs": runs,
        "table": table,
    }
    if "bench_data" in first:
        result["bench_data"] = first["bench_data"]
    return result


def main(argv: list[str]) -> int:
    outs = [a.split("=", 1)[1] for a in argv if a.startswith("out=")]
    paths = [Path(a) for a in argv if not a.startswith("out=")]
    if len(outs) != 1:
        raise UserError(f"usage: {USAGE}")
    result = merge(paths)
    out_dir = Path(outs[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(result["table"], out_dir / "ablations.png")
    write_figures(out_dir, "ablations", result)
    print_table(result["table"])
    print(f"seeds {result['config']['seeds']} merged into {out_dir / 'ablations.json'}")
    return 0


if __name__ == "__main__":
    script_main(main)
