"""The training pass: real torchrun gloo processes on a store extracted from a tiny verifier.

- DDP: 2 ranks and 1 rank with the same global batch end with the same weights, including
  steps where one rank has no data or only samples with no trainable position.
- Kill loop: a run SIGKILLed at awkward moments (during a checkpoint write, steps after
  one, the launcher alone) and rerun exports the same drafter bit for bit as an
  uninterrupted one, logs every step once and leaves no rank behind.
- Long samples are trained as windows that keep every scored token.
- Learning: a few hundred CPU steps raise held-out τ clearly above the untrained draft's.
- Bad input fails before any compute, with errors naming what is wrong.

Over 400 lines on purpose: every test here shares the module's reference runs (an
uninterrupted 1-rank and 2-rank run); split, each file would train them again.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from train_stores import (
    VOCAB,
    make_bigram_verifier,
    make_samples,
    store_target,
    tiny_run_settings,
    write_store,
    write_token_freqs,
)

from dspark.config import LossConfig, load_section
from dspark.errors import UserError
from dspark.eval.__main__ import stage_configs
from dspark.eval.evaluate import offline_sections
from dspark.export import load_drafter
from dspark.store import ShardStore, StoreWriter
from dspark.targets import tokenizer_sha256
from dspark.train.__main__ import run
from dspark.train.build import check_devices
from dspark.train.checkpoint import trainable_state
from dspark.train.config import TrainConfig
from dspark.train.data import StoreSplit, windows_of
from dspark.train.sampler import StepPlanner, share_of_rank
from dspark.vocab import build_mapping, load_mapping, save_mapping

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
RUN_TIMEOUT_S = 300
# 61 samples of 64 tokens and 3 of 190 (each cut into 3 windows of 64 overlapping by one
# token), 2 windows per step (1 per micro-batch); a third of the short samples have no
# trainable token, and one long sample trains only its last 70 tokens (its first window has
# nothing to score and is left out): 69 windows in 35 steps (one epoch), the last one with
# a single micro-batch.
LONG = 190
STEPS = 35
DDP_TRAIN = {
    "train.tokens_per_step": 128,
    "train.tokens_per_micro_batch": 64,
    "train.epochs": 1,
    "train.save_every": 5,
    "train.eval_every": 10,
    "train.keep_last": 2,
    "loss.train_on_prompt": "false",  # keep the plan's awkward steps: a sample with nothing to train
    "heldout.anchors_per_sample": 16,  # a draw: every held-out sample has more candidates
    "train.draft_vocab_from": "verifier",  # its counts are summed over ranks: the weights must match all the same
}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> SimpleNamespace:
    """A tiny bigram verifier, its train/eval stores and token counts."""
    root = tmp_path_factory.mktemp("train")
    verifier = make_bigram_verifier(root / "verifier")
    train = make_samples(verifier, 61, seed=0, min_len=64, max_len=64, empty_masks=20)
    long = make_samples(verifier, 3, seed=2, min_len=LONG, max_len=LONG)
    long[0][1][: LONG - 70] = 0
    train += long
    held_out = make_samples(verifier, 16, seed=1)
    write_store(root / "store" / "train", verifier, train)
    write_store(root / "store" / "eval", verifier, held_out, first_id=1000)
    return SimpleNamespace(
        root=root,
        verifier=verifier,
        train_store=root / "store" / "train",
        eval_store=root / "store" / "eval",
        token_freqs=write_token_freqs(root / "token_freqs.npy", train, VOCAB),
        train_samples=train,
    )


def overrides(world: SimpleNamespace, run_dir: Path, **extra) -> list[str]:
    settings = tiny_run_settings(
        world.verifier,
        world.train_store,
        world.eval_store,
        world.token_freqs,
        **{
            "train.run_dir": str(run_dir),
            "train.log_every": 1,
            "train.data_workers": 1,
            "train.eval_every": 0,
            "train.save_every": 1000,
            **extra,
        },
    )
    return [f"{k}={v}" for k, v in settings.items()]


def torchrun(nproc: int, args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", str(nproc), "-m", "train", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun, every rank and their data workers at once (a crashed node, not a stop).

    The ranks run in sessions of their own, so a process-group kill would miss them.
    """
    parent = psutil.Process(proc.pid)
    for p in [parent, *parent.children(recursive=True)]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass  # already gone (e.g. a rank that died with torchrun): what the kill wants


def train_to_end(nproc: int, args: list[str]) -> str:
    proc = torchrun(nproc, args)
    out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, out[-12000:]
    return out


def rows(run_dir: Path, split: str) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    found = [json.loads(line) for line in lines]
    return {r["step"]: r for r in found if r["split"] == split}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / "latest" / "model.safetensors")


def compose_cfg(args: list[str], stage: str = "train"):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose(stage, overrides=args)


