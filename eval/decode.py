"""`python -m eval.decode drafter=<dir> key=value ...` (make decode DRAFTER=...): speculative decoding with
the exported drafter on transformers, on any machine; see conf/decode.yaml and docs/decode.md.

Writes to eval.out_dir: decode.json (acceptance length per prompt set, temperature and fixed /
adaptive verification, next to the offline τ), decode_outputs.jsonl (every prompt's tokens), decode.png;
and the `decode` section of report.json when one is there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from dspark.config import HeldoutConfig, TargetConfig, load_section
from dspark.entry import stage_main
from dspark.errors import UserError
from dspark.eval.config import EvalConfig
from dspark.eval.decode_runs import (
    DecodeRun,
    block_starts,
    decode_runs,
    load_engine,
    offline_tau,
    prompt_sets,
    score_answers,
)
from dspark.eval.offline import BlockTable, acceptance_summary, pick_device
from dspark.eval.report import REPORT_FILE, _save, plt, read_report, write_report
from dspark.metrics import expected_length

DECODE_FILE = "decode.json"
OUTPUTS_FILE = "decode_outputs.jsonl"
PLOT_FILE = "decode.png"
ALL = "all"
RELATIVE_TOLERANCE = 0.03


def mean_se(values: list[float]) -> tuple[float, float | None]:
    """Mean and standard error over prompts (None with a single prompt)."""
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), (float(arr.std(ddof=1) / math.sqrt(arr.size)) if arr.size > 1 else None)


def run_summary(benchmark: str, runs: list[DecodeRun], block_size: int) -> dict:
    """Served-style figures of the runs' prompts pooled (one temperature, fixed or adaptive)."""
    outputs = [o for r in runs for o in r.outputs]
    per_prompt = [1 + sum(o.accepted_per_step) / len(o.accepted_per_step) for o in outputs]
    mean, se = mean_se(per_prompt)
    accepted = np.array([a for o in outputs for a in o.accepted_per_step])
    generated = sum(len(o.output_ids) for o in outputs)
    forwards = sum(o.verifier_forwards for o in outputs)
    return {
        "benchmark": benchmark,
        "temperature": runs[0].temperature,
        "adaptive": runs[0].adaptive,
        "prompts": len(outputs),
        "acceptance_length": mean,
        "acceptance_length_se": se,
        "acceptance_length_pooled": float(1 + accepted.mean()),
        "per_position_acceptance": [float((accepted > k).mean()) for k in range(block_size)],
        "generated_tokens": generated,
        "verifier_forwards": forwards,
        "verifier_forwards_per_token": forwards / generated,
        "verifier_forwards_saved": generated - forwards,
        "drafted_tokens_verified": int(sum(sum(o.drafted_per_step) for o in outputs)),
        "wall_s": float(sum(r.wall_s for r in runs)),
        "lossless_checked": runs[0].temperature == 0,
    }


def tau_summary(table: BlockTable) -> dict:
    """Offline τ over the table's blocks and its standard error over samples (prompts)."""
    lengths = expected_length(torch.from_numpy(table.alpha), torch.from_numpy(table.slot_mask)).numpy()
    per_sample = [float(lengths[table.sample_id == s].mean()) for s in np.unique(table.sample_id)]
    mean, se = mean_se(per_sample)
    summary = acceptance_summary(table.alpha, table.slot_mask)
    return {"tau": summary["tau"], "tau_mean_over_prompts": mean, "tau_se": se, "samples": len(per_sample), **summary}


def tau_at_block_starts(table: BlockTable, run: DecodeRun) -> dict:
    """Offline τ of the drafter on a run's own outputs, over the blocks it drafted (its block starts,
    every slot in range), mean over prompts: what the decoding's acceptance length estimates."""
    lengths = expected_length(torch.from_numpy(table.alpha), torch.from_numpy(table.slot_mask)).numpy()
    full = table.slot_mask.all(1)
    per_prompt = []
    for i, (prompt, out) in enumerate(zip(run.prompts, run.outputs)):
        rows = (
            (table.sample_id == i) & full & np.isin(table.anchor_pos, block_starts(len(prompt), out.accepted_per_step))
        )
        if rows.any():
            per_prompt.append(float(lengths[rows].mean()))
    mean, se = mean_se(per_prompt)
    return {"tau": mean, "tau_se": se, "prompts": len(per_prompt)}


