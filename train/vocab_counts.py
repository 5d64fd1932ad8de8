"""The draft vocabulary ranked by the verifier: its expected token counts over the training store.

`token_freqs.npy` (the data stage) counts the tokens the verifier happened to sample in its
replies; on a small training set most of the draft vocabulary's slots then go to ids seen once or
never (ties fill by smallest id). The verifier's own next-token distributions at the same
positions, summed, give the expected value of those counts: every token it could have said there
gets its share, so the vocabulary holds more of the mass it puts on held-out text
(`train.draft_vocab_from: verifier`, docs/levers.md).
"""

from __future__ import annotations

import numpy as np
import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from dspark.store.format import bits_to_tensor
from dspark.store.reader import ShardStore
from dspark.verifier import VerifierHead

ROWS_PER_CHUNK = 256  # verifier distributions summed at a time: [256, V] float32 (~155 MB at V = 151,936)


@torch.no_grad()
def verifier_counts(
    store: ShardStore, head: VerifierHead, accelerator: Accelerator, max_samples: int | None = None
) -> np.ndarray:
    """float64 `[V]`: Σ over the loss-masked tokens t of the store's first `max_samples` samples (None: all)
    of the verifier's distribution at t − 1 (what `token_freqs.npy` counts, in expectation), from the stored
    final-layer states. Each rank sums its share of the samples; every rank returns the total."""
    device = accelerator.device
    refs = store.by_sample_id(max_samples)[accelerator.process_index :: accelerator.num_processes]
    total = torch.zeros(head.vocab_size, dtype=torch.float64, device=device)
    bar = tqdm(refs, desc="draft vocabulary: verifier counts", unit="sample", disable=not accelerator.is_main_process)
    for ref in bar:
        sample = store.read(ref)
        predicted = np.nonzero(sample.loss_mask[1:])[0]  # positions whose next token is trained
        if predicted.size == 0:
            continue
        final = bits_to_tensor(sample.hidden[predicted, -1, :])  # [n, H] the final layer, pre-norm
        for start in range(0, len(final), ROWS_PER_CHUNK):
            rows = final[start : start + ROWS_PER_CHUNK].to(device=device, dtype=head.norm.weight.dtype)
            total += torch.softmax(head.logits(rows).float(), dim=-1).sum(0, dtype=torch.float64)
    if accelerator.num_processes > 1:
        total = accelerator.reduce(total, reduction="sum")
    # Rounded to float32: the order of the ranks' sums (which moves with their number) then cannot reorder
    # near-ties; exact ties rank by smaller id.
    return total.cpu().numpy().astype(np.float32).astype(np.float64)


__all__ = ["verifier_counts"]
