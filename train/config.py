"""Schema of the `train:` section of `conf/train.yaml` (types and meaning; defaults live in the YAML), and the
check of every section of a training config (`load_sections`: config classes only, cheap to import for the
launcher, which runs it before starting ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from omegaconf import DictConfig

from dspark.config import Checked, DraftConfig, HeldoutConfig, LossConfig, TargetConfig, load_section, resume_field
from dspark.errors import UserError

RESUME_MODES = ("auto", "never", "must", "restart")
MIXED_PRECISION = ("auto", "bf16", "no")
VOCAB_RANKINGS = ("verifier", "tokens")


@dataclass
class TrainConfig(Checked):
    """The training pass: data, schedule, checkpoints, evaluation and export."""

    SECTION: ClassVar[str] = "train"
    RESUME: ClassVar[str] = "changes"

    run_name: str = resume_field("free")
    """Name of this run; its directory is `run_dir`."""
    run_dir: str = resume_field("free")
    """Directory of the run: checkpoints, vocab mapping, TensorBoard events, metrics.jsonl, drafter/."""
    train_store: str
    """Shard store (path or fsspec URL) with the training split."""
    train_samples: int | None = resume_field("fixed")
    """Train on the training store's first N samples (the lowest sample ids) only, as a smaller dataset would
    be: a data-size study on one store; null = every sample. A `tokens`-ranked draft vocabulary still comes
    from `token_freqs` (the whole dataset); a `verifier`-ranked one counts these N samples."""
    eval_store: str | None
    """Shard store with the held-out split, scored as `make eval` scores it (`heldout.*`); null = no evaluation."""
    token_freqs: str = resume_field("free")
    """token_freqs.npy of the data stage (loss-masked train token counts) used to build the draft vocabulary."""
    vocab_mapping: str | None = resume_field("free")
    """An existing vocab mapping to reuse (e.g. from an earlier run); null = the run's own or a new one."""
    draft_vocab_from: str = resume_field("fixed")
    """How a new reduced draft vocabulary is ranked: `verifier` (its next-token distributions summed over the
    training store's trained tokens) or `tokens` (`token_freqs`, the tokens it sampled)."""
    init_from: str | None = resume_field("fixed")
    """Warm start: an exported drafter dir or a checkpoint dir; weights only, the schedule starts fresh."""
    init_layers_from_verifier: Any = resume_field("fixed")
    """`auto`: the verifier's last `model.num_layers` decoder layers where they can be copied, else
    random; [ids]: draft layer j starts as verifier layer ids[j] (negative = from the end); null = random."""
    init_fc_from_last_aux: Any = resume_field("fixed")
    """Start `fc` as a selection of the last aux layer ([0 … 0 | I]): true, false, or `auto` (when layers are copied)."""
    init_norm_from_verifier: Any = resume_field("fixed")
    """Start the draft's final norm as the verifier's final norm: true, false, or `auto` (when layers are copied)."""
    resume: str = resume_field("free")
    """`auto`: continue from the newest complete checkpoint, else start fresh in an empty run_dir;
    `never`: refuse a run_dir with checkpoints; `must`: refuse one without; `restart`: delete
    the run_dir's checkpoints, metrics, drafter and vocabulary mapping and start from step 0."""
    allow_resume_changes: bool = resume_field("free")
    """Resume even though `loss.*`, schedule or held-out keys (lr, warmup, max_steps, eval_store, ...) differ
    from the checkpoint's; the resumed run then follows the new values (docs/resume.md)."""
    collective_timeout_s: float = resume_field("free")
    """A rank waiting longer than this on its peers (one died or hung) fails instead of waiting forever."""
    seed: int = resume_field("fixed")
    """Seed of weight init, sample order and anchor sampling."""
    epochs: int
    """Passes over the training split."""
    max_steps: int | None
    """Stop after this many optimizer steps (null = all epochs); the warmup and cosine span them."""
    tokens_per_step: int = resume_field("fixed")
    """Global batch: sample tokens per optimizer step, summed over all ranks (independent of GPUS)."""
    tokens_per_micro_batch: int = resume_field("fixed")
    """Padded tokens per forward pass on one rank (bounds memory; more micro-batches = accumulation)."""
    lr: float
    """Peak learning rate of AdamW."""
    lr_scales: dict[str, float] | None
    """LR multipliers by parameter-name prefix (a module path, e.g. `layers`, `layers.0`, `fc`,
    `markov_embed_proj`); 0 freezes."""
    copied_lr_ref_rms: float | None
    """The draft's layers copied from the verifier (`init_layers_from_verifier`) train at lr × (the median RMS
    of their weight matrices as copied / this) × their `lr_scales` multiplier: a step then moves the copy by
    about the same fraction on every verifier as on the one lr was tuned on (SmolLM2, RMS ~0.2). null: at
    lr like every other weight."""
    copied_fc_lr_scale: float | None
    """fc, when it starts as the verifier's last aux layer (`init_fc_from_last_aux`), trains at lr × this ×
    its `lr_scales` multiplier (0 freezes it); a random fc trains at lr. null: at lr either way."""
    weight_decay: float
    """AdamW decoupled weight decay."""
    adam_betas: list[float]
    """AdamW (beta1, beta2)."""
    warmup_ratio: float
    """Fraction of all steps with linear warmup from 0 to `lr`."""
    min_lr_ratio: float
    """Cosine decay ends at `lr * min_lr_ratio`."""
    grad_clip: float | None
    """Clip the global gradient norm to this value (null = no clipping)."""
    max_nonfinite_steps: int = resume_field("free")
    """Stop (an error) after this many optimizer steps in a row whose loss or gradient is not finite
    (each such step is skipped: the weights are left as they are)."""
    mixed_precision: str
    """`auto` (bf16 on CUDA, fp32 on CPU), `bf16` or `no`."""
    compile: Any = resume_field("free")
    """torch.compile the draft's layers and context k/v path: `auto` (on CUDA only: there an eager step is bound by
    kernel launches; on CPU a step gained ~6%, less than worth a compile at every start, docs/performance.md), true or false."""
    data_workers: int = resume_field("free")
    """Background DataLoader worker processes that read and collate the store (0 = in the training loop)."""
    prefetch_steps: int = resume_field("free")
    """Steps each data worker prepares ahead of the training loop."""
    eval_every: int = resume_field("free")
    """Evaluate on the held-out store every this many steps (and at the end); 0 = only at the end."""
    eval_on_start: bool = resume_field("free")
    """Also evaluate before the first step (the baseline of an untrained or warm-started draft)."""
    save_every: int = resume_field("free")
    """Write a checkpoint every this many steps (and at the end)."""
    keep_last: int = resume_field("free")
    """Checkpoints kept besides the best one (older ones are deleted)."""
    log_every: int = resume_field("free")
    """Write train metrics to the trackers / metrics.jsonl every this many steps."""
    log_with: list[str] = resume_field("free")
    """accelerate experiment trackers for train/eval figures (tensorboard, wandb, mlflow, ...); metrics.jsonl always."""
    export: bool = resume_field("free")
    """Export the final drafter in speculators format to `run_dir/drafter`."""

    def __post_init__(self) -> None:
        self.at_least(2, "tokens_per_micro_batch")  # a long sample's windows overlap by one token
        self.at_least(
            1,
            "epochs",
            "tokens_per_step",
            "tokens_per_micro_batch",
            "save_every",
            "keep_last",
            "log_every",
            "prefetch_steps",
            "max_nonfinite_steps",
        )
        self.at_least(0, "eval_every", "data_workers", "weight_decay")
        self.at_least(0, "copied_fc_lr_scale", nullable=True)
        self.at_least(1, "max_steps", "train_samples", nullable=True)
        self.positive("lr", "collective_timeout_s")
        self.positive("grad_clip", "copied_lr_ref_rms", nullable=True)
        self.one_of("resume", RESUME_MODES)
        self.one_of("mixed_precision", MIXED_PRECISION)
        self.one_of("draft_vocab_from", VOCAB_RANKINGS)
        if not 0 <= self.warmup_ratio < 1:
            self.refuse("warmup_ratio", "must be in [0, 1)")
        if not 0 <= self.min_lr_ratio <= 1:
            self.refuse("min_lr_ratio", "must be in [0, 1]")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            self.refuse("adam_betas", "must be [beta1, beta2], each in [0, 1)")
        if any(not isinstance(v, (int, float)) or v < 0 for v in (self.lr_scales or {}).values()):
            self.refuse("lr_scales", "must map parameter-name prefixes to multipliers >= 0")
        layers = self.init_layers_from_verifier
        if not (layers in (None, "auto") or isinstance(layers, list) and all(type(i) is int for i in layers)):
            self.refuse("init_layers_from_verifier", "must be auto, null or a list of layer ids")
        for key in ("init_fc_from_last_aux", "init_norm_from_verifier", "compile"):
            if getattr(self, key) not in (True, False, "auto"):
                self.refuse(key, "must be true, false or auto")


class TrainSections(NamedTuple):
    """The sections of a training config, each checked (`load_sections`)."""

    train: TrainConfig
    target: TargetConfig
    model: DraftConfig
    loss: LossConfig
    heldout: HeldoutConfig


def load_sections(full_cfg: DictConfig) -> TrainSections:
    """Every section of a training config, checked; a UserError on the first bad value. Reads and writes
    nothing, so a run refuses a bad config before it touches its run dir."""
    sections = TrainSections(
        train=load_section(TrainConfig, full_cfg, "train"),
        target=load_section(TargetConfig, full_cfg, "target"),
        model=load_section(DraftConfig, full_cfg, "model"),
        loss=load_section(LossConfig, full_cfg, "loss"),
        heldout=load_section(HeldoutConfig, full_cfg, "heldout"),
    )
    cfg = sections.train
    if cfg.eval_store is not None and cfg.eval_store == cfg.train_store:
        raise UserError(f"train.eval_store is train.train_store ({cfg.train_store}): evaluate on a held-out store")
    return sections


__all__ = ["MIXED_PRECISION", "RESUME_MODES", "VOCAB_RANKINGS", "TrainConfig", "TrainSections", "load_sections"]
