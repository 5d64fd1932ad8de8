"""`python -m extract key=value ...` (make extract GPUS=N): hidden states of the tokenized splits into shard stores."""

from __future__ import annotations

from omegaconf import DictConfig

from dspark.config import TargetConfig, load_section
from dspark.entry import stage_main
from dspark.extract.config import ExtractConfig, ServerConfig
from dspark.extract.pipeline import run_extraction
from dspark.extract.plan import before_extraction
from dspark.extract.scale import scale_config


def run(cfg: DictConfig) -> dict:
    """Run the stage for a composed `extract` config; returns the summary ({} for a dry run)."""
    if before_extraction(cfg):
        return {}
    return run_extraction(
        load_section(TargetConfig, cfg, "target"),
        load_section(ExtractConfig, cfg, "extract"),
        load_section(ServerConfig, cfg, "server"),
        scale_config(cfg),
    )


@stage_main("extract")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
