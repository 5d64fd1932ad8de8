"""Everything a run needs before its first step, each input checked before any compute:
the config, the devices, the stores against the target, the vocab mapping, the resume
point or warm start, and finally the model and its trainer.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from accelerate import Accelerator, InitProcessGroupKwargs
from omegaconf import DictConfig, OmegaConf
from transformers import AutoConfig, AutoTokenizer

from dspark.config import DraftConfig, LossConfig, TargetConfig, to_dataclass
from dspark.errors import UserError
from dspark.export import load_drafter
from dspark.init import init_from_verifier
from dspark.model import DSparkDraft
from dspark.store import ShardStore
from dspark.targets import EMBEDDED_PREFIX, resolve_target_dir, tokenizer_sha256
from dspark.verifier import VerifierHead, resolve_aux_layer_ids, resolve_mask_token_id
from dspark.vocab import build_mapping, check_same_mapping, load_mapping, mapping_path, save_mapping
from train.checkpoint import (
    load_trainable_state,
    read_weights,
    resolve_checkpoint,
    trainable_state,
)
from train.config import TrainConfig
from train.data import StoreSplit
from train.dspark_trainer import DSparkTrainer
from train.resume import clear_run, resume_point

T = TypeVar("T")
RESUME_MODES = ("auto", "never", "must", "restart")
MIXED_PRECISION = ("auto", "bf16", "no")


def check_train_config(cfg: TrainConfig) -> None:
    """Clear errors, naming the field, for values the loop cannot run with."""
    positive = ("epochs", "tokens_per_step", "tokens_per_micro_batch", "save_every", "keep_last", "log_every",
                "prefetch_steps", "eval_num_anchors")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ValueError(f"train.{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("eval_every", "data_workers"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"train.{name} must be >= 0, got {getattr(cfg, name)}")
    if cfg.max_steps is not None and cfg.max_steps < 1:
        raise ValueError(f"train.max_steps must be null or >= 1, got {cfg.max_steps}")
    if cfg.resume not in RESUME_MODES:
        raise ValueError(f"train.resume must be one of {RESUME_MODES}, got {cfg.resume!r}")
    if cfg.mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"train.mixed_precision must be one of {MIXED_PRECISION}, got {cfg.mixed_precision!r}")
    if not 0 <= cfg.warmup_ratio < 1 or not 0 <= cfg.min_lr_ratio <= 1:
        raise ValueError("train.warmup_ratio must be in [0, 1) and train.min_lr_ratio in [0, 1]")
    if len(cfg.adam_betas) != 2:
        raise ValueError(f"train.adam_betas must be [beta1, beta2], got {cfg.adam_betas}")
    if cfg.grad_clip is not None and cfg.grad_clip <= 0:
        raise ValueError(f"train.grad_clip must be null or > 0, got {cfg.grad_clip}")


def check_devices(processes_per_node: int, cuda_devices: int) -> None:
    """On a CUDA machine every process needs its own GPU (CPU runs may start any number)."""
    if cuda_devices and processes_per_node > cuda_devices:
        raise RuntimeError(
            f"GPUS={processes_per_node} processes per node but this machine has {cuda_devices} CUDA device(s); "
            f"use GPUS<={cuda_devices}"
        )


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    cuda = torch.cuda.is_available()
    precision = ("bf16" if cuda else "no") if cfg.mixed_precision == "auto" else cfg.mixed_precision
    # A bounded wait on the other ranks: a dead or hung peer fails the collective instead of hanging it.
    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.collective_timeout_s))
    return Accelerator(cpu=not cuda, mixed_precision=precision, kwargs_handlers=[timeout])


def expected_store_target(target: TargetConfig, hf_config, aux_layer_ids: list[int]) -> dict:
    """The store attributes that must match this run's target (layer ids: aux + final)."""
    num_layers = int(hf_config.num_hidden_layers)
    return {
        "name_or_path": target.name_or_path,
        "hidden_size": int(hf_config.hidden_size),
        "num_hidden_layers": num_layers,
        "layer_ids": [*aux_layer_ids, num_layers],
    }


