"""Model card (README.md) of an exported drafter, rendered from the evaluation report only.

The card takes nothing but `report.json`'s content, so every figure it shows is one the
report holds; numbers are printed by `fmt`, which the tests use to check that claim.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dspark.eval.calibration import SCHEDULES

CARD_FILE = "README.md"
ABSENT = "not recorded"
# how the card names the drafter and a verifier known only by a local path
DRAFTER_DIR = "<this directory>"
VERIFIER_PATH = "<path to verifier>"
BENCHMARK_NAMES = {"mtbench": "MT-Bench", "gsm8k": "GSM8K", "humaneval": "HumanEval"}


def fmt(value) -> str:
    """How the card prints a figure: integers as they are, floats with 3 decimals (3 significant
    digits in exponent form below 0.001, where 3 decimals would print 0.000)."""
    if value is None:
        return ABSENT
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.2e}" if 0 < abs(value) < 1e-3 else f"{value:.3f}"
    if isinstance(value, (list, dict)):
        return "`" + json.dumps(value) + "`"
    return str(value)


def public(value: str | None, placeholder: str) -> str:
    """A name as the card shows it: hub ids and relative names as they are; an absolute path of the
    machine that trained the drafter becomes `placeholder` (the card must read right anywhere)."""
    if not value:
        return placeholder
    return placeholder if os.path.isabs(value) else value


def _cell(value) -> str:
    if isinstance(value, str):
        return public(value, f"<local path>/{Path(value).name}")
    return fmt(value)


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _get(d: dict | None, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _usage(drafter: dict) -> list[str]:
    spec = json.dumps(
        {"method": "dspark", "model": DRAFTER_DIR, "num_speculative_tokens": drafter.get("speculative_tokens")}
    )
    return [
        "## Usage",
        "",
        "```bash",
        f"vllm serve {DRAFTER_DIR}",
        "# or name the verifier explicitly (e.g. a local copy of it):",
        f"vllm serve {public(drafter['verifier'], VERIFIER_PATH)} --speculative-config '{spec}'",
        "```",
        "",
        'vLLM serves DSpark on its GPU runner. Add `"enable_adaptive_verification": true` to the',
        "speculative config to let the confidence head shorten drafts.",
        "",
    ]


def _architecture(d: dict) -> list[str]:
    keys = [
        "verifier",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "block_size",
        "speculative_tokens",
        "verifier_vocab_size",
        "draft_vocab_size",
        "aux_hidden_state_layer_ids",
        "mask_token_id",
        "sample_from_anchor",
        "markov_rank",
        "markov_head_type",
        "confidence_head",
        "confidence_head_with_markov",
        "layer_types",
        "sliding_window",
    ]
    return [
        "## Architecture",
        "",
        "DSpark parallel block drafter over the verifier's aux hidden states, with a "
        "Markov (sequential) logit-bias head and a confidence head; the verifier's embedding, final norm and "
        "lm_head are frozen and shared.",
        "",
        *_table(["field", "value"], [[k, "none" if d.get(k) is None else d[k]] for k in keys]),
    ]


def _data(data: dict) -> list[str]:
    rows = []
    for key in ("name", "source", "path", "rows", "usable", "selected", "max_turns", "eval_fraction"):
        if _get(data, "source", key) is not None:
            rows.append([f"source.{key}", data["source"][key]])
    for split, stats in (data.get("splits") or {}).items():
        rows += [[f"{split}.{k}", v] for k, v in stats.items()]
    regen = data.get("regeneration") or {}
    rows += [[f"regeneration.{k}", v] for k, v in regen.items() if not isinstance(v, dict)]
    store = data.get("heldout_store") or {}
    rows += [[f"heldout_store.{k}", store.get(k)] for k in ("samples", "tokens", "layer_ids") if k in store]
    if not rows:
        return ["## Data", "", ABSENT + " (no data summary.json or store found)", ""]
    return ["## Data", "", *_table(["field", "value"], rows)]


def _training(t: dict) -> list[str]:
    keys = ["steps", "best_step", "epochs", "world_size", "train_time_s", "hardware", "tokens_per_s"]
    rows = [[k, t.get(k)] for k in keys]
    final = t.get("final_eval") or {}
    if "tau" in final:
        rows.append(["final held-out τ (training eval)", final["tau"]])
    return ["## Training", "", *_table(["field", "value"], rows)]


def _offline(off: dict) -> list[str]:
    overall = off["overall"]
    out = [
        "## Acceptance (offline, held-out data)",
        "",
        "Analytic acceptance α_k = Σ_v min(q_k, p_k) against the verifier's full-vocabulary distribution at "
        "temperature 1 (mass outside a reduced draft vocabulary counts as rejected); "
        "τ = 1 + Σ_k Π_{j≤k} α_j tokens per verifier step.",
        "",
        *_table(
            ["figure", "value"], [["τ", overall["tau"]], ["blocks", overall["blocks"]], ["samples", off["samples"]]]
        ),
        *_table(
            ["position", "cumulative Π α", "conditional α"],
            [[str(k + 1), c, a] for k, (c, a) in enumerate(zip(overall["cumulative"], overall["conditional"]))],
        ),
    ]
    for key, title in (
        ("by_length", "sequence length"),
        ("by_anchor_position", "anchor position"),
        ("by_source", "source"),
    ):
        if off.get(key):
            out += [
                f"τ by {title}:",
                "",
                *_table([title, "τ", "blocks"], [[name, s["tau"], s["blocks"]] for name, s in off[key].items()]),
            ]
    return out


def benchmark_names(bench: dict) -> list[tuple[str, str]]:
    """(source key, display name) of each benchmark in a report's benchmarks section."""
    return [(key, BENCHMARK_NAMES.get(key, key)) for key in bench.get("by_benchmark") or {}]


