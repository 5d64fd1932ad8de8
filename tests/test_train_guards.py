"""What a resume may change, what a warm start must share, and non-finite values (in process, tiny stores).

- The resume matrix: for every `train.*` key, a resume either refuses a new value by name or
  follows it (checked on the optimizer's groups, their LRs and the schedule against a hand
  computation), and every parameter keeps its own Adam moments, by name.
- A warm start refuses a checkpoint or drafter made for another verifier or architecture.
- A nan held-out τ is never best; a step with a non-finite loss is skipped (on every rank).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from train_stores import (
    VOCAB,
    extract,
    make_bigram_verifier,
    make_samples,
    store_target,
    tiny_run_settings,
    write_store,
    write_token_freqs,
)

from dspark.config import HeldoutConfig, load_section, resume_kinds
from dspark.errors import UserError
from dspark.export import export_drafter
from dspark.run_lock import in_use
from dspark.store import Sample, ShardStore, StoreWriter, bf16_to_bits
from dspark.targets import tokenizer_sha256
from dspark.train.__main__ import run
from dspark.train.build import build_trainer, make_accelerator
from dspark.train.checkpoint import CONFIG_FILE, WEIGHTS_FILE, latest_checkpoint
from dspark.train.config import TrainConfig
from dspark.train.data import StoreSplit
from dspark.train.dspark_trainer import DSparkTrainer
from dspark.train.resume import resume_point
from dspark.train.sampler import StepPlanner, share_of_rank

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
# One step per epoch (a step holds every sample: 8 samples of at most 48 tokens), so a run's
# length is min(max_steps, epochs) by hand; 2 layers in groups of their own.
BASE = {
    "model.num_layers": 2,
    "train.tokens_per_step": 512,
    "train.tokens_per_micro_batch": 128,
    "train.epochs": 2,
    "train.max_steps": "null",
    "++train.lr_scales": "{layers.0: 0.5, layers.1: 2.0}",  # merged into the default {markov_embed_proj: 4.0}
    "train.data_workers": 0,
    "train.eval_store": "null",
    "train.eval_every": 0,
    "train.export": "false",
    "train.save_every": 1,
    "train.keep_last": 10,
    "train.log_every": 1,
    "train.log_with": "[]",
    "train.copied_lr_ref_rms": "null",  # every group at lr × its lr_scales multiplier (expected_scale)
    "train.copied_fc_lr_scale": "null",
}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("guards")
    verifier = make_bigram_verifier(root / "verifier")
    train = make_samples(verifier, 8, seed=0, min_len=32, max_len=48)
    write_store(root / "store" / "train", verifier, train)
    write_store(root / "store" / "eval", verifier, make_samples(verifier, 4, seed=1), first_id=1000)
    return SimpleNamespace(
        root=root,
        verifier=verifier,
        samples=train,
        train_store=root / "store" / "train",
        eval_store=root / "store" / "eval",
        token_freqs=write_token_freqs(root / "token_freqs.npy", train, VOCAB),
    )


def overrides(world, run_dir: Path, **extra) -> list[str]:
    settings = tiny_run_settings(world.verifier, world.train_store, world.eval_store, world.token_freqs)
    settings.update({**BASE, "train.run_dir": str(run_dir), **extra})
    return [f"{k}={v}" for k, v in settings.items()]


def config(world, run_dir: Path, **extra):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose("train", overrides=overrides(world, run_dir, **extra))


def trainer_for(cfg) -> DSparkTrainer:
    return build_trainer(cfg, make_accelerator(load_section(TrainConfig, cfg, "train")))


@pytest.fixture(scope="module")
def base_run(world) -> Path:
    """2 steps (2 epochs of 1 step), a checkpoint after each."""
    run_dir = world.root / "runs" / "base"
    run(config(world, run_dir))
    return run_dir


def saved_moments(ckpt: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's AdamW state in a checkpoint's optimizer.pt, by the names its groups list."""
    opt = torch.load(ckpt / "optimizer.pt", weights_only=True)["optimizer"]
    return {
        name: opt["state"][index]
        for group in opt["param_groups"]
        for name, index in zip(group["param_names"], group["params"], strict=True)
    }


