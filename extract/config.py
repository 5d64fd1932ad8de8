"""Schemas of the extraction stage's config sections (defaults live in conf/extract.yaml, conf/server/)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dspark.config import Checked
from dspark.store import BF16, FP8

CONNECTORS = ("auto", "cpu", "stock")
STORE_DTYPES = {"bf16": BF16, "fp8": FP8}
"""`extract.store_dtype` -> the store's `target.dtype`."""


@dataclass
class ServerConfig(Checked):
    """How a local vLLM server is started (the `server` group, shared by every pass)."""

    SECTION: ClassVar[str] = "server"

    env: dict[str, str]
    """Environment variables set for the server on top of the current ones."""
    extra_args: list[str]
    """Arguments appended to the `vllm.entrypoints.openai.api_server` command line."""
    ready_timeout_s: float
    """How long a server may take to answer /health and /v1/models."""
    stop_timeout_s: float
    """Grace period between SIGTERM and SIGKILL when stopping."""

    def __post_init__(self) -> None:
        self.positive("ready_timeout_s")
        self.at_least(0, "stop_timeout_s")


@dataclass
class ExtractConfig(Checked):
    """Pass 1b: tokenized splits -> hidden states in shard stores."""

    SECTION: ClassVar[str] = "extract"

    splits: list[str]
    """Splits to extract: `<data_dir>/<split>.jsonl` -> store `<store_dir>/<split>`."""
    data_dir: str
    """Tokenized dataset written by `python -m extract.data`."""
    store_dir: str
    """Parent of the per-split shard stores (a local path or an fsspec URL)."""
    run_dir: str
    """Server logs and `extract-summary.json`."""
    server_url: str | None
    """An already running server in extraction mode (same layer ids!); null = start `gpus` servers."""
    connector: str
    """`auto` (stock on CUDA, cpu otherwise), `cpu` (dspark.extract.connector) or `stock` (vLLM's CUDA connector)."""
    staging_dir: str | None
    """Directory the server writes per-request files to; null = /dev/shm when present, else the temp dir."""
    concurrency: int
    """Requests in flight per server."""
    shard_samples: int
    """A shard is committed once it holds this many samples ..."""
    shard_tokens: int
    """... or this many tokens."""
    request_timeout_s: float
    """Timeout of one request, including the wait for its staged file."""
    max_restarts: int
    """Restarts allowed per server before the run fails."""
    deterministic: bool
    """One sample per engine step, no chunked prefill or prefix cache: reruns give bit-identical states."""
    store_dtype: str
    """How hidden states are stored: `bf16` (lossless) or `fp8` (e4m3 + a scale per token and layer)."""
    dry_run: bool
    """Print the plan (tokens, store bytes, free space, wall time; see extract.plan) and stop."""
    space_check: bool
    """Refuse to start when the stores' estimated bytes exceed the free space (false: start anyway)."""

    def __post_init__(self):
        self.at_least(1, "concurrency", "shard_samples", "shard_tokens")
        self.positive("request_timeout_s")
        self.at_least(0, "max_restarts")
        self.one_of("connector", CONNECTORS)
        self.one_of("store_dtype", tuple(STORE_DTYPES))
        if not self.splits:
            self.refuse("splits", "is empty: nothing to extract")
