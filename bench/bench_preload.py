"""vLLM on CPU with and without the preloaded tcmalloc + Intel OpenMP (extract.server.CPU_PRELOAD).

Setting: the embedded SmolLM2-135M-Instruct in fp32 with the `server` env (1 GiB of KV
cache each), ShareGPT conversations cut to 512 tokens (bench_extract's rows). Two pairs of
servers, one pair at a time: plain ones (what regeneration runs), then extracting ones (the
extract stage's server args), in each pair one launched with the preload and one without
it. Rounds alternate between the two of a pair, so drifting load on a shared machine hits
both alike:

- regeneration: every prompt (the conversation up to its first reply) decoded for
  `GEN_TOKENS` tokens, `GEN_CONCURRENCY` in flight (conf/data.yaml's regen concurrency);
- extraction: every sample through the stage's client (`extract_rows`), states read and
  dropped, the extract stage's concurrency.

Reported per pair: CPU seconds (user + system) of the server's whole process group during
the timed work, and wall time, each as the ratio preloaded / not preloaded; the lower
the better. CPU time, not wall time, is the figure that holds on a shared machine.

Run: python -m bench.bench_preload   (or python -m bench only=preload)
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from bench import write_figures
from bench.bench_extract import extraction, sharegpt_rows, stage_config
from dspark.extract.client import Row, default_staging_root
from dspark.extract.pipeline import load_verifier
from dspark.extract.server import VLLMServer, cpu_preload
from dspark.extract.servers import server_args

N_SAMPLES = 24
MAX_PROMPT_TOKENS = 512
GEN_TOKENS = 64
GEN_CONCURRENCY = 16
ROUNDS = 2


def group_cpu_s(pgid: int) -> float:
    """user + system CPU seconds of every live process in process group `pgid`."""
    total = 0.0
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                times = proc.cpu_times()
                total += times.user + times.system
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass
    return total


async def generate(url: str, model: str, prompts: list[list[int]]) -> None:
    todo = iter(prompts)

    async def worker(client: httpx.AsyncClient) -> None:
        for prompt in todo:
            payload = {"model": model, "prompt": prompt, "max_tokens": GEN_TOKENS, "min_tokens": GEN_TOKENS}
            resp = await client.post(f"{url}/v1/completions", json={**payload, "temperature": 0.7, "top_p": 0.8})
            resp.raise_for_status()

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        await asyncio.gather(*(worker(client) for _ in range(GEN_CONCURRENCY)))


def measured(server: VLLMServer, work) -> tuple[float, float]:
    """(CPU seconds of the server's process group, wall seconds) of running coroutine `work()`."""
    cpu, start = group_cpu_s(server.pid), time.perf_counter()
    asyncio.run(work())
    return group_cpu_s(server.pid) - cpu, time.perf_counter() - start


def compare(make_server, work, n: int) -> dict[str, list[tuple[float, float]]]:
    """Two servers of one kind up together, one launched with the preload and one without;
    an untimed warm-up of each, then `ROUNDS` alternating timed runs of `work(server, kind, n)`."""
    servers = {}
    for kind in ("preloaded", "not_preloaded"):
        servers[kind] = make_server(kind)
        servers[kind].launch()
    try:
        for server in servers.values():
            server.wait_ready()
        for kind, server in servers.items():  # the first batches of a fresh server include one-off work
            asyncio.run(work(server, kind, 4))
        runs: dict[str, list] = {k: [] for k in servers}
        for r in range(ROUNDS):
            for kind in list(servers) if r % 2 == 0 else list(servers)[::-1]:
                runs[kind].append(measured(servers[kind], lambda k=kind: work(servers[k], k, n)))
    finally:
        for server in servers.values():
            server.stop()
    return runs


def pair_figures(runs: dict[str, list[tuple[float, float]]]) -> dict:
    cpu = {k: sum(c for c, _ in v) for k, v in runs.items()}
    wall = {k: sum(w for _, w in v) for k, v in runs.items()}
    return {
        "cpu_s": {k: [round(c, 1) for c, _ in v] for k, v in runs.items()},
        "wall_s": {k: [round(w, 1) for _, w in v] for k, v in runs.items()},
        "cpu_preloaded_vs_not": round(cpu["preloaded"] / cpu["not_preloaded"], 3),
        "cpu_preloaded_vs_not_per_round": [
            round(p[0] / n[0], 3) for p, n in zip(runs["preloaded"], runs["not_preloaded"], strict=True)
        ],
        "wall_preloaded_vs_not": round(wall["preloaded"] / wall["not_preloaded"], 3),
    }


def main(out_dir: Path) -> dict:
    target, ex, srv = stage_config()
    verifier = load_verifier(target)
    rows = [
        Row(r.sample_id, r.input_ids[:MAX_PROMPT_TOKENS], r.loss_mask[:MAX_PROMPT_TOKENS])
        for r in sharegpt_rows(verifier.model_dir, N_SAMPLES)
    ]
    # each conversation up to its first reply (what regeneration sends), at least one token
    prompts = [r.input_ids[: max(1, r.loss_mask.index(1))] if 1 in r.loss_mask else r.input_ids for r in rows]
    preload, missing = cpu_preload(os.environ.get("LD_PRELOAD", ""))
    if missing:
        raise RuntimeError(f"cannot compare: {missing} not found (make setup installs them)")
    model = str(verifier.model_dir)
    env = {**srv.env, "VLLM_CPU_KVCACHE_SPACE": "1"}
    common = dict(env=env, max_model_len=target.max_model_len + 1, dtype=target.dtype, ready_timeout_s=1800)
    with (
        tempfile.TemporaryDirectory() as tmp,
        tempfile.TemporaryDirectory(dir=default_staging_root(), prefix="bench-preload-") as staging,
    ):
        tmp, staging = Path(tmp), Path(staging)
        regen = compare(
            lambda kind: VLLMServer(
                model,
                tmp / f"plain-{kind}",
                extra_args=["--disable-uvicorn-access-log"],
                cpu_preload=kind == "preloaded",
                **common,
            ),
            lambda server, kind, n: generate(server.url, model, prompts[:n]),
            len(prompts),
        )
        extract = compare(
            lambda kind: VLLMServer(
                model,
                tmp / f"extract-{kind}",
                extra_args=server_args(verifier.layer_ids, "cpu", staging / kind, []),
                cpu_preload=kind == "preloaded",
                **common,
            ),
            lambda server, kind, n: extraction(
                server.url, staging / kind, model, rows[:n], verifier, ex, None, min(n, ex.concurrency)
            ),
            len(rows),
        )
    figures = {
        "setting": {
            "target": target.name_or_path,
            "dtype": target.dtype,
            "samples": len(rows),
            "tokens": sum(len(r.input_ids) for r in rows),
            "generated_tokens_per_prompt": GEN_TOKENS,
            "generation_concurrency": GEN_CONCURRENCY,
            "extraction_concurrency": ex.concurrency,
            "rounds": ROUNDS,
            "preload": preload,
        },
        "regeneration": pair_figures(regen),
        "extraction": pair_figures(extract),
    }
    for name in ("regeneration", "extraction"):
        f = figures[name]
        print(
            f"{name}: CPU time preloaded / not {f['cpu_preloaded_vs_not']:.2f}x "
            f"(rounds {f['cpu_preloaded_vs_not_per_round']}), wall {f['wall_preloaded_vs_not']:.2f}x"
        )
    return write_figures(out_dir, "preload", figures)


if __name__ == "__main__":
    main(Path(__file__).resolve().parent / "results")
