"""`python -m extract.plan` (make plan): what `make extract` will take, before it runs.

For the target, the tokenized dataset and `extract.store_dtype` of the extract config it
prints, per split, the tokens still to extract, the store bytes they will add, the free
space where the stores go, and a wall time.

Store bytes come from a probe: the states of a few samples spread evenly over the
dataset (a transformers forward of the verifier on this machine, at vLLM's layer ids)
are written with the store's own writer and codecs into a temporary store; its bytes per
token times the tokens, plus each shard's fixed cost (metadata, offsets, ids), is the
estimate. The compressed size depends on the states themselves, which is why it is
measured on real ones rather than computed from the shapes.

Wall time: tokens / `plan.tokens_per_s` when stated (e.g. from an earlier run's
extract-summary.json), else tokens / the probe's forward rate (one transformers process
on this machine: a rough guide for CPU servers, not for GPU ones).

`python -m extract` runs `check_space` first: it refuses (UserError) to start when the
estimate exceeds the free space, unless `extract.space_check=false`; the probe runs only
when the uncompressed size would not fit. `extract.dry_run=true` prints the plan and stops.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem
from omegaconf import DictConfig

from dspark.config import Checked, TargetConfig, load_section
from dspark.entry import stage_main
from dspark.errors import UserError
from dspark.extract.client import Row
from dspark.extract.config import STORE_DTYPES, ExtractConfig
from dspark.extract.dataset import check_tokenizer, read_split
from dspark.extract.scale import ScaleConfig, scale_config
from dspark.store import BF16, Sample, ShardStore, StoreWriter, bf16_to_bits
from dspark.targets import Target, dataset_target, resolve_target

TOKEN_ARRAYS = ("hidden", "hidden_scale", "token_ids", "loss_mask")
"""Arrays whose bytes grow with the tokens; the rest of a shard is a fixed cost per shard."""


@dataclass
class PlanConfig(Checked):
    """How `make plan` and extraction's space check estimate a run (conf/extract.yaml `plan`)."""

    SECTION: ClassVar[str] = "plan"

    probe_samples: int
    """Samples (spread evenly over the dataset) whose states are measured."""
    probe_tokens: int
    """... at most this many tokens in all (at least one sample)."""
    tokens_per_s: float | None
    """Stated extraction throughput of the whole run; null = the probe's forward rate."""

    def __post_init__(self) -> None:
        self.at_least(1, "probe_samples", "probe_tokens")
        self.positive("tokens_per_s", nullable=True)


@dataclass
class SplitPlan:
    """One split's share of the work."""

    name: str
    url: str
    samples: int
    tokens: int
    todo: list[Row]
    """Samples not committed yet (a rerun extracts only these)."""

    @property
    def todo_tokens(self) -> int:
        return sum(len(r.input_ids) for r in self.todo)


@dataclass
class Probe:
    """What the probe measured."""

    samples: int
    tokens: int
    bytes_per_token: float
    bytes_per_shard: float
    store_bytes: int
    """Bytes of an empty store (root metadata, manifest)."""
    forward_tokens_per_s: float


@dataclass
class Plan:
    """The estimate of one extraction run (see the module docstring)."""

    target: str
    store_dtype: str
    store_dir: str
    splits: list[SplitPlan]
    raw_bytes_per_token: int
    shards: int
    free_bytes: int | None
    probe: Probe | None
    tokens_per_s: float | None
    rate_source: str

    @property
    def todo_tokens(self) -> int:
        return sum(s.todo_tokens for s in self.splits)

    @property
    def store_bytes(self) -> int:
        """Estimated bytes the run adds (the uncompressed size, an upper bound, without a probe)."""
        if self.probe is None:
            return self.raw_bytes_per_token * self.todo_tokens
        new_stores = sum(1 for s in self.splits if s.todo and s.samples == len(s.todo))
        return round(
            self.probe.bytes_per_token * self.todo_tokens
            + self.probe.bytes_per_shard * self.shards
            + self.probe.store_bytes * new_stores
        )

    @property
    def wall_s(self) -> float | None:
        return None if self.tokens_per_s is None else self.todo_tokens / self.tokens_per_s

    def fits(self) -> bool | None:
        return None if self.free_bytes is None else self.store_bytes <= self.free_bytes

    def refuse_if_full(self) -> None:
        """UserError when the estimate exceeds the free space (the message says what to do)."""
        if self.fits() is False:
            raise UserError(
                f"the stores under {self.store_dir} need ~{_size(self.store_bytes)} but only "
                f"{_size(self.free_bytes)} are free there: free space, point extract.store_dir "
                "(paths.store_dir) elsewhere, use extract.store_dtype=fp8 (about 0.6x the bytes of bf16), "
                "or set extract.space_check=false to start anyway\n" + self.format()
            )

    def format(self) -> str:
        lines = [f"plan: target {self.target}, store_dtype {self.store_dtype}, stores under {self.store_dir}"]
        for s in self.splits:
            lines.append(
                f"  {s.name:8s} {s.samples:,} samples, {s.tokens:,} tokens; to extract: "
                f"{len(s.todo):,} samples, {s.todo_tokens:,} tokens"
            )
        if self.probe is None:
            lines.append(f"  store bytes: at most {_size(self.store_bytes)} (uncompressed, no probe)")
        else:
            p = self.probe
            lines.append(
                f"  store bytes: ~{_size(self.store_bytes)} ({p.bytes_per_token:,.1f} B/token measured "
                f"on {p.samples} samples / {p.tokens:,} tokens; raw {self.raw_bytes_per_token:,} B/token; "
                f"{self.shards} shards)"
            )
        free = "unknown (not a local path)" if self.free_bytes is None else _size(self.free_bytes)
        verdict = {True: "fits", False: "DOES NOT FIT", None: "cannot tell"}[self.fits()]
        lines.append(f"  free space at {self.store_dir}: {free} -> {verdict}")
        wall = "unknown" if self.wall_s is None else f"~{_duration(self.wall_s)}"
        rate = "" if self.tokens_per_s is None else f" at {self.tokens_per_s:,.0f} tokens/s ({self.rate_source})"
        lines.append(f"  wall time: {wall}{rate}")
        return "\n".join(lines)


