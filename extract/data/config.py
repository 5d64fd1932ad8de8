"""Schemas of the data stage's config sections (defaults live in conf/data.yaml, conf/data/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dspark.config import Checked
from dspark.errors import UserError
from dspark.extract.data.output import SPLITS

TOOL_CALL_MODES = ("keep", "regenerate")


@dataclass
class MixPart:
    """One source of a mix (`data=mix`): where it reads from and how much of the mix it makes."""

    source: str
    """`sharegpt`, `mtbench`, `gsm8k`, `humaneval`, `jsonl` or `hf`, as `data.source`."""
    path: str | None = None
    """As `data.path` for that source."""
    hf_name: str | None = None
    """hf: dataset configuration name."""
    hf_split: str = "train"
    """hf: split to read."""
    weight: float | None = None
    """Share of `data.max_samples` drawn from this source (weights are normalized over the mix)."""
    samples: int | None = None
    """Exact number of conversations drawn from this source (instead of a weight)."""
    split: str | None = None
    """`train` or `eval`: every conversation of this source goes to that split (null: the fingerprint
    split by `data.eval_fraction`), e.g. training prompts from one source, held-out ones from another."""

    def __post_init__(self) -> None:
        if self.split is not None and self.split not in SPLITS:
            raise UserError(f"data.sources: {self.source}: split={self.split!r}, expected one of {SPLITS} or null")
        if (self.weight is None) == (self.samples is None):
            raise UserError(f"data.sources: {self.source} {self.path or ''}: give exactly one of weight or samples")
        if self.weight is not None and not self.weight > 0:
            raise UserError(f"data.sources: {self.source}: weight={self.weight}, expected > 0")
        if self.samples is not None and self.samples < 1:
            raise UserError(f"data.sources: {self.source}: samples={self.samples}, expected >= 1")


@dataclass
class SourceConfig(Checked):
    """Where the prompts come from (the `data` group, shared by every pass)."""

    SECTION: ClassVar[str] = "data"

    source: str
    """`sharegpt` (embedded ShareGPT V3), `mtbench` / `gsm8k` / `humaneval` (embedded benchmarks' questions),
    `jsonl` (local file), `hf` (datasets id) or `mix` (several of these)."""
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
    sources: list[MixPart] | None = None
    """mix: the sources, deduplicated across by prompt fingerprint (null for a single source)."""

    def __post_init__(self) -> None:
        if (self.source == "mix") != bool(self.sources):
            raise UserError("data.sources: a list of sources is needed with data.source=mix, and only with it")
        self.at_least(1, "max_samples", "max_turns", nullable=True)
        if not 0 <= self.eval_fraction <= 1:
            self.refuse("eval_fraction", "must be in [0, 1]")


@dataclass
class RegenConfig(Checked):
    """Regeneration of the assistant turns by the target itself, through a vLLM server."""

    SECTION: ClassVar[str] = "regen"

    enabled: bool
    """false = keep the source's own assistant replies (no server)."""
    server_url: str | None
    """An already running vLLM server for the target (null = start one for this run)."""
    temperature: float
    """Sampling temperature."""
    top_p: float
    """Nucleus sampling threshold."""
    max_new_tokens: int
    """Longest reply per assistant turn (a reply is also cut where the context ends)."""
    tool_calls: str
    """`keep`: the source's tool-call turns stay as they are; `regenerate`: the target makes them too."""
    concurrency: int
    """Conversations in flight at once."""
    request_timeout_s: float
    """Timeout of one chat-completion request."""
    max_attempts: int
    """Runs that try a conversation whose request failed (e.g. HTTP 400) before it is left out for good."""

    def __post_init__(self) -> None:
        if self.tool_calls not in TOOL_CALL_MODES:
            raise UserError(f"regen.tool_calls={self.tool_calls!r}: expected one of {TOOL_CALL_MODES}")
        if self.max_new_tokens < 1:
            raise UserError(f"regen.max_new_tokens={self.max_new_tokens}: expected >= 1")
        self.at_least(0, "temperature")
        if not 0 < self.top_p <= 1:
            self.refuse("top_p", "must be in (0, 1]")
        self.at_least(1, "concurrency")
        self.positive("request_timeout_s")
        self.at_least(1, "max_attempts")


@dataclass
class TokenizeConfig(Checked):
    """Turning conversations into (input_ids, loss_mask) with the target's chat template."""

    SECTION: ClassVar[str] = "tokenize"

    max_length: int | None
    """Samples are truncated to this many tokens (null = target.max_model_len)."""
    min_loss_tokens: int
    """Samples with fewer loss-masked tokens (after truncation) are dropped."""

    def __post_init__(self) -> None:
        self.at_least(1, "max_length", nullable=True)
        self.at_least(0, "min_loss_tokens")
