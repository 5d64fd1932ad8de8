"""Anchor sampling and per-slot targets of DSpark blocks.

An anchor p starts a block of B slots; slot k predicts token p+k+1 (anchor-as-first-
prediction) from the verifier's distribution at position p+k. Anchors are the positions
whose own token and next token are both trained (`loss_mask`) and in the same document.
"""

from __future__ import annotations

import torch
from torch import Tensor


def anchor_candidates(loss_mask: Tensor, document_ids: Tensor | None = None) -> Tensor:
    """Bool `[b, T]`: p with loss_mask[p], loss_mask[p+1] and p, p+1 in the same document."""
    mask = loss_mask.bool()
    cand = torch.zeros_like(mask)
    cand[:, :-1] = mask[:, :-1] & mask[:, 1:]
    if document_ids is not None:
        cand[:, :-1] &= document_ids[:, :-1] == document_ids[:, 1:]
    return cand


def sample_anchors(
    loss_mask: Tensor,
    num_anchors: int,
    generator: torch.Generator,
    document_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Sample up to `num_anchors` anchors per row, uniformly without replacement.

    `loss_mask [b, T]`, `document_ids [b, T]` (packed sequences) or None. Returns
    `anchors [b, A]` long, ascending per row, and `valid [b, A]` bool, where
    A = min(num_anchors, most candidates in any row), at least 1; rows with fewer
    candidates are padded with position 0 and valid=False. Draws come from `generator`
    only, so a seeded generator reproduces the same anchors.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    cand = anchor_candidates(loss_mask, document_ids)
    # A uniform random key per position; the A smallest keys among candidates are a
    # uniform sample without replacement. Non-candidates get key 2 (> any uniform draw).
    keys = torch.rand(cand.shape, generator=generator, device=generator.device).to(cand.device)
    keys = keys.masked_fill(~cand, 2.0)
    num = max(1, min(num_anchors, int(cand.sum(1).max())))
    chosen_keys, positions = keys.topk(num, dim=1, largest=False, sorted=True)
    valid = chosen_keys < 2.0
    # Ascending positions, padding last: sort by position with padding pushed past T.
    order = torch.where(valid, positions, positions + cand.shape[1]).argsort(dim=1)
    positions, valid = positions.gather(1, order), valid.gather(1, order)
    return positions.masked_fill(~valid, 0), valid


def train_anchors(loss_mask: Tensor, num_anchors: int, generator: torch.Generator, mode: str) -> tuple[Tensor, Tensor]:
    """Training anchors of `loss_mask [b, T]` by `loss.anchor_sampling`: `uniform` is
    `sample_anchors`; `all` takes every candidate."""
    if mode == "uniform":
        return sample_anchors(loss_mask, num_anchors, generator)
    if mode == "all":
        return sample_anchors(loss_mask, loss_mask.shape[1], generator)
    raise ValueError(f"loss.anchor_sampling must be uniform or all, got {mode!r}")


def slot_targets(
    input_ids: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    valid: Tensor,
    block_size: int,
    document_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Labels, target positions and slot mask of every block slot.

    Returns `labels [b, A, B]` (token p+k+1), `target_pos [b, A, B]` (p+k, where the
    verifier's distribution for slot k lives) and `slot_mask [b, A, B]`: slot k is scored
    when its block is valid, p+k+1 is in range, in the loss mask and in the anchor's
    document, and every earlier slot of the block is scored (a contiguous prefix: a draft
    is verified left to right, so a slot after a gap can never be reached). Indices of
    unscored slots are clamped into range; their labels are meaningless.
    """
    b, seq_len = input_ids.shape
    num = anchors.shape[1]
    k = torch.arange(block_size, device=anchors.device)
    target_pos = anchors.unsqueeze(-1) + k  # [b, A, B]
    label_pos = target_pos + 1
    in_range = label_pos < seq_len
    label_pos = label_pos.clamp(max=seq_len - 1)
    target_pos = target_pos.clamp(max=seq_len - 1)

    flat = label_pos.reshape(b, num * block_size)
    ok = in_range & valid.unsqueeze(-1)
    ok &= loss_mask.bool().gather(1, flat).view(b, num, block_size)
    if document_ids is not None:
        anchor_doc = document_ids.gather(1, anchors).unsqueeze(-1)
        ok &= document_ids.gather(1, flat).view(b, num, block_size) == anchor_doc
    slot_mask = ok.long().cumprod(-1).bool()
    labels = input_ids.gather(1, flat).view(b, num, block_size)
    return labels, target_pos, slot_mask


__all__ = ["anchor_candidates", "sample_anchors", "slot_targets", "train_anchors"]
