"""The DSpark training objective, computed chunk by chunk over blocks.

Notation, per scored slot k of a block: q_k = the draft's (Markov-corrected) softmax over
the draft vocabulary D; p_k = the verifier's full-vocabulary softmax at temperature 1 at
position p+k; m_k = Σ_{v∈D} p_k[v] (1 with the full vocabulary). Terms:

- `ce`: −log q_k[y], y = the data token p+k+1 (`ce_target: data`) or the verifier's argmax
  (`ce_target: argmax`). A y outside a reduced D has no draft logit: the slot is left out
  of CE (still counted in the normalizer) and reported in `LossOutput.ce_out_of_vocab`.
- `tv`: ½‖q_k − p_k‖₁ over the FULL vocabulary with q_k = 0 outside D, which equals
  1 − α_k, α_k = Σ_{v∈D} min(q_k, p_k). Target mass outside D counts as distance the draft
  can never close, exactly as it counts as rejection at serving time.
- `kl`: KL(p‖q) is infinite when m_k < 1 (q is 0 where p is not). The term used is its
  finite part m_k·KL(p̂_k‖q_k) = Σ_{v∈D} p log(p/q) − m_k log m_k, p̂_k = p_k restricted to
  D and renormalized: it has the gradient of the soft cross-entropy −Σ_{v∈D} p log q, is
  ≥ 0, is 0 at the best reachable q, and is exactly KL(p‖q) with the full vocabulary. This
  renormalization shapes the training signal only; acceptance figures never renormalize.
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

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dspark.config import LossConfig
from dspark.metrics import (
    AcceptanceStats,
    check_draft_width,
    draft_target_ids,
    overlap,
    restrict_to_draft,
)

DISTRIBUTION_TERMS = ("ce", "tv", "kl")
CE_TARGETS = ("data", "argmax")


@dataclass
class LossOutput:
    """Result of `dspark_loss`; everything but `loss` is detached."""

    loss: Tensor
    """Scalar to backpropagate."""
    terms: dict[str, Tensor]
    """Each computed term, normalized but not multiplied by its weight (`ce`, `tv`, `kl`, `confidence`)."""
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


def _wide(x: Tensor) -> Tensor:
    """Half-precision logits to float32 (softmax over ~150k entries needs it); wider kept."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class _ChunkObjective:
    """Weighted term sums of one chunk of blocks (a plain callable, so it can be checkpointed)."""

    def __init__(self, draft_logits_fn, confidence_fn, target_logits_fn, d2t, cfg, terms):
        self.draft_logits_fn = draft_logits_fn
        self.confidence_fn = confidence_fn
        self.target_logits_fn = target_logits_fn
        self.d2t = d2t
        self.ce_target = cfg.ce_target
        self.terms = terms
        self.gamma = cfg.gamma

    def __call__(self, hidden, prev, target_hidden, labels, slot_mask):
        logq = torch.log_softmax(_wide(self.draft_logits_fn(hidden, prev)), dim=-1)
        q = logq.exp()
        with torch.no_grad():  # the verifier is frozen: its distribution is a constant target
            logp_full = torch.log_softmax(_wide(self.target_logits_fn(target_hidden)), dim=-1)
            check_draft_width(q.shape[-1], logp_full.shape[-1], self.d2t)
            p = restrict_to_draft(logp_full.exp(), self.d2t)
            logp = restrict_to_draft(logp_full, self.d2t) if "kl" in self.terms else None
            target = logp_full.argmax(-1) if self.ce_target == "argmax" else labels.long()
            del logp_full
        wm = slot_mask.to(q.dtype) * position_weights(slot_mask.shape[-1], self.gamma, q.device, q.dtype)
        alpha = overlap(q, p)
        sums: dict[str, Tensor] = {}
        out_of_vocab = torch.zeros((), dtype=torch.long, device=q.device)
        if "ce" in self.terms:
            ids, in_vocab = self._draft_ids(target, p.shape[-1] if self.d2t is None else None, q.device)
            nll = -logq.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            sums["ce"] = (nll * wm * in_vocab).sum()
            out_of_vocab = (slot_mask & ~in_vocab).sum()
        if "tv" in self.terms:
            sums["tv"] = ((1.0 - alpha) * wm).sum()
        if "kl" in self.terms:
            with torch.no_grad():
                mass = p.sum(-1)
                constant = (p * logp).sum(-1) - torch.xlogy(mass, mass)
            # einsum is a batched dot product: no extra [chunk, B, V] temporary.
            sums["kl"] = ((constant - torch.einsum("nbv,nbv->nb", p, logq)) * wm).sum()
        confidence = None
        if self.confidence_fn is not None:
            logit = self.confidence_fn(hidden, prev).to(alpha.dtype)
            bce = F.binary_cross_entropy_with_logits(logit, alpha.detach(), reduction="none")
            sums["confidence"] = (bce * wm).sum()
            confidence = torch.sigmoid(logit.detach())
        return sums, (alpha * slot_mask).detach(), confidence, out_of_vocab

    def _draft_ids(self, target: Tensor, full_vocab: int | None, device) -> tuple[Tensor, Tensor]:
        """Draft index of each verifier token id, and whether it is in the draft vocabulary."""
        if self.d2t is None:
            return target.clamp(0, full_vocab - 1), torch.ones_like(target, dtype=torch.bool)
        target_ids = draft_target_ids(self.d2t.to(device))
        # Sorted draft ids (see dspark.vocab) make the inverse map a binary search.
        pos = torch.searchsorted(target_ids, target).clamp(max=target_ids.shape[0] - 1)
        return pos, target_ids[pos] == target


