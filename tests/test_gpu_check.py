"""bench/gpu_check.sh on CPU: its plan (--dry-run), its argument handling, and the report it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_check.sh"


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )


def test_dry_run_prints_every_phase_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    proc = run_script("--dry-run", "--out", str(out), "--budget-s", "500")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for expected in (
        "[tests] time limit 125 s",
        "-m pytest -m gpu",
        f"--junitxml={out / 'gpu_tests.xml'}",
        "[train_step] time limit 75 s",
        "DSPARK_BENCH_DEVICE=cuda DSPARK_BENCH_DTYPE=bfloat16 DSPARK_BENCH_ATTN=flex",
        f"-m bench only=train_step out={out}",
        "[decode] time limit 50 s",
        f"-m bench only=decode out={out}",
        "[serving] time limit 250 s",
        f"DSPARK_RUNS={out / 'runs'}",
        "-m extract.data",
        "-m train +experiment=demo",
        "-m eval eval.online.num_prompts=16",
        f"report: {out / 'gpu_check.json'}",
    ):
        assert expected in text, expected
    assert not out.exists()  # a dry run writes nothing


def test_only_picks_phases_and_gives_them_the_whole_budget(tmp_path):
    phases = gpu_check.plan(sys.executable, tmp_path, ("serving", "tests"), 300)
    assert [p.name for p in phases] == ["tests", "serving"]  # always in the fixed order
    assert sum(p.timeout_s for p in phases) == 300


@pytest.mark.parametrize(
    "args, message",
    [
        (["--only", "tests,gpu"], "--only: unknown or no phase(s) ['gpu']"),
        (["--only", ","], "--only: unknown or no phase(s) []"),
        (["--budget-s", "0"], "--budget-s must be > 0"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args, message):
    proc = run_script(*args)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_to_run_without_cuda(tmp_path):
    proc = run_script("--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "error: no CUDA device here" in proc.stderr and "--dry-run" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_report_from_the_files_the_phases_write(tmp_path):
    """A real pytest JUnit file, the train-step benchmark's JSON and eval's report.json, as the phases leave them."""
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_x.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert False\n"
        "@pytest.mark.skip\n"
        "def test_skipped(): pass\n"
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            "/dev/null",
            f"--rootdir={tests}",
            f"--junitxml={tmp_path / 'gpu_tests.xml'}",
            str(tests),
        ],
        capture_output=True,
        timeout=120,
        check=False,
    )
    row = {
        "throughput_ratio": 2.5,
        "throughput_ratio_min_max": [2.1, 2.9],
        "tokens_per_s": {"ours": 50000.0, "speculators": 20000.0},
        "flop_limit_fraction": {"ours": 0.41, "speculators": 0.16},
    }
    (tmp_path / "train_step.json").write_text(json.dumps({"rows": {"qwen2.5-0.5b": row}}))
    decode_row = {"verifier_forwards_per_token": 0.8125, "acceptance_length": 1.25, "wall_ratio_vs_plain": 1.5}
    (tmp_path / "decode.json").write_text(
        json.dumps({"device": "NVIDIA H200", "drafter": "random", "runs": {"T0_fixed": decode_row}})
    )
    eval_dir = tmp_path / "runs" / "smollm2-135m" / "eval"
    eval_dir.mkdir(parents=True)
    (eval_dir / "report.json").write_text(
        json.dumps(
            {
                "offline": {"overall": {"tau": 1.8765, "blocks": 100}},
                "online": {
                    "vllm_version": "0.11",
                    "skipped": None,
                    "runs": [
                        {"name": "baseline", "tokens_per_s": 100.0, "speculative_config": None},
                        {"name": "dspark k=4", "tokens_per_s": 160.0, "acceptance_length": 1.9, "speedup": 1.6},
                    ],
                },
            }
        )
    )

    report = {
        "device": "NVIDIA H200",
        "budget_s": 570,
        "phases": {
            name: {"rc": 0, "seconds": 1.0, "figures": gpu_check.figures(name, tmp_path)} for name in gpu_check.PHASES
        },
    }
    assert report["phases"]["tests"]["figures"] == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1, "passed": 1}
    assert report["phases"]["train_step"]["figures"]["qwen2.5-0.5b"]["throughput_ratio"] == 2.5
    assert report["phases"]["decode"]["figures"]["runs"]["T0_fixed"] == decode_row
    serving = report["phases"]["serving"]["figures"]
    assert serving["offline_tau"] == 1.8765
    assert serving["online_runs"][1] == {
        "name": "dspark k=4",
        "acceptance_length": 1.9,
        "tokens_per_s": 160.0,
        "speedup": 1.6,
    }
    gpu_check.write_report(report, tmp_path)
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == report
    md = (tmp_path / "gpu_check.md").read_text()
    assert "gpu tests: 1 passed, 1 failed, 0 errors, 1 skipped" in md
    assert "| qwen2.5-0.5b | 50000.0 | 20000.0 | 2.5 | 0.41 |" in md
    assert "offline τ: 1.877" in md and "| dspark k=4 | 1.9 | 160.0 | 1.6 |" in md
    assert "| T0_fixed | 0.812 | 1.250 | 1.50 |" in md
    # A phase that cannot run here is reported as skipped, with its reason.
    skipped = {"rc": None, "seconds": 0.0, "skipped": "vLLM is not installed", "figures": None}
    assert "| serving | skipped: vLLM is not installed | 0.0 |" in gpu_check.markdown(
        {"device": "x", "commit": "abc", "phases": {"serving": skipped}}
    )
    # A phase that wrote nothing has no figures (and the report still renders).
    assert gpu_check.figures("serving", tmp_path / "empty") is None


VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="smollm2"} 200.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="smollm2"} 1.76e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="smollm2"} 800.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="smollm2"} 250.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smollm2",position="0"} 120.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smollm2",position="1"} 80.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smollm2",position="2"} 40.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smollm2",position="3"} 10.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="smollm2"} 450.0
"""


