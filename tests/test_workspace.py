"""Reused loss buffers (dspark.workspace) and the tiled vocabulary projection: results never change."""

from __future__ import annotations

import pytest
import torch
from drafts import draft_config, make_draft, random_d2t

from dspark.config import LossConfig
from dspark.losses import LossInputs, dspark_loss
from dspark.verifier import VerifierHead
from dspark.vocab_matmul import COLUMN_TILE, project_into
from dspark.workspace import Workspace


@pytest.fixture(scope="module")
def verifier(tiny_qwen3_dir) -> VerifierHead:
    return VerifierHead.from_pretrained(tiny_qwen3_dir)


def test_take_reuses_idle_memory_only():
    ws = Workspace()
    first = ws.take("a", (3, 5), torch.float32, torch.device("cpu"))
    ptr = first.data_ptr()
    held = ws.take("a", (3, 5), torch.float32, "cpu")  # `first` is alive: fresh memory
    assert held.data_ptr() != ptr
    del first, held
    again = ws.take("a", (2, 4), torch.float32, "cpu")  # idle and large enough: the same memory
    assert again.data_ptr() == ptr and again.shape == (2, 4)
    del again
    grown = ws.take("a", (4, 5), torch.float32, "cpu")  # larger: a new buffer replaces it
    assert grown.shape == (4, 5) and ws.nbytes() == 4 * 5 * 4
    del grown
    assert ws.take("a", (4, 5), torch.float64, "cpu").dtype == torch.float64
    assert ws.nbytes() == 4 * 5 * 8

    # A tensor saved for backward holds the buffer too: the next take must not overwrite it.
    x = torch.ones(3, requires_grad=True)
    saved = ws.take("b", (3,), torch.float32, "cpu").fill_(2.0)
    y = (x * saved).sum()
    del saved
    ws.take("b", (3,), torch.float32, "cpu").fill_(-7.0)
    y.backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def loss_cfg(chunk_size: int) -> LossConfig:
    return LossConfig(
        weights={"ce": 0.1, "tv": 0.9, "kl": 0.2},
        confidence_weight=0.5,
        gamma=4.0,
        num_anchors=4,
        chunk_size=chunk_size,
        anchor_sampling="uniform",
        hidden_weight=0.0,
        hidden_slots=None,
        train_on_prompt=False,
    )


@pytest.mark.parametrize(
    "overrides, draft_vocab",
    [
        ({}, None),
        ({"markov_type": "gated", "draft_vocab_size": 700}, 700),
        ({"markov_rank": 0, "confidence_head_with_markov": False}, None),
    ],
    ids=["vanilla", "gated-reduced-vocab", "no-markov"],
)
@pytest.mark.parametrize("keep_budget", [None, 0], ids=["kept", "recomputed"])
def test_loss_and_gradients_equal_without_workspace_over_steps(verifier, overrides, draft_vocab, keep_budget):
    """Three steps on different inputs with one workspace (buffers reused from step to step,
    chunks kept or recomputed in backward) give the same loss, α and gradients as fresh memory."""
    d2t = None if draft_vocab is None else random_d2t(verifier.vocab_size, draft_vocab)
    model = make_draft(verifier, draft_config(**overrides), d2t=d2t)
    heads = [m for m in (model.markov_head, model.confidence_head) if m is not None]
    params = [p for m in heads for p in m.parameters()]  # what the loss reaches besides `hidden`
    cfg = loss_cfg(chunk_size=2 * 4)  # several chunks of two blocks
    ws = Workspace()
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        n, B, H = 5, 4, verifier.hidden_size
        hidden = torch.randn(n, B, H, generator=g, requires_grad=True)
        prev = torch.randint(0, 1000, (n, B), generator=g)
        labels = torch.randint(0, 1000, (n, B), generator=g)
        target_hidden = 3 * torch.randn(n, B, H, generator=g)
        slot_mask = torch.arange(B) < torch.tensor([4, 0, 3, 4, 1])[:, None]
        outs = []
        for workspace in (None, ws):
            blocks = (hidden, prev, target_hidden, labels, slot_mask)
            inputs = LossInputs(model.heads, verifier.logits, *blocks, with_confidence=True, d2t=model.d2t)
            out = dspark_loss(inputs, cfg, keep_budget=keep_budget, workspace=workspace)
            outs.append((out, torch.autograd.grad(out.loss, [hidden, *params])))
        (ref, ref_grads), (got, got_grads) = outs
        torch.testing.assert_close(got.loss, ref.loss, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got.alpha, ref.alpha, rtol=1e-6, atol=1e-7)
        assert any(r.abs().sum() > 0 for r in ref_grads)
        for a, b in zip(got_grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert ws.nbytes() > 0


def test_heads_reuse_logits_memory_only_when_released(verifier):
    model = make_draft(verifier, draft_config())
    ws = Workspace()
    hidden, prev = torch.randn(2, 4, verifier.hidden_size), torch.randint(0, 1000, (2, 4))
    want = model.heads(hidden, prev)[0]
    first = model.heads(hidden, prev, workspace=ws)[0]
    torch.testing.assert_close(first, want)
    kept, first_ptr = first.clone(), first.data_ptr()
    second = model.heads(2 * hidden, prev, workspace=ws)[0]  # `first` is still alive: fresh memory
    assert second.data_ptr() != first_ptr
    torch.testing.assert_close(first, kept)
    del first, second
    third = model.heads(hidden, prev, workspace=ws)[0]  # released: the workspace's memory again
    assert third.data_ptr() == first_ptr
    torch.testing.assert_close(third, want)


@pytest.mark.parametrize("accumulate", [False, True])
def test_tiled_projection_equals_one_gemm(accumulate):
    """Column tiles (a vocabulary that is not a multiple of the tile) give the GEMM's values."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 16, generator=g), torch.randn(2 * COLUMN_TILE + 37, 16, generator=g)
    start = torch.randn(6, w.shape[0], generator=g)
    out = project_into(x, w, start.clone(), accumulate=accumulate)
    want = x @ w.t() + (start if accumulate else 0)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-5)
