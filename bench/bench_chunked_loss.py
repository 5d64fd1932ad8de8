"""Peak memory and time of the chunked DSpark loss against the same loss in one piece.

Setting: verifier vocabulary 151,936, 512 anchors x block 4 = 2,048 slots, hidden 1024
(Qwen3-0.6B sizes), the default objective (0.1 ce + 0.9 tv, confidence head), forward +
backward. The heads are stand-ins with the draft's shapes: frozen lm_head shared with the
verifier, Markov bias (rank 256, trainable) and a confidence head.

"unchunked" is `dspark_loss` with one chunk holding every slot; "chunked" uses 256 slots per
chunk, each keeping its [chunk, B, V] gradient for backward (the default while they fit the
memory budget); "recomputed" uses 256 slots per chunk with a zero budget (every chunk but the
first checkpointed: backward reruns both vocabulary projections).

How memory is measured: every variant runs in a fresh subprocess, which builds its
inputs, resets the kernel's peak-RSS counter (`/proc/self/clear_refs` = 5), runs the loss,
and reports the peak RSS above its resident size before the loss (VmHWM − VmRSS), i.e. the
memory the loss itself needed. Figures are reported as chunked / unchunked ratios.

Run: python -m bench.bench_chunked_loss   (or python -m bench only=chunked_loss)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import write_figures

VOCAB = 151_936
ANCHORS = 512
BLOCK = 4
HIDDEN = 1024
MARKOV_RANK = 256
CHUNK_SLOTS = 256


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def run_variant(chunk_slots: int, threads: int, keep_budget: int | None) -> dict:
    """Build inputs, then time the loss (forward + backward) and measure its peak RSS."""
    import torch
    from torch import nn

    from bench.bench_train_step import from_conf
    from dspark.config import LossConfig
    from dspark.losses import LossInputs, dspark_loss

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    lm_head = nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False)  # frozen, shared
    norm = nn.RMSNorm(HIDDEN).requires_grad_(False)
    w1 = nn.Embedding(VOCAB, MARKOV_RANK)
    w2 = nn.Linear(MARKOV_RANK, VOCAB, bias=False)
    conf = nn.Linear(HIDDEN + MARKOV_RANK, 1)

    def heads(hidden, prev):
        emb = w1(prev)
        return lm_head(hidden) + w2(emb), conf(torch.cat([hidden, emb], dim=-1)).squeeze(-1)

    def target_logits(target_hidden):
        return lm_head(norm(target_hidden))

    hidden = torch.randn(ANCHORS, BLOCK, HIDDEN, requires_grad=True)
    target_hidden = hidden.detach() + 0.5 * torch.randn(ANCHORS, BLOCK, HIDDEN)
    prev = torch.randint(0, VOCAB, (ANCHORS, BLOCK))
    labels = torch.randint(0, VOCAB, (ANCHORS, BLOCK))
    slot_mask = torch.ones(ANCHORS, BLOCK, dtype=torch.bool)
    cfg = from_conf(
        LossConfig,
        "loss/default.yaml",
        weights={"ce": 0.1, "tv": 0.9, "kl": 0.0},  # merged into the default's weights: kl is set
        confidence_weight=1.0,
        hidden_weight=0.0,
        gamma=4.0,
        num_anchors=ANCHORS,
        chunk_size=chunk_slots,
    )

    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    baseline_kib = _status_kib("VmRSS")
    # One pass: at these sizes a pass is a minute of CPU; CPU time is reported next to wall
    # time because a shared machine inflates wall time unevenly between the two runs.
    wall, cpu = time.perf_counter(), time.process_time()
    inputs = LossInputs(heads, target_logits, hidden, prev, target_hidden, labels, slot_mask, with_confidence=True)
    out = dspark_loss(inputs, cfg, keep_budget=keep_budget)
    out.loss.backward()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "chunk_slots": chunk_slots,
        "peak_mib": round((_status_kib("VmHWM") - baseline_kib) / 1024, 1),
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "loss": float(out.loss.detach()),
        "grad_norm_hidden": float(hidden.grad.norm()),
    }


def _spawn(chunk_slots: int, threads: int, keep_budget: int | None = None) -> dict:
    """One variant in a fresh interpreter, so its allocator and peak RSS start clean."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.bench_chunked_loss",
            "--variant",
            str(chunk_slots),
            str(threads),
            str(keep_budget),
        ],
        check=False,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    if proc.returncode != 0:
        raise RuntimeError(f"variant chunk_slots={chunk_slots} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-4 * abs(b)


def main(out_dir: Path) -> dict:
    threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    unchunked = _spawn(ANCHORS * BLOCK, threads)
    chunked = _spawn(CHUNK_SLOTS, threads)
    recomputed = _spawn(CHUNK_SLOTS, threads, keep_budget=0)
    figures = {
        "setting": {
            "vocab": VOCAB,
            "anchors": ANCHORS,
            "block": BLOCK,
            "hidden": HIDDEN,
            "markov_rank": MARKOV_RANK,
            "dtype": "float32",
            "device": "cpu",
            "threads": threads,
            "terms": "0.1 ce + 0.9 tv + confidence",
            "pass": "forward+backward",
            "memory": "peak RSS above pre-loss RSS, fresh process per variant",
        },
        "unchunked": unchunked,
        "chunked": chunked,
        "recomputed": recomputed,
        "recomputed_peak_memory_ratio": round(recomputed["peak_mib"] / unchunked["peak_mib"], 3),
        "recomputed_wall_time_ratio": round(recomputed["wall_s"] / unchunked["wall_s"], 3),
        "peak_memory_ratio": round(chunked["peak_mib"] / unchunked["peak_mib"], 3),
        "wall_time_ratio": round(chunked["wall_s"] / unchunked["wall_s"], 3),
        "cpu_time_ratio": round(chunked["cpu_s"] / unchunked["cpu_s"], 3),
        "same_result": all(
            _close(v[k], unchunked[k]) for v in (chunked, recomputed) for k in ("loss", "grad_norm_hidden")
        ),
    }
    for name in ("unchunked", "chunked", "recomputed"):
        v = figures[name]
        print(
            f"{name:9s} ({v['chunk_slots']} slots per chunk): peak {v['peak_mib']} MiB, "
            f"wall {v['wall_s']} s, cpu {v['cpu_s']} s"
        )
    print(
        f"chunked / unchunked: peak memory {figures['peak_memory_ratio']}x, wall time "
        f"{figures['wall_time_ratio']}x, cpu time {figures['cpu_time_ratio']}x, "
        f"same loss and gradient: {figures['same_result']}"
    )
    return write_figures(out_dir, "chunked_loss", figures)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--variant":
        budget = None if sys.argv[4] == "None" else int(sys.argv[4])
        print(json.dumps(run_variant(int(sys.argv[2]), int(sys.argv[3]), budget)))
    else:
        main(Path(__file__).resolve().parent / "results")
