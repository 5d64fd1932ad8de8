"""`make serve`: the speculative config it hands vLLM, and its refusal without CUDA."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark.errors import UserError
from dspark.eval.serve import ServeConfig, speculative_config


def _cfg(**kw) -> ServeConfig:
    base = dict(port=8000, num_speculative_tokens=None, adaptive_verification=False, run_dir="x")
    return ServeConfig(**{**base, **kw})


def fake_drafter(path: Path, config: dict) -> None:
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").touch()


def test_speculative_config(tmp_path):
    fake_drafter(tmp_path, {})
    assert speculative_config(tmp_path, _cfg()) == {"method": "dspark", "model": str(tmp_path)}
    spec = speculative_config(tmp_path, _cfg(num_speculative_tokens=3, adaptive_verification=True))
    assert spec["num_speculative_tokens"] == 3 and spec["enable_adaptive_verification"] is True


def test_bad_input(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        speculative_config(tmp_path, _cfg())
    fake_drafter(tmp_path, {})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        speculative_config(tmp_path, _cfg(num_speculative_tokens=0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
def test_refuses_without_cuda(tmp_path):
    fake_drafter(tmp_path, {"speculators_model_type": "dspark"})
    proc = subprocess.run(
        [sys.executable, "-m", "eval.serve", f"drafter={tmp_path}"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
        timeout=300,
    )
    assert proc.returncode != 0
    assert proc.returncode == 2 and "error: make serve: DSpark serving needs a CUDA GPU" in proc.stderr