def expected_scale(name: str, cfg: TrainConfig) -> float:
    """The LR multiplier of a parameter, by hand: its longest listed prefix (no wildcards here)."""
    scales = cfg.lr_scales or {}
    prefixes = [p for p in scales if name == p or name.startswith(p + ".")]
    return scales[max(prefixes, key=len)] if prefixes else 1.0


def expected_factor(step: int, cfg: TrainConfig) -> float:
    """Warmup then cosine over min(max_steps, epochs) steps (one step per epoch), written out."""
    total = min(cfg.epochs, cfg.max_steps or cfg.epochs)
    warmup = math.ceil(cfg.warmup_ratio * total) if cfg.warmup_ratio else 0
    if step < warmup:
        return (step + 1) / warmup
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine


def copy_rms(world) -> dict[str, float]:
    """The RMS of each tensor the draft's 2 layers copy, read by hand from the verifier's file (its last
    2 layers), by the draft's name: what `train.copied_lr_ref_rms` divides."""
    files = list(world.verifier.glob("*.safetensors"))
    weights = {k: v for f in files for k, v in load_file(f).items()}
    first = 1 + max(int(k.split(".")[2]) for k in weights if k.startswith("model.layers.")) - 2
    return {
        f"layers.{int(k.split('.')[2]) - first}.{k.split('.', 3)[3]}": float(v.float().pow(2).mean().sqrt())
        for k, v in weights.items()
        if k.startswith("model.layers.") and int(k.split(".")[2]) >= first
    }


def expected_multiplier(name: str, cfg: TrainConfig, rms: dict[str, float], shapes: dict[str, int]) -> float:
    """`train.copied_lr_ref_rms`'s multiplier of a parameter, by hand: for every tensor of a copied layer, the
    median RMS of the copied matrices (by their number of dims, `shapes`) / ref; `train.copied_fc_lr_scale`
    for fc (copied from the last aux layer in these runs); else 1."""
    if name.startswith("fc.") and cfg.copied_fc_lr_scale is not None:
        return cfg.copied_fc_lr_scale
    if not cfg.copied_lr_ref_rms or name not in rms:
        return 1.0
    return statistics.median(v for n, v in rms.items() if shapes[n] == 2) / cfg.copied_lr_ref_rms


def check_follows_config(trainer: DSparkTrainer, ckpt: Path, rms: dict[str, float]) -> None:
    """Every parameter: its group's LR, betas and weight decay are this config's, the schedule at
    the resumed step is this config's, and its AdamW moments are its own from the checkpoint."""
    cfg, moments = trainer.cfg, saved_moments(ckpt)
    assert len(trainer.planner.epoch(0)) == 1  # what expected_factor assumes
    params = dict(trainer.raw_model.named_parameters())
    shapes = {n: p.ndim for n, p in params.items()}
    for group in trainer.optimizer.param_groups:
        assert group["betas"] == tuple(cfg.adam_betas) and group["weight_decay"] == cfg.weight_decay
        for name, p in zip(group["param_names"], group["params"], strict=True):
            assert p is params[name]
            want = cfg.lr * expected_scale(name, cfg) * expected_multiplier(name, cfg, rms, shapes)
            assert group["initial_lr"] == pytest.approx(want), name
            state = trainer.optimizer.state[p]
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key], moments[name][key]), (name, key)
    assert trainer.lr_factor(trainer.state.step) == pytest.approx(expected_factor(trainer.state.step, cfg))


