"""Reading the shard store for training: samples (cut into windows when longer than a
micro-batch), padded micro-batches, background prefetch.

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
from dspark.train.sampler import MicroBatch

Batch = dict[str, torch.Tensor]
"""One padded micro-batch (see `collate`), extended by the algorithm's `prepare`."""


def windows_of(loss_mask: np.ndarray, width: int) -> list[tuple[int, int]]:
    """`(start, end)` windows of at most `width` tokens covering a sample of `len(loss_mask)` tokens.

    A sample that fits is one window. A longer one is cut into windows that overlap by one
    token (stride `width - 1`): every anchor candidate p (p and p+1 both trained) then lies
    with its first target p+1 in exactly one window, so no scored token is lost and none is
    scored twice; a window only loses the draft-side context (and the later slots of blocks
    that run past its end). Windows of a cut sample with nothing to score are left out.
    """
    n = len(loss_mask)
    if n <= width:
        return [(0, n)]
    trained = loss_mask.astype(bool)
    candidate = trained[:-1] & trained[1:]  # anchor candidates p (see dspark.anchors)
    out = []
    for start in range(0, n - 1, width - 1):
        end = min(start + width, n)
        if candidate[start : end - 1].any():
            out.append((start, end))
    return out


@dataclass
class StoreSplit:
    """The windows (see `windows_of`) of the committed samples of one store.

    `refs[i]` is window i as a store reference (a row range of its sample), `offsets[i]` its
    first token's position in the sample, `lengths[i]` its tokens (at most `max_tokens`).
    `counts`: samples, long samples that were cut, windows, and windows left out.
    """

    url: str
    refs: list[SampleRef]
    offsets: np.ndarray
    lengths: np.ndarray
    max_tokens: int
    counts: dict[str, int]

    @classmethod
    def open(
        cls, store: ShardStore, url: str, max_tokens: int, every_token: bool = False, max_samples: int | None = None
    ) -> StoreSplit:
        """Index the store (its first `max_samples` samples by sample id; None: all); the loss masks of samples
        longer than `max_tokens` are read to place their windows (`every_token`: every token counts as trained,
        as with `loss.train_on_prompt`: no mask is read and no window is left out)."""
        samples = store.by_sample_id(max_samples)
        refs, offsets = [], []
        counts = {"samples": len(samples), "long_samples": 0, "windows": 0, "windows_left_out": 0}
        for ref in samples:
            if ref.n_tokens <= max_tokens:
                refs.append(ref)
                offsets.append(0)
                continue
            mask = np.ones(ref.n_tokens, np.uint8) if every_token else store.read_loss_mask(ref)
            found = windows_of(mask, max_tokens)
            counts["long_samples"] += 1
            counts["windows"] += len(found)
            counts["windows_left_out"] += len(range(0, ref.n_tokens - 1, max_tokens - 1)) - len(found)
            for start, end in found:
                refs.append(SampleRef(ref.shard, ref.start + start, ref.start + end, ref.sample_id))
                offsets.append(start)
        lengths = np.array([r.n_tokens for r in refs], dtype=np.int64)
        return cls(
            url=url,
            refs=refs,
            offsets=np.array(offsets, dtype=np.int64),
            lengths=lengths,
            max_tokens=max_tokens,
            counts=counts,
        )

    def fingerprint(self) -> str:
        """Identity of the window list (ids, offsets and lengths): a resumed run must see the same one."""
        digest = hashlib.sha256()
        for ref, start, n in zip(self.refs, self.offsets.tolist(), self.lengths.tolist(), strict=True):
            digest.update((f"{ref.sample_id}:{n};" if start == 0 else f"{ref.sample_id}@{start}:{n};").encode())
        return digest.hexdigest()


def collate(samples: list[Sample], offsets: list[int]) -> Batch:
    """Right-pad samples (windows starting at `offsets` of their samples) into one micro-batch.

    Padding has loss_mask 0 and token_mask 0 (token_mask: the real tokens), so it is never scored.
    """
    lengths = [len(s.token_ids) for s in samples]
    width = max(lengths)
    num_layers, hidden_size = samples[0].hidden.shape[1:]
    token_ids = torch.zeros(len(samples), width, dtype=torch.long)
    loss_mask = torch.zeros(len(samples), width, dtype=torch.bool)
    token_mask = torch.zeros(len(samples), width, dtype=torch.bool)
    hidden = torch.zeros(len(samples), width, num_layers, hidden_size, dtype=torch.bfloat16)
    for row, (sample, n) in enumerate(zip(samples, lengths, strict=True)):
        token_ids[row, :n] = torch.from_numpy(sample.token_ids.astype(np.int64))
        loss_mask[row, :n] = torch.from_numpy(sample.loss_mask.astype(bool))
        token_mask[row, :n] = True
        hidden[row, :n] = bits_to_tensor(sample.hidden)
    return {
        "token_ids": token_ids,
        "loss_mask": loss_mask,
        "token_mask": token_mask,
        "context": hidden[:, :, :-1].flatten(2),
        "target_hidden": hidden[:, :, -1],
        "sample_ids": torch.tensor([s.sample_id for s in samples], dtype=torch.long),
        "window_starts": torch.tensor(offsets, dtype=torch.long),
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
        return self.prepare(collate(samples, [int(self.split.offsets[i]) for i in batch]))

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


__all__ = ["Batch", "StepDataset", "StoreSplit", "TimedLoader", "collate", "windows_of"]
