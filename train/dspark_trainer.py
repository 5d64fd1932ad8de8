"""The DSpark objective plugged into the base loop: anchors, slot targets, loss, acceptance."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dspark.anchors import slot_targets, train_anchors
from dspark.config import HeldoutConfig, LossConfig
from dspark.errors import UserError
from dspark.eval.offline import heldout_samples, score_samples
from dspark.export import export_drafter
from dspark.losses import LossInputs, LossOutput, dspark_loss, term_names, weight_sum
from dspark.metrics import AcceptanceStats
from dspark.model import DSparkDraft
from dspark.store import SampleRef
from dspark.train.data import Batch
from dspark.train.trainer import Trainer
from dspark.verifier import VerifierHead
from dspark.workspace import Workspace


def anchor_seed(seed: int, epoch: int, sample_id: int, window_start: int = 0) -> int:
    """Seed of one training window's anchors: fixed per (epoch, sample, window), whichever rank or batch
    it lands in (held-out anchors are the `heldout` protocol's, drawn by `eval.offline`).

    The first (for most samples the only) window keeps the seed of the whole sample. The 1 tags the
    training stream; it stays, so that a run resumed from an existing checkpoint draws the same anchors.
    """
    entropy = [seed, 1, epoch, sample_id] + ([window_start] if window_start else [])
    state = np.random.SeedSequence(entropy).generate_state(2, np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1


class DSparkTrainer(Trainer):
    """Trains a `DSparkDraft` against the verifier distributions of the stored final layer; its held-out
    figures are `make eval`'s (`eval.offline`'s scorer under the `heldout` protocol)."""

    def __init__(
        self,
        *args,
        model: DSparkDraft,
        verifier: VerifierHead,
        loss_cfg: LossConfig,
        heldout: HeldoutConfig,
        verifier_name_or_path: str,
        **kwargs,
    ):
        self.loss_cfg = loss_cfg
        self.heldout = heldout
        self.block_size = model.block_size
        self.verifier_name_or_path = verifier_name_or_path
        self.workspace = Workspace()  # the loss's vocabulary-sized buffers, reused every step
        super().__init__(*args, model=model, **kwargs)
        self.verifier = verifier
        self.term_names = term_names(loss_cfg, with_confidence=model.confidence_head is not None)

    # ----- data (runs in the loader workers) -----
    def prepare_batch(self, batch: Batch, *, epoch: int) -> Batch:
        """Anchors (resampled each epoch, one generator per window) and each slot's targets."""
        # Which tokens anchors and scored slots may lie on: the replies' (loss_mask), or with
        # loss.train_on_prompt every real token, the prompts' too.
        trained = batch["token_mask"] if self.loss_cfg.train_on_prompt else batch["loss_mask"]
        rows = []
        windows = zip(batch["sample_ids"].tolist(), batch["window_starts"].tolist(), strict=True)
        for row, (sample_id, start) in enumerate(windows):
            gen = torch.Generator().manual_seed(anchor_seed(self.cfg.seed, epoch, sample_id, start))
            mask = trained[row : row + 1]
            rows.append(train_anchors(mask, self.loss_cfg.num_anchors, gen, self.loss_cfg.anchor_sampling))
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
        return self.prepare_batch(batch, epoch=0)

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

    def evaluate(self, refs: list[SampleRef]) -> dict[str, float]:
        """Per-position acceptance and τ on held-out data (honest: full-vocabulary target), by `make eval`'s
        scorer: whole samples at the `heldout` protocol's anchors, this rank's `refs`, summed over ranks."""
        draft: DSparkDraft = self.raw_model
        samples = heldout_samples(self.eval_store, refs, draft.aux_layer_ids, progress=False)  # beside the train bar
        table = score_samples(draft, self.verifier, samples, self.heldout, self.device)
        zeros = torch.zeros(self.block_size, dtype=torch.float64)
        stats = AcceptanceStats(zeros, zeros, zeros)  # a rank with no sample (or no block) adds nothing
        if table is not None:
            stats = AcceptanceStats.from_alpha(torch.from_numpy(table.alpha), torch.from_numpy(table.slot_mask))
        total = self.reduce_sum({"alpha": stats.alpha_sum, "prefix": stats.prefix_sum, "slots": stats.slots})
        stats = AcceptanceStats(total["alpha"].cpu(), total["prefix"].cpu(), total["slots"].cpu())
        if float(stats.slots[0]) == 0:
            raise UserError(
                f"train.eval_store={self.cfg.eval_store}: no held-out sample has a block to score (every sample's "
                "loss mask is empty, or its reply is shorter than the heldout protocol's anchors need); give an "
                "eval store of conversations with replies, or train.eval_store=null to train without held-out eval"
            )
        metrics = {"tau": float(stats.tau())}
        metrics.update({f"alpha_{k}": float(v) for k, v in enumerate(stats.conditional())})
        metrics.update({f"accept_{k}": float(v) for k, v in enumerate(stats.cumulative())})
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