def test_copied_layers_step_by_the_same_fraction_of_their_weights_size(world, tmp_path):
    """`train.copied_lr_ref_rms`: AdamW's first step moves each element by its group's LR (m̂/√v̂ = ±1), so
    after it every tensor of the copied layers (matrices, norms, biases) has moved by lr × its `lr_scales`
    multiplier × the median RMS of the copied matrices / ref, one number for all; fc (copied, not a layer)
    by lr × `train.copied_fc_lr_scale`, and by lr itself where it starts random."""
    ref, run_dir, fc_scale = 0.05, tmp_path / "run", 0.25
    settings = {
        "train.copied_lr_ref_rms": ref,
        "train.copied_fc_lr_scale": fc_scale,
        "train.max_steps": 1,
        "train.epochs": 1,
    }
    trainer = trainer_for(config(world, run_dir, **settings))
    cfg, start = trainer.cfg, {n: p.detach().clone() for n, p in trainer.raw_model.named_parameters()}
    rms = copy_rms(world)
    copied = [n for n in start if n.startswith("layers.") and n in rms]
    assert len(copied) > 20 and len({round(rms[n], 4) for n in copied if start[n].ndim == 2}) > 3
    assert expected_factor(0, cfg) == 1.0
    median = statistics.median(rms[n] for n in copied if start[n].ndim == 2)
    assert abs(median / ref - 1) > 0.2  # the multiplier is seen
    run(config(world, run_dir, **settings))
    moved = {n: (w - start[n]).abs() for n, w in load_file(run_dir / "checkpoints" / "step_1" / WEIGHTS_FILE).items()}
    for name in copied:
        step = float(moved[name][moved[name] > 0].median())  # untouched elements had no gradient
        want = cfg.lr * expected_scale(name, cfg) * median / ref
        assert step == pytest.approx(want, rel=5e-3), name  # Adam's eps shrinks the smallest gradients' steps
    assert float(moved["fc.weight"][moved["fc.weight"] > 0].median()) == pytest.approx(cfg.lr * fc_scale, rel=1e-3)
    random_fc = config(world, tmp_path / "random_fc", **settings, **{"train.init_fc_from_last_aux": "false"})
    fc0 = trainer_for(random_fc).raw_model.fc.weight.detach().clone()
    assert not torch.equal(fc0, start["fc.weight"])  # random, not the last aux layer
    run(random_fc)
    moved = (load_file(tmp_path / "random_fc" / "checkpoints" / "step_1" / WEIGHTS_FILE)["fc.weight"] - fc0).abs()
    assert float(moved[moved > 0].median()) == pytest.approx(cfg.lr, rel=1e-3)


def test_reordered_lr_scales_keep_each_parameters_lr_and_moments(world, base_run):
    ckpt = base_run / "checkpoints" / "step_2"
    moments = saved_moments(ckpt)
    a, b = moments["layers.0.mlp.up_proj.weight"]["exp_avg"], moments["layers.1.mlp.up_proj.weight"]["exp_avg"]
    assert a.shape == b.shape and not torch.equal(a, b)  # a swap would be seen
    trainer = trainer_for(config(world, base_run, **{"++train.lr_scales": "{layers.1: 2.0, layers.0: 0.5}"}))
    check_follows_config(trainer, ckpt, copy_rms(world))
    lrs = {n: g["initial_lr"] for g in trainer.optimizer.param_groups for n in g["param_names"]}
    assert lrs["layers.0.mlp.up_proj.weight"] == pytest.approx(0.5e-2)
    assert lrs["layers.1.mlp.up_proj.weight"] == pytest.approx(2e-2)


def test_unnamed_groups_of_an_older_checkpoint_are_named_from_its_config(world, base_run, tmp_path):
    run_dir = tmp_path / "old"
    shutil.copytree(base_run, run_dir, symlinks=True)
    path = run_dir / "checkpoints" / "step_2" / "optimizer.pt"
    opt = torch.load(path, weights_only=True)
    for group in opt["optimizer"]["param_groups"]:  # as written before groups were named
        del group["param_names"]
    # ... in the order of that run's lr_scales, the rest first: [rest, markov_embed_proj, layers.0, layers.1]
    opt["optimizer"]["param_groups"].sort(key=lambda g: {"": 0, "markov_embed_proj": 1}.get(g["name"], 2))
    torch.save(opt, path)
    check_follows_config(trainer_for(config(world, run_dir)), base_run / "checkpoints" / "step_2", copy_rms(world))


