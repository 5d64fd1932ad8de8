"""`python -m extract.data key=value ...` (make data): build the tokenized train/eval sets."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from dspark.config import TargetConfig, to_dataclass
from dspark.entry import stage_main
from extract.config import ServerConfig
from extract.data.config import RegenConfig, SourceConfig, TokenizeConfig
from extract.data.pipeline import build_dataset
from extract.scale import scale_config


def run(cfg: DictConfig) -> dict:
    """Build the dataset described by a composed `data` config; returns the summary."""
    return build_dataset(
        to_dataclass(TargetConfig, cfg.target),
        to_dataclass(SourceConfig, cfg.data),
        to_dataclass(RegenConfig, cfg.regen),
        to_dataclass(TokenizeConfig, cfg.tokenize),
        to_dataclass(ServerConfig, cfg.server),
        Path(cfg.paths.data_dir),
        scale_config(cfg),
    )


@stage_main("data")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
