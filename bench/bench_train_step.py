"""Training-step throughput against speculators' DSparkDraftModel, where the time goes, and
the achieved fraction of the machine's matmul FLOP/s.

One training step (forward, loss, backward, AdamW step) of this trainer (`DSparkDraft` and
`dspark_loss`, fed the way `train` feeds them: `train.data.collate` and the trainer's
`prepare_batch`/`blocks`) and of speculators' `DSparkDraftModel` (one packed row with
document ids, its eager losses, SDPA) on the same weights (speculators loads this project's
export) and the same conversations. Block 4, loss {"ce": 0.1, "tv": 0.9} + confidence head,
vanilla Markov head (rank 256), 5 draft layers, full draft vocabulary, float32, CPU, 2 threads.

Rows:
- `qwen2.5-0.5b`: a random verifier with Qwen2.5-0.5B's config (hidden 896, 14/2 heads,
  FFN 4864, vocabulary 151,936); a 2,048-token step of conversations of 100–900 tokens;
  64 anchors per step (split over the conversations in proportion to their length).
- `smollm2-135m`: SmolLM2-135M's width (hidden 576, 9/3 heads, FFN 1536, vocabulary
  49,152); one 512-token conversation, 64 anchors.

Steps of the two alternate, so machine noise (a shared machine) hits both; the ratio is
taken per round (speculators' step time / this trainer's) and reported as the median with
its min and max, in wall time and in CPU time (less disturbed by other processes). Shares of step time come from one profiled step of each (torch.profiler,
self time of every op): (a) backbone = everything not below, (b) vocabulary-sized loss =
every op with a vocabulary-sized operand, or called by one or by `project_into` (both
lm_heads, Markov W2, softmaxes, their backward), (c) optimizer = the AdamW step. FLOP fraction: analytic forward+backward FLOPs
of the useful work (backbone on the conversations' tokens, both lm_heads and Markov W2 on
the scored slots) over the median step time, against the best matmul FLOP/s measured in
the same run (measured before every round; the fastest counts). `adamw_step_s`: one AdamW
step over this trainer's parameters as `train` builds it (`train.optim.make_optimizer`, the
fused kernel) and as torch's default AdamW (foreach), which speculators' side of the step uses.

Allocators: on CPU glibc returns every freed tensor over 32 MiB to the OS and page-faults it in
again at the next step, which a GPU's caching allocator never does. So on CPU the real shape is
measured a second time in a child process that keeps freed memory (`KEEP_FREED`: both trainers
in that one process), the figure that holds on a GPU; `kept_freed_memory` in the JSON, beside
the default allocator's rows.

Run: python -m bench.bench_train_step   (or python -m bench only=train_step)

Over 400 lines on purpose: both implementations' steps are built from the same inputs
here, so the comparison cannot drift apart between files.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from bench import qwen_tokenizer_dir, write_figures
from dspark.train.optim import make_optimizer

REPO = Path(__file__).resolve().parents[1]
# The GPU check (bench/gpu_check.py) runs this module with cuda, bfloat16 (autocast) and flex.
DEVICE = os.environ.get("DSPARK_BENCH_DEVICE", "cpu")
DTYPE = getattr(torch, os.environ.get("DSPARK_BENCH_DTYPE", "float32"))
ATTN = os.environ.get("DSPARK_BENCH_ATTN", "sdpa")
THREADS, BLOCK, DRAFT_LAYERS, MARKOV_RANK = 2, 4, 5, 256
ROUNDS = int(os.environ.get("DSPARK_BENCH_ROUNDS", "4"))  # alternating rounds after the warm-up
LOSS = {"ce": 0.1, "tv": 0.9}
# The trainer's `train.compile: auto`: compiled draft layers on CUDA (speculators compiles parts of its step there).
COMPILE = os.environ.get("DSPARK_BENCH_COMPILE", "1" if DEVICE == "cuda" else "0") == "1"


@dataclass(frozen=True)
class Shape:
    """A verifier's width and a step's conversations."""

    name: str
    model_type: str
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    lengths: tuple[int, ...]
    anchors: int


SHAPES = (
    Shape("qwen2.5-0.5b", "qwen2", 896, 14, 2, 4864, 151_936, (612, 388, 845, 203), 64),
    Shape("smollm2-135m", "qwen3", 576, 9, 3, 1536, 49_152, (512,), 64),
)


def make_verifier(shape: Shape, out: Path) -> Path:
    """A random verifier of `shape`'s width (only its embedding, norm and lm_head are read)."""
    from transformers import (
        AutoTokenizer,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(0)
    config_cls, model_cls = (
        (Qwen2Config, Qwen2ForCausalLM) if shape.model_type == "qwen2" else (Qwen3Config, Qwen3ForCausalLM)
    )
    config = config_cls(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=4,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    model_cls(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(qwen_tokenizer_dir()).save_pretrained(out)
    return out


def conversations(shape: Shape, g: torch.Generator):
    """The step's samples (store rows), each with a 32-token prompt outside the loss mask."""
    import numpy as np

    samples = []
    for i, n in enumerate(shape.lengths):
        mask = np.ones(n, dtype=np.uint8)
        mask[:32] = 0
        bits = torch.randn(n, 4, shape.hidden, generator=g).bfloat16().view(torch.int16).numpy().view(np.uint16)
        ids = torch.randint(0, shape.vocab - 1, (n,), generator=g).numpy().astype(np.int32)
        samples.append(SimpleNamespace(sample_id=i, token_ids=ids, loss_mask=mask, hidden=bits))
    return samples


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def matmul_flops_per_s(shape: Shape) -> float:
    """Matmul FLOP/s (in DTYPE) at this step's dominant GEMM shapes, the fastest of: one GEMM
    at each shape, and the vocabulary projection tiled as the trainer runs it (`project_into`)."""
    from dspark.vocab_matmul import project_into

    best = 0.0
    for m, k, n in ((256, shape.hidden, shape.vocab), (2048, shape.hidden, shape.ffn)):
        a, b = torch.randn(m, k, device=DEVICE, dtype=DTYPE), torch.randn(n, k, device=DEVICE, dtype=DTYPE)
        for tiled in (False, True) if n == shape.vocab else (False,):
            sync()
            start = time.perf_counter()
            project_into(a, b, a.new_empty(m, n)) if tiled else a @ b.t()
            sync()
            best = max(best, 2 * m * k * n / (time.perf_counter() - start))
    return best


def step_flops(shape: Shape, blocks: int, slots: int) -> float:
    """Forward+backward FLOPs of the useful work: backbone on the real tokens, heads on the scored slots."""
    tokens, h, d = sum(shape.lengths), shape.hidden, shape.hidden // shape.heads
    kv = shape.kv_heads * d
    q_slots = blocks * BLOCK
    fc = 2 * tokens * 3 * h * h
    per_layer = (
        2 * (tokens + q_slots) * h * 2 * kv  # k/v projections of context and block
        + 2 * q_slots * h * (2 * shape.heads * d + 3 * shape.ffn)  # q, o, MLP of the block slots
        + 2 * 2 * q_slots * (tokens + q_slots) * shape.heads * d
    )  # scores and values (dense)
    backbone = 3 * (fc + DRAFT_LAYERS * per_layer)  # forward, input grad, weight grad
    lm_heads = 2 * slots * h * shape.vocab * (2 + 1)  # draft lm_head: forward + input grad; verifier: forward
    markov = 3 * 2 * slots * MARKOV_RANK * shape.vocab
    return float(backbone + lm_heads + markov)


def classify(prof, vocab: int) -> dict[str, float]:
    """Self CPU time (s) of the profiled step by part: backbone, vocabulary-sized loss, optimizer."""
    parts = {"backbone": 0.0, "vocab_loss": 0.0, "optimizer": 0.0}
    for evt in prof.events():
        part, node = "backbone", evt
        while node is not None:  # the op or a caller: the optimizer step, or vocabulary-sized work
            if node.name.startswith("Optimizer.step"):
                part = "optimizer"
                break
            if node.name == "project_into" or any(vocab in s for s in node.input_shapes if isinstance(s, list)):
                part = "vocab_loss"
            node = node.cpu_parent
        parts[part] += evt.self_cpu_time_total / 1e6
    total = sum(parts.values())
    return {k: round(v / total, 3) for k, v in parts.items()}


def from_conf(cls, path: str, **overrides):
    """A config schema from its file under conf/ (the defaults' one source) with `overrides`."""
    from omegaconf import OmegaConf

    from dspark.config import to_dataclass

    return to_dataclass(cls, OmegaConf.merge(OmegaConf.load(REPO / "conf" / path), overrides))


def build(shape: Shape, work: Path):
    """Both models on the same weights, and one step function for each."""
    from speculators.config import SpeculatorModelConfig
    from speculators.models.dspark import DSparkDraftModel
    from transformers import AutoConfig

    from dspark.config import DraftConfig, LossConfig
    from dspark.export import export_drafter
    from dspark.model import DSparkDraft
    from dspark.train.data import collate
    from dspark.train.dspark_trainer import DSparkTrainer
    from dspark.verifier import VerifierHead
    from dspark.workspace import Workspace

    verifier_dir = make_verifier(shape, work / "verifier")
    verifier = VerifierHead.from_pretrained(verifier_dir)
    torch.manual_seed(0)
    mask_token = shape.vocab - 1
    draft_cfg = from_conf(
        DraftConfig,
        "model/dspark.yaml",
        num_layers=DRAFT_LAYERS,
        block_size=BLOCK,
        draft_vocab_size=None,
        markov_rank=MARKOV_RANK,
        markov_type="vanilla",
        confidence_head=True,
        confidence_head_with_markov=True,
        attn_impl=ATTN,
    )
    ours = DSparkDraft(draft_cfg, AutoConfig.from_pretrained(verifier_dir), [1, 2, 3], mask_token)
    ours.load_verifier(verifier)
    config = SpeculatorModelConfig.from_pretrained(export_drafter(ours, work / "drafter", str(verifier_dir)))
    config.transformer_layer_config._attn_implementation = "simple_flex_attention" if ATTN == "flex" else "sdpa"
    theirs = DSparkDraftModel.from_pretrained(work / "drafter", config=config).to(DEVICE)
    ours.to(DEVICE)
    # What compiling buys, in the same run: the eager step on a copy of the same weights beside it.
    eager = copy.deepcopy(ours) if COMPILE else None
    if COMPILE:
        ours.compile_backbone()
    verifier.to(DEVICE)
    # Frozen vocabulary matrices equal in both models are shared (saves ~1.6 GB at 152k).
    for name in ("embed_tokens", "lm_head", "verifier_lm_head"):
        theirs_w = getattr(theirs, name).weight
        frozen = ours.embed_tokens.weight if name == "embed_tokens" else ours.lm_head.weight
        if not theirs_w.requires_grad and torch.equal(theirs_w, frozen):
            getattr(theirs, name).weight = torch.nn.Parameter(frozen, requires_grad=False)
    # speculators' Triton losses need CUDA; where they fail to compile (torch 2.11 on an H200), its eager ones
    losses = {"implementation": "fused" if DEVICE == "cuda" else "eager", "fused_error": None}

    def their_kwargs() -> dict:
        return theirs.get_trainer_kwargs(
            loss_fn=json.dumps(LOSS),
            loss_implementation=losses["implementation"],
            max_anchors=shape.anchors,
            dflash_decay_gamma=4.0,
        )[0]

    train_kwargs = their_kwargs()
    g = torch.Generator().manual_seed(0)
    samples = conversations(shape, g)
    per_sample = shape.anchors // len(shape.lengths)  # the trainer's num_anchors is per conversation
    loss_cfg = from_conf(
        LossConfig,
        "loss/default.yaml",
        weights=LOSS,
        confidence_weight=1.0,
        gamma=4.0,
        num_anchors=per_sample,
        anchor_sampling="uniform",
    )
    trainer = SimpleNamespace(
        loss_cfg=loss_cfg,
        cfg=SimpleNamespace(seed=0),
        block_size=BLOCK,
        raw_model=ours,
        verifier=verifier,
        workspace=Workspace(),
    )
    trainer.prepare_batch = lambda batch, **kw: DSparkTrainer.prepare_batch(trainer, batch, **kw)
    batch = collate(samples, [0] * len(samples))
    batch = DSparkTrainer.prepare_batch(trainer, batch, epoch=0)
    batch["context"], batch["target_hidden"] = batch["context"].float(), batch["target_hidden"].float()
    batch = {k: v.to(DEVICE) for k, v in batch.items()}

    # speculators: the same conversations packed into one row with document ids.
    cat = {
        k: torch.cat([torch.as_tensor(v) for v in vals])
        for k, vals in (
            ("ids", [s.token_ids.astype("int64") for s in samples]),
            ("mask", [s.loss_mask.astype("int64") for s in samples]),
        )
    }
    hidden = torch.cat([batch["context"][i, :n] for i, n in enumerate(shape.lengths)])
    final = torch.cat([batch["target_hidden"][i, :n] for i, n in enumerate(shape.lengths)])
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(shape.lengths)])
    positions = torch.cat([torch.arange(n) for n in shape.lengths])
    packed = tuple(t[None].to(DEVICE) for t in (hidden, cat["ids"], cat["mask"], final, docs))
    positions = positions.to(DEVICE)

    def autocast():
        return torch.autocast(DEVICE, dtype=DTYPE, enabled=DTYPE != torch.float32)

    opt_cfg = SimpleNamespace(lr=1e-4, lr_scales=None, adam_betas=(0.9, 0.999), weight_decay=0.0)
    opt_ours = make_optimizer([(n, p) for n, p in ours.named_parameters() if p.requires_grad], opt_cfg)
    opt_theirs = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=1e-4)

    def our_step_of(model: DSparkDraft, opt) -> Callable[[], None]:
        owner = SimpleNamespace(**{**vars(trainer), "raw_model": model})

        def step() -> None:
            with autocast():
                out = DSparkTrainer.blocks(owner, model, batch, batch["norm_weight"])
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    def their_loss() -> torch.Tensor:
        nonlocal train_kwargs
        try:
            with autocast():
                return theirs(*packed, position_ids=positions[None], **train_kwargs)[1]
        except Exception as exc:  # only the fused losses may fall back, once
            if losses["implementation"] != "fused":
                raise
            losses.update(implementation="eager", fused_error=f"{type(exc).__name__}: {str(exc)[:300]}")
            print(f"   speculators' fused losses failed, using its eager ones: {losses['fused_error']}", flush=True)
            train_kwargs = their_kwargs()
            return their_loss()

    def their_step() -> None:
        loss = their_loss()
        loss.backward()
        opt_theirs.step()
        opt_theirs.zero_grad(set_to_none=True)

    def optimizer_steps() -> dict[str, float]:
        """Seconds of one AdamW step over this trainer's parameters: as `train` builds it, and torch's default."""
        params = [p for p in ours.parameters() if p.requires_grad]
        out = {}
        for name, opt in (("trainer", opt_ours), ("foreach", None)):
            for p in params:
                p.grad = torch.randn_like(p)
            if opt is None:  # one more optimizer state only now, so the peak memory stays one state higher
                opt = torch.optim.AdamW(params, lr=1e-4)
                opt.step()  # creates the state
            sync()
            start = time.perf_counter()
            opt.step()
            sync()
            out[name] = time.perf_counter() - start
            del opt
        for p in params:
            p.grad = None
        return out

    blocks = int(batch["anchor_valid"].sum())
    slots = int(batch["slot_mask"].sum())
    steps = {"ours": our_step_of(ours, opt_ours), "speculators": their_step}
    if eager is not None:
        eager_params = [(n, p) for n, p in eager.named_parameters() if p.requires_grad]
        steps["ours_eager"] = our_step_of(eager, make_optimizer(eager_params, opt_cfg))
    return steps, blocks, slots, optimizer_steps, losses


