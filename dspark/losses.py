"""The DSpark training objective, computed chunk by chunk over blocks.

Notation, per scored slot k of a block: q_k = the draft's (Markov-corrected) softmax over
the draft vocabulary D; p_k = the verifier's full-vocabulary softmax at temperature 1 at
position p+k; m_k = Σ_{v∈D} p_k[v] (1 with the full vocabulary). Terms:

- `ce`: −log q_k[y], y = the data token p+k+1. A y outside a reduced D has no draft logit: the slot is left out
  of CE (still counted in the normalizer) and reported in `LossOutput.ce_out_of_vocab`.
- `tv`: ½‖q_k − p_k‖₁ over the FULL vocabulary with q_k = 0 outside D, which equals
  1 − α_k, α_k = Σ_{v∈D} min(q_k, p_k). Target mass outside D counts as distance the draft
  can never close, exactly as it counts as rejection at serving time.
- `kl`: KL(p‖q) is infinite when m_k < 1 (q is 0 where p is not). The term used is its
  finite part m_k·KL(p̂_k‖q_k) = Σ_{v∈D} p log(p/q) − m_k log m_k, p̂_k = p_k restricted to
  D and renormalized: it has the gradient of the soft cross-entropy −Σ_{v∈D} p log q, is
  ≥ 0, is 0 at the best reachable q, and is exactly KL(p‖q) with the full vocabulary. This
  renormalization shapes the training signal only; acceptance figures never renormalize.
- `hidden` (`loss.hidden_weight`): ‖h_k − h̄_k‖² / ‖h̄_k‖², h_k the draft's final hidden state
  after its norm (what its lm_head reads) and h̄_k the verifier's after its final norm at p+k
  (what the verifier's lm_head reads to give p_k): a dense target of the whole state p_k comes from.
- `confidence`: BCE between the confidence head's logit and α_k (detached), the analytic
  acceptance of the Markov-corrected q_k against the honest full-vocabulary target.

Each term is Σ_slots w_k·term / norm with w_k = exp(−k/γ) and norm = the sum of w_k over
scored slots of the whole data-parallel batch (`weight_sum`, all-reduced by the trainer),
so every rank's gradient has the same scale. loss = Σ_t weights[t]·term_t +
confidence_weight·confidence + hidden_weight·hidden. `TERMS` registers the terms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dspark.config import LossConfig
from dspark.metrics import AcceptanceStats, check_draft_width, draft_target_ids
from dspark.vocab_terms import VOCAB_TERMS, VocabTerms, term_weights, wide
from dspark.workspace import Workspace


@dataclass
class LossOutput:
    """Result of `dspark_loss`; everything but `loss` is detached."""

    loss: Tensor
    """Scalar to backpropagate."""
    terms: dict[str, Tensor]
    """Each computed term, normalized but not multiplied by its weight (names: `term_names`)."""
    acceptance: AcceptanceStats
    """Per-position acceptance sums and counts of this batch (local to this rank)."""
    alpha: Tensor
    """Per-slot analytic acceptance α `[n, B]` (0 on unscored slots)."""
    confidence: Tensor | None
    """Per-slot confidence-head probability `[n, B]`, or None without a confidence head."""
    ce_out_of_vocab: Tensor
    """Scored slots whose CE target lies outside the draft vocabulary (left out of CE)."""


def position_weights(
    block_size: int, gamma: float, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """w_k = exp(−k/γ) for k = 0..B−1 (slot 0 is the anchor's own prediction)."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float64, device=device) / gamma).to(dtype)


def weight_sum(slot_mask: Tensor, gamma: float) -> Tensor:
    """Σ w_k over the scored slots of `slot_mask [..., B]` (float64): this rank's share of the normalizer."""
    w = position_weights(slot_mask.shape[-1], gamma, slot_mask.device, torch.float64)
    return (slot_mask.to(w.dtype) * w).sum()


def hidden_match_sum(hidden: Tensor, target: Tensor, slot_mask: Tensor, gamma: float) -> Tensor:
    """Σ over scored slots of w_k·‖h − h̄‖² / ‖h̄‖²: hidden [n, B, H] the draft's normed final
    states, target [n, B, H] the verifier's (a constant), slot_mask [n, B]."""
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    h, t = hidden.to(dtype), target.detach().to(dtype)
    err = (h - t).pow(2).sum(-1) / t.pow(2).sum(-1).clamp_min(1e-12)
    w = slot_mask.to(dtype) * position_weights(slot_mask.shape[-1], gamma, hidden.device, dtype)
    return (err * w).sum()


def keep_budget_bytes(device: torch.device) -> int:
    """Memory the loss may keep from forward to backward: a quarter of what is free on `device` now."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 4
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // 4
    except OSError:
        pass
    return 1 << 30


@dataclass
class LossInputs:
    """What the loss terms read, for n blocks of B slots of one rank's batch."""

    heads_fn: Callable[..., tuple[Tensor, Tensor | None]]
    """`(hidden [c, B, H], prev [c, B]) -> (logits [c, B, Vd], confidence [c, B] | None)`: the
    Markov-corrected draft logits and, with `with_confidence`, the confidence head's logits."""
    target_logits_fn: Callable[..., Tensor]
    """`(target_hidden [c, B, Ht]) -> [c, B, V]`: the verifier's logits."""
    hidden: Tensor  # [n, B, H] the draft's final states after its norm
    prev: Tensor  # [n, B] the token at p+k
    target_hidden: Tensor  # [n, B, Ht] the verifier's pre-norm final state at p+k
    labels: Tensor  # [n, B] the data token p+k+1
    slot_mask: Tensor  # [n, B] scored slots
    norm: Tensor | float | None = None
    """The all-reduced `weight_sum` (None: this batch's own, for a single process)."""
    with_confidence: bool = False
    """`heads_fn` returns confidence logits (the `confidence` term trains them against α)."""
    d2t: Tensor | None = None  # [Vd] draft->target id offsets; None: the full vocabulary
    target_norm_fn: Callable[[Tensor], Tensor] | None = None
    """`(target_hidden [n, B, Ht]) -> [n, B, Ht]`: the verifier's final norm (read by `hidden`)."""

    BLOCK_FIELDS: ClassVar[tuple[str, ...]] = ("hidden", "prev", "target_hidden", "labels", "slot_mask")
    """The per-block tensors, split into chunks along their first dimension."""

    def blocks(self) -> tuple[Tensor, ...]:
        """The `BLOCK_FIELDS` tensors."""
        return tuple(getattr(self, name) for name in self.BLOCK_FIELDS)

    def with_blocks(self, *blocks: Tensor) -> LossInputs:
        """These inputs with other `BLOCK_FIELDS` tensors (e.g. one chunk's)."""
        return dataclasses.replace(self, **dict(zip(self.BLOCK_FIELDS, blocks, strict=True)))


@dataclass
class VocabPass:
    """One chunk's vocabulary pass (both projections, `VocabTerms`): what its chunk terms read."""

    slot_weight: Tensor  # [c, B] w_k on scored slots, 0 elsewhere
    objective: Tensor  # scalar Σ_t loss.weights[t]·sums[t], differentiable in the draft logits
    sums: Tensor  # [len(VOCAB_TERMS)] Σ w_k·term of each vocabulary term
    alpha: Tensor  # [c, B] analytic acceptance
    confidence_logit: Tensor | None  # [c, B] the confidence head's logits
    out_of_vocab: Tensor  # scalar: scored slots whose CE label is not a draft id


TermFn = Callable[[LossInputs, VocabPass | None, LossConfig], tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class Term:
    """A loss term: loss += weight(cfg)·objective / norm, and each metric sum / norm is reported."""

    weight: Callable[[LossConfig], float]
    """Its weight in the loss; a term at 0 is not computed."""
    compute: TermFn
    """`(inputs, shared, cfg) -> (objective, metrics)`, each a sum over slots of w_k·term."""
    per_chunk: bool = False
    """Computed in each chunk from its `VocabPass` (`shared`) and added up, else once (`shared` None)."""
    needs_confidence: bool = False
    """Computed only with `LossInputs.with_confidence`."""
    metrics: Callable[[LossConfig], tuple[str, ...]] | None = None
    """Names of its metrics (None: the term's own name)."""


def _vocab_metrics(cfg: LossConfig) -> tuple[str, ...]:
    """The vocabulary terms `loss.weights` gives a weight > 0."""
    return tuple(t for t in VOCAB_TERMS if t in cfg.weights)


def _vocab(inputs: LossInputs, shared: VocabPass, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """The vocabulary terms with a weight (their weights are inside `shared.objective`)."""
    return shared.objective, {t: shared.sums[VOCAB_TERMS.index(t)] for t in _vocab_metrics(cfg)}


def _confidence(inputs: LossInputs, shared: VocabPass, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """BCE of the confidence head's logit against α (a constant)."""
    logit = shared.confidence_logit.to(shared.alpha.dtype)
    bce = F.binary_cross_entropy_with_logits(logit, shared.alpha, reduction="none")
    bce_sum = (bce * shared.slot_weight).sum()
    return bce_sum, {"confidence": bce_sum}


def _hidden(inputs: LossInputs, shared: None, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """The draft's normed final state against the verifier's, on each block's leading `loss.hidden_slots`."""
    if inputs.target_norm_fn is None:
        raise ValueError("loss.hidden_weight > 0 needs target_norm_fn (the verifier's final norm)")
    with torch.no_grad():
        target = inputs.target_norm_fn(inputs.target_hidden)
    block_size = inputs.slot_mask.shape[-1]
    first = torch.arange(block_size, device=inputs.slot_mask.device) < (cfg.hidden_slots or block_size)
    scored = inputs.slot_mask & first  # later slots' states depend on tokens the draft does not see
    hidden_sum = hidden_match_sum(inputs.hidden, target, scored, cfg.gamma)
    return hidden_sum, {"hidden": hidden_sum}


TERMS: dict[str, Term] = {
    # Always computed: α (acceptance, the confidence target) comes from its pass, and its
    # objective (0 with every weight at 0) keeps the draft logits in every rank's graph.
    "vocab": Term(lambda cfg: 1.0, _vocab, per_chunk=True, metrics=_vocab_metrics),
    "confidence": Term(lambda cfg: cfg.confidence_weight, _confidence, per_chunk=True, needs_confidence=True),
    "hidden": Term(lambda cfg: cfg.hidden_weight, _hidden),
}
"""The loss terms by name, in the order they are added up."""


def active_terms(cfg: LossConfig, with_confidence: bool) -> dict[str, Term]:
    """The terms `dspark_loss` computes under `cfg`."""
    return {
        name: term
        for name, term in TERMS.items()
        if term.weight(cfg) > 0 and (with_confidence or not term.needs_confidence)
    }


def term_names(cfg: LossConfig, with_confidence: bool) -> list[str]:
    """The keys of `LossOutput.terms` under `cfg`, in order."""
    names = []
    for name, term in active_terms(cfg, with_confidence).items():
        names += term.metrics(cfg) if term.metrics else (name,)
    return names


class _Chunk:
    """The vocabulary pass and the chunk terms of one chunk (a plain callable, so it can be checkpointed)."""

    def __init__(self, inputs: LossInputs, terms: dict[str, Term], cfg: LossConfig, workspace: Workspace | None):
        self.inputs = inputs  # the batch's: each call replaces its per-block tensors with one chunk's
        self.terms = {name: term for name, term in terms.items() if term.per_chunk}
        self.cfg = cfg
        self.term_weights = term_weights(cfg.weights)
        self.workspace = workspace
        # With a workspace, both projections write into its reused buffers (dspark.workspace).
        self.ws = {} if workspace is None else {"workspace": workspace}
        self.slot_bytes = 0  # bytes of one slot's kept gradient, known once a chunk has run

    def vocab_pass(self, inputs: LossInputs) -> VocabPass:
        logits, confidence_logit = inputs.heads_fn(inputs.hidden, inputs.prev, **self.ws)
        with torch.no_grad():  # the verifier is frozen: its distribution is a constant target
            target_logits = inputs.target_logits_fn(inputs.target_hidden, **self.ws)
        d2t = inputs.d2t
        check_draft_width(logits.shape[-1], target_logits.shape[-1], d2t)
        draft_ids = None if d2t is None else draft_target_ids(d2t.to(logits.device))
        if draft_ids is not None and draft_ids.numel() and int(draft_ids[-1]) >= target_logits.shape[-1]:
            raise ValueError(
                f"d2t maps draft id(s) to target id {int(draft_ids[-1])}, "
                f"outside the verifier vocabulary of {target_logits.shape[-1]}"
            )
        dtype = wide(logits).dtype
        slot_mask = inputs.slot_mask
        wm = slot_mask.to(dtype) * position_weights(slot_mask.shape[-1], self.cfg.gamma, logits.device, dtype)
        self.slot_bytes = logits.shape[-1] * logits.element_size()
        need_grad = torch.is_grad_enabled() and logits.requires_grad
        objective, sums, alpha, out_of_vocab = VocabTerms.apply(
            logits, target_logits, inputs.labels, wm, self.term_weights, draft_ids, need_grad, self.workspace
        )
        return VocabPass(wm, objective, sums, alpha, confidence_logit, out_of_vocab)

    def __call__(self, *blocks: Tensor):
        # The chunk's tensors are the call's arguments, so a checkpoint saves (and version-checks) them.
        inputs = self.inputs.with_blocks(*blocks)
        shared = self.vocab_pass(inputs)
        sums = {name: term.compute(inputs, shared, self.cfg) for name, term in self.terms.items()}
        confidence = None
        if inputs.with_confidence:
            confidence = torch.sigmoid(shared.confidence_logit.detach().to(shared.alpha.dtype))
        return sums, shared.alpha * inputs.slot_mask, confidence, shared.out_of_vocab


def _check_inputs(inputs: LossInputs) -> None:
    """Shapes and d2t of one call (the config's values were checked when it was built: LossConfig.__post_init__)."""
    hidden = inputs.hidden
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [n, B, H], got shape {tuple(hidden.shape)}")
    nb = tuple(hidden.shape[:2])
    for name in ("prev", "labels", "slot_mask"):
        shape = tuple(getattr(inputs, name).shape)
        if shape != nb:
            raise ValueError(f"{name} must be [n, B] = {list(nb)}, got {list(shape)}")
    target_hidden = inputs.target_hidden
    if target_hidden.dim() != 3 or tuple(target_hidden.shape[:2]) != nb:
        raise ValueError(f"target_hidden must be [n, B, H] with [n, B] = {list(nb)}, got {list(target_hidden.shape)}")
    if inputs.d2t is not None:
        ids = draft_target_ids(inputs.d2t.reshape(-1))
        if inputs.d2t.dim() != 1 or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("d2t must be 1-D with strictly ascending target ids (as dspark.vocab builds it)")


def _add(a: tuple[Tensor, dict[str, Tensor]], b: tuple[Tensor, dict[str, Tensor]]) -> tuple[Tensor, dict[str, Tensor]]:
    """Two chunks' (objective, metrics) of one term, added up."""
    return a[0] + b[0], {m: v + b[1][m] for m, v in a[1].items()}


def dspark_loss(
    inputs: LossInputs, cfg: LossConfig, *, keep_budget: int | None = None, workspace: Workspace | None = None
) -> LossOutput:
    """The DSpark loss of n blocks of B slots: the `TERMS` whose weight under `cfg` is > 0.

    `keep_budget`: bytes of per-chunk gradients kept from forward to backward (None:
    `keep_budget_bytes`; 0: recompute every chunk but the first in backward); `workspace`:
    reused vocabulary-sized buffers (dspark.workspace), passed on to `inputs.heads_fn` and
    `inputs.target_logits_fn` as `workspace=` when given.
    """
    _check_inputs(inputs)
    if not term_names(cfg, inputs.with_confidence):
        raise ValueError(
            "loss.weights has no term with a weight > 0, loss.hidden_weight is 0 and there is no "
            "confidence head (or loss.confidence_weight is 0): nothing to train"
        )
    inputs = dataclasses.replace(inputs, slot_mask=inputs.slot_mask.bool())
    n, block_size = inputs.slot_mask.shape
    norm = weight_sum(inputs.slot_mask, cfg.gamma) if inputs.norm is None else inputs.norm
    # With no scored slot anywhere every sum is 0: the loss is 0, not 0/0.
    norm = torch.as_tensor(norm, dtype=torch.float64, device=inputs.hidden.device).clamp_min(1e-12)
    terms = active_terms(cfg, inputs.with_confidence)
    # Terms over the whole batch first: one that cannot run fails before the chunks' work.
    totals = {name: term.compute(inputs, None, cfg) for name, term in terms.items() if not term.per_chunk}
    chunk_objective = _Chunk(inputs, terms, cfg, workspace)

    # Memory: each chunk's vocabulary-sized work (both projections, VocabTerms) runs and is
    # freed before the next chunk starts; what outlives forward is one [chunk, B, Vd] gradient
    # per chunk (see dspark.vocab_terms). Chunks are kept that way while their gradients fit
    # in `keep_budget` (default: a quarter of the device's free memory); chunks past it are
    # checkpointed instead (only their small inputs are kept, and backward reruns them, both
    # projections included), so memory stays bounded however many anchors a batch holds.
    blocks_per_chunk = max(1, cfg.chunk_size // block_size)
    if keep_budget is None and torch.is_grad_enabled():
        keep_budget = keep_budget_bytes(inputs.hidden.device)
    alphas, confidences, out_of_vocab = [], [], []
    kept = 0
    # range(max(n, 1)): an empty batch still runs the heads once (on zero blocks), so every
    # data-parallel rank builds a graph over the same parameters.
    for start in range(0, max(n, 1), blocks_per_chunk):
        args = tuple(t[start : start + blocks_per_chunk] for t in inputs.blocks())
        # The first chunk is always kept: its gradient is no larger than the chunk's own working memory.
        chunk_bytes = args[0].shape[0] * block_size * chunk_objective.slot_bytes
        if start and torch.is_grad_enabled() and kept + chunk_bytes > keep_budget:
            sums, alpha, confidence, oov = checkpoint(chunk_objective, *args, use_reentrant=False)
        else:
            kept += chunk_bytes
            sums, alpha, confidence, oov = chunk_objective(*args)
        for name, value in sums.items():
            totals[name] = _add(totals[name], value) if name in totals else value
        alphas.append(alpha)
        confidences.append(confidence)
        out_of_vocab.append(oov)

    loss, normalized = 0.0, {}
    for name, term in terms.items():  # in registry order
        objective, metrics = totals[name]
        loss = loss + term.weight(cfg) * (objective / norm.to(objective.dtype))
        normalized.update({m: value / norm.to(value.dtype) for m, value in metrics.items()})
    alpha = torch.cat(alphas)
    return LossOutput(
        loss=loss,
        terms={name: value.detach() for name, value in normalized.items()},
        acceptance=AcceptanceStats.from_alpha(alpha, inputs.slot_mask),
        alpha=alpha,
        confidence=torch.cat(confidences) if inputs.with_confidence else None,
        ce_out_of_vocab=torch.stack(out_of_vocab).sum(),
    )


__all__ = [
    "TERMS",
    "LossInputs",
    "LossOutput",
    "Term",
    "VocabPass",
    "active_terms",
    "dspark_loss",
    "hidden_match_sum",
    "keep_budget_bytes",
    "position_weights",
    "term_names",
    "weight_sum",
]
