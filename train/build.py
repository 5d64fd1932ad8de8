"""Everything a run needs before its first step, each input checked before any compute:
the config, the devices, the stores against the target, the vocab mapping, the resume
point or warm start, and finally the model and its trainer.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator, InitProcessGroupKwargs
from accelerate.utils import ProjectConfiguration
from omegaconf import DictConfig, OmegaConf

from dspark.config import DraftConfig, HeldoutConfig
from dspark.errors import MissingInput, UserError
from dspark.eval.offline import held_out_refs
from dspark.export import load_drafter
from dspark.init import copyable_last_layers, init_from_verifier
from dspark.model import DSparkDraft
from dspark.store import SampleRef, ShardStore
from dspark.targets import EMBEDDED_PREFIX, Target, dataset_target, resolve_target
from dspark.train.checkpoint import (
    CONFIG_FILE,
    load_trainable_state,
    read_weights,
    resolve_checkpoint,
    trainable_state,
)
from dspark.train.config import TrainConfig, load_sections
from dspark.train.data import StoreSplit
from dspark.train.dspark_trainer import DSparkTrainer
from dspark.train.optim import COPIED_FC, COPIED_LAYERS, copied_layers_lr, with_prefix_lr
from dspark.train.resume import clear_run, identity_changes, resume_point
from dspark.train.vocab_counts import verifier_counts
from dspark.verifier import VerifierHead
from dspark.vocab import MAPPING_GLOB, build_mapping, check_same_mapping, load_mapping, mapping_path, save_mapping


def check_devices(processes_per_node: int, cuda_devices: int) -> None:
    """On a CUDA machine every process needs its own GPU (CPU runs may start any number)."""
    if cuda_devices and processes_per_node > cuda_devices:
        raise UserError(
            f"GPUS={processes_per_node} processes per node but this machine has {cuda_devices} CUDA device(s); "
            f"use GPUS<={cuda_devices}"
        )


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    cuda = torch.cuda.is_available()
    precision = ("bf16" if cuda else "no") if cfg.mixed_precision == "auto" else cfg.mixed_precision
    # A bounded wait on the other ranks: a dead or hung peer fails the collective instead of hanging it.
    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.collective_timeout_s))
    # Experiment trackers (train.log_with); TensorBoard events go to run_dir/tensorboard/<run_name>.
    project = ProjectConfiguration(project_dir=cfg.run_dir, logging_dir=str(Path(cfg.run_dir) / "tensorboard"))
    return Accelerator(
        cpu=not cuda,
        mixed_precision=precision,
        kwargs_handlers=[timeout],
        log_with=cfg.log_with or None,
        project_config=project,
    )


def open_store(url: str, field: str, target: Target) -> ShardStore:
    """Open a store and refuse one made for another target, other layers or another tokenizer."""
    try:
        store = ShardStore.open(url)
    except FileNotFoundError as err:
        raise MissingInput(f"train.{field}: {err}; run `make extract` first") from err
    target.check_store(store.attrs, f"train.{field}={url}")
    role = {"train_store": "train", "eval_store": "eval"}[field]
    if store.attrs.get("split", role) != role:
        raise UserError(
            f"train.{field}={url} holds the {store.attrs['split']!r} split, not {role!r}: training on held-out "
            "data, or picking the best checkpoint on training data, gives misleading figures"
        )
    return store


def open_split(
    url: str, field: str, target: Target, max_tokens: int, every_token: bool = False, max_samples: int | None = None
) -> StoreSplit:
    store = open_store(url, field, target)
    split = StoreSplit.open(store, url, max_tokens, every_token, max_samples)
    if not split.refs:
        raise UserError(f"train.{field}={url} has no committed samples: nothing to train on")
    return split


def open_heldout(url: str, target: Target, heldout: HeldoutConfig) -> tuple[ShardStore, list[SampleRef]]:
    """The held-out store and the samples every evaluation scores (`make eval`'s: `held_out_refs`)."""
    store = open_store(url, "eval_store", target)
    refs = held_out_refs(store, heldout.max_samples)
    if not refs:
        raise UserError(f"train.eval_store={url} has no committed samples: nothing to evaluate on")
    return store, refs


def new_mapping_needed(cfg: TrainConfig, draft: DraftConfig, vocab_size: int, run_dir: Path) -> bool:
    """Whether `vocab_mapping` will rank a new draft vocabulary (a reduced one, no run's own or given file)."""
    reduced = draft.draft_vocab_size is not None and draft.draft_vocab_size != vocab_size
    return reduced and cfg.vocab_mapping is None and not mapping_path(run_dir, draft.draft_vocab_size).exists()


def vocab_mapping(
    cfg: TrainConfig, draft: DraftConfig, vocab_size: int, run_dir: Path, counts: np.ndarray | None = None
) -> Path | None:
    """The run's mapping file (reused, copied from `train.vocab_mapping`, or built by ranking token counts).

    A new one ranks `counts` (the verifier's expected counts: `train.draft_vocab_from: verifier`) or
    token_freqs (`tokens`). None when the draft uses the full verifier vocabulary.
    """
    if draft.draft_vocab_size is None or draft.draft_vocab_size == vocab_size:
        if cfg.vocab_mapping is not None:
            raise UserError("train.vocab_mapping is set but model.draft_vocab_size is the full vocabulary")
        return None
    size = draft.draft_vocab_size
    own = mapping_path(run_dir, size)
    given = None
    if cfg.vocab_mapping is not None:
        given = load_mapping(cfg.vocab_mapping, target_vocab_size=vocab_size, draft_vocab_size=size)
    if own.exists():
        current = load_mapping(own, target_vocab_size=vocab_size, draft_vocab_size=size)
        if given is not None:
            check_same_mapping(current, given, names=(str(own), cfg.vocab_mapping))
        ranked_by = current[2].get("ranked_by")
        if given is None and "copied_from" not in current[2] and ranked_by not in (None, cfg.draft_vocab_from):
            raise UserError(
                f"{own} (an earlier run's draft vocabulary) was ranked by {ranked_by}, train.draft_vocab_from is "
                f"{cfg.draft_vocab_from}: set train.resume=restart to start over with a new one, or another train.run_name"
            )
        return own
    if given is not None:
        return save_mapping(own, given[0], given[1], {**given[2], "copied_from": cfg.vocab_mapping})
    if cfg.draft_vocab_from == "verifier":
        if counts is None or counts.shape != (vocab_size,):
            raise ValueError(f"draft_vocab_from=verifier needs the verifier's counts [{vocab_size}]")
        d2t, t2d = build_mapping(counts, size)
        return save_mapping(
            own, d2t, t2d, {"ranked_by": "verifier", "train_store": cfg.train_store, "draft_vocab_size": size}
        )
    freqs_path = Path(cfg.token_freqs)
    if not freqs_path.is_file():
        raise MissingInput(
            f"train.token_freqs: {freqs_path} not found; it is written by `make data` "
            "(or give an existing mapping with train.vocab_mapping)"
        )
    counts = np.load(freqs_path)
    if counts.shape != (vocab_size,):
        raise UserError(
            f"train.token_freqs: {freqs_path} has shape {counts.shape}, the verifier vocabulary is {vocab_size}"
        )
    d2t, t2d = build_mapping(counts, size)
    return save_mapping(
        own, d2t, t2d, {"ranked_by": "tokens", "token_freqs": str(freqs_path), "draft_vocab_size": size}
    )


def draft_identity(model: DSparkDraft, verifier_name_or_path: str) -> dict:
    """What a draft's weights mean, in config terms (the sections `identity_changes` compares): its
    verifier, aux layers, mask token and architecture. The training-only Markov projection is
    left out: a drafter holds it folded into its table."""
    arch = {k: v for k, v in asdict(model.cfg).items() if k != "markov_embed_proj"}
    target = {"name_or_path": verifier_name_or_path, "aux_layer_ids": list(model.aux_layer_ids)}
    target["mask_token_id"] = model.mask_token_id
    return {"target": target, "model": {**arch, "draft_vocab_size": model.draft_vocab_size}}


def refuse_other_identity(path: str, changed: list[str], source: Path) -> None:
    if changed:
        raise UserError(
            f"train.init_from={path}: {changed} differ from {source} (it was trained for another verifier, "
            "other aux layers or another draft architecture; its weights would load and mean something else); "
            "set them as it has them, or start without train.init_from"
        )


def warm_start(model: DSparkDraft, path: str, full_cfg: DictConfig, verifier_name_or_path: str) -> None:
    """Load weights from an exported drafter or a checkpoint made for the same verifier, aux layers and
    draft architecture as this run (the keys a resume may not change either); its vocab mapping must be ours."""
    source = Path(path)
    if (source / "config.json").is_file():
        other = load_drafter(source)
        spec = json.loads((source / "config.json").read_text()).get("speculators_config", {})
        theirs = draft_identity(other, spec.get("verifier", {}).get("name_or_path"))
        changed = identity_changes(draft_identity(model, verifier_name_or_path), theirs)
        refuse_other_identity(path, changed, source / "config.json")
        if (other.d2t is None) != (model.d2t is None):
            raise UserError(
                f"train.init_from={path}: one of the drafter and this run has a reduced vocabulary, the other not"
            )
        if model.d2t is not None:
            check_same_mapping((model.d2t, model.t2d), (other.d2t, other.t2d), names=("this run", path))
        weights = trainable_state(other)
        # The training-time Markov projection was folded into the drafter's table: it starts at 0 again.
        params = dict(model.named_parameters())
        weights.update({name: params[name].detach().clone() for name in model.training_only() - set(weights)})
        load_trainable_state(model, weights, source)
        return
    ckpt = resolve_checkpoint(source)
    refuse_other_identity(path, identity_changes(full_cfg, OmegaConf.load(ckpt / CONFIG_FILE)), ckpt / CONFIG_FILE)
    if model.d2t is not None:
        files = sorted(ckpt.glob(MAPPING_GLOB))
        if not files:
            raise UserError(
                f"train.init_from={path}: checkpoint has no vocab mapping but this run uses a reduced vocabulary"
            )
        check_same_mapping((model.d2t, model.t2d), load_mapping(files[0]), names=("this run", str(files[0])))
    load_trainable_state(model, read_weights(ckpt), ckpt)  # weights only: nothing is unpickled


def served_verifier_name(name_or_path: str, target_dir: Path) -> str:
    """What the exported drafter names as its verifier: the hub id, else the local directory."""
    if name_or_path.startswith(EMBEDDED_PREFIX) or Path(name_or_path).expanduser().exists():
        return str(Path(target_dir).resolve())
    return name_or_path


def build_trainer(full_cfg: DictConfig, accelerator: Accelerator) -> DSparkTrainer:
    """Check every input, build the draft and return its trainer (resumed when asked)."""
    cfg, target_cfg, draft_cfg, loss_cfg, heldout = load_sections(full_cfg)
    run_dir = Path(cfg.run_dir)
    resume_from = resume_point(cfg, run_dir, full_cfg)
    if cfg.resume == "restart":
        accelerator.wait_for_everyone()  # every rank has looked before rank 0 deletes
        if accelerator.is_main_process:
            clear_run(run_dir)
        accelerator.wait_for_everyone()

    target = resolve_target(target_cfg, dataset_target(OmegaConf.select(full_cfg, "paths.data_dir")))
    accelerator.print(target.describe())
    target_dir = target.model_dir
    train_split = open_split(
        cfg.train_store,
        "train_store",
        target,
        cfg.tokens_per_micro_batch,
        every_token=loss_cfg.train_on_prompt,
        max_samples=cfg.train_samples,
    )
    eval_store, eval_refs = open_heldout(cfg.eval_store, target, heldout) if cfg.eval_store is not None else (None, [])

    vocab_size = target.vocab_size
    # On the device first: the draft then shares the verifier's embedding instead of copying it.
    verifier = VerifierHead.from_pretrained(target_dir).to(accelerator.device)
    counts = None
    if cfg.draft_vocab_from == "verifier" and new_mapping_needed(cfg, draft_cfg, vocab_size, run_dir):
        counts = verifier_counts(
            open_store(cfg.train_store, "train_store", target), verifier, accelerator, cfg.train_samples
        )
    # Rank 0 writes the run's mapping; the others read what it wrote.
    with accelerator.main_process_first():
        mapping_file = vocab_mapping(cfg, draft_cfg, vocab_size, run_dir, counts)
    d2t = None
    if mapping_file is not None:
        mapping = load_mapping(mapping_file)
        if resume_from is not None:  # the checkpoint's own copy is what its weights were trained with
            saved = resume_from / mapping_file.name
            check_same_mapping(load_mapping(saved), mapping, names=(str(saved), str(mapping_file)))
        d2t = mapping[0]

    torch.manual_seed(cfg.seed)
    model = DSparkDraft(draft_cfg, target.text_config, target.aux_layer_ids, target.mask_token_id, d2t=d2t).to(
        accelerator.device
    )
    model.load_verifier(verifier)
    layers, fc = cfg.init_layers_from_verifier, cfg.init_fc_from_last_aux
    if layers == "auto":
        layers, line = copyable_last_layers(model, target_dir)
        accelerator.print(line)
    fc, norm = (layers is not None if v == "auto" else v for v in (fc, cfg.init_norm_from_verifier))
    lr_scales = cfg.lr_scales
    if layers is not None or fc or norm:
        copied = init_from_verifier(model, target_dir, layers, fc, norm)
        if cfg.copied_lr_ref_rms is not None and layers is not None:  # before a warm start or resume replaces them
            multiplier = copied_layers_lr(model, list(copied), cfg.copied_lr_ref_rms)
            lr_scales = with_prefix_lr(lr_scales, COPIED_LAYERS, multiplier)
            accelerator.print(
                f"copied layers: train at lr × {multiplier:.3g} (the median RMS of their matrices / "
                f"train.copied_lr_ref_rms={cfg.copied_lr_ref_rms})"
            )
        if fc and cfg.copied_fc_lr_scale is not None:
            lr_scales = with_prefix_lr(lr_scales, COPIED_FC, cfg.copied_fc_lr_scale)
            accelerator.print(f"copied fc: trains at lr × {cfg.copied_fc_lr_scale:g} (train.copied_fc_lr_scale)")
        if lr_scales != cfg.lr_scales:
            accelerator.print(f"LR multipliers {lr_scales}")
    verifier_name = served_verifier_name(target.name_or_path, target_dir)
    if cfg.init_from is not None and resume_from is None:  # a resume's weights are the checkpoint's
        warm_start(model, cfg.init_from, full_cfg, verifier_name)
    if cfg.compile is True or (cfg.compile == "auto" and accelerator.device.type == "cuda"):
        model.compile_backbone()

    return DSparkTrainer(
        cfg,
        accelerator,
        model=model,
        verifier=verifier,
        loss_cfg=loss_cfg,
        heldout=heldout,
        verifier_name_or_path=verifier_name,
        train_split=train_split,
        eval_store=eval_store,
        eval_refs=eval_refs,
        run_dir=run_dir,
        config_yaml=OmegaConf.to_yaml(full_cfg, resolve=True),
        run_files={} if mapping_file is None else {mapping_file.name: mapping_file},
        resume_from=resume_from,
        lr_scales=lr_scales,
    )


__all__ = [
    "build_trainer",
    "check_devices",
    "make_accelerator",
    "open_store",
    "vocab_mapping",
]
