"""Analytic acceptance of a drafter against its verifier.

The target is always the verifier's full-vocabulary softmax at temperature 1. With a
reduced draft vocabulary D the draft puts no mass outside D, so target mass outside D is
rejected mass: it is never renormalized away. Under speculative sampling the probability
that slot k is accepted, given every earlier slot was, is

    α_k = Σ_v min(q_k[v], p_k[v])      (= 1 − ½‖q_k − p_k‖₁ over the full vocabulary)

and the expected number of tokens one block yields (the verifier's bonus token included) is

    τ = 1 + Σ_k Π_{j≤k} α_j            over the block's scored slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def draft_target_ids(d2t: Tensor) -> Tensor:
    """Verifier token id of every draft id (`d2t` holds offsets: target id = i + d2t[i])."""
    return torch.arange(d2t.shape[0], device=d2t.device, dtype=torch.long) + d2t.long()


def restrict_to_draft(p_full: Tensor, d2t: Tensor | None) -> Tensor:
    """The full-vocabulary target `[..., V]` read at the draft ids `[..., Vd]`, NOT renormalized."""
    if d2t is None:
        return p_full
    ids = draft_target_ids(d2t.to(p_full.device))
    if ids.numel() and int(ids.max()) >= p_full.shape[-1]:
        raise ValueError(
            f"d2t maps draft id(s) to target id {int(ids.max())}, outside the verifier vocabulary of {p_full.shape[-1]}"
        )
    return p_full.index_select(-1, ids)


def check_draft_width(num_draft: int, num_target: int, d2t: Tensor | None) -> None:
    """Raise a clear error when the draft distribution and the mapping disagree in size."""
    if d2t is not None and num_draft != d2t.shape[0]:
        raise ValueError(f"draft distribution has {num_draft} entries but d2t has {d2t.shape[0]}")
    if d2t is None and num_draft != num_target:
        raise ValueError(
            f"draft distribution has {num_draft} entries but the verifier vocabulary has "
            f"{num_target}; pass d2t for a reduced draft vocabulary"
        )


def overlap(q: Tensor, p: Tensor) -> Tensor:
    """Σ_v min(q, p) of two distributions over the same ids (p may be a sub-distribution)."""
    return torch.minimum(q, p).sum(-1)


def acceptance(q_draft_probs: Tensor, p_full: Tensor, d2t: Tensor | None) -> Tensor:
    """α = Σ_v min(q, p) per row: `q_draft_probs [..., Vd]`, `p_full [..., V]` -> `[...]`."""
    check_draft_width(q_draft_probs.shape[-1], p_full.shape[-1], d2t)
    return overlap(q_draft_probs, restrict_to_draft(p_full, d2t))


def prefix_acceptance(alpha: Tensor, slot_mask: Tensor) -> Tensor:
    """Π_{j≤k} α_j per slot `[n, B]`; 0 from the first unscored slot on (a block stops there)."""
    return torch.cumprod(alpha * slot_mask.to(alpha.dtype), dim=-1)


def expected_length(alpha: Tensor, slot_mask: Tensor) -> Tensor:
    """τ per block `[n]` = 1 + Σ_k Π_{j≤k} α_j over the scored prefix (bonus token included)."""
    return 1.0 + prefix_acceptance(alpha, slot_mask).sum(-1)


@dataclass
class AcceptanceStats:
    """Per-position acceptance sums; add them over batches (and all-reduce over ranks), then read.

    Every field is a float64 tensor `[B]` (B = block size), summed over scored slots only.
    """

    alpha_sum: Tensor
    """Σ α_k over scored slots at position k."""
    prefix_sum: Tensor
    """Σ Π_{j≤k} α_j over the same slots."""
    slots: Tensor
    """Number of scored slots at position k (slots[0] = number of scored blocks)."""

    @classmethod
    def from_alpha(cls, alpha: Tensor, slot_mask: Tensor) -> AcceptanceStats:
        """Stats of one batch: `alpha [n, B]` per-slot acceptance, `slot_mask [n, B]`."""
        alpha = alpha.detach().to(torch.float64)
        mask = slot_mask.to(torch.float64)
        return cls(
            alpha_sum=(alpha * mask).sum(0),
            prefix_sum=prefix_acceptance(alpha, slot_mask).sum(0),
            slots=mask.sum(0),
        )

    def __add__(self, other: AcceptanceStats) -> AcceptanceStats:
        return AcceptanceStats(
            self.alpha_sum + other.alpha_sum,
            self.prefix_sum + other.prefix_sum,
            self.slots + other.slots,
        )

    def conditional(self) -> Tensor:
        """Mean α_k: acceptance of slot k given every earlier slot was accepted `[B]`."""
        return self.alpha_sum / self.slots.clamp_min(1)

    def cumulative(self) -> Tensor:
        """Mean Π_{j≤k} α_j: probability that slots 0..k are all accepted `[B]`.

        Averaged over blocks that score slot k (blocks cut short by the end of a sequence do
        not count as rejections here; they do shorten `tau`).
        """
        return self.prefix_sum / self.slots.clamp_min(1)

    def tau(self) -> Tensor:
        """Mean expected tokens per block, τ = 1 + Σ_k Π_{j≤k} α_j, over scored blocks."""
        return 1.0 + self.prefix_sum.sum() / self.slots[0].clamp_min(1)


__all__ = [
    "AcceptanceStats",
    "acceptance",
    "check_draft_width",
    "draft_target_ids",
    "expected_length",
    "overlap",
    "prefix_acceptance",
    "restrict_to_draft",
]