def test_a_checkpoint_with_keys_this_schema_no_longer_has_resumes_or_is_refused_in_one_line(world, base_run, tmp_path):
    """Keys a checkpoint's config.yaml holds that the schemas have since lost are not compared; a
    checkpoint whose weights hold a tensor this model no longer has is refused by name (a UserError:
    one line, no traceback); so is one whose lr_scales differ from today's default."""
    run_dir = tmp_path / "old"
    shutil.copytree(base_run, run_dir, symlinks=True)
    ckpt = run_dir / "checkpoints" / "step_2"
    saved = OmegaConf.load(ckpt / CONFIG_FILE)
    saved.loss.retired_term = 0.0
    saved.train.retired_average = None
    saved.model.retired_projection = False
    OmegaConf.save(saved, ckpt / CONFIG_FILE)
    cfg = config(world, run_dir)
    assert resume_point(load_section(TrainConfig, cfg, "train"), run_dir, cfg) == ckpt.resolve()
    assert trainer_for(cfg).state.step == 2
    weights = load_file(ckpt / WEIGHTS_FILE)
    save_file({**weights, "retired_projection.weight": torch.zeros(2, 2)}, ckpt / WEIGHTS_FILE)
    with pytest.raises(UserError, match=r"weights do not fit this model .*unexpected \['retired_projection.weight'\]"):
        trainer_for(cfg)
    saved.train.lr_scales = None  # as a run before lr_scales held the projection's 4x
    OmegaConf.save(saved, ckpt / CONFIG_FILE)
    with pytest.raises(UserError, match=r"cannot resume .*\['train.lr_scales'\] differ"):
        resume_point(load_section(TrainConfig, cfg, "train"), run_dir, cfg)


# Every train key and a value other than BASE's: the matrix below must cover each one.
ALTERNATIVES = {
    "run_name": "other",
    "run_dir": "<copy of the run dir>",
    "train_store": "<copy of the store>",
    "eval_store": "<the eval store>",
    "token_freqs": "<copy of token_freqs>",
    "vocab_mapping": "<the run's own mapping>",
    "draft_vocab_from": "verifier",
    "init_from": "<its first checkpoint>",
    "init_layers_from_verifier": "null",
    "init_fc_from_last_aux": "false",
    "init_norm_from_verifier": "false",
    "resume": "must",
    "allow_resume_changes": "true",
    "collective_timeout_s": 60,
    "seed": 1,
    "epochs": 4,
    "max_steps": 1,
    "train_samples": 5,
    "tokens_per_step": 1024,
    "tokens_per_micro_batch": 256,
    "lr": 2e-2,
    "lr_scales": "{layers.0: 0.5, layers.1: 2.0, markov_embed_proj: 1.0}",
    "copied_lr_ref_rms": 0.5,
    "copied_fc_lr_scale": 0.5,
    "weight_decay": 0.1,
    "adam_betas": "[0.8,0.9]",
    "warmup_ratio": 0.5,
    "min_lr_ratio": 0.5,
    "grad_clip": 0.5,
    "max_nonfinite_steps": 5,
    "mixed_precision": "bf16",
    "compile": "true",
    "data_workers": 1,
    "prefetch_steps": 3,
    "eval_every": 7,
    "eval_on_start": "true",
    "save_every": 3,
    "keep_last": 4,
    "log_every": 2,
    "log_with": "[tensorboard]",
    "export": "true",
}
# The accelerator (its mixed precision) is made once per process: that key is checked at the refusal only
# (`resume_point`, which every run passes before anything is built).
ONE_ACCELERATOR = {"mixed_precision"}


