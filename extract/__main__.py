"""`python -m extract key=value ...` (make extract GPUS=N): hidden states of the tokenized splits into shard stores."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from dspark.config import TargetConfig, to_dataclass
from dspark.entry import stage_main
from extract.config import ExtractConfig, ServerConfig
from extract.pipeline import run_extraction
from extract.scale import scale_config


def run(cfg: DictConfig) -> dict:
    """Run the stage for a composed `extract` config; returns the summary."""
    OmegaConf.resolve(cfg)  # sections refer to `paths.*`; to_dataclass sees one section at a time
    return run_extraction(
        to_dataclass(TargetConfig, cfg.target),
        to_dataclass(ExtractConfig, cfg.extract),
        to_dataclass(ServerConfig, cfg.server),
        scale_config(cfg),
    )


@stage_main("extract")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
