"""`make train NODES=2`: two torchrun launches (through train.launch) joined by a c10d rendezvous on
localhost (one gloo process each, like two one-GPU nodes) end with the same weights as one launch of
two processes.

The launch commands are the ones the Makefile builds (`make -n`), so the test covers what a
user runs; the store and verifier come from tests/train_stores.py.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_stores import (
    VOCAB,
    make_bigram_verifier,
    make_samples,
    tiny_run_settings,
    write_store,
    write_token_freqs,
)

from dspark.extract.server import free_port

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240


def make_command(*variables: str) -> list[str]:
    """The `make train` command line for these variables (setup treated as done: nothing is installed)."""
    out = subprocess.run(
        ["make", "-s", "-n", "-o", ".venv/.setup-done", "train", *variables],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (line,) = out.strip().splitlines()
    return shlex.split(line)


def launch(cmd: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs: list[subprocess.Popen]) -> None:
    try:
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]


@pytest.fixture(scope="module")
def args(tmp_path_factory) -> str:
    """Hydra overrides of a short training run on a tiny store (ARGS of `make train`, without run_dir)."""
    root = tmp_path_factory.mktemp("multinode")
    verifier = make_bigram_verifier(root / "verifier")
    train = make_samples(verifier, 24, seed=0, min_len=48, max_len=64)
    write_store(root / "train", verifier, train)
    write_store(root / "eval", verifier, make_samples(verifier, 4, seed=1), first_id=1000)
    settings = tiny_run_settings(
        verifier,
        root / "train",
        root / "eval",
        write_token_freqs(root / "freqs.npy", train, VOCAB),
        **{
            "train.epochs": 1,
            "train.tokens_per_step": 256,
            "train.tokens_per_micro_batch": 64,
            "train.data_workers": 0,
            "train.eval_every": 0,
            "train.save_every": 1000,
            "train.log_every": 1,
        },
    )
    return " ".join(f"{k}={v}" for k, v in settings.items())


def test_makefile_keeps_standalone_for_one_node():
    cmd = make_command("GPUS=2")
    assert cmd[1:3] == ["-m", "train.launch"]  # torchrun's flags and launcher, one-line failures
    assert cmd[3:6] == ["--standalone", "--nproc_per_node", "2"] and "--nnodes" not in cmd
    many = make_command("NODES=4", "NODE_RANK=3", "MASTER_ADDR=10.1.2.3", "MASTER_PORT=1234", "GPUS=8")
    assert many[3:14] == [
        "--nnodes",
        "4",
        "--node-rank",
        "3",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "10.1.2.3:1234",
        "--nproc_per_node",
        "8",
        "-m",
    ]
    refused = subprocess.run(
        ["make", "-s", "-n", "-o", ".venv/.setup-done", "train", "NODES=2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert refused.returncode != 0 and "MASTER_ADDR" in refused.stderr
    example = REPO / "examples" / "slurm-scale-out.sh"  # the cluster example at least parses
    assert subprocess.run(["bash", "-n", str(example)], check=False).returncode == 0


@pytest.mark.slow  # ~30 s or more on 2 cores: make test, not make test-fast
def test_two_nodes_by_rendezvous_equal_one_node_of_two_processes(args, tmp_path):
    one = tmp_path / "one-node"
    finish([launch(make_command("GPUS=2", f"ARGS={args} train.run_dir={one}"))])
    two = tmp_path / "two-nodes"
    port = free_port()
    finish(
        [
            launch(
                make_command(
                    "NODES=2",
                    f"NODE_RANK={r}",
                    "MASTER_ADDR=127.0.0.1",
                    f"MASTER_PORT={port}",
                    "GPUS=1",
                    f"ARGS={args} train.run_dir={two}",
                )
            )
            for r in range(2)
        ]
    )

    state = json.loads((two / "checkpoints" / "latest" / "trainer_state.json").read_text())
    assert state["world_size"] == 2
    a = load_file(one / "checkpoints" / "latest" / "model.safetensors")
    b = load_file(two / "checkpoints" / "latest" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:  # the same reduction over the same two ranks: bit-identical
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    losses = {
        name: [
            r["loss"]
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["split"] == "train"
        ]
        for name, run in (("one", one), ("two", two))
    }
    assert losses["one"] == losses["two"] and len(losses["two"]) >= 5
    assert losses["two"][-1] < losses["two"][0], "weights must have moved: not two untouched initializations"