def _benchmarks(bench: dict) -> list[str]:
    names = benchmark_names(bench)
    rows = [
        [label, *[bench["by_benchmark"][key][figure] for key, _ in names], bench["overall"][figure]]
        for label, figure in (("τ", "tau"), ("blocks", "blocks"))
    ]
    return [
        "## Acceptance per benchmark (offline)",
        "",
        f"τ as above on the standard eval sets' prompts, answered by the verifier ({fmt(bench['samples'])} "
        "held-out samples, `data=benchmarks`).",
        "",
        *_table(["figure", *[name for _, name in names], "all"], rows),
    ]


def _calibration(cal: dict) -> list[str]:
    rows = []
    for k, (b, a) in enumerate(zip(cal["before"]["per_position"], cal["after"]["per_position"])):
        rows.append(
            [
                str(k + 1),
                cal["temperatures"][k],
                b["ece"],
                a["ece"],
                b["auroc"],
                a["auroc"],
                b.get("auroc_ceiling", ""),
                b["brier"],
                a["brier"],
            ]
        )
    pooled_b, pooled_a = cal["before"]["pooled"], cal["after"]["pooled"]
    rows.append(
        [
            "all",
            "",
            pooled_b["ece"],
            pooled_a["ece"],
            pooled_b["auroc"],
            pooled_a["auroc"],
            pooled_b.get("auroc_ceiling", ""),
            pooled_b["brier"],
            pooled_a["brier"],
        ]
    )
    return [
        "## Confidence head",
        "",
        "Prefix-survival prediction Π_{j≤k} c_j against the realized analytic acceptance Π_{j≤k} α_j, before and "
        "after per-position sequential temperature scaling (temperatures in `calibration.json`, fitted on "
        f"{fmt(cal['fit_samples'])} held-out samples, scored on the other {fmt(cal['scored_samples'])}). "
        "The acceptance is a probability, so no score reaches AUROC 1: the ceiling is the AUROC of the "
        "acceptance itself used as the score.",
        "",
        *_table(
            [
                "position",
                "temperature",
                "ECE raw",
                "ECE STS",
                "AUROC raw",
                "AUROC STS",
                "AUROC ceiling",
                "Brier raw",
                "Brier STS",
            ],
            rows,
        ),
        *(_served(cal) if cal.get("served") else []),
        *(_budget(cal["budget"]) if cal.get("budget") else []),
    ]


