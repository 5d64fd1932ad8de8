"""The decode stage on the tiny eval setup: files, report and card, outputs that recheck against
transformers, the lossless check's refusal, and its config checks."""

from __future__ import annotations

import json

import pytest
import torch
from eval_fixtures import build_setup, compose_cfg, configs
from transformers import Qwen3ForCausalLM

from dspark.config import load_section
from dspark.errors import UserError
from dspark.eval.config import DecodeConfig
from dspark.eval.decode_runs import (
    block_starts,
    check_lossless,
    decode_runs,
    given_costs,
    hf_generate,
    load_engine,
    prompt_sets,
)
from dspark.eval.evaluate import evaluate_drafter
from dspark.extract.config import ServerConfig

MAX_NEW = 12


@pytest.fixture(scope="module")
def decoded(tmp_path_factory):
    setup = build_setup(tmp_path_factory.mktemp("decode_stage"), n_samples=4)
    cfg = compose_cfg(
        setup,
        "eval.offline.enabled=false",
        "eval.decode.enabled=true",
        "eval.decode.prompts_per_benchmark=2",
        f"eval.decode.max_new_tokens={MAX_NEW}",
        "eval.decode.profile_replays=1",
    )
    target, eval_cfg, heldout = configs(cfg)
    report = evaluate_drafter(setup.drafter, target, eval_cfg, heldout, load_section(ServerConfig, cfg, "server"))
    return setup, report


def test_report_files_and_card(decoded):
    setup, report = decoded
    out = setup.root / "eval"
    section = json.loads((out / "decode.json").read_text())
    assert report["decode"] == section
    assert (out / section["plot"]).stat().st_size > 0
    kinds = {(r["benchmark"], r["temperature"], r["adaptive"]) for r in section["runs"]}
    assert kinds == {(b, t, a) for b in ("chat", "code", "all") for t in (0.0, 1.0) for a in (False, True)}
    for r in section["runs"]:
        assert r["generated_tokens"] == r["prompts"] * MAX_NEW
        assert 1.0 <= r["acceptance_length"] <= 1 + section["block_size"]
        assert r["verifier_forwards_saved"] == r["generated_tokens"] - r["verifier_forwards"]
    assert {c["benchmark"] for c in section["comparison"]} == {"chat", "code", "all"}
    # the offline τ on each T=1 run's own outputs, over the blocks the run drafted
    assert set(section["offline_tau_on_outputs"]) == {"chat", "code"}
    for c in section["comparison"]:
        if c["benchmark"] != "all":
            assert 1.0 <= c["offline_tau_on_outputs"] <= 1 + section["block_size"]
            assert c["gap_on_outputs"] == pytest.approx(c["decode_acceptance_length"] - c["offline_tau_on_outputs"])
    assert section["adaptive_costs"]["source"] == "profiled on cpu"
    # recorded in the form eval.decode.step_costs takes: it reads back as the same costs
    recorded = {k: section["adaptive_costs"][k] for k in ("draft_ms", "verify_ms")}
    assert len(recorded["verify_ms"]) == section["block_size"] + 1
    assert given_costs(recorded, section["block_size"]).as_step_costs() == recorded
    card = (setup.drafter / "README.md").read_text()
    assert "## Speculative decoding (transformers)" in card
    assert "step costs (profiled on cpu)" in card
    assert f"{section['offline_tau']['all']['tau_mean_over_prompts']:.3f}" in card


