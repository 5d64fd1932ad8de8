"""The extraction stage end to end: tokenized splits -> vLLM servers -> shard stores -> summary.

Each split `<data_dir>/<split>.jsonl` goes to its own store `<store_dir>/<split>`. A rerun
opens the store, deletes shards a killed run left uncommitted, and extracts only the
samples not committed yet. `gpus` servers run side by side (on CPU: processes pinned to
disjoint cores), each fed a contiguous range of the missing samples and writing its own
shards; a server that dies is restarted (at most `max_restarts` times) and its range
resumes from what was committed.

Staged files go to a private directory created fresh for the run (mode 0700, under
/dev/shm when present); the client refuses any path outside it. With
`extract.deterministic` every server computes one sample per engine step, alone and
whole (no batching, no chunked prefill, no prefix cache), so a sample's states do not
depend on what else was in flight: reruns give bit-identical stores. An external server
(`extract.server_url`) is checked where it can be (served model name, stored layers and
hidden size from the returned shapes) and the store records that its states came from an
external, unverified server.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import fsspec
from tqdm import tqdm

from dspark.config import TargetConfig
from dspark.errors import UserError
from dspark.extract.client import (
    HiddenStatesClient,
    Row,
    ServerFailure,
    ShardWriter,
    extract_rows,
)
from dspark.extract.config import STORE_DTYPES, ExtractConfig, ServerConfig
from dspark.extract.dataset import Split, check_tokenizer, read_split
from dspark.extract.scale import ScaleConfig
from dspark.extract.servers import External, ManagedServers, ServerSlot, check_served_model, served_model
from dspark.store import ShardStore, StoreWriter
from dspark.targets import Target, dataset_target, resolve_target

SUMMARY = "extract-summary.json"
MANAGED, EXTERNAL = "managed", "external, unverified"


def load_verifier(target: TargetConfig, data_dir: str | Path | None = None) -> Target:
    """The verifier's identity; null target fields as the dataset summary in `data_dir` recorded them."""
    verifier = resolve_target(target, dataset_target(data_dir))
    print(verifier.describe())
    return verifier


def raw_bytes_per_token(verifier: Target) -> int:
    """Uncompressed bytes of one stored token: bf16 hidden states + int32 id + uint8 mask."""
    return len(verifier.layer_ids) * verifier.hidden_size * 2 + 4 + 1


# -- extraction --------------------------------------------------------------------------


class Progress:
    """Progress bar of one split: samples, tokens/s, MB committed (raw bf16), ETA."""

    def __init__(self, split: str, total: int, done: int, raw_bytes_per_token: int):
        self.raw_bytes_per_token = raw_bytes_per_token
        self.tokens = 0
        self.committed_bytes = 0
        self.start = time.monotonic()
        self.bar = tqdm(
            total=total,
            initial=done,
            unit="sample",
            desc=f"extract {split}",
            file=sys.stderr,
            dynamic_ncols=True,
            smoothing=0.1,
        )

    def sample(self, sample) -> None:
        self.tokens += len(sample.token_ids)
        self.bar.update()
        self._postfix()

    def commit(self, entry: dict) -> None:
        self.committed_bytes += entry["n_tokens"] * self.raw_bytes_per_token
        self._postfix()

    def _postfix(self) -> None:
        rate = self.tokens / max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate:,.0f} tok/s, {self.committed_bytes / 2**20:,.1f} MB written", refresh=False)

    def close(self) -> None:
        self.bar.close()


def open_split_store(store_url: str, verifier: Target, split: Split, ex: ExtractConfig) -> ShardStore:
    """The split's store; its attrs say where the states came from and whether the mode was deterministic.

    Both are part of the store's identity: a rerun with another server kind or mode is
    refused instead of mixing states of both into one store.
    """
    return StoreWriter.create_or_open(
        store_url,
        verifier.store_attrs(STORE_DTYPES[ex.store_dtype]),
        verifier.tokenizer_sha256,
        extra_attrs={
            "split": split.name,
            "data_sha256": split.sha256,
            "states_server": EXTERNAL if ex.server_url else MANAGED,
            "deterministic": ex.deterministic,
        },
    )