def make_eval_offline(world, drafter: Path, *heldout: str) -> dict:
    """The offline section `make eval` reports for `drafter` on the world's held-out store (one process)."""
    args = [
        f"drafter={drafter}",
        "target.name=tiny",
        f"target.name_or_path={world.verifier}",
        "target.aux_layer_ids=null",
        f"target.mask_token_id={VOCAB - 1}",
        f"paths.root={world.root / 'eval-paths'}",
        f"eval.store={world.eval_store}",
        "eval.bench_store=null",
        "eval.offline.device=cpu",
        "eval.calibration.enabled=false",
        *heldout,
    ]
    target, eval_cfg, protocol, _ = stage_configs(compose_cfg(args, "eval"))
    return offline_sections(drafter, target, eval_cfg, protocol)[0]


def assert_same_heldout_figures(trainer_row: dict, offline: dict) -> None:
    """The trainer's eval row and make eval's offline section: the same blocks, τ and acceptance."""
    overall = offline["overall"]
    assert trainer_row["blocks"] == overall["blocks"]
    assert trainer_row["tau"] == pytest.approx(overall["tau"], abs=1e-5)
    cumulative = [trainer_row[f"accept_{k}"] for k in range(len(overall["cumulative"]))]
    conditional = [trainer_row[f"alpha_{k}"] for k in range(len(overall["conditional"]))]
    assert cumulative == pytest.approx(overall["cumulative"], abs=1e-5)
    assert conditional == pytest.approx(overall["conditional"], abs=1e-5)


@pytest.fixture(scope="module")
def two_rank_run(world) -> Path:
    """The reference 2-rank run (the DDP comparison and the uninterrupted run of the resume test)."""
    run_dir = world.root / "runs" / "two-ranks"
    train_to_end(2, overrides(world, run_dir, **DDP_TRAIN))
    return run_dir


def ddp_split(world) -> StoreSplit:
    return StoreSplit.open(
        ShardStore.open(world.train_store), str(world.train_store), DDP_TRAIN["train.tokens_per_micro_batch"]
    )


@pytest.mark.slow  # ~30 s or more on 2 cores: make test, not make test-fast
def test_ddp_two_ranks_match_one_rank(world, two_rank_run):
    # The plan really holds the awkward steps: a rank with no micro-batch at all, and a rank
    # whose only sample has no trainable position (zero valid anchors) while the other trains.
    split = ddp_split(world)
    assert split.counts == {"samples": 64, "long_samples": 3, "windows": 8, "windows_left_out": 1}
    # loss.train_on_prompt: every token can be scored, so the window left out comes back
    store, width = ShardStore.open(world.train_store), DDP_TRAIN["train.tokens_per_micro_batch"]
    every = StoreSplit.open(store, str(world.train_store), width, every_token=True)
    assert every.counts == {"samples": 64, "long_samples": 3, "windows": 9, "windows_left_out": 0}

    def windows(s: StoreSplit) -> set[tuple[int, int]]:
        return {(ref.sample_id, int(o)) for ref, o in zip(s.refs, s.offsets, strict=True)}

    assert windows(split) < windows(every) and len(windows(every) - windows(split)) == 1
    untrained = {i for i, ref in enumerate(split.refs) if not world.train_samples[ref.sample_id][1].any()}
    planner = StepPlanner(
        split.lengths, DDP_TRAIN["train.tokens_per_step"], DDP_TRAIN["train.tokens_per_micro_batch"], 0
    )
    assert len(planner.epoch(0)) == STEPS
    shares = [[share_of_rank(planner, step, r, 2) for r in range(2)] for step in planner.epoch(0)]
    assert any(not share[1] for share in shares)
    assert any(
        all(set(b) <= untrained for b in share[r]) and share[r] and any(set(b) - untrained for b in share[1 - r])
        for share in shares
        for r in range(2)
    )

    one_rank = world.root / "runs" / "one-rank"
    train_to_end(1, overrides(world, one_rank, **DDP_TRAIN))
    assert json.loads((two_rank_run / "checkpoints" / "latest" / "trainer_state.json").read_text())["world_size"] == 2
    a, b = final_weights(one_rank), final_weights(two_rank_run)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)
    losses_1, losses_2 = rows(one_rank, "train"), rows(two_rank_run, "train")
    assert sorted(losses_1) == sorted(losses_2) == list(range(1, STEPS + 1))
    np.testing.assert_allclose(
        [losses_1[s]["loss"] for s in losses_1], [losses_2[s]["loss"] for s in losses_1], rtol=1e-4
    )
    # Weights moved: the comparison is not between two untouched initializations.
    assert losses_2[STEPS]["loss"] < losses_2[1]["loss"]
    # Held-out figures: each rank scores its share of the samples, summed over ranks: every sample and
    # anchor once (a rank scoring all of them, or only its own unsummed, would change `blocks`).
    evals_1, evals_2 = rows(one_rank, "eval"), rows(two_rank_run, "eval")
    assert sorted(evals_1) == sorted(evals_2) == [10, 20, 30, STEPS]
    for step, row in evals_2.items():
        assert row["blocks"] == evals_1[step]["blocks"] == 16 * 16
        assert row["tau"] == pytest.approx(evals_1[step]["tau"], abs=1e-5), step


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            found.append(json.loads(line)["step"])
        except json.JSONDecodeError:  # a row being written
            pass
    return found


