"""A drafter's speculative-decoding acceptance on a lever benchmark's held-out prompts, with what made it.

Runs `python -m eval.decode` (transformers, the verifier checking the drafter's blocks; temperature 1
and fixed verification unless overridden) on the benchmark's held-out prompts, writes decode.json,
decode_outputs.jsonl and decode.png to `out`, and beside them record.json: the commit, the drafter's
weights and config hashes, the prompts' hash, the command, and where the drafter is a `make ablate`
run's, that run's training key and store fingerprints. A `decode/<variant>/` folder under
`bench/results/levers/<benchmark>/` is then re-made by one command:

    python -m bench.decode_report drafter=DIR bench_data=NAME out=DIR [eval.decode overrides]
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from bench import write_figures
from bench.ablate_record import file_fingerprint, git_state
from dspark.entry import script_main

# What the lever tables' decode column reports; each is overridable on the command line.
DECODE_DEFAULTS = [
    "eval.decode.temperatures=[1.0]",
    "eval.decode.adaptive=false",
    "eval.decode.offline_tau=false",
]


def _key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~")


def decode_figures(drafter: str, overrides: list[str], out_dir: str) -> tuple[dict, dict]:
    """Decode with `drafter` under `python -m eval.decode`'s config with `overrides` into `out_dir`;
    returns the decode section and the record of what made it (written there as record.json), with
    the section's acceptance lengths."""
    import hydra

    from dspark.config import HeldoutConfig, TargetConfig, load_section
    from dspark.entry import CONF_DIR
    from dspark.eval.config import EvalConfig
    from dspark.eval.decode import run_decode

    given = {_key(a) for a in overrides} - {"eval.out_dir"}
    args = [
        f"drafter={drafter}",
        *(a for a in DECODE_DEFAULTS if _key(a) not in given),
        *(a for a in overrides if _key(a) != "eval.out_dir"),
    ]
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = hydra.compose(config_name="decode", overrides=[*args, f"eval.out_dir={out_dir}"])
    eval_cfg = load_section(EvalConfig, cfg, "eval")
    section = run_decode(
        Path(drafter), load_section(TargetConfig, cfg, "target"), eval_cfg, load_section(HeldoutConfig, cfg, "heldout")
    )
    record = {
        "made": {**git_state(), "date": datetime.date.today().isoformat()},
        "command": "python -m eval.decode " + " ".join([*args, f"eval.out_dir={out_dir}"]),
        "drafter": drafter,
        "drafter_model_safetensors_sha256": file_fingerprint(f"{drafter}/model.safetensors"),
        "drafter_config_sha256": file_fingerprint(f"{drafter}/config.json"),
    }
    run_record = Path(drafter).parent / "ablate.json"  # a `make ablate` run: what it was trained on
    if run_record.is_file():
        run = json.loads(run_record.read_text())
        record |= {"train_key": run.get("train_key"), "data": run.get("data")}
    if eval_cfg.decode.prompts_file is not None:
        record["prompts_sha256"] = file_fingerprint(eval_cfg.decode.prompts_file)
    record["acceptance_length"] = {
        f"{r['benchmark']} T={r['temperature']:g}{' adaptive' if r['adaptive'] else ''}": [
            r["acceptance_length"],
            r["acceptance_length_se"],
        ]
        for r in section["runs"]
    }
    return section, write_figures(Path(out_dir), "record", record)


def main(argv: list[str]) -> int:
    from bench import lever_data
    from dspark.eval.decode import headline

    args, record, overrides = lever_data.report_args(
        argv, "python -m bench.decode_report drafter=DIR bench_data=NAME out=DIR [overrides]"
    )
    prompts = f"eval.decode.prompts_file={Path(record['data_dir']) / 'eval.jsonl'}"
    section, _ = decode_figures(args["drafter"], [prompts, *overrides], args["out"])
    print(headline(section))
    print(f"record: {Path(args['out']) / 'record.json'}")
    return 0


if __name__ == "__main__":
    script_main(main)
