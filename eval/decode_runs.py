"""The decode step: the verifier (transformers) and the exported drafter, speculative decoding of every
prompt set at each temperature (fixed and adaptive verification), greedy outputs checked against the
verifier's own greedy decoding, and the offline τ on verifier answers sampled at temperature 1."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from dspark.config import HeldoutConfig, TargetConfig
from dspark.errors import UserError
from dspark.eval.config import EvalConfig
from dspark.eval.offline import pick_device, score_samples
from dspark.eval.online import load_prompt_rows
from dspark.eval.speculative import CostModel, DecodeOutput, DraftContext, SpeculativeDecoder, Verifier
from dspark.export import load_drafter
from dspark.servable import check_servable
from dspark.targets import resolve_target
from dspark.verifier import VerifierHead


@dataclass
class DecodeRun:
    """One prompt set decoded at one temperature, fixed or adaptive."""

    benchmark: str
    temperature: float
    adaptive: bool
    prompts: list[list[int]]
    outputs: list[DecodeOutput]
    wall_s: float


def load_engine(drafter_dir: Path, target: TargetConfig, device: torch.device):
    """(engine, HF verifier, tokenizer, context length): the verifier in float32 from the target, the
    drafter from its exported directory only (config.json + model.safetensors)."""
    resolved = resolve_target(target)
    model_dir = resolved.model_dir
    check_servable(drafter_dir, verifier=str(model_dir))  # decode only what vLLM would load the same way
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    try:
        draft = load_drafter(drafter_dir)
        decoder = model.model
        draft.load_verifier(
            VerifierHead(model.config, decoder.embed_tokens.weight, decoder.norm.weight, model.lm_head.weight)
        )
        engine = SpeculativeDecoder(Verifier(model, draft.aux_layer_ids), draft.to(device))
    except ValueError as err:
        raise UserError(f"drafter={drafter_dir} with verifier {target.name_or_path}: {err}") from err
    return engine, model, AutoTokenizer.from_pretrained(model_dir), int(resolved.config.max_model_len)


def prompt_sets(cfg: EvalConfig, tokenizer, max_prompt_tokens: int) -> dict[str, list[list[int]]]:
    """Token ids of the first `prompts_per_benchmark` prompts per benchmark (`source`) of the prompt file."""
    dc = cfg.decode
    path = dc.prompts_file
    if path is None:
        bench = Path(cfg.bench_data_dir) / "eval.jsonl"
        path = bench if bench.is_file() else Path(cfg.data_dir) / "eval.jsonl"
    try:
        rows = load_prompt_rows(Path(path))
    except (FileNotFoundError, ValueError) as err:
        raise UserError(f"eval.decode prompts: {err}") from err
    sets: dict[str, list[list[int]]] = {}
    for source, prompt in rows:
        if isinstance(prompt, str):
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        chosen = sets.setdefault(source or "prompts", [])
        if len(chosen) < dc.prompts_per_benchmark and 0 < len(prompt) <= max_prompt_tokens:
            chosen.append(list(prompt))
    return sets


def hf_generate(model, prompt: list[int], max_new_tokens: int, temperature: float, seed: int = 0) -> list[int]:
    """The verifier's own decoding with transformers `generate` (greedy at 0, pure sampling otherwise);
    EOS does not stop it.

    The settings go as keyword arguments: values left None in a GenerationConfig object are filled in
    from the model's own generation config (its `eos_token_id` among them), which would stop at EOS.
    """
    sampled = temperature > 0
    torch.manual_seed(seed)
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        do_sample=sampled,
        temperature=temperature if sampled else None,
        top_k=0 if sampled else None,
        top_p=1.0 if sampled else None,
        max_new_tokens=max_new_tokens,
        min_new_tokens=None,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    if len(out) != max_new_tokens:
        raise RuntimeError(f"transformers generate returned {len(out)} of {max_new_tokens} tokens")
    return out


def check_lossless(benchmark: str, prompts: list[list[int]], outputs: list[list[int]], references: list[list[int]]):
    """A UserError naming the prompt and first differing position where greedy speculative decoding
    does not reproduce the verifier's greedy decoding token for token."""
    for i, (prompt, got, want) in enumerate(zip(prompts, outputs, references)):
        if got != want:
            pos = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise UserError(
                f"lossless check failed: {benchmark} prompt {i} ({len(prompt)} tokens): greedy speculative "
                f"decoding differs from the verifier's greedy decoding at generated token {pos} "
                f"({got[pos] if pos < len(got) else 'end'} vs {want[pos] if pos < len(want) else 'end'})"
            )


def profile_costs(engine: SpeculativeDecoder, prompt: list[int], replays: int) -> CostModel:
    """Median ms of one draft step and of verifier forwards of 1..B+1 tokens after `prompt`, as vLLM
    profiles step costs for adaptive verification."""
    dev, B = engine.device, engine.block_size
    ids = torch.tensor([prompt], device=dev)
    cache = DynamicCache()
    _, aux = engine.verifier.forward(ids, torch.arange(len(prompt), device=dev)[None], torch.ones_like(ids), cache)
    context = DraftContext(engine.draft, 1, len(prompt) + 1)
    positions = torch.arange(len(prompt), device=dev)
    context.append(aux[0], torch.zeros_like(positions), positions)
    n_ctx = torch.tensor([len(prompt)], device=dev)
    anchor = ids[:, -1]

    def timed(fn) -> float:
        times = []
        for _ in range(replays + 1):  # the first call warms up
            start = time.perf_counter()
            fn()
            if dev.type == "cuda":  # kernels run asynchronously: time them to their end
                torch.cuda.synchronize(dev)
            times.append(1000 * (time.perf_counter() - start))
        return float(np.median(times[1:]))

    draft_ms = timed(lambda: engine.draft_block(context, n_ctx, anchor, 0.0, None))
    verify_ms = [0.0]
    for n in range(1, B + 2):

        def verify(n=n):
            step = ids[:, -1:].expand(1, n)
            pos = len(prompt) + torch.arange(n, device=dev)[None]
            engine.verifier.forward(step, pos, torch.ones(1, len(prompt) + n, device=dev, dtype=torch.long), cache)
            cache.crop(-n)

        verify_ms.append(timed(verify))
    return CostModel(draft_ms, np.maximum.accumulate(np.array(verify_ms)))


