"""Offline acceptance of a drafter on the held-out shard store.

For every evaluated block (anchor p, slots k = 0..B−1) the draft runs on the stored aux
hidden states exactly as in training, and each slot is scored against the verifier's
full-vocabulary softmax (temperature 1) at position p+k, computed from the stored final
hidden state: α_k = Σ_v min(q_k, p_k). A reduced draft vocabulary is counted honestly:
target mass outside it is rejected (see `dspark.metrics`). The Markov head's previous
token is the data token (teacher forcing): the data is the verifier's own output, so this
is the token the verifier would have accepted.

Results are kept per block (`BlockTable`), so any grouping (sequence-length bucket, anchor
position bucket, data source) and the confidence calibration read the same numbers.

Which samples and anchors are scored is the `heldout` protocol (`dspark.config.HeldoutConfig`),
and `heldout_samples` + `score_samples` are the one scorer of held-out τ: `make eval`, `make
ablate` and the trainer's periodic evaluation (each rank scoring its share of whole samples, the
sums added over ranks) all call them, so on one store they report the same figure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F
from tqdm import tqdm

from dspark.anchors import anchor_candidates, sample_anchors, slot_targets
from dspark.config import HeldoutConfig
from dspark.errors import MissingInput, UserError
from dspark.eval.config import OfflineConfig
from dspark.metrics import AcceptanceStats, acceptance
from dspark.model import DSparkDraft
from dspark.store import SampleRef, ShardStore, bits_to_tensor
from dspark.verifier import VerifierHead


@dataclass
class BlockTable:
    """Per-block results; row i is one block (one anchor of one held-out sample)."""

    alpha: np.ndarray
    """float64 [n, B] acceptance of each slot given the earlier ones (0 where unscored)."""
    slot_mask: np.ndarray
    """bool [n, B] scored slots (a contiguous prefix per block)."""
    conf_logits: np.ndarray | None
    """float64 [n, B] confidence-head logits, or None for a draft without the head."""
    sample_id: np.ndarray
    """int64 [n] held-out sample of the block."""
    anchor_pos: np.ndarray
    """int64 [n] anchor position p (context tokens before the block's first prediction)."""
    seq_len: np.ndarray
    """int64 [n] length of the block's sample."""
    head_inputs: np.ndarray | None = None
    """float32 [n, B, F] what the confidence head read (`evaluate_store(..., head_inputs=True)`), else None."""

    def select(self, rows: np.ndarray) -> BlockTable:
        return BlockTable(
            self.alpha[rows],
            self.slot_mask[rows],
            None if self.conf_logits is None else self.conf_logits[rows],
            self.sample_id[rows],
            self.anchor_pos[rows],
            self.seq_len[rows],
            None if self.head_inputs is None else self.head_inputs[rows],
        )

    @property
    def num_blocks(self) -> int:
        return int(self.alpha.shape[0])


def open_heldout_store(url: str) -> ShardStore:
    """The held-out store, or a clear error when there is none (or it is empty or not held out)."""
    try:
        store = ShardStore.open(url)
    except FileNotFoundError as err:
        raise MissingInput(
            f"eval.store={url}: no held-out shard store there ({err}); extract the eval split first "
            f"(make extract) or point eval.store at one"
        ) from err
    split = store.attrs.get("split")
    if split is not None and split != "eval":
        raise UserError(f"eval.store={url} holds the {split!r} split, not held-out data (split 'eval')")
    if not store.manifest["shards"]:
        raise UserError(f"eval.store={url} has no committed samples: nothing to evaluate")
    return store


def drafter_verifier_name(drafter_dir: str | Path) -> str:
    """The verifier a drafter was trained for (`speculators_config.verifier.name_or_path`)."""
    config = json.loads((Path(drafter_dir) / "config.json").read_text())
    try:
        return config["speculators_config"]["verifier"]["name_or_path"]
    except (KeyError, TypeError) as err:
        raise UserError(f"{drafter_dir}/config.json: no speculators_config.verifier.name_or_path") from err


def _same_verifier(name: str, target_name_or_path: str, target_dir: Path) -> bool:
    if name == target_name_or_path:
        return True
    path = Path(name).expanduser()
    return path.is_dir() and path.resolve() == Path(target_dir).resolve()


def check_compatible(
    drafter_dir: str | Path, draft: DSparkDraft, store: ShardStore, target_name_or_path: str, target_dir: Path
) -> None:
    """Refuse (ValueError naming what differs) a drafter that does not belong to the store and target
    (the store itself is checked against the target by `Target.check_store`)."""
    stored = store.target
    name = drafter_verifier_name(drafter_dir)
    if not _same_verifier(name, target_name_or_path, target_dir):
        raise UserError(
            f"drafter {drafter_dir} was trained for verifier {name!r}, but the held-out store {store.url} "
            f"holds states of {stored.get('name_or_path')!r} ({target_dir})"
        )
    if draft.layer_config.hidden_size != stored["hidden_size"]:
        raise UserError(
            f"drafter {drafter_dir}: hidden_size {draft.layer_config.hidden_size} != the store's "
            f"{stored['hidden_size']}"
        )
    missing = sorted(set(draft.aux_layer_ids) - set(stored["layer_ids"][:-1]))
    if missing:
        raise UserError(
            f"drafter {drafter_dir} reads aux layers {draft.aux_layer_ids}; the store "
            f"{store.url} has no layer(s) {missing} (stored: {stored['layer_ids']})"
        )


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("eval.offline.device=cuda but no CUDA device is available")
    return torch.device(name)


def held_out_refs(store: ShardStore, max_samples: int | None) -> list[SampleRef]:
    """The samples evaluated: lowest sample ids first, so reruns and other drafters see the same ones."""
    return store.by_sample_id(max_samples)


def evaluate_store(
    draft: DSparkDraft,
    verifier: VerifierHead,
    store: ShardStore,
    heldout: HeldoutConfig,
    device: torch.device,
    max_samples: int | None,
    desc: str = "offline eval",
    head_inputs: bool = False,
) -> BlockTable:
    """Score every block of the store's first `max_samples` held-out samples on `device`; with
    `head_inputs`, keep what the draft's confidence head read at each slot (`BlockTable.head_inputs`)."""
    refs = held_out_refs(store, max_samples)
    if not head_inputs or draft.confidence_head is None:
        return evaluate_blocks(draft, verifier, store, refs, heldout, device, desc)
    seen: list[torch.Tensor] = []  # one [c, B, F] per call of the head, in the table's block order
    hook = draft.confidence_head.register_forward_pre_hook(
        lambda _module, args: seen.append(args[0].detach().float().cpu())
    )
    try:
        table = evaluate_blocks(draft, verifier, store, refs, heldout, device, desc)
    finally:
        hook.remove()
    table.head_inputs = torch.cat(seen).numpy()
    if table.head_inputs.shape[:2] != table.alpha.shape:
        raise RuntimeError(
            f"captured head inputs {table.head_inputs.shape} do not match the blocks {table.alpha.shape}"
        )
    return table


def _anchors(loss_mask: torch.Tensor, sample_id: int, heldout: HeldoutConfig) -> torch.Tensor:
    """Anchor positions [A] of one sample: every candidate, or a seeded draw per sample."""
    if heldout.anchors_per_sample is None:
        return anchor_candidates(loss_mask[None])[0].nonzero().flatten()
    gen = torch.Generator().manual_seed(int(np.random.SeedSequence([heldout.seed, sample_id]).generate_state(1)[0]))
    anchors, valid = sample_anchors(loss_mask[None], heldout.anchors_per_sample, gen)
    return anchors[0][valid[0]]


def heldout_samples(
    store: ShardStore,
    refs: list[SampleRef],
    aux_layer_ids: list[int],
    desc: str = "offline eval",
    progress: bool = True,
):
    """The samples of `refs` as `score_samples` takes them, read one at a time (whole samples: a
    block's context is everything before it)."""
    layer_ids = list(store.target["layer_ids"])
    aux_index = [layer_ids.index(i) for i in aux_layer_ids]
    for ref in tqdm(refs, desc=desc, unit="sample", dynamic_ncols=True, disable=not progress):
        sample = store.read(ref)
        hidden = bits_to_tensor(sample.hidden).to(dtype=torch.float32)  # [T, L, H]
        ids = torch.from_numpy(sample.token_ids.astype(np.int64))
        mask = torch.from_numpy(sample.loss_mask.astype(bool))
        yield ref.sample_id, hidden[:, aux_index].flatten(1), hidden[:, -1], ids, mask


def evaluate_blocks(
    draft: DSparkDraft,
    verifier: VerifierHead,
    store: ShardStore,
    refs: list[SampleRef],
    heldout: HeldoutConfig,
    device: torch.device,
    desc: str = "offline eval",
) -> BlockTable:
    """Score every block of the given held-out samples."""
    samples = heldout_samples(store, refs, draft.aux_layer_ids, desc)
    table = score_samples(draft, verifier, samples, heldout, device)
    if table is None:
        raise UserError(f"{store.url}: no held-out sample has a trained position to anchor a block at")
    return table


@torch.no_grad()
def score_samples(draft: DSparkDraft, verifier: VerifierHead, samples, heldout: HeldoutConfig, device: torch.device):
    """Score every block of in-memory samples at the `heldout` protocol's anchors; None when no sample
    has a block to score.

    samples: iterable of (sample_id, context [T, m·H] aux states in the draft's layer order,
    final [T, H] pre-norm final-layer states, token_ids [T], loss_mask [T] bool).
    """
    draft = draft.to(device).eval()
    verifier = verifier.to(device)
    d2t = None if draft.d2t is None else draft.d2t.to(device)
    has_conf = draft.confidence_head is not None
    parts: dict[str, list] = {k: [] for k in ("alpha", "mask", "conf", "sid", "pos", "len")}
    for sample_id, context, final, ids, mask in samples:
        seq_len = context.shape[0]
        context = context.to(device, torch.float32)[None]
        final = final.to(device, torch.float32)
        ids, mask = ids[None].to(device), mask[None].to(device)
        all_anchors = _anchors(mask[0].cpu(), sample_id, heldout).to(device)
        for start in range(0, all_anchors.numel(), heldout.anchors_per_forward):
            anchors = all_anchors[start : start + heldout.anchors_per_forward][None]
            valid = torch.ones_like(anchors, dtype=torch.bool)
            _, target_pos, slot_mask = slot_targets(ids, mask, anchors, valid, draft.block_size)
            h = draft(context, ids, anchors, valid)[0]  # [A, B, H]
            prev = draft.block_tokens(ids, anchors)[0]  # [A, B]
            logits, conf = draft.heads(h, prev, with_confidence=has_conf)
            q = F.softmax(logits.float(), dim=-1)
            p = F.softmax(verifier.logits(final[target_pos[0]]).float(), dim=-1)
            alpha = acceptance(q, p, d2t) * slot_mask[0]
            parts["alpha"].append(alpha.double().cpu())
            parts["mask"].append(slot_mask[0].cpu())
            if has_conf:
                parts["conf"].append(conf.double().cpu())
            n = anchors.shape[1]
            parts["sid"].append(torch.full((n,), sample_id))
            parts["pos"].append(anchors[0].cpu())
            parts["len"].append(torch.full((n,), seq_len))
    if not parts["alpha"]:
        return None
    cat = {k: torch.cat(v).numpy() for k, v in parts.items() if v}
    return BlockTable(
        alpha=cat["alpha"],
        slot_mask=cat["mask"].astype(bool),
        conf_logits=cat.get("conf"),
        sample_id=cat["sid"].astype(np.int64),
        anchor_pos=cat["pos"].astype(np.int64),
        seq_len=cat["len"].astype(np.int64),
    )


def acceptance_summary(alpha: np.ndarray, slot_mask: np.ndarray) -> dict:
    """τ, per-position conditional (mean α_k) and cumulative (mean Π_{j≤k} α_j) acceptance."""
    stats = AcceptanceStats.from_alpha(torch.from_numpy(alpha), torch.from_numpy(slot_mask))
    return {
        "blocks": int(stats.slots[0]),
        "tau": float(stats.tau()),
        "conditional": stats.conditional().tolist(),
        "cumulative": stats.cumulative().tolist(),
        "scored_slots": stats.slots.long().tolist(),
    }


def bucket_labels(values: np.ndarray, edges: list[int]) -> np.ndarray:
    """'<e0', 'e0-e1', ..., '>=eN' labels of integer values for ascending edges."""
    edges = sorted(edges)
    names = [f"<{edges[0]}"] + [f"{a}-{b - 1}" for a, b in zip(edges, edges[1:])] + [f">={edges[-1]}"]
    return np.array(names, dtype=object)[np.searchsorted(edges, values, side="right")]


def grouped_summary(table: BlockTable, labels: np.ndarray) -> dict[str, dict]:
    """`acceptance_summary` per distinct label, in order of first appearance."""
    out = {}
    for label in dict.fromkeys(labels.tolist()):
        rows = labels == label
        out[str(label)] = acceptance_summary(table.alpha[rows], table.slot_mask[rows])
    return out


def read_sources(data_dir: str | Path) -> dict[int, str]:
    """sample_id -> source name from the tokenized held-out set (`eval.jsonl`), if present."""
    path = Path(data_dir) / "eval.jsonl"
    if not path.is_file():
        return {}
    sources = {}
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                sources[int(row["sample_id"])] = str(row.get("source", "unknown"))
            except (ValueError, KeyError, TypeError) as err:
                raise UserError(f"{path}:{line_no}: not a tokenized sample row ({err})") from err
    return sources


def summarize(table: BlockTable, cfg: OfflineConfig, sources: dict[int, str]) -> dict:
    """The offline section of the report: overall and per bucket / source."""
    order = np.argsort(table.seq_len, kind="stable")
    by_length = grouped_summary(table.select(order), bucket_labels(table.seq_len[order], cfg.length_buckets))
    order = np.argsort(table.anchor_pos, kind="stable")
    by_position = grouped_summary(table.select(order), bucket_labels(table.anchor_pos[order], cfg.position_buckets))
    out = {
        "samples": int(np.unique(table.sample_id).size),
        "overall": acceptance_summary(table.alpha, table.slot_mask),
        "by_length": by_length,
        "by_anchor_position": by_position,
    }
    if sources:
        labels = np.array([sources.get(int(s), "unknown") for s in table.sample_id], dtype=object)
        out["by_source"] = grouped_summary(table, labels)
    return out


__all__ = [
    "BlockTable",
    "acceptance_summary",
    "bucket_labels",
    "check_compatible",
    "drafter_verifier_name",
    "evaluate_blocks",
    "evaluate_store",
    "grouped_summary",
    "held_out_refs",
    "heldout_samples",
    "open_heldout_store",
    "pick_device",
    "read_sources",
    "score_samples",
    "summarize",
]
