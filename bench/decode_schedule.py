"""What the confidence head's schedule spares when decoding: vLLM's adaptive verification against fixed
draft budgets, on a lever benchmark's held-out prompts, with the head as `make eval` serves it.

The offline verification budget (`make eval`'s report) reads the head's confidence for the block it
verifies. vLLM reads it one step stale (the previous draft's survivals budget this step's), and decoding
anchors blocks where the last step stopped, so what the head spares when served is measured here with
`eval.decode`'s engine, which follows vLLM's proposer:

1. a copy of the drafter is calibrated by `make eval`'s offline pass (the served map, and the refit
   where it is on, folded into its head, fitted on the fit half of the held-out conversations);
2. prompts of the other half (the scored conversations, `per_benchmark` of each benchmark) are decoded
   greedily under each schedule: every fixed budget of k = 1..B drafts a step, and the budget rule under
   verify costs linear in the tokens verified, 1 + r·n, for each slope r of `slopes` (free drafts: the
   rule's trade-off is the drafts' verification alone). Greedy decoding gives the same text under every
   schedule, checked token for token against transformers' greedy decoding, so the schedules are paired
   prompt by prompt and differ only in how many drafts each step sends;
3. per schedule: the acceptance length (tokens per verifier forward), drafts sent per step, the loss of
   acceptance length and the drafts spared against the full block, each with a bootstrap SE over
   prompts; and at most `max_loss` acceptance length lost, the most any head schedule spares against
   the most any fixed budget spares (schedules chosen on these prompts; the SE holds them fixed); and for
   every head schedule, what it spares beyond the fixed budgets' curve at its own loss (two budgets
   alternated land between two integers), the comparison at equal acceptance length.

Greedy acceptance is of the verifier's argmax, while the head is trained and calibrated on the
temperature-1 acceptance, so the rule's slope for a given share of drafts differs from vLLM's at T=1;
the comparison is of the schedules' trade-off curves, which the slopes trace.

    python -m bench.decode_schedule drafter=DIR bench_data=NAME out=FILE.json [per_benchmark=8]
        [max_new_tokens=96] [slopes=0.005,0.01,...] [eval overrides]
"""

from __future__ import annotations

import datetime
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench import write_atomically
from bench.ablate_record import digest, file_fingerprint, git_state, read_json, store_fingerprint
from dspark.entry import script_main
from dspark.errors import UserError

USAGE = (
    "python -m bench.decode_schedule drafter=DIR bench_data=NAME out=FILE.json [per_benchmark=8] "
    "[max_new_tokens=96] [slopes=r1,r2,...] [eval overrides]"
)
SLOPES = (0.005, 0.01, 0.02, 0.03, 0.05, 0.1)
ROUNDS = 1000  # prompt resamples behind each SE


def fixed_costs(k: int, block_size: int):
    """A CostModel under which the budget rule sends k drafts every step: verifying up to 1+k tokens
    costs the same, more costs far more."""
    from dspark.eval.speculative import CostModel

    return CostModel(0.0, np.array([0.0] + [1.0] * (k + 1) + [1e12] * (block_size - k)))


def linear_costs(slope: float, block_size: int):
    """Verifying n tokens costs 1 + slope·n; a draft step is free."""
    from dspark.eval.speculative import CostModel

    return CostModel(0.0, np.array([0.0] + [1.0 + slope * n for n in range(1, block_size + 2)]))


def per_prompt(outputs) -> np.ndarray:
    """[prompts, 3]: verifier steps, tokens they produced (accepted + one each), drafts sent."""
    return np.array(
        [
            [len(o.accepted_per_step), sum(o.accepted_per_step) + len(o.accepted_per_step), sum(o.drafted_per_step)]
            for o in outputs
        ],
        dtype=np.float64,
    )


KEYS = ("acceptance_length", "drafts_per_step", "acceptance_length_loss", "drafts_spared")


