"""Export replaces the drafter whole: a process SIGKILLed at any point of an export leaves a complete drafter.

A real child process exports drafters in a loop (drafter k: weights from seed k, meta
step k) and is SIGKILLed, at random moments and at the two worst ones (between the
renames of the swap, and before the old tree is deleted). After every kill the drafter
must load and be exactly one of the exported ones; the next export (or load) recovers.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from drafts import draft_config, make_draft

from dspark.atomic_dir import aside_dir
from dspark.export import export_drafter, load_drafter
from dspark.verifier import VerifierHead

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import os, signal, sys
    from drafts import draft_config, make_draft
    import dspark.atomic_dir
    from dspark.export import export_drafter
    from dspark.verifier import VerifierHead

    verifier_dir, out, first, kill_at_rename = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    verifier = VerifierHead.from_pretrained(verifier_dir)
    renames = 0
    real_rename = os.rename

    def rename_then_maybe_die(src, dst):
        global renames
        real_rename(src, dst)
        renames += 1
        if renames == kill_at_rename:
            os.kill(os.getpid(), signal.SIGKILL)

    dspark.atomic_dir.os.rename = rename_then_maybe_die
    print("ready", flush=True)
    step = first
    while True:
        export_drafter(make_draft(verifier, draft_config(), seed=step), out, verifier_dir, {"step": step}, vllm_check=False)
        print("exported", step, flush=True)
        step += 1
""")


@pytest.fixture(scope="module")
def verifier(tiny_qwen3_dir) -> VerifierHead:
    return VerifierHead.from_pretrained(tiny_qwen3_dir)


def start_child(script: Path, verifier_dir: Path, out: Path, first: int, kill_at_rename: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(script), str(verifier_dir), str(out), str(first), str(kill_at_rename)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def assert_one_complete_drafter(out: Path, verifier: VerifierHead, exported: set[int]) -> int:
    """The drafter at `out` loads and is exactly drafter k for one exported k; returns k."""
    loaded = load_drafter(out, verifier)
    step = json.loads((out / "dspark_meta.json").read_text())["step"]
    assert step in exported, (step, exported)
    expected = make_draft(verifier, draft_config(), seed=step).state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, expected[name]), (step, name)
    assert not aside_dir(out).exists()  # load_drafter finished or undid the killed swap
    return step


@pytest.mark.slow  # a kill loop of export subprocesses, ~40 s on 2 cores: make test, not make test-fast
def test_sigkill_during_export_always_leaves_a_complete_drafter(verifier, tiny_qwen3_dir, tmp_path):
    script = tmp_path / "export_loop.py"
    script.write_text(CHILD)
    out = tmp_path / "drafter"
    export_drafter(
        make_draft(verifier, draft_config(), seed=0), out, str(tiny_qwen3_dir), {"step": 0}, vllm_check=False
    )
    exported, current = {0}, 0
    rng = random.Random(0)
    first = 1
    # rename 1 of an export that replaces a drafter moves the old one aside, rename 2 moves
    # the new one in; 0 = killed at a random moment instead.
    for kill_at_rename in (1, 2, 0, 0, 0):
        proc = start_child(script, tiny_qwen3_dir, out, first, kill_at_rename)
        if kill_at_rename:
            assert proc.wait(timeout=300) == -signal.SIGKILL
        else:
            proc.stdout.readline()  # one export done: the next ones are under way
            time.sleep(rng.uniform(0.0, 1.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        lines = proc.stdout.read().split("\n")
        proc.stdout.close()
        done = [int(line.split()[1]) for line in lines if line.startswith("exported")]
        # the export under way when killed may or may not have landed
        exported |= set(range(first, (max(done) if done else first) + 2))
        if kill_at_rename == 1:
            assert not out.exists() and aside_dir(out).exists()  # the moment that used to lose the drafter
        step = assert_one_complete_drafter(out, verifier, exported)
        if kill_at_rename:  # killed in its first export: the old drafter is back, or the new one is whole
            assert step == (current if kill_at_rename == 1 else first)
        current, first = step, max(exported) + 1
