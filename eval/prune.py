"""Post-hoc vocabulary pruning of an exported drafter: `python -m eval.prune drafter=<dir> ...`.

Keeps the draft-vocabulary rows of the tokens the verifier actually emits (counted over
loss-masked tokens of a store or tokenized dataset, or given as a counts array), i.e. it
row-gathers `lm_head.weight` and `markov_head.markov_w2.weight`, rewrites `d2t`/`t2d` and
`draft_vocab_size`, and writes a new drafter. Kept tokens keep their exact logits; the
draft's softmax renormalizes over the smaller vocabulary, so its τ is measured again
(honestly: target mass outside the new vocabulary is rejected) next to the original's.

Only tokens already in the drafter's vocabulary can be kept: a row outside it has no
trained Markov weights.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
import zarr
from omegaconf import DictConfig
from safetensors.torch import load_file, save_file

from dspark.config import load_section
from dspark.entry import stage_main
from dspark.eval.__main__ import stage_configs
from dspark.eval.config import PruneConfig
from dspark.eval.evaluate import load_checked
from dspark.eval.offline import acceptance_summary, evaluate_store, pick_device
from dspark.eval.report import write_report
from dspark.export import CONFIG_FILE, META_FILE, WEIGHTS_FILE
from dspark.store import ShardStore
from dspark.targets import resolve_target_dir
from dspark.verifier import VerifierHead
from dspark.vocab import build_mapping, count_tokens

LM_HEAD = "lm_head.weight"
MARKOV_W2 = "markov_head.markov_w2.weight"
PRUNE_REPORT = "prune_report.json"


def load_counts(source: str | Path, vocab_size: int) -> np.ndarray:
    """Token counts int64 [V] from a `.npy` array, a tokenized `.jsonl` or a shard store."""
    path = Path(source)
    if path.suffix == ".npy":
        counts = np.load(path)
        if counts.shape != (vocab_size,) or not np.issubdtype(counts.dtype, np.integer):
            raise ValueError(
                f"prune.counts={path}: expected integer counts of shape [{vocab_size}], "
                f"got {counts.dtype} {list(counts.shape)}"
            )
        return counts.astype(np.int64)
    if path.suffix == ".jsonl":
        ids, masks = [], []
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids.append(row["input_ids"])
                masks.append(row["loss_mask"])
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{line_no}: a row needs `input_ids` and `loss_mask` ({err})") from err
        return count_tokens(ids, masks, vocab_size)
    return store_counts(str(source), vocab_size)


def store_counts(url: str, vocab_size: int) -> np.ndarray:
    """Counts over a store's loss-masked tokens, reading only `token_ids` and `loss_mask` of each shard."""
    store = ShardStore.open(url)
    root = zarr.open_group(url, mode="r")
    shards = [root[f"shards/{s['name']}"] for s in store.manifest["shards"]]
    if not shards:
        raise ValueError(f"prune.counts={url}: the store has no committed samples")
    return count_tokens((g["token_ids"][...] for g in shards), (g["loss_mask"][...] for g in shards), vocab_size)


def kept_token_ids(
    draft_ids: np.ndarray, counts: np.ndarray, draft_vocab_size: int | None, min_count: int
) -> np.ndarray:
    """Ascending verifier ids to keep: the most frequent of the draft's own ids (ties → smaller id)."""
    if draft_vocab_size is None:
        kept = draft_ids[counts[draft_ids] >= min_count]
        if kept.size == 0:
            raise ValueError(f"prune: no token of the draft vocabulary occurs >= {min_count} times in the counts")
        return kept
    if not 1 <= draft_vocab_size <= draft_ids.size:
        raise ValueError(
            f"prune.draft_vocab_size={draft_vocab_size}: must be in [1, {draft_ids.size}] "
            f"(the drafter's current vocabulary)"
        )
    # ids outside the current draft vocabulary rank below every id inside it
    restricted = np.full_like(counts, -1)
    restricted[draft_ids] = counts[draft_ids]
    d2t, _ = build_mapping(restricted, draft_vocab_size)
    return (torch.arange(draft_vocab_size) + d2t).numpy()