def refit_phrase(served: dict) -> str:
    """What the served map holds beyond the slope and intercept (`eval.calibration.refit`), in words."""
    refit = served.get("refit")
    if refit is None:
        return ""
    if refit["l2"] is None:
        tried = "the cross-validation kept it" if refit["cv_nll"] else "too few conversations to cross-validate"
        return f", with no correction (a refit of the head was tried: {tried})"
    return f", plus a linear correction on the features the head reads (ridge {refit['l2']:g}, cross-validated)"


def _served(cal: dict) -> list[str]:
    served = cal["served"]
    return [
        "",
        "vLLM reads the head's sigmoid as each slot's acceptance probability, one head for every position, "
        "and no temperatures: `make eval` folded one slope and intercept, fitted on the same samples as the "
        f"temperatures, into the head (slope {fmt(served['slope'])}, intercept {fmt(served['intercept'])}"
        f"{refit_phrase(served)}; `folds` in `calibration.json`). Pooled ECE of the head as served now, on the "
        f"scored samples: {fmt(served['pooled']['ece'])} (raw {fmt(cal['before']['pooled']['ece'])}, "
        f"STS {fmt(cal['after']['pooled']['ece'])}); AUROC per position "
        + " / ".join(fmt(p["auroc"]) for p in served["per_position"])
        + "."
        + (
            f" Scheduled on as served, it spares {fmt(served['budget']['confidence']['saved'])} of the drafts "
            f"at the bound below (after STS: {fmt(cal['budget']['confidence']['saved'])})."
            if served.get("budget") and cal.get("budget")
            else ""
        ),
    ]


def budget_headline(budget: dict) -> str:
    """One line: the share of drafts the confidence head spares the verifier, against a fixed budget."""
    conf, fixed = budget["confidence"], budget["fixed"]
    line = (
        f"verification budget (tau loss <= {budget['max_tau_loss']:.0%} on the fit samples): the confidence "
        f"head saves {_share(conf)} of drafts (tau loss {conf['tau_loss']:.2%}), a fixed budget "
        f"{_share(fixed)} (tau loss {fixed['tau_loss']:.2%}), the oracle {_share(budget['oracle'])}"
    )
    lead = budget.get("confidence_vs_fixed")
    return line if lead is None else f"{line}; the head's lead {lead['saved']:+.1%} ± {lead['se']:.1%}"


def _share(schedule: dict) -> str:
    """A schedule's share of drafts saved, with its SE where the budget has one."""
    se = schedule.get("saved_se")
    return f"{schedule['saved']:.1%}" + ("" if se is None else f" ± {se:.1%}")


def _budget(budget: dict) -> list[str]:
    lead = budget.get("confidence_vs_fixed")
    rows = [["every slot", None, budget["all_slots"]["tau"], None, budget["all_slots"]["sent"], None, None]]
    rows += [
        [
            name,
            budget[name]["setting"],
            budget[name]["tau"],
            budget[name]["tau_loss"],
            budget[name]["sent"],
            budget[name]["saved"],
            budget[name].get("saved_se"),
        ]
        for name in SCHEDULES
    ]
    return [
        "### Verification budget",
        "",
        "Drafts sent to the verifier per block when it verifies only some slots: `fixed` the first s of "
        "every block (s is the setting; fractional: slot ⌊s⌋+1 in that share of blocks), `confidence` "
        "those whose calibrated survival reaches a threshold, `oracle` those whose true acceptance does "
        "(the ceiling). Each setting sends the fewest drafts with τ within "
        f"{fmt(budget['max_tau_loss'])} (relative) of verifying every slot on the fit samples; the figures are "
        "on the scored samples, each SE a bootstrap over the scored conversations. A confidence head is "
        "worth scheduling on where it saves more than `fixed`"
        + ("." if lead is None else f": here {fmt(lead['saved'])} ± {fmt(lead['se'])} of the drafts (paired)."),
        "",
        *_table(["schedule", "setting", "τ", "τ loss", "drafts sent", "saved", "saved SE"], rows),
    ]


