"""The data-parallel training loop; an algorithm subclass supplies the objective.

The base class owns everything that is not specific to the draft: the step plan over the
store, background loading, gradient accumulation under DDP, the loss normalizer shared by
all ranks, AdamW with warmup + cosine, clipping, skipping a step whose loss or gradient is
not finite (on every rank alike), checkpoints and exact resume, evaluation cadence (each rank
scores its share of the held-out samples), best-checkpoint tracking (a non-finite metric is
never best) and reporting. The loss normalizer and the handling of a
rank with nothing to score live here, in `train_step`, and nowhere else: the step's loss is
the sum of every micro-batch's weighted loss over all ranks divided by `norm`, the sum of
their `norm_weight`s; a micro-batch with `norm_weight` 0 (or a rank with no data, which runs
`empty_batch()`) still gives every parameter a (zero) gradient, as DDP requires.

A subclass implements (each hook's docstring says what it must return):

- `prepare_batch(batch, *, epoch) -> Batch` (runs in the data workers),
- `empty_batch() -> Batch`,
- `compute_loss(model, batch, norm) -> (loss, logs)`,
- `evaluate(refs) -> dict[str, float]` (must contain `best_metric_name`),
- `export(out_dir, metrics) -> None`.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from omegaconf import OmegaConf
from torch import nn

from dspark.errors import UserError
from dspark.store import SampleRef, ShardStore
from dspark.train.checkpoint import CONFIG_FILE, CheckpointWriter, load_trainable_state, read_checkpoint, restore_rng
from dspark.train.config import TrainConfig
from dspark.train.data import Batch, StepDataset, StoreSplit, TimedLoader
from dspark.train.optim import load_state_by_name, make_optimizer, name_unnamed_groups, warmup_cosine
from dspark.train.reporting import Reporter
from dspark.train.sampler import StepPlanner, share_of_rank, share_of_samples


@dataclass
class LoopState:
    """Where the loop is; saved in every checkpoint (trainer_state.json)."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    best_value: float | None = None
    """Highest `Trainer.best_metric_name` seen so far, at `best_step`."""
    best_step: int | None = None
    train_time_s: float = 0.0
    """Wall time spent in training steps, summed over resumes."""
    evaluated_step: int | None = None
    """Step of the last held-out evaluation (a rerun does not evaluate or log that step again)."""
    last_eval: dict[str, float] = field(default_factory=dict)
    """Metrics of that evaluation (what the export reports)."""
    nonfinite_steps: int = 0
    """Steps skipped because their loss or gradient was not finite (nan/inf), over the whole run."""


