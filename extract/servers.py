"""The extraction servers: vLLM's command line in extraction mode, the private staging dirs, the
servers the stage starts (`ManagedServers`, restarted when they die) and an external one
(`External`, checked by name and never restarted).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from tqdm import tqdm

from dspark.config import TargetConfig
from dspark.errors import UserError
from dspark.extract.client import ServerFailure, check_private_dir, default_staging_root, expect, private_staging_dir
from dspark.extract.config import ExtractConfig, ServerConfig
from dspark.extract.scale import ScaleConfig, server_envs, tp_args
from dspark.extract.server import ServerError, VLLMServer, log_tail
from dspark.targets import Target

CPU_CONNECTOR = ("CPUHiddenStatesConnector", "dspark.extract.connector")
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
# In run_dir: the private staging dir of the last run, removed by the next one (a killed run leaves it).
STAGING_RECORD = ".staging-dir"


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


def served_model(url: str, setting: str = "extract.server_url") -> dict:
    """The first entry of the server's GET /v1/models (`id`, and `root`: the model it loaded); `setting`
    names the config key the URL came from, in the error."""
    url = url.rstrip("/")
    try:
        with httpx.Client(timeout=30) as client:
            resp = client.get(f"{url}/v1/models")
    except httpx.TransportError as err:
        raise UserError(
            f"no server answers at {url} ({setting}): {type(err).__name__}: {err}; start "
            f"it, fix the URL, or set {setting}=null to let the stage start its own"
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


def check_served_model(url: str, model: dict, verifier: Target, setting: str = "extract.server_url") -> None:
    """Refuse an external server whose model is not the target (by name: all that can be checked up front)."""
    ours = {verifier.name_or_path, str(verifier.model_dir), str(Path(verifier.model_dir).resolve())}
    theirs = {model.get("id"), model.get("root")}
    if not ours & theirs:
        raise UserError(
            f"the server at {url} serves {model.get('id')!r} (loaded from {model.get('root')!r}), not the target "
            f"{verifier.name_or_path!r}: point {setting} at a server of the target, or start it with "
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


class External:
    """The one already running server of `extract.server_url` (never started or stopped here)."""

    def __init__(self, url: str, staging_dir: Path):
        self.url = url.rstrip("/")
        self.staging_dir = staging_dir

    def __enter__(self) -> list[ServerSlot]:
        check_private_dir(self.staging_dir)
        return [ServerSlot(self.url, staging_dir=self.staging_dir)]

    def __exit__(self, *exc) -> None:
        pass


__all__ = [
    "External",
    "ManagedServers",
    "ServerSlot",
    "deterministic_args",
    "kv_transfer_config",
    "resolve_connector",
    "check_served_model",
    "served_model",
    "server_args",
    "speculative_config",
]
