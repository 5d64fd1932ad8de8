"""Config schemas, one dataclass per section, each refusing bad values when it is built.

The dataclasses carry types, one-line docstrings and range checks (`__post_init__`); every
default value lives in Hydra's `conf/` tree (the single source of defaults). A stage turns
a section of its composed config into its schema with `load_section`, so a misspelt key, a
wrong type or a value out of range fails at load time, before any work, with a
`UserError` naming `section.field`; so does any numeric value that is not finite (`nan`,
`inf`), in every section, nested dicts and lists included.

The schemas the training pass reads also say, per field, what a resume may do with it
(`resume_field` / `Checked.RESUME`, read by `resume_kinds`): `fixed` (the checkpoint's
weights or sample plan depend on it: never changed by a resume, nor by a warm start for
the verifier and the draft's architecture), `changes` (the objective, the schedule and the
held-out metric: changed only with `train.allow_resume_changes`, and then the resumed run
follows the new value) and `free` (operational: a resume uses the new value).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dspark.errors import UserError

MARKOV_TYPES = ("vanilla", "gated", "rnn")
ATTN_IMPLS = ("sdpa", "flex")
ANCHOR_SAMPLING = ("uniform", "all")
DTYPES = ("auto", "float32", "bfloat16", "float16")
RESUME_KINDS = ("fixed", "changes", "free")


def resume_field(kind: str, **kwargs: Any) -> Any:
    """A schema field whose resume kind (one of `RESUME_KINDS`) differs from its class's `RESUME`."""
    assert kind in RESUME_KINDS, kind
    return dataclasses.field(metadata={"resume": kind}, **kwargs)


class Checked:
    """Base of the schemas: helpers that refuse a field's value with `SECTION.field` in the message."""

    SECTION: ClassVar[str] = ""
    """Where the schema lives in the composed config (`train`, `eval.offline`, ...)."""
    RESUME: ClassVar[str | None] = None
    """Resume kind of the fields without their own `resume_field` (None: each field must say)."""

    def refuse(self, field: str, requirement: str) -> None:
        raise UserError(f"{self.SECTION}.{field} {requirement}, got {getattr(self, field)!r}")

    def at_least(self, minimum: float, *fields: str, nullable: bool = False) -> None:
        """Each field >= minimum (None allowed when `nullable`)."""
        for field in fields:
            value = getattr(self, field)
            if value is None and nullable:
                continue
            if value is None or value < minimum:
                self.refuse(field, f"must be {'null or ' if nullable else ''}>= {minimum}")

    def positive(self, *fields: str, nullable: bool = False) -> None:
        """Each field > 0 (None allowed when `nullable`)."""
        for field in fields:
            value = getattr(self, field)
            if not ((value is None and nullable) or (value is not None and value > 0)):
                self.refuse(field, f"must be {'null or ' if nullable else ''}> 0")

    def one_of(self, field: str, choices: tuple[str, ...]) -> None:
        if getattr(self, field) not in choices:
            self.refuse(field, f"must be one of {list(choices)}")


@dataclass
class TargetConfig(Checked):
    """The verifier: shared by every pass so layer ids and paths cannot drift.

    Null fields are derived from the verifier itself (`dspark.targets.resolve_target`;
    `target=auto` leaves them all null).
    """

    SECTION: ClassVar[str] = "target"
    RESUME: ClassVar[str] = "fixed"

    name: str = resume_field("free")
    """Short name used in run directories and reports (`target=auto`: the last part of `name_or_path`)."""
    name_or_path: str
    """HF hub id, local HF directory, or `embedded:smollm2` for the PyPI-shipped default."""
    revision: str | None
    """Hub revision to pin (ignored for local directories)."""
    preset_for: str | None
    """The verifier a preset's fixed values were chosen for (null in `target=auto`); with another
    `name_or_path` every pass warns that they are kept."""
    aux_layer_ids: list[int] | None
    """Aux layer ids in vLLM's convention (id k = residual entering layer k); null = the paper's spacing."""
    mask_token_id: int | None
    """Embedding row used as the draft mask token; null = the first row past the tokenizer, else its pad token."""
    chat_template_kwargs: dict[str, Any] | None
    """Extra kwargs for `apply_chat_template` (e.g. `enable_thinking: false`); null = derived from the template."""
    dtype: str | None
    """dtype the verifier runs in on the server; null = float32 without CUDA, else the config's dtype."""
    max_model_len: int | None
    """Context length given to the vLLM server (also the longest sample kept); null = the config's."""

    def __post_init__(self) -> None:
        if not isinstance(self.name_or_path, str) or not self.name_or_path.strip():
            self.refuse("name_or_path", "must name the verifier (a local HF dir, a hub id or embedded:smollm2)")
        if not self.name or "/" in self.name:
            self.refuse("name", "must be a non-empty name without `/` (it names the run directories)")
        self.positive("max_model_len", nullable=True)
        if self.dtype is not None:
            self.one_of("dtype", DTYPES)


