"""Export in the speculators format: speculators loads it and computes the same logits,
vLLM's speculators-config parsing reads it, and load_drafter restores it exactly."""

from __future__ import annotations

import json

import pytest
import torch
from drafts import QWEN3_MASK_TOKEN_ID, draft_config, make_draft, packed_inputs, random_d2t
from safetensors import safe_open

from dspark.export import export_drafter as export_checked
from dspark.export import load_drafter
from dspark.verifier import VerifierHead

DRAFT_VOCAB = 2000


def export_drafter(*args, **kwargs):
    """Export without vLLM's subprocess check (tests/test_export_checks.py runs it)."""
    return export_checked(*args, vllm_check=False, **kwargs)


# Gated/rnn variants are exported on purpose here (speculators runs them); the warning itself
# is checked in test_export_warns_about_what_vllm_cannot_serve and tests/test_export_checks.py.
pytestmark = pytest.mark.filterwarnings("ignore:vLLM cannot serve this drafter as trained")

# (draft overrides, reduced vocabulary?) — speculators can express each of these layouts.
VARIANTS = {
    "full-vanilla": (dict(), False),
    "reduced-gated-sliding": (dict(markov_type="gated", sliding_window=6, confidence_head_with_markov=False), True),
    "rnn-sliding-causal": (
        dict(markov_type="rnn", sliding_window=6, causal_in_block=True, confidence_head=False),
        False,
    ),
}


@pytest.fixture(scope="module")
def verifier(tiny_qwen3_dir) -> VerifierHead:
    return VerifierHead.from_pretrained(tiny_qwen3_dir)


def build(verifier, name):
    overrides, reduced = VARIANTS[name]
    if reduced:
        overrides = dict(overrides, draft_vocab_size=DRAFT_VOCAB)
    d2t = random_d2t(verifier.vocab_size, DRAFT_VOCAB) if reduced else None
    return make_draft(verifier, draft_config(**overrides), d2t=d2t)


def load_in_speculators(drafter_dir):
    """speculators' DSparkDraftModel on CPU: SDPA attention (its default needs flex + Triton)."""
    from speculators.config import SpeculatorModelConfig
    from speculators.models.dspark import DSparkDraftModel

    config = SpeculatorModelConfig.from_pretrained(drafter_dir)
    config.transformer_layer_config._attn_implementation = "sdpa"
    return DSparkDraftModel.from_pretrained(drafter_dir, config=config).eval()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_speculators_loads_export_with_same_weights_and_logits(verifier, tiny_qwen3_dir, tmp_path, monkeypatch, name):
    import speculators.models.dspark.core as dspark_core
    from safetensors.torch import load_file

    model = build(verifier, name)
    out = export_drafter(model, tmp_path / "drafter", str(tiny_qwen3_dir))
    theirs = load_in_speculators(out)

    # Every tensor they hold is ours: trainable ones from the file, frozen ones from the verifier.
    saved = load_file(str(out / "model.safetensors"))
    ours = model.state_dict()
    their_state = theirs.state_dict()
    verifier_only = {"verifier_lm_head.weight", "verifier_norm.weight"}
    assert set(their_state) - verifier_only == set(ours)
    assert set(saved) == set(ours) - model.verifier_owned()
    for key, value in ours.items():
        assert torch.equal(their_state[key], value), key
    trainable = {n for n, p in theirs.named_parameters() if p.requires_grad}
    assert trainable == {n for n, p in model.named_parameters() if p.requires_grad}

    # Drive speculators' own training forward. Its anchors are every loss-masked position
    # (sorted) when max_anchors equals their count: put the loss mask exactly on ours.
    T, anchors = 26, torch.tensor([1, 4, 6, 9, 13, 15, 20])
    context, input_ids = packed_inputs(1, T, 3, verifier.hidden_size)
    document_ids = torch.tensor([[0] * 8 + [1] * 10 + [2] * 8])
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, anchors] = 1
    captured = {}

    def capture(logits, targets, confidence_logits, *args, **kwargs):
        captured.update(logits=logits, confidence=confidence_logits)
        return real_compute_metrics(logits, targets, confidence_logits, *args, **kwargs)

    real_compute_metrics = dspark_core.compute_metrics
    monkeypatch.setattr(dspark_core, "compute_metrics", capture)
    train_kwargs, _ = theirs.get_trainer_kwargs(
        loss_fn='{"ce": 0.1, "tv": 0.9}', loss_implementation="eager", max_anchors=len(anchors)
    )
    with torch.no_grad():
        theirs(context, input_ids, loss_mask, torch.randn(1, T, verifier.hidden_size), document_ids, **train_kwargs)
        hidden = model(context, input_ids, anchors[None], torch.ones(1, len(anchors), dtype=torch.bool), document_ids)
        prev = model.block_tokens(input_ids, anchors[None])[0]
        logits = model.draft_logits(hidden[0], prev)

    B = model.block_size
    their_logits = captured["logits"].view(len(anchors), B, -1)
    assert their_logits.shape[-1] == model.draft_vocab_size
    torch.testing.assert_close(logits, their_logits, rtol=1e-4, atol=1e-4)
    if model.confidence_head is not None:
        torch.testing.assert_close(
            model.confidence_logits(hidden[0], prev), captured["confidence"].view(len(anchors), B), rtol=1e-4, atol=1e-4
        )
    else:
        assert captured["confidence"] is None


