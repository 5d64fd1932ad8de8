"""The GPU check: one script, one CUDA GPU, under 10 minutes (`bench/gpu_check.sh`).

Phases (each a subprocess with its own time limit; a failing phase does not stop the next):
1. `tests`: the `gpu`-marked tests (flex attention equal to SDPA, the stock CUDA connector,
   bf16 paths), with a JUnit XML report.
2. `train_step`: the training-step benchmark (`bench/bench_train_step.py`) on the GPU in bf16
   autocast with flex attention, against speculators (its fused losses, or its eager ones where
   the fused ones fail to compile, and flex attention).
3. `decode`: speculative decoding (`bench/bench_decode.py`) on the GPU against plain decoding of
   the same verifier: verifier forwards per token and the wall-time ratio (float32).
4. `serving`: the embedded default end to end on the GPU (`make demo`'s stages: data, extract,
   the demo training, eval), so DSpark is served by vLLM: acceptance length and speedup from
   the online benchmark next to eval.decode's acceptance length (speculative decoding on
   transformers, same drafter and prompts) and the offline τ of the same drafter.

It writes `<out>/gpu_check.json` (every phase's command, exit status, seconds and figures) and
`<out>/gpu_check.md` (the same as tables), with the commit measured (`DSPARK_COMMIT` when the
tree was copied without its git folder). Needs the venv made by `make setup` on a CUDA machine
(vLLM for CUDA) and the offline caches of the embedded default; `--dry-run` prints the plan and
needs neither. Where vLLM is not installed, `serving` is reported as skipped, with the reason,
and the other phases run.

Usage: bench/gpu_check.sh [--dry-run] [--out DIR] [--only tests,train_step,decode,serving] [--budget-s S]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("tests", "train_step", "decode", "serving")
SHARES = {"tests": 0.25, "train_step": 0.15, "decode": 0.1, "serving": 0.5}
"""Each phase's share of the time budget."""


@dataclass
class Phase:
    """One phase: the commands it runs (in order, stopping at the first failure), its time limit, and
    why it cannot run on this machine (None: it can)."""

    name: str
    commands: list[list[str]]
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 60.0
    skipped: str | None = None


def plan(python: str, out: Path, only: tuple[str, ...], budget_s: float) -> list[Phase]:
    """The phases to run, in order."""
    runs = out / "runs"
    torchrun = str(Path(python).with_name("torchrun"))
    phases = {
        "tests": Phase(
            "tests",
            [
                [
                    python,
                    "-m",
                    "pytest",
                    "-m",
                    "gpu",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    f"--junitxml={out / 'gpu_tests.xml'}",
                    "tests",
                ]
            ],
        ),
        "train_step": Phase(
            "train_step",
            [[python, "-m", "bench", "only=train_step", f"out={out}"]],
            env={"DSPARK_BENCH_DEVICE": "cuda", "DSPARK_BENCH_DTYPE": "bfloat16", "DSPARK_BENCH_ATTN": "flex"},
        ),
        "decode": Phase(
            "decode",
            [[python, "-m", "bench", "only=decode", f"out={out}"]],
            env={"DSPARK_BENCH_DEVICE": "cuda"},
        ),
        "serving": Phase(
            "serving",
            [
                [python, "-m", "extract.data"],
                [python, "-m", "extract"],
                [torchrun, "--standalone", "--nproc_per_node", "1", "-m", "train", "+experiment=demo"],
                [
                    python,
                    "-m",
                    "eval",
                    "eval.online.num_prompts=16",
                    "eval.online.max_tokens=256",
                    # eval.decode on the same prompts and length (the served runs are greedy)
                    "eval.decode.prompts_per_benchmark=16",
                    "eval.decode.max_new_tokens=256",
                    "eval.decode.adaptive=false",
                ],
            ],
            env={"DSPARK_RUNS": str(runs)},
        ),
    }
    chosen = [phases[name] for name in PHASES if name in only]
    for p in chosen:
        p.skipped = skip_reason(p.name)
    total = sum(SHARES[p.name] for p in chosen if not p.skipped) or 1.0  # skipped phases take no time
    for p in chosen:
        p.timeout_s = 0 if p.skipped else round(budget_s * SHARES[p.name] / total)
    return chosen


def skip_reason(name: str) -> str | None:
    """Why a phase cannot run on this machine (None: it can)."""
    if name == "serving" and find_spec("vllm") is None:
        return "vLLM is not installed in this environment (the serving phase needs vLLM for CUDA)"
    return None


