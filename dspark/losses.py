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
confidence_weight·confidence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
    """Each computed term, normalized but not multiplied by its weight (`ce`, `tv`, `kl`, `confidence`, `hidden`)."""
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


class _ChunkObjective:
    """Weighted term sums of one chunk of blocks (a plain callable, so it can be checkpointed)."""

    def __init__(self, heads_fn, with_confidence, target_logits_fn, d2t, cfg, workspace):
        # With a workspace, both projections write into its reused buffers (dspark.workspace).
        ws = {} if workspace is None else {"workspace": workspace}
        self.heads_fn = lambda hidden, prev: heads_fn(hidden, prev, **ws)
        self.target_logits_fn = lambda target_hidden: target_logits_fn(target_hidden, **ws)
        self.workspace = workspace
        self.with_confidence = with_confidence
        self.d2t = d2t
        self.term_weights = term_weights(cfg.weights)
        self.gamma = cfg.gamma
        self.slot_bytes = 0  # bytes of one slot's kept gradient, known once a chunk has run

    def __call__(self, hidden, prev, target_hidden, labels, slot_mask):
        logits, confidence_logit = self.heads_fn(hidden, prev)
        with torch.no_grad():  # the verifier is frozen: its distribution is a constant target
            target_logits = self.target_logits_fn(target_hidden)
        check_draft_width(logits.shape[-1], target_logits.shape[-1], self.d2t)
        draft_ids = None if self.d2t is None else draft_target_ids(self.d2t.to(logits.device))
        if draft_ids is not None and draft_ids.numel() and int(draft_ids[-1]) >= target_logits.shape[-1]:
            raise ValueError(
                f"d2t maps draft id(s) to target id {int(draft_ids[-1])}, "
                f"outside the verifier vocabulary of {target_logits.shape[-1]}"
            )
        dtype = wide(logits).dtype
        wm = slot_mask.to(dtype) * position_weights(slot_mask.shape[-1], self.gamma, logits.device, dtype)
        self.slot_bytes = logits.shape[-1] * logits.element_size()
        need_grad = torch.is_grad_enabled() and logits.requires_grad
        objective, sums, alpha, out_of_vocab = VocabTerms.apply(
            logits, target_logits, labels, wm, self.term_weights, draft_ids, need_grad, self.workspace
        )
        confidence, bce_sum = None, None
        if self.with_confidence:
            logit = confidence_logit.to(alpha.dtype)
            bce = F.binary_cross_entropy_with_logits(logit, alpha, reduction="none")
            bce_sum = (bce * wm).sum()
            confidence = torch.sigmoid(logit.detach())
        return objective, sums, bce_sum, alpha * slot_mask, confidence, out_of_vocab


def _check_inputs(hidden, prev, target_hidden, labels, slot_mask) -> None:
    """Shapes of one call (the config's values were checked when it was built: LossConfig.__post_init__)."""
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [n, B, H], got shape {tuple(hidden.shape)}")
    nb = tuple(hidden.shape[:2])
    for name, t in (("prev", prev), ("labels", labels), ("slot_mask", slot_mask)):
        if tuple(t.shape) != nb:
            raise ValueError(f"{name} must be [n, B] = {list(nb)}, got {list(t.shape)}")
    if target_hidden.dim() != 3 or tuple(target_hidden.shape[:2]) != nb:
        raise ValueError(f"target_hidden must be [n, B, H] with [n, B] = {list(nb)}, got {list(target_hidden.shape)}")