def test_resume_matrix_refuses_by_name_or_follows_the_new_value(world, base_run, tmp_path):
    kinds = resume_kinds(TrainConfig)
    assert set(ALTERNATIVES) == set(kinds), "every train key needs a row in the resume matrix"
    ckpt = base_run / "checkpoints" / "step_2"
    run_copy = tmp_path / "moved"
    shutil.copytree(base_run, run_copy, symlinks=True)
    store_copy = tmp_path / "store"
    shutil.copytree(world.train_store, store_copy)
    freqs_copy = shutil.copy(world.token_freqs, tmp_path / "freqs.npy")
    paths = {
        "run_dir": run_copy,
        "train_store": store_copy,
        "eval_store": world.eval_store,
        "token_freqs": freqs_copy,
        "vocab_mapping": base_run / "vocab_map_128.safetensors",
        "init_from": base_run / "checkpoints" / "step_1",
    }
    seen = {kind: [] for kind in ("fixed", "changes", "free")}
    for key, value in ALTERNATIVES.items():
        kind = kinds[key]
        seen[kind].append(key)
        change = {f"train.{key}": paths.get(key, value)}
        if kind != "free":  # refused by name, and whatever allow_resume_changes says for a fixed key
            for allow in ("false",) if kind == "changes" else ("false", "true"):
                cfg = config(world, base_run, **change, **{"train.allow_resume_changes": allow})
                with pytest.raises(UserError, match=rf"cannot resume .*\['train.{key}'\] differ"):
                    resume_point(load_section(TrainConfig, cfg, "train"), base_run, cfg)
        if kind == "fixed" or key in ONE_ACCELERATOR:
            continue
        allowed = {"train.allow_resume_changes": "true"} if kind == "changes" else {}
        trainer = trainer_for(config(world, base_run, **change, **allowed))
        assert trainer.state.step == 2, key  # resumed, not started over
        check_follows_config(trainer, ckpt, copy_rms(world))
        if key == "eval_store":
            assert trainer.eval_store is not None and trainer.eval_refs[0].sample_id == 1000
        if key == "compile":  # compiled on a CPU too when asked for (auto compiles on CUDA only)
            assert all(layer._compiled_call_impl is not None for layer in trainer.raw_model.layers)
    assert seen["fixed"] and seen["changes"] and seen["free"]
    assert {"seed", "tokens_per_step", "init_from"} <= set(seen["fixed"])
    assert {"lr", "max_steps", "warmup_ratio", "epochs", "eval_store"} <= set(seen["changes"])


def test_train_samples_trains_on_the_lowest_sample_ids_only(world, tmp_path):
    """`train.train_samples=N`: a data-size study on one store trains on its first N samples by id."""
    ids = sorted(ShardStore.open(world.train_store).index(), key=lambda r: r.sample_id)
    trainer = trainer_for(config(world, tmp_path / "run", **{"train.train_samples": 3}))
    assert {ref.sample_id for ref in trainer.train_split.refs} == {ref.sample_id for ref in ids[:3]}
    assert trainer.train_split.counts["samples"] == 3
    full = trainer_for(config(world, tmp_path / "full"))
    assert full.train_split.counts["samples"] == len(ids) == 8


def test_held_out_keys_are_compared_like_the_eval_store(world, base_run, tmp_path):
    """heldout.* (shared with make eval) decide the metric the best checkpoint is picked on: a resume
    refuses a changed sample set, anchor draw or seed by name unless train.allow_resume_changes, like a
    changed train.eval_store; the batching bounds memory only and is free. A checkpoint written without
    the section (its held-out keys then under train.*, retired since) is not compared on it."""
    ckpt = (base_run / "checkpoints" / "step_2").resolve()
    changes = {"max_samples": "changes", "anchors_per_sample": "changes", "seed": "changes"}
    assert resume_kinds(HeldoutConfig) == {**changes, "anchors_per_forward": "free"}

    def resumes_from(**change) -> Path | None:
        cfg = config(world, base_run, **change)
        return resume_point(load_section(TrainConfig, cfg, "train"), base_run, cfg)

    for key, value in {"max_samples": 2, "anchors_per_sample": "null", "seed": 3}.items():
        with pytest.raises(UserError, match=rf"cannot resume .*\['heldout.{key}'\] differ"):
            resumes_from(**{f"heldout.{key}": value})
        assert resumes_from(**{f"heldout.{key}": value, "train.allow_resume_changes": "true"}) == ckpt
    assert resumes_from(**{"heldout.anchors_per_forward": 5}) == ckpt
    run_dir = tmp_path / "old"
    shutil.copytree(base_run, run_dir, symlinks=True)
    old = (run_dir / "checkpoints" / "step_2").resolve()
    saved = OmegaConf.load(old / CONFIG_FILE)
    del saved["heldout"]
    saved.train.eval_num_anchors, saved.train.eval_max_samples = 512, None
    OmegaConf.save(saved, old / CONFIG_FILE)
    cfg = config(world, run_dir, **{"heldout.anchors_per_sample": 7})
    assert resume_point(load_section(TrainConfig, cfg, "train"), run_dir, cfg) == old


