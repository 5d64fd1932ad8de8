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
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import fsspec
import httpx
from tqdm import tqdm

from dspark.config import TargetConfig
from dspark.errors import UserError
from dspark.store import ShardStore
from dspark.targets import Target, dataset_target, resolve_target
from extract.client import (
    HiddenStatesClient,
    Row,
    ServerFailure,
    ShardWriter,
    check_private_dir,
    default_staging_root,
    expect,
    extract_rows,
    private_staging_dir,
)
from extract.config import STORE_DTYPES, ExtractConfig, ServerConfig
from extract.dataset import Split, check_tokenizer, read_split
from extract.scale import ScaleConfig, server_envs, tp_args
from extract.server import ServerError, VLLMServer, log_tail

SUMMARY = "extract-summary.json"
CPU_CONNECTOR = ("CPUHiddenStatesConnector", "extract.connector")
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
# In run_dir: the private staging dir of the last run, removed by the next one (a killed run leaves it).
STAGING_RECORD = ".staging-dir"
MANAGED, EXTERNAL = "managed", "external, unverified"


def load_verifier(target: TargetConfig, data_dir: str | Path | None = None) -> Target:
    """The verifier's identity; null target fields as the dataset summary in `data_dir` recorded them."""
    verifier = resolve_target(target, dataset_target(data_dir))
    print(verifier.describe())
    return verifier


def raw_bytes_per_token(verifier: Target) -> int:
    """Uncompressed bytes of one stored token: bf16 hidden states + int32 id + uint8 mask."""
    return len(verifier.layer_ids) * verifier.hidden_size * 2 + 4 + 1


# -- server setup ------------------------------------------------------------------------


def speculative_config(layer_ids: list[int]) -> dict:
    """vLLM's hidden-states extraction mode; vLLM stores the listed layer ids, ascending."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }


def resolve_connector(setting: str, cuda: bool) -> str:
    """`cpu` or `stock`; `auto` = stock on CUDA (its async pinned-memory copy), cpu elsewhere."""
    if setting == "auto":
        return "stock" if cuda else "cpu"
    return setting


def kv_transfer_config(connector: str, staging_dir: Path) -> dict:
    config = {"kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(staging_dir)}}
    if connector == "stock":
        return {"kv_connector": STOCK_CONNECTOR, **config}
    name, module = CPU_CONNECTOR
    return {"kv_connector": name, "kv_connector_module_path": module, **config}


def server_args(layer_ids: list[int], connector: str, staging_dir: Path, extra_args: list[str]) -> list[str]:
    return [
        "--speculative-config",
        json.dumps(speculative_config(layer_ids)),
        "--kv-transfer-config",
        json.dumps(kv_transfer_config(connector, staging_dir)),
        "--disable-uvicorn-access-log",  # one line per sample otherwise
        *extra_args,
    ]


def deterministic_args(max_model_len: int) -> list[str]:
    """One sample per engine step, prefilled whole and from scratch: its numerics depend on nothing else.

    vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT) has no CPU attention backend, so
    the batch is made trivial instead: one sequence, no chunked prefill (a prompt is one
    forward), no prefix cache (a shared prefix is never taken from another request).
    """
    return [
        "--max-num-seqs",
        "1",
        "--no-enable-chunked-prefill",
        "--no-enable-prefix-caching",
        "--max-num-batched-tokens",
        str(max_model_len),
    ]


class ServerSlot:
    """One server feeding one writer: its URL, and the way to restart it when it fails."""

    def __init__(
        self,
        url: str,
        server: VLLMServer | None = None,
        staging_dir: Path | None = None,
        max_restarts: int = 0,
        executor: ThreadPoolExecutor | None = None,
    ):
        self.url = url
        self.server = server
        self.staging_dir = staging_dir
        self.max_restarts = max_restarts
        self.executor = executor

    @property
    def restarts(self) -> int:
        return self.server.restarts if self.server is not None else 0

    async def restart(self, failure: ServerFailure) -> None:
        if self.server is None:
            raise UserError(
                f"the extraction server at {self.url} failed ({failure}); it was not started "
                "by this run, so it is not restarted: fix it and rerun (committed work is kept)"
            )
        log = self.server.log_path
        if self.restarts >= self.max_restarts:
            raise ServerError(
                f"the vLLM server at {self.url} failed again after {self.restarts} restart(s) "
                f"({failure}); last lines of {log}:\n{log_tail(log)}"
            )
        tqdm.write(f"server {self.url} failed ({failure}); restart {self.restarts + 1}/{self.max_restarts}")
        await asyncio.get_running_loop().run_in_executor(self.executor, self._restart)

    def _restart(self) -> None:
        self.server.stop()
        _fresh_dir(self.staging_dir)
        self.server.restart()


def _fresh_dir(path: Path | None) -> None:
    """Empty private staging dir: files of requests a dead server left behind go away."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(mode=0o700)