def default_target_name(name_or_path: str) -> str:
    """`Qwen/Qwen3-0.6B` -> `qwen3-0.6b`, `/models/llama/` -> `llama`, `embedded:smollm2` -> `smollm2`."""
    return str(name_or_path).rstrip("/").replace(":", "/").rsplit("/", 1)[-1].lower()


# `conf/target/auto.yaml` names its runs after the verifier: `${dspark.target_name:${target.name_or_path}}`.
OmegaConf.register_new_resolver("dspark.target_name", default_target_name, replace=True)


@dataclass
class DraftConfig(Checked):
    """Architecture of the DSpark draft model (sized from the verifier's HF config)."""

    SECTION: ClassVar[str] = "model"
    RESUME: ClassVar[str] = "fixed"

    num_layers: int
    """Number of Qwen3 decoder layers in the draft."""
    block_size: int
    """Tokens drafted per block (slots); slot k predicts token p+k+1 for anchor p."""
    draft_vocab_size: int | None
    """Reduced draft vocabulary size; null = the verifier's full vocabulary."""
    markov_rank: int
    """Rank r of the Markov logit bias W2(W1[prev]); 0 disables the head."""
    markov_type: str
    """Markov head variant: `vanilla` (served by vLLM), `gated` or `rnn`."""
    confidence_head: bool
    """Attach the per-slot acceptance-probability head."""
    confidence_head_with_markov: bool
    """Feed the Markov previous-token embedding to the confidence head too."""
    sliding_window: int | None
    """null = full attention over the context; an int = context keys >= anchor - window."""
    causal_in_block: bool
    """Causal attention inside a block (default false: bidirectional, as in the paper)."""
    attn_impl: str = resume_field("free")
    """`sdpa` (everywhere) or `flex` (CUDA only, tested equal to sdpa)."""
    markov_embed_proj: bool
    """Training only: W1[prev] gets + E[prev]·P (E the verifier's embedding, P trainable), folded into W1 at export."""

    def __post_init__(self) -> None:
        self.at_least(1, "block_size", "num_layers")
        self.at_least(1, "draft_vocab_size", "sliding_window", nullable=True)
        if self.markov_rank < 0:
            self.refuse("markov_rank", "must be >= 0 (0 disables the head)")
        self.one_of("markov_type", MARKOV_TYPES)
        if self.confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            self.refuse("confidence_head_with_markov", "needs the Markov head (model.markov_rank > 0)")
        self.one_of("attn_impl", ATTN_IMPLS)
        if self.markov_embed_proj and self.markov_rank == 0:
            self.refuse("markov_embed_proj", "needs the Markov head (model.markov_rank > 0)")


@dataclass
class LossConfig(Checked):
    """Training objective."""

    SECTION: ClassVar[str] = "loss"
    RESUME: ClassVar[str] = "changes"

    weights: dict[str, float]
    """Weights of the distribution terms `ce`, `tv` (= ½‖q−p‖₁) and `kl`; a term at 0 is not computed."""
    confidence_weight: float
    """Weight of the confidence-head BCE."""
    gamma: float
    """Position weights w_k = exp(-k/gamma)."""
    num_anchors: int
    """Anchors sampled per sequence (uniformly, without replacement, every step)."""
    chunk_size: int = resume_field("free")
    """Slots per chunk of the vocabulary-sized loss computation (bounds peak memory)."""
    anchor_sampling: str
    """Training anchors: `uniform` (`num_anchors` of them) or `all` candidates."""
    hidden_weight: float
    """Weight of the `hidden` term: the draft's final hidden state (after its norm) against the verifier's."""
    hidden_slots: int | None
    """Leading slots of each block the `hidden` term scores (null = all); later slots' targets depend on tokens the draft does not see."""
    train_on_prompt: bool
    """Training only: anchors and scored slots on every token (the prompts' too: their targets are the verifier's distributions there), not only the replies'."""

    def __post_init__(self) -> None:
        # Imported here: the schemas load without torch, and only a training config has a loss.
        from dspark.vocab_terms import term_weights

        try:
            term_weights(self.weights)
        except ValueError as err:
            raise UserError(f"loss.weights: {err}") from None
        if any(w < 0 for w in self.weights.values()):
            self.refuse("weights", "must be >= 0 for every term")
        # A Hydra override of a dict merges into the default (`loss.weights={kl: 1.0}` keeps the
        # others), so a term is switched off by weight 0; it is then left out, not computed
        # (with none left, dspark_loss trains the confidence head alone or refuses).
        self.weights = {t: float(w) for t, w in self.weights.items() if w > 0}
        self.at_least(0, "confidence_weight")
        self.positive("gamma")
        self.at_least(1, "num_anchors", "chunk_size")
        self.one_of("anchor_sampling", ANCHOR_SAMPLING)
        self.at_least(0, "hidden_weight")
        self.at_least(1, "hidden_slots", nullable=True)


