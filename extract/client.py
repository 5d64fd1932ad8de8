"""Extraction client: token ids in, bf16 hidden states out, committed to the store shard by shard.

One sample is one request to a vLLM server running the `extract_hidden_states`
speculative method with a hidden-states connector: `POST /v1/completions` with the
token ids as prompt and `max_tokens=1`. The response names a staged safetensors file
(`kv_transfer_params.hidden_states_path`) holding `hidden_states [T, L, H]` (ascending
layer id, the model's dtype) and `token_ids [T]`. The connector writes that file one
engine step *after* the response, holding an exclusive flock on `<file>.lock` until it
is complete, so the client keeps more requests in flight than the server batches and
reads each file once its lock is free, then deletes it. The client opens and deletes only
files inside the staging directory it was given (a private one the stage created); a
response naming any other path is refused.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import stat
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dspark.errors import UserError
from dspark.store import Sample, ShardStore, bf16_to_bits

SHM = Path("/dev/shm")
# How often a waiting reader retries a staged file's lock; the file lands within one
# engine step (~0.1-3 s on CPU), so 10 ms polling costs nothing and adds no latency.
LOCK_POLL_S = 0.01


class ServerFailure(RuntimeError):
    """The server stopped answering, failed internally, or never delivered a file: restart and retry."""


class ExtractionError(RuntimeError):
    """A sample or the server's answer for it is wrong in a way a retry cannot fix."""


class UnexpectedAnswer(UserError):
    """The server answered something other than what a vLLM extraction server answers (wrong URL or setup)."""


@dataclass
class Row:
    """One tokenized sample of the dataset."""

    sample_id: int
    input_ids: list[int]
    loss_mask: list[int]


def default_staging_root() -> Path:
    """tmpfs (/dev/shm) when there is one: staged files are written and deleted at request rate."""
    if SHM.is_dir() and os.access(SHM, os.W_OK):
        return SHM
    return Path(tempfile.gettempdir())


def private_staging_dir(root: Path) -> Path:
    """A fresh directory under `root` that only this user can enter (mode 0700, unpredictable name)."""
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="dspark-extract-", dir=root))


