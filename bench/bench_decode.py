"""Speculative decoding (eval.speculative) against plain decoding of the same verifier, in the same run.

Per temperature (0 and 1) and verification (fixed block, adaptive with the confidence head):
verifier forwards per generated token (plain decoding: 1) and the wall-time ratio speculative /
plain decoding (transformers `generate`), prompts decoded one at a time, rounds alternating so
machine noise hits both. Default: a random 4-layer verifier (hidden 128, 2,048 tokens) and a
random drafter exported and reloaded from its directory, 2 prompts of 32 tokens, 32 new tokens
(the random verifier's flat distributions accept some random drafts: engine overhead and budget).
Point DSPARK_BENCH_DRAFTER at an exported drafter (verifier: DSPARK_BENCH_VERIFIER, a model dir)
for a trained one's figures; DSPARK_BENCH_DEVICE=cuda runs both decodings on the GPU (one
untimed warm-up round first, which the CPU runs skip).

Run: python -m bench.bench_decode   (or python -m bench only=decode)
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from bench import write_figures
from bench.tiny_models import TINY_DRAFT, tiny_qwen3_config
from dspark.eval.decode_runs import hf_generate, profile_costs
from dspark.eval.speculative import SpeculativeDecoder, Verifier
from dspark.export import export_drafter, load_drafter
from dspark.model import DSparkDraft
from dspark.verifier import VerifierHead

PROMPTS, PROMPT_LEN, NEW_TOKENS, ROUNDS = 2, 32, 32, 2
DEVICE = torch.device(os.environ.get("DSPARK_BENCH_DEVICE", "cpu"))


def random_models(root: Path) -> tuple[Path, Path]:
    torch.manual_seed(0)
    config = tiny_qwen3_config(2048, hidden_size=128, num_layers=4, max_position_embeddings=1024)
    Qwen3ForCausalLM(config).save_pretrained(root / "verifier")
    head = VerifierHead.from_pretrained(root / "verifier")
    cfg = dataclasses.replace(TINY_DRAFT, num_layers=1, markov_rank=16)
    draft = DSparkDraft(cfg, head.config, [1, 2, 3], 2047)
    draft.load_verifier(head)
    export_drafter(draft, root / "drafter", str(root / "verifier"))
    return root / "verifier", root / "drafter"


def main(out_dir: Path) -> dict:
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        drafter_dir = os.environ.get("DSPARK_BENCH_DRAFTER")
        verifier_dir = os.environ.get("DSPARK_BENCH_VERIFIER")
        if drafter_dir is None:
            verifier_dir, drafter_dir = random_models(Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval().to(DEVICE)
        draft = load_drafter(drafter_dir, VerifierHead.from_pretrained(verifier_dir)).to(DEVICE)
        engine = SpeculativeDecoder(Verifier(model, draft.aux_layer_ids), draft)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, model.config.vocab_size - 1, PROMPT_LEN).tolist() for _ in range(PROMPTS)]
        costs = profile_costs(engine, prompts[0], 3) if draft.confidence_head is not None else None
        rows = {}
        for temperature in (0.0, 1.0):
            for adaptive in [False] if costs is None else [False, True]:
                ratios, forwards = [], 0
                for r in range(-1 if DEVICE.type == "cuda" else 0, ROUNDS):
                    start = time.perf_counter()
                    for i, p in enumerate(prompts):
                        hf_generate(model, p, NEW_TOKENS, temperature, seed=i)
                    plain = time.perf_counter() - start
                    start = time.perf_counter()
                    outs = [
                        engine.generate([p], NEW_TOKENS, temperature, i, costs if adaptive else None)[0]
                        for i, p in enumerate(prompts)
                    ]
                    if r >= 0:  # round -1: the GPU's warm-up (kernels, caches), not timed
                        ratios.append((time.perf_counter() - start) / plain)
                    forwards = sum(o.verifier_forwards for o in outs)
                name = f"T{temperature:g}_{'adaptive' if adaptive else 'fixed'}"
                rows[name] = {
                    "verifier_forwards_per_token": forwards / (PROMPTS * NEW_TOKENS),
                    "acceptance_length": float(np.mean([1 + np.mean(o.accepted_per_step) for o in outs])),
                    "wall_ratio_vs_plain": statistics.median(ratios),
                }
                print(f"   {name}: {rows[name]}", flush=True)
    figures = {
        "drafter": "random (exported, reloaded)" if os.environ.get("DSPARK_BENCH_DRAFTER") is None else drafter_dir,
        "device": torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu",
        "prompts": PROMPTS,
        "new_tokens": NEW_TOKENS,
        "rounds": ROUNDS,
        # what the adaptive runs' budget rule weighed, profiled here: `eval.decode.step_costs` takes it
        "adaptive_costs": None if costs is None else costs.as_step_costs(),
        "runs": rows,
    }
    return write_figures(out_dir, "decode", figures)


if __name__ == "__main__":
    main(Path("bench/results"))
