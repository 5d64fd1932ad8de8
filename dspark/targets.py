"""The verifier ("target"): where it lives on disk, and its identity as every pass sees it.

`resolve_target(TargetConfig)` gives a `Target`: the resolved directory, the text config,
hidden size, layers, aux layer ids, mask token id, tokenizer hash, and every null config
field derived from the verifier itself (`target=auto`); `store_attrs()` is what a shard
store records of it and `check_store(attrs)` refuses a store made for another one.

Where a verifier lives on disk (embedded, local, hub) is `dspark.target_dirs`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from dspark.config import TargetConfig
from dspark.errors import UserError
from dspark.target_dirs import EMBEDDED_PREFIX, cache_dir, embedded_gguf, resolve_target_dir, tokenizer_sha256

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
        """An embedding row the data never holds: past the tokenizer, else an idle special token, else pad."""
        rows, tokens = int(self._need("vocab_size", "mask_token_id")), len(self.tokenizer)
        if rows > tokens:
            return tokens, f"derived: first unused embedding row (the tokenizer has {tokens} of {rows} rows)"
        idle = self.idle_special_token(rows)
        if idle is not None:
            name = self.tokenizer.convert_ids_to_tokens(idle)
            return idle, f"derived: {name!r}, the last special token that chats never use (no unused embedding row)"
        pad = self.tokenizer.pad_token_id
        if pad is None:
            raise UserError(
                f"target.mask_token_id: the tokenizer of {self.model_dir} fills all {rows} embedding "
                "rows and has no idle special token or pad token; set target.mask_token_id to a token "
                "id the data never has"
            )
        return int(pad), f"derived: the pad token {self.tokenizer.pad_token!r} (no unused row or idle special token)"

    def idle_special_token(self, rows: int) -> int | None:
        """The highest added special token that is no bos/eos/pad/unk and that the chat template
        does not render (e.g. SmolLM2's `<empty_output>`, Llama 3's reserved tokens): the data
        stage never writes it, so its embedding can mark the draft's mask slots."""
        tok = self.tokenizer
        used = set(tok.all_special_ids)
        chat = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
        ]
        for messages in (chat, chat[1:]):  # some templates refuse a system turn
            try:
                rendered = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
            except Exception:  # any template error (no template, a refused role): next form, else the ids alone
                continue
            used.update(int(i) for i in rendered)
            break
        idle = [i for i, t in tok.added_tokens_decoder.items() if t.special and i < rows and i not in used]
        return max(idle) if idle else None

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
    "EMBEDDED_PREFIX",
    "Target",
    "cache_dir",
    "check_store_name",
    "dataset_target",
    "embedded_gguf",
    "resolve_target",
    "resolve_target_dir",
    "tokenizer_sha256",
]