def open_store(url: str, field: str, expected: dict, tokenizer_hash: str) -> ShardStore:
    """Open a store and refuse one made for another target, other layers or another tokenizer."""
    try:
        store = ShardStore.open(url)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"train.{field}: no shard store at {url} (run `make extract` first): {err}") from err
    found = store.target
    wrong = {k: (found.get(k), v) for k, v in expected.items() if found.get(k) != v}
    if wrong:
        detail = "; ".join(f"{k}: store has {got!r}, this run needs {want!r}" for k, (got, want) in wrong.items())
        raise ValueError(f"train.{field}={url} was extracted for another target or layers: {detail}")
    if store.attrs.get("tokenizer_sha256") != tokenizer_hash:
        raise ValueError(f"train.{field}={url}: tokenizer_sha256 differs from the target's tokenizer")
    role = {"train_store": "train", "eval_store": "eval"}[field]
    if store.attrs.get("split", role) != role:
        raise UserError(
            f"train.{field}={url} holds the {store.attrs['split']!r} split, not {role!r}: training on held-out "
            "data, or picking the best checkpoint on training data, gives misleading figures"
        )
    return store


def open_split(url: str, field: str, expected: dict, tokenizer_hash: str, max_tokens: int,
               max_samples: int | None = None) -> StoreSplit:
    store = open_store(url, field, expected, tokenizer_hash)
    split = StoreSplit.open(store, url, max_tokens, max_samples)
    if not split.refs:
        raise ValueError(f"train.{field}={url} has no committed samples: nothing to train or evaluate on")
    return split


def vocab_mapping(cfg: TrainConfig, draft: DraftConfig, vocab_size: int, run_dir: Path) -> Path | None:
    """The run's mapping file (reused, copied from `train.vocab_mapping`, or built from token_freqs).

    None when the draft uses the full verifier vocabulary.
    """
    if draft.draft_vocab_size is None or draft.draft_vocab_size == vocab_size:
        if cfg.vocab_mapping is not None:
            raise ValueError("train.vocab_mapping is set but model.draft_vocab_size is the full vocabulary")
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
        return own
    if given is not None:
        return save_mapping(own, given[0], given[1], {**given[2], "copied_from": cfg.vocab_mapping})
    freqs_path = Path(cfg.token_freqs)
    if not freqs_path.is_file():
        raise FileNotFoundError(
            f"train.token_freqs: {freqs_path} not found; it is written by `make data` "
            "(or give an existing mapping with train.vocab_mapping)"
        )
    counts = np.load(freqs_path)
    if counts.shape != (vocab_size,):
        raise ValueError(
            f"train.token_freqs: {freqs_path} has shape {counts.shape}, the verifier vocabulary is {vocab_size}"
        )
    d2t, t2d = build_mapping(counts, size)
    return save_mapping(own, d2t, t2d, {"token_freqs": str(freqs_path), "draft_vocab_size": size})


def warm_start(model: DSparkDraft, path: str) -> None:
    """Load weights from an exported drafter or a checkpoint; its vocab mapping must be ours."""
    source = Path(path)
    if (source / "config.json").is_file():
        other = load_drafter(source)
        if (other.d2t is None) != (model.d2t is None):
            raise ValueError(
                f"train.init_from={path}: one of the drafter and this run has a reduced vocabulary, the other not"
            )
        if model.d2t is not None:
            check_same_mapping((model.d2t, model.t2d), (other.d2t, other.t2d), names=("this run", path))
        load_trainable_state(model, trainable_state(other), source)
        return
    ckpt = resolve_checkpoint(source)
    if model.d2t is not None:
        files = sorted(ckpt.glob("vocab_map_*.safetensors"))
        if not files:
            raise ValueError(
                f"train.init_from={path}: checkpoint has no vocab mapping but this run uses a reduced vocabulary"
            )
        check_same_mapping((model.d2t, model.t2d), load_mapping(files[0]), names=("this run", str(files[0])))
    load_trainable_state(model, read_weights(ckpt), ckpt)  # weights only: nothing is unpickled


def served_verifier_name(name_or_path: str, target_dir: Path) -> str:
    """What the exported drafter names as its verifier: the hub id, else the local directory."""
    if name_or_path.startswith(EMBEDDED_PREFIX) or Path(name_or_path).expanduser().exists():
        return str(Path(target_dir).resolve())
    return name_or_path


