"""What the report says about the drafter, its data and its training run (read from their files).

Everything here is read defensively: a drafter copied without its run directory or data
still gets a report; the missing parts are reported as absent, never guessed.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark.store import ShardStore

DRAFTER_META = "dspark_meta.json"
METRICS_FILE = "metrics.jsonl"
TRAINER_STATE = "trainer_state.json"


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def drafter_info(drafter_dir: str | Path) -> dict:
    """Architecture of an exported drafter, from its speculators config.json."""
    drafter_dir = Path(drafter_dir)
    config = _json(drafter_dir / "config.json")
    if config is None:
        raise FileNotFoundError(f"drafter={drafter_dir}: no config.json (not an exported drafter dir)")
    layers = config.get("transformer_layer_config", {})
    spec = config.get("speculators_config", {})
    proposals = spec.get("proposal_methods") or [{}]
    return {
        "path": str(drafter_dir.resolve()),
        "verifier": spec.get("verifier", {}).get("name_or_path"),
        "speculators_model_type": config.get("speculators_model_type"),
        "num_layers": layers.get("num_hidden_layers"),
        "hidden_size": layers.get("hidden_size"),
        "num_attention_heads": layers.get("num_attention_heads"),
        "num_key_value_heads": layers.get("num_key_value_heads"),
        "intermediate_size": layers.get("intermediate_size"),
        "layer_types": layers.get("layer_types"),
        "sliding_window": layers.get("sliding_window"),
        "block_size": config.get("block_size"),
        "speculative_tokens": proposals[0].get("speculative_tokens"),
        "verifier_vocab_size": layers.get("vocab_size"),
        "draft_vocab_size": config.get("draft_vocab_size"),
        "aux_hidden_state_layer_ids": config.get("aux_hidden_state_layer_ids"),
        "mask_token_id": config.get("mask_token_id"),
        "sample_from_anchor": config.get("sample_from_anchor"),
        "markov_rank": config.get("markov_rank"),
        "markov_head_type": config.get("markov_head_type"),
        "confidence_head": config.get("enable_confidence_head"),
        "confidence_head_with_markov": config.get("confidence_head_with_markov"),
    }


def data_info(data_dir: str | Path, store: ShardStore | None) -> dict:
    """Sources, sample counts and regeneration settings (data summary.json), plus the store's attrs."""
    out: dict = {}
    summary = _json(Path(data_dir) / "summary.json")
    if summary is not None:
        source = summary.get("source", {})
        out["source"] = {
            k: source.get(k)
            for k in ("name", "source", "path", "rows", "usable", "selected", "max_turns", "eval_fraction")
        }
        out["splits"] = summary.get("splits")
        out["regeneration"] = summary.get("regeneration")
        out["tokenize"] = summary.get("tokenize")
    if store is not None:
        shards = store.manifest["shards"]
        out["heldout_store"] = {
            "url": store.url,
            "samples": sum(s["n_samples"] for s in shards),
            "tokens": sum(s["n_tokens"] for s in shards),
            "layer_ids": store.target.get("layer_ids"),
            **{k: v for k, v in store.attrs.items() if k not in ("format_version", "target", "tokenizer_sha256")},
        }
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return []
    rows = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as err:
                raise ValueError(f"{path}:{line_no}: not JSON ({err})") from err
    return rows


def training_info(run_dir: str | Path, drafter_dir: str | Path) -> dict:
    """Steps, time, hardware, final held-out figures and loss/τ curves of the training run."""
    run_dir, drafter_dir = Path(run_dir), Path(drafter_dir)
    meta = _json(drafter_dir / DRAFTER_META) or {}
    state = _json(run_dir / "checkpoints" / "latest" / TRAINER_STATE) or {}
    rows = read_metrics(run_dir)
    train_rows = [r for r in rows if r.get("split") == "train"]
    eval_rows = [r for r in rows if r.get("split") == "eval"]
    out = {
        "run_dir": str(run_dir.resolve()) if run_dir.is_dir() else None,
        "steps": meta.get("step", state.get("step")),
        "best_step": meta.get("best_step", state.get("best_step")),
        "epochs": state.get("epoch"),
        "world_size": meta.get("world_size", state.get("world_size")),
        "train_time_s": meta.get("train_time_s"),
        "hardware": meta.get("hardware"),
        "final_eval": meta.get("eval") or (eval_rows[-1] if eval_rows else None),
        "curves": {
            "train loss": [[r["step"], r["loss"]] for r in train_rows if "loss" in r],
            "held-out τ": [[r["step"], r["tau"]] for r in eval_rows if "tau" in r],
        },
    }
    if train_rows and "tokens_per_s" in train_rows[-1]:
        out["tokens_per_s"] = train_rows[-1]["tokens_per_s"]
    return out


__all__ = ["data_info", "drafter_info", "read_metrics", "training_info"]
