"""The DSpark draft model: batched block attention vs one anchor at a time, sizing, errors."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from drafts import QWEN3_MASK_TOKEN_ID, draft_config, make_draft, packed_inputs, random_d2t
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen3Config

from dspark.attention import BlockLayout
from dspark.errors import UserError
from dspark.model import DSparkDraft, draft_layer_config
from dspark.verifier import VerifierHead, resolve_aux_layer_ids, resolve_mask_token_id


@pytest.fixture(scope="module")
def verifier(tiny_qwen3_dir) -> VerifierHead:
    return VerifierHead.from_pretrained(tiny_qwen3_dir)


# --- an independent, one-anchor-at-a-time computation ---------------------------------


def naive_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [L, heads, d] rotated by the textbook RoPE formula at `positions` [L]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :].float()
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :].float()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def naive_block(model: DSparkDraft, context, input_ids, document_ids, position_ids, p: int) -> torch.Tensor:
    """Hidden states [B, H] of the block anchored at p, attending only what it may see.

    The visible context is selected by position (same document, strictly before p, inside the
    window); attention is a plain per-head softmax over [visible context ; own block].
    """
    cfg, lc = model.cfg, model.layer_config
    B, hd = cfg.block_size, lc.head_dim
    theta = lc.rope_parameters["rope_theta"]
    visible = [
        t
        for t in range(p)
        if document_ids[t] == document_ids[p] and (cfg.sliding_window is None or t >= p - cfg.sliding_window)
    ]
    visible = torch.tensor(visible, dtype=torch.long)
    ctx = model.hidden_norm(model.fc(context[visible]))
    n = len(visible)
    x = model.embed_tokens(torch.tensor([int(input_ids[p])] + [QWEN3_MASK_TOKEN_ID] * (B - 1)))
    block_pos = position_ids[p] + torch.arange(B)
    key_pos = torch.cat([position_ids[visible], block_pos])
    group = lc.num_attention_heads // lc.num_key_value_heads
    for layer in model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        keys_in = torch.cat([ctx, h])
        q = naive_rope(attn.q_norm(attn.q_proj(h).view(B, -1, hd)), block_pos, theta)
        k = naive_rope(attn.k_norm(attn.k_proj(keys_in).view(n + B, -1, hd)), key_pos, theta)
        v = attn.v_proj(keys_in).view(n + B, -1, hd)
        heads = []
        for head in range(lc.num_attention_heads):
            scores = q[:, head] @ k[:, head // group].T / math.sqrt(hd)
            if cfg.causal_in_block:
                later = torch.ones(B, B, dtype=torch.bool).triu(1)
                scores[:, n:] = scores[:, n:].masked_fill(later, float("-inf"))
            heads.append(scores.softmax(-1) @ v[:, head // group])
        x = x + attn.o_proj(torch.cat(heads, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x)


@pytest.mark.parametrize(
    "window, causal",
    [(None, False), (5, False), (None, True), (5, True)],
    ids=["full", "sliding", "full-causal", "sliding-causal"],
)
def test_batched_blocks_match_one_anchor_at_a_time(verifier, window, causal):
    model = make_draft(verifier, draft_config(sliding_window=window, causal_in_block=causal))
    T = 22
    context, input_ids = packed_inputs(2, T, 3, verifier.hidden_size)
    # Row 0: three packed documents; row 1: one document with positions offset by 7.
    document_ids = torch.tensor([[0] * 7 + [1] * 9 + [2] * 6, [0] * T])
    position_ids = torch.stack(
        [
            torch.cat([torch.arange(7), torch.arange(9), torch.arange(6)]),
            torch.arange(7, 7 + T),
        ]
    )
    anchors = torch.tensor([[0, 3, 6, 7, 12, 16, 19], [1, 5, 8, 13, 17, 20, 21]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    valid[1, -1] = False  # a padding anchor: computed, never compared

    with torch.no_grad():
        hidden = model(context, input_ids, anchors, valid, document_ids, position_ids)
        prev = model.block_tokens(input_ids, anchors)
        logits = model.draft_logits(hidden.flatten(0, 1), prev.flatten(0, 1)).view(*prev.shape, -1)
        for b in range(2):
            for j in range(anchors.shape[1]):
                if not valid[b, j]:
                    continue
                p = int(anchors[b, j])
                expected = naive_block(model, context[b], input_ids[b], document_ids[b], position_ids[b], p)
                torch.testing.assert_close(hidden[b, j], expected, rtol=1e-4, atol=1e-4)
                # Logits by hand: frozen lm_head rows plus W2(W1[token at p+k]).
                prev_tokens = input_ids[b, torch.arange(p, p + 4).clamp(max=T - 1)]
                head = model.markov_head
                expected_logits = expected @ verifier.lm_head_weight.T + head.markov_w2(head.markov_w1(prev_tokens))
                torch.testing.assert_close(logits[b, j], expected_logits, rtol=1e-4, atol=1e-4)


def test_block_inputs_and_tokens_by_hand(verifier):
    model = make_draft(verifier, draft_config(block_size=3))
    input_ids = torch.tensor([[10, 11, 12, 13, 14]])
    anchors = torch.tensor([[0, 3]])
    m = QWEN3_MASK_TOKEN_ID
    assert model.block_inputs(input_ids, anchors).tolist() == [[[10, m, m], [13, m, m]]]
    # Slot k's previous token is the token at p+k, clamped at the row's end.
    assert model.block_tokens(input_ids, anchors).tolist() == [[[10, 11, 12], [13, 14, 14]]]


def test_blocks_ignore_later_context_and_other_documents(verifier):
    """Changing context after an anchor, or in another document, leaves its block unchanged."""
    model = make_draft(verifier, draft_config())
    context, input_ids = packed_inputs(1, 16, 3, verifier.hidden_size)
    document_ids = torch.tensor([[0] * 6 + [1] * 10])
    anchors, valid = torch.tensor([[9]]), torch.tensor([[True]])
    changed = context.clone()
    changed[0, 9:] += 1.0  # the anchor position itself and everything after it
    changed[0, :6] += 1.0  # the other document
    with torch.no_grad():
        before = model(context, input_ids, anchors, valid, document_ids)
        after = model(changed, input_ids, anchors, valid, document_ids)
        changed[0, 8] += 1.0  # the last visible context position does matter
        moved = model(changed, input_ids, anchors, valid, document_ids)
    torch.testing.assert_close(before, after)
    assert not torch.allclose(before, moved)


def test_only_context_a_block_can_see_is_projected(verifier):
    """Row padding and the tail after a row's last valid anchor skip `fc` (and the k/v projections)."""
    model = make_draft(verifier, draft_config())
    context, input_ids = packed_inputs(2, 12, 3, verifier.hidden_size)
    anchors = torch.tensor([[2, 5], [3, 9]])
    valid = torch.tensor([[True, False], [True, True]])
    rows = []
    handle = model.fc.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    with torch.no_grad():
        hidden = model(context, input_ids, anchors, valid)
        alone = model(context[1:, :10], input_ids[1:, :10], anchors[1:], valid[1:])
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the CUDA default's mixed precision
            low = model(context, input_ids, anchors, valid)
    handle.remove()
    assert rows == [2 + 9, 9, 2 + 9]  # positions < 2 of row 0 and < 9 of row 1; row 1 alone; again
    torch.testing.assert_close(hidden[1], alone[0])
    torch.testing.assert_close(low.float(), hidden, rtol=0.1, atol=0.1)


