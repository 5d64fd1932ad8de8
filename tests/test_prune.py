"""Vocabulary pruning: kept logits unchanged, the kept set, counts from every source, the stage."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from eval_fixtures import VOCAB, build_setup, compose_cfg, export_tiny_drafter, make_samples

from dspark.eval.prune import PRUNE_REPORT, kept_token_ids, load_counts, prune_drafter, run
from dspark.export import load_drafter
from dspark.verifier import VerifierHead
from dspark.vocab import count_tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return build_setup(tmp_path_factory.mktemp("prune"))


@pytest.fixture(scope="module")
def verifier(setup):
    return VerifierHead.from_pretrained(setup.verifier_dir)


def logits_of(draft, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(5, draft.block_size, draft.layer_config.hidden_size, generator=g)
    prev = torch.randint(0, VOCAB - 1, (5, draft.block_size), generator=g)
    with torch.no_grad():
        return draft.draft_logits(hidden, prev), draft.confidence_logits(hidden, prev)


@pytest.mark.parametrize("reduced", [False, True], ids=["from-full-vocab", "from-reduced-vocab"])
def test_pruned_logits_equal_original_on_kept_tokens(setup, verifier, tmp_path, reduced):
    src = (
        setup.drafter
        if not reduced
        else export_tiny_drafter(setup.verifier_dir, tmp_path / "reduced", draft_vocab_size=512)
    )
    original = load_drafter(src, verifier)
    old_ids = original.target_ids.numpy()
    keep = np.sort(np.random.default_rng(0).choice(old_ids, size=100, replace=False))
    pruned = load_drafter(prune_drafter(src, tmp_path / "pruned", keep, setup.verifier_dir), verifier)
    assert pruned.draft_vocab_size == 100 and pruned.target_ids.tolist() == keep.tolist()
    assert int(pruned.t2d.sum()) == 100 and pruned.t2d[torch.from_numpy(keep)].all()
    config = json.loads((tmp_path / "pruned" / "config.json").read_text())
    assert config["draft_vocab_size"] == 100
    (a, conf_a), (b, conf_b) = logits_of(original), logits_of(pruned)
    columns = torch.from_numpy(np.searchsorted(old_ids, keep))
    torch.testing.assert_close(b, a[..., columns], rtol=0, atol=0)
    torch.testing.assert_close(conf_b, conf_a, rtol=0, atol=0)  # the confidence head is untouched


def test_kept_token_ids():
    counts = np.zeros(20, dtype=np.int64)
    counts[[3, 5, 7, 11, 19]] = [5, 9, 1, 9, 100]
    draft_ids = np.array([1, 3, 5, 7, 11, 13])  # 19 is frequent but outside the draft vocabulary
    assert kept_token_ids(draft_ids, counts, None, 1).tolist() == [3, 5, 7, 11]
    assert kept_token_ids(draft_ids, counts, None, 6).tolist() == [5, 11]
    assert kept_token_ids(draft_ids, counts, 3, 1).tolist() == [3, 5, 11]
    # more than the counted tokens: unseen draft ids fill up, smaller ids first, never 19
    assert kept_token_ids(draft_ids, counts, 5, 1).tolist() == [1, 3, 5, 7, 11]
    with pytest.raises(ValueError, match="draft_vocab_size=7"):
        kept_token_ids(draft_ids, counts, 7, 1)
    with pytest.raises(ValueError, match=">= 1000 times"):
        kept_token_ids(draft_ids, counts, None, 1000)


def test_counts_from_store_jsonl_and_npy(setup, tmp_path):
    samples = make_samples(8, seed=7)
    expected = count_tokens([s[0] for s in samples], [s[1] for s in samples], VOCAB)
    np.testing.assert_array_equal(load_counts(str(setup.store), VOCAB), expected)
    np.testing.assert_array_equal(load_counts(setup.data_dir / "eval.jsonl", VOCAB), expected)
    np.save(tmp_path / "c.npy", expected)
    np.testing.assert_array_equal(load_counts(tmp_path / "c.npy", VOCAB), expected)
    with pytest.raises(ValueError, match=r"expected integer counts of shape \[10\]"):
        load_counts(tmp_path / "c.npy", 10)
    (tmp_path / "bad.jsonl").write_text('{"input_ids": [1]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: a row needs"):
        load_counts(tmp_path / "bad.jsonl", VOCAB)


def test_prune_stage(setup):
    out = setup.root / "pruned-drafter"
    cfg = compose_cfg(
        setup, f"prune.out={out}", f"prune.counts={setup.store}", "prune.draft_vocab_size=64", config_name="prune"
    )
    report = run(cfg)
    assert report["pruned"]["draft_vocab_size"] == 64 and report["original"]["draft_vocab_size"] == VOCAB
    on_disk = json.loads((out / PRUNE_REPORT).read_text())
    for key in ("original", "pruned"):
        assert 1.0 <= on_disk[key]["offline"]["tau"] <= 5.0
    # the data draws tokens from 96 ids: 64 of them cover most of the counted mass
    assert 0.5 < report["counts"]["covered_by_pruned"] < report["counts"]["covered_by_original"] == 1.0
    assert json.loads((out / "dspark_meta.json").read_text())["pruned_from"]["draft_vocab_size"] == VOCAB
    with pytest.raises(ValueError, match="is the drafter itself"):
        run(compose_cfg(setup, f"prune.out={setup.drafter}", config_name="prune"))