def _online(on: dict) -> list[str]:
    out = [
        "## Served speed (vLLM)",
        "",
        f"{fmt(on['prompts'])} prompts, {fmt(on['max_tokens'])} greedy tokens each, concurrency 1, "
        f"device {on['device']}, vLLM {on.get('vllm_version') or ABSENT}.",
        "",
    ]
    rows = [[r["name"], r["tokens_per_s"], r.get("speedup"), r.get("acceptance_length")] for r in on["runs"]]
    out += _table(["run", "tokens/s", "speedup", "acceptance length"], rows)
    for r in on["runs"]:
        if r.get("per_position_acceptance"):
            out += [
                f"Per-position acceptance, {r['name']}:",
                "",
                *_table(
                    ["position", "accepted / drafts"],
                    [[str(k + 1), v] for k, v in enumerate(r["per_position_acceptance"])],
                ),
            ]
    if on.get("skipped"):
        out += [f"Skipped: {on['skipped']}.", ""]
    return out


def _decode(dec: dict) -> list[str]:
    out = [
        "## Speculative decoding (transformers)",
        "",
        f"The drafter as exported, run by `python -m eval.decode` the way vLLM's DSpark proposer runs it: "
        f"{fmt(dec['max_new_tokens'])} tokens per prompt, block of {fmt(dec['block_size'])}, device {dec['device']}. "
        "Acceptance length = tokens per verifier forward, bonus included (± standard error over prompts); "
        "greedy outputs equal the verifier's own greedy decoding token for token; offline τ is scored on "
        "verifier answers to the same prompts sampled at temperature 1.",
        "",
    ]
    costs = dec.get("adaptive_costs")
    if costs:
        verify = ", ".join(f"{v:.3g}" for v in costs["verify_ms"])
        out += [
            f"Adaptive verification's step costs ({costs['source']}): a draft step {costs['draft_ms']:.3g} ms, "
            f"a verifier forward of 1..{len(costs['verify_ms'])} tokens {verify} ms.",
            "",
        ]
    taus = dec.get("offline_tau") or {}
    rows = []
    for r in dec["runs"]:
        tau = taus.get(r["benchmark"]) if r["temperature"] == 1.0 and not r["adaptive"] else None
        rows.append(
            [
                r["benchmark"],
                f"{r['temperature']:g}",
                "adaptive" if r["adaptive"] else "fixed",
                fmt(r["prompts"]),
                r["acceptance_length"],
                r["acceptance_length_se"],
                r["verifier_forwards_per_token"],
                None if tau is None else tau["tau_mean_over_prompts"],
            ]
        )
    return out + _table(
        [
            "prompt set",
            "T",
            "verification",
            "prompts",
            "acceptance length",
            "SE",
            "verifier forwards / token",
            "offline τ",
        ],
        rows,
    )


def render_card(report: dict) -> str:
    drafter = report["drafter"]
    lines = [
        f"# DSpark drafter for {public(drafter['verifier'], Path(drafter['verifier'] or 'its verifier').name)}",
        "",
        "A DSpark speculative-decoding drafter (semi-autoregressive block drafting with a confidence head) "
        "in the speculators format that vLLM loads. Every figure below is taken from this evaluation's "
        "`report.json`.",
        "",
        *_usage(drafter),
        *_architecture(drafter),
        *_data(report.get("data") or {}),
        *_training(report.get("training") or {}),
    ]
    if report.get("offline"):
        lines += _offline(report["offline"])
    if report.get("benchmarks"):
        lines += _benchmarks(report["benchmarks"])
    if report.get("calibration"):
        lines += _calibration(report["calibration"])
    if report.get("decode"):
        lines += _decode(report["decode"])
    if report.get("online"):
        lines += _online(report["online"])
    return "\n".join(lines).rstrip() + "\n"


def write_card(report: dict, drafter_dir: str | Path) -> Path:
    path = Path(drafter_dir) / CARD_FILE
    tmp = path.with_name(f".{CARD_FILE}.tmp-{os.getpid()}")
    tmp.write_text(render_card(report))
    os.replace(tmp, path)
    return path


__all__ = ["BENCHMARK_NAMES", "CARD_FILE", "benchmark_names", "fmt", "render_card", "write_card"]
