"""What the draft needs from the verifier: layer ids, the mask token, and its frozen head.

Training never loads the verifier's decoder layers. `VerifierHead` reads only the
embedding, the final norm and the lm_head from the safetensors files, so pass 2 can turn
stored final hidden states into target distributions without the verifier's weight bulk.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F
from transformers import AutoConfig, PretrainedConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from dspark.vocab_matmul import project_into
from dspark.workspace import Workspace

# Decoder families whose final norm is the plain `x_norm * w` RMSNorm and whose layers
# the Qwen3-style draft can be sized from. Gemma-style `(1 + w)` norms are deliberately
# absent: their frozen final norm would silently mis-scale every target distribution.
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")


def require_field(hf_config: PretrainedConfig, field: str):
    """The value of `field` in the verifier config, or a clear error naming it."""
    value = getattr(hf_config, field, None)
    if value is None:
        raise ValueError(
            f"verifier config ({getattr(hf_config, 'model_type', '?')}) has no `{field}`; the draft is sized from it"
        )
    return value


def check_model_type(hf_config: PretrainedConfig) -> str:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"verifier config `model_type` is {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def resolve_aux_layer_ids(hf_config: PretrainedConfig, aux_layer_ids: list[int] | None) -> list[int]:
    """Aux layer ids in vLLM's convention (id k = residual stream entering layer k).

    None picks Qwen3-0.6B's spacing `[2, N//2, N-3]` (`[2, 14, 25]` for 28 layers) when the
    verifier is deep enough for three distinct ids, else the first layers `1..min(3, N-1)`.
    The final layer (id N) is never an aux layer: the store keeps it separately as the target.
    """
    num_layers = int(require_field(hf_config, "num_hidden_layers"))
    if aux_layer_ids is None:
        if num_layers >= 7:
            return [2, num_layers // 2, num_layers - 3]
        if num_layers < 2:
            raise ValueError(f"verifier has {num_layers} layer(s): no layer is left for `aux_layer_ids`")
        return list(range(1, min(3, num_layers - 1) + 1))
    ids = list(aux_layer_ids)
    if not ids:
        raise ValueError("`aux_layer_ids` is empty; give at least one layer id or null")
    if any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
        raise ValueError(f"`aux_layer_ids` must be integers, got {ids}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"`aux_layer_ids` {ids}: {bad} outside [0, {num_layers - 1}] for a verifier with "
            f"{num_layers} layers (id {num_layers}, the final layer, is stored separately)"
        )
    if any(a >= b for a, b in zip(ids, ids[1:])):
        raise ValueError(f"`aux_layer_ids` {ids} must be strictly increasing (sorted, unique)")
    return ids


def resolve_mask_token_id(hf_config: PretrainedConfig, tokenizer_len: int, mask_token_id: int | None) -> int:
    """The embedding row fed to the draft's mask slots (never learned).

    None picks the first row past the tokenizer (Qwen3: 151669), which exists only when the
    embedding matrix is padded beyond the tokenizer.
    """
    vocab_size = int(require_field(hf_config, "vocab_size"))
    if mask_token_id is None:
        if vocab_size > tokenizer_len:
            return int(tokenizer_len)
        raise ValueError(
            f"the verifier's embedding has {vocab_size} rows and its tokenizer {tokenizer_len} "
            f"tokens: no unused row is left for a mask token; set target.mask_token_id "
            f"to a token id the data never contains"
        )
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"`mask_token_id` {mask_token_id} is outside the verifier's embedding [0, {vocab_size})")
    return int(mask_token_id)


def _weight_map(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, for single-file and sharded checkpoints."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _find(weight_map: dict[str, Path], suffix: str) -> str | None:
    """The shortest tensor name equal to `suffix` or ending in `.suffix` (prefix-agnostic:
    `model.norm.weight`, `language_model.model.norm.weight`, ...)."""
    matches = [n for n in weight_map if n == suffix or n.endswith("." + suffix)]
    return min(matches, key=len) if matches else None


def _read(weight_map: dict[str, Path], name: str, dtype: torch.dtype) -> torch.Tensor:
    with safe_open(str(weight_map[name]), framework="pt") as f:
        return f.get_tensor(name).to(dtype)


class VerifierHead(nn.Module):
    """The verifier's frozen embedding, final norm and lm_head (nothing else)."""

    def __init__(
        self,
        config: PretrainedConfig,
        embed_weight: torch.Tensor,
        norm_weight: torch.Tensor,
        lm_head_weight: torch.Tensor | None,
    ):
        super().__init__()
        check_model_type(config)
        self.config = config
        vocab_size, hidden_size = embed_weight.shape
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, _weight=embed_weight, _freeze=True)
        self.norm = Qwen3RMSNorm(hidden_size, eps=float(getattr(config, "rms_norm_eps", 1e-6)))
        self.norm.weight = nn.Parameter(norm_weight, requires_grad=False)
        # Tied checkpoints share one matrix; keep it shared here too (no second copy).
        self.lm_head_weight = (
            self.embed_tokens.weight if lm_head_weight is None else nn.Parameter(lm_head_weight, requires_grad=False)
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> VerifierHead:
        model_dir = Path(model_dir)
        config = AutoConfig.from_pretrained(model_dir).get_text_config()  # as dspark.targets reads it
        check_model_type(config)
        weight_map = _weight_map(model_dir)
        names = {key: _find(weight_map, key) for key in ("embed_tokens.weight", "norm.weight", "lm_head.weight")}
        for key in ("embed_tokens.weight", "norm.weight"):
            if names[key] is None:
                raise ValueError(f"{model_dir}: no `{key}` tensor in the safetensors files")
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if names["lm_head.weight"] is None and not tied:
            raise ValueError(f"{model_dir}: no `lm_head.weight` tensor and `tie_word_embeddings` is false")
        embed = _read(weight_map, names["embed_tokens.weight"], dtype)
        norm = _read(weight_map, names["norm.weight"], dtype)
        lm_head = None if tied or names["lm_head.weight"] is None else _read(weight_map, names["lm_head.weight"], dtype)
        return cls(config, embed, norm, lm_head)

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.num_embeddings

    @property
    def hidden_size(self) -> int:
        return self.embed_tokens.embedding_dim

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def logits(self, h_prenorm: torch.Tensor, workspace: Workspace | None = None) -> torch.Tensor:
        """Full-vocabulary verifier logits [..., V] from pre-norm final-layer hidden states [..., H].

        With a workspace (and no autograd or autocast to serve) they are written into its
        `target_logits` buffer: a constant target the loss consumes in place.
        """
        x = self.norm(h_prenorm)
        if workspace is None or torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type):
            return F.linear(x, self.lm_head_weight)
        w = self.lm_head_weight.to(x.dtype)
        out = workspace.take("target_logits", (*x.shape[:-1], w.shape[0]), x.dtype, x.device)
        project_into(x.reshape(-1, x.shape[-1]), w, out.view(-1, w.shape[0]))
        return out


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "VerifierHead",
    "check_model_type",
    "require_field",
    "resolve_aux_layer_ids",
    "resolve_mask_token_id",
]
