"""Training-time perturbation of the draft's inputs (`train.context_noise`)."""

from __future__ import annotations

import torch


def noisy_context(context: torch.Tensor, num_aux: int, scale: float, generator: torch.Generator) -> torch.Tensor:
    """context [T, m·H] (one row's aux hidden states, m layers side by side) plus Gaussian noise whose std
    is `scale` times each token's RMS in each aux layer: the same relative size whatever a verifier's
    activation scale. Drawn from `generator`; returned in the context's dtype."""
    tokens, width = context.shape
    x = context.float().view(tokens, num_aux, width // num_aux)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()  # [T, m, 1]
    noise = torch.randn(x.shape, generator=generator)
    return (x + scale * rms * noise).view(tokens, width).to(context.dtype)


__all__ = ["noisy_context"]