def prune_drafter(src: str | Path, dst: str | Path, keep: np.ndarray, verifier_dir: str | Path | None = None) -> Path:
    """Write a copy of drafter `src` restricted to verifier ids `keep` (ascending) at `dst`.

    A full-vocabulary drafter stores no lm_head (it is the verifier's); `verifier_dir`
    supplies its rows then.
    """
    src, dst = Path(src), Path(dst)
    config = json.loads((src / CONFIG_FILE).read_text())
    tensors = load_file(str(src / WEIGHTS_FILE))
    vocab_size = int(config["transformer_layer_config"]["vocab_size"])
    draft_ids = draft_token_ids(tensors, int(config["draft_vocab_size"]), vocab_size)
    keep = np.asarray(keep, dtype=np.int64)
    rows = np.searchsorted(draft_ids, keep)
    if (
        keep.size == 0
        or (keep[1:] <= keep[:-1]).any()
        or rows.max() >= draft_ids.size
        or (draft_ids[rows] != keep).any()
    ):
        raise ValueError("prune: kept ids must be ascending, non-empty and inside the drafter's vocabulary")
    if LM_HEAD not in tensors:
        if verifier_dir is None:
            raise ValueError(f"{src}: full-vocabulary drafter (no {LM_HEAD}); the verifier's lm_head is needed")
        like = next(iter(tensors.values()))
        tensors[LM_HEAD] = VerifierHead.from_pretrained(verifier_dir).lm_head_weight.detach().to(like.dtype)
    index = torch.from_numpy(rows)
    for name in (LM_HEAD, MARKOV_W2):
        if name in tensors:
            tensors[name] = tensors[name].index_select(0, index).contiguous()
    ids = torch.from_numpy(keep)
    tensors["d2t"] = ids - torch.arange(keep.size)
    tensors["t2d"] = torch.zeros(vocab_size, dtype=torch.bool)
    tensors["t2d"][ids] = True
    config["draft_vocab_size"] = int(keep.size)

    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    meta = json.loads((src / META_FILE).read_text()) if (src / META_FILE).is_file() else {}
    meta["pruned_from"] = {"path": str(src.resolve()), "draft_vocab_size": int(draft_ids.size)}
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)
    return dst


def draft_token_ids(tensors: dict[str, torch.Tensor], draft_vocab_size: int, vocab_size: int) -> np.ndarray:
    """Verifier id of every draft id (identity for a full-vocabulary drafter)."""
    if "d2t" not in tensors:
        if draft_vocab_size != vocab_size:
            raise ValueError(
                f"draft_vocab_size {draft_vocab_size} < verifier vocabulary {vocab_size} but no d2t tensor"
            )
        return np.arange(vocab_size)
    return (torch.arange(draft_vocab_size) + tensors["d2t"].long()).numpy()


def run(cfg: DictConfig) -> dict:
    """Prune `cfg.drafter` as configured; returns (and writes) the comparison report."""
    target, eval_cfg, heldout, _ = stage_configs(cfg)
    prune = load_section(PruneConfig, cfg, "prune")
    src, dst = Path(cfg.drafter), Path(prune.out)
    if not (src / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"drafter={src}: not an exported drafter dir (no {CONFIG_FILE})")
    if dst.resolve() == src.resolve():
        raise ValueError(f"prune.out={dst} is the drafter itself; write the pruned drafter elsewhere")
    config = json.loads((src / CONFIG_FILE).read_text())
    vocab_size = int(config["transformer_layer_config"]["vocab_size"])
    draft_ids = draft_token_ids(load_file(str(src / WEIGHTS_FILE)), int(config["draft_vocab_size"]), vocab_size)
    counts = load_counts(prune.counts, vocab_size)
    keep = kept_token_ids(draft_ids, counts, prune.draft_vocab_size, prune.min_count)
    verifier_dir = resolve_target_dir(target.name_or_path, target.revision)
    prune_drafter(src, dst, keep, verifier_dir)
    report = {
        "original": {"path": str(src.resolve()), "draft_vocab_size": int(draft_ids.size)},
        "pruned": {"path": str(dst.resolve()), "draft_vocab_size": int(keep.size)},
        "counts": {
            "source": prune.counts,
            "total": int(counts.sum()),
            "covered_by_original": float(counts[draft_ids].sum() / max(counts.sum(), 1)),
            "covered_by_pruned": float(counts[keep].sum() / max(counts.sum(), 1)),
        },
    }
    if prune.evaluate:
        for key, path in (("original", src), ("pruned", dst)):
            draft, verifier, store, _ = load_checked(path, target, eval_cfg.store)
            device = pick_device(eval_cfg.offline.device)
            table = evaluate_store(draft, verifier, store, heldout, device, heldout.max_samples, desc=f"τ of {key}")
            report[key]["offline"] = acceptance_summary(table.alpha, table.slot_mask)
    write_report(report, dst, PRUNE_REPORT)
    return report


__all__ = ["PRUNE_REPORT", "draft_token_ids", "kept_token_ids", "load_counts", "prune_drafter", "run", "store_counts"]


@stage_main("prune")
def main(cfg: DictConfig) -> None:
    report = run(cfg)
    for key in ("original", "pruned"):
        r = report[key]
        tau = f", offline τ {r['offline']['tau']:.3f}" if "offline" in r else ""
        print(f"{key}: {r['path']} ({r['draft_vocab_size']} draft tokens{tau})")


if __name__ == "__main__":
    main()