def test_served_decode_and_offline_side_by_side(tmp_path):
    """vLLM's served acceptance length from its Prometheus counters, eval.decode's and the offline τ in one table."""
    from dspark.eval.online import ServerCounters, parse_metrics, spec_decode_summary

    served = spec_decode_summary(parse_metrics(VLLM_METRICS) - ServerCounters())
    assert served["acceptance_length"] == 1 + 250 / 200
    assert served["per_position_acceptance"] == [0.6, 0.4, 0.2, 0.05]
    eval_dir = tmp_path / "runs" / "smollm2-135m" / "eval"
    eval_dir.mkdir(parents=True)
    decode_run = {"benchmark": "all", "prompts": 16, "acceptance_length_se": 0.05}
    report = {
        "offline": {"overall": {"tau": 1.9}},
        "online": {"runs": [{"name": "dspark k=4", "tokens_per_s": 150.0, "speedup": 1.5, **served}]},
        "decode": {
            "runs": [
                {**decode_run, "temperature": 0.0, "adaptive": False, "acceptance_length": 2.25},
                {**decode_run, "temperature": 1.0, "adaptive": False, "acceptance_length": 2.1},
                {**decode_run, "benchmark": "gsm8k", "temperature": 1.0, "adaptive": False, "acceptance_length": 9.0},
            ],
            "offline_tau": {"all": {"tau_mean_over_prompts": 2.08}},
        },
    }
    (eval_dir / "report.json").write_text(json.dumps(report))
    serving = gpu_check.figures("serving", tmp_path)
    assert [r["temperature"] for r in serving["decode_runs"]] == [0.0, 1.0]
    md = gpu_check.markdown(
        {"device": "NVIDIA H200", "phases": {"serving": {"rc": 0, "seconds": 1, "figures": serving}}}
    )
    assert "| 0 | 2.25 | 2.250 ± 0.050 | — |" in md
    assert "| 1 | — | 2.100 ± 0.050 | 2.080 |" in md


def test_commit_of_a_copied_tree_comes_from_the_environment(monkeypatch):
    """A tree copied to a GPU machine without its git folder (or with a stale one) records DSPARK_COMMIT."""
    from bench.ablate_record import git_state

    monkeypatch.setenv("DSPARK_COMMIT", "c10fe3d")
    assert git_state() == {"commit": "c10fe3d", "dirty": None}
    monkeypatch.delenv("DSPARK_COMMIT")
    assert len(git_state()["commit"]) == 40
