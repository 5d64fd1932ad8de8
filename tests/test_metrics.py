"""dspark.metrics against naive loops: honest acceptance, τ, and per-position aggregation."""

from __future__ import annotations

import pytest
import torch

from dspark.metrics import AcceptanceStats, acceptance, expected_length

V = 30


def random_probs(*shape, generator, scale=2.0):
    return torch.softmax(scale * torch.randn(*shape, generator=generator, dtype=torch.float64), dim=-1)


def reduced_vocab(size: int, generator) -> tuple[torch.Tensor, list[int]]:
    ids = torch.randperm(V, generator=generator)[:size].sort().values
    return ids - torch.arange(size), ids.tolist()


def naive_acceptance(q_row, p_row, draft_ids):
    """Σ_v min(q, p) over the full vocabulary, with q = 0 outside the draft ids."""
    total = 0.0
    for v in range(V):
        q_v = float(q_row[draft_ids.index(v)]) if v in draft_ids else 0.0
        total += min(q_v, float(p_row[v]))
    return total


@pytest.mark.parametrize("draft_vocab", [None, 12])
def test_acceptance_matches_naive_loop(draft_vocab):
    g = torch.Generator().manual_seed(0)
    d2t, draft_ids = (None, list(range(V))) if draft_vocab is None else reduced_vocab(draft_vocab, g)
    q = random_probs(9, len(draft_ids), generator=g)
    p = random_probs(9, V, generator=g)
    got = acceptance(q, p, d2t)
    want = torch.tensor([naive_acceptance(q[i], p[i], draft_ids) for i in range(9)], dtype=torch.float64)
    torch.testing.assert_close(got, want)
    # Same thing as 1 − total-variation distance over the full vocabulary.
    q_full = torch.zeros(9, V, dtype=torch.float64)
    q_full[:, draft_ids] = q
    torch.testing.assert_close(got, 1 - 0.5 * (q_full - p).abs().sum(-1))


def test_target_mass_outside_draft_vocab_is_rejected():
    """A draft equal to the renormalized in-vocabulary target is accepted only with that mass."""
    g = torch.Generator().manual_seed(1)
    d2t, draft_ids = reduced_vocab(10, g)
    p = random_probs(5, V, generator=g)
    in_vocab = p[:, draft_ids]
    mass = in_vocab.sum(-1)
    q = in_vocab / mass.unsqueeze(-1)
    torch.testing.assert_close(acceptance(q, p, d2t), mass)
    assert bool((mass < 0.99).all())  # never 1: a renormalized target would claim full acceptance


def test_acceptance_width_mismatch_is_a_clear_error():
    g = torch.Generator().manual_seed(2)
    d2t, _ = reduced_vocab(10, g)
    with pytest.raises(ValueError, match="d2t has 10"):
        acceptance(random_probs(2, 11, generator=g), random_probs(2, V, generator=g), d2t)
    with pytest.raises(ValueError, match="pass d2t"):
        acceptance(random_probs(2, 11, generator=g), random_probs(2, V, generator=g), None)


def random_alpha_and_mask(n, block, generator):
    alpha = torch.rand(n, block, generator=generator, dtype=torch.float64)
    lengths = torch.randint(0, block + 1, (n,), generator=generator)
    lengths[0] = block
    return alpha, torch.arange(block) < lengths.unsqueeze(1)


def naive_tau(alpha_row, mask_row):
    tau, prefix = 1.0, 1.0
    for a, m in zip(alpha_row.tolist(), mask_row.tolist(), strict=True):
        if not m:
            break
        prefix *= a
        tau += prefix
    return tau


def test_expected_length_matches_naive_loop():
    g = torch.Generator().manual_seed(3)
    alpha, mask = random_alpha_and_mask(20, 5, g)
    want = torch.tensor([naive_tau(alpha[i], mask[i]) for i in range(20)], dtype=torch.float64)
    torch.testing.assert_close(expected_length(alpha, mask), want)
    full_block = torch.ones(1, 4, dtype=torch.bool)
    torch.testing.assert_close(expected_length(torch.ones(1, 4), full_block), torch.tensor([5.0]))


def test_acceptance_stats_aggregate_across_batches():
    g = torch.Generator().manual_seed(4)
    batches = [random_alpha_and_mask(n, 4, g) for n in (6, 9, 3)]
    stats = AcceptanceStats.from_alpha(*batches[0])
    for batch in batches[1:]:
        stats = stats + AcceptanceStats.from_alpha(*batch)

    alpha = torch.cat([a for a, _ in batches])
    mask = torch.cat([m for _, m in batches])
    conditional, cumulative, taus = [], [], []
    for k in range(4):
        rows = [i for i in range(len(alpha)) if mask[i, k]]
        conditional.append(sum(float(alpha[i, k]) for i in rows) / len(rows))
        cumulative.append(sum(float(alpha[i, : k + 1].prod()) for i in rows) / len(rows))
    taus = [naive_tau(alpha[i], mask[i]) for i in range(len(alpha)) if mask[i, 0]]

    torch.testing.assert_close(stats.conditional(), torch.tensor(conditional, dtype=torch.float64))
    torch.testing.assert_close(stats.cumulative(), torch.tensor(cumulative, dtype=torch.float64))
    torch.testing.assert_close(stats.tau(), torch.tensor(sum(taus) / len(taus), dtype=torch.float64))
    torch.testing.assert_close(stats.slots, mask.sum(0).double())
