"""Schemas of `conf/eval.yaml` and `conf/prune.yaml` (types and meaning; defaults live in the YAML)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any, ClassVar

from dspark.config import DTYPES, Checked

DEVICES = ("auto", "cpu", "cuda")


@dataclass
class OfflineConfig(Checked):
    """Acceptance on the held-out store, computed from stored verifier states (no server); which
    samples and anchors are scored is the shared `heldout` protocol (`dspark.config.HeldoutConfig`)."""

    SECTION: ClassVar[str] = "eval.offline"

    enabled: bool
    """Run the offline evaluation."""
    length_buckets: list[int]
    """Edges of the sequence-length buckets (tokens per sample)."""
    position_buckets: list[int]
    """Edges of the anchor-position buckets (context tokens before the block)."""
    device: str
    """`auto` (cuda when present), `cpu` or `cuda`."""

    def __post_init__(self) -> None:
        self.one_of("device", DEVICES)
        for field in ("length_buckets", "position_buckets"):
            edges = getattr(self, field)
            if not edges or any(a >= b for a, b in pairwise(edges)):
                self.refuse(field, "must be a non-empty ascending list")


@dataclass
class CalibrationConfig(Checked):
    """Confidence-head quality and per-position sequential temperature scaling (STS)."""

    SECTION: ClassVar[str] = "eval.calibration"

    enabled: bool
    """Score the confidence head (drafts without one skip this)."""
    fit_fraction: float
    """Share of held-out samples the temperatures are fitted on; scores are reported on the rest."""
    n_bins: int
    """Equal-width bins of the ECE and the reliability curves."""
    t_min: float
    """Smallest temperature searched."""
    t_max: float
    """Largest temperature searched."""
    max_tau_loss: float
    """The verification budget's bound: the drafts a schedule spares the verifier are counted at the
    setting that keeps τ within this relative loss of verifying every slot (`calibration.verification_budget`)."""
    save: bool
    """Fold the served map (one slope and intercept for every position, `calibration.fit_served_scaling`)
    into the drafter's confidence head, the one vLLM serves, and write it with the fitted temperatures to
    `<drafter>/calibration.json`; false leaves the drafter as it is."""
    refit: bool
    """Refit the served head on the fit half, around its own logit: a ridge-penalized linear correction
    on the features the head reads, its strength (or none) cross-validated over the fit half's
    conversations (`calibration.refit_served_head`); false fits the slope and intercept only."""

    def __post_init__(self) -> None:
        if not 0 < self.fit_fraction < 1:
            self.refuse("fit_fraction", "must be in (0, 1)")
        self.at_least(1, "n_bins")
        self.positive("t_min")
        if self.t_max <= self.t_min:
            self.refuse("t_max", f"must be > eval.calibration.t_min ({self.t_min})")
        if not 0 <= self.max_tau_loss < 1:
            self.refuse("max_tau_loss", "must be in [0, 1)")


@dataclass
class OnlineConfig(Checked):
    """Served speed: the verifier in vLLM with and without the drafter, greedy, concurrency 1."""

    SECTION: ClassVar[str] = "eval.online"

    enabled: bool
    """Run the online benchmark (starts vLLM servers)."""
    prompts_file: str | None
    """jsonl with `input_ids` (token ids) or `prompt` (text) per row; null = prompts of the held-out data."""
    num_prompts: int
    """Prompts sent (the first ones, in file / sample-id order)."""
    max_tokens: int
    """Tokens generated per prompt (min_tokens = max_tokens, ignore_eos: every run decodes the same count)."""
    warmup_requests: int
    """Requests sent before measuring (compilation, caches)."""
    methods: list[str]
    """Speculative methods benchmarked against the baseline: `dspark` (the drafter), or model-free
    references such as `ngram` (prompt lookup)."""
    num_speculative_tokens: list[int] | None
    """Values swept (one server per method and value); null = the drafter's block size."""
    adaptive: bool
    """Also run DSpark with `enable_adaptive_verification` (uses the confidence head)."""
    method_config: dict[str, dict[str, Any]]
    """Extra `--speculative-config` keys per method (e.g. `ngram: {prompt_lookup_max: 4}`)."""
    require_cuda_for_draft: bool
    """Skip the DSpark runs without CUDA (vLLM serves DSpark only on its GPU runner)."""
    max_model_len: int | None
    """Context length given to the servers; null = the target's (derived when the target leaves it null)."""
    dtype: str | None
    """dtype the servers run the verifier in; null = the target's."""
    request_timeout_s: float
    """Timeout of one completion request."""

    def __post_init__(self) -> None:
        self.at_least(1, "num_prompts", "max_tokens")
        self.at_least(0, "warmup_requests")
        self.at_least(1, "max_model_len", nullable=True)
        if self.dtype is not None:
            self.one_of("dtype", DTYPES)
        if self.num_speculative_tokens is not None and (
            not self.num_speculative_tokens or min(self.num_speculative_tokens) < 1
        ):
            self.refuse("num_speculative_tokens", "must be null or a non-empty list of values >= 1")
        self.positive("request_timeout_s")


