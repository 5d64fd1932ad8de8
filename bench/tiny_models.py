"""Tiny random models shared by the benchmarks and the tests: a Qwen3 verifier's config and a draft config."""

from __future__ import annotations

from transformers import Qwen3Config

from dspark.config import DraftConfig

TINY_DRAFT = DraftConfig(
    num_layers=2,
    block_size=4,
    draft_vocab_size=None,
    markov_rank=8,
    markov_type="vanilla",
    confidence_head=True,
    confidence_head_with_markov=True,
    sliding_window=None,
    causal_in_block=False,
    attn_impl="sdpa",
    markov_embed_proj=False,
)
"""A small draft of the defaults' shape (full attention, vanilla Markov head, confidence head, full vocabulary)."""


def tiny_qwen3_config(
    vocab_size: int, hidden_size: int, num_layers: int, max_position_embeddings: int, **extra
) -> Qwen3Config:
    """A Qwen3 of 4 query heads over 2 key/value heads (head_dim hidden / 4), MLP 2× hidden, tied lm_head;
    `extra`: other Qwen3Config fields."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        **extra,
    )
