"""bench.ablate: clustered standard errors against naive computations, the variant file, and
runs of bench/ablate_tiny.yaml on a tiny store (records, reuse, re-scoring, retraining)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from train_stores import (
    VOCAB,
    make_bigram_verifier,
    make_samples,
    write_store,
    write_token_freqs,
)

from bench import ablate, ablate_merge, ablate_pair
from bench.ablate_record import REPO, digest, git_state, provenance, read_json, store_fingerprint
from bench.ablate_stats import Blocks, clustered_mean_se, combine_seeds, summarize
from bench.ablate_variants import load_config
from dspark.errors import UserError
from dspark.run_lock import in_use
from dspark.train.checkpoint import latest_checkpoint

KILL_ITSELF = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"  # as the OOM killer ends a process


def blocks(taus_minus_one: list[float], conversations: list[int] | None = None) -> Blocks:
    """Blocks of one slot whose τ is 1 + α (α given); each its own conversation unless `conversations` says."""
    alpha = np.asarray(taus_minus_one, dtype=np.float64)[:, None]
    conv = np.arange(len(alpha)) if conversations is None else np.asarray(conversations)
    key = np.stack([conv, np.arange(len(alpha))], 1).astype(np.int64)
    return Blocks(alpha, np.ones_like(alpha, dtype=bool), key)


def naive_clustered_se(values, clusters) -> float:
    """The cluster-robust SE of a mean, written out as a loop over conversations."""
    n, mean = len(values), sum(values) / len(values)
    names = sorted(set(clusters))
    total = 0.0
    for c in names:
        total += sum(v - mean for v, k in zip(values, clusters) if k == c) ** 2
    return math.sqrt(len(names) / (len(names) - 1) * total / n**2)


def test_clustered_standard_error_against_a_hand_example_a_loop_and_a_bootstrap():
    # conversations 7: [1, 3], 8: [2], 9: [6, 4]; mean 3.2; deviation sums -2.4, -1.2, 3.6
    values, clusters = np.array([1.0, 3.0, 2.0, 6.0, 4.0]), np.array([7, 7, 8, 9, 9])
    mean, se = clustered_mean_se(values, clusters)
    assert mean == pytest.approx(3.2)
    assert se == pytest.approx(math.sqrt(3 / 2 * (2.4**2 + 1.2**2 + 3.6**2) / 25))
    assert se == pytest.approx(naive_clustered_se(values.tolist(), clusters.tolist()))
    # one block per conversation: the plain sd/√n; equal-sized conversations: sd(conversation means)/√C
    assert clustered_mean_se(values, np.arange(5))[1] == pytest.approx(values.std(ddof=1) / math.sqrt(5))
    pairs = np.array([1.0, 2.0, 5.0, 4.0, 0.0, 3.0])
    means = pairs.reshape(3, 2).mean(1)
    assert clustered_mean_se(pairs, np.repeat([0, 1, 2], 2))[1] == pytest.approx(means.std(ddof=1) / math.sqrt(3))
    assert math.isnan(clustered_mean_se(values, np.zeros(5))[1])  # one conversation: no estimate

    # correlated blocks: 40 conversations of 3-30 blocks, each with its own offset
    rng = np.random.default_rng(0)
    sizes = rng.integers(3, 31, size=40)
    clusters = np.repeat(np.arange(40), sizes)
    values = np.repeat(rng.normal(0, 1, 40), sizes) + rng.normal(0, 0.5, sizes.sum())
    mean, se = clustered_mean_se(values, clusters)
    assert se == pytest.approx(naive_clustered_se(values.tolist(), clusters.tolist()))
    # a bootstrap over conversations (resampling whole conversations) agrees
    sums, counts = np.bincount(clusters, weights=values), np.bincount(clusters)
    draws = rng.integers(0, 40, size=(4000, 40))
    boot = sums[draws].sum(1) / counts[draws].sum(1)
    assert boot.std() * math.sqrt(40 / 39) == pytest.approx(se, rel=0.1)
    # and the block-level SE is far too small here
    assert values.std(ddof=1) / math.sqrt(values.size) < se / 2


def test_table_errors_are_clustered_and_paired_against_the_named_reference():
    # one run's SE: the hand example above, per seed; seeds combine as √(sd²/S + mean SE²)
    got = combine_seeds([1.0, 1.2], [0.03, 0.04])
    assert got["mean"] == pytest.approx(1.1) and got["seeds"] == 2
    assert got["se"] == pytest.approx(math.sqrt(0.02 / 2 + 0.00125))

    runs = [
        {"variant": v, "budget": 1, "seed": s, "steps": 10, "train_tokens": 2e6, "wall_s": w, "train_time_s": w / 2}
        for v, s, w in (("a", 0, 10.0), ("a", 1, 14.0), ("b", 0, 12.0), ("b", 1, 12.0), ("c", 0, 1.0))
    ]
    conv = [0, 0, 1, 1]
    done = {
        ("a", 1, 0): blocks([0.2, 0.4, 0.1, 0.1], conv),
        ("a", 1, 1): blocks([0.4, 0.4, 0.2, 0.0], conv),
        ("b", 1, 0): blocks([0.5, 0.5, 0.3, 0.1], conv),
        ("b", 1, 1): blocks([0.3, 0.7, 0.2, 0.2], conv),
        ("c", 1, 0): blocks([0.6, 0.6, 0.4, 0.2], conv),
    }
    untrained = {(v, s): blocks([0.0, 0.2, 0.0, 0.0], conv) for v in "abc" for s in (0, 1)}
    table = {r["variant"]: r for r in summarize(runs, done, untrained, reference="a", against={"c": "b"})}
    a, b, c = table["a"], table["b"], table["c"]
    assert (a["heldout_conversations"], a["heldout_blocks"]) == (2, 4)

    def run_se(x):
        return naive_clustered_se(list(x), conv)

    tau_a = [np.array([1.2, 1.4, 1.1, 1.1]), np.array([1.4, 1.4, 1.2, 1.0])]
    assert a["tau"]["mean"] == pytest.approx(np.mean([t.mean() for t in tau_a]))
    seed_var = np.var([t.mean() for t in tau_a], ddof=1) / 2
    assert a["tau"]["se"] == pytest.approx(math.sqrt(seed_var + np.mean([run_se(t) ** 2 for t in tau_a])))
    # b − a per block, per seed: [.3, .1, .2, 0] and [-.1, .3, 0, .2], clustered by conversation
    diffs = [np.array([0.3, 0.1, 0.2, 0.0]), np.array([-0.1, 0.3, 0.0, 0.2])]
    seed_var = np.var([d.mean() for d in diffs], ddof=1) / 2
    assert b["gain"]["mean"] == pytest.approx(0.125)
    assert b["gain"]["se"] == pytest.approx(math.sqrt(seed_var + np.mean([run_se(d) ** 2 for d in diffs])))
    assert a["gain"]["mean"] == 0 and a["gain"]["se"] == 0
    # c names b as its reference: paired on seed 0, the seed both ran
    assert c["against"] == "b" and "against" not in b
    assert c["gain_against"]["mean"] == pytest.approx(0.1) and c["gain_against"]["seeds"] == 1
    assert c["gain_against"]["se"] == pytest.approx(run_se([0.1, 0.1, 0.1, 0.1]))
    assert b["tau_per_mtok"]["mean"] == pytest.approx(np.mean([0.25, 0.15, 0.15, 0.05, 0.15, 0.25, 0.1, 0.1]))
    assert a["accept"]["mean"] == pytest.approx([0.225]) and a["alpha"]["mean"] == pytest.approx([0.225])
    assert a["wall_s"] == {"mean": 12.0, "se": pytest.approx(2.0), "seeds": 2}  # sd √8 / √2
    # each over its own untrained draft (τ 1, 1.2, 1, 1): a gains .15 and .2 a seed, b .3 and .3; the
    # ratio a / b per seed (.5 and .6667), its SE that of the linearized (a − R·b) / 0.3 per block
    gained_a = [np.array([0.2, 0.2, 0.1, 0.1]), np.array([0.4, 0.2, 0.2, 0.0])]
    gained_b = [np.array([0.5, 0.3, 0.3, 0.1]), np.array([0.3, 0.5, 0.2, 0.2])]
    assert a["trained_gain"]["mean"] == pytest.approx(0.175) and b["trained_gain"]["mean"] == pytest.approx(0.3)
    ratios = [0.15 / 0.3, 0.2 / 0.3]
    linear = [(ga - r * gb) / 0.3 for ga, gb, r in zip(gained_a, gained_b, ratios)]
    seed_var = np.var(ratios, ddof=1) / 2
    assert b["gain_ratio"]["mean"] == pytest.approx(np.mean(ratios))
    assert b["gain_ratio"]["se"] == pytest.approx(math.sqrt(seed_var + np.mean([run_se(x) ** 2 for x in linear])))
    assert "gain_ratio" not in a  # the reference's own row
    assert c["gain_ratio"]["mean"] == pytest.approx(0.15 / 0.4) and c["gain_ratio"]["seeds"] == 1
    with pytest.raises(ValueError, match="different held-out blocks"):
        summarize(runs, {**done, ("b", 1, 1): blocks([0.3])}, untrained, reference="a", against={})


def test_the_gain_ratio_se_matches_a_bootstrap_over_conversations():
    """The delta-method SE of a ratio of two paired mean gains against an independent computation: a
    bootstrap that resamples whole conversations. Conversations of 1 to 8 blocks share an effect, so the
    SE clustered by conversation is the one that matches, and a block-level SE falls short of it."""
    from bench.ablate_stats import ratio_over_seeds

    rng = np.random.default_rng(7)
    conversations = np.repeat(np.arange(120), rng.integers(1, 9, size=120))
    effect = rng.normal(0, 0.1, size=120)[conversations]
    den = 0.25 + 0.5 * effect + rng.normal(0, 0.15, size=conversations.size)
    num = 0.5 + 3 * effect + 0.5 * (den - 0.25) + rng.normal(0, 0.2, size=conversations.size)
    got = ratio_over_seeds([num], [den], conversations)
    assert got["mean"] == pytest.approx(num.mean() / den.mean()) and got["seeds"] == 1

    sums = np.stack([np.bincount(conversations, weights=w) for w in (num, den, np.ones_like(num))])
    draws = rng.integers(0, 120, size=(4000, 120))
    resampled = sums[:, draws].sum(-1)  # [3, draws]: Σ num, Σ den, blocks
    bootstrap_sd = float(np.std(resampled[0] / resampled[1], ddof=1))
    assert got["se"] == pytest.approx(bootstrap_sd, rel=0.1)
    blockwise = ratio_over_seeds([num], [den], np.arange(conversations.size))["se"]
    assert blockwise < 0.8 * got["se"]
    # two seeds whose gains differ: the seed term adds to the held-out term
    two = ratio_over_seeds([num, num + 0.1], [den, den], conversations)
    assert two["mean"] == pytest.approx((num.mean() + 0.05) / den.mean()) and two["seeds"] == 2
    assert two["se"] > got["se"]


def test_the_console_table_prints_a_dash_where_a_row_has_no_reference_to_gain_against(capsys):
    # the reference "a" is not among the runs (make ablate only=b,c): no row has a gain
    runs = [
        {"variant": v, "budget": 1, "seed": 0, "steps": 10, "train_tokens": 2e6, "wall_s": 4.0, "train_time_s": 2.0}
        for v in ("b", "c")
    ]
    conv = [0, 0, 1, 1]
    done = {("b", 1, 0): blocks([0.5, 0.5, 0.3, 0.1], conv), ("c", 1, 0): blocks([0.6, 0.6, 0.4, 0.2], conv)}
    untrained = {(v, 0): blocks([0.0, 0.2, 0.0, 0.0], conv) for v in "bc"}
    table = summarize(runs, done, untrained, reference="a", against={"c": "b"})
    ablate.print_table(table)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "nan" not in "\n".join(lines)
    assert "gain —  vs - —" in lines[0]
    assert "gain —  vs b +0.1000 ± 0.0000" in lines[1]


def test_torn_results_read_as_missing(tmp_path):
    good = blocks([0.1, 0.2], [0, 1])
    good.save(tmp_path / "b.npz")
    assert np.array_equal(Blocks.load(tmp_path / "b.npz").key, good.key)
    (tmp_path / "torn.npz").write_bytes((tmp_path / "b.npz").read_bytes()[:100])
    (tmp_path / "torn.json").write_text('{"variant": "a", "tau')
    assert Blocks.load(tmp_path / "torn.npz") is None and Blocks.load(tmp_path / "none.npz") is None
    assert read_json(tmp_path / "torn.json") is None and read_json(tmp_path / "none.json") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.npz", "torn.json", "torn.npz"]  # no temp files left


def variant_file(tmp_path, variants: dict, recipe: str = "published") -> dict:
    cfg = {
        "launcher": ["python", "-m", "train"],
        "runs_dir": "runs",
        "keep_checkpoints": False,
        "common": [],
        "recipe": recipe,
        "steps": 1,
        "budgets": [1],
        "seeds": [0],
        "heldout": {},
        "reference": next(iter(variants)),
        "variants": variants,
    }
    (tmp_path / "ablate.yaml").write_text(yaml.safe_dump(cfg))
    return cfg


def test_a_variant_is_a_delta_from_a_recipe_and_can_build_on_another(tmp_path):
    """`@other` stands for variant `other` (its recipe and overrides); `against` defaults to it."""
    path = tmp_path / "ablate.yaml"
    variant_file(
        tmp_path,
        {
            "base": ["a=1"],
            "mid": ["@base", "b=2"],
            "top": ["c=3", "@mid", "d=4"],
            "now": {"recipe": "default", "against": "top"},
            "on_now": ["@now", "e=5"],
        },
    )
    assert load_config(path)["variants"] == {
        "base": {"recipe": "published", "overrides": ["a=1"], "against": None},
        "mid": {"recipe": "published", "overrides": ["a=1", "b=2"], "against": "base"},
        "top": {"recipe": "published", "overrides": ["c=3", "a=1", "b=2", "d=4"], "against": "mid"},
        "now": {"recipe": "default", "overrides": [], "against": "top"},
        "on_now": {"recipe": "default", "overrides": ["e=5"], "against": "now"},
    }
    for variants, message in [
        ({"base": ["@nope"]}, "refers to '@nope', which is not a variant"),
        ({"base": ["@loop"], "loop": ["@base"]}, "cycle: base -> loop -> base"),
        ({"base": [], "x": {"recipe": "default", "overrides": ["@base"]}}, "recipe 'default'.*recipe 'published'"),
        ({"base": [], "x": {"against": "nope"}}, "measured against 'nope'"),
        ({"base": [], "x": {"recipe": "nope"}}, "recipe 'nope' is not in"),
        ({"base": [], "x": {"overides": []}}, "must be a list of overrides or a mapping"),
    ]:
        variant_file(tmp_path, variants)
        with pytest.raises(UserError, match=message):
            load_config(path)


def test_a_variant_file_extends_another_and_runs_the_variants_it_names(tmp_path):
    """`extends`: the file's keys replace the other file's, its variants join the other's (a name
    replaced); `only` picks what runs, in order, while `@` still reaches every variant."""
    variant_file(tmp_path, {"base": ["a=1"], "lever": ["@base", "b=2"], "other": ["c=3"]})
    child = tmp_path / "sub" / "child.yaml"
    child.parent.mkdir()

    def write(**keys):
        child.write_text(yaml.safe_dump({"extends": "../ablate.yaml", **keys}))

    write(recipe="default", seeds=[4], only=["base", "lever", "mine"], variants={"base": ["z=0"], "mine": ["@other"]})
    cfg = load_config(child)
    assert list(cfg["variants"]) == ["base", "lever", "mine"] and cfg["seeds"] == [4] and cfg["steps"] == 1
    assert cfg["variants"]["lever"] == {"recipe": "default", "overrides": ["z=0", "b=2"], "against": "base"}
    assert cfg["variants"]["mine"] == {"recipe": "default", "overrides": ["c=3"], "against": "other"}
    assert "only" not in cfg and "extends" not in cfg and cfg["left_out"] == ["other"]
    # asked for by name, a variant the file defines but does not run says why it cannot
    with pytest.raises(UserError, match=r"\['other'\] are defined but not in the file's `only:` list"):
        ablate.run_ablation(cfg, tmp_path / "out", only=["base", "other"])
    for keys, message in [
        ({"only": ["base", "nope"]}, "only must list variants of"),
        ({"only": ["lever"]}, "the reference 'base' among them"),
        ({"extends": "child.yaml"}, "extends it back"),
        ({"extends": "../missing.yaml"}, "cannot read the variant file"),
    ]:
        write(**keys)
        with pytest.raises(UserError, match=message):
            load_config(child)


def test_the_file_overrides_the_shared_held_out_protocol_for_every_run(tmp_path):
    """`heldout:` holds keys of conf/heldout/ only; they reach every run, last (no variant changes them)."""
    cfg = variant_file(tmp_path, {"base": ["heldout.seed=9"]})
    cfg["heldout"] = {"anchors_per_sample": None, "seed": 3}
    (tmp_path / "ablate.yaml").write_text(yaml.safe_dump(cfg))
    overrides = ablate.run_overrides(load_config(tmp_path / "ablate.yaml"), "base", 1, 0, tmp_path / "run")
    assert overrides[-2:] == ["heldout.anchors_per_sample=null", "heldout.seed=3"]
    protocol = {"max_samples": None, "anchors_per_sample": None, "anchors_per_forward": 64, "seed": 3}
    assert ablate.compose(overrides).heldout == protocol
    for bad in ({"anchors": 5}, ["anchors_per_sample=null"]):
        cfg["heldout"] = bad
        (tmp_path / "ablate.yaml").write_text(yaml.safe_dump(cfg))
        with pytest.raises(UserError, match=r"heldout must map keys of \['anchors_per_forward'"):
            load_config(tmp_path / "ablate.yaml")


@pytest.mark.parametrize("name", ["../x", "..", "a/b", "/abs", ".hidden", "a b", "a..b", "", "x" * 101])
def test_unsafe_variant_and_recipe_names_are_refused(tmp_path, name):
    """A variant name becomes a folder under runs_dir (which train.resume=restart clears): one safe path part."""
    variant_file(tmp_path, {"base": [], name: ["a=1"]})
    with pytest.raises(UserError, match="is not allowed"):
        load_config(tmp_path / "ablate.yaml")
    variant_file(tmp_path, {"base": []}, recipe=name)
    with pytest.raises(UserError, match="is not allowed"):
        load_config(tmp_path / "ablate.yaml")


def test_the_default_recipe_is_the_plain_defaults():
    assert ablate.compose(["+recipe=default"]) == ablate.compose([])
    published = ablate.compose(["+recipe=published"])
    assert published.model.markov_rank == 256 and published.train.init_layers_from_verifier is None
    assert published != ablate.compose([])


@pytest.mark.parametrize("path", sorted((REPO / "bench").glob("ablate*.yaml")), ids=lambda p: p.name)
def test_every_shipped_variant_file_composes_every_variant(path, tmp_path):
    """Each tracked variant file loads, and each variant's overrides name keys and recipes that exist:
    a typo fails here, not an hour into a table."""
    cfg = load_config(path)
    for variant in cfg["variants"]:
        full = ablate.compose(ablate.run_overrides(cfg, variant, 1, 0, tmp_path / variant))
        # the file's budget, unless the variant sets its own steps (an arm at another arm's training time)
        own = [o.removeprefix("train.max_steps=") for o in cfg["variants"][variant]["overrides"] if "max_steps=" in o]
        assert full.train.max_steps == (int(own[-1]) if own else cfg["steps"])


def test_the_demo_picked_recipe_holds_the_two_levers_switched_off():
    """`+recipe=demo-picked` is today's defaults with tv + kl and prompt anchors back, nothing else."""
    picked, today = ablate.compose(["+recipe=demo-picked"]), ablate.compose([])
    assert dict(picked.loss.weights) == {"ce": 0.0, "tv": 0.9, "kl": 0.3} and picked.loss.train_on_prompt
    picked.loss.weights, picked.loss.train_on_prompt = today.loss.weights, today.loss.train_on_prompt
    assert picked == today