@dataclass
class DecodeConfig(Checked):
    """Speculative decoding with the exported drafter on transformers (eval.decode): served-style
    acceptance on any machine, greedy outputs checked against the verifier's own."""

    SECTION: ClassVar[str] = "eval.decode"

    enabled: bool
    """Run the decode step in `python -m eval` (`python -m eval.decode` always runs it)."""
    prompts_file: str | None
    """jsonl of prompts (`input_ids`, `prompt` text, or tokenized samples; a `source` names the
    benchmark); null = the standard eval sets of `data=benchmarks` when made, else the held-out data."""
    prompts_per_benchmark: int
    """Prompts decoded per benchmark (prompt set), the first ones in file order."""
    max_new_tokens: int
    """Tokens generated per prompt (EOS does not stop: every run decodes the same count)."""
    temperatures: list[float]
    """Sampling temperatures; 0 = greedy (checked token for token against the verifier's greedy decoding)."""
    adaptive: bool
    """Also run with adaptive verification (drafters with a confidence head)."""
    offline_tau: bool
    """Also score the drafter's offline τ on verifier answers to the same prompts sampled at temperature 1."""
    batch_size: int
    """Prompts decoded together."""
    profile_replays: int
    """Timed replays per forward shape for the adaptive-verification cost model (vLLM profiles too)."""
    step_costs: dict[str, Any] | None
    """Adaptive verification's step costs: null = profiled on this machine, as vLLM profiles them;
    or `{draft_ms: x, verify_ms: [v1, ..., v_B+1]}` (ms of one draft step and of a verifier forward
    of 1..B+1 tokens), e.g. the serving GPU's, to see on any machine what its rule does there."""
    seed: int
    """Seed of the sampling runs and of the comparison answers."""
    device: str
    """`auto` (cuda when present), `cpu` or `cuda`; the verifier runs in float32."""

    def __post_init__(self) -> None:
        self.at_least(1, "prompts_per_benchmark", "max_new_tokens", "batch_size", "profile_replays")
        self.one_of("device", DEVICES)
        temps = self.temperatures
        if not temps or any(not isinstance(t, int | float) or t < 0 for t in temps) or len(set(temps)) < len(temps):
            self.refuse("temperatures", "must be a non-empty list of distinct values >= 0")
        if self.step_costs is not None:
            costs = dict(self.step_costs)
            draft, verify = costs.pop("draft_ms", None), costs.pop("verify_ms", None)
            if (
                costs
                or not isinstance(draft, int | float)
                or draft < 0
                or not isinstance(verify, list | tuple)
                or len(verify) < 2
                or any(not isinstance(v, int | float) or v <= 0 for v in verify)
            ):
                self.refuse(
                    "step_costs",
                    "must be null or {draft_ms: >= 0, verify_ms: [ms of verifying 1, 2, ..., B+1 tokens, each > 0]}",
                )


@dataclass
class EvalConfig(Checked):
    """The evaluation stage: offline acceptance, calibration, online speed, report and model card."""

    SECTION: ClassVar[str] = "eval"

    store: str
    """Shard store of the held-out split."""
    data_dir: str
    """Tokenized dataset dir (sources of held-out samples, prompts, summary.json); may be absent."""
    bench_store: str | None
    """Store of the standard eval sets (`data=benchmarks`): τ per benchmark when it exists; null = skip."""
    bench_data_dir: str
    """Their tokenized dataset dir (the benchmark of each sample)."""
    out_dir: str
    """Where report.json and the plots go."""
    train_run_dir: str | None
    """Training run dir (metrics.jsonl, config); null = the drafter's parent directory."""
    write_card: bool
    """Write README.md (model card) into the drafter dir."""
    offline: OfflineConfig
    calibration: CalibrationConfig
    online: OnlineConfig
    decode: DecodeConfig


@dataclass
class PruneConfig(Checked):
    """Post-hoc pruning of a drafter's vocabulary to the tokens the verifier emits."""

    SECTION: ClassVar[str] = "prune"

    out: str
    """Directory of the pruned drafter."""
    counts: str
    """Token counts: a `.npy` int64 [V], a tokenized `.jsonl` (input_ids, loss_mask) or a shard store."""
    draft_vocab_size: int | None
    """Tokens kept (most frequent first); null = every token seen at least `min_count` times."""
    min_count: int
    """With `draft_vocab_size: null`, the fewest occurrences for a token to be kept."""
    evaluate: bool
    """Measure τ of the original and the pruned drafter on the held-out store (the `heldout` protocol)."""

    def __post_init__(self) -> None:
        self.at_least(1, "draft_vocab_size", nullable=True)
        self.at_least(1, "min_count")


__all__ = ["CalibrationConfig", "DecodeConfig", "EvalConfig", "OfflineConfig", "OnlineConfig", "PruneConfig"]
