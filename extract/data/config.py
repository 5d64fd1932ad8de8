"""Schemas of the data stage's config sections (defaults live in conf/data.yaml, conf/data/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SourceConfig:
    """Where the prompts come from (the `data` group, shared by every pass)."""

    source: str
    """`sharegpt` (embedded ShareGPT V3), `mtbench` (embedded MT-Bench), `jsonl` (local file) or `hf` (datasets id)."""
    path: str | None
    """jsonl: file; hf: dataset id or local dataset dir; sharegpt: another ShareGPT .json array (null = embedded)."""
    hf_name: str | None
    """hf: dataset configuration name."""
    hf_split: str
    """hf: split to read."""
    max_samples: int | None
    """Conversations drawn from the usable rows (null = all)."""
    seed: int
    """Seed of the random draw of `max_samples` conversations."""
    max_turns: int | None
    """User turns kept per conversation (null = all)."""
    eval_fraction: float
    """Share of distinct prompts held out for evaluation (1.0 = an evaluation-only set)."""


@dataclass
class RegenConfig:
    """Regeneration of the assistant turns by the target itself, through a vLLM server."""

    enabled: bool
    """false = keep the source's own assistant replies (no server)."""
    server_url: str | None
    """An already running vLLM server for the target (null = start one for this run)."""
    temperature: float
    """Sampling temperature."""
    top_p: float
    """Nucleus sampling threshold."""
    max_new_tokens: int
    """Longest reply per assistant turn."""
    concurrency: int
    """Conversations in flight at once."""
    request_timeout_s: float
    """Timeout of one chat-completion request."""


@dataclass
class TokenizeConfig:
    """Turning conversations into (input_ids, loss_mask) with the target's chat template."""

    max_length: int | None
    """Samples are truncated to this many tokens (null = target.max_model_len)."""
    min_loss_tokens: int
    """Samples with fewer loss-masked tokens (after truncation) are dropped."""
