"""The data-wait fraction of the real trainer (step throughput against speculators is
bench/bench_train_step.py).

The real trainer (`train.__main__.run`, one process) on a store of random hidden states of a
SmolLM2-135M-sized verifier: the share of step time spent waiting for the next batch, with
one background worker (prefetch) and with loading inline. The step is made light here
(1 draft layer, 16 anchors per sample), as a GPU step would be next to the CPU-side
reading, so that loading is a visible share of it.

Run: python -m bench.bench_train   (or python -m bench only=train)
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench import qwen_tokenizer_dir, write_figures

REPO = Path(__file__).resolve().parents[1]
HIDDEN, HEADS, KV_HEADS, MLP, VOCAB, VERIFIER_LAYERS = 576, 9, 3, 1536, 49_152, 4
MASK_TOKEN_ID = VOCAB - 1
SEQ = 512
WAIT_LAYERS, WAIT_ANCHORS, WAIT_SAMPLES = 1, 16, 24


def make_verifier(out: Path) -> Path:
    """A random Qwen3 verifier of SmolLM2-135M's width (only its embedding, norm and lm_head are read)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=VERIFIER_LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    Qwen3ForCausalLM(config).save_pretrained(out)
    # Any real tokenizer: the store records its hash; nothing is tokenized here.
    AutoTokenizer.from_pretrained(qwen_tokenizer_dir()).save_pretrained(out)
    return out


def write_random_store(url: Path, verifier_dir: Path, samples: int) -> None:
    from dspark.store import Sample, StoreWriter, bf16_to_bits
    from dspark.targets import tokenizer_sha256

    target = {
        "name_or_path": str(verifier_dir),
        "hidden_size": HIDDEN,
        "num_hidden_layers": VERIFIER_LAYERS,
        "layer_ids": [1, 2, 3, VERIFIER_LAYERS],
        "dtype": "bfloat16",
    }
    store = StoreWriter.create_or_open(url, target, tokenizer_sha256(verifier_dir))
    rng = np.random.default_rng(0)
    rows = []
    for i in range(samples):
        mask = np.ones(SEQ, dtype=np.uint8)
        mask[:32] = 0
        hidden = bf16_to_bits(torch.from_numpy(rng.standard_normal((SEQ, 4, HIDDEN), dtype=np.float32)))
        rows.append(Sample(i, rng.integers(0, MASK_TOKEN_ID, SEQ).astype(np.int32), mask, hidden))
    for start in range(0, samples, 8):
        store.write_shard(rows[start : start + 8])


def data_wait(verifier_dir: Path, work: Path, workers: int) -> dict:
    from hydra import compose, initialize_config_dir

    from dspark.train.__main__ import run

    run_dir = work / f"run-{workers}"
    overrides = [
        "target.name=bench",
        f"target.name_or_path={verifier_dir}",
        "target.aux_layer_ids=[1,2,3]",
        f"target.mask_token_id={MASK_TOKEN_ID}",
        f"model.num_layers={WAIT_LAYERS}",
        f"loss.num_anchors={WAIT_ANCHORS}",
        f"train.run_dir={run_dir}",
        f"train.train_store={work / 'store'}",
        "train.eval_store=null",
        f"train.tokens_per_step={SEQ}",
        f"train.tokens_per_micro_batch={SEQ}",
        "train.epochs=1",
        f"train.data_workers={workers}",
        "train.log_every=1",
        "train.export=false",
        "train.save_every=1000",
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        run(compose("train", overrides=overrides))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if r["split"] == "train"][1:]  # step 1 includes the workers' start
    return {
        "data_wait_fraction": round(statistics.mean(r["data_wait"] for r in steady), 4),
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in steady), 1),
        "steps": len(steady),
    }


def main(out_dir: Path) -> dict:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        verifier_dir = make_verifier(work / "verifier")
        write_random_store(work / "store", verifier_dir, samples=WAIT_SAMPLES)
        wait = {"prefetch_1_worker": data_wait(verifier_dir, work, 1), "inline": data_wait(verifier_dir, work, 0)}
    figures = {
        "setting": {
            "verifier": f"qwen3-shaped, hidden {HIDDEN}, vocab {VOCAB}",
            "device": "cpu",
            "threads": 1,
            "draft_layers": WAIT_LAYERS,
            "anchors": WAIT_ANCHORS,
            "samples": WAIT_SAMPLES,
            "tokens_per_step": SEQ,
        },
        "data_wait": wait,
    }
    for name, w in wait.items():
        print(f"data wait ({name}): {100 * w['data_wait_fraction']:.1f}% of step time, {w['tokens_per_s']} tokens/s")
    return write_figures(out_dir, "train", figures)


if __name__ == "__main__":
    main(Path(__file__).resolve().parent / "results")