def test_row_without_anchors_gives_empty_blocks_and_bf16_context_is_accepted(verifier):
    model = make_draft(verifier, draft_config())
    context, input_ids = packed_inputs(1, 2, 3, verifier.hidden_size)
    none = torch.zeros(1, 0, dtype=torch.long)
    hidden = model(context.bfloat16(), input_ids, none, none.bool())
    assert hidden.shape == (1, 0, 4, verifier.hidden_size) and hidden.dtype == torch.float32


def test_reduced_vocab_lm_head_is_verifier_rows(verifier):
    d2t = random_d2t(verifier.vocab_size, 500)
    model = make_draft(verifier, draft_config(draft_vocab_size=500), d2t=d2t)
    target = torch.arange(500) + d2t
    assert torch.equal(model.lm_head.weight, verifier.lm_head_weight[target])
    assert model.t2d.sum() == 500 and model.t2d[target].all()
    hidden = torch.randn(3, 4, verifier.hidden_size)
    prev = torch.randint(0, 1000, (3, 4))
    assert model.draft_logits(hidden, prev).shape == (3, 4, 500)


@pytest.mark.parametrize("markov_type", ["vanilla", "gated", "rnn"])
def test_heads_shapes_and_markov_dependence(verifier, markov_type):
    model = make_draft(verifier, draft_config(markov_type=markov_type))
    hidden = torch.randn(3, 4, verifier.hidden_size)
    prev = torch.randint(0, 1000, (3, 4))
    logits = model.draft_logits(hidden, prev)
    assert logits.shape == (3, 4, verifier.vocab_size)
    assert model.confidence_logits(hidden, prev).shape == (3, 4)
    both = model.heads(hidden, prev)  # the training path: one W1 lookup for both heads
    torch.testing.assert_close(both[0], logits)
    torch.testing.assert_close(both[1], model.confidence_logits(hidden, prev))
    empty = model.heads(hidden[:0], prev[:0])  # a rank with no block still runs the heads
    assert empty[0].shape == (0, 4, verifier.vocab_size) and empty[1].shape == (0, 4)
    other = prev.clone()
    other[:, 1] += 1
    # Slot 1's bias depends on its previous token; slot 0's never does.
    changed = model.draft_logits(hidden, other)
    torch.testing.assert_close(changed[:, 0], logits[:, 0])
    assert not torch.allclose(changed[:, 1], logits[:, 1])
    # Under bf16 autocast (the CUDA default) the logits are bf16 and match float32 to bf16 precision.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model.draft_logits(hidden, prev)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), logits, rtol=0.05, atol=0.05)