def schedule_stats(runs: dict[str, np.ndarray], full: str, idx: np.ndarray) -> dict[str, np.ndarray]:
    """Per schedule, on prompts `idx`: [acceptance length, drafts per step, the acceptance length lost
    against `full` (relative), the share of `full`'s drafts spared]."""
    base = runs[full][idx]
    al_full = base[:, 1].sum() / base[:, 0].sum()
    out = {}
    for name, rows in runs.items():
        r = rows[idx]
        al = r[:, 1].sum() / r[:, 0].sum()
        out[name] = np.array(
            [al, r[:, 2].sum() / r[:, 0].sum(), 1 - al / al_full, 1 - r[:, 2].sum() / base[:, 2].sum()]
        )
    return out


def _turn(a, b, c) -> float:
    """z of (b − a) × (c − a): >= 0 when b is on or under the line from a to c (a, c ordered by x)."""
    return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])


def fixed_frontier(points: list[tuple[float, float]]) -> np.ndarray:
    """[m, 2] (loss, spared) of the best the fixed budgets reach: the upper concave hull of their points
    (alternating two budgets reaches any point on the segment between them)."""
    hull: list[tuple[float, float]] = []
    for p in sorted(points, key=lambda p: (p[0], -p[1])):
        if hull and p[0] == hull[-1][0]:
            continue  # the same loss, fewer drafts spared
        while len(hull) >= 2 and _turn(hull[-2], hull[-1], p) >= 0:
            hull.pop()  # under the segment from hull[-2] to p
        hull.append(p)
    return np.array(hull)


def lead_at_equal_loss(stats: dict[str, np.ndarray], head: str, fixed: list[str]) -> float:
    """Drafts spared by schedule `head` beyond the fixed budgets' frontier (`fixed_frontier`) at the same
    acceptance length lost."""
    frontier = fixed_frontier([(stats[n][2], stats[n][3]) for n in fixed])
    return float(stats[head][3] - np.interp(stats[head][2], frontier[:, 0], frontier[:, 1]))


