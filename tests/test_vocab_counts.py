"""The draft vocabulary ranked by the verifier (`train.draft_vocab_from: verifier`): its expected token
counts over a real store, against HF transformers, and the mapping a run builds from them.

(That 2 ranks build the same mapping as 1 is part of tests/test_train.py's DDP test: the runs there
rank their reduced vocabulary this way, and their weights must match.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from train_stores import VOCAB, make_bigram_verifier, make_samples, write_store, write_token_freqs
from transformers import AutoModelForCausalLM

from dspark.store import ShardStore, bits_to_tensor
from dspark.train.vocab_counts import verifier_counts
from dspark.verifier import VerifierHead
from dspark.vocab import build_mapping


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab_counts")
    verifier = make_bigram_verifier(root / "verifier")
    samples = make_samples(verifier, 12, seed=3, min_len=20, max_len=40, empty_masks=2)
    store = write_store(root / "train", verifier, samples, shard_size=5)
    return verifier, samples, ShardStore.open(store.url), root


def test_counts_are_the_verifier_distributions_summed_over_trained_tokens(world):
    verifier, samples, store, _ = world
    ours = verifier_counts(store, VerifierHead.from_pretrained(verifier), Accelerator(cpu=True))
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    from_states, from_tokens = np.zeros(VOCAB), np.zeros(VOCAB)
    trained = 0
    with torch.no_grad():
        for ref in store.index():  # a naive loop: one position at a time, HF's own norm and lm_head
            sample = store.read(ref)
            logits = model(torch.from_numpy(sample.token_ids.astype(np.int64))[None]).logits[0]
            states = bits_to_tensor(sample.hidden[:, -1, :]).float()
            for t in range(1, len(sample.token_ids)):
                if not sample.loss_mask[t]:
                    continue
                trained += 1
                p = torch.softmax(model.lm_head(model.model.norm(states[t - 1])), -1)
                from_states += p.double().numpy()
                from_tokens += torch.softmax(logits[t - 1], -1).double().numpy()
    assert trained == sum(int(m[1:].sum()) for _, m in samples) > 100
    assert ours.sum() == pytest.approx(trained, rel=1e-5)  # one distribution per trained token
    # The same states through HF's modules: equal up to float32 rounding.
    np.testing.assert_allclose(ours, from_states, rtol=1e-5, atol=1e-4)
    # The verifier run on the tokens themselves (the store keeps bf16 states): close, and the same ranking.
    np.testing.assert_allclose(ours, from_tokens, rtol=0.05, atol=0.05)
    assert torch.equal(build_mapping(ours, 128)[1], build_mapping(from_tokens, 128)[1])


def test_the_verifier_ranking_covers_tokens_it_could_have_sampled(world):
    verifier, samples, store, root = world
    counts = verifier_counts(store, VerifierHead.from_pretrained(verifier), Accelerator(cpu=True))
    sampled = np.load(write_token_freqs(root / "freqs.npy", samples, VOCAB))
    # Every data token the verifier gives mass to ranks above the rest of the vocabulary, seen or not.
    likely = np.nonzero(counts > 1.0)[0]
    unseen = [v for v in likely if sampled[v] == 0]
    assert unseen, "the sample should miss some of the verifier's likely tokens"
    _, by_verifier = build_mapping(counts, len(likely))
    _, by_tokens = build_mapping(sampled, len(likely))
    assert bool(by_verifier[likely].all())
    assert not bool(by_tokens[unseen].any())  # the sampled counts fill those slots by smallest id