def measure(shape: Shape, work: Path) -> dict:
    steps, blocks, slots, optimizer_steps, losses = build(shape, work)
    times: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    matmul = []
    for round_ in range(ROUNDS + 1):
        matmul.append(matmul_flops_per_s(shape))
        for name, step in steps.items():
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            sync()
            if round_:  # the first round warms up allocators and caches
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    ratios = [t / o for o, t in zip(times["ours"], times["speculators"], strict=True)]
    cpu_ratios = [t / o for o, t in zip(cpu["ours"], cpu["speculators"], strict=True)]
    shares = {}  # by CPU self time: on CUDA they would measure kernel launches, not kernels
    for name, step in steps.items() if DEVICE == "cpu" else ():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
        shares[name] = classify(prof, shape.vocab)
    matmul = max(matmul)  # the least disturbed measurement is the machine's limit
    flops = step_flops(shape, blocks, slots)
    optimizer = optimizer_steps()
    median = {k: statistics.median(v) for k, v in times.items()}
    tokens = sum(shape.lengths)
    return {
        "setting": {
            "conversation_tokens": list(shape.lengths),
            "anchors": blocks,
            "scored_slots": slots,
            "hidden": shape.hidden,
            "heads": [shape.heads, shape.kv_heads],
            "ffn": shape.ffn,
            "vocab": shape.vocab,
        },
        "tokens_per_s": {k: round(tokens / v, 1) for k, v in median.items()},
        "step_s_median": {k: round(v, 4) for k, v in median.items()},
        "throughput_ratio": round(statistics.median(ratios), 3),
        "throughput_ratio_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
        "cpu_time_ratio": round(statistics.median(cpu_ratios), 3),
        "cpu_time_ratio_min_max": [round(min(cpu_ratios), 3), round(max(cpu_ratios), 3)],
        "time_shares": shares,
        "step_gflop": round(flops / 1e9, 1),
        "matmul_gflop_per_s": round(matmul / 1e9, 1),
        "flop_limit_fraction": {k: round(flops / v / matmul, 3) for k, v in median.items()},
        "adamw_step_s": {k: round(v, 3) for k, v in optimizer.items()},
        "speculators_losses": losses,
        # eager step time over the compiled one's (train.compile), where the step was compiled
        "compile_speedup": round(median["ours_eager"] / median["ours"], 3) if "ours_eager" in median else None,
    }


