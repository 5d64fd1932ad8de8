"""What each lever costs per training step: every variant of the lever table against today's defaults,
as the ratio of their step times measured side by side.

The lever tables (`make ablate`, docs/levers.md) report each run's tokens/s, but those runs shared
the machine with other runs, so their throughputs do not compare. Here each variant of
`bench/ablate_levers.yaml` (its recipe and overrides, the lever benchmark's schedule) is built with
the trainer's own `build_trainer` beside today's defaults, in a child process of its own that keeps
freed memory (as `make demo` trains), and the two take turns: each round times `STEPS_PER_ROUND`
optimizer steps (`Trainer.train_step`: forward, loss, backward, AdamW) of one and then of the other,
in alternating order, on micro-batches prepared before the timing (the data workers' reading and
anchoring is left out: it overlaps the step in training). The ratio is taken per round (the
variant's step time / the defaults'), reported as the median with its min and max, in wall and CPU
time; above 1 the variant's step is slower. `default (again)` pairs the defaults with themselves:
how far from 1 the harness itself lands.

Data: the benchmark's own first `SAMPLES` training conversations (their token ids and loss masks)
with random states of the verifier's shapes in a temporary store (a step costs the same whatever
the states hold), so no extraction is needed. Rows: `smollm2-135m` (the embedded default) and
`qwen2.5-coder-0.5b` where its verifier is installed (`make setup-qwen25`).

Run: python -m bench.bench_recipe_step   (or python -m bench only=recipe_step)
Another variant file's variants (each against the defaults), the figures written to DIR/recipe_step.json:
    python -m bench.bench_recipe_step variant_file=bench/ablate_regularize.yaml only=default,anchors_64 out=DIR
"""

from __future__ import annotations

import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench import lever_data, split_args, write_figures
from bench.ablate import compose, run_overrides
from bench.ablate_variants import load_config
from bench.bench_train_step import KEEP_FREED
from dspark.entry import script_main
from dspark.errors import MissingInput, UserError
from dspark.store import Sample, StoreWriter, bf16_to_bits
from dspark.targets import resolve_target
from dspark.train.build import build_trainer, make_accelerator
from dspark.train.config import load_sections
from dspark.train.sampler import share_of_rank
from dspark.vocab import count_tokens

VARIANT_FILE = Path(__file__).with_name("ablate_levers.yaml")
BENCHMARKS = ("smollm2-135m", "qwen2.5-coder-0.5b")
SAMPLES = 48
STEPS_PER_ROUND = 3
ROUNDS = 6
THREADS = 2
PAIR_ROW = "pair row: "
REPO = Path(__file__).resolve().parents[1]
USAGE = "python -m bench.bench_recipe_step [variant_file=PATH] [only=a,b] [out=DIR]"