def pooled_table(tables: list[BlockTable]) -> BlockTable:
    """One table of several prompt sets' blocks (sample ids made distinct across sets)."""
    offsets = np.cumsum([0] + [int(t.sample_id.max()) + 1 for t in tables[:-1]])
    return BlockTable(
        alpha=np.concatenate([t.alpha for t in tables]),
        slot_mask=np.concatenate([t.slot_mask for t in tables]),
        conf_logits=None,
        sample_id=np.concatenate([t.sample_id + off for t, off in zip(tables, offsets)]),
        anchor_pos=np.concatenate([t.anchor_pos for t in tables]),
        seq_len=np.concatenate([t.seq_len for t in tables]),
    )


def comparison(runs: list[dict], taus: dict[str, dict], on_outputs: dict[str, dict]) -> list[dict]:
    """Temperature-1 fixed-length acceptance length against the offline τ per prompt set: they agree
    within 2 standard errors or 3% relative, whichever is larger. Beside it, the offline τ on the run's
    own outputs at its block starts (same sampled answers, so no answer-sampling noise in the gap)."""
    rows = []
    for run in runs:
        tau = taus.get(run["benchmark"])
        if tau is None or run["temperature"] != 1.0 or run["adaptive"]:
            continue
        se = math.hypot(run["acceptance_length_se"] or 0.0, tau["tau_se"] or 0.0)
        tolerance = max(2 * se, RELATIVE_TOLERANCE * tau["tau"])
        gap = run["acceptance_length"] - tau["tau_mean_over_prompts"]
        own = on_outputs.get(run["benchmark"])
        rows.append(
            {
                "benchmark": run["benchmark"],
                "decode_acceptance_length": run["acceptance_length"],
                "offline_tau": tau["tau_mean_over_prompts"],
                "gap": gap,
                "tolerance": tolerance,
                "agrees": abs(gap) <= tolerance,
                "offline_tau_on_outputs": None if own is None else own["tau"],
                "gap_on_outputs": None if own is None else run["acceptance_length"] - own["tau"],
            }
        )
    return rows


def output_rows(runs: list[DecodeRun]):
    for run in runs:
        for i, (prompt, out) in enumerate(zip(run.prompts, run.outputs)):
            yield {
                "benchmark": run.benchmark,
                "temperature": run.temperature,
                "adaptive": run.adaptive,
                "prompt_index": i,
                "prompt_token_ids": prompt,
                "output_token_ids": out.output_ids,
                "accepted_per_step": out.accepted_per_step,
                "drafted_per_step": out.drafted_per_step,
                "verifier_forwards": out.verifier_forwards,
            }


def plot_decode(section: dict, path: Path) -> Path:
    """Acceptance length per prompt set and run (offline τ beside it), and per-position acceptance."""
    runs = [r for r in section["runs"] if r["benchmark"] != ALL]
    names = list(dict.fromkeys(r["benchmark"] for r in runs))
    kinds = list(dict.fromkeys((r["temperature"], r["adaptive"]) for r in runs))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / (len(kinds) + 1)
    for j, (temp, adaptive) in enumerate(kinds):
        vals = {r["benchmark"]: r for r in runs if (r["temperature"], r["adaptive"]) == (temp, adaptive)}
        ys = [vals[n]["acceptance_length"] for n in names]
        errs = [vals[n]["acceptance_length_se"] or 0 for n in names]
        ax.bar(
            np.arange(len(names)) + j * width,
            ys,
            width,
            yerr=errs,
            label=f"T={temp:g}{' adaptive' if adaptive else ''}",
        )
    taus = section.get("offline_tau") or {}
    if taus:
        ys = [taus[n]["tau_mean_over_prompts"] if n in taus else 0 for n in names]
        ax.bar(np.arange(len(names)) + len(kinds) * width, ys, width, color="grey", label="offline τ (T=1 answers)")
    ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names)
    ax.set_ylabel("tokens per verifier forward")
    ax.legend(fontsize=7)
    for r in (r for r in section["runs"] if r["benchmark"] == ALL):
        pos = range(1, len(r["per_position_acceptance"]) + 1)
        ax2.plot(
            pos,
            r["per_position_acceptance"],
            "o-",
            label=f"T={r['temperature']:g}{' adaptive' if r['adaptive'] else ''}",
        )
    if ALL in taus:
        ax2.plot(range(1, len(taus[ALL]["cumulative"]) + 1), taus[ALL]["cumulative"], "k--", label="offline Π α")
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("accepted / verification steps")
    ax2.legend(fontsize=7)
    return _save(fig, path)


