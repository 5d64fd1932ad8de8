"""`bench.decode_report` on the tiny eval setup: the decode files of the lever tables' column and
the record of what made them."""

from __future__ import annotations

import json

from eval_fixtures import build_setup, setup_overrides


def test_decode_report_records_the_decode_and_its_provenance(tmp_path):
    """`bench.decode_report` on a real drafter: eval.decode's files at temperature 1 with fixed
    verification (the lever tables' column), and a record.json that names what made them."""
    from bench.ablate_record import file_fingerprint
    from bench.decode_report import decode_figures

    setup = build_setup(tmp_path, n_samples=4)
    prompts = setup.data_dir / "eval.jsonl"
    out = tmp_path / "decode"
    overrides = [
        *setup_overrides(setup),
        f"eval.decode.prompts_file={prompts}",
        "eval.decode.prompts_per_benchmark=1",
        "eval.decode.max_new_tokens=8",
    ]
    returned, record = decode_figures(str(setup.drafter), overrides, str(out))
    assert json.loads((out / "record.json").read_text()) == record
    section = json.loads((out / "decode.json").read_text())
    assert returned["runs"] == section["runs"]
    assert {(r["temperature"], r["adaptive"]) for r in section["runs"]} == {(1.0, False)}
    assert record["acceptance_length"]["all T=1"][0] == next(
        r["acceptance_length"] for r in section["runs"] if r["benchmark"] == "all"
    )
    assert record["drafter_model_safetensors_sha256"] == file_fingerprint(f"{setup.drafter}/model.safetensors")
    assert record["prompts_sha256"] == file_fingerprint(str(prompts))
    assert "eval.decode.adaptive=false" in record["command"] and "train_key" not in record
    # an override of a default wins, and the default is not passed a second time
    _, record = decode_figures(str(setup.drafter), [*overrides, "eval.decode.temperatures=[0.0]"], str(out))
    assert record["command"].count("eval.decode.temperatures") == 1
    assert list(record["acceptance_length"]) == ["chat T=0", "code T=0", "all T=0"]