def config_section(cls: type[T], full_cfg: DictConfig, name: str) -> T:
    """`full_cfg[name]` as a `cls`, its interpolations (`${paths.*}`) resolved against the whole config."""
    return to_dataclass(cls, OmegaConf.to_container(full_cfg[name], resolve=True))


def build_trainer(full_cfg: DictConfig, accelerator: Accelerator) -> DSparkTrainer:
    """Check every input, build the draft and return its trainer (resumed when asked)."""
    cfg = config_section(TrainConfig, full_cfg, "train")
    target = config_section(TargetConfig, full_cfg, "target")
    draft_cfg = config_section(DraftConfig, full_cfg, "model")
    loss_cfg = config_section(LossConfig, full_cfg, "loss")
    check_train_config(cfg)
    run_dir = Path(cfg.run_dir)
    if cfg.eval_store is not None and cfg.eval_store == cfg.train_store:
        raise UserError(f"train.eval_store is train.train_store ({cfg.train_store}): evaluate on a held-out store")
    resume_from = resume_point(cfg, run_dir, full_cfg)
    if cfg.resume == "restart":
        accelerator.wait_for_everyone()  # every rank has looked before rank 0 deletes
        if accelerator.is_main_process:
            clear_run(run_dir)
        accelerator.wait_for_everyone()

    target_dir = resolve_target_dir(target.name_or_path, target.revision)
    hf_config = AutoConfig.from_pretrained(target_dir)
    hf_config = getattr(hf_config, "text_config", None) or hf_config
    aux_ids = resolve_aux_layer_ids(hf_config, target.aux_layer_ids)
    tokenizer_len = len(AutoTokenizer.from_pretrained(target_dir)) if target.mask_token_id is None else 0
    mask_id = resolve_mask_token_id(hf_config, tokenizer_len, target.mask_token_id)
    expected = expected_store_target(target, hf_config, aux_ids)
    tok_hash = tokenizer_sha256(target_dir)
    train_split = open_split(cfg.train_store, "train_store", expected, tok_hash, cfg.tokens_per_micro_batch)
    eval_split = None
    if cfg.eval_store is not None:
        eval_split = open_split(cfg.eval_store, "eval_store", expected, tok_hash, cfg.tokens_per_micro_batch,
                                cfg.eval_max_samples)

    vocab_size = int(hf_config.vocab_size)
    # Rank 0 writes the run's mapping; the others read what it wrote.
    with accelerator.main_process_first():
        mapping_file = vocab_mapping(cfg, draft_cfg, vocab_size, run_dir)
    d2t = None
    if mapping_file is not None:
        mapping = load_mapping(mapping_file)
        if resume_from is not None:  # the checkpoint's own copy is what its weights were trained with
            saved = resume_from / mapping_file.name
            check_same_mapping(load_mapping(saved), mapping, names=(str(saved), str(mapping_file)))
        d2t = mapping[0]

    torch.manual_seed(cfg.seed)
    model = DSparkDraft(draft_cfg, hf_config, aux_ids, mask_id, d2t=d2t).to(accelerator.device)
    # On the device first: the draft then shares the verifier's embedding instead of copying it.
    verifier = VerifierHead.from_pretrained(target_dir).to(accelerator.device)
    model.load_verifier(verifier)
    if cfg.init_layers_from_verifier is not None or cfg.init_fc_from_last_aux:
        init_from_verifier(model, target_dir, cfg.init_layers_from_verifier, cfg.init_fc_from_last_aux)
    if cfg.init_from is not None:
        warm_start(model, cfg.init_from)

    return DSparkTrainer(
        cfg,
        accelerator,
        model=model,
        verifier=verifier,
        loss_cfg=loss_cfg,
        verifier_name_or_path=served_verifier_name(target.name_or_path, target_dir),
        train_split=train_split,
        eval_split=eval_split,
        run_dir=run_dir,
        config_yaml=OmegaConf.to_yaml(full_cfg, resolve=True),
        run_files={} if mapping_file is None else {mapping_file.name: mapping_file},
        resume_from=resume_from,
    )


__all__ = [
    "build_trainer",
    "check_devices",
    "check_train_config",
    "config_section",
    "make_accelerator",
    "open_store",
    "vocab_mapping",
]
