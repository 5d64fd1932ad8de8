"""How pass 1 spreads over devices, servers and nodes (the top-level keys `gpus`, `tp`, `nodes`, `node_rank`).

A node runs `gpus / tp` vLLM servers side by side, each with `tp` devices
(`--tensor-parallel-size tp`): on CUDA its own `CUDA_VISIBLE_DEVICES`, on CPU its own
cores (one `|`-separated core group per tensor-parallel rank, vLLM's
`VLLM_CPU_OMP_THREADS_BIND` syntax). Several nodes share one store or dataset: node r of
M takes the samples whose position in the sorted sample-id list is ≡ r (mod M). Strided
rather than contiguous ranges, so that nodes get similar mixes when ids follow the
source's order (sources often group long or similar conversations together).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TypeVar

from omegaconf import DictConfig

from dspark.config import to_dataclass
from dspark.errors import UserError

T = TypeVar("T")


@dataclass
class ScaleConfig:
    """Devices and nodes of one run of a pass-1 stage (defaults in conf/scale/default.yaml)."""

    gpus: int
    """Devices used on this node (CPU: core groups); gpus / tp servers run side by side."""
    tp: int
    """Devices per server (`--tensor-parallel-size`); must divide gpus."""
    nodes: int
    """Nodes sharing the work; each takes every nodes-th sample of the sorted id list."""
    node_rank: int
    """This node's index, 0 <= node_rank < nodes."""

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.tp < 1 or self.gpus % self.tp:
            raise UserError(
                f"gpus={self.gpus}, tp={self.tp}: need gpus >= 1 and tp >= 1 dividing gpus "
                "(gpus/tp servers of tp devices each)"
            )
        if self.nodes < 1 or not 0 <= self.node_rank < self.nodes:
            raise UserError(
                f"nodes={self.nodes}, node_rank={self.node_rank}: need nodes >= 1 and 0 <= node_rank < nodes"
            )

    @property
    def servers(self) -> int:
        return self.gpus // self.tp

    def share(self, items: Iterable[T], sample_id: Callable[[T], int]) -> list[T]:
        """This node's part of `items` (in their order): position of the id in the sorted ids ≡ node_rank."""
        items = list(items)
        if self.nodes == 1:
            return items
        ours = set(sorted(map(sample_id, items))[self.node_rank :: self.nodes])
        return [item for item in items if sample_id(item) in ours]


def scale_config(cfg: DictConfig) -> ScaleConfig:
    """The scale keys of a composed stage config (conf/scale/default.yaml), checked."""
    return to_dataclass(ScaleConfig, {name: cfg[name] for name in ("gpus", "tp", "nodes", "node_rank")})


def tp_args(tp: int) -> list[str]:
    """vLLM command-line arguments for `tp` devices per server."""
    return ["--tensor-parallel-size", str(tp)] if tp > 1 else []


def cuda_devices(devices: Sequence[str], servers: int, tp: int) -> list[str]:
    """`CUDA_VISIBLE_DEVICES` of each server: `tp` consecutive devices each."""
    if servers * tp > len(devices):
        raise UserError(
            f"{servers} server(s) x tp={tp} need {servers * tp} CUDA devices, but {len(devices)} are visible"
        )
    return [",".join(devices[i * tp : (i + 1) * tp]) for i in range(servers)]


def cpu_binds(cores: Sequence[int], servers: int, tp: int) -> list[str]:
    """`VLLM_CPU_OMP_THREADS_BIND` of each server: disjoint cores, one `|`-separated group per TP rank."""
    ranks = servers * tp
    if ranks > len(cores):
        raise UserError(
            f"{servers} CPU server(s) x tp={tp} need a core each per tensor-parallel rank "
            f"({ranks}), but only {len(cores)} are available"
        )
    size, extra = divmod(len(cores), ranks)
    bounds = [i * size + min(i, extra) for i in range(ranks + 1)]
    groups = [",".join(map(str, cores[a:b])) for a, b in pairwise(bounds)]
    return ["|".join(groups[i * tp : (i + 1) * tp]) for i in range(servers)]


def server_envs(gpus: int, cuda: bool, base: dict[str, str], tp: int = 1) -> list[dict[str, str]]:
    """Environment of each of the gpus/tp servers: `tp` CUDA devices each, or (CPU) disjoint cores each."""
    if cuda:
        import torch

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        return [{**base, "CUDA_VISIBLE_DEVICES": d} for d in cuda_devices(devices, gpus // tp, tp)]
    if gpus == 1 or "VLLM_CPU_OMP_THREADS_BIND" in base:
        return [dict(base) for _ in range(gpus // tp)]
    binds = cpu_binds(sorted(os.sched_getaffinity(0)), gpus // tp, tp)
    return [{**base, "VLLM_CPU_OMP_THREADS_BIND": bind} for bind in binds]


__all__ = ["ScaleConfig", "cpu_binds", "cuda_devices", "scale_config", "server_envs", "tp_args"]