# glibc tunables that keep freed memory in the process (as the demo's training runs).
KEEP_FREED = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}
KEPT_CHILD = "DSPARK_BENCH_KEPT_FREED_CHILD"  # set in the child: measure the real shape, print its row
KEPT_ROW = "kept-freed-memory row: "


def kept_freed_memory_row() -> dict:
    """The real shape's row measured in a child process that keeps freed memory."""
    env = {**os.environ, **KEEP_FREED, KEPT_CHILD: "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bench_train_step"], env=env, cwd=REPO, capture_output=True, text=True
    )
    rows = [line.removeprefix(KEPT_ROW) for line in proc.stdout.splitlines() if line.startswith(KEPT_ROW)]
    if proc.returncode != 0 or len(rows) != 1:
        raise RuntimeError(f"the kept-freed-memory child failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return {"allocator": KEEP_FREED, **json.loads(rows[0])}


def main(out_dir: Path) -> dict:
    if DEVICE == "cpu":
        torch.set_num_threads(THREADS)
    if os.environ.get(KEPT_CHILD):
        with tempfile.TemporaryDirectory() as tmp:
            print(KEPT_ROW + json.dumps(measure(SHAPES[0], Path(tmp))), flush=True)
        return {}
    rows = {}
    for shape in SHAPES:
        with tempfile.TemporaryDirectory() as tmp:
            rows[shape.name] = row = measure(shape, Path(tmp))
        print(
            f"{shape.name}: tokens/s ours {row['tokens_per_s']['ours']}, speculators "
            f"{row['tokens_per_s']['speculators']} -> ratio {row['throughput_ratio']} "
            f"(min {row['throughput_ratio_min_max'][0]}, max {row['throughput_ratio_min_max'][1]}); "
            f"FLOP-limit fraction ours {row['flop_limit_fraction']['ours']}, speculators "
            f"{row['flop_limit_fraction']['speculators']}; shares {row['time_shares']}; AdamW step "
            f"{row['adamw_step_s']}"
            + (f"; compiled step {row['compile_speedup']}x the eager one" if row["compile_speedup"] else ""),
            flush=True,
        )
    figures = {
        "setting": {
            "draft_layers": DRAFT_LAYERS,
            "block": BLOCK,
            "markov_rank": MARKOV_RANK,
            "loss": LOSS,
            "confidence_head": True,
            "draft_vocab": "full",
            "dtype": str(DTYPE).removeprefix("torch."),
            "device": DEVICE,
            "threads": THREADS if DEVICE == "cpu" else None,
            "attention": ATTN,
            "compiled_layers": COMPILE,
            "rounds": ROUNDS,
        },
        "rows": rows,
    }
    if DEVICE == "cpu":
        kept = figures["kept_freed_memory"] = kept_freed_memory_row()
        print(
            f"{SHAPES[0].name}, freed memory kept: tokens/s ours {kept['tokens_per_s']['ours']}, speculators "
            f"{kept['tokens_per_s']['speculators']} -> ratio {kept['throughput_ratio']} "
            f"(min {kept['throughput_ratio_min_max'][0]}, max {kept['throughput_ratio_min_max'][1]}); "
            f"FLOP-limit fraction ours {kept['flop_limit_fraction']['ours']}, speculators "
            f"{kept['flop_limit_fraction']['speculators']}",
            flush=True,
        )
    return write_figures(out_dir, "train_step", figures)


if __name__ == "__main__":
    main(Path(__file__).resolve().parent / "results")
