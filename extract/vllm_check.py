"""`python -m dspark.extract.vllm_check DRAFTER... [--num-speculative-tokens N] [--verifier V]`: would the installed vLLM serve these drafters?

Runs vLLM's own code on CPU, nothing copied from it, each step as `vllm serve` does it:
1. `maybe_override_with_speculators`: the speculators-config parsing that turns the drafter
   directory into a speculative config and names the verifier;
2. `SpeculativeConfig` on the verifier's `ModelConfig`: method and architecture resolution,
   the number of drafted tokens and the checks vLLM makes on them;
3. `ModelRegistry.resolve_model_cls`: the model class the resolved architecture maps to,
   which must be the Qwen3 DSpark one (any other class loads the drafter as another model);
4. that class built on the meta device and its `load_weights` fed meta tensors of the
   checkpoint's names, shapes and dtypes (nothing is read but the safetensors header): the
   tensors it needs and the ones it refuses.

Prints one JSON line per drafter, last on stdout:
`{"drafter": ..., "refusals": [{"step": ..., "message": ...}], "served": {...}}`. A step
that cannot run (the verifier's config is not on this machine) is a refusal of step
`unchecked`; the caller decides what it means. Imported only in this subprocess: vLLM's
import costs seconds and much memory, and nothing in `dspark` depends on it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

QWEN3_DSPARK_CLASS = "Qwen3DSparkForCausalLM"
SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "BOOL": torch.bool,
}


def meta_tensors(weights: Path) -> list[tuple[str, torch.Tensor]]:
    """(name, meta tensor of the stored shape and dtype) for every tensor in a safetensors file."""
    with safe_open(str(weights), framework="pt") as f:
        out = []
        for name in f.keys():
            part = f.get_slice(name)
            out.append((name, torch.empty(part.get_shape(), dtype=SAFETENSORS_DTYPES[part.get_dtype()], device="meta")))
    return out


def one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:600]


class ServingParallel:
    """The single-process distributed state vLLM's layers are built in (gloo, tensor parallel size 1)."""

    def __init__(self) -> None:
        self.ready = False

    def ensure(self, vllm_config) -> None:
        if self.ready:
            return
        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel

        init_file = Path(tempfile.mkdtemp(prefix="vllm-check-")) / "init"
        with set_current_vllm_config(vllm_config):
            init_distributed_environment(1, 0, f"file://{init_file}", 0, backend="gloo")
            initialize_model_parallel(1, 1)
        self.ready = True


def check(drafter: Path, num_speculative_tokens: int | None, verifier: str | None, parallel: ServingParallel) -> dict:
    """What vLLM makes of one drafter dir: its refusals (step, message) and what it would serve."""
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.transformers_utils.config import maybe_override_with_speculators

    result: dict = {"drafter": str(drafter), "refusals": [], "served": {}}

    def refuse(step: str, message: str) -> dict:
        result["refusals"].append({"step": step, "message": message})
        return result

    try:
        named, _, spec = maybe_override_with_speculators(str(drafter), None, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - vLLM's refusal, reported as such
        return refuse("config", f"vLLM's speculators parsing refuses config.json: {one_line(err)}")
    if spec is None:  # not the speculators format: what `--speculative-config {"method": "dspark", ...}` gives
        named, spec = None, {"method": "dspark", "model": str(drafter)}
    verifier = verifier or named
    if verifier is None:
        return refuse("config", "config.json names no verifier (speculators_config.verifier.name_or_path)")
    if num_speculative_tokens is not None:
        spec["num_speculative_tokens"] = num_speculative_tokens
    try:
        target = ModelConfig(model=verifier, tokenizer=verifier, dtype="float32")
    except Exception as err:  # noqa: BLE001
        return refuse("unchecked", f"the verifier {verifier!r} could not be read here: {one_line(err)}")
    try:
        speculative = SpeculativeConfig(**spec, target_model_config=target, target_parallel_config=ParallelConfig())
    except Exception as err:  # noqa: BLE001
        return refuse("speculative-config", f"vLLM's SpeculativeConfig refuses it: {one_line(err)}")
    draft = speculative.draft_model_config
    hf = draft.hf_config
    result["served"] = {
        "method": speculative.method,
        "num_speculative_tokens": speculative.num_speculative_tokens,
        "architectures": list(draft.architectures),
        # what vLLM's DSpark runtime reads (its defaults where the config is silent)
        "sample_from_anchor": getattr(hf, "sample_from_anchor", True),
        "confidence_head_with_markov": getattr(hf, "confidence_head_with_markov", False),
    }
    try:
        model_class, _ = ModelRegistry.resolve_model_cls(draft.architectures, draft)
    except Exception as err:  # noqa: BLE001
        return refuse("registry", f"vLLM's model registry resolves no class: {one_line(err)}")
    result["served"]["model_class"] = model_class.__name__
    if model_class.__name__ != QWEN3_DSPARK_CLASS:
        return refuse(
            "registry",
            f"vLLM maps architecture {draft.architectures} to {model_class.__name__}, not {QWEN3_DSPARK_CLASS}: "
            "it would load this Qwen3 drafter as another model",
        )
    # The CPU build's VllmConfig refuses DSpark (its V1 runner has none): the model is built
    # under a config without it, the speculative config attached after, as only the layers need it.
    vllm_config = VllmConfig(model_config=target, device_config=DeviceConfig("cpu"))
    vllm_config.speculative_config = speculative
    parallel.ensure(vllm_config)
    try:
        with set_current_vllm_config(vllm_config), torch.device("meta"):
            model = model_class(vllm_config=vllm_config, prefix="")
        with set_current_vllm_config(vllm_config):
            model.load_weights(iter(meta_tensors(drafter / "model.safetensors")))
    except Exception as err:  # noqa: BLE001
        return refuse("load", f"vLLM's {QWEN3_DSPARK_CLASS}.load_weights refuses model.safetensors: {one_line(err)}")
    result["served"]["confidence_head"] = model.model.confidence_head is not None
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dspark.extract.vllm_check", description=__doc__.splitlines()[0])
    parser.add_argument("drafters", nargs="+", type=Path)
    parser.add_argument("--num-speculative-tokens", type=int, default=None)
    parser.add_argument("--verifier", default=None, help="the verifier served with them (default: the one each names)")
    args = parser.parse_args(argv)
    parallel = ServingParallel()
    results = [check(d, args.num_speculative_tokens, args.verifier, parallel) for d in args.drafters]
    sys.stdout.flush()
    for result in results:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
