"""train.ema: the weight average against a hand computation, swapped in and out, saved with the optimizer."""

from __future__ import annotations

import torch

from train.ema import KEY, WeightAverage, ema_decay


def test_average_matches_hand_computation_and_survives_the_optimizer_state():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = torch.optim.AdamW([p], lr=0.1)
    avg = WeightAverage([p], opt, decay=0.5)
    seen = []
    for step in (1, 2, 3):
        p.grad = torch.tensor([1.0, -1.0]) * step
        opt.step()
        avg.update(step)
        seen.append(p.detach().clone())
    # d_1 unused (the first step starts the average), d_2 = min(.5, 3/12) = .25, d_3 = min(.5, 4/13)
    assert ema_decay(0.5, 2) == 0.25 and ema_decay(0.5, 3) == 4 / 13 and ema_decay(0.5, 100) == 0.5
    expected = seen[0]
    for step, w in ((2, seen[1]), (3, seen[2])):
        d = ema_decay(0.5, step)
        expected = d * expected + (1 - d) * w
    torch.testing.assert_close(opt.state[p][KEY], expected)
    assert not torch.allclose(expected, p.detach())

    raw = p.detach().clone()
    with avg.applied():
        torch.testing.assert_close(p.detach(), expected)
    assert torch.equal(p.detach(), raw)  # training continues from the raw weights

    # a checkpoint's optimizer state carries the average; AdamW keeps stepping with it loaded
    q = torch.nn.Parameter(raw.clone())
    opt2 = torch.optim.AdamW([q], lr=0.1)
    opt2.load_state_dict(opt.state_dict())
    torch.testing.assert_close(opt2.state[q][KEY], expected)
    q.grad = torch.ones(2)
    opt2.step()
    WeightAverage([q], opt2, 0.5).update(4)
    d = ema_decay(0.5, 4)
    torch.testing.assert_close(opt2.state[q][KEY], d * expected + (1 - d) * q.detach())