def given_costs(step_costs: dict, block_size: int) -> CostModel:
    """`eval.decode.step_costs` as a CostModel, refused unless it prices verifying 1..B+1 tokens."""
    verify = [float(v) for v in step_costs["verify_ms"]]
    if len(verify) != block_size + 1:
        raise UserError(
            f"eval.decode.step_costs.verify_ms must price a verifier forward of 1..{block_size + 1} tokens "
            f"(the drafter's block size is {block_size}), got {len(verify)} values"
        )
    return CostModel(float(step_costs["draft_ms"]), np.array([0.0, *verify]))


def decode_runs(engine: SpeculativeDecoder, model, sets: dict[str, list[list[int]]], cfg: EvalConfig):
    """Every (prompt set, temperature, fixed/adaptive) run; greedy runs checked lossless."""
    dc = cfg.decode
    costs = None
    if dc.adaptive and engine.draft.confidence_head is not None:
        if dc.step_costs is not None:
            costs = given_costs(dc.step_costs, engine.block_size)
        else:
            costs = profile_costs(engine, next(iter(sets.values()))[0], dc.profile_replays)
    runs = []
    modes = [None] if costs is None else [None, costs]
    bar = tqdm(
        total=sum(len(p) for p in sets.values()) * len(dc.temperatures) * len(modes),
        desc="decode",
        unit="prompt",
        dynamic_ncols=True,
    )
    for benchmark, prompts in sets.items():
        references = None
        for temperature in dc.temperatures:
            for cost in modes:
                bar.set_postfix_str(f"{benchmark} T={temperature:g} {'adaptive' if cost else 'fixed'}")
                start = time.perf_counter()
                outputs = []
                for i in range(0, len(prompts), dc.batch_size):
                    batch = prompts[i : i + dc.batch_size]
                    outputs += engine.generate(batch, dc.max_new_tokens, temperature, dc.seed + i, cost)
                    bar.update(len(batch))
                wall = time.perf_counter() - start
                if temperature == 0:
                    if references is None:
                        references = [hf_generate(model, p, dc.max_new_tokens, 0.0) for p in prompts]
                    check_lossless(benchmark, prompts, [o.output_ids for o in outputs], references)
                runs.append(DecodeRun(benchmark, float(temperature), cost is not None, prompts, outputs, wall))
    bar.close()
    return runs, costs


def offline_tau(
    engine: SpeculativeDecoder, model, sets: dict[str, list[list[int]]], cfg: EvalConfig, heldout: HeldoutConfig
) -> dict:
    """Per prompt set: the drafter's offline τ (eval.offline's scoring, the `heldout` protocol's anchors) on
    verifier answers to its prompts sampled with transformers at temperature 1, as BlockTables keyed by benchmark."""
    tables = {}
    for benchmark, prompts in sets.items():
        answers = (
            hf_generate(model, prompt, cfg.decode.max_new_tokens, 1.0, cfg.decode.seed + i)
            for i, prompt in enumerate(tqdm(prompts, desc=f"offline τ {benchmark}", unit="prompt", dynamic_ncols=True))
        )
        tables[benchmark] = score_answers(engine, model, prompts, answers, cfg, heldout)
    return tables


def score_answers(
    engine: SpeculativeDecoder, model, prompts: list[list[int]], answers, cfg: EvalConfig, heldout: HeldoutConfig
):
    """BlockTable of the drafter's offline τ on each prompt's answer (the verifier's states of prompt +
    answer, anchors in the answer drawn as `heldout` says), or None when no answer has a block."""
    head = VerifierHead(model.config, model.model.embed_tokens.weight, model.model.norm.weight, model.lm_head.weight)

    def samples():
        for i, (prompt, answer) in enumerate(zip(prompts, answers)):
            ids = torch.tensor(prompt + answer, device=model.device)
            context, final = engine.verifier.states(ids)
            yield i, context, final, ids.cpu(), torch.arange(len(ids)) >= len(prompt)

    return score_samples(engine.draft, head, samples(), heldout, pick_device(cfg.decode.device))


def block_starts(prompt_len: int, accepted_per_step: list[int]) -> np.ndarray:
    """Sequence positions of the anchors a decode run drafted from: the first generated token, then
    each step's verifier token after its accepted drafts."""
    return prompt_len + np.concatenate([[0], np.cumsum(np.asarray(accepted_per_step) + 1)[:-1]]).astype(np.int64)


__all__ = [
    "DecodeRun",
    "block_starts",
    "check_lossless",
    "decode_runs",
    "given_costs",
    "hf_generate",
    "load_engine",
    "offline_tau",
    "prompt_sets",
    "score_answers",
]