# --- sizing from other verifier families ----------------------------------------------


def tiny_llama_config(**kw) -> LlamaConfig:
    base = dict(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**{**base, **kw})


def random_head(config) -> VerifierHead:
    V, H = config.vocab_size, config.hidden_size
    return VerifierHead(config, torch.randn(V, H), 1 + 0.1 * torch.randn(H), torch.randn(V, H))


def forward_smoke(model: DSparkDraft, vocab: int) -> torch.Tensor:
    context = torch.randn(1, 12, len(model.aux_layer_ids) * model.layer_config.hidden_size)
    input_ids = torch.randint(0, vocab, (1, 12))
    anchors, valid = torch.tensor([[2, 7]]), torch.ones(1, 2, dtype=torch.bool)
    return model(context, input_ids, anchors, valid)


def test_sizes_from_llama_config():
    config = tiny_llama_config()
    model = DSparkDraft(draft_config(num_layers=3, markov_rank=4), config, [1, 2], mask_token_id=299)
    model.load_verifier(random_head(config))
    lc = model.layer_config
    assert (lc.hidden_size, lc.num_attention_heads, lc.num_key_value_heads, lc.head_dim) == (48, 6, 2, 8)
    assert lc.num_hidden_layers == 3 and lc.intermediate_size == 96
    assert model.layers[0].self_attn.q_proj.weight.shape == (48, 48)
    assert model.layers[0].self_attn.k_proj.weight.shape == (16, 48)
    assert model.fc.weight.shape == (48, 96)
    assert forward_smoke(model, 300).shape == (1, 2, 4, 48)


def test_sizes_from_qwen2_config_without_head_dim():
    config = Qwen2Config(
        vocab_size=300,
        hidden_size=40,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=5,
        num_key_value_heads=1,
        max_position_embeddings=512,
    )
    assert getattr(config, "head_dim", None) is None
    model = DSparkDraft(draft_config(), config, [1], mask_token_id=299)
    model.load_verifier(random_head(config))
    assert model.layer_config.head_dim == 8
    assert forward_smoke(model, 300).shape == (1, 2, 4, 40)