def check_private_dir(path: Path) -> None:
    """Refuse a staging dir that others could write into or that is not a plain directory of ours."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UserError(
            f"staging dir {path} does not exist: extract.staging_dir must name the directory the "
            "extraction server stages its files in"
        ) from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise UserError(
            f"staging dir {path} must be a directory owned by this user and writable by no one "
            f"else (found mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}): "
            "the client reads and deletes the files named there"
        )


def staged_path(answer: str, staging_dir: Path, url: str) -> str:
    """`answer` (a path named by the server) if it lies inside `staging_dir`; UnexpectedAnswer otherwise."""
    real, root = os.path.realpath(answer), os.path.realpath(staging_dir)
    if not os.path.isabs(answer) or os.path.commonpath([real, root]) != root or real == root:
        raise UnexpectedAnswer(
            f"{url} named the staged file {answer!r}, outside the staging dir {staging_dir}: refused (the client "
            "only opens and deletes files there; set extract.staging_dir to the server's shared_storage_path)"
        )
    return real


def expect(condition: bool, url: str, what: str, got: object) -> None:
    """UnexpectedAnswer naming the URL, what was expected and (the start of) what came instead."""
    if not condition:
        raise UnexpectedAnswer(f"{url} is not a vLLM extraction server: expected {what}, got {str(got)[:300]!r}")


class HiddenStatesClient:
    """Requests hidden states of single samples from one extraction server (an async context manager)."""

    def __init__(self, url: str, model: str, *, n_layers: int, hidden_size: int, timeout_s: float, staging_dir: Path):
        """`staging_dir`: where the server stages files; a response naming a path elsewhere is refused."""
        self.url = url.rstrip("/")
        self.model = model
        self.n_layers = n_layers
        self.hidden_size = hidden_size
        self.timeout_s = timeout_s
        self.staging_dir = Path(staging_dir)
        self._http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> HiddenStatesClient:
        # No connection limit below the caller's concurrency: every request must reach the server.
        self._http = httpx.AsyncClient(timeout=self.timeout_s, limits=httpx.Limits(max_connections=None))
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._http is not None
        await self._http.aclose()

    async def extract(self, row: Row) -> Sample:
        """The sample with its hidden states as bf16 bits [T, L, H]; the staged file is deleted."""
        path = await self._request(row)
        try:
            hidden = await self._read_staged(path, row)
        finally:
            for p in (path, path + ".lock"):
                try:
                    os.remove(p)
                except FileNotFoundError:
                    pass
        return Sample(
            sample_id=row.sample_id,
            token_ids=np.asarray(row.input_ids, dtype=np.int32),
            loss_mask=np.asarray(row.loss_mask, dtype=np.uint8),
            hidden=hidden,
        )

    async def _request(self, row: Row) -> str:
        assert self._http is not None, "use HiddenStatesClient as `async with`"
        where = f"sample {row.sample_id}"
        payload = {"model": self.model, "prompt": row.input_ids, "max_tokens": 1, "return_token_ids": True}
        try:
            resp = await self._http.post(f"{self.url}/v1/completions", json=payload)
        except httpx.TransportError as err:
            raise ServerFailure(f"{where}: no answer from {self.url}: {type(err).__name__}: {err}") from err
        if resp.status_code >= 500:
            raise ServerFailure(f"{where}: {self.url} failed with HTTP {resp.status_code}: {resp.text[:500]}")
        if resp.status_code != 200:
            raise UnexpectedAnswer(
                f"{where}: {self.url} refused POST /v1/completions (HTTP {resp.status_code}), "
                f"expected a completion from a vLLM extraction server: {resp.text[:500]}"
            )
        try:
            body = resp.json()
        except ValueError:
            body = None
        completion = "a JSON completion {'choices': [{'prompt_token_ids': [...]}], 'kv_transfer_params': {...}}"
        expect(
            isinstance(body, dict)
            and isinstance(body.get("choices"), list)
            and body["choices"]
            and isinstance(body["choices"][0], dict),
            self.url,
            completion,
            resp.text,
        )
        echoed = body["choices"][0].get("prompt_token_ids")
        if echoed != row.input_ids:
            raise ExtractionError(
                f"{where}: the server echoed other prompt token ids than it was sent "
                f"({_first_difference(echoed, row.input_ids)}); it must not re-tokenize the prompt"
            )
        params = body.get("kv_transfer_params") or {}
        expect(isinstance(params, dict), self.url, completion, resp.text)
        path = params.get("hidden_states_path")
        if not path:
            raise ExtractionError(
                f"{where}: the response has no kv_transfer_params.hidden_states_path; is {self.url} running "
                "with --speculative-config method=extract_hidden_states and a hidden-states connector?"
            )
        expect(isinstance(path, str), self.url, "kv_transfer_params.hidden_states_path as a string", path)
        return staged_path(path, self.staging_dir, self.url)

    async def _read_staged(self, path: str, row: Row) -> np.ndarray:
        where = f"sample {row.sample_id}"
        deadline = time.monotonic() + self.timeout_s
        # The connector creates and locks `<path>.lock` before the response leaves the server.
        try:
            lock_fd = os.open(path + ".lock", os.O_RDONLY)
        except FileNotFoundError:
            raise ExtractionError(
                f"{where}: no lock file beside {path}: the server's connector must keep its "
                "synchronization lock on (use_synchronization_lock, the default)"
            ) from None
        try:
            while True:
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    data = load_file(path)
                    break
                except BlockingIOError:  # locked: still being written
                    if time.monotonic() > deadline:
                        raise ServerFailure(
                            f"{where}: staged file {path} not written within {self.timeout_s:.0f}s"
                        ) from None
                    await asyncio.sleep(LOCK_POLL_S)
                except FileNotFoundError:
                    # The writer holds the lock until the file is complete: free lock, no file
                    # = the writer is gone (the server died or dropped the request).
                    raise ServerFailure(f"{where}: the server released {path}.lock without writing the file") from None
                except SafetensorError as err:  # truncated: the writer died mid-file
                    raise ServerFailure(f"{where}: staged file {path} is incomplete: {err}") from err
        finally:
            os.close(lock_fd)
        return self._checked_bits(data, row)

    def _checked_bits(self, data: dict[str, torch.Tensor], row: Row) -> np.ndarray:
        where = f"sample {row.sample_id}"
        hidden, token_ids = data.get("hidden_states"), data.get("token_ids")
        if hidden is None or token_ids is None:
            raise ExtractionError(f"{where}: staged file lacks hidden_states/token_ids (has {sorted(data)})")
        if token_ids.tolist() != row.input_ids:
            raise ExtractionError(
                f"{where}: staged token_ids differ from the sample "
                f"({_first_difference(token_ids.tolist(), row.input_ids)})"
            )
        expected = (len(row.input_ids), self.n_layers, self.hidden_size)
        if tuple(hidden.shape) != expected:
            raise UnexpectedAnswer(
                f"{where}: {self.url} returned hidden states of shape {list(hidden.shape)}, expected "
                f"{list(expected)} (tokens, stored layers, hidden size of the target): the server runs another "
                "model or other layer ids than target.* configures"
            )
        # Checked as stored: bf16 has half the bytes to scan, and a huge fp32 value that rounds to
        # inf in bf16 is caught too.
        hidden = hidden.to(torch.bfloat16)
        finite = torch.isfinite(hidden)
        if not bool(finite.all()):
            t, layer, _ = (~finite).nonzero()[0].tolist()
            raise ExtractionError(f"{where}: non-finite hidden state at token {t}, stored layer {layer}")
        return bf16_to_bits(hidden)


def _first_difference(got: Sequence[int] | None, want: Sequence[int]) -> str:
    if got is None:
        return "none echoed"
    if len(got) != len(want):
        return f"{len(got)} tokens instead of {len(want)}"
    k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    return f"first difference at position {k}: {got[k]} instead of {want[k]}"


class ShardWriter:
    """Buffers extracted samples and commits them as shards of bounded size, one commit at a time.

    A full buffer is committed in a thread while the requests go on: the server is not left
    idle while a shard is compressed and written. At most one commit runs; the next full
    buffer waits for it (so at most two shards are held in memory). A failed commit raises
    in the caller that next adds a full buffer or flushes.
    """

    def __init__(
        self,
        store: ShardStore,
        *,
        shard_samples: int,
        shard_tokens: int,
        on_commit: Callable[[dict], None] | None = None,
    ):
        if shard_samples < 1 or shard_tokens < 1:
            raise ValueError(f"shard_samples and shard_tokens must be >= 1, got {shard_samples}, {shard_tokens}")
        self.store = store
        self.shard_samples = shard_samples
        self.shard_tokens = shard_tokens
        self.on_commit = on_commit
        self._buffer: list[Sample] = []
        self._buffered_tokens = 0
        self._lock = asyncio.Lock()
        self._writing: asyncio.Future | None = None

    async def add(self, sample: Sample) -> None:
        self._buffer.append(sample)
        self._buffered_tokens += len(sample.token_ids)
        if len(self._buffer) >= self.shard_samples or self._buffered_tokens >= self.shard_tokens:
            await self._start_commit()

    async def flush(self) -> None:
        """Commit whatever is buffered (nothing if empty); returns once no commit is running."""
        await self._start_commit()
        async with self._lock:
            await self._wait_for_commit()

    async def _start_commit(self) -> None:
        batch, self._buffer, self._buffered_tokens = self._buffer, [], 0
        async with self._lock:
            await self._wait_for_commit()
            if batch:
                self._writing = asyncio.ensure_future(asyncio.to_thread(self.store.write_shard, batch))
                self._writing.add_done_callback(self._committed)

    async def _wait_for_commit(self) -> None:
        """Wait for the running commit; its error is raised here, once. A cancelled caller leaves the
        commit running to its end (shield); the next caller waits for it again. A failed commit only
        loses its batch from memory: those samples are not in the manifest, so a rerun extracts them."""
        if self._writing is None:
            return
        try:
            await asyncio.shield(self._writing)
        finally:
            if self._writing.done():
                self._writing = None

    def _committed(self, future: asyncio.Future) -> None:
        if self.on_commit is not None and not future.cancelled() and future.exception() is None:
            self.on_commit(future.result())


async def extract_rows(
    client: HiddenStatesClient,
    rows: Sequence[Row],
    writer: ShardWriter,
    *,
    concurrency: int,
    on_sample: Callable[[Sample], None] | None = None,
) -> None:
    """Extract `rows` with up to `concurrency` requests in flight and commit them through `writer`.

    Whatever finished is committed before this returns or raises (the first error wins;
    ServerFailure means: restart the server and call again with the rows still missing).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    todo = iter(rows)

    async def worker() -> None:
        for row in todo:  # one shared iterator: every row is taken exactly once
            sample = await client.extract(row)
            if on_sample is not None:
                on_sample(sample)
            await writer.add(sample)

    tasks = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(rows)))]
    if not tasks:
        return
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()  # re-raises the first failure
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await writer.flush()


__all__ = [
    "ExtractionError",
    "HiddenStatesClient",
    "Row",
    "ServerFailure",
    "ShardWriter",
    "UnexpectedAnswer",
    "check_private_dir",
    "default_staging_root",
    "extract_rows",
    "private_staging_dir",
]
