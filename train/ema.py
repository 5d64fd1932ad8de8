"""An exponential moving average of the trainable weights, for held-out evaluation and export.

After each optimizer step t (1, 2, ...) every trainable parameter's average moves toward it:
ema ← ema + (1 − d_t)(p − ema), with d_t = min(decay, (1 + t) / (10 + t)) so a short run is
not dominated by its random init. The averages live in the optimizer's per-parameter state
(key `ema`), so checkpoints save and restore them with the optimizer, unchanged. Training
always continues from the raw weights; `applied()` swaps the averages in for a while.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

KEY = "ema"


def ema_decay(decay: float, step: int) -> float:
    """d_t of optimizer step `step` (1-based)."""
    return min(decay, (1 + step) / (10 + step))


class WeightAverage:
    """EMA of `params`, kept in `optimizer.state[p][KEY]`."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, decay: float):
        self.params, self.optimizer, self.decay = params, optimizer, decay

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold the weights after optimizer step `step` into the averages (the first step starts them).

        Called after the optimizer step: the optimizer has its own state by then (AdamW
        initialises a parameter's state only when it finds it empty).
        """
        d = ema_decay(self.decay, step)
        for p in self.params:
            state = self.optimizer.state[p]
            if KEY not in state:
                state[KEY] = p.detach().clone()
            else:
                state[KEY].lerp_(p.detach(), 1.0 - d)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The averages in the parameters for the duration (weights without one yet stay as they are)."""
        saved = []
        with torch.no_grad():
            for p in self.params:
                avg = self.optimizer.state[p].get(KEY)
                if avg is not None:
                    saved.append((p, p.detach().clone()))
                    p.copy_(avg)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, raw in saved:
                    p.copy_(raw)


__all__ = ["KEY", "WeightAverage", "ema_decay"]