def test_a_resumed_run_trains_at_the_new_lr_and_schedule(world, base_run, tmp_path):
    """The optimizer's LRs in the steps after a resume that changes lr and the length: the new
    values (a loaded scheduler state would keep the old peak)."""
    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir, symlinks=True)
    change = {"train.lr": 2e-2, "train.epochs": 4, "train.allow_resume_changes": "true"}
    run(config(world, run_dir, **change))
    cfg = load_section(TrainConfig, config(world, run_dir, **change), "train")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows if r["split"] == "train"}
    assert sorted(lrs) == [1, 2, 3, 4]
    for step in (3, 4):  # logged at step s: the LR of optimizer step s (schedule position s - 1)
        assert lrs[step] == pytest.approx(2e-2 * expected_factor(step - 1, cfg))
    opt = torch.load(run_dir / "checkpoints" / "step_4" / "optimizer.pt", weights_only=True)["optimizer"]
    for group in opt["param_groups"]:
        peak = 2e-2 * {"layers.0": 0.5, "layers.1": 2.0, "markov_embed_proj": 4.0}.get(group["name"], 1.0)
        assert group["lr"] == pytest.approx(peak * expected_factor(3, cfg)), group["name"]


# ----- warm start: the same identity a resume checks -----


def test_warm_start_refuses_another_verifier_or_architecture(world, base_run, tmp_path):
    trainer = trainer_for(config(world, base_run))
    drafter = export_drafter(trainer.raw_model, tmp_path / "drafter", trainer.verifier_name_or_path)
    other = export_drafter(trainer.raw_model, tmp_path / "other", "Qwen/Qwen3-0.6B")
    ckpt = base_run / "checkpoints" / "step_2"
    refusals = [  # (source, this run's change, the key named)
        (drafter, {"model.block_size": 3}, "model.block_size"),
        (ckpt, {"model.block_size": 3}, "model.block_size"),
        (other, {}, "target.name_or_path"),
        (ckpt, {"target.mask_token_id": 5}, "target.mask_token_id"),
        (ckpt, {"model.causal_in_block": "true"}, "model.causal_in_block"),
    ]
    for source, change, key in refusals:
        with pytest.raises(UserError, match=rf"train.init_from=.*\['{key}'\] differ"):
            trainer_for(config(world, tmp_path / "warm", **{"train.init_from": source, **change}))
    assert not (tmp_path / "warm" / "checkpoints").exists()
    weights = load_file(ckpt / "model.safetensors")
    for source in (drafter, ckpt):  # the same identity loads (a new objective or schedule may differ)
        warm = trainer_for(config(world, tmp_path / "warm", **{"train.init_from": source, "train.lr": 5e-3}))
        got = dict(warm.raw_model.named_parameters())
        assert torch.equal(got["layers.1.mlp.up_proj.weight"], weights["layers.1.mlp.up_proj.weight"])


# ----- non-finite values -----


