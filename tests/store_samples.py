"""Deterministic samples for the shard-store tests; torch-free so writer subprocesses start fast."""

from __future__ import annotations

import numpy as np

from dspark.store import Sample, ShardStore, StoreWriter

TARGET = {
    "name_or_path": "tiny/verifier",
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "layer_ids": [1, 3, 4],
    "dtype": "bfloat16",
}
TOKENIZER = "ab" * 32
EXTRA = {"data_config_sha256": "cd" * 32, "split": "train"}


def make_sample(sample_id: int, n_tokens: int, *, gaussian: bool = False) -> Sample:
    """Deterministic in `sample_id`, so other processes can regenerate the expected data."""
    rng = np.random.default_rng(sample_id)
    shape = (n_tokens, len(TARGET["layer_ids"]), TARGET["hidden_size"])
    if gaussian:  # hidden-state-like values: bf16 = the top 16 bits of fp32 (truncated)
        values = rng.standard_normal(shape, dtype=np.float32) * 4
        hidden = (values.view(np.uint32) >> 16).astype(np.uint16)
    else:  # every bit pattern is fair game, NaN payloads included
        hidden = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return Sample(
        sample_id=sample_id,
        token_ids=rng.integers(0, 151_936, size=n_tokens).astype(np.int32),
        loss_mask=rng.integers(0, 2, size=n_tokens).astype(np.uint8),
        hidden=hidden,
    )


def new_store(path, **kw) -> ShardStore:
    return StoreWriter.create_or_open(str(path), TARGET, TOKENIZER, EXTRA, **kw)
