"""Deterministic, resumable split of a store into optimizer steps, micro-batches and ranks.

The plan of an epoch is a pure function of (sample lengths, seed, epoch, token budgets):
every rank computes the same plan, takes its own share, and a resumed run regenerates it
and continues at the saved step, so nothing is repeated or skipped. The global batch of
a step does not depend on the number of ranks: `GPUS=1` and `GPUS=8` see the same samples
per optimizer step, only spread differently (more micro-batches per rank = accumulation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MicroBatch = list[int]
"""Indices (into the store's sample list) of the samples padded into one forward pass."""


@dataclass(frozen=True)
class StepPlanner:
    """Turns sample lengths into steps of token-budgeted micro-batches."""

    lengths: np.ndarray
    """Tokens of every sample, already capped at `tokens_per_micro_batch`."""
    tokens_per_step: int
    """Sample tokens per optimizer step over all ranks."""
    tokens_per_micro_batch: int
    """Padded tokens (rows x longest row) per micro-batch."""
    seed: int
    """Seed of the per-epoch sample order."""

    def __post_init__(self) -> None:
        # The budgets are checked where they are configured (TrainConfig.__post_init__).
        if len(self.lengths) and int(self.lengths.max()) > self.tokens_per_micro_batch:
            raise ValueError("sample lengths must be capped at train.tokens_per_micro_batch")

    def epoch(self, epoch: int) -> list[list[MicroBatch]]:
        """All steps of `epoch` (shuffled order); each step is a list of micro-batches."""
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
        order = rng.permutation(len(self.lengths))
        steps: list[list[MicroBatch]] = []
        current: list[int] = []
        tokens = 0
        for idx in order.tolist():
            n = int(self.lengths[idx])
            if current and tokens + n > self.tokens_per_step:
                steps.append(self.micro_batches(current))
                current, tokens = [], 0
            current.append(idx)
            tokens += n
        if current:
            steps.append(self.micro_batches(current))
        return steps

    def micro_batches(self, indices: Sequence[int]) -> list[MicroBatch]:
        """Pack `indices` into padded micro-batches, longest first (little padding, stable order)."""
        ranked = sorted(indices, key=lambda i: (-int(self.lengths[i]), i))
        batches: list[MicroBatch] = []
        for idx in ranked:
            if batches:
                rows, longest = len(batches[-1]) + 1, int(self.lengths[batches[-1][0]])
                if rows * longest <= self.tokens_per_micro_batch:
                    batches[-1].append(idx)
                    continue
            batches.append([idx])
        return batches

    def padded_tokens(self, batch: MicroBatch) -> int:
        """Tokens one micro-batch occupies once padded."""
        return len(batch) * max(int(self.lengths[i]) for i in batch)


def assign_ranks(costs: Sequence[int], world_size: int) -> list[int]:
    """The rank of each item, in the order given: each goes to the least-loaded rank so far
    (longest-processing-time-first balancing when the items come largest first)."""
    load = [0] * world_size
    ranks = []
    for cost in costs:
        target = min(range(world_size), key=lambda r: (load[r], r))
        load[target] += cost
        ranks.append(target)
    return ranks


def share_of_rank(planner: StepPlanner, step: list[MicroBatch], rank: int, world_size: int) -> list[MicroBatch]:
    """The micro-batches of `step` that `rank` runs: longest-processing-time-first balancing.

    A rank may get none (small last step, more ranks than micro-batches); it still joins
    the step's collectives with an empty batch.
    """
    ranks = assign_ranks([planner.padded_tokens(batch) for batch in step], world_size)  # already longest first
    return [batch for batch, r in zip(step, ranks, strict=True) if r == rank]


def share_of_samples(lengths: Sequence[int], rank: int, world_size: int) -> list[int]:
    """Indices of the samples (of `lengths` tokens) that `rank` scores in a held-out evaluation: every
    sample on exactly one rank, longest first to the least-loaded one; a rank may get none."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    ranks = assign_ranks([int(lengths[i]) for i in order], world_size)
    return sorted(i for i, r in zip(order, ranks, strict=True) if r == rank)


__all__ = ["MicroBatch", "StepPlanner", "assign_ranks", "share_of_rank", "share_of_samples"]