def _check_inputs(hidden, prev, target_hidden, labels, slot_mask, cfg: LossConfig) -> None:
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [n, B, H], got shape {tuple(hidden.shape)}")
    nb = tuple(hidden.shape[:2])
    for name, t in (("prev", prev), ("labels", labels), ("slot_mask", slot_mask)):
        if tuple(t.shape) != nb:
            raise ValueError(f"{name} must be [n, B] = {list(nb)}, got {list(t.shape)}")
    if target_hidden.dim() != 3 or tuple(target_hidden.shape[:2]) != nb:
        raise ValueError(f"target_hidden must be [n, B, H] with [n, B] = {list(nb)}, got {list(target_hidden.shape)}")
    unknown = sorted(set(cfg.weights) - set(DISTRIBUTION_TERMS))
    if unknown:
        raise ValueError(f"loss.weights: unknown term(s) {unknown}; known: {list(DISTRIBUTION_TERMS)}")
    if cfg.ce_target not in CE_TARGETS:
        raise ValueError(f"loss.ce_target must be one of {list(CE_TARGETS)}, got {cfg.ce_target!r}")
    if cfg.chunk_size < 1:
        raise ValueError(f"loss.chunk_size must be >= 1, got {cfg.chunk_size}")
    if cfg.gamma <= 0:
        raise ValueError(f"loss.gamma must be > 0, got {cfg.gamma}")


def dspark_loss(
    draft_logits_fn: Callable[[Tensor, Tensor], Tensor],
    target_logits_fn: Callable[[Tensor], Tensor],
    hidden: Tensor,
    prev: Tensor,
    target_hidden: Tensor,
    labels: Tensor,
    slot_mask: Tensor,
    cfg: LossConfig,
    norm: Tensor | float | None = None,
    *,
    confidence_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
    d2t: Tensor | None = None,
) -> LossOutput:
    """The DSpark loss of n blocks of B slots (see the module docstring for the terms).

    `draft_logits_fn(hidden [c, B, H], prev [c, B]) -> [c, B, Vd]` Markov-corrected draft
    logits; `target_logits_fn(target_hidden [c, B, Ht]) -> [c, B, V]` verifier logits from
    the pre-norm final hidden state at p+k; `confidence_fn(hidden, prev) -> [c, B]` or None;
    `prev [n, B]` the token at p+k; `labels [n, B]` the data token p+k+1; `slot_mask [n, B]`;
    `d2t [Vd]` draft→target offsets or None for the full vocabulary; `norm` the all-reduced
    `weight_sum` (None: this batch's own, for a single process).
    """
    _check_inputs(hidden, prev, target_hidden, labels, slot_mask, cfg)
    if not cfg.weights and confidence_fn is None:
        raise ValueError("loss.weights is empty and there is no confidence head: nothing to train")
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
    terms = tuple(t for t in DISTRIBUTION_TERMS if t in cfg.weights)
    objective = _ChunkObjective(draft_logits_fn, confidence_fn, target_logits_fn, d2t, cfg, terms)

    # Why checkpoint: autograd keeps each op's saved tensors until backward. For the
    # vocabulary-sized ops those are several [chunk, B, V] buffers, so merely looping over
    # chunks would still hold every chunk's buffers at once when backward starts (memory
    # ∝ anchors). Checkpointing keeps only each chunk's small inputs and reruns the chunk's
    # forward inside backward, one chunk at a time, at the price of one more pass of both
    # vocabulary projections. (A fused autograd Function with an analytic gradient could
    # skip the rerun, but would have to know the heads' parameters; here they are opaque
    # callables.) With a single chunk there is nothing to bound, so no checkpoint.
    blocks_per_chunk = max(1, cfg.chunk_size // block_size)
    use_checkpoint = torch.is_grad_enabled() and n > blocks_per_chunk
    totals: dict[str, Tensor] = {}
    alphas, confidences, out_of_vocab = [], [], []
    # range(max(n, 1)): an empty batch still runs the heads once (on zero blocks), so every
    # data-parallel rank builds a graph over the same parameters.
    for start in range(0, max(n, 1), blocks_per_chunk):
        chunk = slice(start, start + blocks_per_chunk)
        args = (hidden[chunk], prev[chunk], target_hidden[chunk], labels[chunk], slot_mask[chunk])
        if use_checkpoint:
            sums, alpha, confidence, oov = checkpoint(objective, *args, use_reentrant=False)
        else:
            sums, alpha, confidence, oov = objective(*args)
        for name, value in sums.items():
            totals[name] = totals[name] + value if name in totals else value
        alphas.append(alpha)
        confidences.append(confidence)
        out_of_vocab.append(oov)

    normalized = {name: value / norm.to(value.dtype) for name, value in totals.items()}
    loss = sum((cfg.weights[t] * normalized[t] for t in terms), torch.zeros((), device=hidden.device))
    if "confidence" in normalized:
        loss = loss + cfg.confidence_weight * normalized["confidence"]
    alpha = torch.cat(alphas)
    return LossOutput(
        loss=loss,
        terms={name: value.detach() for name, value in normalized.items()},
        acceptance=AcceptanceStats.from_alpha(alpha, slot_mask),
        alpha=alpha,
        confidence=None if confidence_fn is None else torch.cat(confidences),
        ce_out_of_vocab=torch.stack(out_of_vocab).sum(),
    )


__all__ = ["DISTRIBUTION_TERMS", "LossOutput", "dspark_loss", "position_weights", "weight_sum"]
