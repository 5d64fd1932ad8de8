"""A hidden-states connector that works without CUDA.

vLLM's `ExampleHiddenStatesConnector` copies each finished request's hidden states into
pinned host memory on a CUDA stream and writes the file from a thread pool. On a CPU
build the pinned allocation and the CUDA events crash the engine at the first finished
request. This subclass keeps everything else (file naming, the `.lock` protocol, the
scheduler side) and replaces only the copy: the states are already in host memory, so
it writes the file synchronously and reports the request as finished once it is on disk.
It stages the states as bf16, the precision the store keeps: a float32 verifier (the CPU
default) would otherwise stage twice the bytes for the client to read and round (the same
round-to-nearest-even, so the stored bits are unchanged; a value past bf16's range stages as
inf, which the client refuses as it did).

Loaded by vLLM through `kv_connector_module_path="dspark.extract.connector"`; only the engine
process imports it.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
)


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with synchronous host-side writes (no pinned memory, no CUDA)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Requests whose file is complete on disk, waiting to be reported as finished.
        self._written: set[str] = set()

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        # Token t sits in cache block block_ids[t // block_size] at offset t % block_size: gather
        # the request's n tokens only (the copy outlives the cache blocks, freed right after).
        positions = torch.arange(pending.token_ids.shape[0])
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)[positions // self._block_size]
        hidden = self._kv_cache[blocks, :, positions % self._block_size].to(torch.bfloat16)

        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers waiting on LOCK_SH wake up
        self._written.add(pending.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.has_connector_metadata():
            metadata = self._get_connector_metadata()
            if isinstance(metadata, ExampleHiddenStatesConnectorMetadata):
                for pending in metadata.pending_saves:
                    self._submit_async_write(pending)

        self._accumulated_finished_req_ids.update(finished_req_ids)
        done_sending: set[str] = set()
        for req_id in list(self._accumulated_finished_req_ids):
            self._accumulated_finished_req_ids.discard(req_id)
            if req_id in self._written:
                self._written.discard(req_id)
                done_sending.add(req_id)
            # A request aborted before its save still holds a pre-created lock: release it.
            lock_fd = self._lock_fds.pop(req_id, None)
            if lock_fd is not None:
                os.close(lock_fd)
        return done_sending or None, None


__all__ = ["CPUHiddenStatesConnector"]
