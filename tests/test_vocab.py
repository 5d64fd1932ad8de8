"""dspark.vocab: counting, the top-k mapping (hand example, speculators), files and mismatches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dspark.vocab import (
    build_mapping,
    check_same_mapping,
    count_tokens,
    load_mapping,
    mapping_path,
    save_mapping,
)


def test_count_tokens_counts_only_loss_masked_tokens():
    ids = [[1, 2, 2, 5], np.array([5, 5, 0])]
    masks = [[0, 1, 1, 1], np.array([1, 0, 1], dtype=np.uint8)]
    assert count_tokens(ids, masks, 6).tolist() == [1, 0, 2, 0, 0, 2]


def test_count_tokens_over_many_tokens_matches_bincount():
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 1000, size=n) for n in (700_000, 500_000, 3)]  # crosses the 1M flush
    masks = [rng.integers(0, 2, size=a.size) for a in ids]
    want = np.bincount(np.concatenate([a[m == 1] for a, m in zip(ids, masks)]), minlength=1000)
    assert np.array_equal(count_tokens(ids, masks, 1000), want)


@pytest.mark.parametrize(
    "ids, masks, message",
    [
        ([[1, 2]], [[1]], "sample 0: token_ids shape"),
        ([[1], [7]], [[1], [1]], "sample 1: token id 7 outside"),
        ([[1], [2]], [[1]], "loss_masks has fewer samples"),
        ([[1]], [[1], [1]], "loss_masks has more samples"),
    ],
)
def test_count_tokens_bad_input(ids, masks, message):
    with pytest.raises(ValueError, match=message):
        count_tokens(ids, masks, 6)


def test_build_mapping_hand_example_with_ties():
    counts = np.array([5, 0, 3, 3, 7, 0, 3, 1])
    # Top 4: id 4 (7), id 0 (5), then three ids tie at 3 (2, 3, 6): the smaller ids 2, 3 win.
    d2t, t2d = build_mapping(counts, 4)
    assert d2t.dtype == torch.int64 and d2t.tolist() == [0, 1, 1, 1]  # target ids 0, 2, 3, 4
    assert t2d.dtype == torch.bool and t2d.tolist() == [True, False, True, True, True, False, False, False]
    # More draft ids than seen tokens: unseen ids (count 0) fill in by smaller id.
    d2t, _ = build_mapping(counts, 7)
    assert (torch.arange(7) + d2t).tolist() == [0, 1, 2, 3, 4, 6, 7]
    with pytest.raises(ValueError, match="draft_vocab_size must be in"):
        build_mapping(counts, 9)
    # The same ranking whatever the counts' dtype: unsigned (no wrap-around), float (expected counts).
    for dtype in (np.uint32, np.uint64, np.float32):
        assert torch.equal(build_mapping(counts.astype(dtype), 4)[1], build_mapping(counts, 4)[1]), dtype
    with pytest.raises(ValueError, match="finite numbers"):
        build_mapping(np.array([1.0, np.nan, 2.0]), 2)


def test_build_mapping_matches_speculators():
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    rng = np.random.default_rng(0)
    counts = rng.integers(0, 20, size=500)  # many ties
    d2t, t2d = build_mapping(counts, 64)
    want_d2t, want_t2d = build_vocab_mappings_from_distribution({i: int(c) for i, c in enumerate(counts)}, 64, 500)
    assert torch.equal(d2t, want_d2t) and torch.equal(t2d, want_t2d)


def test_save_load_round_trip(tmp_path):
    d2t, t2d = build_mapping(np.arange(50)[::-1].copy(), 10)
    path = save_mapping(mapping_path(tmp_path / "data", 10), d2t, t2d, {"source": "train.jsonl"})
    assert path == tmp_path / "data" / "vocab_map_10.safetensors" and path.is_file()
    got_d2t, got_t2d, meta = load_mapping(path, target_vocab_size=50, draft_vocab_size=10)
    assert torch.equal(got_d2t, d2t) and torch.equal(got_t2d, t2d) and meta == {"source": "train.jsonl"}
    assert not list(path.parent.glob("*.tmp"))


def test_load_with_wrong_sizes_names_the_field(tmp_path):
    d2t, t2d = build_mapping(np.arange(50), 10)
    path = save_mapping(tmp_path / "map.safetensors", d2t, t2d)
    with pytest.raises(ValueError, match="d2t has 10 entries but draft_vocab_size is 12"):
        load_mapping(path, draft_vocab_size=12)
    with pytest.raises(ValueError, match="t2d has 50 entries but the verifier vocabulary has 64"):
        load_mapping(path, target_vocab_size=64)


def test_malformed_files_are_refused(tmp_path):
    d2t, t2d = build_mapping(np.arange(50), 10)
    header = {"format": "dspark-vocab-mapping", "format_version": "1", "meta": "{}"}
    short_t2d = tmp_path / "short.safetensors"
    save_file({"d2t": d2t, "t2d": t2d[:45].clone()}, str(short_t2d), metadata=header)
    with pytest.raises(ValueError, match=r"d2t maps to target ids outside \[0, 45\) \(the size of t2d\)"):
        load_mapping(short_t2d)
    missing = tmp_path / "missing.safetensors"
    save_file({"d2t": d2t}, str(missing), metadata=header)
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['t2d'\]"):
        load_mapping(missing)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"d2t": d2t, "t2d": t2d}, str(foreign))
    with pytest.raises(ValueError, match="not a vocab mapping"):
        load_mapping(foreign)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_mapping(tmp_path / "nothing.safetensors")


def test_check_same_mapping():
    counts = np.arange(40)
    a = build_mapping(counts, 8)
    check_same_mapping(a, build_mapping(counts.copy(), 8))  # same counts, same mapping

    other = counts.copy()
    other[0] = 100  # id 0 displaces id 32, the least frequent of the top 8
    message = r"\(checkpoint vs data\): d2t differs at 1 draft id\(s\); draft id 0 is target id 32 vs 0"
    with pytest.raises(ValueError, match=message):
        check_same_mapping(a, build_mapping(other, 8), names=("checkpoint", "data"))
    with pytest.raises(ValueError, match=r"d2t has 8 vs 9 entries \(draft_vocab_size\)"):
        check_same_mapping(a, build_mapping(counts, 9))
    with pytest.raises(ValueError, match=r"t2d has 40 vs 41 entries"):
        check_same_mapping(a, build_mapping(np.arange(1, 42), 8))