def test_outputs_recheck_against_transformers(decoded):
    """Every greedy row of decode_outputs.jsonl is the verifier's greedy decoding, rechecked here."""
    setup, _ = decoded
    rows = [json.loads(line) for line in (setup.root / "eval" / "decode_outputs.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2 * 2  # benchmarks x prompts x temperatures x fixed/adaptive
    model = Qwen3ForCausalLM.from_pretrained(setup.verifier_dir, dtype=torch.float32).eval()
    greedy = [r for r in rows if r["temperature"] == 0]
    for r in greedy:
        assert r["output_token_ids"] == hf_generate(model, r["prompt_token_ids"], MAX_NEW, 0.0)
        assert len(r["accepted_per_step"]) == r["verifier_forwards"] - 1
    sampled = [r["output_token_ids"] for r in rows if r["temperature"] == 1]
    assert all(len(s) == MAX_NEW for s in sampled)


def given_costs_run(setup, verify_ms: list[float]):
    """The adaptive greedy runs of one prompt per set under `eval.decode.step_costs` (no profiling)."""
    cfg = compose_cfg(
        setup,
        "eval.decode.prompts_per_benchmark=1",
        f"eval.decode.max_new_tokens={MAX_NEW}",
        "eval.decode.temperatures=[0.0]",
        f"eval.decode.step_costs={{draft_ms: 1.0, verify_ms: {verify_ms}}}",
    )
    target, eval_cfg, _ = configs(cfg)
    engine, model, tokenizer, max_len = load_engine(setup.drafter, target, torch.device("cpu"))
    sets = prompt_sets(eval_cfg, tokenizer, max_len - MAX_NEW)
    runs, costs = decode_runs(engine, model, sets, eval_cfg)  # greedy runs are checked lossless inside
    return engine.block_size, [o for r in runs if r.adaptive for o in r.outputs], costs


def test_given_step_costs_set_the_adaptive_budget(decoded):
    """Costs from the config drive vLLM's rule: when verifying more tokens costs nothing more every step
    sends the whole block; when a second verified token costs 1,000x the first, no step sends a draft."""
    setup, _ = decoded
    flat_B, flat, costs = given_costs_run(setup, [5.0] * 5)
    assert costs.draft_ms == 1.0 and costs.verify_ms.tolist() == [0.0] + [5.0] * 5
    assert {d for o in flat for d in o.drafted_per_step} == {flat_B}
    _, steep, _ = given_costs_run(setup, [1.0, 1000.0, 2000.0, 3000.0, 4000.0])
    assert {d for o in steep for d in o.drafted_per_step} == {0}
    assert all(sum(o.accepted_per_step) == 0 for o in steep)
    with pytest.raises(UserError, match=r"verify_ms must price a verifier forward of 1\.\.5 tokens.*got 3"):
        given_costs_run(setup, [1.0, 2.0, 3.0])


def test_block_starts_follow_the_accepted_drafts():
    # prompt of 5: anchors at 5 (first generated token), then +1+accepted each step: 2 -> 8, 0 -> 9, 3 -> 13
    assert block_starts(5, [2, 0, 3, 1]).tolist() == [5, 8, 9, 13]


def test_lossless_violation_names_prompt_and_position():
    prompts = [[1, 2], [3, 4, 5]]
    outputs = [[7, 8, 9], [10, 11, 12]]
    check_lossless("gsm8k", prompts, outputs, [list(o) for o in outputs])
    with pytest.raises(UserError, match=r"gsm8k prompt 1 \(3 tokens\).*generated token 2 \(12 vs 13\)"):
        check_lossless("gsm8k", prompts, outputs, [[7, 8, 9], [10, 11, 13]])


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("temperatures", [], "non-empty"),
        ("temperatures", [0.0, 0.0], "distinct"),
        ("temperatures", [-1.0], ">= 0"),
        ("max_new_tokens", 0, ">= 1"),
        ("device", "tpu", "one of"),
        ("step_costs", {"draft_ms": 1.0}, "verify_ms"),
        ("step_costs", {"draft_ms": -1.0, "verify_ms": [1.0, 2.0]}, "draft_ms: >= 0"),
        ("step_costs", {"draft_ms": 1.0, "verify_ms": [1.0, 0.0]}, "each > 0"),
        ("step_costs", {"draft_ms": 1.0, "verify_ms": [1.0, 2.0], "prefill_ms": 3.0}, "must be null or"),
    ],
)
def test_decode_config_refuses(field, value, message):
    good = dict(
        enabled=True,
        prompts_file=None,
        prompts_per_benchmark=2,
        max_new_tokens=8,
        temperatures=[0.0, 1.0],
        adaptive=True,
        offline_tau=True,
        batch_size=2,
        profile_replays=1,
        step_costs=None,
        seed=0,
        device="cpu",
    )
    DecodeConfig(**good)
    with pytest.raises(UserError, match=f"eval.decode.{field}.*{message}"):
        DecodeConfig(**{**good, field: value})