async def feed(
    slot: ServerSlot, rows: list[Row], store: ShardStore, verifier: Target, ex: ExtractConfig, progress: Progress
) -> None:
    """Extract `rows` through one server into `store`, restarting the server when it fails."""
    writer = ShardWriter(store, shard_samples=ex.shard_samples, shard_tokens=ex.shard_tokens, on_commit=progress.commit)
    model = served_model(slot.url)
    if slot.server is None:
        check_served_model(slot.url, model, verifier)
    while rows:
        try:
            async with HiddenStatesClient(
                slot.url,
                model["id"],
                n_layers=len(verifier.layer_ids),
                hidden_size=verifier.hidden_size,
                timeout_s=ex.request_timeout_s,
                staging_dir=slot.staging_dir,
            ) as client:
                await extract_rows(client, rows, writer, concurrency=ex.concurrency, on_sample=progress.sample)
        except ServerFailure as failure:
            await slot.restart(failure)
        done = store.committed_sample_ids()
        rows = [r for r in rows if r.sample_id not in done]


async def extract_split(
    slots: list[ServerSlot],
    rows: list[Row],
    store_url: str,
    verifier: Target,
    split: Split,
    ex: ExtractConfig,
    progress: Progress,
) -> None:
    """Split `rows` into contiguous ranges, one per server, each written by its own writer."""
    size, extra = divmod(len(rows), len(slots))
    bounds = [i * size + min(i, extra) for i in range(len(slots) + 1)]
    ranges = [rows[a:b] for a, b in zip(bounds, bounds[1:])]
    try:
        async with asyncio.TaskGroup() as group:
            for slot, part in zip(slots, ranges):
                if part:
                    group.create_task(
                        feed(slot, part, open_split_store(store_url, verifier, split, ex), verifier, ex, progress)
                    )
    except BaseExceptionGroup as failures:
        raise failures.exceptions[0] from None  # the first failure, not a group wrapper


def store_bytes(url: str) -> int | None:
    """Bytes the store takes on its filesystem (None when the backend cannot tell)."""
    fs, path = fsspec.core.url_to_fs(url)
    try:
        return int(fs.du(path, total=True))
    except (NotImplementedError, OSError):
        return None


