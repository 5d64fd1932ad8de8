"""Pass 2: `torchrun --standalone --nproc_per_node N -m train key=value ...` (make train GPUS=N).

Every process runs this; accelerate picks up torchrun's environment (NCCL on GPUs, gloo
on CPU) and DDP-wraps the draft. Without CUDA the same command runs N CPU processes.
Under torchrun every rank dies with its launcher (parent-death signal), and a rank whose
peer died or hung fails after `train.collective_timeout_s` instead of waiting forever. One run at a
time holds its `train.run_dir` (`dspark.run_lock`).
"""

from __future__ import annotations

import os
import signal
import traceback
from pathlib import Path

import torch
from omegaconf import DictConfig

from dspark.entry import stage_main
from dspark.lifetime import die_with_parent
from dspark.run_lock import holding_run_dir
from dspark.train.build import build_trainer, check_devices, make_accelerator
from dspark.train.config import load_sections

DDP_FILE = os.path.join("torch", "nn", "parallel", "distributed.py")


def from_a_collective(err: RuntimeError) -> bool:
    """Whether `err` is a collective's failure: NCCL raises DistError subclasses; gloo a RuntimeError that
    names its source file, or one that does not ("Application timeout caused pair closure") raised by the
    collective call itself, the innermost frame (DDP's buffer sync, a torch.distributed op)."""
    if isinstance(err, torch.distributed.DistError) or "gloo" in str(err):
        return True
    frames = traceback.extract_tb(err.__traceback__)
    raised_in = frames[-1].filename if frames else ""
    return f"{os.sep}torch{os.sep}distributed{os.sep}" in raised_in or raised_in.endswith(DDP_FILE)


def run(cfg: DictConfig) -> dict[str, float]:
    """Train as configured; returns the final held-out metrics."""
    train_cfg = load_sections(cfg).train  # every section checked before the run dir is touched
    check_devices(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count())
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank of torchrun: a killed launcher takes it along
        die_with_parent(signal.SIGKILL)
    accelerator = make_accelerator(train_cfg)
    try:
        with holding_run_dir(Path(train_cfg.run_dir), accelerator):
            return build_trainer(cfg, accelerator).fit()
    except RuntimeError as err:
        if not from_a_collective(err):
            raise
        raise RuntimeError(
            f"rank {accelerator.process_index}: a collective with the other ranks failed or waited longer than "
            f"train.collective_timeout_s={train_cfg.collective_timeout_s:g}s (a peer rank died, hung or was "
            f"stopped; see its output above): {err}"
        ) from err
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@stage_main("train")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