def test_layer_config_round_trips():
    cfg = draft_config(sliding_window=16, causal_in_block=True)
    once = draft_layer_config(tiny_llama_config(), cfg)
    twice = draft_layer_config(once, cfg)
    assert once.to_dict() == twice.to_dict()
    assert once.layer_types == ["sliding_attention"] * 2 and once.sliding_window == 16 and once.is_causal


def test_verifier_head_loads_sharded_untied_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    head = VerifierHead.from_pretrained(tmp_path)
    h = torch.randn(5, 48)
    ids = torch.tensor([0, 7, 299])
    with torch.no_grad():
        torch.testing.assert_close(head.logits(h), model.lm_head(model.model.norm(h)))
        torch.testing.assert_close(head.embed(ids), model.model.embed_tokens(ids))
    assert head.lm_head_weight.data_ptr() != head.embed_tokens.weight.data_ptr()


def test_verifier_head_of_tied_checkpoint_matches_hf(tiny_qwen3_dir, verifier):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    h = torch.randn(3, verifier.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(verifier.logits(h), hf.lm_head(hf.model.norm(h)))
    assert verifier.lm_head_weight is verifier.embed_tokens.weight  # one matrix, not two


# --- aux layers and mask token ----------------------------------------------------------


def test_aux_layer_ids_default_and_validation():
    assert resolve_aux_layer_ids(Qwen3Config(num_hidden_layers=28), None) == [2, 14, 25]
    assert resolve_aux_layer_ids(Qwen3Config(num_hidden_layers=30), None) == [2, 15, 27]
    assert resolve_aux_layer_ids(Qwen3Config(num_hidden_layers=4), None) == [1, 2, 3]
    assert resolve_aux_layer_ids(Qwen3Config(num_hidden_layers=4), [0, 3]) == [0, 3]
    for bad in ([1, 4], [-1, 2], [2, 1], [1, 1], []):
        with pytest.raises(ValueError, match="aux_layer_ids"):
            resolve_aux_layer_ids(Qwen3Config(num_hidden_layers=4), bad)


def test_mask_token_id_resolution():
    config = Qwen3Config(vocab_size=151936)
    assert resolve_mask_token_id(config, 151669, None) == 151669
    assert resolve_mask_token_id(config, 151669, 151700) == 151700
    with pytest.raises(ValueError, match="mask_token_id"):
        resolve_mask_token_id(Qwen3Config(vocab_size=1000), 1000, None)
    with pytest.raises(ValueError, match="mask_token_id"):
        resolve_mask_token_id(config, 151669, 151936)


# --- bad input: clear errors naming the field --------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(block_size=0), "block_size"),
        (dict(num_layers=0), "num_layers"),
        (dict(markov_type="lstm"), "markov_type"),
        (dict(markov_rank=0), "confidence_head_with_markov"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(attn_impl="eager"), "attn_impl"),
        (dict(draft_vocab_size=400), "draft_vocab_size"),
    ],
)
def test_bad_draft_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        DSparkDraft(draft_config(**overrides), tiny_llama_config(), [1], mask_token_id=299)


def test_bad_d2t_names_it():
    config = tiny_llama_config()
    cfg = draft_config(draft_vocab_size=100)
    for d2t in (None, random_d2t(300, 99), random_d2t(300, 100).flip(0), torch.full((100,), 250)):
        with pytest.raises(ValueError, match="d2t"):
            DSparkDraft(cfg, config, [1], mask_token_id=299, d2t=d2t)
    with pytest.raises(ValueError, match="d2t"):
        DSparkDraft(draft_config(), config, [1], mask_token_id=299, d2t=random_d2t(300, 100))


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"])
def test_verifier_config_missing_field_is_named(field):
    # HF config classes refuse None for these fields; a hand-written or foreign config may lack them.
    config = SimpleNamespace(**{**tiny_llama_config().to_dict(), field: None})
    with pytest.raises(ValueError, match=field):
        DSparkDraft(draft_config(), config, [1], mask_token_id=1)


def test_unsupported_verifier_model_type_is_named():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="model_type"):
        DSparkDraft(draft_config(), GPT2Config(), [1], mask_token_id=1)