def run_extraction(target: TargetConfig, ex: ExtractConfig, srv: ServerConfig, scale: ScaleConfig) -> dict:
    """The whole stage on this node's share of the samples; returns (and writes to `run_dir`) the summary."""
    start = time.monotonic()
    if ex.server_url and scale.servers != 1:
        raise UserError(
            f"extract.server_url names one server; gpus={scale.gpus} tp={scale.tp} needs "
            f"{scale.servers} started here (server_url=null)"
        )
    if ex.server_url and ex.deterministic:
        raise UserError(
            "extract.deterministic needs servers started by this run (it sets how they batch): "
            "set extract.server_url=null, or extract.deterministic=false for an external server"
        )
    if ex.server_url and not ex.staging_dir:
        raise UserError(
            "extract.server_url needs extract.staging_dir: the directory the server stages its files "
            "in (its kv_connector_extra_config.shared_storage_path); no other path is read or deleted"
        )
    verifier = load_verifier(target, ex.data_dir)
    target = verifier.config  # every field filled
    check_tokenizer(Path(ex.data_dir), verifier.tokenizer_sha256, target.name_or_path)
    splits = [
        read_split(Path(ex.data_dir), name, max_tokens=target.max_model_len, vocab_size=verifier.vocab_size)
        for name in ex.splits
    ]
    # Several nodes write into one store: this node extracts (and summarizes) only its share.
    splits = [replace(split, rows=scale.share(split.rows, lambda row: row.sample_id)) for split in splits]

    plan = []
    for split in splits:
        url = f"{ex.store_dir.rstrip('/')}/{split.name}"
        store = open_split_store(url, verifier, split, ex)
        removed = store.clean_uncommitted()
        if removed:
            print(f"{url}: removed {len(removed)} uncommitted shard(s) of an interrupted run")
        done = store.committed_sample_ids()
        plan.append((split, url, [r for r in split.rows if r.sample_id not in done], len(done)))

    restarts: list[int] = []
    connector = None
    timings: dict[str, float] = {}
    if any(todo for _, _, todo, _ in plan):
        if ex.server_url:
            slots_cm = External(ex.server_url, Path(ex.staging_dir))
        else:
            slots_cm = ManagedServers(verifier, target, ex, srv, scale)
            connector = slots_cm.connector
        with slots_cm as slots:
            for split, url, todo, done in plan:
                if not todo:
                    continue
                progress = Progress(split.name, len(split.rows), done, raw_bytes_per_token(verifier))
                t0 = time.monotonic()
                try:
                    asyncio.run(extract_split(slots, todo, url, verifier, split, ex, progress))
                finally:
                    progress.close()
                timings[split.name] = time.monotonic() - t0
            restarts = [s.restarts for s in slots]

    summary = {
        "target": verifier.store_attrs() | {"model_dir": str(verifier.model_dir)},
        "gpus": scale.gpus,
        "tp": scale.tp,
        "nodes": scale.nodes,
        "node_rank": scale.node_rank,
        "connector": connector,
        "server_url": ex.server_url,
        "deterministic": ex.deterministic,
        "restarts": sum(restarts),
        "restarts_per_server": restarts,
        "seconds": round(time.monotonic() - start, 2),
        "splits": {
            split.name: _split_summary(split, url, todo, timings.get(split.name), verifier)
            for split, url, todo, _ in plan
        },
    }
    run_dir = Path(ex.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    name = SUMMARY if scale.nodes == 1 else SUMMARY.replace(".json", f".node{scale.node_rank}.json")
    tmp = run_dir / f".{name}.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, run_dir / name)
    print(format_summary(summary, run_dir / name))
    return summary


def _split_summary(split: Split, url: str, todo: list[Row], seconds: float | None, verifier: Target) -> dict:
    store = ShardStore.open(url)
    missing = len({r.sample_id for r in split.rows} - store.committed_sample_ids())
    if missing:
        raise RuntimeError(f"{url}: {missing} sample(s) of {split.path} are not in the store after extraction")
    n_tokens = sum(s["n_tokens"] for s in store.manifest["shards"])
    tokens_extracted = sum(len(r.input_ids) for r in todo)
    disk = store_bytes(url)
    return {
        "store": url,
        "samples": len(split.rows),
        "tokens": n_tokens,
        "shards": len(store.manifest["shards"]),
        "samples_extracted": len(todo),
        "tokens_extracted": tokens_extracted,
        "seconds": None if seconds is None else round(seconds, 2),
        "tokens_per_s": round(tokens_extracted / seconds, 1) if seconds else None,
        "store_bytes": disk,
        # A node whose share is empty may find a store no other node has committed to yet.
        "store_bytes_per_token": None if disk is None or not n_tokens else round(disk / n_tokens, 1),
        "raw_bytes_per_token": raw_bytes_per_token(verifier),
    }


def format_summary(summary: dict, path: Path) -> str:
    lines = [f"extraction summary ({path}): {summary['seconds']:.0f}s, {summary['restarts']} server restart(s)"]
    for name, s in summary["splits"].items():
        per_token = s["store_bytes_per_token"]
        ratio = (
            ""
            if per_token is None
            else (f", {per_token:.0f} B/token on disk ({per_token / s['raw_bytes_per_token']:.2f}x raw)")
        )
        speed = "" if not s["seconds"] else f" in {s['seconds']:.0f}s ({s['tokens_per_s']:,.0f} tok/s)"
        lines.append(
            f"  {name:5s}: {s['samples']} samples, {s['tokens']} tokens in {s['shards']} shard(s); "
            f"{s['samples_extracted']} extracted{speed}{ratio}"
        )
    return "\n".join(lines)


__all__ = ["extract_split", "load_verifier", "raw_bytes_per_token", "run_extraction"]
