"""Export checks against vLLM's loader: each check fails on an export that breaks it.

Real exported drafter dirs from tiny drafts, then corrupted the way a hand edit or
another trainer would; vLLM's side is the installed vLLM run in its subprocess
(`python -m dspark.extract.vllm_check`), once for all the dirs.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
from drafts import draft_config, make_draft, random_d2t
from safetensors.torch import load_file, save_file

import dspark.export
import dspark.servable
from dspark.errors import UserError
from dspark.export import export_drafter, load_drafter
from dspark.servable import check_servable, static_problems, vllm_problems
from dspark.verifier import VerifierHead

DRAFT_VOCAB = 2000


def edit_config(drafter, edit) -> None:
    path = drafter / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def drop_tensor(drafter, name: str) -> None:
    tensors = load_file(str(drafter / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(drafter / "model.safetensors"), metadata={"format": "pt"})


def without(key: str):
    return lambda config: {k: v for k, v in config.items() if k != key}


def plain_qwen3(config: dict) -> dict:
    """A drafter config that is no speculators config: the layers' Qwen3 config, naming Qwen3ForCausalLM."""
    return {**config["transformer_layer_config"], "architectures": ["Qwen3ForCausalLM"]}


@pytest.fixture(scope="module")
def verifier(tiny_qwen3_dir) -> VerifierHead:
    return VerifierHead.from_pretrained(tiny_qwen3_dir)