def test_the_lever_benchmarks_schedule_is_the_demos_without_its_prompt_anchors():
    """The demo trades in prompt anchors for its few reply tokens; the lever benchmarks judge that
    lever, so their schedule must be the demo's with today's default anchors, nothing else."""
    demo, bench = ablate.compose(["+experiment=demo"]), ablate.compose(["+experiment=lever-bench"])
    assert demo.loss.train_on_prompt and not bench.loss.train_on_prompt
    assert bench.loss.train_on_prompt == ablate.compose([]).loss.train_on_prompt
    demo.loss.train_on_prompt = False
    assert demo == bench


@pytest.fixture(scope="module")
def tiny_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("ablate")
    verifier = make_bigram_verifier(root / "verifier")
    train = make_samples(verifier, 12, seed=0, min_len=48, max_len=48)
    write_store(root / "store" / "train", verifier, train)
    write_store(root / "store" / "eval", verifier, make_samples(verifier, 4, seed=1), first_id=1000)
    write_token_freqs(root / "freqs.npy", train, VOCAB)
    return root


def tiny_variant_file(root, runs, **changes) -> tuple[dict, list[str]]:
    """bench/ablate_tiny.yaml on the tiny world, 2 steps, one seed and budget, runs under `runs`; its main() args."""
    cfg = yaml.safe_load((REPO / "bench" / "ablate_tiny.yaml").read_text())
    cfg.update({"runs_dir": str(runs), "steps": 2, "budgets": [1], "seeds": [0], **changes})
    cfg["variants"]["default"]["against"] = "baseline"
    path = runs.parent / f"{runs.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return cfg, [f"config={path}", f"out={runs.parent / (runs.name + '_out')}", "only=baseline,default"]


