"""`make serve`: the speculative config it hands vLLM, and its refusal without CUDA."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eval.serve import ServeConfig, speculative_config


def _cfg(**kw) -> ServeConfig:
    base = dict(port=8000, num_speculative_tokens=None, adaptive_verification=False, run_dir="x")
    return ServeConfig(**{**base, **kw})


def test_speculative_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert speculative_config(tmp_path, _cfg()) == {"method": "dspark", "model": str(tmp_path)}
    spec = speculative_config(tmp_path, _cfg(num_speculative_tokens=3, adaptive_verification=True))
    assert spec["num_speculative_tokens"] == 3 and spec["enable_adaptive_verification"] is True


def test_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        speculative_config(tmp_path, _cfg())
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        speculative_config(tmp_path, _cfg(num_speculative_tokens=0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
def test_refuses_without_cuda(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": "dspark"}))
    proc = subprocess.run(
        [sys.executable, "-m", "eval.serve", f"drafter={tmp_path}"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
        timeout=300,
    )
    assert proc.returncode != 0
    assert "needs a CUDA GPU" in proc.stderr
