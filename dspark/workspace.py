"""Vocabulary-sized scratch buffers kept from one training step to the next.

On CPU every fresh tensor of ~150 MB (a [256, 152k] float32 logits block) is returned to the
OS when freed and page-faulted in again on the next step: measured at 40–90 ms per buffer on
2 cores, a few percent of a step per buffer. `Workspace.take` hands out the same memory each
step instead. A buffer is reused only while nothing else holds it (a view still alive, a
tensor saved for backward): otherwise that call gets a fresh tensor, so reuse never changes
a result. On CUDA the caching allocator already recycles memory and `take` is `torch.empty`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _holders(buffer: Tensor) -> int:
    """References to `buffer`'s storage (the buffer itself, its views, tensors saved by autograd)."""
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata)


class Workspace:
    """Named CPU buffers, each grown to the largest size asked for and reused while idle."""

    def __init__(self) -> None:
        self._buffers: dict[str, tuple[Tensor, int]] = {}  # name -> (flat buffer, its holders when idle)

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """An uninitialized tensor of `shape`: a view of buffer `name` when that buffer is idle."""
        device = torch.device(device)
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        numel = math.prod(shape)
        held = self._buffers.get(name)
        if held is not None:
            buffer, idle = held
            if _holders(buffer) != idle:  # still in use (e.g. a gradient saved for backward)
                return torch.empty(shape, dtype=dtype)
            if buffer.dtype == dtype and buffer.numel() >= numel:
                return buffer[:numel].view(shape)
        buffer = torch.empty(numel, dtype=dtype)
        self._buffers[name] = (buffer, _holders(buffer))
        return buffer.view(shape)

    def nbytes(self) -> int:
        """Bytes held."""
        return sum(b.numel() * b.element_size() for b, _ in self._buffers.values())


def scratch(workspace: Workspace | None, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """`workspace.take` in `like`'s dtype and device, or a fresh tensor without a workspace."""
    if workspace is None:
        return like.new_empty(shape)
    return workspace.take(name, shape, like.dtype, like.device)


__all__ = ["Workspace", "scratch"]
