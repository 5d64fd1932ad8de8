"""`python -m eval drafter=<dir> key=value ...` (make eval DRAFTER=...): see conf/eval.yaml."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from dspark.config import HeldoutConfig, TargetConfig, load_section
from dspark.entry import stage_main
from dspark.errors import UserError
from dspark.eval.card import benchmark_names, budget_headline, refit_phrase
from dspark.eval.config import EvalConfig
from dspark.eval.decode import headline as decode_headline
from dspark.eval.evaluate import evaluate_drafter
from dspark.extract.config import ServerConfig


def stage_configs(cfg: DictConfig) -> tuple[TargetConfig, EvalConfig, HeldoutConfig, ServerConfig]:
    """The target, eval, heldout and server sections as checked dataclasses."""
    return (
        load_section(TargetConfig, cfg, "target"),
        load_section(EvalConfig, cfg, "eval"),
        load_section(HeldoutConfig, cfg, "heldout"),
        load_section(ServerConfig, cfg, "server"),
    )


def run(cfg: DictConfig) -> dict:
    """Evaluate `cfg.drafter`; returns the report (also written to `eval.out_dir/report.json`)."""
    sections = stage_configs(cfg)  # a bad config value is refused before anything is read
    drafter = Path(cfg.drafter)
    if not (drafter / "config.json").is_file():
        raise UserError(f"drafter={drafter}: not an exported drafter dir (no config.json)")
    return evaluate_drafter(drafter, *sections)


def headline(report: dict) -> str:
    lines = []
    if report.get("offline"):
        overall = report["offline"]["overall"]
        lines.append(
            f"offline τ {overall['tau']:.3f} over {overall['blocks']} blocks; cumulative acceptance "
            + " ".join(f"{a:.3f}" for a in overall["cumulative"])
        )
    if report.get("benchmarks"):
        bench = report["benchmarks"]
        lines.append(
            "offline τ per benchmark: "
            + ", ".join(f"{name} {bench['by_benchmark'][key]['tau']:.3f}" for key, name in benchmark_names(bench))
        )
    if report.get("calibration"):
        c = report["calibration"]
        lines.append(
            f"confidence ECE {c['before']['pooled']['ece']:.4f} -> {c['after']['pooled']['ece']:.4f} "
            f"with STS temperatures " + " ".join(f"{t:.3f}" for t in c["temperatures"])
        )
        served = c.get("served")
        if served:
            lines.append(
                f"confidence head as vLLM serves it: logit x {served['slope']:.3f} {served['intercept']:+.3f}"
                f"{refit_phrase(served)} folded in, ECE {served['pooled']['ece']:.4f}, AUROC per position "
                + " ".join(f"{p['auroc']:.3f}" for p in served["per_position"])
            )
        # the budget of the head vLLM schedules on: as served where the report has it
        budget = (served or {}).get("budget") or c.get("budget")
        if budget:
            lines.append(budget_headline(budget))
    if report.get("decode"):
        lines.append("speculative decoding (transformers):\n" + decode_headline(report["decode"]))
    for r in (report.get("online") or {}).get("runs", []):
        extra = f", speedup {r['speedup']:.2f}x" if "speedup" in r else ""
        extra += f", acceptance length {r['acceptance_length']:.3f}" if "acceptance_length" in r else ""
        lines.append(f"served {r['name']}: {r['tokens_per_s']:.1f} tok/s{extra}")
    if (report.get("online") or {}).get("skipped"):
        lines.append(f"online: {report['online']['skipped']}")
    return "\n".join(lines)


@stage_main("eval")
def main(cfg: DictConfig) -> None:
    report = run(cfg)
    print(headline(report))
    print(f"report: {Path(cfg.eval.out_dir) / 'report.json'}")


if __name__ == "__main__":
    main()