def newest_checkpoint_step(run_dir: Path) -> int:
    found = [int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*")]
    return max(found, default=0)


def writing_checkpoint(run_dir: Path) -> bool:
    root = run_dir / "checkpoints"
    return root.is_dir() and any(name.endswith(".partial") for name in os.listdir(root))


def kill_when(
    proc: subprocess.Popen, ready, *, whole_tree: bool, delay_s: float = 0.0, stop_only: bool = False
) -> list[psutil.Process]:
    """SIGKILL the run (its whole tree, or the launcher alone) `delay_s` after `ready()`; returns
    the processes below the launcher at that moment (the ranks and their data workers).
    `stop_only`: SIGSTOP rank 1 instead (a hung peer) and leave the run going."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(delay_s)
    assert proc.poll() is None, "the run ended before the moment to kill it"
    below = psutil.Process(proc.pid).children(recursive=True)
    if stop_only:
        next(p for p in below if p.environ().get("RANK") == "1").suspend()
        return below
    if whole_tree:
        kill_tree(proc)
    else:
        proc.send_signal(signal.SIGKILL)
    proc.communicate()
    return below


@pytest.mark.slow  # ~30 s or more on 2 cores: make test, not make test-fast
def test_kill_loop_resumes_exactly_without_orphans_or_duplicate_rows(world, two_rank_run):
    # save_every 20: besides the evaluations that improve (every 10 steps), checkpoints are
    # sparse, so a kill can land many steps after one.
    run_dir = world.root / "runs" / "kill-loop"
    args = overrides(world, run_dir, **{**DDP_TRAIN, "train.save_every": 20})
    rng = random.Random(0)
    moment, delay_s = rng.randint(20, STEPS - 5), rng.uniform(0, 0.3)

    def many_steps_after_a_checkpoint() -> bool:
        newest = newest_checkpoint_step(run_dir)
        return newest > 0 and max(logged_steps(run_dir), default=0) >= newest + 7

    trials = [  # what, when, the whole tree (else the launcher alone), delay
        ("during the first checkpoint write", lambda: writing_checkpoint(run_dir), True, 0.0),
        ("7 steps after a checkpoint", many_steps_after_a_checkpoint, False, 0.0),
        (f"during step {moment + 1}", lambda: max(logged_steps(run_dir), default=0) >= moment, True, delay_s),
    ]
    for what, ready, whole_tree, delay in trials:
        below = kill_when(torchrun(2, args), ready, whole_tree=whole_tree, delay_s=delay)
        assert below, what
        if what.startswith("during the first checkpoint"):
            # On a loaded machine the write can finish between seeing it and the kill landing:
            # that try missed its moment, so it starts over from nothing (a few tries at most).
            for _ in range(4):
                if writing_checkpoint(run_dir):
                    break
                shutil.rmtree(run_dir)
                below = kill_when(torchrun(2, args), ready, whole_tree=whole_tree, delay_s=delay)
            assert writing_checkpoint(run_dir) and newest_checkpoint_step(run_dir) == 0
        if not whole_tree:  # the launcher alone: every rank dies with it (no orphan waits forever)
            _, alive = psutil.wait_procs(below, timeout=10)
            assert not alive, (what, alive)
        assert not (run_dir / "drafter").exists(), what
    out = train_to_end(2, args)
    assert "resuming from" in out

    ref, got = (
        load_file(two_rank_run / "drafter" / "model.safetensors"),
        load_file(run_dir / "drafter" / "model.safetensors"),
    )
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = [(r["step"], r["split"]) for r in lines]
    assert len(keys) == len(set(keys)), "a step was logged twice"
    for split in ("train", "eval"):
        a, b = rows(two_rank_run, split), rows(run_dir, split)
        assert sorted(a) == sorted(b)
        for step in a:
            for key in ("loss", "ce", "tv", "confidence", "tau", "lr"):
                if key in a[step]:
                    assert a[step][key] == b[step][key], (split, step, key)


@pytest.mark.slow  # ~30 s or more on 2 cores: make test, not make test-fast
def test_a_rank_stuck_on_a_hung_peer_fails_after_the_collective_timeout(world, tmp_path):
    run_dir = tmp_path / "run"
    proc = torchrun(
        2, overrides(world, run_dir, **{**DDP_TRAIN, "train.collective_timeout_s": 3, "train.data_workers": 0})
    )
    try:
        kill_when(proc, lambda: max(logged_steps(run_dir), default=0) >= 1, whole_tree=False, stop_only=True)
        started, seen = time.monotonic(), []
        for line in proc.stdout:  # rank 0 waits on the stopped rank 1, then gives up
            seen.append(line)
            if "waited longer than train.collective_timeout_s=3s" in line:
                break
        assert time.monotonic() - started < 60
        assert "a peer rank died, hung or was stopped" in line, "".join(seen)[-3000:]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        proc.communicate()


def test_collective_failures_are_told_apart_from_other_errors():
    """gloo's timeout in DDP's buffer sync says neither "gloo" nor DistError: the frame it was raised in
    tells; an error of the model's own code called through DDP's forward stays what it is."""
    from dspark.train.__main__ import from_a_collective

    def raised(source: str, filename: str, **env) -> RuntimeError:
        try:
            exec(compile(source, filename, "exec"), dict(env))
        except RuntimeError as err:
            return err
        raise AssertionError("nothing raised")

    timeout = "raise RuntimeError('Application timeout caused pair closure')"
    assert from_a_collective(raised(timeout, "/venv/torch/nn/parallel/distributed.py"))
    assert from_a_collective(raised(timeout, "/venv/torch/distributed/distributed_c10d.py"))
    assert from_a_collective(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed"))
    assert not from_a_collective(raised(timeout, "/work/dspark/model.py"))

    def model_forward():
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    through_ddp = raised("forward()", "/venv/torch/nn/parallel/distributed.py", forward=model_forward)
    assert not from_a_collective(through_ddp)


def test_checkpoints_logs_and_export_of_a_run(world, two_rank_run):
    ckpts = two_rank_run / "checkpoints"
    steps = sorted(int(p.name.split("_")[1]) for p in ckpts.glob("step_*"))
    best = ckpts / "best"
    assert best.exists() and (ckpts / "latest").resolve().name == f"step_{STEPS}"
    # keep_last=2 plus the best one
    assert set(steps) == {(STEPS - 1) // 5 * 5, STEPS} | {int(best.resolve().name.split("_")[1])}
    latest = ckpts / "latest"
    for name in ("config.yaml", "optimizer.pt", "rng_rank0.pt", "rng_rank1.pt", "vocab_map_128.safetensors"):
        assert (latest / name).is_file(), name
    assert "draft_vocab_size: 128" in (latest / "config.yaml").read_text()
    evals = rows(two_rank_run, "eval")
    assert sorted(evals) == sorted({*range(10, STEPS + 1, 10), STEPS})
    assert {"tau", "alpha_0", "alpha_3", "accept_3"} <= evals[STEPS].keys()
    assert max(evals[s]["tau"] for s in evals) == evals[int(best.resolve().name.split("_")[1])]["tau"]
    events = EventAccumulator(str(two_rank_run / "tensorboard" / "default")).Reload()  # accelerate's tracker
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, STEPS + 1))
    assert [e.value for e in events.Scalars("eval/tau")] == pytest.approx([evals[s]["tau"] for s in sorted(evals)])
    assert 0 <= rows(two_rank_run, "train")[STEPS]["data_wait"] <= 1
    data = rows(two_rank_run, "data")[0]
    assert (data["train_long_samples"], data["train_windows"], data["train_windows_left_out"]) == (3, 8, 1)

    meta = json.loads((two_rank_run / "drafter" / "dspark_meta.json").read_text())
    assert (meta["step"], meta["world_size"], meta["eval"]["tau"]) == (STEPS, 2, evals[STEPS]["tau"])
    # the 2-rank evaluation (samples split over the ranks) is make eval's, in one process, on the same weights
    assert_same_heldout_figures(
        evals[STEPS], make_eval_offline(world, two_rank_run / "drafter", "heldout.anchors_per_sample=16")
    )
    assert meta["hardware"].startswith("2 x CPU") and meta["train_time_s"] > 0
    drafter = load_drafter(two_rank_run / "drafter")
    exported = trainable_state(drafter)
    weights = final_weights(two_rank_run)
    # the default Markov embedding projection trains as W1 + E·P and is exported folded into W1
    proj = weights.pop("markov_embed_proj.weight")
    embed = load_file(world.verifier / "model.safetensors")["model.embed_tokens.weight"]
    folded = weights.pop("markov_head.markov_w1.weight") + embed @ proj.t()
    torch.testing.assert_close(exported.pop("markov_head.markov_w1.weight"), folded, rtol=1e-6, atol=1e-6)
    assert proj.abs().max() > 0 and set(exported) == set(weights)
    # ... and trains in a param group of its own at train.lr_scales.markov_embed_proj (4) x lr (1e-2)
    groups = torch.load(latest / "optimizer.pt", weights_only=True)["optimizer"]["param_groups"]
    markov = {g["name"]: g for g in groups}["markov_embed_proj"]
    assert (markov["initial_lr"], len(markov["params"])) == (pytest.approx(4e-2), 1)
    for name, value in weights.items():
        assert torch.equal(exported[name], value), name


LEARN = {
    "train.tokens_per_step": 512,
    "train.tokens_per_micro_batch": 256,
    "train.epochs": 30,
    "train.eval_on_start": "true",
    "train.log_every": 10,
}
"""A run long enough for held-out τ to rise well above the untrained draft's (seen: 1.87 -> 3.33)."""


@pytest.mark.slow  # ~30 s or more on 2 cores: make test, not make test-fast
def test_training_raises_held_out_tau(world):
    run_dir = world.root / "runs" / "learn"
    train_to_end(
        2,
        overrides(
            world,
            run_dir,
            **LEARN,
        ),
    )
    evals = rows(run_dir, "eval")
    untrained, trained = evals[0]["tau"], evals[max(evals)]["tau"]
    assert max(evals) >= 200
    assert trained > untrained + 1.0, (untrained, trained)  # seen: 1.87 -> 3.33
    assert evals[max(evals)]["alpha_1"] > 10 * evals[0]["alpha_1"]

    # Warm start from the exported drafter: its first evaluation is the trained one.
    warm = world.root / "runs" / "warm"
    run(
        compose_cfg(
            overrides(
                world,
                warm,
                **{
                    "train.init_from": str(run_dir / "drafter"),
                    "train.eval_on_start": "true",
                    "train.max_steps": 1,
                    "train.tokens_per_step": 512,
                    "train.tokens_per_micro_batch": 256,
                    "train.export": "false",
                    "train.data_workers": 0,
                },
            )
        )
    )
    assert rows(warm, "eval")[0]["tau"] == pytest.approx(trained, rel=1e-6)


# ----- bad input: clear errors before any compute -----


def expect_refusal(world, tmp_path, error, match: str, **extra) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(error, match=match):
        run(compose_cfg(overrides(world, run_dir, **extra)))
    assert not (run_dir / "checkpoints").exists()


def test_refuses_store_of_another_target(world, tmp_path):
    other = store_target(world.verifier, name_or_path="Qwen/Qwen3-0.6B")
    write_store(tmp_path / "other", world.verifier, world.train_samples[:2], target=other)
    expect_refusal(world, tmp_path, ValueError, "name_or_path", **{"train.train_store": str(tmp_path / "other")})


def test_refuses_store_with_other_layers(world, tmp_path):
    expect_refusal(world, tmp_path, ValueError, "layer_ids", **{"target.aux_layer_ids": "[1,3]"})


def test_refuses_empty_training_split(world, tmp_path):
    StoreWriter.create_or_open(tmp_path / "empty", store_target(world.verifier), tokenizer_sha256(world.verifier))
    expect_refusal(
        world, tmp_path, ValueError, "no committed samples", **{"train.train_store": str(tmp_path / "empty")}
    )


def test_refuses_missing_vocab_inputs(world, tmp_path):
    expect_refusal(
        world,
        tmp_path,
        FileNotFoundError,
        "does not exist",
        **{"train.vocab_mapping": str(tmp_path / "missing.safetensors")},
    )
    missing = {"train.token_freqs": str(tmp_path / "missing.npy"), "train.draft_vocab_from": "tokens"}
    expect_refusal(world, tmp_path, FileNotFoundError, "train.token_freqs", **missing)


def test_refuses_a_different_vocab_mapping(world, tmp_path):
    counts = np.zeros(VOCAB, dtype=np.int64)
    counts[:128] = 1  # the first 128 ids: not this data's tokens
    other = save_mapping(tmp_path / "other.safetensors", *build_mapping(counts, 128))
    # The run's own mapping (ranked on the first start) must be reused.
    run_dir = tmp_path / "run"
    first = {"train.max_steps": 1, "train.eval_store": "null", "train.export": "false", "train.data_workers": 0}
    run(compose_cfg(overrides(world, run_dir, **first)))
    with pytest.raises(ValueError, match="vocab mapping mismatch"):
        run(compose_cfg(overrides(world, run_dir, **{**first, "train.vocab_mapping": str(other)})))
    with pytest.raises(ValueError, match="vocab mapping mismatch"):
        run(
            compose_cfg(
                overrides(
                    world,
                    tmp_path / "warm",
                    **{"train.vocab_mapping": str(other), "train.init_from": str(run_dir / "checkpoints" / "latest")},
                )
            )
        )
    assert not (tmp_path / "warm" / "checkpoints").exists()


def test_a_run_ranks_its_reduced_vocabulary_by_the_verifier_or_by_the_tokens(world, tmp_path):
    from accelerate import Accelerator

    from dspark.train.vocab_counts import verifier_counts
    from dspark.verifier import VerifierHead

    first = {"train.max_steps": 1, "train.eval_store": "null", "train.export": "false", "train.data_workers": 0}
    expected = {
        "verifier": verifier_counts(
            ShardStore.open(world.train_store), VerifierHead.from_pretrained(world.verifier), Accelerator(cpu=True)
        ),
        "tokens": np.load(world.token_freqs),
    }
    made = {}
    for ranking, counts in expected.items():
        run_dir = tmp_path / ranking
        run(compose_cfg(overrides(world, run_dir, **first, **{"train.draft_vocab_from": ranking})))
        made[ranking] = load_mapping(run_dir / "vocab_map_128.safetensors")
        assert made[ranking][2]["ranked_by"] == ranking
        want = build_mapping(counts, 128)
        assert torch.equal(made[ranking][0], want[0]) and torch.equal(made[ranking][1], want[1])
    assert not torch.equal(made["verifier"][1], made["tokens"][1])

    # A fresh start in the verifier-ranked run's dir (its checkpoints gone, its mapping left) under the other
    # ranking is refused by name; a restart deletes that mapping and ranks a new one by this config.
    run_dir = tmp_path / "verifier"
    shutil.rmtree(run_dir / "checkpoints")
    other = {**first, "train.draft_vocab_from": "tokens"}
    with pytest.raises(UserError, match="ranked by verifier, train.draft_vocab_from is tokens"):
        run(compose_cfg(overrides(world, run_dir, **other)))
    run(compose_cfg(overrides(world, run_dir, **other, **{"train.resume": "restart"})))
    again = load_mapping(run_dir / "vocab_map_128.safetensors")
    assert again[2]["ranked_by"] == "tokens" and torch.equal(again[1], made["tokens"][1])


def test_refuses_more_processes_than_gpus():
    with pytest.raises(UserError, match="GPUS=3 .* 2 CUDA device"):
        check_devices(3, 2)
    check_devices(2, 2)
    check_devices(4, 0)  # CPU: any number of gloo processes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torchrun_with_too_many_gpus_fails_before_training(world, tmp_path):
    proc = torchrun(torch.cuda.device_count() + 1, overrides(world, tmp_path / "run"))
    out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode != 0 and "CUDA device" in out
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attn_impl", ["sdpa", "flex"])
def test_training_on_cuda_in_bf16_raises_held_out_tau(world, tmp_path, attn_impl):
    """The CUDA path end to end: NCCL rank, bf16 autocast (mixed_precision auto), flex or SDPA
    attention, the held-out evaluation and the export, on one GPU."""
    run_dir = tmp_path / attn_impl
    train_to_end(1, overrides(world, run_dir, **LEARN, **{"model.attn_impl": attn_impl}))
    evals = rows(run_dir, "eval")
    untrained, trained = evals[0]["tau"], evals[max(evals)]["tau"]
    assert trained > untrained + 1.0, (untrained, trained)  # the CPU run (fp32, 2 ranks) goes 1.87 -> 3.33
    meta = json.loads((run_dir / "drafter" / "dspark_meta.json").read_text())
    assert meta["hardware"] == f"1 x {torch.cuda.get_device_name(0)}"
    assert all(torch.isfinite(t).all() for t in trainable_state(load_drafter(run_dir / "drafter")).values())


# ----- configs -----


def test_default_and_seed_recipe_configs_resolve():
    default = load_section(TrainConfig, compose_cfg([]), "train")
    assert default.run_dir == "runs/smollm2-135m/train/default"
    assert default.token_freqs == "runs/smollm2-135m/data/token_freqs.npy"
    assert default.train_store == "runs/smollm2-135m/store/train"
    seed = compose_cfg(["+experiment=qwen3-0.6b"])
    assert load_section(TrainConfig, seed, "train").run_dir == "runs/qwen3-0.6b/train/qwen3-0.6b"
    assert (seed.model.num_layers, seed.model.block_size, seed.model.draft_vocab_size) == (5, 4, 32000)
    assert (seed.model.markov_rank, seed.model.markov_type, seed.model.confidence_head) == (512, "vanilla", True)
    assert seed.model.markov_embed_proj and seed.train.init_norm_from_verifier == "auto"  # the default levers
    assert list(seed.target.aux_layer_ids) == [2, 14, 25]
    assert load_section(LossConfig, seed, "loss").weights == {"ce": 0.1, "tv": 0.9}  # the default loss
    assert not seed.loss.train_on_prompt
    assert seed.loss.hidden_weight > 0
    exact = compose_cfg(["+experiment=qwen3-0.6b", "+recipe=published"])
    assert exact == compose_cfg(["+recipe=published", "+experiment=qwen3-0.6b"])  # in either order
    assert load_section(LossConfig, exact, "loss").weights == {"ce": 0.1, "tv": 0.9}  # the seed drafter's
    assert exact.loss.hidden_weight == 0
    assert (exact.model.markov_rank, exact.model.markov_embed_proj) == (256, False)
    assert (exact.train.init_layers_from_verifier, exact.loss.train_on_prompt) == (None, False)
    assert (seed.train.epochs, seed.train.lr, seed.data.max_samples) == (5, 3e-4, 1200)


# ----- the step plan -----


def test_step_plan_covers_each_sample_once_per_epoch_within_budgets():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 100, size=203)
    planner = StepPlanner(lengths, tokens_per_step=700, tokens_per_micro_batch=200, seed=3)
    epochs = [planner.epoch(e) for e in range(3)]
    for steps in epochs:
        seen = [i for step in steps for batch in step for i in batch]
        assert sorted(seen) == list(range(len(lengths)))
        for step in steps:
            assert sum(lengths[i] for b in step for i in b) <= 700 or sum(len(b) for b in step) == 1
            for batch in step:
                assert len(batch) * max(lengths[i] for i in batch) <= 200
            for world_size in (1, 2, 3, 8):
                shares = [share_of_rank(planner, step, r, world_size) for r in range(world_size)]
                assert sorted(map(tuple, sum(shares, []))) == sorted(map(tuple, step))
    assert epochs[0] != epochs[1]
    assert epochs[0] == StepPlanner(lengths, 700, 200, seed=3).epoch(0)