def test_config_json_spells_out_what_vllm_would_default(verifier, tiny_qwen3_dir, tmp_path):
    model = build(verifier, "reduced-gated-sliding")
    out = export_drafter(model, tmp_path / "drafter", str(tiny_qwen3_dir), extra_meta={"step": 7})
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark"
    assert config["sample_from_anchor"] is True
    assert config["confidence_head_with_markov"] is False
    assert config["block_size"] == 4 and config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["mask_token_id"] == QWEN3_MASK_TOKEN_ID
    assert config["aux_hidden_state_layer_ids"] == [1, 2, 3]
    spec = config["speculators_config"]
    assert spec["algorithm"] == "dspark"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4
    assert spec["verifier"] == {"name_or_path": str(tiny_qwen3_dir), "architectures": ["Qwen3ForCausalLM"]}
    layers = config["transformer_layer_config"]
    assert layers["layer_types"] == ["sliding_attention"] * 2
    assert layers["sliding_window"] == 6 and layers["is_causal"] is False
    assert json.loads((out / "dspark_meta.json").read_text()) == {"step": 7}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("lm_head.weight").shape == (DRAFT_VOCAB, verifier.hidden_size)
    assert {"d2t", "t2d", "lm_head.weight"} <= names and "embed_tokens.weight" not in names


def test_full_vocab_export_leaves_verifier_tensors_out(verifier, tiny_qwen3_dir, tmp_path):
    out = export_drafter(build(verifier, "full-vanilla"), tmp_path / "drafter", str(tiny_qwen3_dir))
    config = json.loads((out / "config.json").read_text())
    assert config["transformer_layer_config"]["layer_types"] == ["full_attention"] * 2
    assert config["transformer_layer_config"]["sliding_window"] is None
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert not names & {"embed_tokens.weight", "lm_head.weight", "d2t", "t2d"}


@pytest.mark.parametrize("name", ["full-vanilla", "reduced-gated-sliding", "rnn-sliding-causal"])
def test_load_drafter_restores_the_exact_model(verifier, tiny_qwen3_dir, tmp_path, name):
    model = build(verifier, name)
    out = export_drafter(model, tmp_path / "drafter", str(tiny_qwen3_dir))
    loaded = load_drafter(out, verifier)
    assert loaded.cfg == model.cfg
    assert (loaded.aux_layer_ids, loaded.mask_token_id) == (model.aux_layer_ids, model.mask_token_id)
    expected, got = model.state_dict(), loaded.state_dict()
    assert set(got) == set(expected)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    # Without the verifier: everything the checkpoint holds is restored already.
    bare = load_drafter(out).state_dict()
    for key in set(expected) - model.verifier_owned():
        assert torch.equal(bare[key], expected[key]), key


def test_load_drafter_refuses_mismatched_files(verifier, tiny_qwen3_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    out = export_drafter(build(verifier, "full-vanilla"), tmp_path / "drafter", str(tiny_qwen3_dir))
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["fc.weight"]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="fc.weight"):
        load_drafter(out)
    config = json.loads((out / "config.json").read_text())
    config["sample_from_anchor"] = False
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sample_from_anchor"):
        load_drafter(out)


def test_export_warns_about_what_vllm_cannot_serve(verifier, tiny_qwen3_dir, tmp_path):
    with pytest.warns(UserWarning, match="vanilla Markov head"):
        export_drafter(build(verifier, "rnn-sliding-causal"), tmp_path / "rnn", str(tiny_qwen3_dir))
    with pytest.warns(UserWarning, match="bidirectional"):
        model = make_draft(verifier, draft_config(causal_in_block=True))
        export_drafter(model, tmp_path / "causal", str(tiny_qwen3_dir))


def test_export_replaces_an_old_export_whole(verifier, tiny_qwen3_dir, tmp_path):
    target = tmp_path / "drafter"
    target.mkdir()
    (target / "stale.bin").write_text("old")
    export_drafter(build(verifier, "full-vanilla"), target, str(tiny_qwen3_dir))
    assert sorted(p.name for p in target.iterdir() if p.name != "vllm-check.json") == [
        "config.json",
        "model.safetensors",
    ]
    assert not (tmp_path / "drafter.partial").exists()


@pytest.mark.parametrize(
    "name, layer_attention",
    [
        ("full-vanilla", (None, False)),
        ("reduced-gated-sliding", (6, False)),
        ("rnn-sliding-causal", (6, True)),
    ],
)
def test_vllm_reads_the_exported_config(verifier, tiny_qwen3_dir, tmp_path, name, layer_attention):
    from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention
    from vllm.transformers_utils.config import maybe_override_with_speculators
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    model = build(verifier, name)
    out = export_drafter(model, tmp_path / "drafter", str(tiny_qwen3_dir))
    served, tokenizer, speculative = maybe_override_with_speculators(str(out), None, trust_remote_code=False)
    assert served == tokenizer == str(tiny_qwen3_dir)
    assert speculative == {"method": "dspark", "num_speculative_tokens": model.block_size, "model": str(out)}

    draft = SpeculatorsConfig.from_pretrained(out)
    assert draft.eagle_aux_hidden_state_layer_ids == [1, 2, 3]
    assert draft.target_layer_ids == [0, 1, 2]  # vLLM's DSpark indexing: aux id − 1
    assert draft.sample_from_anchor is True and draft.dspark_bonus_anchor is False
    assert (draft.block_size, draft.mask_token_id) == (4, QWEN3_MASK_TOKEN_ID)
    assert draft.draft_vocab_size == model.draft_vocab_size
    assert draft.enable_confidence_head == model.cfg.confidence_head
    assert draft.confidence_head_with_markov == model.cfg.confidence_head_with_markov
    # What vLLM's DSpark layers would do: (sliding window, causal in block) per layer.
    assert [_resolve_layer_attention(draft, i) for i in range(2)] == [layer_attention] * 2