def test_forward_before_load_verifier_is_refused():
    model = DSparkDraft(draft_config(), tiny_llama_config(), [1, 2], mask_token_id=299)
    with pytest.raises(RuntimeError, match="load_verifier"):
        forward_smoke(model, 300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_flex_without_cuda_is_refused():
    with pytest.raises(UserError, match="attn_impl"):
        DSparkDraft(draft_config(attn_impl="flex"), tiny_llama_config(), [1], mask_token_id=299)


# --- GPU: flex attention equals SDPA ------------------------------------------------------


@pytest.mark.parametrize("window, causal", [(None, False), (5, True)])
def test_flex_block_mask_holds_the_dense_mask(window, causal):
    """The block mask flex attention gets is built (create_block_mask runs on CPU too) from the same
    predicate as the dense mask SDPA gets: flex once refused a bound method as a score_mod."""
    anchors = torch.tensor([[3, 9, 20, 30], [1, 5, 7, 7]])
    layout = BlockLayout(
        anchors, torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool(), (torch.arange(32) >= 12).long().expand(2, 32), 4,
        window, causal,
    )  # fmt: skip
    mask = layout.flex()
    b = torch.arange(2)[:, None, None]
    q, kv = torch.arange(layout.q_len)[None, :, None], torch.arange(layout.kv_len)[None, None, :]
    dense = layout.dense()[:, 0]
    assert dense.any() and not dense.all()
    assert torch.equal(mask.mask_mod(b, None, q, kv), dense)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention runs on CUDA only")
@pytest.mark.parametrize("window, causal", [(None, False), (5, True)])
def test_flex_matches_sdpa_on_cuda(verifier, window, causal):
    cfg = draft_config(sliding_window=window, causal_in_block=causal)
    sdpa = make_draft(verifier, cfg).cuda()
    flex = DSparkDraft(
        draft_config(sliding_window=window, causal_in_block=causal, attn_impl="flex"),
        verifier.config,
        [1, 2, 3],
        QWEN3_MASK_TOKEN_ID,
    ).cuda()
    flex.load_verifier(verifier)
    flex.load_state_dict(sdpa.state_dict())
    context, input_ids = packed_inputs(2, 300, 3, verifier.hidden_size)
    document_ids = (torch.arange(300) >= 140).long().expand(2, 300)
    anchors = torch.randint(0, 296, (2, 40)).sort().values
    valid = torch.ones_like(anchors, dtype=torch.bool)
    args = [t.cuda() for t in (context, input_ids, anchors, valid, document_ids)]
    with torch.no_grad():
        torch.testing.assert_close(flex(*args), sdpa(*args), rtol=2e-4, atol=2e-4)


@pytest.mark.slow
def test_compiled_backbone_matches_eager_and_keeps_state_dict_keys(verifier):
    """`train.compile`: the compiled layers and context path give the eager forward and gradients at two batch shapes
    (the second makes rows and context length dynamic), and export and checkpoints see the same keys."""
    eager = make_draft(verifier, draft_config())
    compiled = make_draft(verifier, draft_config())
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_backbone()
    assert list(compiled.state_dict()) == list(eager.state_dict())
    for rows, T, A in ((2, 22, 5), (3, 30, 7)):
        context, input_ids = packed_inputs(rows, T, 3, verifier.hidden_size)
        anchors = torch.randint(0, T - 4, (rows, A)).sort().values
        valid = torch.ones_like(anchors, dtype=torch.bool)
        hiddens, grads = [], []
        for model in (eager, compiled):
            model.zero_grad()
            hidden = model(context, input_ids, anchors, valid)
            hidden.square().mean().backward()
            hiddens.append(hidden.detach())
            grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        torch.testing.assert_close(hiddens[1], hiddens[0], rtol=1e-4, atol=1e-4)
        assert grads[0].keys() == grads[1].keys() and grads[0]
        for name, grad in grads[0].items():
            torch.testing.assert_close(grads[1][name], grad, rtol=1e-3, atol=1e-5, msg=name)