@dataclass
class HeldoutConfig(Checked):
    """The held-out scoring protocol (`conf/heldout/`), one for the trainer's evaluation, `make eval`
    and `make ablate`: on the same store, the same samples and anchors, hence the same τ."""

    SECTION: ClassVar[str] = "heldout"
    RESUME: ClassVar[str] = "changes"

    max_samples: int | None
    """Score at most this many held-out samples, lowest sample ids first (null = all)."""
    anchors_per_sample: int | None
    """Anchors per sample, drawn uniformly without replacement from its anchor candidates (p and p+1
    in the loss mask) by a generator seeded with (`seed`, sample id); null = every candidate."""
    anchors_per_forward: int = resume_field("free")
    """Blocks per draft forward pass: bounds memory (~ blocks × block_size × vocabulary floats), not the figures."""
    seed: int
    """Seed of the anchor draw (and of `make eval`'s calibration split into fit and scored samples)."""

    def __post_init__(self) -> None:
        self.at_least(1, "max_samples", "anchors_per_sample", nullable=True)
        self.at_least(1, "anchors_per_forward")
        self.at_least(0, "seed")  # a SeedSequence entropy


def resume_kinds(cls: type[Checked]) -> dict[str, str]:
    """What a resume may do with each field of a schema: field name -> one of `RESUME_KINDS`."""
    kinds = {f.name: f.metadata.get("resume", cls.RESUME) for f in dataclasses.fields(cls)}
    undeclared = sorted(name for name, kind in kinds.items() if kind not in RESUME_KINDS)
    if undeclared:
        raise TypeError(f"{cls.__name__}: no resume kind for {undeclared} (use resume_field or {cls.__name__}.RESUME)")
    return kinds


def non_finite(value: Any, key: str) -> tuple[str, float] | None:
    """The first (`key.sub` / `key[i]`, value) inside `value` that is a non-finite number, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return key, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for sub, inner in items:
        found = non_finite(inner, f"{key}[{sub}]" if isinstance(value, list) else f"{key}.{sub}")
        if found:
            return found
    return None


T_cfg = TypeVar("T_cfg")


def to_dataclass(cls: type[T_cfg], cfg: DictConfig | dict, section: str | None = None) -> T_cfg:
    """Validate `cfg` against the dataclass schema `cls` and return an instance.

    Unknown keys, missing keys, wrong types and values the schema's checks refuse raise a
    `UserError` naming the field (prefixed with `section`, default the schema's own).
    """
    section = section or getattr(cls, "SECTION", "") or cls.__name__
    try:
        if isinstance(cfg, DictConfig):
            _refuse_missing(section, cfg)
            # A section taken out of the tree can no longer see `${paths.*}` or `${target.*}`:
            # resolve its interpolations (against the whole tree) before validating it alone.
            cfg = OmegaConf.to_container(cfg, resolve=True)
        merged = OmegaConf.merge(OmegaConf.structured(cls), cfg)
        _refuse_missing(section, merged)
        # Before the schema's own checks: `nan < 0` is false, so a range check lets nan through.
        found = non_finite(OmegaConf.to_container(merged, resolve=True), section)
        if found:
            raise UserError(f"{found[0]} must be a finite number, got {found[1]}")
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        detail = str(err).splitlines()[0]
        key = str(getattr(err, "full_key", None) or "")
        if key and key != section and not key.startswith(f"{section}."):
            key = f"{section}.{key}"  # the key of a plain dict is relative to the section
        raise UserError(f"{key or section}: {detail}") from err


def _missing_keys(cfg: DictConfig) -> list[str]:
    """Keys left `???`, without resolving interpolations (one may point at a missing key)."""
    missing = []
    for key in cfg:
        if OmegaConf.is_missing(cfg, key):
            missing.append(str(key))
        elif not OmegaConf.is_interpolation(cfg, key) and isinstance(cfg[key], DictConfig):
            missing += [f"{key}.{sub}" for sub in _missing_keys(cfg[key])]
    return missing


def _refuse_missing(section: str, cfg: DictConfig) -> None:
    missing = _missing_keys(cfg)
    if missing:
        raise UserError(
            f"{section}: no value for {', '.join(f'{section}.{k}' for k in missing)} "
            f"(set it on the command line, e.g. {section}.{missing[0]}=...)"
        )


def load_section(cls: type[T_cfg], cfg: DictConfig, name: str) -> T_cfg:
    """`cfg[name]` of a composed stage config as a checked `cls` (the one way every stage reads a section)."""
    if name not in cfg:
        raise UserError(f"the config has no `{name}` section")
    return to_dataclass(cls, cfg[name], name)


__all__ = [
    "ATTN_IMPLS",
    "DTYPES",
    "MARKOV_TYPES",
    "RESUME_KINDS",
    "Checked",
    "DraftConfig",
    "HeldoutConfig",
    "LossConfig",
    "TargetConfig",
    "default_target_name",
    "load_section",
    "resume_field",
    "resume_kinds",
    "to_dataclass",
]