def run_phase(phase: Phase, log_dir: Path) -> dict:
    """Run the phase's commands; its exit status, seconds and log file."""
    log = log_dir / f"{phase.name}.log"
    start, rc = time.monotonic(), 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **phase.env}
    with log.open("w") as f:
        for cmd in phase.commands:
            left = phase.timeout_s - (time.monotonic() - start)
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            try:
                rc = subprocess.run(
                    cmd, check=False, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=max(left, 1)
                ).returncode
            except subprocess.TimeoutExpired:
                rc = 124
                f.write(f"timed out after the phase's {phase.timeout_s} s\n")
            if rc:
                break
    return {"rc": rc, "seconds": round(time.monotonic() - start, 1), "log": log.name}


def test_figures(junit: Path) -> dict:
    """Passed, failed, errors and skipped of a JUnit XML report (pytest's)."""
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def train_step_figures(path: Path) -> dict:
    """Per shape: ratio to speculators, tokens/s and the FLOP-limit fraction (bench_train_step's JSON)."""
    rows = json.loads(path.read_text())["rows"]
    return {
        name: {
            "throughput_ratio": r["throughput_ratio"],
            "ratio_min_max": r["throughput_ratio_min_max"],
            "tokens_per_s": r["tokens_per_s"],
            "flop_limit_fraction": r["flop_limit_fraction"],
            "speculators_losses": r.get("speculators_losses"),
        }
        for name, r in rows.items()
    }


def serving_figures(report_path: Path) -> dict:
    """Offline τ and, per online run, acceptance length, tokens/s and speedup (eval's report.json)."""
    report = json.loads(report_path.read_text())
    online = report.get("online", {})
    runs = [
        {k: r.get(k) for k in ("name", "acceptance_length", "tokens_per_s", "speedup")} for r in online.get("runs", [])
    ]
    decode = report.get("decode") or {}
    return {
        "offline_tau": report["offline"]["overall"]["tau"],
        "decode_runs": [
            {k: r.get(k) for k in ("temperature", "adaptive", "prompts", "acceptance_length", "acceptance_length_se")}
            for r in decode.get("runs", [])
            if r["benchmark"] == "all"
        ],
        "decode_offline_tau": ((decode.get("offline_tau") or {}).get("all") or {}).get("tau_mean_over_prompts"),
        "online_runs": runs,
        "online_skipped": online.get("skipped"),
        "vllm_version": online.get("vllm_version"),
    }


def decode_figures(path: Path) -> dict:
    """Per temperature and verification: forwards per token, acceptance length, wall ratio (bench_decode's JSON)."""
    found = json.loads(path.read_text())
    return {"device": found.get("device"), "drafter": found.get("drafter"), "runs": found["runs"]}


def figures(name: str, out: Path) -> dict | None:
    """What a finished phase measured, read from the files it wrote (None when it wrote none)."""
    sources = {
        "tests": (out / "gpu_tests.xml", test_figures),
        "train_step": (out / "train_step.json", train_step_figures),
        "decode": (out / "decode.json", decode_figures),
    }
    if name == "serving":
        found = sorted((out / "runs").glob("*/eval/report.json"))
        sources[name] = (found[0] if found else out / "runs" / "missing", serving_figures)
    path, read = sources[name]
    return read(path) if path.exists() else None


def markdown(report: dict) -> str:
    """The report as Markdown tables."""
    lines = ["# GPU check", "", f"device: {report['device']}", f"commit: {report.get('commit')}, {report.get('date')}"]
    lines += ["", "| phase | exit | seconds |", "|---|---|---|"]
    lines += [
        f"| {p} | {r['rc'] if 'skipped' not in r else 'skipped: ' + r['skipped']} | {r['seconds']} |"
        for p, r in report["phases"].items()
    ]
    tests = report["phases"].get("tests", {}).get("figures")
    if tests:
        lines += [
            "",
            (
                f"gpu tests: {tests['passed']} passed, {tests['failures']} failed, "
                f"{tests['errors']} errors, {tests['skipped']} skipped"
            ),
        ]
    step = report["phases"].get("train_step", {}).get("figures")
    if step:
        lines += [
            "",
            "| shape | tokens/s (this trainer) | tokens/s (speculators) | ratio | FLOP-limit fraction |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {n} | {r['tokens_per_s']['ours']} | {r['tokens_per_s']['speculators']} | "
            f"{r['throughput_ratio']} | {r['flop_limit_fraction']['ours']} |"
            for n, r in step.items()
        ]
    decode = report["phases"].get("decode", {}).get("figures")
    if decode:
        lines += [
            "",
            f"speculative decoding on {decode['device']} ({decode['drafter']} drafter), against plain decoding:",
            "",
            "| run | verifier forwards / token | acceptance length | wall ratio vs plain |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {n} | {r['verifier_forwards_per_token']:.3f} | {r['acceptance_length']:.3f} | "
            f"{r['wall_ratio_vs_plain']:.2f} |"
            for n, r in decode["runs"].items()
        ]
    serving = report["phases"].get("serving", {}).get("figures")
    if serving:
        lines += [
            "",
            f"offline τ: {serving['offline_tau']:.3f}",
            "",
            "| online run | acceptance length | tokens/s | speedup |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r['name']} | {r['acceptance_length']} | {r['tokens_per_s']} | {r['speedup']} |"
            for r in serving["online_runs"]
        ]
        lines += side_by_side(serving)
    return "\n".join(lines) + "\n"


