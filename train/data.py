"""Reading the shard store for training: sample-level random access, padded micro-batches,
background prefetch.

A sample's `hidden [T, L, H]` holds the aux layers (ascending) and, last, the final pre-norm
layer; the draft reads the aux layers as its context and the final layer gives the targets.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from dspark.store import Sample, SampleRef, ShardStore, bits_to_tensor
from train.sampler import MicroBatch

Batch = dict[str, torch.Tensor]
"""One padded micro-batch (see `collate`), extended by the algorithm's `prepare`."""


@dataclass
class StoreSplit:
    """The committed samples of one store, with their lengths capped at the micro-batch budget."""

    url: str
    refs: list[SampleRef]
    lengths: np.ndarray
    max_tokens: int

    @classmethod
    def open(cls, store: ShardStore, url: str, max_tokens: int, max_samples: int | None = None) -> StoreSplit:
        refs = sorted(store.index(), key=lambda r: r.sample_id)
        if max_samples is not None:
            refs = refs[:max_samples]
        lengths = np.minimum(np.array([r.end - r.start for r in refs], dtype=np.int64), max_tokens)
        return cls(url=url, refs=refs, lengths=lengths, max_tokens=max_tokens)

    def fingerprint(self) -> str:
        """Identity of the sample list (ids and lengths): a resumed run must see the same one."""
        digest = hashlib.sha256()
        for ref, n in zip(self.refs, self.lengths.tolist(), strict=True):
            digest.update(f"{ref.sample_id}:{n};".encode())
        return digest.hexdigest()


def collate(samples: list[Sample], max_tokens: int) -> Batch:
    """Right-pad samples into one micro-batch (padding has loss_mask 0, so it is never scored)."""
    lengths = [min(len(s.token_ids), max_tokens) for s in samples]
    width = max(lengths)
    num_layers, hidden_size = samples[0].hidden.shape[1:]
    token_ids = torch.zeros(len(samples), width, dtype=torch.long)
    loss_mask = torch.zeros(len(samples), width, dtype=torch.bool)
    hidden = torch.zeros(len(samples), width, num_layers, hidden_size, dtype=torch.bfloat16)
    for row, (sample, n) in enumerate(zip(samples, lengths, strict=True)):
        token_ids[row, :n] = torch.from_numpy(sample.token_ids[:n].astype(np.int64))
        loss_mask[row, :n] = torch.from_numpy(sample.loss_mask[:n].astype(bool))
        hidden[row, :n] = bits_to_tensor(sample.hidden[:n])
    return {
        "token_ids": token_ids,
        "loss_mask": loss_mask,
        "context": hidden[:, :, :-1].flatten(2),
        "target_hidden": hidden[:, :, -1],
        "sample_ids": torch.tensor([s.sample_id for s in samples], dtype=torch.long),
        "num_tokens": torch.tensor(sum(lengths), dtype=torch.long),
    }


class StepDataset(Dataset):
    """Item i: the prepared micro-batches one rank runs at its i-th step.

    Runs in DataLoader workers, each of which opens the store itself.
    """

    def __init__(self, split: StoreSplit, steps: list[list[MicroBatch]], prepare: Callable[[Batch], Batch]):
        self.split = split
        self.steps = steps
        self.prepare = prepare
        self._store: ShardStore | None = None

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: int) -> list[Batch]:
        if self._store is None:
            self._store = ShardStore.open(self.split.url)
        return [self.read_batch(self._store, batch) for batch in self.steps[i]]

    def read_batch(self, store: ShardStore, batch: MicroBatch) -> Batch:
        samples = [store.read(self.split.refs[i]) for i in batch]
        return self.prepare(collate(samples, self.split.max_tokens))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_store": None}


def _as_is(item: list[Batch]) -> list[Batch]:
    return item


class TimedLoader:
    """Iterates a `StepDataset` with background workers and measures time spent waiting for data."""

    def __init__(self, dataset: StepDataset, workers: int, prefetch_steps: int, pin_memory: bool):
        self.loader = DataLoader(
            dataset,
            batch_size=None,
            shuffle=False,
            num_workers=workers,
            prefetch_factor=prefetch_steps if workers else None,
            collate_fn=_as_is,
            pin_memory=pin_memory,
        )
        self.wait_s = 0.0

    def __iter__(self) -> Iterator[list[Batch]]:
        it = iter(self.loader)
        while True:
            start = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            self.wait_s += time.perf_counter() - start
            yield item


__all__ = ["Batch", "StepDataset", "StoreSplit", "TimedLoader", "collate"]
