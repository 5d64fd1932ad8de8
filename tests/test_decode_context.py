"""The decoder's per-row cache of the drafter's context keys and values (eval.speculative.DraftContext)
gives the block hidden states the drafter's full forward gives when it re-projects the whole context."""

from __future__ import annotations

import pytest
import torch
from decode_fixtures import AUX_LAYER_IDS, make_small_verifier, small_draft
from transformers import Qwen3ForCausalLM

from dspark.eval.speculative import DraftContext, SpeculativeDecoder, Verifier


@pytest.mark.parametrize(
    "window, causal", [(None, False), (3, False), (3, True)], ids=["full", "sliding", "sliding-causal"]
)
@torch.no_grad()
def test_cached_context_equals_full_reprojection(tmp_path, window, causal):
    verifier_dir = make_small_verifier(tmp_path / "verifier", vocab=16, seed=0)
    verifier = Verifier(Qwen3ForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32), AUX_LAYER_IDS)
    draft = small_draft(verifier_dir, None, block_size=4, seed=2, sliding_window=window, causal_in_block=causal)
    decoder = SpeculativeDecoder(verifier, draft)
    B = decoder.block_size
    g = torch.Generator().manual_seed(0)
    n_ctx = torch.tensor([3, 9, 1, 6])  # rows of different lengths
    b, steps = len(n_ctx), 6
    capacity = int(n_ctx.max()) + steps * (B + 1) + 1
    # Aux states of every position a row will reach; the full forward also reads the (masked) columns
    # past each row's context, which hold other values than the cache's zeros there.
    aux = torch.randn(b, capacity, draft.fc.in_features, generator=g)
    tokens = torch.randint(0, draft.verifier_vocab_size - 1, (b, capacity), generator=g)
    context = DraftContext(draft, b, capacity)
    rows, cols = (torch.arange(capacity)[None] < n_ctx[:, None]).nonzero(as_tuple=True)
    context.append(aux[rows, cols], rows, cols)
    active = torch.ones(b, dtype=torch.bool)

    def reprojected(n_ctx):
        """The drafter's forward over every context token, one anchor per row."""
        width = int(n_ctx.max()) + 1
        return draft(aux[:, :width], tokens[:, :width], n_ctx[:, None], torch.ones(b, 1, dtype=torch.bool))[:, 0]

    for step in range(steps):
        cached = decoder.block_hidden(context, n_ctx, tokens[torch.arange(b), n_ctx])
        torch.testing.assert_close(cached, reprojected(n_ctx), rtol=1e-5, atol=1e-5)
        # the anchor and its accepted drafts join the context; a finished row stops growing
        accepted = torch.randint(0, B + 1, (b,), generator=g)
        if step == 2:
            active[1] = False
        keep = (torch.arange(B + 1)[None] <= accepted[:, None]) & active[:, None]
        r, j = keep.nonzero(as_tuple=True)
        context.append(aux[r, n_ctx[r] + j], r, n_ctx[r] + j)
        n_ctx = torch.where(active, n_ctx + accepted + 1, n_ctx)
    assert int(n_ctx.max()) > 3 * B, "the rows grew too little to test a long context"
    # the comparison can fail: row 0's last context token cached with another token's states
    context.append(aux[0, :1], torch.zeros(1, dtype=torch.long), n_ctx[:1] - 1)
    stale = decoder.block_hidden(context, n_ctx, tokens[torch.arange(b), n_ctx])
    full = reprojected(n_ctx)
    assert not torch.allclose(stale[0], full[0], atol=1e-3)
    torch.testing.assert_close(stale[1:], full[1:], rtol=1e-5, atol=1e-5)


def test_a_non_vanilla_markov_head_is_refused(tmp_path):
    verifier_dir = make_small_verifier(tmp_path / "verifier", vocab=16, seed=0)
    verifier = Verifier(Qwen3ForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32), AUX_LAYER_IDS)
    with pytest.raises(ValueError, match="'gated' Markov head: vLLM builds only the vanilla"):
        SpeculativeDecoder(verifier, small_draft(verifier_dir, None, block_size=4, markov_type="gated"))