@pytest.fixture(scope="module")
def tiny_ablation(tiny_world, tmp_path_factory):
    """bench/ablate_tiny.yaml's baseline (the published recipe) and default (today's), trained once."""
    runs = tmp_path_factory.mktemp("tiny_ablation") / "runs"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ABLATE_ROOT", str(tiny_world))
        _, args = tiny_variant_file(tiny_world, runs)
        assert ablate.main(args) == 0
    return runs


def copy_of(runs, tmp_path):
    shutil.copytree(runs, tmp_path / "runs")
    return tmp_path / "runs"


@pytest.mark.parametrize(
    ("code", "says"),
    [("import sys; sys.exit(2)", "exited with status 2"), (KILL_ITSELF, "was killed by SIGKILL (out of memory?)")],
)
def test_a_failed_training_is_one_clear_error_and_keeps_what_finished(tiny_world, tmp_path, monkeypatch, code, says):
    """The training subprocess fails (a bad setting, the OOM killer): `make ablate` names the run, how it
    ended and its log, as a UserError (one line, no traceback), with the untrained draft's score kept."""
    monkeypatch.setenv("ABLATE_ROOT", str(tiny_world))
    runs = tmp_path / "runs"
    _, args = tiny_variant_file(tiny_world, runs, launcher=["python", "-c", code])
    with pytest.raises(
        UserError, match=rf"baseline x1 seed 0: its training {re.escape(says)} \(its log: .*x1_s0\.log\)"
    ):
        ablate.main(args)
    assert (runs / "baseline" / "untrained_s0" / ablate.RECORD_FILE).is_file()


