"""dspark.anchors against naive loops, with packed documents and padded rows."""

from __future__ import annotations

import pytest
import torch

from dspark.anchors import anchor_candidates, sample_anchors, slot_targets


def random_batch(seed: int, b: int = 4, seq_len: int = 24, docs: bool = True):
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.rand(b, seq_len, generator=g) < 0.7
    loss_mask[-1] = False  # a row without any candidate
    document_ids = None
    if docs:  # packed rows: random document boundaries
        document_ids = (torch.rand(b, seq_len, generator=g) < 0.2).long().cumsum(1)
    input_ids = torch.randint(0, 1000, (b, seq_len), generator=g)
    return input_ids, loss_mask, document_ids


def naive_candidates(loss_mask, document_ids):
    b, seq_len = loss_mask.shape
    out = [[] for _ in range(b)]
    for r in range(b):
        for p in range(seq_len - 1):
            same_doc = document_ids is None or document_ids[r, p] == document_ids[r, p + 1]
            if loss_mask[r, p] and loss_mask[r, p + 1] and same_doc:
                out[r].append(p)
    return out


@pytest.mark.parametrize("docs", [False, True])
def test_candidates_match_naive_loop(docs):
    _, loss_mask, document_ids = random_batch(0, docs=docs)
    cand = anchor_candidates(loss_mask, document_ids)
    assert [row.nonzero().flatten().tolist() for row in cand] == naive_candidates(loss_mask, document_ids)


@pytest.mark.parametrize("num_anchors", [1, 5, 100])
def test_sample_anchors_are_distinct_sorted_candidates(num_anchors):
    _, loss_mask, document_ids = random_batch(1)
    expected = naive_candidates(loss_mask, document_ids)
    anchors, valid = sample_anchors(loss_mask, num_anchors, torch.Generator().manual_seed(0), document_ids)
    assert anchors.shape == valid.shape
    assert anchors.shape[1] == max(1, min(num_anchors, max(len(c) for c in expected)))
    for r, cands in enumerate(expected):
        chosen = anchors[r][valid[r]].tolist()
        assert len(chosen) == min(num_anchors, len(cands))
        assert chosen == sorted(set(chosen)) and set(chosen) <= set(cands)
        assert not valid[r, len(chosen) :].any()  # padding comes last
        assert (anchors[r][~valid[r]] == 0).all()


def test_sample_anchors_is_reproducible_and_uniform():
    loss_mask = torch.zeros(1, 12, dtype=torch.bool)
    loss_mask[0, 2:8] = True  # candidates 2..6
    draws = [sample_anchors(loss_mask, 2, torch.Generator().manual_seed(s))[0][0].tolist() for s in range(3000)]
    again = [sample_anchors(loss_mask, 2, torch.Generator().manual_seed(s))[0][0].tolist() for s in range(5)]
    assert again == draws[:5]
    assert len({tuple(d) for d in draws}) == 10  # all C(5, 2) pairs occur
    for p in range(2, 7):  # each candidate is chosen with probability 2/5
        freq = sum(p in d for d in draws) / len(draws)
        assert abs(freq - 0.4) < 0.04, (p, freq)


def test_sample_anchors_without_candidates_pads_one_invalid_anchor():
    anchors, valid = sample_anchors(torch.zeros(2, 5, dtype=torch.bool), 4, torch.Generator().manual_seed(0))
    assert anchors.tolist() == [[0], [0]] and not valid.any()
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(torch.ones(1, 5, dtype=torch.bool), 0, torch.Generator())


def naive_slots(input_ids, loss_mask, anchors, valid, block_size, document_ids):
    b, seq_len = input_ids.shape
    labels, positions, masks = [], [], []
    for r in range(b):
        for j in range(anchors.shape[1]):
            p = int(anchors[r, j])
            alive = bool(valid[r, j])
            for k in range(block_size):
                label_pos = p + k + 1
                ok = alive and label_pos < seq_len and bool(loss_mask[r, label_pos])
                if ok and document_ids is not None:
                    ok = bool(document_ids[r, label_pos] == document_ids[r, p])
                alive = ok
                masks.append(ok)
                if ok:
                    labels.append(int(input_ids[r, label_pos]))
                    positions.append(p + k)
    return labels, positions, masks


@pytest.mark.parametrize("docs", [False, True])
def test_slot_targets_match_naive_loop(docs):
    input_ids, loss_mask, document_ids = random_batch(2, seq_len=30, docs=docs)
    anchors, valid = sample_anchors(loss_mask, 10, torch.Generator().manual_seed(1), document_ids)
    valid[0, 0] = False  # a block dropped by the caller
    anchors[1, -1], valid[1, -1] = 28, True  # runs past the end of the row
    labels, target_pos, slot_mask = slot_targets(input_ids, loss_mask, anchors, valid, 5, document_ids)
    want_labels, want_pos, want_mask = naive_slots(input_ids, loss_mask, anchors, valid, 5, document_ids)
    assert slot_mask.flatten().tolist() == want_mask
    assert labels[slot_mask].tolist() == want_labels
    assert target_pos[slot_mask].tolist() == want_pos
    assert 0 < sum(want_mask) < len(want_mask)
    assert int(target_pos.max()) < 30  # unscored slots are clamped into range


def test_slot_mask_stops_at_a_document_boundary_and_a_gap():
    input_ids = torch.arange(10).unsqueeze(0)
    loss_mask = torch.ones(1, 10, dtype=torch.bool)
    loss_mask[0, 7] = False
    document_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    anchors = torch.tensor([[1, 5]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    labels, target_pos, slot_mask = slot_targets(input_ids, loss_mask, anchors, valid, 4, document_ids)
    # Anchor 1: labels 2, 3 in document 0, then 4 is document 1. Anchor 5: label 6, then 7 is masked
    # (8 would be trained but the prefix is broken).
    assert slot_mask.tolist() == [[[True, True, False, False], [True, False, False, False]]]
    assert labels[0, 0, :2].tolist() == [2, 3] and target_pos[0, 0, :2].tolist() == [1, 2]
    assert labels[0, 1, 0].item() == 6 and target_pos[0, 1, 0].item() == 5


def test_train_anchors_modes():
    from dspark.anchors import train_anchors

    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    every = anchor_candidates(loss_mask)[0].nonzero().flatten()  # [1, 2, 3, 4, 5, 8]
    gen = torch.Generator().manual_seed(0)
    anchors, valid = train_anchors(loss_mask, 2, gen, "all")
    assert anchors[valid].tolist() == every.tolist()
    # uniform is `sample_anchors` itself: same generator state, same draw
    a1, _ = train_anchors(loss_mask, 3, torch.Generator().manual_seed(5), "uniform")
    a2, _ = sample_anchors(loss_mask, 3, torch.Generator().manual_seed(5))
    assert a1.tolist() == a2.tolist()
    with pytest.raises(ValueError, match="anchor_sampling"):
        train_anchors(loss_mask, 1, gen, "best")
