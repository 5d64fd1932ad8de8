"""The DSpark objective plugged into the base loop: anchors, slot targets, loss, acceptance."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from dspark.anchors import sample_anchors, slot_targets, train_anchors
from dspark.config import LossConfig
from dspark.export import export_drafter
from dspark.losses import LossInputs, LossOutput, dspark_loss, term_names, weight_sum
from dspark.metrics import AcceptanceStats
from dspark.model import DSparkDraft
from dspark.verifier import VerifierHead
from dspark.workspace import Workspace
from train.data import Batch
from train.trainer import Trainer


def anchor_seed(seed: int, epoch: int, sample_id: int, train: bool, window_start: int = 0) -> int:
    """Seed of one window's anchors: fixed per (epoch, sample, window), whichever rank or batch it lands in.

    The first (for most samples the only) window keeps the seed of the whole sample.
    """
    entropy = [seed, int(train), epoch, sample_id] + ([window_start] if window_start else [])
    state = np.random.SeedSequence(entropy).generate_state(2, np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1


class DSparkTrainer(Trainer):
    """Trains a `DSparkDraft` against the verifier distributions of the stored final layer."""

    def __init__(
        self,
        *args,
        model: DSparkDraft,
        verifier: VerifierHead,
        loss_cfg: LossConfig,
        verifier_name_or_path: str,
        **kwargs,
    ):
        self.loss_cfg = loss_cfg
        self.block_size = model.block_size
        self.verifier_name_or_path = verifier_name_or_path
        self.workspace = Workspace()  # the loss's vocabulary-sized buffers, reused every step
        super().__init__(*args, model=model, **kwargs)
        self.verifier = verifier
        self.term_names = term_names(loss_cfg, with_confidence=model.confidence_head is not None)

    # ----- data (runs in the loader workers) -----
    def prepare_batch(self, batch: Batch, *, epoch: int, train: bool) -> Batch:
        """Anchors (resampled each epoch, one generator per window) and each slot's targets."""
        num = self.loss_cfg.num_anchors if train else self.cfg.eval_num_anchors
        # Which tokens anchors and scored slots may lie on: the replies' (loss_mask), or in
        # training with loss.train_on_prompt every real token, the prompts' too.
        trained = batch["token_mask"] if train and self.loss_cfg.train_on_prompt else batch["loss_mask"]
        rows = []
        windows = zip(batch["sample_ids"].tolist(), batch["window_starts"].tolist(), strict=True)
        for row, (sample_id, start) in enumerate(windows):
            gen = torch.Generator().manual_seed(anchor_seed(self.cfg.seed, epoch, sample_id, train, start))
            mask = trained[row : row + 1]
            if not train:  # held-out anchors stay uniform: the metric does not move with the lever
                rows.append(sample_anchors(mask, num, gen))
                continue
            rows.append(train_anchors(mask, num, gen, self.loss_cfg.anchor_sampling))
        width = max(a.shape[1] for a, _ in rows)
        anchors = torch.zeros(len(rows), width, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for row, (a, v) in enumerate(rows):
            anchors[row, : a.shape[1]], valid[row, : v.shape[1]] = a[0], v[0]
        labels, target_pos, slot_mask = slot_targets(batch["token_ids"], trained, anchors, valid, self.block_size)
        return {
            **batch,
            "anchors": anchors,
            "anchor_valid": valid,
            "labels": labels,
            "target_pos": target_pos,
            "slot_mask": slot_mask,
            "norm_weight": weight_sum(slot_mask, self.loss_cfg.gamma),
        }

    def empty_batch(self) -> Batch:
        """One two-token row with no loss mask: no anchor is valid, nothing is scored."""
        model: DSparkDraft = self.raw_model
        width = model.fc.in_features
        batch = {
            "token_ids": torch.zeros(1, 2, dtype=torch.long),
            "loss_mask": torch.zeros(1, 2, dtype=torch.bool),
            "token_mask": torch.zeros(1, 2, dtype=torch.bool),
            "context": torch.zeros(1, 2, width, dtype=torch.bfloat16),
            "target_hidden": torch.zeros(1, 2, model.layer_config.hidden_size, dtype=torch.bfloat16),
            "sample_ids": torch.zeros(1, dtype=torch.long),  # any id: nothing to sample from
            "window_starts": torch.zeros(1, dtype=torch.long),
            "num_tokens": torch.zeros((), dtype=torch.long),
        }
        return self.prepare_batch(batch, epoch=0, train=True)

    # ----- objective -----
    def blocks(self, model: nn.Module, batch: Batch, norm) -> LossOutput:
        """Run the draft on the batch's anchors and score the valid blocks."""
        draft: DSparkDraft = self.raw_model
        hidden = model(batch["context"], batch["token_ids"], batch["anchors"], batch["anchor_valid"])
        valid = batch["anchor_valid"]
        b, a, k = batch["target_pos"].shape
        pos = batch["target_pos"].reshape(b, a * k, 1).expand(-1, -1, batch["target_hidden"].shape[-1])
        target_hidden = batch["target_hidden"].gather(1, pos).view(b, a, k, -1)[valid]
        inputs = LossInputs(
            heads_fn=draft.heads,
            target_logits_fn=self.verifier.logits,
            hidden=hidden[valid],
            prev=draft.block_tokens(batch["token_ids"], batch["anchors"])[valid],
            target_hidden=target_hidden.to(self.verifier.lm_head_weight.dtype),
            labels=batch["labels"][valid],
            slot_mask=batch["slot_mask"][valid],
            norm=norm,
            with_confidence=draft.confidence_head is not None,
            d2t=draft.d2t,
            target_norm_fn=self.verifier.norm,
        )
        return dspark_loss(inputs, self.loss_cfg, workspace=self.workspace)

    def compute_loss(
        self, model: nn.Module, batch: Batch, norm: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = self.blocks(model, batch, norm)
        logs = {"loss": out.loss.detach(), **{t: out.terms[t] for t in self.term_names}}
        logs.update(
            accept_sum=out.acceptance.alpha_sum.sum(),
            accept_prefix_sum=out.acceptance.prefix_sum.sum(),
            accept_slots=out.acceptance.slots.sum(),
            accept_blocks=out.acceptance.slots[0],
        )
        return out.loss, logs

    def summarize(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        out = {k: float(v) for k, v in sums.items() if not k.startswith("accept_")}
        out["acceptance"] = float(sums["accept_sum"] / sums["accept_slots"].clamp_min(1))
        out["tau"] = float(1 + sums["accept_prefix_sum"] / sums["accept_blocks"].clamp_min(1))
        return out

    def evaluate(self, batches: Iterable[Batch]) -> dict[str, float]:
        """Per-position acceptance and τ on held-out data (honest: full-vocabulary target)."""
        zeros = torch.zeros(self.block_size, dtype=torch.float64)
        stats = AcceptanceStats(zeros.clone(), zeros.clone(), zeros.clone())
        sums = {t: torch.zeros((), dtype=torch.float64) for t in self.term_names}
        sums["weight"] = torch.zeros((), dtype=torch.float64)
        for batch in batches:
            out = self.blocks(self.raw_model, batch, 1.0)  # norm 1: raw weighted sums
            got = out.acceptance
            stats = stats + AcceptanceStats(got.alpha_sum.cpu(), got.prefix_sum.cpu(), got.slots.cpu())
            for t in self.term_names:
                sums[t] += out.terms[t].double().cpu()
            sums["weight"] += float(batch["norm_weight"])
        total = self.reduce_sum({"alpha": stats.alpha_sum, "prefix": stats.prefix_sum, "slots": stats.slots, **sums})
        stats = AcceptanceStats(total["alpha"].cpu(), total["prefix"].cpu(), total["slots"].cpu())
        if float(stats.slots[0]) == 0:
            raise ValueError(f"{self.cfg.eval_store}: no held-out sample has a trainable position to score")
        metrics = {"tau": float(stats.tau())}
        metrics.update({f"alpha_{k}": float(v) for k, v in enumerate(stats.conditional())})
        metrics.update({f"accept_{k}": float(v) for k, v in enumerate(stats.cumulative())})
        weight = float(total["weight"])
        metrics.update({t: float(total[t]) / weight for t in self.term_names})
        metrics["blocks"] = float(stats.slots[0])
        return metrics

    def export(self, out_dir, metrics: dict[str, float]) -> None:
        meta = {
            "step": self.state.step,
            "best_step": self.state.best_step,
            "world_size": self.accelerator.num_processes,
            "train_time_s": round(self.state.train_time_s, 1),
            "hardware": self.hardware(),
            "eval": metrics,
        }
        export_drafter(self.raw_model, out_dir, self.verifier_name_or_path, extra_meta=meta)


__all__ = ["DSparkTrainer", "anchor_seed"]
