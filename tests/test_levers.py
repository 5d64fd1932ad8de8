"""Initialising the draft from the verifier (dspark.init): weights by name, forward vs HF's layer;
LR multipliers by module, and the Markov embedding projection."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from drafts import draft_config
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file, save_file
from train_stores import MASK_TOKEN_ID, make_bigram_verifier
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from dspark.attention import BlockLayout
from dspark.config import load_section
from dspark.errors import UserError
from dspark.export import export_drafter, load_drafter
from dspark.init import copyable_last_layers, init_from_verifier
from dspark.model import DSparkDraft
from dspark.train.config import TrainConfig
from dspark.train.optim import copied_layers_lr, make_optimizer, with_prefix_lr
from dspark.verifier import VerifierHead

BLOCK = 4
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    return make_bigram_verifier(tmp_path_factory.mktemp("levers") / "verifier")


def draft(verifier_dir, num_layers: int = 2, markov_rank: int = 0, markov_embed_proj: bool = False) -> DSparkDraft:
    cfg = draft_config(
        num_layers=num_layers,
        block_size=BLOCK,
        markov_rank=markov_rank,
        confidence_head=False,
        confidence_head_with_markov=False,
        causal_in_block=True,
        markov_embed_proj=markov_embed_proj,
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
    lc = model.layer_config
    # the block at anchor 0 sees no context key: one masked (zero) context position
    context_kv = (torch.zeros(1, 1, lc.num_key_value_heads, lc.head_dim),) * 2
    positions = torch.arange(BLOCK)[None]
    cos, sin = model.rope(positions)
    hf_cos, hf_sin = hf.model.rotary_emb(x, positions)
    causal = torch.full((BLOCK, BLOCK), float("-inf")).triu(1)[None, None]
    for j, i in enumerate([1, 3]):
        ours = model.layers[j](x, context_kv, cos, sin, layout.dense())
        theirs = hf.model.layers[i](
            x, attention_mask=causal, position_ids=positions, position_embeddings=(hf_cos, hf_sin)
        )
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # and a random-init layer does not (the comparison can fail)
    fresh = draft(verifier_dir).layers[0](x, context_kv, cos, sin, layout.dense())
    assert not torch.allclose(fresh, model.layers[0](x, context_kv, cos, sin, layout.dense()), atol=1e-3)


def test_bad_layer_choices_are_user_errors(verifier_dir):
    model = draft(verifier_dir)
    with pytest.raises(UserError, match="model.num_layers=2"):
        init_from_verifier(model, verifier_dir, [-1], fc_from_last_aux=False)
    with pytest.raises(UserError, match=r"\[4\] outside"):
        init_from_verifier(model, verifier_dir, [3, 4], fc_from_last_aux=False)


def test_auto_takes_the_last_layers_where_they_can_be_copied(verifier_dir):
    """`train.init_layers_from_verifier=auto` (the default): the last num_layers layers of a
    verifier that has them; random, with the reason, for a shallower one."""
    layers, line = copyable_last_layers(draft(verifier_dir, num_layers=2), verifier_dir)
    assert layers == [-2, -1] and line == "init: draft layers start as verifier layers 2..3"
    layers, line = copyable_last_layers(draft(verifier_dir, num_layers=5), verifier_dir)
    assert layers is None and "draft layers random" in line and "outside the verifier's 4 layers" in line


def test_qwen2_layers_are_copied_with_their_attention_biases(verifier_dir, tmp_path):
    """A Qwen2 verifier (q/k/v biases, none on o_proj, no `attention_bias` in its config) gives the
    draft attention biases: its last layers are copied, biases included; o_proj's bias stays zero."""
    config = Qwen2Config(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    qwen2 = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in qwen2.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_()  # not the zeros of HF's init
    qwen2.save_pretrained(tmp_path / "qwen2")
    model = draft(tmp_path / "qwen2", num_layers=2)
    assert model.layer_config.attention_bias and not draft(verifier_dir).layer_config.attention_bias  # Qwen3: none
    layers, line = copyable_last_layers(model, tmp_path / "qwen2")
    assert layers == [-2, -1] and line == "init: draft layers start as verifier layers 1..2"
    copied = init_from_verifier(model, tmp_path / "qwen2", layers, fc_from_last_aux=True)
    tensors = load_file(tmp_path / "qwen2" / "model.safetensors")
    for j, i in enumerate([1, 2]):
        for proj in ("q_proj", "k_proj", "v_proj"):
            name = f"layers.{j}.self_attn.{proj}.bias"
            assert copied[name] == f"model.layers.{i}.self_attn.{proj}.bias"
            assert torch.equal(model.state_dict()[name], tensors[copied[name]]) and tensors[copied[name]].any()
        assert f"layers.{j}.self_attn.o_proj.bias" not in copied
        assert not model.layers[j].self_attn.o_proj.bias.any()


def test_final_norm_starts_as_the_verifiers(verifier_dir, tmp_path):
    """`train.init_norm_from_verifier`: the draft's final norm is the verifier's (here not all ones),
    and nothing else moves."""
    shutil.copytree(verifier_dir, tmp_path / "v")
    tensors = load_file(tmp_path / "v" / "model.safetensors")
    tensors["model.norm.weight"] = torch.rand(tensors["model.norm.weight"].shape) + 0.5
    save_file(tensors, tmp_path / "v" / "model.safetensors", metadata={"format": "pt"})
    model = draft(tmp_path / "v")
    before = {k: v.clone() for k, v in model.named_parameters() if v.requires_grad and k != "norm.weight"}
    assert init_from_verifier(model, tmp_path / "v", None, fc_from_last_aux=False, norm=True) == {
        "norm.weight": "model.norm.weight"
    }
    assert torch.equal(model.norm.weight, tensors["model.norm.weight"])
    for k, v in model.named_parameters():
        if k in before:
            assert torch.equal(v, before[k]), k


def test_lr_scales_give_module_prefixes_their_own_lr(verifier_dir):
    """`train.lr_scales`: the parameters under each prefix (the longest match wins) get a param
    group at lr × scale; at 0 an AdamW step leaves them as they were while every other tensor moves;
    a prefix that matches nothing is refused."""
    model = draft(verifier_dir)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        train_cfg = load_section(TrainConfig, compose(config_name="train"), "train")
    cfg = dataclasses.replace(train_cfg, lr=1e-2, weight_decay=0.0, lr_scales={"layers": 0.25, "layers.1": 0.5})
    groups = make_optimizer(named, cfg).param_groups
    ids = [{id(p) for n, p in named if n.startswith(prefix)} for prefix in ("layers.0.", "layers.1.")]
    assert [g["lr"] for g in groups] == [1e-2, 2.5e-3, 5e-3]
    assert [{id(p) for p in g["params"]} for g in groups[1:]] == ids
    assert len(groups[0]["params"]) == len(named) - len(ids[0]) - len(ids[1])

    cfg.lr_scales = {"layers": 0.0}
    opt = make_optimizer(named, cfg)
    before = {n: p.detach().clone() for n, p in named}
    for _, p in named:
        p.grad = torch.ones_like(p)
    opt.step()
    for n, p in named:
        assert torch.equal(p, before[n]) == n.startswith("layers."), n
    cfg.lr_scales = {"layers.*.mlp": 0.0, "layers.1.mlp.up_proj": 2.0}  # `*`: any one component
    groups = make_optimizer(named, cfg).param_groups
    mlp = {id(p) for n, p in named if n.split(".")[0] == "layers" and n.split(".")[2] == "mlp"}
    up = {id(p) for n, p in named if n.startswith("layers.1.mlp.up_proj.")}
    assert [g["lr"] for g in groups] == [1e-2, 0.0, 2e-2]
    assert [{id(p) for p in g["params"]} for g in groups[1:]] == [mlp - up, up] and len(mlp) > len(up) > 0
    cfg.lr_scales = {"layer": 0.5}  # a prefix is a module path, not a string prefix
    with pytest.raises(UserError, match=r"train.lr_scales: \['layer'\] match no trainable parameter"):
        make_optimizer(named, cfg)


def test_the_copied_layers_multiplier_scales_every_prefix_inside_them(verifier_dir):
    """`train.copied_lr_ref_rms`: the multiplier is the median RMS of the copied layers' matrices / ref (a
    naive sort picks the median; norms, biases and fc stay out of it), and it scales every `lr_scales`
    prefix inside the layers, including the layers' own entry, and nothing outside them."""
    model = draft(verifier_dir)
    params = dict(model.named_parameters())
    copied = [*(n for n in params if n.startswith("layers.")), "fc.weight"]
    rms = sorted(float((params[n].detach().double() ** 2).mean() ** 0.5) for n in copied[:-1] if params[n].ndim == 2)
    assert len(rms) % 2 == 1 or rms[len(rms) // 2 - 1] != rms[len(rms) // 2]
    naive = rms[len(rms) // 2] if len(rms) % 2 else (rms[len(rms) // 2 - 1] + rms[len(rms) // 2]) / 2
    assert copied_layers_lr(model, copied, 0.5) == pytest.approx(naive / 0.5, rel=1e-6)
    scales = {"markov_embed_proj": 4.0, "layers.*.mlp": 0.5, "layers.1": 2.0}
    assert with_prefix_lr(scales, "layers", 0.1) == pytest.approx(
        {"markov_embed_proj": 4.0, "layers.*.mlp": 0.05, "layers.1": 0.2, "layers": 0.1}
    )
    assert with_prefix_lr({"layers": 3.0}, "layers", 0.1) == pytest.approx({"layers": 0.3})
    assert with_prefix_lr(None, "layers", 0.1) == pytest.approx({"layers": 0.1})
    assert scales == {"markov_embed_proj": 4.0, "layers.*.mlp": 0.5, "layers.1": 2.0}  # not changed in place


def test_the_copied_fc_trains_at_a_quarter_of_the_lr_by_default_only():
    """`train.copied_fc_lr_scale: 0.25` (conf/train.yaml): fc's multiplier, times its own `lr_scales` entry;
    the published recipe (nothing copied) has none. Where it applies (fc copied) is build_trainer's, and
    the step it gives is tests/test_train_guards.py's."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        default = load_section(TrainConfig, compose(config_name="train"), "train")
        published = load_section(TrainConfig, compose(config_name="train", overrides=["+recipe=published"]), "train")
    assert (default.copied_fc_lr_scale, published.copied_fc_lr_scale) == (0.25, None)
    scales = {"markov_embed_proj": 4.0, "fc": 2.0}
    assert with_prefix_lr(scales, "fc", 0.25) == {"markov_embed_proj": 4.0, "fc": 0.5}
    assert with_prefix_lr(None, "fc", 0.25) == {"fc": 0.25}
    # a user's entry inside fc is scaled with it, as those inside the copied layers are
    assert with_prefix_lr({"fc.weight": 2.0}, "fc", 0.25) == {"fc": 0.25, "fc.weight": 0.5}
    assert scales == {"markov_embed_proj": 4.0, "fc": 2.0}  # not changed in place


def test_the_markov_embed_proj_trains_at_4x_the_lr_by_default_only(verifier_dir):
    """`train.lr_scales: {markov_embed_proj: 4.0}` (conf/train.yaml): the projection's own param group
    at 4 × lr; the published recipe has none (no projection), and the default's entry without the
    projection is refused with the way to drop it."""
    model = draft(verifier_dir, markov_rank=8, markov_embed_proj=True)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        default = load_section(TrainConfig, compose(config_name="train"), "train")
        published = load_section(TrainConfig, compose(config_name="train", overrides=["+recipe=published"]), "train")
    groups = {g["name"]: g for g in make_optimizer(named, default).param_groups}
    assert set(groups) == {"", "markov_embed_proj"}
    assert groups["markov_embed_proj"]["params"] == [model.markov_embed_proj.weight]
    assert groups["markov_embed_proj"]["lr"] == pytest.approx(4 * default.lr) and groups[""]["lr"] == default.lr
    assert published.lr_scales is None
    plain = [(n, p) for n, p in draft(verifier_dir, markov_rank=8).named_parameters() if p.requires_grad]
    assert [g["name"] for g in make_optimizer(plain, published).param_groups] == [""]
    with pytest.raises(UserError, match=r"\['markov_embed_proj'\] match no trainable parameter.*~train.lr_scales"):
        make_optimizer(plain, default)


@torch.no_grad()
def test_markov_embed_proj_is_folded_into_w1_at_export(verifier_dir, tmp_path):
    """`model.markov_embed_proj`: W1[prev] + E[prev]·P in training; the exported drafter holds
    the folded table and computes the same logits as a plain vanilla head."""
    verifier = VerifierHead.from_pretrained(verifier_dir)
    model = draft(verifier_dir, markov_rank=8, markov_embed_proj=True)
    model.load_verifier(verifier)
    assert not model.markov_embed_proj.weight.any()  # the head starts as without it
    torch.nn.init.normal_(model.markov_embed_proj.weight, std=0.5)
    export_drafter(model, tmp_path / "drafter", str(verifier_dir), vllm_check=False)
    loaded = load_drafter(tmp_path / "drafter", verifier)
    assert loaded.markov_embed_proj is None
    gen = torch.Generator().manual_seed(0)
    prev = torch.randint(0, model.verifier_vocab_size, (6, BLOCK), generator=gen)
    hidden = torch.randn(6, BLOCK, model.layer_config.hidden_size, generator=gen)
    ours = model.draft_logits(hidden, prev)
    torch.testing.assert_close(loaded.draft_logits(hidden, prev), ours, rtol=1e-5, atol=1e-5)
    # independent: the bias written out by hand from the parts
    head = model.markov_head
    w1 = head.markov_w1(prev) + model.embed_tokens(prev) @ model.markov_embed_proj.weight.t()
    torch.testing.assert_close(ours, model.lm_head(hidden) + w1 @ head.markov_w2.weight.t(), rtol=1e-5, atol=1e-4)
    # the projection is part of what the draft computes (the comparisons above can fail)
    table_only = model.lm_head(hidden) + head.markov_w2(head.markov_w1(prev))
    assert not torch.allclose(table_only, ours, atol=1e-3)


def test_train_on_prompt_puts_training_anchors_on_prompt_tokens_not_padding():
    """loss.train_on_prompt: training anchors and scored slots may lie on a sample's prompt
    (loss_mask 0) but never on padding (held-out anchors are eval.offline's, on the replies)."""
    from dspark.store import Sample
    from dspark.train.data import collate
    from dspark.train.dspark_trainer import DSparkTrainer

    def sample(sample_id: int, n: int) -> Sample:
        mask = np.zeros(n, np.uint8)
        mask[12:] = 1  # a 12-token prompt, then the reply
        return Sample(sample_id, np.arange(n, dtype=np.int32), mask, np.zeros((n, 2, 8), np.uint16))

    batch = collate([sample(0, 40), sample(1, 30)], [0, 0])  # the second row is padded to 40
    real = torch.arange(40) < torch.tensor([[40], [30]])
    assert torch.equal(batch["token_mask"], real)
    for train_on_prompt in (False, True):
        trainer = DSparkTrainer.__new__(DSparkTrainer)  # prepare_batch reads only these fields
        trainer.block_size = BLOCK
        trainer.cfg = SimpleNamespace(seed=0)
        trainer.loss_cfg = SimpleNamespace(
            num_anchors=64, anchor_sampling="uniform",
            gamma=4.0, train_on_prompt=train_on_prompt,
        )  # fmt: skip
        out = trainer.prepare_batch(batch, epoch=0)
        on = out["anchor_valid"]
        anchors = out["anchors"][on]
        # every candidate is drawn (64 > candidates): p and p+1 both allowed tokens
        allowed = real if train_on_prompt else batch["loss_mask"]
        expected = int((allowed[:, :-1] & allowed[:, 1:]).sum())
        assert on.sum() == expected
        assert (anchors < 12).any() == train_on_prompt
        label_pos = (out["target_pos"] + 1)[out["slot_mask"]]
        rows = torch.arange(2)[:, None, None].expand_as(out["slot_mask"])[out["slot_mask"]]
        assert allowed[rows, label_pos].all()  # no scored slot on padding (or on a prompt, unless asked)
