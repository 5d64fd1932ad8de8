"""A small evaluation setup on disk: tiny verifier, held-out store, data dir, exported drafter, run dir.

Self-contained on purpose: the verifier keeps only the first 2,048 rows of Qwen3's
vocabulary (every full-vocabulary softmax stays cheap), samples are random tokens, and
hidden states come from HF transformers with forward pre-hooks in vLLM's layer-id
convention (id k = residual entering layer k; id N = the input of the final norm).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from conftest import qwen_tokenizer_files
from drafts import draft_config
from hydra import compose, initialize_config_dir
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from dspark.config import HeldoutConfig, TargetConfig
from dspark.eval.__main__ import stage_configs
from dspark.eval.config import EvalConfig
from dspark.export import export_drafter
from dspark.model import DSparkDraft
from dspark.store import Sample, ShardStore, StoreWriter, bf16_to_bits
from dspark.targets import tokenizer_sha256
from dspark.verifier import VerifierHead

VOCAB = 2048
MASK_TOKEN_ID = VOCAB - 1
NUM_LAYERS = 4
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
AUX_LAYER_IDS = (1, 2, 3)
SOURCES = ("chat", "code")


@dataclass
class EvalSetup:
    root: Path
    verifier_dir: Path
    store: Path
    data_dir: Path
    run_dir: Path
    drafter: Path


def write_data_dir(data_dir: Path, samples, first_id: int = 0) -> None:
    """eval.jsonl (with alternating sources) and a summary.json like the data stage writes."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with (data_dir / "eval.jsonl").open("w") as f:
        for i, (ids, mask) in enumerate(samples):
            f.write(
                json.dumps(
                    {
                        "sample_id": first_id + i,
                        "source": SOURCES[i % 2],
                        "split": "eval",
                        "input_ids": ids.tolist(),
                        "loss_mask": mask.tolist(),
                    }
                )
                + "\n"
            )
    summary = {
        "source": {
            "name": "synthetic",
            "source": "jsonl",
            "path": None,
            "rows": 40,
            "usable": 38,
            "selected": 30,
            "max_turns": None,
            "eval_fraction": 0.2,
        },
        "splits": {
            "train": {"samples": 22, "tokens": 1000, "loss_tokens": 800},
            "eval": {
                "samples": len(samples),
                "tokens": int(sum(len(s[0]) for s in samples)),
                "loss_tokens": int(sum(int(s[1].sum()) for s in samples)),
            },
        },
        "regeneration": {"enabled": True, "temperature": 0.7, "top_p": 0.8, "max_new_tokens": 128},
    }
    (data_dir / "summary.json").write_text(json.dumps(summary))


def write_run_dir(run_dir: Path, steps: int = 20) -> None:
    """metrics.jsonl rows as the trainer writes them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "metrics.jsonl").open("w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"step": step, "split": "train", "loss": 3.0 / step, "tokens_per_s": 1000.0}) + "\n")
            if step % 5 == 0:
                f.write(json.dumps({"step": step, "split": "eval", "tau": 1.0 + step / steps}) + "\n")


def export_tiny_drafter(
    verifier_dir: Path,
    out: Path,
    *,
    draft_vocab_size: int | None = None,
    verifier_name: str | None = None,
    seed: int = 0,
    mask_token_id: int = MASK_TOKEN_ID,
    confidence_head: bool = True,
) -> Path:
    verifier = VerifierHead.from_pretrained(verifier_dir)
    d2t = None
    if draft_vocab_size is not None:
        # half of the data's tokens (1000..1095) inside the draft vocabulary, half outside
        assert 48 <= draft_vocab_size <= 1048
        ids = torch.cat([torch.arange(draft_vocab_size - 48), torch.arange(1000, 1096, 2)])
        d2t = ids - torch.arange(draft_vocab_size)
    torch.manual_seed(seed)
    cfg = draft_config(
        draft_vocab_size=draft_vocab_size,
        confidence_head=confidence_head,
        confidence_head_with_markov=confidence_head,
    )
    model = DSparkDraft(cfg, verifier.config, list(AUX_LAYER_IDS), mask_token_id, d2t=d2t)
    model.load_verifier(verifier)
    with torch.no_grad():  # random weights of a visible size (norm gains too): acceptance well inside (0, 1)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))
    meta = {"step": 20, "best_step": 15, "eval": {"tau": 2.0}, "world_size": 2}
    # vLLM's subprocess check is tests/test_export_checks.py's; here it would only cost time
    return export_drafter(model, out, verifier_name or str(verifier_dir), extra_meta=meta, vllm_check=False)


def make_verifier(out: Path, seed: int = 0) -> Path:
    """A random Qwen3 (4 layers, hidden 64, tied lm_head, 2,048-token vocabulary, real tokenizer files)."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # peaked next-token distributions, like a trained model's
        model.get_input_embeddings().weight.normal_(std=0.1)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(qwen_tokenizer_files()).save_pretrained(out)
    return out


