"""`python -m extract.data key=value ...` (make data): build the tokenized train/eval sets."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from dspark.config import TargetConfig, load_section
from dspark.entry import stage_main
from dspark.extract.config import ServerConfig
from dspark.extract.data.config import RegenConfig, SourceConfig, TokenizeConfig
from dspark.extract.data.pipeline import build_dataset
from dspark.extract.scale import scale_config


def run(cfg: DictConfig) -> dict:
    """Build the dataset described by a composed `data` config; returns the summary."""
    return build_dataset(
        load_section(TargetConfig, cfg, "target"),
        load_section(SourceConfig, cfg, "data"),
        load_section(RegenConfig, cfg, "regen"),
        load_section(TokenizeConfig, cfg, "tokenize"),
        load_section(ServerConfig, cfg, "server"),
        Path(cfg.paths.data_dir),
        scale_config(cfg),
    )


@stage_main("data")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