def test_a_nan_held_out_tau_is_never_best(world, tmp_path, monkeypatch):
    """τ 1.7, nan, 1.2 with keep_last 1: best stays at step 1 and survives the pruning."""
    taus = iter([1.7, math.nan, 1.2])
    real = DSparkTrainer.evaluate
    monkeypatch.setattr(DSparkTrainer, "evaluate", lambda self, refs: {**real(self, refs), "tau": next(taus)})
    run_dir = tmp_path / "run"
    settings = {"train.eval_store": world.eval_store, "train.eval_every": 1, "train.keep_last": 1}
    run(config(world, run_dir, **{**settings, "train.epochs": 3, "train.save_every": 100}))
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "best").resolve().name == "step_1"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_1", "step_3"]
    assert json.loads((ckpts / "step_3" / "trainer_state.json").read_text())["best_value"] == 1.7


def test_a_held_out_store_with_nothing_to_score_is_a_user_error(world, tmp_path):
    empty = make_samples(world.verifier, 3, seed=2, empty_masks=3)  # no trained token in any sample
    write_store(tmp_path / "eval", world.verifier, empty, first_id=1000)
    settings = {"train.eval_store": tmp_path / "eval", "train.eval_every": 1}
    with pytest.raises(UserError, match=r"no held-out sample has a block to score.*train.eval_store=null"):
        run(config(world, tmp_path / "run", **settings))


def test_a_run_dir_in_use_is_refused_untouched_and_freed_when_its_holder_is_killed(world, tmp_path):
    """A second run into a live run's train.run_dir (a relaunch, a second `make ablate`) is a UserError
    naming the holder, before it writes anything; a holder killed with SIGKILL frees the dir at once, though
    a child it forked (as a data-loader worker is) still lives."""
    run_dir = tmp_path / "run"
    code = "import os, sys, time; from pathlib import Path; from dspark.run_lock import try_lock; "
    code += "lock = try_lock(Path(sys.argv[1])); child = os.fork(); child or time.sleep(600); "
    code += "print(child, flush=True); time.sleep(600)"
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(holder.stdout.readline()))
    try:
        in_use = f"train.run_dir={run_dir} is in use by another training run (pid {holder.pid} on "
        with pytest.raises(UserError, match=re.escape(in_use)):
            run(config(world, run_dir, **{"train.resume": "restart"}))
        assert sorted(p.name for p in run_dir.iterdir()) == ["train.lock"]
        holder.kill()
        holder.wait()
        assert child.is_running()
        run(config(world, run_dir))
        assert latest_checkpoint(run_dir) is not None
    finally:
        holder.kill()
        child.kill()