def _size(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def free_bytes(url: str) -> int | None:
    """Free bytes of the filesystem `url` would live on (its nearest existing parent); None off local disk."""
    fs, path = fsspec.core.url_to_fs(url)
    if not isinstance(fs, LocalFileSystem):
        return None
    parent = Path(path).absolute()
    while not parent.exists():
        parent = parent.parent
    return shutil.disk_usage(parent).free


def raw_bytes_per_token(target: Target, dtype: str) -> int:
    """Uncompressed bytes of one stored token: hidden states (+ scales) + int32 id + uint8 mask."""
    n_layers = len(target.layer_ids)
    hidden = n_layers * target.hidden_size * 2 if dtype == BF16 else n_layers * (target.hidden_size + 4)
    return hidden + 4 + 1


def shard_count(lengths: Sequence[int], shard_samples: int, shard_tokens: int, writers: int) -> int:
    """Shards the extraction's writers cut `lengths` into: one writer per server, on contiguous ranges."""
    size, extra = divmod(len(lengths), writers)
    shards, start = 0, 0
    for w in range(writers):
        end = start + size + (w < extra)
        n = t = 0
        for length in lengths[start:end]:
            n, t = n + 1, t + length
            if n >= shard_samples or t >= shard_tokens:
                shards, n, t = shards + 1, 0, 0
        shards += n > 0
        start = end
    return shards


def probe_rows(rows: Sequence[Row], max_samples: int, max_tokens: int) -> list[Row]:
    """Up to `max_samples` rows at evenly spaced quantiles of the sample length, in dataset order.

    Matching the dataset's length distribution matters: a store's bytes per token depend on
    how many samples share a chunk (e.g. a common system prompt compresses across samples).
    Fewer rows are taken while they exceed `max_tokens` (at least one).
    """
    by_length = sorted(range(len(rows)), key=lambda i: (len(rows[i].input_ids), i))
    for n in range(min(max_samples, len(rows)), 0, -1):
        picks = sorted({by_length[round(q)] for q in np.linspace(0, len(rows) - 1, n)})
        if n == 1 or sum(len(rows[i].input_ids) for i in picks) <= max_tokens:
            return [rows[i] for i in picks]
    return []


def hf_states(model_dir: Path, layer_ids: list[int], rows: Sequence[Row], dtype: str = "float32") -> list[Sample]:
    """Samples of `rows` with the verifier's hidden states from a transformers forward, as bf16 bits.

    vLLM's layer ids: id k < N is the residual stream entering decoder layer k, id N the
    input of the final norm.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    decoder = model.get_decoder()
    n = len(decoder.layers)
    captured: dict[int, torch.Tensor] = {}

    def keep(k: int):
        return lambda _module, args: captured.__setitem__(k, args[0])

    hooks = [decoder.norm.register_forward_pre_hook(keep(n))]
    hooks += [decoder.layers[k].register_forward_pre_hook(keep(k)) for k in layer_ids if k < n]
    samples = []
    try:
        with torch.no_grad():
            for row in rows:
                model(torch.tensor([row.input_ids]))
                hidden = torch.stack([captured[k][0] for k in layer_ids], dim=1)  # [T, L, H]
                samples.append(
                    Sample(
                        row.sample_id,
                        np.asarray(row.input_ids, np.int32),
                        np.asarray(row.loss_mask, np.uint8),
                        bf16_to_bits(hidden),
                    )
                )
    finally:
        for hook in hooks:
            hook.remove()
    return samples


def measure(samples: Sequence[Sample], store_target: dict) -> tuple[float, float, int]:
    """(bytes per token, fixed bytes per shard, bytes of an empty store) of `samples` in a store."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "probe"
        store = StoreWriter.create_or_open(root, store_target, "probe")
        empty = _tree_bytes(root)
        name = store.write_shard(list(samples))["name"]
        shard = root / "shards" / name
        token_bytes = sum(_tree_bytes(shard / a) for a in TOKEN_ARRAYS if (shard / a).exists())
        tokens = sum(len(s.token_ids) for s in samples)
        return token_bytes / tokens, _tree_bytes(shard) - token_bytes, empty


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def split_plans(target: Target, ex: ExtractConfig, scale: ScaleConfig) -> list[SplitPlan]:
    """This node's samples of each split, and those not yet committed to an existing store."""
    check_tokenizer(Path(ex.data_dir), target.tokenizer_sha256, target.name_or_path)
    plans = []
    for name in ex.splits:
        split = read_split(
            Path(ex.data_dir), name, max_tokens=target.config.max_model_len, vocab_size=target.vocab_size
        )
        rows = scale.share(split.rows, lambda row: row.sample_id)
        url = f"{ex.store_dir.rstrip('/')}/{name}"
        try:
            done = ShardStore.open(url).committed_sample_ids()
        except FileNotFoundError:
            done = set()
        plans.append(
            SplitPlan(
                name, url, len(rows), sum(len(r.input_ids) for r in rows), [r for r in rows if r.sample_id not in done]
            )
        )
    return plans


def make_plan(target: Target, ex: ExtractConfig, scale: ScaleConfig, cfg: PlanConfig, *, probe: bool = True) -> Plan:
    """The plan of extracting `ex.splits` for `target`; `probe=False` skips the probe (upper-bound bytes)."""
    dtype = STORE_DTYPES[ex.store_dtype]
    splits = split_plans(target, ex, scale)
    writers = 1 if ex.server_url else scale.servers
    shards = sum(
        shard_count([len(r.input_ids) for r in s.todo], ex.shard_samples, ex.shard_tokens, writers) for s in splits
    )
    measured, rate, source = None, cfg.tokens_per_s, "stated: plan.tokens_per_s"
    todo = [r for s in splits for r in s.todo]
    if probe and todo:
        rows = probe_rows(todo, cfg.probe_samples, cfg.probe_tokens)
        start = time.perf_counter()
        samples = hf_states(target.model_dir, target.layer_ids, rows, target.config.dtype)
        seconds = time.perf_counter() - start
        per_token, per_shard, empty = measure(samples, target.store_attrs(dtype))
        n_tokens = sum(len(r.input_ids) for r in rows)
        measured = Probe(len(rows), n_tokens, per_token, per_shard, empty, n_tokens / seconds)
        if rate is None:
            rate, source = measured.forward_tokens_per_s, "the probe's transformers forward on this machine"
    return Plan(
        target.name_or_path,
        ex.store_dtype,
        ex.store_dir,
        splits,
        raw_bytes_per_token(target, dtype),
        shards,
        free_bytes(ex.store_dir),
        measured,
        rate,
        source,
    )


def check_space(target: Target, ex: ExtractConfig, scale: ScaleConfig, cfg: PlanConfig) -> Plan | None:
    """Refuse (UserError) an extraction whose stores cannot fit where they go.

    Free: nothing is probed when even the uncompressed size fits. Skipped with
    `extract.space_check=false`, and where the free space is unknown (object storage).
    """
    if not ex.space_check:
        return None
    plan = make_plan(target, ex, scale, cfg, probe=False)
    if plan.fits() is not False:
        return plan
    plan = make_plan(target, ex, scale, cfg)
    plan.refuse_if_full()
    return plan


def _inputs(cfg: DictConfig) -> tuple[Target, ExtractConfig, ScaleConfig, PlanConfig]:
    ex = load_section(ExtractConfig, cfg, "extract")
    target = resolve_target(load_section(TargetConfig, cfg, "target"), dataset_target(ex.data_dir))
    return target, ex, scale_config(cfg), load_section(PlanConfig, cfg, "plan")


def before_extraction(cfg: DictConfig) -> bool:
    """`python -m extract`'s first step: print the plan with `extract.dry_run` (returns True: stop
    there), else refuse a run whose stores cannot fit (`check_space`)."""
    ex = load_section(ExtractConfig, cfg, "extract")
    if not (ex.dry_run or ex.space_check):
        return False
    target, ex, scale, plan_cfg = _inputs(cfg)
    if ex.dry_run:
        print(make_plan(target, ex, scale, plan_cfg).format())
        return True
    check_space(target, ex, scale, plan_cfg)
    return False


@stage_main("extract")
def main(cfg: DictConfig) -> None:
    print(make_plan(*_inputs(cfg)).format())


if __name__ == "__main__":
    main()
