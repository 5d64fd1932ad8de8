"""Config schemas, one dataclass per section.

The dataclasses carry types and one-line docstrings only; every default value lives in
Hydra's `conf/` tree (the single source of defaults). Stages merge the YAML into these
schemas with `to_dataclass`, so a misspelt key or a wrong type fails before any work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

@dataclass
class TargetConfig:
    """The verifier: shared by every pass so layer ids and paths cannot drift."""

    name: str
    """Short name used in run directories and reports."""
    name_or_path: str
    """HF hub id, local HF directory, or `embedded:smollm2` for the PyPI-shipped default."""
    revision: str | None
    """Hub revision to pin (ignored for local directories)."""
    aux_layer_ids: list[int] | None
    """Aux layer ids in vLLM's convention (id k = residual entering layer k); null = evenly spaced."""
    mask_token_id: int | None
    """Unused embedding row used as the draft mask token; null = first id past the tokenizer."""
    chat_template_kwargs: dict[str, Any]
    """Extra kwargs for `apply_chat_template` (e.g. `enable_thinking: false` for Qwen3)."""
    dtype: str
    """dtype the verifier runs in on the server (`float32` is fastest on CPU, `bfloat16` on GPU)."""
    max_model_len: int
    """Context length given to the vLLM server (also the longest sample kept)."""


@dataclass
class DraftConfig:
    """Architecture of the DSpark draft model (sized from the verifier's HF config)."""

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
    attn_impl: str
    """`sdpa` (everywhere) or `flex` (CUDA only, tested equal to sdpa)."""


@dataclass
class LossConfig:
    """Training objective."""

    weights: dict[str, float]
    """Weights of the distribution terms: `ce`, `tv` (= ½‖q−p‖₁) and `kl`."""
    ce_target: str
    """CE label: `data` (the data token) or `argmax` (the verifier's argmax)."""
    confidence_weight: float
    """Weight of the confidence-head BCE."""
    gamma: float
    """Position weights w_k = exp(-k/gamma)."""
    num_anchors: int
    """Anchors sampled per sequence (uniformly, without replacement, every step)."""
    chunk_size: int
    """Slots per chunk of the vocabulary-sized loss computation (bounds peak memory)."""
    anchor_sampling: str
    """Training anchors: `uniform`, `confident` (∝ the verifier's top probability) or `all` candidates."""
    anchor_pool: int | None
    """`confident`: candidates scored per sequence (a uniform pool; bounds the head's cost); null = all."""


T_cfg = TypeVar("T_cfg")


def to_dataclass(cls: type[T_cfg], cfg: DictConfig | dict) -> T_cfg:
    """Validate `cfg` against the dataclass schema `cls` and return an instance.

    Unknown keys, missing keys and wrong types raise an error naming the field.
    """
    if isinstance(cfg, DictConfig):
        # A section taken out of the tree can no longer see `${paths.*}` or `${target.*}`:
        # resolve its interpolations (against the whole tree) before validating it alone.
        cfg = OmegaConf.to_container(cfg, resolve=True)
    schema = OmegaConf.structured(cls)
    merged = OmegaConf.merge(schema, cfg)
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ValueError(f"{cls.__name__}: missing config keys {missing}")
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


__all__ = ["TargetConfig", "DraftConfig", "LossConfig", "to_dataclass"]