def run_decode(drafter_dir: Path, target: TargetConfig, cfg: EvalConfig, heldout: HeldoutConfig) -> dict:
    """Decode every prompt set, write decode.json, decode_outputs.jsonl and decode.png; returns the section."""
    device = pick_device(cfg.decode.device)
    engine, model, tokenizer, max_len = load_engine(drafter_dir, target, device)
    sets = prompt_sets(cfg, tokenizer, max_len - cfg.decode.max_new_tokens)
    if not sets:
        raise UserError("eval.decode: no prompt fits in the context (max_model_len − eval.decode.max_new_tokens)")
    runs, costs = decode_runs(engine, model, sets, cfg)
    B = engine.block_size
    groups: dict[tuple, list[DecodeRun]] = {}
    for run in runs:
        groups.setdefault((run.benchmark, run.temperature, run.adaptive), []).append(run)
        groups.setdefault((ALL, run.temperature, run.adaptive), []).append(run)
    order = list(sets)
    keys = sorted(groups, key=lambda k: (k[0] == ALL, order.index(k[0]) if k[0] in order else 0, k[1], k[2]))
    summaries = [run_summary(k[0], groups[k], B) for k in keys]
    taus, on_outputs = {}, {}
    if cfg.decode.offline_tau:
        tables = offline_tau(engine, model, sets, cfg, heldout)
        taus = {name: tau_summary(t) for name, t in tables.items() if t is not None}
        valid = [t for t in tables.values() if t is not None]
        if valid:
            taus[ALL] = tau_summary(pooled_table(valid))
        for run in runs:
            if run.temperature == 1.0 and not run.adaptive:
                table = score_answers(engine, model, run.prompts, [o.output_ids for o in run.outputs], cfg, heldout)
                if table is not None:
                    on_outputs[run.benchmark] = tau_at_block_starts(table, run)
    section = {
        "drafter": str(drafter_dir),
        "device": str(device),
        "block_size": B,
        "max_new_tokens": cfg.decode.max_new_tokens,
        "prompts": {name: len(p) for name, p in sets.items()},
        "adaptive_costs": None
        if costs is None
        else {
            **costs.as_step_costs(),
            "source": f"profiled on {device}" if cfg.decode.step_costs is None else "given (eval.decode.step_costs)",
        },
        "runs": summaries,
        "offline_tau": taus,
        "offline_tau_on_outputs": on_outputs,
        "comparison": comparison(summaries, taus, on_outputs),
    }
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / OUTPUTS_FILE).open("w") as f:
        for row in output_rows(runs):
            f.write(json.dumps(row) + "\n")
    section["plot"] = plot_decode(section, out_dir / PLOT_FILE).name
    write_report(section, out_dir, DECODE_FILE)
    return section


def headline(section: dict) -> str:
    lines = [f"{'prompt set':<12} {'T':>4} {'verify':>8} {'accept len':>16} {'fwd/token':>9} {'offline τ':>16}"]
    for r in section["runs"]:
        tau = (section["offline_tau"] or {}).get(r["benchmark"]) if r["temperature"] == 1.0 else None
        se = f" ± {r['acceptance_length_se']:.3f}" if r["acceptance_length_se"] is not None else ""
        tau_s = (
            f"{tau['tau_mean_over_prompts']:.3f}" + (f" ± {tau['tau_se']:.3f}" if tau and tau["tau_se"] else "")
            if tau
            else ""
        )
        lines.append(
            f"{r['benchmark']:<12} {r['temperature']:>4g} {'adaptive' if r['adaptive'] else 'fixed':>8} "
            f"{r['acceptance_length']:>7.3f}{se:<9} {r['verifier_forwards_per_token']:>9.3f} {tau_s:>16}"
        )
    return "\n".join(lines)


@stage_main("decode")
def main(cfg: DictConfig) -> None:
    target = load_section(TargetConfig, cfg, "target")
    eval_cfg = load_section(EvalConfig, cfg, "eval")
    heldout = load_section(HeldoutConfig, cfg, "heldout")
    drafter = Path(cfg.drafter)
    if not (drafter / "config.json").is_file():
        raise UserError(f"drafter={drafter}: not an exported drafter dir (no config.json)")
    section = run_decode(drafter, target, eval_cfg, heldout)
    report_path = Path(eval_cfg.out_dir) / REPORT_FILE
    if report_path.is_file():
        report = read_report(report_path)
        report["decode"] = section
        write_report(report, eval_cfg.out_dir)
    print(headline(section))
    print(f"decode: {Path(eval_cfg.out_dir) / DECODE_FILE}")


if __name__ == "__main__":
    main()