# ----- long samples -----


def test_windows_cover_every_anchor_once():
    rng = np.random.default_rng(0)
    for n, width in [(150, 64), (64, 64), (65, 64), (1000, 7), (10, 2)]:
        for _ in range(20):
            mask = rng.random(n) < rng.uniform(0.2, 1.0)
            mask[: rng.integers(0, n)] = False  # often a long untrained prefix
            windows = windows_of(mask.astype(np.uint8), width)
            owners: dict[int, int] = {}
            for start, end in windows:
                assert 0 <= start < end <= n and end - start <= width
                for p in range(start, end - 1):  # anchors p with their first target p+1 in the window
                    if mask[p] and mask[p + 1]:
                        assert p not in owners, (n, width, p)
                        owners[p] = start
            candidates = {p for p in range(n - 1) if mask[p] and mask[p + 1]}
            assert set(owners) == candidates, (n, width)
            if n > width:  # a cut sample keeps only windows with something to score
                assert all(any(owners[p] == s for p in owners) for s, _ in windows)


# ----- where a run starts -----


def short_run(world, run_dir: Path, **extra) -> dict[str, float]:
    """One in-process rank, 2 steps of 2 samples, a checkpoint every step, no eval, no export."""
    return run(
        compose_cfg(
            overrides(
                world,
                run_dir,
                **{
                    "train.tokens_per_step": 300,
                    "train.tokens_per_micro_batch": 300,
                    "train.data_workers": 0,
                    "train.eval_store": "null",
                    "train.export": "false",
                    "train.save_every": 1,
                    "train.max_steps": 2,
                    "train.keep_last": 10,
                    **extra,
                },
            )
        )
    )


