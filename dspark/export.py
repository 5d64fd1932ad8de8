"""Drafter checkpoints in the speculators format (what `vllm serve <drafter>` reads).

`config.json` is written by speculators' own `DSparkSpeculatorConfig`, so field names and
defaults are the library's; the fields whose absence vLLM reads as something else
(`sample_from_anchor`, `confidence_head_with_markov`, ...) are always written out.
`model.safetensors` holds the trainable tensors under speculators' names, plus the
draft-vocabulary `lm_head` rows and the `d2t`/`t2d` maps when the vocabulary is reduced;
the verifier's embedding and full lm_head are reloaded from the verifier.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark.atomic_dir import recover_dir, replace_dir, staging_dir
from dspark.config import DraftConfig
from dspark.errors import UserError
from dspark.model import DSparkDraft
from dspark.servable import CONFIG_FILE, WEIGHTS_FILE, servable_problems, static_problems
from dspark.verifier import VerifierHead

META_FILE = "dspark_meta.json"


def speculators_config(model: DSparkDraft, verifier_name_or_path: str):
    """The drafter's `DSparkSpeculatorConfig` (speculators' schema and validation)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark import DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    cfg = model.cfg
    return DSparkSpeculatorConfig(
        transformer_layer_config=model.layer_config,
        draft_vocab_size=model.draft_vocab_size,
        block_size=cfg.block_size,
        target_hidden_size=model.layer_config.hidden_size,
        aux_hidden_state_layer_ids=model.aux_layer_ids,
        mask_token_id=model.mask_token_id,
        # speculators: full-attention layers are always bidirectional in block; sliding
        # layers follow this flag. vLLM reads `transformer_layer_config.is_causal`.
        sliding_window_non_causal=not cfg.causal_in_block,
        # Slot k predicts token p+k+1: all B slots are drafted tokens.
        sample_from_anchor=True,
        markov_rank=cfg.markov_rank,
        markov_head_type=cfg.markov_type,
        enable_confidence_head=cfg.confidence_head,
        confidence_head_with_markov=cfg.confidence_head_with_markov,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=cfg.block_size)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier_name_or_path, architectures=model.verifier_architectures),
        ),
    )


def drafter_tensors(model: DSparkDraft) -> dict[str, torch.Tensor]:
    """The tensors a drafter checkpoint holds (speculators' names)."""
    if model.d2t is not None and not model.verifier_loaded:
        raise RuntimeError(
            "a reduced-vocabulary draft needs load_verifier(...) before export "
            "(its lm_head rows come from the verifier)"
        )
    skip = model.verifier_owned() | model.training_only()
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items() if name not in skip}
    if model.markov_head is not None:  # the training-time projection folded in (a no-op without it)
        tensors["markov_head.markov_w1.weight"] = model.folded_markov_w1().detach().contiguous()
    return tensors


