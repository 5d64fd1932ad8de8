"""Initialising the draft from the verifier instead of at random.

The draft's decoder layers have the verifier's width (see `draft_layer_config`), so draft
layer j can start as a copy of verifier decoder layer `layers[j]`: its attention
projections, q/k norms, MLP and both layer norms, read by name from the verifier's
safetensors files (only those tensors are read). `fc` can start as a selection of the last
aux layer (`[0 … 0 | I]`), so the context injected into every draft layer starts as the
(normed) residual stream the verifier had at that layer, and the draft's final norm can start
as the verifier's, the one its (shared) lm_head was trained behind.

Verifiers without q/k norms (llama, mistral, qwen2) leave the draft's at their init (ones).
A verifier with q/k/v biases (qwen2) gives the draft attention biases (`draft_layer_config`):
they are copied, and the o_proj bias it lacks stays at its init (zeros).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from dspark.errors import UserError
from dspark.model import DSparkDraft
from dspark.verifier import _find, _weight_map

OPTIONAL = ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.o_proj.bias")


def resolve_layers(layers: list[int], num_verifier_layers: int, num_draft_layers: int) -> list[int]:
    """Verifier layer index per draft layer (negative ids count from the end, as in Python)."""
    if len(layers) != num_draft_layers:
        raise UserError(
            f"train.init_layers_from_verifier has {len(layers)} layer ids; the draft has "
            f"model.num_layers={num_draft_layers}: give one verifier layer per draft layer"
        )
    out = [i + num_verifier_layers if i < 0 else i for i in layers]
    bad = [i for i, j in zip(layers, out) if not 0 <= j < num_verifier_layers]
    if bad:
        raise UserError(
            f"train.init_layers_from_verifier: {bad} outside the verifier's "
            f"{num_verifier_layers} layers (use 0..{num_verifier_layers - 1} or -1..-{num_verifier_layers})"
        )
    return out


def layer_tensor_names(model: DSparkDraft, weight_map: dict, layers: list[int]) -> dict[str, str]:
    """Draft state-dict name -> verifier tensor name, for every tensor the copy replaces."""
    names = {}
    suffixes = list(model.layers[0].state_dict())
    for j, i in enumerate(layers):
        own = re.compile(rf"(?:^|\.)layers\.{i}\.(.+)$")
        extra = sorted({m.group(1) for m in map(own.search, weight_map) if m} - set(suffixes))
        if extra:
            raise UserError(
                f"verifier layer {i} has tensors the draft layer lacks ({extra}): "
                "train.init_layers_from_verifier cannot copy it; use null (random init)"
            )
        for suffix in suffixes:
            found = _find(weight_map, f"layers.{i}.{suffix}")
            if found is None and suffix not in OPTIONAL:
                raise UserError(f"verifier has no `layers.{i}.{suffix}` tensor to initialise draft layer {j} from")
            if found is not None:
                names[f"layers.{j}.{suffix}"] = found
    return names


def copyable_last_layers(model: DSparkDraft, target_dir: str | Path) -> tuple[list[int] | None, str]:
    """The verifier's last `len(model.layers)` layer ids when every one can be copied, else None;
    and a line saying which (for the run's log)."""
    num_verifier = int(AutoConfig.from_pretrained(target_dir).get_text_config().num_hidden_layers)
    layers = list(range(-len(model.layers), 0))
    try:
        layer_tensor_names(
            model, _weight_map(Path(target_dir)), resolve_layers(layers, num_verifier, len(model.layers))
        )
    except UserError as err:
        return None, f"init: draft layers random (the verifier's last layers cannot be copied: {err})"
    first = num_verifier + layers[0]
    return layers, f"init: draft layers start as verifier layers {first}..{num_verifier - 1}"


@torch.no_grad()
def init_from_verifier(
    model: DSparkDraft, target_dir: str | Path, layers: list[int] | None, fc_from_last_aux: bool, norm: bool = False
) -> dict[str, str]:
    """Copy verifier decoder layers into the draft's layers, set `fc` to select the last aux
    layer and/or copy the verifier's final norm into the draft's. Returns the draft -> verifier
    tensor names copied."""
    copied: dict[str, str] = {}
    weight_map = _weight_map(Path(target_dir)) if layers is not None or norm else {}
    if norm:  # VerifierHead.from_pretrained has already refused a verifier without one
        copied["norm.weight"] = _find(weight_map, "norm.weight")
    if layers is not None:
        num_verifier = int(AutoConfig.from_pretrained(target_dir).get_text_config().num_hidden_layers)
        copied.update(layer_tensor_names(model, weight_map, resolve_layers(layers, num_verifier, len(model.layers))))
    params = dict(model.named_parameters())
    by_file = defaultdict(list)
    for ours, theirs in copied.items():
        by_file[weight_map[theirs]].append((ours, theirs))
    for file, pairs in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for ours, theirs in pairs:
                value = f.get_tensor(theirs)
                if value.shape != params[ours].shape:
                    raise UserError(
                        f"verifier tensor {theirs} is {tuple(value.shape)}, draft {ours} is {tuple(params[ours].shape)}"
                    )
                params[ours].copy_(value.to(params[ours].dtype))
    if fc_from_last_aux:
        hidden = model.layer_config.hidden_size
        model.fc.weight.zero_()
        model.fc.weight[:, -hidden:] = torch.eye(hidden, dtype=model.fc.weight.dtype)
    return copied


__all__ = ["copyable_last_layers", "init_from_verifier", "resolve_layers"]