def make_samples(n: int, seed: int, min_len: int = 24, max_len: int = 80, prompt_len: int = 6):
    """Random (token_ids, loss_mask) samples: an untrained prompt, then trained tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        mask = np.ones(length, dtype=np.uint8)
        mask[:prompt_len] = 0
        out.append((rng.integers(1000, 1096, size=length), mask))
    return out


def store_target(verifier_dir: Path, name_or_path: str | None = None) -> dict:
    return {
        "name_or_path": name_or_path or str(verifier_dir),
        "hidden_size": 64,
        "num_hidden_layers": NUM_LAYERS,
        "layer_ids": [*AUX_LAYER_IDS, NUM_LAYERS],
        "dtype": "bfloat16",
    }


@torch.no_grad()
def write_store(url: Path, verifier_dir: Path, samples, extra_attrs: dict | None = None) -> ShardStore:
    """A shard store of the samples with the verifier's hidden states at aux layers + the final layer."""
    model = Qwen3ForCausalLM.from_pretrained(verifier_dir).eval()
    captured: dict[int, torch.Tensor] = {}
    model.model.norm.register_forward_pre_hook(lambda m, args: captured.__setitem__(NUM_LAYERS, args[0]))
    for k in AUX_LAYER_IDS:
        model.model.layers[k].register_forward_pre_hook(lambda m, args, k=k: captured.__setitem__(k, args[0]))
    store = StoreWriter.create_or_open(url, store_target(verifier_dir), tokenizer_sha256(verifier_dir), extra_attrs)
    rows = []
    for i, (ids, mask) in enumerate(samples):
        model(torch.from_numpy(ids)[None])
        hidden = torch.stack([captured[k][0] for k in (*AUX_LAYER_IDS, NUM_LAYERS)], dim=1)
        rows.append(Sample(i, ids.astype(np.int32), mask, bf16_to_bits(hidden)))
    store.write_shard(rows[: len(rows) // 2])
    store.write_shard(rows[len(rows) // 2 :])
    return store


def build_setup(root: Path, n_samples: int = 8) -> EvalSetup:
    verifier_dir = make_verifier(root / "verifier")
    samples = make_samples(n_samples, seed=7)
    store = root / "store" / "eval"
    write_store(store, verifier_dir, samples, extra_attrs={"split": "eval"})
    write_data_dir(root / "data", samples)
    write_run_dir(root / "run")
    drafter = export_tiny_drafter(verifier_dir, root / "run" / "drafter")
    return EvalSetup(root, verifier_dir, store, root / "data", root / "run", drafter)


def setup_overrides(setup: EvalSetup) -> list[str]:
    """`python -m eval` overrides that point the stage at the setup (its drafter aside)."""
    return [
        "target.name=tiny",
        f"target.name_or_path={setup.verifier_dir}",
        "target.aux_layer_ids=[1,2,3]",
        "target.max_model_len=512",
        f"paths.root={setup.root}",
        f"eval.store={setup.store}",
        f"eval.data_dir={setup.data_dir}",
        f"eval.out_dir={setup.root / 'eval'}",
        "eval.online.enabled=false",
        "eval.decode.enabled=false",
    ]


def compose_cfg(setup: EvalSetup, *overrides: str, config_name: str = "eval"):
    """The stage's real Hydra config with the setup's paths."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(
            config_name=config_name, overrides=[f"drafter={setup.drafter}", *setup_overrides(setup), *overrides]
        )


def configs(cfg) -> tuple[TargetConfig, EvalConfig, HeldoutConfig]:
    target, eval_cfg, heldout, _ = stage_configs(cfg)
    return target, eval_cfg, heldout
