"""A drafter's confidence-head figures on a lever benchmark, with what made them.

Runs `python -m eval`'s offline evaluation and calibration (no vLLM server, no decoding) on the
benchmark's held-out store, and writes the report's calibration section (per-position AUROC and
ECE before and after the sequential temperature scaling, the verification budget with its SEs)
beside the commit, the drafter's weights hash, the store's fingerprint and the command, so a
`confidence.json` under `bench/results/levers/<benchmark>/` is re-made by one command:

    python -m bench.confidence_report drafter=DIR bench_data=NAME out=FILE.json [eval overrides]
"""

from __future__ import annotations

import datetime
import tempfile

from bench.ablate_record import file_fingerprint, git_state, store_fingerprint
from dspark.entry import script_main
from dspark.errors import UserError

# The report's sections this needs; the others start servers or decode.
OFFLINE_ONLY = [
    "eval.online.enabled=false",
    "eval.decode.enabled=false",
    "eval.bench_store=null",
    "eval.calibration.save=false",
    "eval.write_card=false",
]


def confidence_figures(drafter: str, overrides: list[str]) -> dict:
    """The eval report's offline τ and calibration section for `drafter` under `python -m eval`'s
    config with `overrides` (its store, target, ...), with their provenance."""
    import hydra

    from dspark.entry import CONF_DIR
    from eval.__main__ import run

    fixed = {a.split("=", 1)[0] for a in OFFLINE_ONLY} | {"eval.out_dir"}
    with tempfile.TemporaryDirectory() as tmp:
        args = [f"drafter={drafter}", *(a for a in overrides if a.split("=", 1)[0] not in fixed), *OFFLINE_ONLY]
        with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = hydra.compose(config_name="eval", overrides=[*args, f"eval.out_dir={tmp}"])
        report = run(cfg)
    if not report.get("calibration"):
        raise UserError(f"drafter={drafter}: the eval report has no calibration section (no confidence head?)")
    store = cfg.eval.store
    return {
        "made": {**git_state(), "date": datetime.date.today().isoformat()},
        "command": "python -m eval " + " ".join(args),
        "drafter": drafter,
        "drafter_model_safetensors_sha256": file_fingerprint(f"{drafter}/model.safetensors"),
        "eval_store": store,
        "eval_store_fingerprint": store_fingerprint(store),
        "offline_tau": report["offline"]["overall"]["tau"],
        "calibration": report["calibration"],
    }


def main(argv: list[str]) -> int:
    from bench import lever_data

    figures = lever_data.write_report(
        argv,
        "python -m bench.confidence_report drafter=DIR bench_data=NAME out=FILE.json [overrides]",
        confidence_figures,
    )
    budget = figures["calibration"]["budget"]
    print(f"tau {figures['offline_tau']:.4f}")
    print("AUROC before STS:", [round(p["auroc"], 3) for p in figures["calibration"]["before"]["per_position"]])
    pooled = {k: figures["calibration"][k]["pooled"]["ece"] for k in ("before", "after", "served")}
    print("pooled ECE raw {before:.4f}, STS {after:.4f}, as served {served:.4f}".format(**pooled))
    for name in ("fixed", "confidence", "oracle"):
        print(f"{name:>10} saves {budget[name]['saved']:.1%} +- {budget[name].get('saved_se', 0):.1%}")
    served = figures["calibration"]["served"]["budget"]["confidence"]
    print(f"as served saves {served['saved']:.1%} +- {served['saved_se']:.1%} (tau loss {served['tau_loss']:.2%})")
    return 0


if __name__ == "__main__":
    script_main(main)