def bootstrap(fn, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`fn` (prompt indices -> array) on all `n` prompts, and its SE over `ROUNDS` resamples of them."""
    draws = [fn(idx) for idx in np.random.default_rng(seed).integers(0, n, size=(ROUNDS, n))]
    return fn(np.arange(n)), np.std(draws, axis=0, ddof=1)


def versus_full(runs: dict[str, np.ndarray], full: str, seed: int) -> dict:
    """Each schedule's figures (`schedule_stats`) on all prompts, with bootstrap SEs over prompts, and each
    non-fixed schedule's `lead_at_equal_loss` over the `fixed_*` schedules."""
    names = list(runs)
    fixed = [name for name in names if name.startswith("fixed")]

    def figures(idx: np.ndarray) -> np.ndarray:  # [schedules, 5]
        stats = schedule_stats(runs, full, idx)
        lead = [lead_at_equal_loss(stats, name, fixed) if name not in fixed else np.nan for name in names]
        return np.column_stack([np.stack([stats[name] for name in names]), lead])

    point, se = bootstrap(figures, len(runs[full]), seed)
    out = {}
    for i, name in enumerate(names):
        keys = KEYS + (() if name in fixed else ("lead_at_equal_loss",))
        out[name] = {k: {"mean": float(point[i, j]), "se": float(se[i, j])} for j, k in enumerate(keys)}
    return out


def best_within(table: dict, names: list[str], max_loss: float) -> str | None:
    """The schedule of `names` sparing the most drafts with at most `max_loss` acceptance length lost."""
    ok = [n for n in names if table[n]["acceptance_length_loss"]["mean"] <= max_loss]
    return max(ok, key=lambda n: table[n]["drafts_spared"]["mean"]) if ok else None


def spared_beyond(runs: dict[str, np.ndarray], a: str, b: str, full: str, seed: int) -> dict:
    """Points of `full`'s drafts schedule `a` spares beyond schedule `b`, paired, bootstrap SE over prompts."""

    def diff(idx: np.ndarray) -> np.ndarray:
        stats = schedule_stats({k: runs[k] for k in (a, b, full)}, full, idx)
        return np.asarray(stats[a][3] - stats[b][3])

    point, se = bootstrap(diff, len(runs[full]), seed)
    return {"mean": float(point), "se": float(se)}


def decode_schedules(engine, model, sets, schedules, max_new: int, batch_size: int, partial, key: str) -> dict:
    """{schedule: [prompts, 3] per_prompt counts} over every prompt set, each set's greedy outputs checked
    against transformers'. Each (set, schedule) done is kept in `partial` (under `key`, what decided it),
    so a killed run resumes where it stopped: greedy decoding repeats, so what it kept is what it would
    decode again."""
    from dspark.eval.decode_runs import check_lossless, hf_generate

    kept = read_json(partial) if partial is not None else None
    done = kept["done"] if kept is not None and kept.get("key") == key else {}
    if done:
        print(f"resuming: {sum(map(len, done.values()))} (prompt set, schedule) runs kept in {partial}", flush=True)
    bar = tqdm(
        total=sum(len(p) for p in sets.values()) * (len(schedules) + 1),
        desc="decode schedules",
        unit="prompt",
        dynamic_ncols=True,
    )
    for benchmark, prompts in sets.items():
        ours = done.setdefault(benchmark, {})
        references = []
        if any(name not in ours for name in schedules):
            bar.set_postfix_str(f"{benchmark}: transformers' greedy text")
            for p in prompts:
                references.append(hf_generate(model, p, max_new, 0.0))
                bar.update()
        else:
            bar.update(len(prompts))
        for name, costs in schedules.items():
            if name in ours:
                bar.update(len(prompts))
                continue
            bar.set_postfix_str(f"{benchmark}: {name}")
            outputs = []
            for i in range(0, len(prompts), batch_size):
                batch = prompts[i : i + batch_size]
                outputs += engine.generate(batch, max_new, 0.0, 0, costs)
                bar.update(len(batch))
            check_lossless(benchmark, prompts, [o.output_ids for o in outputs], references)
            ours[name] = per_prompt(outputs).astype(int).tolist()
            if partial is not None:
                write_atomically(partial, json.dumps({"key": key, "done": done}).encode())
    bar.close()
    return {name: np.concatenate([np.array(done[b][name], np.float64) for b in sets]) for name in schedules}


def schedule_figures(
    drafter: str, overrides: list[str], per_benchmark: int, max_new: int, slopes, partial: Path | None = None
) -> dict:
    import hydra

    from dspark.config import HeldoutConfig, TargetConfig, load_section
    from dspark.entry import CONF_DIR
    from dspark.eval.config import EvalConfig
    from dspark.eval.decode_runs import load_engine, prompt_sets
    from dspark.eval.evaluate import offline_sections, split_samples
    from dspark.eval.offline import pick_device

    if not (Path(drafter) / "config.json").is_file():
        raise UserError(f"drafter={drafter}: not an exported drafter dir (no config.json)")
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = hydra.compose(config_name="eval", overrides=[f"drafter={drafter}", "eval.bench_store=null", *overrides])
    target, ecfg = load_section(TargetConfig, cfg, "target"), load_section(EvalConfig, cfg, "eval")
    heldout = load_section(HeldoutConfig, cfg, "heldout")
    rows = [json.loads(line) for line in (Path(ecfg.data_dir) / "eval.jsonl").read_text().splitlines() if line]
    fit_ids, scored_ids = split_samples(
        np.array([r["sample_id"] for r in rows]), ecfg.calibration.fit_fraction, heldout.seed
    )
    with tempfile.TemporaryDirectory() as tmp:
        served = Path(tmp) / "drafter"
        shutil.copytree(drafter, served)
        offline, calibration, _, _ = offline_sections(served, target, ecfg, heldout)
        if calibration is None:
            raise UserError(f"drafter={drafter}: no confidence head (or eval.calibration off): no schedule to measure")
        if calibration["fit_samples"] != fit_ids.size:
            raise RuntimeError("the served head's fit half is not the one the prompts were split by")
        prompts_file, scored = Path(tmp) / "scored.jsonl", set(scored_ids.tolist())
        prompts_file.write_text("".join(json.dumps(r) + "\n" for r in rows if r["sample_id"] in scored))
        prompts_sha256 = file_fingerprint(str(prompts_file))
        ecfg.decode.prompts_file, ecfg.decode.prompts_per_benchmark = str(prompts_file), per_benchmark
        engine, model, tokenizer, max_len = load_engine(served, target, pick_device(ecfg.decode.device))
        sets = prompt_sets(ecfg, tokenizer, max_len - max_new)
        B = engine.block_size
        schedules = {f"fixed_{k}": fixed_costs(k, B) for k in range(1, B)} | {f"fixed_{B}": None}
        schedules |= {f"head_r{r:g}": linear_costs(r, B) for r in slopes}
        # what decides the decoding: the drafter as served (its calibration folded in), the prompts, the
        # length and the engine
        key = digest(
            {
                "served_drafter": file_fingerprint(str(served / "model.safetensors")),
                "prompts": {name: [list(map(int, p)) for p in prompts] for name, prompts in sets.items()},
                "max_new": max_new,
                "engine": {"device": str(engine.device), "batch_size": ecfg.decode.batch_size},
            }
        )
        runs = decode_schedules(engine, model, sets, schedules, max_new, ecfg.decode.batch_size, partial, key)
    table = versus_full(runs, f"fixed_{B}", heldout.seed)
    max_loss = ecfg.calibration.max_tau_loss
    head = best_within(table, [n for n in schedules if n.startswith("head")], max_loss)
    fixed = best_within(table, [n for n in schedules if n.startswith("fixed")], max_loss)
    lead = None
    if head is not None and fixed is not None:
        lead = {
            "head": head,
            "fixed": fixed,
            "spared_beyond_fixed": spared_beyond(runs, head, fixed, f"fixed_{B}", heldout.seed),
            "lead_at_equal_loss": table[head]["lead_at_equal_loss"],
        }
    return {
        "made": {**git_state(), "date": datetime.date.today().isoformat()},
        "drafter": drafter,
        "drafter_model_safetensors_sha256": file_fingerprint(f"{drafter}/model.safetensors"),
        "eval_overrides": list(overrides),
        "eval_store_fingerprint": store_fingerprint(ecfg.store),
        "prompts": {name: len(p) for name, p in sets.items()},
        # the scored half's rows of eval.jsonl the prompts were drawn from (`per_benchmark` of each set)
        "scored_rows_sha256": prompts_sha256,
        "max_new_tokens": max_new,
        "temperature": 0.0,
        "block_size": B,
        "served_head": {k: calibration["served"][k] for k in ("slope", "intercept")},
        "offline": {"tau": offline["overall"]["tau"], "served_budget": calibration["served"]["budget"]},
        "schedules": table,
        "max_loss": max_loss,
        "at_max_loss": lead,
        # per prompt and schedule: [verifier steps, tokens produced, drafts sent], for re-scoring
        "per_prompt": {name: rows.astype(int).tolist() for name, rows in runs.items()},
    }


def main(argv: list[str]) -> int:
    from bench import lever_data, write_figures

    args, _, overrides = lever_data.report_args(argv, USAGE, frozenset({"per_benchmark", "max_new_tokens", "slopes"}))
    slopes = [float(s) for s in args["slopes"].split(",")] if "slopes" in args else SLOPES
    out = Path(args["out"])
    partial = out.with_name(f"{out.stem}.partial.json")  # what a killed run had decoded; gone once out is written
    figures = schedule_figures(
        args["drafter"],
        overrides,
        int(args.get("per_benchmark", 8)),
        int(args.get("max_new_tokens", 96)),
        slopes,
        partial,
    )
    write_figures(out.parent, out.stem, figures)
    partial.unlink(missing_ok=True)
    for name, row in figures["schedules"].items():
        cells = "  ".join(f"{k} {v['mean']:.4f} ± {v['se']:.4f}" for k, v in row.items())
        print(f"{name:<12} {cells}")
    print(f"at ≤ {figures['max_loss']:.0%} loss: {figures['at_max_loss']}")
    return 0


if __name__ == "__main__":
    script_main(main)
