"""Cost of hidden-state extraction over the verifier's plain prefill, and the store's size.

Setting: the stage's defaults (conf/extract.yaml: embedded SmolLM2-135M-Instruct in fp32,
its aux layer ids + the final layer, the `server` env, the client concurrency) on ShareGPT
conversations in the model's chat template with their own replies, cut to 1024 tokens.
Two servers of the same model, dtype, max_model_len, environment and compile settings are
up together and timed in alternating rounds (so drifting load on a shared machine hits
both alike; each round runs the timed passes below in an order rotated by one place, so
none of them always follows its server's idle spell):

- plain:   no extraction. Every sample is one `/v1/completions` request (prompt = token
           ids, max_tokens=1): the prefill the verifier does anyway (the baseline);
- extract: the stage's server (extract_hidden_states + hidden-states connector) and client
           (`extract_rows`): the same requests, plus waiting for and reading each staged
           file, bf16 conversion, and committing shards to a ShardStore, in shards of
           4,096 tokens so that commits overlap the requests as in a long run;
- extract as one shard: the same with the stage's shard size, which these 30k tokens do not
           fill: the whole commit comes after the last request;
- extract without store: the same, but the states are dropped once read (splits the
           extra time into server/transfer and store writing).

Every server runs without the prefix cache: the rounds send the same token ids again, and a
cache hit skips the forward (the extraction server keeps its hidden states in cache blocks
too), so with the cache on the baseline would time mostly cache hits. Both after an untimed
warm-up pass over the same samples, with the same requests in flight; staged files on
tmpfs as in the stage. Reported:
extraction wall time / plain wall time, and store bytes on disk per token / raw bytes per
token (bf16 hidden states of every stored layer + int32 token id + uint8 loss mask).

Run: python -m bench.bench_extract   (or python -m bench only=extract)
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import httpx

from bench import write_figures
from dspark.config import TargetConfig, load_section  # noqa: E402
from dspark.extract.client import HiddenStatesClient, Row, ShardWriter, default_staging_root, extract_rows  # noqa: E402
from dspark.extract.config import ExtractConfig, ServerConfig  # noqa: E402
from dspark.extract.pipeline import load_verifier, raw_bytes_per_token, store_bytes  # noqa: E402
from dspark.extract.server import VLLMServer  # noqa: E402
from dspark.extract.servers import deterministic_args, server_args  # noqa: E402
from dspark.store import ShardStore, StoreWriter  # noqa: E402
from dspark.targets import Target  # noqa: E402

N_SAMPLES = 64
ROUNDS = 3
MAX_TOKENS = 1024
# Shards of this many tokens in the timed extraction: ~8 commits over the samples, each
# overlapping the next requests as every shard but the last does in a long run.
STEADY_SHARD = 4096
# The timed runs of a round, each round in this order rotated by one more place.
TIMED = ("plain", "steady", "one-shard", "dropped", "deterministic")
CONF = Path(__file__).resolve().parents[1] / "conf"


def stage_config() -> tuple[TargetConfig, ExtractConfig, ServerConfig]:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="extract")
    return (
        load_section(TargetConfig, cfg, "target"),
        load_section(ExtractConfig, cfg, "extract"),
        load_section(ServerConfig, cfg, "server"),
    )


def sharegpt_rows(model_dir: Path, n: int) -> list[Row]:
    from dspark.extract.data.config import SourceConfig
    from dspark.extract.data.sources import load_source, select
    from dspark.extract.data.tokenize import ChatTokenizer

    source = SourceConfig(
        source="sharegpt",
        path=None,
        hf_name=None,
        hf_split="train",
        max_samples=None,
        seed=0,
        max_turns=1,
        eval_fraction=0.0,
    )
    chat = ChatTokenizer(model_dir)
    rows = []
    for conv in select(load_source(source).conversations, 4 * n, seed=0):
        if len(rows) == n:
            break
        messages = list(conv.messages)
        while messages and messages[-1]["role"] != "assistant":
            messages.pop()
        if not messages:
            continue
        try:
            ids, mask = chat.encode(messages, [True] * sum(m["role"] == "assistant" for m in messages))
        except ValueError:
            continue  # a conversation the template cannot render verbatim
        rows.append(Row(len(rows), ids[:MAX_TOKENS], mask[:MAX_TOKENS]))
    return rows


async def plain_prefill(url: str, model: str, rows: list[Row], concurrency: int) -> None:
    todo = iter(rows)

    async def worker(client: httpx.AsyncClient) -> None:
        for row in todo:
            resp = await client.post(
                f"{url}/v1/completions", json={"model": model, "prompt": row.input_ids, "max_tokens": 1}
            )
            resp.raise_for_status()

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))


async def extraction(
    url: str,
    staging: Path,
    model: str,
    rows: list[Row],
    verifier: Target,
    ex: ExtractConfig,
    store: ShardStore | None,
    concurrency: int = 0,
    shard_tokens: int | None = None,
) -> None:
    async with HiddenStatesClient(
        url,
        model,
        n_layers=len(verifier.layer_ids),
        hidden_size=verifier.hidden_size,
        timeout_s=ex.request_timeout_s,
        staging_dir=staging,
    ) as client:
        if store is None:  # read and drop, `concurrency` at a time
            todo = iter(rows)

            async def worker() -> None:
                for row in todo:
                    await client.extract(row)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return
        writer = ShardWriter(store, shard_samples=ex.shard_samples, shard_tokens=shard_tokens or ex.shard_tokens)
        await extract_rows(client, rows, writer, concurrency=ex.concurrency)


def timed(coroutine_factory) -> float:
    start = time.perf_counter()
    asyncio.run(coroutine_factory())
    return time.perf_counter() - start


def main(out_dir: Path) -> dict:
    target, ex, srv = stage_config()
    verifier = load_verifier(target)
    rows = sharegpt_rows(verifier.model_dir, N_SAMPLES)
    n_tokens = sum(len(r.input_ids) for r in rows)
    model = str(verifier.model_dir)
    # Both servers are up at once (rounds alternate, so drifting load on a shared machine
    # hits both alike); half the default KV cache each keeps the pair within memory.
    env = {**srv.env, "VLLM_CPU_KVCACHE_SPACE": str(max(1, int(srv.env.get("VLLM_CPU_KVCACHE_SPACE", "4")) // 2))}
    common = dict(
        env=env, max_model_len=target.max_model_len + 1, dtype=target.dtype, ready_timeout_s=srv.ready_timeout_s
    )
    # Warm-up = one untimed pass over every sample: the first batches of a fresh server
    # include one-off work (compiled-graph shape buckets, allocations).
    warm_rows = [Row(-1 - i, r.input_ids, r.loss_mask) for i, r in enumerate(rows)]
    with (
        tempfile.TemporaryDirectory() as tmp,
        tempfile.TemporaryDirectory(dir=default_staging_root(), prefix="bench-extract-") as staging,
    ):
        tmp, staging = Path(tmp), Path(staging)
        no_cache = [*srv.extra_args, "--no-enable-prefix-caching"]
        plain = VLLMServer(model, tmp / "plain", extra_args=["--disable-uvicorn-access-log", *no_cache], **common)
        extracting = VLLMServer(
            model,
            tmp / "extract",
            extra_args=server_args(verifier.layer_ids, "cpu", staging / "normal", no_cache),
            **common,
        )
        # extract.deterministic: one sample per engine step, no chunked prefill, no prefix cache.
        one_by_one = VLLMServer(
            model,
            tmp / "deterministic",
            extra_args=server_args(
                verifier.layer_ids,
                "cpu",
                staging / "deterministic",
                [*srv.extra_args, *deterministic_args(target.max_model_len + 1)],
            ),
            **common,
        )
        with plain, extracting, one_by_one:
            asyncio.run(plain_prefill(plain.url, model, warm_rows, ex.concurrency))
            asyncio.run(
                extraction(extracting.url, staging / "normal", model, warm_rows, verifier, ex, None, ex.concurrency)
            )
            asyncio.run(
                extraction(
                    one_by_one.url, staging / "deterministic", model, warm_rows, verifier, ex, None, ex.concurrency
                )
            )
            times: dict[str, list[float]] = {name: [] for name in TIMED}
            for r in range(ROUNDS):
                stores = {
                    kind: StoreWriter.create_or_open(
                        str(tmp / f"store-{r}-{kind}"), verifier.store_attrs(), verifier.tokenizer_sha256
                    )
                    for kind in ("steady", "one-shard")
                }
                runs = {
                    "plain": lambda: plain_prefill(plain.url, model, rows, ex.concurrency),
                    "steady": lambda stores=stores: extraction(
                        extracting.url,
                        staging / "normal",
                        model,
                        rows,
                        verifier,
                        ex,
                        stores["steady"],
                        shard_tokens=STEADY_SHARD,
                    ),
                    "one-shard": lambda stores=stores: extraction(
                        extracting.url, staging / "normal", model, rows, verifier, ex, stores["one-shard"]
                    ),
                    "dropped": lambda: extraction(
                        extracting.url, staging / "normal", model, warm_rows, verifier, ex, None, ex.concurrency
                    ),
                    "deterministic": lambda: extraction(
                        one_by_one.url, staging / "deterministic", model, warm_rows, verifier, ex, None, ex.concurrency
                    ),
                }
                # Each round starts one later in the list: a run that follows an idle spell of its
                # server (or a busy one of another) is not always the same one.
                for name in TIMED[r % len(TIMED) :] + TIMED[: r % len(TIMED)]:
                    times[name].append(timed(runs[name]))
                for store in stores.values():
                    assert len(store.committed_sample_ids()) == len(rows)
            plain_s, extract_s, one_shard_s, dropped_s, deterministic_s = (times[name] for name in TIMED)
        disk = store_bytes(str(tmp / "store-0-one-shard"))
    ratios = [e / p for e, p in zip(extract_s, plain_s)]
    figures = {
        "setting": {
            "target": target.name_or_path,
            "dtype": target.dtype,
            "layer_ids": verifier.layer_ids,
            "hidden_size": verifier.hidden_size,
            "samples": len(rows),
            "tokens": n_tokens,
            "rounds": ROUNDS,
            "concurrency": ex.concurrency,
            "steady_shard_tokens": STEADY_SHARD,
            "server_env": env,
            "server_extra_args": srv.extra_args,
            "prefix_caching": False,
        },
        "plain_prefill_s": [round(t, 2) for t in plain_s],
        "extraction_s": [round(t, 2) for t in extract_s],
        "plain_tokens_per_s": round(ROUNDS * n_tokens / sum(plain_s), 1),
        "extraction_tokens_per_s": round(ROUNDS * n_tokens / sum(extract_s), 1),
        "extraction_time_vs_plain_prefill": round(sum(extract_s) / sum(plain_s), 3),
        "extraction_time_vs_plain_prefill_per_round": [round(x, 3) for x in ratios],
        # The stage's shard size: these tokens make one shard, compressed and written after
        # the last request (a tail a long run pays once, not per shard).
        "extraction_one_shard_s": [round(t, 2) for t in one_shard_s],
        "extraction_one_shard_vs_plain_prefill": round(sum(one_shard_s) / sum(plain_s), 3),
        # Where the extra time goes: the same extraction with the states read and dropped
        # (server side + transfer) against plain prefill, and the store writes on top.
        "extraction_without_store_s": [round(t, 2) for t in dropped_s],
        "extraction_without_store_vs_plain_prefill": round(sum(dropped_s) / sum(plain_s), 3),
        # extract.deterministic against the normal mode, both without the store writes.
        "deterministic_without_store_s": [round(t, 2) for t in deterministic_s],
        "deterministic_vs_normal_extraction": round(sum(deterministic_s) / sum(dropped_s), 3),
        "store_bytes_per_token": round(disk / n_tokens, 1),
        "raw_bytes_per_token": raw_bytes_per_token(verifier),
        "store_size_vs_raw": round(disk / (n_tokens * raw_bytes_per_token(verifier)), 3),
    }
    print(
        f"{len(rows)} samples, {n_tokens} tokens, {ROUNDS} alternating rounds: plain prefill "
        f"{figures['plain_tokens_per_s']:.0f} tok/s, extraction {figures['extraction_tokens_per_s']:.0f} tok/s: "
        f"extraction takes {figures['extraction_time_vs_plain_prefill']:.2f}x plain prefill's time "
        f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)}; "
        f"{figures['extraction_one_shard_vs_plain_prefill']:.2f}x as one shard; without the store writes "
        f"{figures['extraction_without_store_vs_plain_prefill']:.2f}x; deterministic mode "
        f"{figures['deterministic_vs_normal_extraction']:.2f}x the normal mode's time); "
        f"store {figures['store_bytes_per_token']:.0f} B/token = {figures['store_size_vs_raw']:.3f}x raw "
        f"({raw_bytes_per_token(verifier)} B/token)"
    )
    return write_figures(out_dir, "extract", figures)


if __name__ == "__main__":
    main(Path(__file__).resolve().parent / "results")