def export_drafter(
    model: DSparkDraft,
    out_dir,
    verifier_name_or_path: str,
    extra_meta: dict | None = None,
    vllm_check: bool = True,
) -> Path:
    """Write a speculators-format drafter directory, checked against vLLM's loader, and swap it in whole.

    The new directory is written and checked beside `out_dir` and replaces it atomically
    (`dspark.atomic_dir`): a kill at any moment leaves the old drafter or the new one. A
    check that finds the files broken (vLLM would refuse or misread them) is a UserError
    and the old drafter stays; one that finds them valid but not servable by vLLM (a
    gated or rnn Markov head) is a warning. `vllm_check=False` skips only the vLLM
    subprocess (`dspark.servable`), not the static checks.
    """
    out_dir = Path(out_dir)
    if model.cfg.causal_in_block and model.cfg.sliding_window is None:
        warnings.warn(
            "causal_in_block with full attention: vLLM honours it (is_causal), but speculators' "
            "own DSparkDraftModel treats full-attention layers as bidirectional",
            stacklevel=2,
        )
    recover_dir(out_dir)
    staging = staging_dir(out_dir)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    # to_json_file, not save_pretrained: the latter also copies speculators' config.py beside it.
    speculators_config(model, verifier_name_or_path).to_json_file(staging / CONFIG_FILE, use_diff=True)
    save_file(drafter_tensors(model), str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
    if extra_meta:
        (staging / META_FILE).write_text(json.dumps(extra_meta, indent=2, default=str))
    problems = servable_problems(staging) if vllm_check else static_problems(staging)
    problems = [dataclasses.replace(p, message=p.message.replace(str(staging), str(out_dir))) for p in problems]
    broken = [p.message for p in problems if p.breaks_export]
    if broken:
        shutil.rmtree(staging)
        raise UserError(f"export to {out_dir} refused, the previous drafter is kept: " + "; ".join(broken))
    for problem in problems:
        warnings.warn(f"vLLM cannot serve this drafter as trained: {problem.message}", stacklevel=2)
    replace_dir(staging, out_dir)
    return out_dir


def _draft_config(config, attn_impl: str) -> DraftConfig:
    """Our DraftConfig from a speculators DSpark config."""
    layers = config.transformer_layer_config
    layer_types = set(layers.layer_types or ["full_attention"])
    if len(layer_types) > 1:
        raise ValueError(f"mixed attention layer types {sorted(layer_types)} are not supported")
    sliding = layer_types == {"sliding_attention"}
    causal = getattr(layers, "is_causal", None)
    if causal is None:  # speculators' rule when the flag is absent
        causal = sliding and not config.sliding_window_non_causal
    return DraftConfig(
        num_layers=layers.num_hidden_layers,
        block_size=config.block_size,
        draft_vocab_size=config.draft_vocab_size if config.draft_vocab_size < layers.vocab_size else None,
        markov_rank=config.markov_rank,
        markov_type=config.markov_head_type,
        confidence_head=config.enable_confidence_head,
        confidence_head_with_markov=config.confidence_head_with_markov,
        sliding_window=layers.sliding_window if sliding else None,
        causal_in_block=bool(causal),
        attn_impl=attn_impl,
        markov_embed_proj=False,  # a drafter holds the projection folded into W1
    )


def load_drafter(path, verifier: VerifierHead | None = None, attn_impl: str = "sdpa") -> DSparkDraft:
    """A DSparkDraft from a speculators-format DSpark checkpoint (e.g. to warm-start training).

    Without `verifier` the frozen embedding (and full-vocabulary lm_head) stay unloaded
    until `model.load_verifier(...)`.
    """
    from speculators.config import SpeculatorModelConfig

    path = Path(path)
    recover_dir(path)  # a replace killed midway leaves the old drafter aside
    if not (path / CONFIG_FILE).is_file():
        raise UserError(f"{path}: not an exported drafter dir (no {CONFIG_FILE})")
    config = SpeculatorModelConfig.from_pretrained(path)
    if config.speculators_model_type != "dspark":
        raise UserError(
            f"{path / CONFIG_FILE}: `speculators_model_type` is {config.speculators_model_type!r}, expected 'dspark'"
        )
    if not config.sample_from_anchor:
        raise UserError(
            f"{path / CONFIG_FILE}: `sample_from_anchor` is false (bonus-anchor layout); "
            f"this draft predicts token p+k+1 from slot k and needs it true"
        )
    if config.mask_token_id is None:
        raise UserError(f"{path / CONFIG_FILE}: `mask_token_id` is missing")
    tensors = load_file(str(path / WEIGHTS_FILE))
    model = DSparkDraft(
        _draft_config(config, attn_impl),
        config.transformer_layer_config,
        config.aux_hidden_state_layer_ids,
        config.mask_token_id,
        d2t=tensors.get("d2t"),
    )
    model.verifier_architectures = list(config.speculators_config.verifier.architectures)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = sorted(set(missing) - model.verifier_owned())
    if missing or unexpected:
        raise UserError(
            f"{path / WEIGHTS_FILE} does not match the draft its config describes: "
            f"missing {missing}, unexpected {sorted(unexpected)}"
        )
    if verifier is not None:
        model.load_verifier(verifier)
    return model


__all__ = ["drafter_tensors", "export_drafter", "load_drafter", "speculators_config"]