class Trainer:
    """Base loop (see the module docstring for what a subclass provides)."""

    best_metric_name = "tau"
    """The held-out metric (higher is better) that picks the `best` checkpoint."""

    def __init__(
        self,
        cfg: TrainConfig,
        accelerator: Accelerator,
        model: nn.Module,
        *,
        train_split: StoreSplit,
        eval_store: ShardStore | None,
        eval_refs: list[SampleRef],
        run_dir: Path,
        config_yaml: str,
        run_files: dict[str, Path],
        resume_from: Path | None,
        lr_scales: dict[str, float] | None = None,
    ):
        self.cfg = cfg
        self.accelerator = accelerator
        self.run_dir = run_dir
        self.config_yaml = config_yaml
        self.run_files = run_files
        self.train_split = train_split
        # The held-out store (None: no evaluation) and the samples every evaluation scores.
        self.eval_store = eval_store
        self.eval_refs = eval_refs
        self.planner = StepPlanner(train_split.lengths, cfg.tokens_per_step, cfg.tokens_per_micro_batch, cfg.seed)
        all_steps = sum(len(self.planner.epoch(e)) for e in range(cfg.epochs))
        self.total_steps = all_steps if cfg.max_steps is None else min(cfg.max_steps, all_steps)

        # On the device before the optimizer exists, so restored optimizer state lands there too.
        model.to(accelerator.device)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.param_names = [n for n, _ in named]
        self.nonfinite_in_a_row = 0
        self.optimizer = make_optimizer(named, cfg, lr_scales)
        warmup = max(1, math.ceil(cfg.warmup_ratio * self.total_steps)) if cfg.warmup_ratio > 0 else 0
        # The schedule is a function of the step and this config alone (nothing of it is restored):
        # a resume that changes lr, warmup or the length follows the new values from its first step.
        self.lr_factor = partial(warmup_cosine, total=self.total_steps, warmup=warmup, min_ratio=cfg.min_lr_ratio)
        self.state = LoopState()
        self.saved_step: int | None = None
        if resume_from is not None:
            self.restore(model, resume_from)
            self.saved_step = self.state.step
        self.raw_model = model
        self.model = accelerator.prepare_model(model)
        self.writer = CheckpointWriter(run_dir, accelerator.process_index, accelerator.wait_for_everyone, cfg.keep_last)
        self.reporter = Reporter(
            run_dir,
            accelerator,
            run_name=cfg.run_name,
            total_steps=self.total_steps,
            start_step=self.state.step,
            resumed=resume_from is not None,
        )
        if resume_from is not None:
            self.reporter.message(f"resuming from {resume_from} at step {self.state.step}")
        else:
            evals = {"samples": len(eval_refs)} if eval_store is not None else {}
            self.reporter.data({"train": train_split.counts, "eval": evals})

    # ----- hooks -----
    def prepare_batch(self, batch: Batch, *, epoch: int) -> Batch:
        """Runs in the data workers on a collated training micro-batch (see `train.data.collate`).

        Returns the batch extended with what `compute_loss` needs, including `norm_weight`: a
        scalar tensor, this micro-batch's share of the step's loss normalizer (0 = nothing to
        score). Must be a pure function of the batch and `epoch` (exact resume).
        """
        raise NotImplementedError

    def empty_batch(self) -> Batch:
        """A prepared batch with `norm_weight` 0, run by a rank that has no data in a step."""
        raise NotImplementedError

    def compute_loss(
        self, model: nn.Module, batch: Batch, norm: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Returns `(loss, logs)`: `loss` (scalar, with grad) = this batch's weighted loss sum / `norm`
        (the step's global normalizer); `logs`: detached scalar sums over the batch, the same keys
        for every batch (added over micro-batches and ranks, then passed to `summarize`)."""
        raise NotImplementedError

    def evaluate(self, refs: list[SampleRef]) -> dict[str, float]:
        """Returns held-out metrics over all ranks, including `best_metric_name`: `refs` are this rank's
        whole samples of `eval_store` (possibly none), the figures are reduced with `reduce_sum`. Every
        rank calls it (model in eval mode, no grad) and gets the same figures."""
        raise NotImplementedError

    def export(self, out_dir: Path, metrics: dict[str, float]) -> None:
        """Writes the deployable model to `out_dir` (rank 0 only); returns nothing."""

    # ----- helpers for subclasses -----
    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def hardware(self) -> str:
        """What the run ran on, for the model card."""
        world = self.accelerator.num_processes
        if self.device.type == "cuda":
            return f"{world} x {torch.cuda.get_device_name(self.device)}"
        return f"{world} x CPU process ({torch.get_num_threads()} threads)"

    def reduce_sum(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sum a dict of tensors over ranks (same keys and shapes on every rank)."""
        keys = sorted(values)
        flat = [values[k].detach().to(self.device, torch.float64).reshape(-1) for k in keys]
        sizes = [t.numel() for t in flat]
        total = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64, device=self.device)
        if self.accelerator.num_processes > 1:
            torch.distributed.all_reduce(total)
        return {k: t.view_as(values[k]) for k, t in zip(keys, total.split(sizes), strict=True)}

    def to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    # ----- the loop -----
    def loader(self, split: StoreSplit, steps: list, *, epoch: int) -> TimedLoader:
        dataset = StepDataset(split, steps, partial(self.prepare_batch, epoch=epoch))
        pin = self.device.type == "cuda"
        return TimedLoader(dataset, self.cfg.data_workers, self.cfg.prefetch_steps, pin_memory=pin)

    def fit(self) -> dict[str, float]:
        """Train to the end of the schedule, evaluate, save, export; returns the last eval metrics."""
        cfg, acc = self.cfg, self.accelerator
        if cfg.eval_on_start and self.eval_store is not None and self.state.step == 0:
            self.state.last_eval = self.run_eval()
        self.model.train()
        while self.state.step < self.total_steps and self.state.epoch < cfg.epochs:
            plan = self.planner.epoch(self.state.epoch)
            mine = [
                share_of_rank(self.planner, step, acc.process_index, acc.num_processes)
                for step in plan[self.state.step_in_epoch :]
            ]
            loader = self.loader(self.train_split, mine, epoch=self.state.epoch)
            start, waited = time.perf_counter(), loader.wait_s
            for micro_batches in loader:
                logs = self.train_step(micro_batches)
                elapsed = time.perf_counter() - start
                self.state.train_time_s += elapsed
                logs.update(tokens_per_s=logs["num_tokens"] / elapsed, data_wait=(loader.wait_s - waited) / elapsed)
                self.state.step += 1
                self.state.step_in_epoch += 1
                logs["epoch"] = self.state.epoch + self.state.step_in_epoch / len(plan)
                self.reporter.train_step(self.state.step, logs, log=self.state.step % cfg.log_every == 0)
                self.evaluate_and_save(final=False)
                if self.state.step >= self.total_steps:
                    break
                start, waited = time.perf_counter(), loader.wait_s
            else:
                self.state.epoch += 1
                self.state.step_in_epoch = 0
        self.evaluate_and_save(final=True)
        if cfg.export and acc.is_main_process:
            self.export(self.run_dir / "drafter", self.state.last_eval)
            self.reporter.message(f"drafter exported to {self.run_dir / 'drafter'}")
        acc.wait_for_everyone()
        self.reporter.close()
        return self.state.last_eval

    def evaluate_and_save(self, *, final: bool) -> None:
        """Evaluate and checkpoint when due (always at the end, unless just done at this step)."""
        step, cfg = self.state.step, self.cfg
        improved = False
        due = cfg.eval_every and step % cfg.eval_every == 0
        if self.eval_store is not None and (due if not final else self.state.evaluated_step != step):
            self.state.last_eval = self.run_eval()
            self.state.evaluated_step = step
            improved = self.track_best(self.state.last_eval)
        if improved or (step % cfg.save_every == 0 if not final else self.saved_step != step):
            self.save(best=improved)
            self.saved_step = step

    def train_step(self, micro_batches: list[Batch]) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches (accumulated, synced once)."""
        acc = self.accelerator
        micro_batches = micro_batches or [self.empty_batch()]
        local_norm = torch.stack([b["norm_weight"].double() for b in micro_batches]).sum()
        norm = self.reduce_sum({"norm": local_norm})["norm"].float()
        sums: dict[str, torch.Tensor] = {}
        local_loss = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            scored = bool(batch["norm_weight"] > 0)
            batch = self.to_device(batch)
            last = i == len(micro_batches) - 1
            # DDP averages gradients over ranks; the loss is already normalized by the
            # global weight sum, so scale by the world size to get the global gradient.
            with nullcontext() if last else acc.no_sync(self.model):
                with acc.autocast():
                    loss, logs = self.compute_loss(self.model, batch, norm)
                if not scored:
                    # Nothing to score here, but DDP's reducer waits for a gradient of every
                    # parameter on every rank: keep them all in the graph, at zero weight.
                    loss = loss + 0.0 * sum(p.sum() for p in self.params)
                acc.backward(loss * acc.num_processes)
            local_loss = local_loss + loss.detach().float()
            logs["num_tokens"] = batch["num_tokens"]
            for k, v in logs.items():
                sums[k] = sums[k] + v.detach() if k in sums else v.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip or math.inf)
        # A nan/inf loss or gradient on any rank skips the step on every rank: the flag is summed
        # over ranks with the logs, so each rank reads the same total and decides the same.
        sums["nonfinite"] = (~torch.isfinite(local_loss) | ~torch.isfinite(grad_norm)).double()
        totals = self.reduce_sum(sums)
        skipped = bool(totals.pop("nonfinite") > 0)
        factor = self.lr_factor(self.state.step)
        if norm > 0 and not skipped:  # a step with nothing to score (every rank empty) leaves the weights alone
            for group in self.optimizer.param_groups:
                group["lr"] = group["initial_lr"] * factor
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.count_nonfinite(skipped)
        out = self.summarize(totals)
        out.update(lr=self.cfg.lr * factor, grad_norm=float(grad_norm), nonfinite_steps=self.state.nonfinite_steps)
        return out

    def count_nonfinite(self, skipped: bool) -> None:
        """Count a skipped step; stop after `train.max_nonfinite_steps` of them in a row."""
        if not skipped:
            self.nonfinite_in_a_row = 0
            return
        self.state.nonfinite_steps += 1
        self.nonfinite_in_a_row += 1
        step, streak = self.state.step + 1, self.nonfinite_in_a_row
        self.reporter.message(f"step {step}: the loss or gradient is not finite; update skipped ({streak} in a row)")
        if streak >= self.cfg.max_nonfinite_steps:
            raise UserError(
                f"steps {step - streak + 1}..{step}: {streak} steps in a row had a non-finite loss or gradient "
                f"(train.max_nonfinite_steps={self.cfg.max_nonfinite_steps}); the run diverged or its data holds "
                "nan/inf. Lower train.lr (or set train.grad_clip), check the stores, then resume from the last "
                "checkpoint"
            )

    def summarize(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Turn the rank-summed train logs into reported figures (override for ratios)."""
        return {k: float(v) for k, v in sums.items()}

    def run_eval(self) -> dict[str, float]:
        """Held-out metrics on the eval store: every sample scored whole on one rank (the same samples
        every time, whatever the number of ranks), in full precision."""
        acc = self.accelerator
        assert self.eval_store is not None
        lengths = [ref.n_tokens for ref in self.eval_refs]
        mine = [self.eval_refs[i] for i in share_of_samples(lengths, acc.process_index, acc.num_processes)]
        self.raw_model.eval()
        with torch.no_grad():
            metrics = self.evaluate(mine)
        self.raw_model.train()
        self.reporter.eval(self.state.step, metrics)
        return metrics

    def track_best(self, metrics: dict[str, float]) -> bool:
        value = metrics[self.best_metric_name]
        if not math.isfinite(value):  # `nan <= best` is false: without this a nan would become best
            self.reporter.message(
                f"step {self.state.step}: held-out {self.best_metric_name} is {value}, never the best"
            )
            return False
        if self.state.best_value is not None and value <= self.state.best_value:
            return False
        self.state.best_value, self.state.best_step = value, self.state.step
        return True

    def plan_identity(self) -> dict:
        """What the sample order depends on: a mid-epoch resume needs all of it unchanged."""
        return {
            "data_fingerprint": self.train_split.fingerprint(),
            "seed": self.cfg.seed,
            "tokens_per_step": self.cfg.tokens_per_step,
            "tokens_per_micro_batch": self.cfg.tokens_per_micro_batch,
        }

    def save(self, *, best: bool) -> None:
        self.writer.save(
            self.state.step,
            model=self.raw_model,
            optimizer=self.optimizer,
            state={**asdict(self.state), "plan": self.plan_identity(), "world_size": self.accelerator.num_processes},
            config_yaml=self.config_yaml,
            files=self.run_files,
            best=best,
        )

    def restore(self, model: nn.Module, path: Path) -> None:
        """Exact resume: weights, each parameter's optimizer state, RNG and loop position from `path`
        (the LR schedule is this config's: see `lr_factor`)."""
        ckpt = read_checkpoint(path, self.accelerator.process_index)
        state = ckpt["state"]
        if state["step_in_epoch"] and state["plan"] != self.plan_identity():
            changed = sorted(k for k in state["plan"] if state["plan"][k] != self.plan_identity()[k])
            raise UserError(
                f"cannot resume {path} mid-epoch: {changed} changed since it was written "
                "(the sample order would differ, repeating or skipping samples); restore them "
                "or warm-start a new run with train.init_from"
            )
        load_trainable_state(model, ckpt["weights"], path)
        saved = ckpt["optimizer"]
        if any("param_names" not in group for group in saved["param_groups"]):
            saved = name_unnamed_groups(saved, self.param_names, OmegaConf.load(path / CONFIG_FILE).train, path)
        load_state_by_name(self.optimizer, saved, path)
        restore_rng(ckpt["rng"])
        self.state = LoopState(**{k: state[k] for k in asdict(LoopState()) if k in state})