def side_by_side(serving: dict) -> list[str]:
    """vLLM's served acceptance length (greedy, from its counters), eval.decode's and the offline τ
    (on verifier answers sampled at temperature 1), same drafter and prompts."""
    decode = [r for r in serving.get("decode_runs", []) if not r["adaptive"]]
    if not decode:
        return []
    served = next((r["acceptance_length"] for r in serving["online_runs"] if r.get("acceptance_length")), None)
    tau = serving.get("decode_offline_tau")
    lines = [
        "",
        "| temperature | vLLM served acceptance length | eval.decode acceptance length | offline τ (T=1 answers) |",
        "|---|---|---|---|",
    ]
    for r in decode:
        greedy = r["temperature"] == 0
        se = f" ± {r['acceptance_length_se']:.3f}" if r.get("acceptance_length_se") is not None else ""
        lines.append(
            f"| {r['temperature']:g} | {served if greedy and served is not None else '—'} | "
            f"{r['acceptance_length']:.3f}{se} | {'—' if greedy or tau is None else f'{tau:.3f}'} |"
        )
    return lines


def write_report(report: dict, out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    (out / "gpu_check.md").write_text(markdown(report))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/gpu_check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu_check")
    parser.add_argument("--only", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    parser.add_argument("--budget-s", type=float, default=570.0, help="time for all phases together (s)")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    only = tuple(p.strip() for p in args.only.split(",") if p.strip())
    unknown = sorted(set(only) - set(PHASES))
    if unknown or not only:
        parser.error(f"--only: unknown or no phase(s) {unknown}; choose from {','.join(PHASES)}")
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0, got {args.budget_s}")
    args.only = only
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    phases = plan(args.python, out, args.only, args.budget_s)
    if args.dry_run:
        for p in phases:
            env = " ".join(f"{k}={v}" for k, v in p.env.items())
            if p.skipped:
                print(f"[{p.name}] skipped: {p.skipped}")
                continue
            print(f"[{p.name}] time limit {p.timeout_s} s" + (f", env {env}" if env else ""))
            for cmd in p.commands:
                print("  " + " ".join(cmd))
        print(f"report: {out / 'gpu_check.json'}, {out / 'gpu_check.md'}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print(
            "error: no CUDA device here; run bench/gpu_check.sh on a GPU machine (--dry-run shows the plan)",
            file=sys.stderr,
        )
        return 2
    out.mkdir(parents=True, exist_ok=True)
    from bench.ablate_record import git_state

    report = {
        "device": torch.cuda.get_device_name(0),
        "commit": git_state()["commit"],
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "budget_s": args.budget_s,
        "phases": {},
    }
    for p in phases:
        print(f"== {p.name} (limit {p.timeout_s} s)", flush=True)
        result = {"commands": [" ".join(c) for c in p.commands], "env": p.env}
        if p.skipped:
            report["phases"][p.name] = {**result, "rc": None, "seconds": 0.0, "skipped": p.skipped, "figures": None}
            print(f"   skipped: {p.skipped}", flush=True)
            continue
        result |= run_phase(p, out)
        result["figures"] = figures(p.name, out)
        report["phases"][p.name] = result
        write_report(report, out)  # after every phase: a later timeout loses nothing
        print(f"   exit {result['rc']} after {result['seconds']} s", flush=True)
    print(markdown(report))
    return 0 if all(r["rc"] in (0, None) for r in report["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