@pytest.fixture(scope="module")
def drafters(verifier, tiny_qwen3_dir, tmp_path_factory) -> dict:
    """name -> drafter dir: good exports and exports each broken in one way."""
    root = tmp_path_factory.mktemp("drafters")
    d2t = random_d2t(verifier.vocab_size, DRAFT_VOCAB)
    base = {
        "full": make_draft(verifier, draft_config()),
        "reduced": make_draft(verifier, draft_config(draft_vocab_size=DRAFT_VOCAB), d2t=d2t),
        "causal": make_draft(verifier, draft_config(causal_in_block=True, sliding_window=6)),
    }
    out = {name: export_drafter(m, root / name, str(tiny_qwen3_dir), vllm_check=False) for name, m in base.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the gated head's warning is checked below
        gated = make_draft(verifier, draft_config(markov_type="gated"))
        out["gated"] = export_drafter(gated, root / "gated", str(tiny_qwen3_dir), vllm_check=False)
    broken = {
        "no-d2t": ("reduced", lambda d: drop_tensor(d, "d2t")),
        "no-lm-head": ("reduced", lambda d: drop_tensor(d, "lm_head.weight")),
        "no-sample-from-anchor": ("full", lambda d: edit_config(d, without("sample_from_anchor"))),
        "no-confidence-with-markov": ("full", lambda d: edit_config(d, without("confidence_head_with_markov"))),
        "plain-qwen3": ("full", lambda d: edit_config(d, plain_qwen3)),
    }
    for name, (source, corrupt) in broken.items():
        shutil.copytree(out[source], root / name)
        corrupt(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def vllm_verdicts(drafters, tiny_qwen3_dir) -> dict:
    """vLLM's problems with each dir, one subprocess (the plain config names no verifier: given here)."""
    names = [n for n in drafters if n != "plain-qwen3"]
    by_dir = vllm_problems([drafters[n] for n in names])
    plain = vllm_problems([drafters["plain-qwen3"]], num_speculative_tokens=4, verifier=str(tiny_qwen3_dir))
    return {n: by_dir[drafters[n]] for n in names} | {"plain-qwen3": plain[drafters["plain-qwen3"]]}


def messages(problems) -> str:
    return " | ".join(p.message for p in problems)


@pytest.mark.parametrize("name", ["full", "reduced", "causal"])
def test_good_exports_pass_both_halves(drafters, vllm_verdicts, name):
    assert static_problems(drafters[name]) == []
    assert vllm_verdicts[name] == []


def test_gated_markov_head_is_unservable_not_broken(drafters, vllm_verdicts):
    (problem,) = static_problems(drafters["gated"])
    assert not problem.breaks_export and "vanilla Markov head" in problem.message
    # vLLM's own loader: it builds the vanilla head and refuses the gate's tensors
    assert "markov_head.gate_up_proj" in messages(vllm_verdicts["gated"])


@pytest.mark.parametrize("name, tensor", [("no-d2t", "d2t"), ("no-lm-head", "lm_head.weight")])
def test_reduced_vocabulary_needs_d2t_and_lm_head(drafters, vllm_verdicts, name, tensor):
    (problem,) = static_problems(drafters[name])
    assert problem.breaks_export and repr(tensor) in problem.message
    assert ("d2t mapping" if tensor == "d2t" else "must include lm_head") in messages(vllm_verdicts[name])


def test_absent_sample_from_anchor_is_refused(drafters, vllm_verdicts):
    (problem,) = static_problems(drafters["no-sample-from-anchor"])
    assert problem.breaks_export and "sample_from_anchor is absent" in problem.message
    assert "bonus-anchor layout" in messages(vllm_verdicts["no-sample-from-anchor"])  # vLLM reads it as false


def test_absent_confidence_head_with_markov_is_refused(drafters, vllm_verdicts):
    (problem,) = static_problems(drafters["no-confidence-with-markov"])
    assert problem.breaks_export and "confidence_head_with_markov is absent" in problem.message
    # vLLM builds the head without the Markov input: the stored projection does not fit
    assert "load_weights refuses" in messages(vllm_verdicts["no-confidence-with-markov"])


def test_architecture_must_map_to_the_qwen3_dspark_class(drafters, vllm_verdicts):
    got = messages(vllm_verdicts["plain-qwen3"])
    assert "DSparkDeepseekV4ForCausalLM, not Qwen3DSparkForCausalLM" in got, got
    assert any(p.breaks_export for p in static_problems(drafters["plain-qwen3"]))


def test_num_speculative_tokens_must_match_a_bidirectional_block(drafters):
    with pytest.raises(UserError, match="num_speculative_tokens=2 but the drafter's block size is 4"):
        check_servable(drafters["full"], num_speculative_tokens=2)
    assert "no slot past 4" in messages(static_problems(drafters["full"], num_speculative_tokens=5))
    # causal in block: a shorter block is exactly the trained block's prefix
    assert static_problems(drafters["causal"], num_speculative_tokens=2) == []


def test_check_servable_refuses_what_vllm_refuses(drafters, tiny_qwen3_dir):
    with pytest.raises(UserError, match="vanilla Markov head.*gate_up_proj"):
        check_servable(drafters["gated"])
    check_servable(drafters["reduced"], verifier=str(tiny_qwen3_dir))  # as eval.serve calls it
    with pytest.raises(UserError, match="not an exported drafter dir"):
        check_servable(drafters["full"].parent / "nope")


def test_export_refuses_broken_files_and_keeps_the_old_drafter(verifier, tiny_qwen3_dir, tmp_path, monkeypatch):
    out = tmp_path / "drafter"
    good = make_draft(verifier, draft_config(draft_vocab_size=DRAFT_VOCAB), d2t=random_d2t(verifier.vocab_size, 2000))
    export_drafter(good, out, str(tiny_qwen3_dir), extra_meta={"step": 1}, vllm_check=False)
    real = dspark.export.drafter_tensors
    monkeypatch.setattr(dspark.export, "drafter_tensors", lambda m: {k: v for k, v in real(m).items() if k != "d2t"})
    with pytest.raises(UserError, match="previous drafter is kept.*'d2t'"):
        export_drafter(good, out, str(tiny_qwen3_dir), extra_meta={"step": 2}, vllm_check=False)
    assert json.loads((out / "dspark_meta.json").read_text()) == {"step": 1}
    assert "d2t" in load_file(str(out / "model.safetensors"))
    assert not (tmp_path / "drafter.partial").exists()


def test_export_runs_vllms_check(verifier, tiny_qwen3_dir, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a servable drafter: no warning at all
        export_drafter(make_draft(verifier, draft_config()), tmp_path / "full", str(tiny_qwen3_dir))
    with pytest.warns(UserWarning, match="gate_up_proj"):  # vLLM's loader's words, as a warning
        gated = make_draft(verifier, draft_config(markov_type="gated"))
        export_drafter(gated, tmp_path / "gated", str(tiny_qwen3_dir))
    assert load_drafter(tmp_path / "gated").cfg.markov_type == "gated"  # still a valid speculators checkpoint


def test_vllms_acceptance_is_recorded_and_reused_only_for_the_same_files(
    verifier, tiny_qwen3_dir, tmp_path, monkeypatch
):
    out = export_drafter(make_draft(verifier, draft_config()), tmp_path / "full", str(tiny_qwen3_dir))
    record = json.loads((out / "vllm-check.json").read_text())
    assert record["result"]["refusals"] == [] and record["key"]["weights_sha256"]
    calls = []
    real_run = dspark.servable.subprocess.run
    monkeypatch.setattr(dspark.servable.subprocess, "run", lambda *a, **k: calls.append(a) or real_run(*a, **k))
    check_servable(out)
    check_servable(out, verifier=str(tiny_qwen3_dir))  # the verifier it names, given: the same verdict
    assert calls == [], "a recorded acceptance of the same files must not start vLLM again"
    check_servable(out, num_speculative_tokens=4)  # other arguments: checked afresh
    assert len(calls) == 1
    # Other weights under the old record: checked afresh, and a refusal is never recorded.
    gated = tmp_path / "gated"
    with pytest.warns(UserWarning):
        export_drafter(make_draft(verifier, draft_config(markov_type="gated")), gated, str(tiny_qwen3_dir))
    assert len(calls) == 2 and not (gated / "vllm-check.json").exists()
    shutil.copy(out / "vllm-check.json", gated / "vllm-check.json")
    with pytest.raises(UserError, match="gate_up_proj"):
        check_servable(gated)
    assert len(calls) == 3