def served_model(url: str) -> dict:
    """The first entry of the server's GET /v1/models (`id`, and `root`: the model it loaded)."""
    url = url.rstrip("/")
    try:
        with httpx.Client(timeout=30) as client:
            resp = client.get(f"{url}/v1/models")
    except httpx.TransportError as err:
        raise UserError(
            f"no server answers at {url} (extract.server_url): {type(err).__name__}: {err}; start "
            "it, fix the URL, or set extract.server_url=null to let the stage start its own"
        ) from err
    wanted = "HTTP 200 with JSON {'data': [{'id': <model>, ...}]} from GET /v1/models"
    try:
        body = resp.json()
    except ValueError:
        body = None
    data = body.get("data") if isinstance(body, dict) else None
    expect(
        resp.status_code == 200
        and isinstance(data, list)
        and bool(data)
        and isinstance(data[0], dict)
        and isinstance(data[0].get("id"), str),
        url,
        wanted,
        f"HTTP {resp.status_code}: {resp.text}",
    )
    return data[0]


def check_served_model(url: str, model: dict, verifier: Target) -> None:
    """Refuse an external server whose model is not the target (by name: all that can be checked up front)."""
    ours = {verifier.name_or_path, str(verifier.model_dir), str(Path(verifier.model_dir).resolve())}
    theirs = {model.get("id"), model.get("root")}
    if not ours & theirs:
        raise UserError(
            f"the server at {url} serves {model.get('id')!r} (loaded from {model.get('root')!r}), not the target "
            f"{verifier.name_or_path!r}: point extract.server_url at a server of the target, or start it with "
            f"--served-model-name {verifier.name_or_path}"
        )


class ManagedServers:
    """`gpus` extraction servers started together and stopped together (a context manager)."""

    def __init__(
        self, verifier: Target, target: TargetConfig, ex: ExtractConfig, srv: ServerConfig, scale: ScaleConfig
    ):
        import torch

        cuda = torch.cuda.is_available()
        self.connector = resolve_connector(ex.connector, cuda)
        run_dir = Path(ex.run_dir).resolve()
        root = Path(ex.staging_dir) if ex.staging_dir else default_staging_root()
        # A fresh private dir per run; its path is recorded so the next run removes what a
        # killed one left (tmpfs holds memory).
        remove_recorded_staging(run_dir)
        self.staging = private_staging_dir(root)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / STAGING_RECORD).write_text(str(self.staging))
        self.run_dir = run_dir
        extra = [
            *tp_args(scale.tp),
            *srv.extra_args,
            *(deterministic_args(target.max_model_len + 1) if ex.deterministic else []),
        ]
        # Restarts run here, not on the event loop: a restart takes minutes and the other
        # servers keep working meanwhile. The pool's threads live until every server is
        # stopped, which matters because a server dies with the thread that started it.
        self.executor = ThreadPoolExecutor(max_workers=scale.servers, thread_name_prefix="vllm-restart")
        self.slots = []
        for i, env in enumerate(server_envs(scale.gpus, cuda, dict(srv.env), scale.tp)):
            staging = self.staging / f"server-{i}"
            server = VLLMServer(
                verifier.model_dir,
                run_dir / "logs",
                extra_args=server_args(verifier.layer_ids, self.connector, staging, extra),
                env=env,
                ready_timeout_s=srv.ready_timeout_s,
                stop_timeout_s=srv.stop_timeout_s,
                # +1: a sample may fill target.max_model_len and the request adds one generated token.
                max_model_len=target.max_model_len + 1,
                dtype=target.dtype,
            )
            self.slots.append(ServerSlot(server.url, server, staging, ex.max_restarts, self.executor))

    def __enter__(self) -> list[ServerSlot]:
        try:
            for slot in self.slots:
                _fresh_dir(slot.staging_dir)
                slot.server.launch()  # all boot at once; then wait for each
            for slot in self.slots:
                slot.server.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self.slots

    def __exit__(self, *exc) -> None:
        for slot in self.slots:
            slot.server.stop()
        self.executor.shutdown()
        shutil.rmtree(self.staging, ignore_errors=True)
        (self.run_dir / STAGING_RECORD).unlink(missing_ok=True)


def remove_recorded_staging(run_dir: Path) -> None:
    """Remove the private staging dir a killed run of `run_dir` left, if it is still ours."""
    try:
        path = Path((run_dir / STAGING_RECORD).read_text().strip())
    except FileNotFoundError:
        return
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if path.name.startswith("dspark-extract-") and st.st_uid == os.getuid() and path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)


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
    return ShardStore.create_or_open(
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
            slots_cm = _External(ex.server_url, Path(ex.staging_dir))
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


class _External:
    """The one already running server of `extract.server_url` (never started or stopped here)."""

    def __init__(self, url: str, staging_dir: Path):
        self.url = url.rstrip("/")
        self.staging_dir = staging_dir

    def __enter__(self) -> list[ServerSlot]:
        check_private_dir(self.staging_dir)
        return [ServerSlot(self.url, staging_dir=self.staging_dir)]

    def __exit__(self, *exc) -> None:
        pass


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


__all__ = [
    "ManagedServers",
    "ServerSlot",
    "extract_split",
    "kv_transfer_config",
    "load_verifier",
    "raw_bytes_per_token",
    "resolve_connector",
    "run_extraction",
    "server_args",
    "speculative_config",
]