def dspark_loss(
    heads_fn: Callable[[Tensor, Tensor], tuple[Tensor, Tensor | None]],
    target_logits_fn: Callable[[Tensor], Tensor],
    hidden: Tensor,
    prev: Tensor,
    target_hidden: Tensor,
    labels: Tensor,
    slot_mask: Tensor,
    cfg: LossConfig,
    norm: Tensor | float | None = None,
    *,
    with_confidence: bool = False,
    d2t: Tensor | None = None,
    keep_budget: int | None = None,
    workspace: Workspace | None = None,
    target_norm_fn: Callable[[Tensor], Tensor] | None = None,
) -> LossOutput:
    """The DSpark loss of n blocks of B slots (see the module docstring for the terms).

    `heads_fn(hidden [c, B, H], prev [c, B]) -> (logits [c, B, Vd], confidence [c, B] | None)`:
    the Markov-corrected draft logits and, when `with_confidence`, the confidence head's
    logits (trained against α); `target_logits_fn(target_hidden [c, B, Ht]) -> [c, B, V]`
    verifier logits from the pre-norm final hidden state at p+k;
    `prev [n, B]` the token at p+k; `labels [n, B]` the data token p+k+1; `slot_mask [n, B]`;
    `d2t [Vd]` draft→target offsets or None for the full vocabulary; `norm` the all-reduced
    `weight_sum` (None: this batch's own, for a single process); `keep_budget` bytes of
    per-chunk gradients kept from forward to backward (None: `keep_budget_bytes`; 0: recompute
    every chunk but the first in backward); `workspace` reused vocabulary-sized buffers
    (dspark.workspace), passed on to both functions as `workspace=` when given;
    `target_norm_fn(target_hidden) -> [n, B, Ht]` the verifier's final norm (needed for the
    `hidden` term, i.e. when `cfg.hidden_weight > 0`; `hidden` is then the draft's normed state).
    """
    _check_inputs(hidden, prev, target_hidden, labels, slot_mask)
    if cfg.hidden_weight > 0 and target_norm_fn is None:
        raise ValueError("loss.hidden_weight > 0 needs target_norm_fn (the verifier's final norm)")
    if not cfg.weights and not with_confidence and not cfg.hidden_weight:
        raise ValueError(
            "loss.weights has no term with a weight > 0, loss.hidden_weight is 0 and there is no "
            "confidence head: nothing to train"
        )
    if d2t is not None:
        ids = draft_target_ids(d2t.reshape(-1))
        if d2t.dim() != 1 or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("d2t must be 1-D with strictly ascending target ids (as dspark.vocab builds it)")
    n, block_size = slot_mask.shape
    slot_mask = slot_mask.bool()
    if norm is None:
        norm = weight_sum(slot_mask, cfg.gamma)
    # With no scored slot anywhere every sum is 0: the loss is 0, not 0/0.
    norm = torch.as_tensor(norm, dtype=torch.float64, device=hidden.device).clamp_min(1e-12)
    terms = tuple(t for t in VOCAB_TERMS if t in cfg.weights)
    objective = _ChunkObjective(heads_fn, with_confidence, target_logits_fn, d2t, cfg, workspace)

    # Memory: each chunk's vocabulary-sized work (both projections, VocabTerms) runs and is
    # freed before the next chunk starts; what outlives forward is one [chunk, B, Vd] gradient
    # per chunk (see dspark.vocab_terms). Chunks are kept that way while their gradients fit
    # in `keep_budget` (default: a quarter of the device's free memory); chunks past it are
    # checkpointed instead (only their small inputs are kept, and backward reruns them, both
    # projections included), so memory stays bounded however many anchors a batch holds.
    blocks_per_chunk = max(1, cfg.chunk_size // block_size)
    if keep_budget is None and torch.is_grad_enabled():
        keep_budget = keep_budget_bytes(hidden.device)
    objective_total, confidence_total, term_sums = 0.0, 0.0, None
    alphas, confidences, out_of_vocab = [], [], []
    kept = 0
    # range(max(n, 1)): an empty batch still runs the heads once (on zero blocks), so every
    # data-parallel rank builds a graph over the same parameters.
    for start in range(0, max(n, 1), blocks_per_chunk):
        chunk = slice(start, start + blocks_per_chunk)
        args = (hidden[chunk], prev[chunk], target_hidden[chunk], labels[chunk], slot_mask[chunk])
        # The first chunk is always kept: its gradient is no larger than the chunk's own working memory.
        chunk_bytes = args[0].shape[0] * block_size * objective.slot_bytes
        if start and torch.is_grad_enabled() and kept + chunk_bytes > keep_budget:
            obj, chunk_sums, bce, alpha, confidence, oov = checkpoint(objective, *args, use_reentrant=False)
        else:
            kept += chunk_bytes
            obj, chunk_sums, bce, alpha, confidence, oov = objective(*args)
        objective_total = objective_total + obj
        term_sums = chunk_sums if term_sums is None else term_sums + chunk_sums
        if bce is not None:
            confidence_total = confidence_total + bce
        alphas.append(alpha)
        confidences.append(confidence)
        out_of_vocab.append(oov)

    norm_ = norm.to(term_sums.dtype)
    normalized = {t: term_sums[VOCAB_TERMS.index(t)] / norm_ for t in terms}
    loss = objective_total / norm_
    if with_confidence:
        normalized["confidence"] = confidence_total / norm_
        loss = loss + cfg.confidence_weight * normalized["confidence"]
    if cfg.hidden_weight > 0:
        with torch.no_grad():
            target = target_norm_fn(target_hidden)
        first = torch.arange(block_size, device=slot_mask.device) < (cfg.hidden_slots or block_size)
        scored = slot_mask & first  # later slots' states depend on tokens the draft does not see
        normalized["hidden"] = hidden_match_sum(hidden, target, scored, cfg.gamma) / norm.to(hidden.dtype)
        loss = loss + cfg.hidden_weight * normalized["hidden"]
    alpha = torch.cat(alphas)
    return LossOutput(
        loss=loss,
        terms={name: value.detach() for name, value in normalized.items()},
        acceptance=AcceptanceStats.from_alpha(alpha, slot_mask),
        alpha=alpha,
        confidence=torch.cat(confidences) if with_confidence else None,
        ce_out_of_vocab=torch.stack(out_of_vocab).sum(),
    )


__all__ = [
    "LossOutput",
    "dspark_loss",
    "hidden_match_sum",
    "keep_budget_bytes",
    "position_weights",
    "weight_sum",
]
