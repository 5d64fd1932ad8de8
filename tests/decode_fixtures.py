"""A tiny verifier (a handful of tokens) and exported DSpark drafters for the speculative-decoding tests."""

from __future__ import annotations

from pathlib import Path

import torch
from drafts import draft_config
from transformers import Qwen3ForCausalLM

from bench.tiny_models import tiny_qwen3_config
from dspark.eval.speculative import SpeculativeDecoder, Verifier
from dspark.export import export_drafter, load_drafter
from dspark.model import DSparkDraft
from dspark.verifier import VerifierHead

AUX_LAYER_IDS = [1, 2]


def make_small_verifier(out: Path, vocab: int, seed: int = 0, logit_scale: float = 3.0) -> Path:
    """A random 3-layer Qwen3 over `vocab` tokens, with distributions neither flat nor one-hot."""
    torch.manual_seed(seed)
    config = tiny_qwen3_config(vocab, hidden_size=32, num_layers=3, max_position_embeddings=512)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(std=logit_scale / 32**0.5)
    model.save_pretrained(out)
    return out


def small_draft(verifier_dir: Path, draft_vocab: list[int] | None, block_size: int, seed=0, **overrides) -> DSparkDraft:
    """A random drafter on the verifier (draft_vocab: the target ids of a reduced vocabulary;
    overrides: other DraftConfig fields)."""
    verifier = VerifierHead.from_pretrained(verifier_dir)
    d2t = None if draft_vocab is None else torch.tensor(draft_vocab) - torch.arange(len(draft_vocab))
    vocab = None if d2t is None else len(draft_vocab)
    cfg = draft_config(block_size=block_size, markov_rank=4, draft_vocab_size=vocab, **overrides)
    torch.manual_seed(seed)
    model = DSparkDraft(cfg, verifier.config, AUX_LAYER_IDS, verifier.vocab_size - 1, d2t=d2t)
    model.load_verifier(verifier)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    return model


def export_small_drafter(verifier_dir: Path, out: Path, draft_vocab: list[int] | None, block_size: int, seed=0):
    """`small_draft` exported to `out`."""
    return export_drafter(small_draft(verifier_dir, draft_vocab, block_size, seed), out, str(verifier_dir))


def decoder_for(
    verifier_dir: Path, drafter_dir: Path, device: str = "cpu"
) -> tuple[SpeculativeDecoder, Qwen3ForCausalLM]:
    """The engine on the verifier and the drafter as loaded from its exported directory."""
    model = Qwen3ForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval().to(device)
    draft = load_drafter(drafter_dir, VerifierHead.from_pretrained(verifier_dir)).to(device)
    return SpeculativeDecoder(Verifier(model, draft.aux_layer_ids), draft), model
