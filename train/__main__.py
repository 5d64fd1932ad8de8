"""Pass 2: `torchrun --standalone --nproc_per_node N -m train key=value ...` (make train GPUS=N).

Every process runs this; accelerate picks up torchrun's environment (NCCL on GPUs, gloo
on CPU) and DDP-wraps the draft. Without CUDA the same command runs N CPU processes.
"""

from __future__ import annotations

import os

import torch
from omegaconf import DictConfig

from dspark.entry import stage_main
from train.build import build_trainer, check_devices, config_section, make_accelerator
from train.config import TrainConfig


def run(cfg: DictConfig) -> dict[str, float]:
    """Train as configured; returns the final held-out metrics."""
    train_cfg = config_section(TrainConfig, cfg, "train")
    check_devices(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count())
    accelerator = make_accelerator(train_cfg)
    try:
        return build_trainer(cfg, accelerator).fit()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@stage_main("train")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
