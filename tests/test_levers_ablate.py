"""bench.ablate: the standard errors against a hand computation, and a 2-variant run on a tiny store."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import yaml
from train_stores import (
    MASK_TOKEN_ID,
    VOCAB,
    make_bigram_verifier,
    make_samples,
    write_store,
    write_token_freqs,
)

from bench import ablate
from bench.ablate import Blocks, combine_seeds, mean_se, summarize


def blocks(taus_minus_one: list[float]) -> Blocks:
    """Blocks of one slot whose τ is 1 + α (α given), one per held-out anchor."""
    alpha = np.asarray(taus_minus_one, dtype=np.float64)[:, None]
    key = np.stack([np.arange(len(alpha)), np.zeros(len(alpha), dtype=np.int64)], 1)
    return Blocks(alpha, np.ones_like(alpha, dtype=bool), key)


def test_standard_errors_match_a_hand_computation():
    # one run: values 1, 2, 3, 6 -> mean 3, sd² = (4 + 1 + 0 + 9) / 3 = 14/3, SE = √(14/3 / 4)
    assert mean_se(np.array([1.0, 2.0, 3.0, 6.0])) == pytest.approx((3.0, math.sqrt(14 / 12)))
    # seeds with means 1.0, 1.2 and anchor SEs 0.03, 0.04: seed var (0.02)/2, anchor (0.0009+0.0016)/2
    got = combine_seeds([1.0, 1.2], [0.03, 0.04])
    assert got["mean"] == pytest.approx(1.1) and got["seeds"] == 2
    assert got["se"] == pytest.approx(math.sqrt(0.02 / 2 + 0.00125))

    runs = [
        {"variant": v, "budget": 1, "seed": s, "steps": 10, "train_tokens": 2e6, "wall_s": w, "train_time_s": w / 2}
        for v, s, w in (("a", 0, 10.0), ("a", 1, 14.0), ("b", 0, 12.0), ("b", 1, 12.0))
    ]
    done = {
        ("a", 1, 0): blocks([0.2, 0.4]),
        ("a", 1, 1): blocks([0.4, 0.4]),
        ("b", 1, 0): blocks([0.5, 0.5]),
        ("b", 1, 1): blocks([0.3, 0.7]),
    }
    untrained = {(v, s): blocks([0.0, 0.2]) for v in "ab" for s in (0, 1)}
    table = {r["variant"]: r for r in summarize(runs, done, untrained, reference="a")}
    a, b = table["a"], table["b"]
    # a: seed means 1.3 (SE √(0.02/2)/√2... sd of [.2,.4] = √0.02, SE = 0.1) and 1.4 (SE 0)
    assert a["tau"]["mean"] == pytest.approx(1.35)
    assert a["tau"]["se"] == pytest.approx(math.sqrt(0.005 / 2 + (0.1**2 + 0) / 2))
    # b - a paired per block: seed 0 [0.3, 0.1] (mean 0.2, SE 0.1); seed 1 [-0.1, 0.3] (mean 0.1, SE 0.2)
    assert b["gain"]["mean"] == pytest.approx(0.15)
    assert b["gain"]["se"] == pytest.approx(math.sqrt(0.005 / 2 + (0.01 + 0.04) / 2))
    assert a["gain"]["mean"] == 0 and a["gain"]["se"] == 0
    # per training token: (τ − the reference's untrained τ [1.0, 1.2]) / 2 Mtok; b seed 0 -> [0.25, 0.15]
    assert b["tau_per_mtok"]["mean"] == pytest.approx(np.mean([0.25, 0.15, 0.15, 0.25]))
    assert b["untrained_tau"]["mean"] == pytest.approx(1.1)
    assert a["accept"]["mean"] == pytest.approx([0.35]) and a["alpha"]["mean"] == pytest.approx([0.35])
    assert a["wall_s"] == {"mean": 12.0, "se": pytest.approx(2.0), "seeds": 2}  # sd √8 / √2
    with pytest.raises(ValueError, match="different held-out blocks"):
        summarize(runs, {**done, ("b", 1, 1): blocks([0.3])}, untrained, reference="a")


@pytest.fixture(scope="module")
def tiny_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("ablate")
    verifier = make_bigram_verifier(root / "verifier")
    train = make_samples(verifier, 12, seed=0, min_len=48, max_len=48)
    write_store(root / "store" / "train", verifier, train)
    write_store(root / "store" / "eval", verifier, make_samples(verifier, 4, seed=1), first_id=1000)
    write_token_freqs(root / "freqs.npy", train, VOCAB)
    return root


def tiny_overrides(root) -> list[str]:
    """A 1-layer draft on the tiny store, 96 tokens per step."""
    return [
        f"target.name_or_path={root / 'verifier'}",
        "target.name=tiny",
        "target.aux_layer_ids=null",
        f"target.mask_token_id={MASK_TOKEN_ID}",
        "model.num_layers=1",
        "model.markov_rank=16",
        "model.draft_vocab_size=null",
        "loss.num_anchors=4",
        f"train.train_store={root / 'store' / 'train'}",
        f"train.eval_store={root / 'store' / 'eval'}",
        f"train.token_freqs={root / 'freqs.npy'}",
        "train.tokens_per_step=96",
        "train.tokens_per_micro_batch=96",
        "train.data_workers=0",
        "train.lr=1e-2",
    ]


@pytest.mark.slow  # ~30 s or more on 2 cores: make test, not make test-fast
def test_two_variants_make_one_table(tiny_world, tmp_path):
    common = [*tiny_overrides(tiny_world), "train.eval_every=0"]
    cfg = {
        "launcher": ["python", "-m", "train"],
        "runs_dir": str(tmp_path / "runs"),
        "keep_checkpoints": False,
        "common": common,
        "steps": 3,
        "budgets": [1],
        "seeds": [0],
        "reference": "baseline",
        "eval": {"max_samples": None, "anchors_per_sample": None, "anchors_per_forward": 64},
        "variants": {
            "baseline": [],
            "levers": [
                "train.init_layers_from_verifier=[-1]",
                "train.init_fc_from_last_aux=true",
                "loss.anchor_sampling=confident",
                "loss.anchor_pool=8",
            ],
        },
    }
    (tmp_path / "ablate.yaml").write_text(yaml.safe_dump(cfg))
    assert ablate.main([f"config={tmp_path / 'ablate.yaml'}", f"out={tmp_path / 'out'}"]) == 0
    result = json.loads((tmp_path / "out" / "ablations.json").read_text())
    assert (tmp_path / "out" / "ablations.png").stat().st_size > 0
    table = {r["variant"]: r for r in result["table"]}
    assert set(table) == {"baseline", "levers"} and len(result["runs"]) == 2
    for row in table.values():
        assert row["steps"] == 3 and row["train_tokens"] > 0 and row["wall_s"]["mean"] > 0
        assert len(row["accept"]["mean"]) == len(row["alpha"]["se"]) == 4  # block size 4
        assert 1.0 <= row["tau"]["mean"] <= 5.0 and row["tau"]["se"] > 0
        # one seed: the SE is the anchor SE of the stored blocks
        run = Blocks.load(tmp_path / "runs" / row["variant"] / "x1_s0" / "ablate.npz")
        assert row["tau"]["mean"] == pytest.approx(run.tau.mean())
        assert row["tau"]["se"] == pytest.approx(run.tau.std(ddof=1) / math.sqrt(run.tau.size))
    assert table["baseline"]["gain"]["mean"] == 0
    # the trainer's own held-out τ at the end is the same metric on the same blocks
    rows = [json.loads(x) for x in (tmp_path / "runs" / "levers" / "x1_s0" / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if r["split"] == "eval"][-1]
    assert final["tau"] == pytest.approx(table["levers"]["tau"]["mean"], rel=1e-4)
    # a scored run keeps its drafter, not its checkpoints
    assert (tmp_path / "runs" / "levers" / "x1_s0" / "drafter").is_dir()
    assert not (tmp_path / "runs" / "levers" / "x1_s0" / "checkpoints").exists()
    # a finished run is reused, not retrained
    stamp = (tmp_path / "runs" / "baseline" / "x1_s0" / "ablate.json").stat().st_mtime
    ablate.main([f"config={tmp_path / 'ablate.yaml'}", f"out={tmp_path / 'out'}", "only=baseline"])
    assert (tmp_path / "runs" / "baseline" / "x1_s0" / "ablate.json").stat().st_mtime == stamp


def test_ema_is_what_is_evaluated_and_exported(tiny_world, tmp_path):
    """A short run with train.ema_decay: the exported drafter holds the checkpoint's averages, not its raw weights."""
    from hydra import compose, initialize_config_dir

    from dspark.export import load_drafter
    from train.__main__ import run
    from train.checkpoint import read_checkpoint

    args = [
        *tiny_overrides(tiny_world),
        "train.max_steps=4",
        "train.ema_decay=0.9",
        f"train.run_dir={tmp_path / 'run'}",
        # one param group, and export tensors named as trained (the projection's fold is tested in test_levers)
        "model.markov_embed_proj=false",
    ]
    with initialize_config_dir(config_dir=str(ablate.REPO / "conf"), version_base=None):
        run(compose("train", overrides=args))
    ckpt = read_checkpoint(tmp_path / "run" / "checkpoints" / "latest", rank=0)
    draft = load_drafter(tmp_path / "run" / "drafter")
    exported = draft.state_dict()
    # the optimizer's state is indexed in the order of the trainable parameters
    trainable = [n for n, p in draft.named_parameters() if p.requires_grad]
    averages = [s["ema"] for _, s in sorted(ckpt["optimizer"]["state"].items())]
    assert len(averages) == len(trainable) and "fc.weight" in trainable
    for name, average in zip(trainable, averages, strict=True):
        torch.testing.assert_close(exported[name], average.to(exported[name].dtype))
    assert not torch.equal(exported["fc.weight"], ckpt["weights"]["fc.weight"])


def test_a_variant_can_build_on_another(tmp_path):
    """`@other` in a variant's list stands for variant `other`'s (expanded) overrides."""
    cfg = {
        "launcher": ["python", "-m", "train"],
        "runs_dir": "runs",
        "keep_checkpoints": False,
        "common": [],
        "steps": 1,
        "budgets": [1],
        "seeds": [0],
        "eval": {},
        "reference": "base",
        "variants": {"base": ["a=1"], "mid": ["@base", "b=2"], "top": ["c=3", "@mid", "d=4"]},
    }
    path = tmp_path / "ablate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert ablate.load_config(path)["variants"] == {
        "base": ["a=1"],
        "mid": ["a=1", "b=2"],
        "top": ["c=3", "a=1", "b=2", "d=4"],
    }
    for variants, message in [
        ({"base": ["@nope"]}, "refers to '@nope', which is not a variant"),
        ({"base": ["@loop"], "loop": ["@base"]}, "cycle: base -> loop -> base"),
    ]:
        path.write_text(yaml.safe_dump({**cfg, "variants": variants}))
        with pytest.raises(SystemExit, match=message):
            ablate.load_config(path)