def steps_logged(run_dir: Path) -> list[int]:
    return [
        r["step"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if r["split"] == "train"
    ]


def test_resume_finds_the_newest_complete_checkpoint_itself(world, tmp_path, capsys):
    run_dir = tmp_path / "run"
    short_run(world, run_dir)
    ckpts = run_dir / "checkpoints"
    (ckpts / "latest").unlink()  # missing link
    longer = {"train.allow_resume_changes": "true"}  # train.max_steps sets the schedule's length
    short_run(world, run_dir, **{"train.max_steps": 3, **longer})
    assert f"resuming from {ckpts / 'step_2'} at step 2" in capsys.readouterr().out
    (ckpts / "latest").unlink()
    (ckpts / "latest").symlink_to("step_99")  # dangling link
    (ckpts / "step_7").mkdir()  # and a newer step that is not complete
    (ckpts / "step_7" / "trainer_state.json").write_text("{}")
    short_run(world, run_dir, **{"train.max_steps": 4, **longer})
    assert f"resuming from {ckpts / 'step_3'} at step 3" in capsys.readouterr().out
    assert steps_logged(run_dir) == [1, 2, 3, 4]


def test_fresh_start_over_an_earlier_run_is_refused_unless_asked(world, tmp_path):
    run_dir = tmp_path / "run"
    short_run(world, run_dir)
    shutil.rmtree(run_dir / "checkpoints")
    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(UserError, match=f"{run_dir} holds an earlier run .*train.resume=restart"):
        short_run(world, run_dir)
    assert (run_dir / "metrics.jsonl").read_text() == before and not (run_dir / "checkpoints").exists()
    short_run(world, run_dir, **{"train.resume": "restart", "train.max_steps": 1})
    assert steps_logged(run_dir) == [1]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_1"]


def test_resume_refuses_a_changed_objective_or_schedule(world, tmp_path):
    run_dir = tmp_path / "run"
    short_run(world, run_dir)
    changes = {"train.lr": 2e-2, "loss.gamma": 2.0, "train.epochs": 7, "train.warmup_ratio": 0.5}
    for key, value in {**changes, "train.max_steps": 3}.items():
        with pytest.raises(UserError, match=rf"\['{key}'\].*train.allow_resume_changes=true"):
            short_run(world, run_dir, **{key: value})
    with pytest.raises(UserError, match=r"\['loss.gamma', 'train.lr'\]"):
        short_run(world, run_dir, **{"train.lr": 2e-2, "loss.gamma": 2.0})
    assert steps_logged(run_dir) == [1, 2]
    short_run(world, run_dir, **{"train.lr": 2e-2, "train.max_steps": 3, "train.allow_resume_changes": "true"})
    assert steps_logged(run_dir) == [1, 2, 3]


def test_eval_store_must_be_held_out(world, tmp_path):
    split_train = tmp_path / "split-train"
    StoreWriter.create_or_open(
        split_train, store_target(world.verifier), tokenizer_sha256(world.verifier), extra_attrs={"split": "train"}
    )
    expect_refusal(
        world, tmp_path, UserError, "holds the 'train' split, not 'eval'", **{"train.eval_store": str(split_train)}
    )
    expect_refusal(
        world,
        tmp_path,
        UserError,
        "train.eval_store is train.train_store",
        **{"train.eval_store": str(world.train_store)},
    )


class Payload:
    """Unpickling this runs code: it creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_foreign_pickles_in_a_checkpoint_never_run(world, tmp_path):
    source = tmp_path / "source"
    short_run(world, source, **{"train.max_steps": 1})
    ckpt = source / "checkpoints" / "step_1"
    marker = tmp_path / "pwned"
    torch.save({"optimizer": Payload(marker), "scheduler": {}}, ckpt / "optimizer.pt")
    # Warm start: weights only, from safetensors.
    short_run(world, tmp_path / "warm", **{"train.init_from": str(ckpt), "train.max_steps": 1})
    assert not marker.exists()
    # Resume: the optimizer state is refused, not unpickled.
    with pytest.raises(UserError, match="refusing to unpickle"):
        short_run(world, source, **{"train.max_steps": 1})
    assert not marker.exists()


def test_checkpoints_are_fsynced_before_they_are_renamed_into_place(world, tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kwargs):
        events.append(("replace", f"{os.path.realpath(src)} -> {os.path.realpath(dst)}"))
        return real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    run_dir = tmp_path / "run"
    short_run(world, run_dir, **{"train.max_steps": 1})
    root = os.path.realpath(run_dir / "checkpoints")
    partial = f"{root}/.step_1.partial"
    rename = events.index(("replace", f"{partial} -> {root}/step_1"))
    synced_before = {path for kind, path in events[:rename] if kind == "fsync"}
    written = {partial, *(f"{partial}/{p.name}" for p in (run_dir / "checkpoints" / "step_1").iterdir())}
    assert written <= synced_before, written - synced_before
    assert ("fsync", root) in events[rename:]  # the rename itself is made durable


def test_rerun_of_a_finished_run_logs_and_changes_nothing(world, tmp_path):
    run_dir = tmp_path / "run"
    settings = {"train.eval_store": str(world.eval_store), "train.export": "true", "heldout.max_samples": 4}
    short_run(world, run_dir, **settings)
    metrics = (run_dir / "metrics.jsonl").read_text()
    weights = load_file(run_dir / "drafter" / "model.safetensors")
    short_run(world, run_dir, **settings)
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    again = load_file(run_dir / "drafter" / "model.safetensors")
    assert all(torch.equal(weights[k], again[k]) for k in weights)


def test_trainer_logs_the_tau_make_eval_reports_for_its_drafter(world, tmp_path):
    """One protocol: the final held-out τ in metrics.jsonl (and the drafter's meta) is the offline τ of
    `make eval` on the exported drafter, same store, same samples, same seeded anchors (a draw here:
    fewer anchors than most samples have candidates), whatever the trainer's micro-batch budget (the
    held-out samples are longer than it: scored whole, not as windows)."""
    run_dir = tmp_path / "run"
    heldout = {"heldout.max_samples": 10, "heldout.anchors_per_sample": 12, "heldout.seed": 5}
    settings = {"train.eval_store": str(world.eval_store), "train.export": "true", "train.eval_on_start": "true"}
    short_run(world, run_dir, **settings, **heldout, **{"train.tokens_per_micro_batch": 48})
    evals = rows(run_dir, "eval")
    assert sorted(evals) == [0, 2] and evals[2]["tau"] != evals[0]["tau"]  # the weights moved
    offline = make_eval_offline(world, run_dir / "drafter", *(f"{k}={v}" for k, v in heldout.items()))
    assert offline["samples"] == 10 and offline["heldout"]["anchors_per_sample"] == 12
    refs = sorted(ShardStore.open(world.eval_store).index(), key=lambda r: r.sample_id)[:10]
    assert [r.sample_id for r in refs] == list(range(1000, 1010)) and any(r.n_tokens > 48 for r in refs)
    assert offline["overall"]["blocks"] == 10 * 12  # each sample has more candidates (17 or more): a draw
    assert_same_heldout_figures(evals[2], offline)
    meta = json.loads((run_dir / "drafter" / "dspark_meta.json").read_text())
    assert meta["eval"]["tau"] == evals[2]["tau"]
    # another draw (seed) is another figure: the comparison above is not between constants
    other = make_eval_offline(world, run_dir / "drafter", "heldout.max_samples=10", "heldout.anchors_per_sample=12")
    assert other["overall"]["tau"] != pytest.approx(offline["overall"]["tau"], abs=1e-5)