def test_a_run_dir_that_cannot_be_created_is_a_user_error(world, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(UserError, match=r"train.run_dir=.*/file/run: cannot create or lock train.lock there"):
        run(config(world, tmp_path / "file" / "run"))
    # the probe `make ablate` runs first says the same instead of raising
    assert re.match(
        r"train.run_dir=.*/file/run: cannot create or lock train.lock there", in_use(tmp_path / "file" / "run")
    )
    assert in_use(tmp_path / "free") is None
    code = "import sys; from pathlib import Path; from dspark.run_lock import try_lock; "
    code += "sys.exit(try_lock(Path(sys.argv[1])) is None)"
    assert subprocess.run([sys.executable, "-c", code, str(tmp_path / "free")]).returncode == 0  # the probe let go


def write_poisoned_store(url: Path, verifier: Path, samples, poisoned: set[int]) -> None:
    """A store whose samples in `poisoned` hold nan target states (the verifier's final layer)."""
    target = store_target(verifier)
    writer = StoreWriter.create_or_open(url, target, tokenizer_sha256(verifier))
    hidden = extract(verifier, target["layer_ids"], [ids for ids, _ in samples])
    nan = bf16_to_bits(torch.tensor([math.nan]))[0]
    rows = []
    for i, ((ids, mask), h) in enumerate(zip(samples, hidden, strict=True)):
        if i in poisoned:
            h = h.copy()
            h[:, -1, :] = nan
        rows.append(Sample(i, ids.astype(np.int32), mask.astype(np.uint8), h))
    writer.write_shard(rows)


def one_sample_steps(world, store: Path, run_dir: Path, **extra) -> dict:
    """Settings of a run of one sample a step (4 samples: 4 steps an epoch), a checkpoint every step."""
    settings = {
        "train.train_store": store,
        "train.tokens_per_step": 48,
        "train.tokens_per_micro_batch": 48,
        "train.epochs": 1,
        "train.lr_scales": "null",
        "model.num_layers": 1,
    }
    return {**settings, **extra}


def train_rows(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["split"] == "train"}


def test_a_non_finite_loss_skips_the_step_and_too_many_stop_the_run(world, tmp_path):
    samples = [(ids[:48], mask[:48]) for ids, mask in world.samples[:4]]
    clean = tmp_path / "clean"
    write_poisoned_store(clean, world.verifier, samples, poisoned=set())
    split = StoreSplit.open(ShardStore.open(clean), str(clean), 48)
    (third,) = StepPlanner(split.lengths, 48, 48, seed=0).epoch(0)[2]  # the micro-batches of step 3
    store = tmp_path / "poisoned"
    write_poisoned_store(store, world.verifier, samples, poisoned={split.refs[i].sample_id for i in third})
    run_dir = tmp_path / "run"
    run(config(world, run_dir, **one_sample_steps(world, store, run_dir)))
    rows = train_rows(run_dir)
    assert [math.isfinite(rows[s]["loss"]) for s in (1, 2, 3, 4)] == [True, True, False, True]
    assert [rows[s]["nonfinite_steps"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]
    weights = [load_file(run_dir / "checkpoints" / f"step_{s}" / "model.safetensors") for s in (1, 2, 3, 4)]
    for a, b, same in (
        (weights[0], weights[1], False),
        (weights[1], weights[2], True),
        (weights[2], weights[3], False),
    ):
        assert all(torch.equal(a[k], b[k]) for k in a) == same  # step 3's update was skipped, the others trained
    assert all(torch.isfinite(t).all() for t in weights[3].values())

    all_bad = tmp_path / "all-bad"
    write_poisoned_store(all_bad, world.verifier, samples, poisoned={0, 1, 2, 3})
    with pytest.raises(UserError, match=r"steps 1\.\.2: 2 steps in a row had a non-finite loss.*max_nonfinite_steps=2"):
        run(
            config(
                world,
                tmp_path / "bad",
                **one_sample_steps(world, all_bad, tmp_path, **{"train.max_nonfinite_steps": 2}),
            )
        )


def test_ddp_ranks_skip_a_step_with_a_non_finite_loss_together(world, tmp_path):
    """2 gloo ranks, one sample each a step; rank 1's sample of step 2 holds nan states: every
    rank skips step 2 (the flag is summed over ranks), and the run goes on to train step 3."""
    samples = [(ids[:48], mask[:48]) for ids, mask in world.samples[:6]]
    clean = tmp_path / "clean"
    write_poisoned_store(clean, world.verifier, samples, poisoned=set())
    split = StoreSplit.open(ShardStore.open(clean), str(clean), 48)
    planner = StepPlanner(split.lengths, 96, 48, seed=0)
    (second,) = share_of_rank(planner, planner.epoch(0)[1], 1, 2)  # rank 1's micro-batch of step 2
    store = tmp_path / "poisoned"
    write_poisoned_store(store, world.verifier, samples, poisoned={split.refs[i].sample_id for i in second})
    run_dir = tmp_path / "run"
    settings = one_sample_steps(world, store, run_dir, **{"train.tokens_per_step": 96})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "train",
        *overrides(world, run_dir, **settings),
    ]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = train_rows(run_dir)
    assert [math.isfinite(rows[s]["loss"]) for s in (1, 2, 3)] == [True, False, True]
    assert [rows[s]["nonfinite_steps"] for s in (1, 2, 3)] == [0, 1, 1]
    weights = [load_file(run_dir / "checkpoints" / f"step_{s}" / "model.safetensors") for s in (1, 2, 3)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not all(torch.equal(weights[1][k], weights[2][k]) for k in weights[1])
    assert all(torch.isfinite(t).all() for t in weights[2].values())