def benchmark_samples(name: str, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The first `n` training conversations of lever benchmark `name`: (token ids, loss mask)."""
    folder = lever_data.bench_dir(name)
    files = lever_data.checked_files(folder, lever_data.load_manifest(folder))
    rows = gzip.decompress(files["train.jsonl.gz"]).decode().splitlines()[:n]
    return [
        (np.asarray(row["input_ids"], np.int32), np.asarray(row["loss_mask"], np.uint8))
        for row in map(json.loads, rows)
    ]


def synthetic_store(url: Path, target, samples: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """A train store of `samples` with random bf16 states `[T, L, H]` of the verifier's layers."""
    writer = StoreWriter.create_or_open(url, target.store_attrs(), target.tokenizer_sha256, {"split": "train"})
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i, (ids, mask) in enumerate(samples):
        states = torch.randn(len(ids), len(target.layer_ids), target.hidden_size, generator=gen)
        rows.append(Sample(i, ids, mask, bf16_to_bits(states)))
    writer.write_shard(rows)


def prepared_steps(trainer, n: int) -> list:
    """The first `n` steps of the trainer's plan, each its micro-batches as the data workers prepare them."""
    plan = trainer.planner.epoch(0)[:n]
    mine = [share_of_rank(trainer.planner, step, 0, 1) for step in plan]
    return list(trainer.loader(trainer.train_split, mine, epoch=0))


def timed(trainer, steps: list) -> tuple[float, float, int]:
    """Wall and CPU seconds of the optimizer steps over `steps`, and the tokens they trained."""
    tokens = 0
    wall, cpu = time.perf_counter(), time.process_time()
    for micro_batches in steps:
        tokens += int(trainer.train_step(micro_batches)["num_tokens"])
    return time.perf_counter() - wall, time.process_time() - cpu, tokens


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def settings(name: str, work: Path, variant_file: Path) -> tuple[dict, list[str]]:
    """The variant file's config (its runs on benchmark `name`'s verifier) and the overrides that point a run
    at the synthetic store under `work` (written here on the first call)."""
    cfg = load_config(variant_file)
    manifest = lever_data.load_manifest(lever_data.bench_dir(name))
    cfg["common"] = [*cfg["common"], *manifest["target"]["overrides"]]
    store, freqs = work / name / "store", work / name / "token_freqs.npy"
    if not store.exists():
        target = resolve_target(load_sections(compose(cfg["common"])).target)
        samples = benchmark_samples(name, SAMPLES)
        synthetic_store(store, target, samples)
        np.save(freqs, count_tokens([ids for ids, _ in samples], [mask for _, mask in samples], target.vocab_size))
    data = [
        f"train.train_store={store}",
        "train.eval_store=null",
        f"train.token_freqs={freqs}",
        "train.draft_vocab_from=tokens",  # the ranking costs nothing per step; on random states it is noise
        "train.data_workers=0",
        "train.log_with=[]",
    ]
    return cfg, data


def measure_pair(name: str, variant: str, work: Path, variant_file: Path) -> dict:
    """Today's defaults and `variant` (`default` again: the harness's own bias and noise), built in this
    process and timed in turns."""
    cfg, data = settings(name, work, variant_file)

    def build(label: str, variant: str):
        full = compose([*run_overrides(cfg, variant, 1, 0, work / name / label), *data])
        trainer = build_trainer(full, make_accelerator(load_sections(full).train))
        steps = prepared_steps(trainer, STEPS_PER_ROUND)
        timed(trainer, steps)  # warm-up: first-touch allocations
        return trainer, steps

    pair = [("default", build("default", "default")), ("variant", build(f"{variant}_variant", variant))]
    walls, cpus, speeds = [], [], {"default": [], "variant": []}
    for r in range(ROUNDS):
        times = {}
        for label, (trainer, steps) in pair if r % 2 == 0 else pair[::-1]:
            wall, cpu, tokens = timed(trainer, steps)
            times[label] = (wall, cpu)
            speeds[label].append(tokens / wall)
        walls.append(times["variant"][0] / times["default"][0])
        cpus.append(times["variant"][1] / times["default"][1])
    return {
        "step_time_ratio": spread(walls),
        "cpu_time_ratio": spread(cpus),
        "tokens_per_s": round(statistics.median(speeds["variant"]), 1),
        "defaults_tokens_per_s": round(statistics.median(speeds["default"]), 1),
    }


def measure(name: str, work: Path, variant_file: Path, only: list[str] | None) -> dict:
    """Every variant of the lever table against the defaults on benchmark `name`, each pair in a child process
    that keeps freed memory (as `make demo` trains: glibc would otherwise hand every large freed buffer back
    to the OS and fault it in again at the next step, which no GPU allocator does). `only`: these variants."""
    cfg, _ = settings(name, work, variant_file)
    row = {"samples": SAMPLES, "variants": {}}
    for variant in only or cfg["variants"]:
        env = {**os.environ, **KEEP_FREED, "OMP_NUM_THREADS": str(THREADS)}
        cmd = [sys.executable, "-m", "bench.bench_recipe_step", f"pair={name},{variant},{variant_file},{work}"]
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        found = [line.removeprefix(PAIR_ROW) for line in proc.stdout.splitlines() if line.startswith(PAIR_ROW)]
        if proc.returncode != 0 or len(found) != 1:
            raise RuntimeError(
                f"{name} {variant}: the timing child failed (exit {proc.returncode}): {proc.stderr[-3000:]}"
            )
        fig = row["variants"]["default (again)" if variant == "default" else variant] = json.loads(found[0])
        print(
            f"   {name} {variant:20s} step time {fig['step_time_ratio']['median']:.3f}x the defaults' "
            f"({fig['step_time_ratio']['min']:.3f}-{fig['step_time_ratio']['max']:.3f}; CPU time "
            f"{fig['cpu_time_ratio']['median']:.3f}x), {fig['tokens_per_s']:.0f} against "
            f"{fig['defaults_tokens_per_s']:.0f} tokens/s",
            flush=True,
        )
    return row


def main(out_dir: Path, variant_file: Path = VARIANT_FILE, only: list[str] | None = None) -> dict:
    missing = sorted(set(only or []) - set(load_config(variant_file)["variants"]))
    if missing:  # before any timing, and not a MissingInput: that one skips a benchmark whose verifier is absent
        raise UserError(f"only={','.join(only)}: {missing} are not variants of {variant_file}")
    rows, skipped = {}, {}
    with tempfile.TemporaryDirectory(prefix="recipe_step_") as tmp:
        for name in BENCHMARKS:
            try:
                rows[name] = measure(name, Path(tmp), variant_file, only)
            except MissingInput as err:  # a verifier that is not installed here
                skipped[name] = str(err)
                print(f"   {name}: skipped ({err})", flush=True)
    figures = {
        "setting": {
            "variant_file": os.path.relpath(variant_file.resolve(), REPO),
            "only": only,
            "samples": SAMPLES,
            "steps_per_round": STEPS_PER_ROUND,
            "rounds": ROUNDS,
            "threads": THREADS,
            "allocator": KEEP_FREED,
            "device": "cpu",
        },
        "rows": rows,
        "skipped": skipped,
    }
    return write_figures(out_dir, "recipe_step", figures)


def cli(argv: list[str]) -> int:
    args, rest = split_args(argv, {"pair", "variant_file", "only", "out"}, set(), USAGE)
    if rest:
        raise UserError(f"unknown arguments {rest}; usage: {USAGE}")
    if "pair" not in args:
        only = args["only"].split(",") if "only" in args else None
        main(Path(args.get("out", "bench/results")), Path(args.get("variant_file", VARIANT_FILE)), only)
    else:  # a timing child (see `measure`)
        torch.set_num_threads(THREADS)
        name, variant, variant_file, work = args["pair"].split(",", 3)
        print(PAIR_ROW + json.dumps(measure_pair(name, variant, Path(work), Path(variant_file))), flush=True)
    return 0


if __name__ == "__main__":
    script_main(cli)