@pytest.mark.slow  # trains real runs: make test, not make test-fast
def test_a_table_records_what_made_it(tiny_world, tiny_ablation, monkeypatch):
    monkeypatch.setenv("ABLATE_ROOT", str(tiny_world))
    out = tiny_ablation.parent / "runs_out"
    result = json.loads((out / "ablations.json").read_text())
    assert (out / "ablations.png").stat().st_size > 0
    assert result["made"] == git_state() and len(result["made"]["commit"]) == 40
    table = {r["variant"]: r for r in result["table"]}
    assert set(table) == {"baseline", "default"} and len(result["runs"]) == 2
    for row in table.values():
        assert row["steps"] == 2 and row["train_tokens"] > 0 and row["wall_s"]["mean"] > 0
        assert len(row["accept"]["mean"]) == len(row["alpha"]["se"]) == 4  # block size 4
        assert 1.0 <= row["tau"]["mean"] <= 5.0 and row["tau"]["se"] > 0
        # one seed: the SE is the clustered SE of the stored blocks
        run = Blocks.load(tiny_ablation / row["variant"] / "x1_s0" / "ablate.npz")
        assert row["tau"]["mean"] == pytest.approx(run.tau.mean())
        assert row["tau"]["se"] == pytest.approx(naive_clustered_se(run.tau.tolist(), run.key[:, 0].tolist()))
        assert row["heldout_conversations"] == 4
    # today's defaults, paired against the reference it names (here the baseline, so the same figure)
    assert table["default"]["against"] == "baseline"
    assert table["default"]["gain_against"] == pytest.approx(table["default"]["gain"])
    assert table["baseline"]["gain"]["mean"] == 0
    records = {r["variant"]: r for r in result["runs"]}
    for variant, record in records.items():
        assert record["trained"]["commit"] == record["scored"]["commit"] == result["made"]["commit"]
        assert set(record["data"]) == {"train_store", "eval_store", "token_freqs"}
        assert record["data"]["train_store"] != record["data"]["eval_store"]
        # the config hash is of the composed config the run trained on
        assert record["config_sha256"] == provenance(ablate.compose(record["overrides"]))["config_sha256"]
        # scored (and trained) under the file's held-out protocol: every anchor candidate
        assert (
            record["heldout"]["anchors_per_sample"] is None and "heldout.anchors_per_sample=null" in record["overrides"]
        )
        assert record == read_json(tiny_ablation / variant / "x1_s0" / "ablate.json")
    assert records["baseline"]["recipe"] == "published" and records["default"]["recipe"] == "default"
    assert records["baseline"]["config_sha256"] != records["default"]["config_sha256"]
    # the trainer's own held-out τ at the end is the same metric on the same blocks
    rows = [json.loads(x) for x in (tiny_ablation / "default" / "x1_s0" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in rows if r["split"] == "eval"][-1]["tau"] == pytest.approx(table["default"]["tau"]["mean"])
    # a scored run keeps its drafter, not its checkpoints
    assert (tiny_ablation / "default" / "x1_s0" / "drafter").is_dir()
    assert not (tiny_ablation / "default" / "x1_s0" / "checkpoints").exists()


def test_an_untrained_draft_is_scored_once_for_the_variants_that_start_from_it(tiny_world, tmp_path, monkeypatch):
    """A variant that changes only the training (anchors_all: the anchor sampling) starts from the baseline's
    draft: its untrained score is the baseline's, not scored again; one that changes the draft (its init, its
    seed) is scored."""
    monkeypatch.setenv("ABLATE_ROOT", str(tiny_world))
    _, args = tiny_variant_file(tiny_world, tmp_path / "runs")
    cfg, root = load_config(tmp_path / "runs.yaml"), tmp_path / "runs"
    first = ablate.untrained_blocks(cfg, "baseline", 0, root / "baseline" / "untrained_s0")

    def scoring(*_):
        raise AssertionError("scored")

    monkeypatch.setattr(ablate, "score", scoring)
    same = ablate.untrained_blocks(cfg, "anchors_all", 0, root / "anchors_all" / "untrained_s0")
    np.testing.assert_array_equal(same.alpha, first.alpha)
    np.testing.assert_array_equal(same.key, first.key)
    record = read_json(root / "anchors_all" / "untrained_s0" / ablate.RECORD_FILE)
    assert record["scored_as"] == str(root / "baseline" / "untrained_s0")
    assert record["score_key"] != read_json(root / "baseline" / "untrained_s0" / ablate.RECORD_FILE)["score_key"]
    for variant, seed in [("init_last_layers", 0), ("anchors_all", 1)]:
        with pytest.raises(AssertionError, match="scored"):
            ablate.untrained_blocks(cfg, variant, seed, root / variant / f"untrained_s{seed}")


@pytest.mark.slow  # trains real runs: make test, not make test-fast
def test_a_killed_run_continues_from_its_checkpoint_and_scores_as_an_unbroken_one(tiny_world, tmp_path, monkeypatch):
    """`make ablate` killed mid-training (a lost session, the OOM killer) and run again: its training dies with it,
    and the run continues from its newest checkpoint, not from step 0, and scores as the same run trained unbroken, under the same key (how
    often a run saves does not enter it). Killed at each of three checkpoints in turn."""
    monkeypatch.setenv("ABLATE_ROOT", str(tiny_world))
    steps, every, common = 100, 20, yaml.safe_load((REPO / "bench" / "ablate_tiny.yaml").read_text())["common"]
    _, unbroken = tiny_variant_file(tiny_world, tmp_path / "unbroken", steps=steps)
    assert ablate.main([*unbroken[:2], "only=baseline"]) == 0
    saving = [*common, f"train.save_every={every}", "train.keep_last=1"]
    _, args = tiny_variant_file(tiny_world, tmp_path / "runs", steps=steps, common=saving)
    run_dir, cmd = (
        tmp_path / "runs" / "baseline" / "x1_s0",
        [sys.executable, "-m", "bench.ablate", *args[:2], "only=baseline"],
    )
    killed_at = []
    for _ in range(3):
        proc = subprocess.Popen(
            cmd, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 300
        while (ckpt := latest_checkpoint(run_dir)) is None or (killed_at and int(ckpt.name[5:]) <= killed_at[-1]):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before a new checkpoint"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)  # make ablate alone: its training must not train on, orphaned
        proc.wait()
        killed_at.append(int(ckpt.name[5:]))
        while in_use(run_dir) is not None:
            assert time.monotonic() < deadline, "the training outlived make ablate"
            time.sleep(0.05)
        assert not (run_dir / "drafter").exists() and not (run_dir / ablate.RECORD_FILE).exists()
    assert 0 < killed_at[0] < killed_at[1] < killed_at[2] < steps
    assert ablate.main([*args[:2], "only=baseline"]) == 0
    log = (run_dir.parent / "x1_s0.log").read_text()
    # each run after a kill started from the checkpoint it found (the one seen, or one saved before the kill landed)
    resumed = [(int(a), int(b)) for a, b in re.findall(r"resuming from \S+step_(\d+) at step (\d+)", log)]
    assert [a for a, _ in resumed] == [b for _, b in resumed] and len(resumed) == 3
    assert all(k <= a < k + 2 * every for (a, _), k in zip(resumed, killed_at))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("split") == "train"] == list(range(1, steps + 1))  # each step once
    got, want = (
        read_json(run_dir / ablate.RECORD_FILE),
        read_json(tmp_path / "unbroken" / "baseline" / "x1_s0" / ablate.RECORD_FILE),
    )
    assert got["train_key"] == want["train_key"] and got["score_key"] == want["score_key"]
    assert len(got["resumed"]) == 3 and "resumed" not in want  # the commit of each resume, beside the first's
    got_blocks, want_blocks = (
        Blocks.load(d / "baseline" / "x1_s0" / ablate.BLOCKS_FILE) for d in (tmp_path / "runs", tmp_path / "unbroken")
    )
    np.testing.assert_array_equal(got_blocks.alpha, want_blocks.alpha)
    assert not (run_dir / "checkpoints").exists()  # a scored run keeps its drafter, not its checkpoints


@pytest.mark.slow  # trains real runs: make test, not make test-fast
def test_a_rerun_reuses_rescores_a_torn_result_and_never_retrains_a_drafter(
    tiny_world, tiny_ablation, tmp_path, monkeypatch
):
    monkeypatch.setenv("ABLATE_ROOT", str(tiny_world))
    runs = copy_of(tiny_ablation, tmp_path)
    logs = {v: (runs / v / "x1_s0.log").stat().st_size for v in ("baseline", "default")}
    before = {v: read_json(runs / v / "x1_s0" / "ablate.json") for v in ("baseline", "default")}
    stamp = (runs / "baseline" / "x1_s0" / "ablate.json").stat().st_mtime_ns
    # default's result torn mid-write; its blocks lost
    record = runs / "default" / "x1_s0" / "ablate.json"
    record.write_text(record.read_text()[:50])
    (runs / "default" / "x1_s0" / "ablate.npz").unlink()
    _, args = tiny_variant_file(tiny_world, runs)
    assert ablate.main(args) == 0
    after = {v: read_json(runs / v / "x1_s0" / "ablate.json") for v in ("baseline", "default")}
    assert (runs / "baseline" / "x1_s0" / "ablate.json").stat().st_mtime_ns == stamp  # reused as it was
    for v in ("baseline", "default"):
        assert (runs / v / "x1_s0.log").stat().st_size == logs[v]  # neither trained again
        assert {k: after[v][k] for k in ("score_key", "steps", "wall_s")} == {
            k: before[v][k] for k in ("score_key", "steps", "wall_s")
        }
    table = {r["variant"]: r for r in json.loads((tmp_path / "runs_out" / "ablations.json").read_text())["table"]}
    assert table["default"]["tau"]["mean"] == pytest.approx(
        Blocks.load(runs / "default" / "x1_s0" / "ablate.npz").tau.mean()
    )


@pytest.mark.slow  # trains real runs: make test, not make test-fast
def test_a_stored_run_reused_under_another_name_is_labelled_by_it(tiny_world, tiny_ablation, tmp_path, monkeypatch):
    """A variant whose composed config is a stored run's (the baseline's, copied under the new name, as a
    lever's `no_*` variant is yesterday's defaults) reuses it untrained and untouched, and its table row
    and run record name the variant it was reused for."""
    monkeypatch.setenv("ABLATE_ROOT", str(tiny_world))
    runs = copy_of(tiny_ablation, tmp_path)
    shutil.copytree(runs / "baseline", runs / "published_again")
    stored = (runs / "published_again" / "x1_s0" / "ablate.json").read_bytes()
    variants = yaml.safe_load((REPO / "bench" / "ablate_tiny.yaml").read_text())["variants"]
    _, args = tiny_variant_file(
        tiny_world, runs, variants={**variants, "published_again": []}, reference="published_again"
    )
    assert ablate.main([*args[:2], "only=published_again,default"]) == 0
    assert (runs / "published_again" / "x1_s0" / "ablate.json").read_bytes() == stored  # not trained nor scored
    result = json.loads((tmp_path / "runs_out" / "ablations.json").read_text())
    assert (
        {r["variant"] for r in result["table"]}
        == {r["variant"] for r in result["runs"]}
        == {
            "published_again",
            "default",
        }
    )
    assert json.loads(stored)["variant"] == "baseline"


@pytest.mark.slow  # trains real runs: make test, not make test-fast
def test_stored_runs_pair_as_the_table_pairs_them_and_only_alike(tiny_ablation, tmp_path):
    """`bench.ablate_pair`: two stored runs give the gain (and its clustered SE) the table gave the same
    pair, and recomputed here by a loop over conversations, and the gain ratio over their untrained drafts;
    a pair of other seeds is refused."""
    table = json.loads((tiny_ablation.parent / "runs_out" / "ablations.json").read_text())
    want = {r["variant"]: r for r in table["table"]}["default"]["gain_against"]
    new, old = tiny_ablation / "default" / "x1_s0", tiny_ablation / "baseline" / "x1_s0"
    assert ablate_pair.main([f"new={new}", f"old={old}", f"out={tmp_path}"]) == 0
    got = json.loads((tmp_path / "paired.json").read_text())
    assert got["gain"] == pytest.approx(want) and got["gain"]["se"] > 0
    a, b = Blocks.load(new / "ablate.npz"), Blocks.load(old / "ablate.npz")
    diffs = (a.tau - b.tau).tolist()
    assert got["gain"]["se"] == pytest.approx(naive_clustered_se(diffs, a.key[:, 0].tolist()))
    assert [r["variant"] for r in got["new"]["runs"] + got["old"]["runs"]] == ["default", "baseline"]
    assert got["made"]["commit"] == git_state()["commit"]
    # each arm's gain over its own untrained draft (kept beside it), and their ratio: by hand, and the
    # table's `gain_ratio` of `default` (the reference's gain over its own) with the arms swapped
    rows = {r["variant"]: r for r in table["table"]}
    for arm, variant in (("new", "default"), ("old", "baseline")):
        assert got[arm]["trained_gain"] == pytest.approx(rows[variant]["trained_gain"])
    gains = [
        Blocks.load(run / "ablate.npz").tau - Blocks.load(run.parent / "untrained_s0" / "ablate.npz").tau
        for run in (new, old)
    ]
    assert got["gain_ratio"]["mean"] == pytest.approx(gains[0].mean() / gains[1].mean())
    assert ablate_pair.main([f"new={old}", f"old={new}", f"out={tmp_path / 'swapped'}"]) == 0
    swapped = json.loads((tmp_path / "swapped" / "paired.json").read_text())
    assert swapped["gain_ratio"] == pytest.approx(rows["default"]["gain_ratio"])
    # a run whose untrained draft is not beside it: the gain, no ratio
    alone = tmp_path / "alone" / "x1_s0"
    shutil.copytree(old, alone)
    assert ablate_pair.main([f"new={new}", f"old={alone}", f"out={tmp_path / 'alone_out'}"]) == 0
    assert "gain_ratio" not in json.loads((tmp_path / "alone_out" / "paired.json").read_text())
    other = tmp_path / "other_seed"
    shutil.copytree(old, other)
    record = json.loads((other / "ablate.json").read_text())
    (other / "ablate.json").write_text(json.dumps({**record, "seed": 1}))
    with pytest.raises(UserError, match=r"differ in \['seed'\]: not a pair"):
        ablate_pair.main([f"new={new}", f"old={other}", f"out={tmp_path / 'refused'}"])
    assert not (tmp_path / "refused").exists()
    # an arm of other steps pairs only as an equal-time pair, and says so
    longer = tmp_path / "longer"
    shutil.copytree(old, longer)
    (longer / "ablate.json").write_text(json.dumps({**json.loads((old / "ablate.json").read_text()), "steps": 9}))
    with pytest.raises(UserError, match=r"differ in \['steps'\]: not a pair"):
        ablate_pair.main([f"new={new}", f"old={longer}", f"out={tmp_path / 'refused'}"])
    assert not (tmp_path / "refused").exists() and not got["equal_time"]
    assert ablate_pair.main([f"new={new}", f"old={longer}", f"out={tmp_path / 'timed'}", "equal_time=true"]) == 0
    timed = json.loads((tmp_path / "timed" / "paired.json").read_text())
    assert timed["equal_time"] and timed["gain"] == pytest.approx(got["gain"])


@pytest.mark.slow  # trains real runs: make test, not make test-fast
def test_changed_steps_or_overrides_retrain_instead_of_reusing(tiny_world, tiny_ablation, tmp_path, monkeypatch):
    monkeypatch.setenv("ABLATE_ROOT", str(tiny_world))
    runs = copy_of(tiny_ablation, tmp_path)
    old = read_json(runs / "baseline" / "x1_s0" / "ablate.json")
    cfg, args = tiny_variant_file(tiny_world, runs, steps=3)
    # while another process trains the run (holds its lock), the ablation stops before it touches it
    run_dir = runs / "baseline" / "x1_s0"

    def files():  # the run's records and its training log (the lock file names its holder)
        paths = [*run_dir.iterdir(), run_dir.parent / "x1_s0.log"]
        return {p.name: p.read_bytes() for p in paths if p.is_file() and p.name != "train.lock"}

    before = files()
    code = "import sys, time; from pathlib import Path; from dspark.run_lock import try_lock; "
    code += "lock = try_lock(Path(sys.argv[1])); print(flush=True); time.sleep(600)"
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()
        with pytest.raises(
            UserError, match=re.escape(f"{run_dir} is in use by another training run (pid {holder.pid}")
        ):
            ablate.main([*args[:2], "only=baseline"])
    finally:
        holder.kill()
        holder.wait()
    assert files() == before and "ablate_training.json" in before
    assert ablate.main([*args[:2], "only=baseline"]) == 0
    new = read_json(runs / "baseline" / "x1_s0" / "ablate.json")
    assert new["steps"] == 3 and new["train_key"] != old["train_key"]
    # the finished run of the other config was moved aside with its log, not trained over
    aside = runs / "baseline" / f"x1_s0.{old['train_key'][:12]}"
    assert {p.name: p.read_bytes() for p in aside.iterdir() if p.is_file() and p.name != "train.lock"} == {
        name: data for name, data in before.items() if name != "x1_s0.log"
    }
    assert (aside / "drafter" / "model.safetensors").is_file()
    assert aside.with_name(f"{aside.name}.log").read_bytes() == before["x1_s0.log"]
    # the key follows what the run trains on, whatever changes it
    base = provenance(ablate.compose(ablate.run_overrides(load_config(tmp_path / "runs.yaml"), "baseline", 1, 0, runs)))
    assert base["train_key"] == new["train_key"]
    cfg["variants"]["baseline"] = ["train.lr=5e-3"]
    (tmp_path / "runs.yaml").write_text(yaml.safe_dump(cfg))
    edited = load_config(tmp_path / "runs.yaml")
    keys = {
        "lr": provenance(ablate.compose(ablate.run_overrides(edited, "baseline", 1, 0, runs))),
        "seed": provenance(ablate.compose(ablate.run_overrides(edited, "baseline", 1, 1, runs))),
        "store": provenance(
            ablate.compose(
                [
                    *ablate.run_overrides(edited, "baseline", 1, 0, runs),
                    f"train.train_store={tiny_world / 'store' / 'eval'}",
                ]
            )
        ),
        "eval": provenance(
            ablate.compose([*ablate.run_overrides(edited, "baseline", 1, 0, runs), "heldout.max_samples=2"])
        ),
    }
    assert len({base["train_key"], *(k["train_key"] for k in keys.values())}) == 4  # eval changes the score key only
    assert keys["eval"]["train_key"] == keys["lr"]["train_key"] and keys["eval"]["score_key"] != keys["lr"]["score_key"]
    assert keys["store"]["data"]["train_store"] != base["data"]["train_store"]
    # the run dir does not enter the key: the same run elsewhere is the same result
    elsewhere = provenance(ablate.compose(ablate.run_overrides(edited, "baseline", 1, 0, tmp_path / "x")))
    assert elsewhere["train_key"] == keys["lr"]["train_key"]
    assert digest({"a": 1, "b": 2}) == digest({"b": 2, "a": 1})


def assert_same_figures(got, want, where="table"):
    """Every figure of `got` equals `want`'s (floats to rounding), key for key."""
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for key in want:
            assert_same_figures(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for k, (g, w) in enumerate(zip(got, want)):
            assert_same_figures(g, w, f"{where}[{k}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), where
    else:
        assert got == want, where


@pytest.mark.slow  # trains real runs: make test, not make test-fast
def test_tables_of_one_seed_each_merge_into_the_table_of_both(tiny_world, tiny_ablation, tmp_path, monkeypatch):
    monkeypatch.setenv("ABLATE_ROOT", str(tiny_world))
    runs = copy_of(tiny_ablation, tmp_path)
    _, args = tiny_variant_file(tiny_world, runs, seeds=[1])
    assert ablate.main(args) == 0  # seed 1 alone (trains it), then both seeds from the same runs at once
    assert ablate.main([*args[:1], f"out={tmp_path / 'both'}", "seeds=0,1", *args[2:]]) == 0
    seed_0, seed_1 = tiny_ablation.parent / "runs_out", tmp_path / "runs_out"
    assert ablate_merge.main([f"out={tmp_path / 'merged'}", str(seed_0), str(seed_1 / "ablations.json")]) == 0
    merged = read_json(tmp_path / "merged" / "ablations.json")
    both = read_json(tmp_path / "both" / "ablations.json")
    assert_same_figures(merged["table"], both["table"])
    assert merged["config"]["seeds"] == [0, 1] and (tmp_path / "merged" / "ablations.png").stat().st_size > 0
    key = lambda run: (run["variant"], run["seed"])  # noqa: E731
    assert sorted(merged["runs"], key=key) == sorted(both["runs"], key=key)
    assert merged["made"]["commit"] == git_state()["commit"]
    assert [m["made"] for m in merged["merged_from"]] == [read_json(seed_0 / "ablations.json")["made"]] * 2
    # refused, nothing written: a seed twice, a table of two seeds, another schedule, other data
    tampered = read_json(seed_1 / "ablations.json")
    tampered["config"]["steps"] = 3
    (tmp_path / "steps.json").write_text(json.dumps(tampered))
    tampered = read_json(seed_1 / "ablations.json")
    tampered["runs"][0]["data"]["train_store"] = "another store"
    (tmp_path / "data.json").write_text(json.dumps(tampered))
    for other, why in [
        (seed_0, "seed 0 is in two tables"),
        (tmp_path / "both", "each table must hold one seed"),
        (tmp_path / "steps.json", "another steps"),
        (tmp_path / "data.json", "data fingerprints differ"),
    ]:
        with pytest.raises(UserError, match=why):
            ablate_merge.main([f"out={tmp_path / 'refused'}", str(seed_0), str(other)])
        assert not (tmp_path / "refused").exists()


def test_make_ablate_trains_todays_defaults_from_the_recipe_alone(tmp_path):
    """bench/ablate.yaml's `default` is the plain defaults; every variant of the file composes."""
    cfg = load_config(REPO / "bench" / "ablate.yaml")
    assert cfg["variants"]["default"] == {"recipe": "default", "overrides": [], "against": "h10_slot0"}
    assert cfg["variants"]["baseline"] == {"recipe": "published", "overrides": [], "against": None}
    run = ablate.run_overrides(cfg, "default", 1, 0, tmp_path)
    assert ablate.compose(run) == ablate.compose([o for o in run if o != "+recipe=default"])
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        for variant in cfg["variants"]:
            compose("train", overrides=ablate.run_overrides(cfg, variant, 1, 0, tmp_path))


def test_every_benchmark_json_records_the_commit_that_measured_it(tmp_path):
    from bench import write_figures

    written = write_figures(tmp_path, "speed", {"ratio": 1.5})
    on_disk = json.loads((tmp_path / "speed.json").read_text())
    assert on_disk == written and on_disk["ratio"] == 1.5
    assert {k: on_disk["made"][k] for k in ("commit", "dirty")} == git_state()
    assert on_disk["made"]["commit"] and len(on_disk["made"]["date"]) == 10
    own = {"commit": "abc", "dirty": False}  # figures that say what made them (ablations.json) keep it
    assert json.loads(json.dumps(write_figures(tmp_path, "own", {"made": own})))["made"] == own


def test_a_tree_is_dirty_for_code_not_for_results_or_prose(tmp_path, monkeypatch):
    """A record says dirty when code or config differs from the commit; edited docs and new results do not count."""
    monkeypatch.delenv("DSPARK_COMMIT", raising=False)  # else the commit comes from it, the tree unread

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    (tmp_path / "docs").mkdir()
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "train.py").write_text("lr = 1\n")
    (tmp_path / "docs" / "levers.md").write_text("# levers\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "start")
    clean = git_state(tmp_path)
    assert len(clean["commit"]) == 40 and clean["dirty"] is False
    (tmp_path / "docs" / "levers.md").write_text("# levers\nan edit\n")
    (tmp_path / "README.md").write_text("new prose\n")
    (tmp_path / "bench" / "results" / "table.json").write_text("{}")
    assert git_state(tmp_path) == clean
    (tmp_path / "train.py").write_text("lr = 2\n")
    assert git_state(tmp_path) == {**clean, "dirty": True}
    git("checkout", "train.py")
    (tmp_path / "conf.yaml").write_text("lr: 2\n")  # a new, untracked config file counts too
    assert git_state(tmp_path) == {**clean, "dirty": True}


@pytest.mark.slow  # reads the trained tiny runs: make test, not make test-fast
def test_memorization_scores_a_run_on_its_own_training_conversations(tiny_world, tiny_ablation, monkeypatch):
    from bench import memorization

    monkeypatch.setenv("ABLATE_ROOT", str(tiny_world))
    out = tiny_ablation.parent / "memorization_out"
    config = f"config={tiny_ablation.parent / 'runs.yaml'}"
    assert memorization.main([config, "runs=default:1:0", "samples=3", f"out={out}"]) == 0
    result = json.loads((out / "memorization.json").read_text())
    (row,) = result["runs"]
    record = read_json(tiny_ablation / "default" / "x1_s0" / "ablate.json")
    assert row["trained"] == record["trained"] and row["config_sha256"] == record["config_sha256"]
    assert row["heldout_tau"]["mean"] == pytest.approx(
        Blocks.load(tiny_ablation / "default" / "x1_s0" / "ablate.npz").tau.mean(), abs=1e-4
    )
    # 3 of the 12 training conversations, not the 4 held-out ones
    assert row["train_set_tau"]["conversations"] == 3 and row["heldout_tau"]["conversations"] == 4
    assert 1.0 <= row["train_set_tau"]["mean"] <= 5.0
    assert row["gap"] == pytest.approx(row["train_set_tau"]["mean"] - row["heldout_tau"]["mean"], abs=1e-4)
    assert result["train_store_fingerprint"] == store_fingerprint(str(tiny_world / "store" / "train"))
    # every named run is checked before any is scored
    with pytest.raises(UserError, match="no scored run"):
        memorization.main([config, "runs=default:1:0,baseline:4:0", f"out={out}"])
    with pytest.raises(UserError, match="not a variant"):
        memorization.main([config, "runs=default:1:0,nope:1:0", f"out={out}"])
