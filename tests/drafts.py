"""Building small DSpark drafts for the model and export tests."""

from __future__ import annotations

import dataclasses

import torch

from bench.tiny_models import TINY_DRAFT
from dspark.config import DraftConfig
from dspark.model import DSparkDraft
from dspark.verifier import VerifierHead

# Qwen3's first embedding row past its 151,669-token tokenizer.
QWEN3_MASK_TOKEN_ID = 151669


def draft_config(**overrides) -> DraftConfig:
    return dataclasses.replace(TINY_DRAFT, **overrides)


def random_d2t(vocab_size: int, draft_vocab_size: int, seed: int = 0) -> torch.Tensor:
    """d2t offsets of a random ascending subset of the verifier vocabulary."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randperm(vocab_size, generator=g)[:draft_vocab_size].sort().values
    return target - torch.arange(draft_vocab_size)


def make_draft(
    verifier: VerifierHead, cfg: DraftConfig, aux_layer_ids=(1, 2, 3), d2t=None, seed: int = 0
) -> DSparkDraft:
    """A draft with every trainable tensor randomized (norm gains too), verifier loaded."""
    torch.manual_seed(seed)
    model = DSparkDraft(cfg, verifier.config, list(aux_layer_ids), QWEN3_MASK_TOKEN_ID, d2t=d2t)
    model.load_verifier(verifier)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))
    return model


def packed_inputs(num_rows: int, seq_len: int, num_aux: int, hidden: int, seed: int = 0):
    """Random aux context and token ids (real-token range) for `num_rows` packed rows."""
    g = torch.Generator().manual_seed(seed)
    context = torch.randn(num_rows, seq_len, num_aux * hidden, generator=g)
    input_ids = torch.randint(0, QWEN3_MASK_TOKEN_ID, (num_rows, seq_len), generator=g)
    return context, input_ids
