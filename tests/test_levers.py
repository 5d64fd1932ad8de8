"""Initialising the draft from the verifier (dspark.init): weights by name, forward vs HF's layer."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from train_stores import MASK_TOKEN_ID, make_bigram_verifier
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from dspark.attention import BlockLayout
from dspark.config import DraftConfig
from dspark.errors import UserError
from dspark.init import copyable_last_layers, init_from_verifier
from dspark.model import DSparkDraft

BLOCK = 4


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    return make_bigram_verifier(tmp_path_factory.mktemp("levers") / "verifier")


def draft(verifier_dir, num_layers: int = 2) -> DSparkDraft:
    cfg = DraftConfig(
        num_layers=num_layers,
        block_size=BLOCK,
        draft_vocab_size=None,
        markov_rank=0,
        markov_type="vanilla",
        confidence_head=False,
        confidence_head_with_markov=False,
        sliding_window=None,
        causal_in_block=True,
        attn_impl="sdpa",
    )
    return DSparkDraft(cfg, AutoConfig.from_pretrained(verifier_dir), [1, 2, 3], MASK_TOKEN_ID)


def test_draft_layers_start_as_the_verifiers_last_layers(verifier_dir):
    model = draft(verifier_dir)
    # trainable tensors only: the verifier's placeholders are uninitialized memory until load_verifier
    before = {k: v.clone() for k, v in model.named_parameters() if v.requires_grad and not k.startswith("layers.")}
    copied = init_from_verifier(model, verifier_dir, [-2, -1], fc_from_last_aux=True)
    tensors = load_file(verifier_dir / "model.safetensors")
    state = model.state_dict()
    layer_keys = [k for k in state if k.startswith("layers.")]
    assert sorted(copied) == sorted(layer_keys) and len(layer_keys) == 2 * 11
    for j, i in enumerate([2, 3]):  # -2, -1 of 4 verifier layers
        for suffix, value in model.layers[j].state_dict().items():
            assert copied[f"layers.{j}.{suffix}"] == f"model.layers.{i}.{suffix}"
            assert torch.equal(value, tensors[f"model.layers.{i}.{suffix}"])
    hidden = model.layer_config.hidden_size
    expected_fc = torch.cat([torch.zeros(hidden, 2 * hidden), torch.eye(hidden)], dim=1)
    assert torch.equal(model.fc.weight, expected_fc)
    for k, v in before.items():  # nothing else moved
        if k != "fc.weight":
            assert torch.equal(state[k], v), k


@torch.no_grad()
def test_copied_layer_computes_what_the_verifiers_layer_computes(verifier_dir):
    """A block at anchor 0 sees no context: with causal attention in the block, draft layer j
    on the block equals the verifier's layer on the same B tokens (HF, eager attention)."""
    model = draft(verifier_dir)
    init_from_verifier(model, verifier_dir, [1, 3], fc_from_last_aux=False)
    hf = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32, attn_implementation="eager").eval()
    hidden = model.layer_config.hidden_size
    x = torch.randn(1, BLOCK, hidden, generator=torch.Generator().manual_seed(0))
    anchors = torch.zeros(1, 1, dtype=torch.long)
    layout = BlockLayout(
        anchors, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, 1, dtype=torch.long), BLOCK, None, True
    )
    needed = layout.context_needed()  # none: the block at anchor 0 sees no context key
    context = torch.randn(int(needed.sum()), hidden)
    positions = torch.arange(BLOCK)[None]
    cos, sin = model.rotary_emb(x, torch.cat([torch.zeros(1, 1, dtype=torch.long), positions], 1))
    hf_cos, hf_sin = hf.model.rotary_emb(x, positions)
    causal = torch.full((BLOCK, BLOCK), float("-inf")).triu(1)[None, None]
    for j, i in enumerate([1, 3]):
        ours = model.layers[j](x, context, needed, cos, sin, layout.dense())
        theirs = hf.model.layers[i](
            x, attention_mask=causal, position_ids=positions, position_embeddings=(hf_cos, hf_sin)
        )
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # and a random-init layer does not (the comparison can fail)
    fresh = draft(verifier_dir).layers[0](x, context, needed, cos, sin, layout.dense())
    assert not torch.allclose(fresh, model.layers[0](x, context, needed, cos, sin, layout.dense()), atol=1e-3)


def test_bad_layer_choices_are_user_errors(verifier_dir):
    model = draft(verifier_dir)
    with pytest.raises(UserError, match="model.num_layers=2"):
        init_from_verifier(model, verifier_dir, [-1], fc_from_last_aux=False)
    with pytest.raises(UserError, match=r"\[4\] outside"):
        init_from_verifier(model, verifier_dir, [3, 4], fc_from_last_aux=False)


def test_auto_takes_the_last_layers_where_they_can_be_copied(verifier_dir, tmp_path):
    """`train.init_layers_from_verifier=auto` (the default): the last num_layers layers of a
    verifier that has them; random, with the reason, for a shallower one or one with attention biases."""
    layers, line = copyable_last_layers(draft(verifier_dir, num_layers=2), verifier_dir)
    assert layers == [-2, -1] and line == "init: draft layers start as verifier layers 2..3"
    layers, line = copyable_last_layers(draft(verifier_dir, num_layers=5), verifier_dir)
    assert layers is None and "draft layers random" in line and "outside the verifier's 4 layers" in line

    config = Qwen2Config(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "qwen2")
    layers, line = copyable_last_layers(draft(tmp_path / "qwen2", num_layers=2), tmp_path / "qwen2")
    assert layers is None and "self_attn.q_proj.bias" in line
