"""`python -m eval.serve drafter=<dir>` (make serve DRAFTER=...): serve the verifier with the drafter.

Checks the drafter against vLLM's loader first (`dspark.servable.check_servable`), then runs
the one vLLM lifecycle (`extract.server.VLLMServer`) in the foreground: the verifier
with `--speculative-config {"method": "dspark", "model": <drafter>}` on 127.0.0.1, until Ctrl-C.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from omegaconf import DictConfig

from dspark.config import Checked, TargetConfig, load_section
from dspark.entry import stage_main
from dspark.errors import UserError
from dspark.extract.config import ServerConfig
from dspark.extract.server import VLLMServer
from dspark.servable import check_servable, read_config
from dspark.targets import dataset_target, resolve_target


@dataclass
class ServeConfig(Checked):
    """The `serve` section of conf/serve.yaml."""

    SECTION: ClassVar[str] = "serve"

    port: int
    """Port on 127.0.0.1 the OpenAI-compatible server listens on."""
    num_speculative_tokens: int | None
    """Draft tokens per step; null = the drafter's block size."""
    adaptive_verification: bool
    """Let vLLM stop a draft early where the confidence head predicts a rejection."""
    run_dir: str
    """Where the server log goes."""

    def __post_init__(self) -> None:
        self.at_least(1, "port")
        self.at_least(1, "num_speculative_tokens", nullable=True)


def speculative_config(drafter: Path, cfg: ServeConfig) -> dict:
    """vLLM's `--speculative-config` for a DSpark drafter directory (a UserError if it is none)."""
    read_config(drafter)
    spec: dict = {"method": "dspark", "model": str(drafter)}
    if cfg.num_speculative_tokens is not None:
        spec["num_speculative_tokens"] = cfg.num_speculative_tokens
    if cfg.adaptive_verification:
        spec["enable_adaptive_verification"] = True
    return spec


@stage_main("serve")
def main(cfg: DictConfig) -> None:
    verifier = resolve_target(load_section(TargetConfig, cfg, "target"), dataset_target(cfg.paths.data_dir))
    target = verifier.config  # every field filled
    server_cfg = load_section(ServerConfig, cfg, "server")
    serve_cfg = load_section(ServeConfig, cfg, "serve")
    spec = speculative_config(Path(cfg.drafter), serve_cfg)
    if not torch.cuda.is_available():
        # vLLM serves DSpark only on its V2 GPU runner; failing here beats a crash deep in the engine.
        raise UserError("make serve: DSpark serving needs a CUDA GPU (vLLM's V2 GPU runner); none found")
    check_servable(Path(cfg.drafter), serve_cfg.num_speculative_tokens, verifier=str(verifier.model_dir))
    server = VLLMServer(
        verifier.model_dir,
        Path(serve_cfg.run_dir),
        extra_args=[*server_cfg.extra_args, "--speculative-config", json.dumps(spec)],
        env=server_cfg.env,
        port=serve_cfg.port,
        ready_timeout_s=server_cfg.ready_timeout_s,
        max_model_len=target.max_model_len,
        dtype=target.dtype,
        stop_timeout_s=server_cfg.stop_timeout_s,
    )
    with server:
        print(
            f"serving {target.name_or_path} with DSpark drafter {cfg.drafter} at {server.url}/v1 "
            f"(log: {server.log_path}); Ctrl-C stops it",
            flush=True,
        )
        while server.is_alive():
            time.sleep(1)
    raise SystemExit(f"vLLM exited; see {server.log_path}")


if __name__ == "__main__":
    main()
