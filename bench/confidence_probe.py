"""What a confidence head could rank on a trained draft's features: probes fitted on a frozen trunk.

vLLM's DSpark confidence head is one linear map of the draft's final hidden state and (with
`confidence_head_with_markov`) the Markov head's previous-token embedding. This asks how much of
the acceptance those features carry: on the held-out store, the features the head reads are
captured (a forward pre-hook on the head), and probes are fitted on the calibration's fit
conversations and scored on the others, by the same AUROC (`eval.calibration`) against the same
analytic acceptance. Each feature set (the hidden state, the Markov embedding, both) gets a linear
probe (what vLLM can serve) and a one-hidden-layer MLP (what it cannot), both with a bias per block
position. A probe near the trained head says the trunk's features, not the head's training, bound
its ranking; a probe well above it says the head is under-trained.

The probes see held-out conversations; a head a user could ship cannot. `refit_samples=N` also
refits the servable head itself (one linear map for every position, as vLLM serves it) on the
frozen draft's features over the first N conversations of the benchmark's *training* store, and
scores it on the same held-out conversations: what a refit of the head after training would buy.

    python -m bench.confidence_probe drafter=DIR bench_data=NAME out=FILE.json [steps=1000] [refit_samples=200]
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench import write_figures
from bench.ablate_record import file_fingerprint, store_fingerprint
from dspark.config import HeldoutConfig
from dspark.entry import script_main
from dspark.errors import UserError
from dspark.eval import calibration as cal
from dspark.eval.config import EvalConfig
from dspark.eval.offline import BlockTable

MLP_WIDTH = 64
REFIT_L2 = 1e-3  # on standardized features; 0 to 1e-2 gave AUROCs within 0.005 of each other on both benchmarks
REFIT_ANCHORS = 64  # anchors per training conversation the refit reads


def fit_probe(
    features: torch.Tensor, alpha: np.ndarray, mask: np.ndarray, fit: np.ndarray, width: int, steps: int, seed: int
) -> np.ndarray:
    """Logits [n, B] of a probe fitted by BCE against α on the `fit` blocks.

    features: [n, B, F] (standardized on the fit blocks here); alpha, mask: [n, B]; fit: [n] bool.
    `width` 0 is a linear probe, else an MLP of that width; both add a bias per position."""
    torch.manual_seed(seed)
    x = features.float()
    mean, std = x[fit].flatten(0, 1).mean(0), x[fit].flatten(0, 1).std(0) + 1e-6
    x = (x - mean) / std
    dim = x.shape[-1]
    net = (
        torch.nn.Linear(dim, 1)
        if width == 0
        else torch.nn.Sequential(torch.nn.Linear(dim, width), torch.nn.GELU(), torch.nn.Linear(width, 1))
    )
    position_bias = torch.zeros(x.shape[1], requires_grad=True)
    opt = torch.optim.AdamW([*net.parameters(), position_bias], lr=1e-2, weight_decay=0.01)
    y, weight = torch.from_numpy(alpha[fit]).float(), torch.from_numpy(mask[fit]).float()
    for _ in range(steps):
        logits = net(x[fit]).squeeze(-1) + position_bias
        loss = (F.binary_cross_entropy_with_logits(logits, y, reduction="none") * weight).sum() / weight.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return (net(x).squeeze(-1) + position_bias).double().numpy()


def refit_head(features: torch.Tensor, alpha: np.ndarray, mask: np.ndarray, l2: float = REFIT_L2):
    """(weight [F], bias) of a servable confidence head fitted by BCE against α on every valid slot.

    features: [n, B, F]; alpha, mask: [n, B]. One linear map for every block position (vLLM's head
    has no per-position term), fitted by L-BFGS on standardized features and mapped back."""
    x = features.double()
    valid = torch.from_numpy(np.asarray(mask, bool))
    mean, std = x[valid].mean(0), x[valid].std(0) + 1e-6
    xs = (x - mean) / std
    w = torch.zeros(x.shape[-1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    y, weight = torch.from_numpy(np.asarray(alpha, np.float64)), valid.double()
    opt = torch.optim.LBFGS([w, b], lr=1, max_iter=300, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        bce = F.binary_cross_entropy_with_logits(xs @ w + b, y, reduction="none")
        loss = (bce * weight).sum() / weight.sum() + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return w / std, b - (w / std * mean).sum()


def per_position_auroc(logits: np.ndarray, alpha: np.ndarray, mask: np.ndarray) -> list[float]:
    """AUROC of the predicted prefix survival per block position (`eval.calibration`)."""
    return [p["auroc"] for p in cal.confidence_quality(logits, alpha, mask, None, 10)["per_position"]]


def probe_table(
    features: dict[str, torch.Tensor], alpha: np.ndarray, mask: np.ndarray, fit: np.ndarray, steps: int
) -> dict:
    """{feature set: {linear, mlp: per-position AUROC on the non-fit blocks}}."""
    scored = ~fit
    return {
        name: {
            kind: per_position_auroc(
                fit_probe(x, alpha, mask, fit, width, steps, seed=0)[scored], alpha[scored], mask[scored]
            )
            for kind, width in (("linear", 0), ("mlp", MLP_WIDTH))
        }
        for name, x in features.items()
    }


def head_inputs(draft, verifier, store, heldout: HeldoutConfig) -> tuple[torch.Tensor, BlockTable]:
    """What the draft's confidence head reads [n, B, F] on `heldout`'s blocks of `store`, and the blocks' table."""
    from dspark.eval.offline import evaluate_store

    table = evaluate_store(draft, verifier, store, heldout, torch.device("cpu"), heldout.max_samples, head_inputs=True)
    return torch.from_numpy(table.head_inputs), table


def capture(
    drafter: str, overrides: list[str], refit_store: str | None = None, refit_samples: int = 0
) -> tuple[dict[str, torch.Tensor], BlockTable, EvalConfig, HeldoutConfig, tuple | None]:
    """The features the confidence head of `drafter` read [n, B, F] on the held-out store, the scored
    BlockTable, and the eval and held-out configs, under `python -m eval`'s config with `overrides`;
    with `refit_store`, also (features, table) of its first `refit_samples` samples."""
    import hydra

    from dspark.config import TargetConfig, load_section
    from dspark.entry import CONF_DIR
    from dspark.eval.evaluate import load_checked
    from dspark.eval.offline import check_compatible
    from dspark.store import ShardStore

    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = hydra.compose(config_name="eval", overrides=[f"drafter={drafter}", *overrides])
    target, ecfg = load_section(TargetConfig, cfg, "target"), load_section(EvalConfig, cfg, "eval")
    heldout = load_section(HeldoutConfig, cfg, "heldout")
    draft, verifier, store, target_dir = load_checked(drafter, target, ecfg.store)
    if draft.confidence_head is None:
        raise UserError(f"drafter={drafter} has no confidence head: nothing to probe")
    both, table = head_inputs(draft, verifier, store, heldout)
    hidden = draft.layer_config.hidden_size
    features = {"hidden": both[..., :hidden], "both": both}
    if both.shape[-1] > hidden:
        features["markov"] = both[..., hidden:]
    refit = None
    if refit_store is not None:
        train = ShardStore.open(refit_store)
        check_compatible(drafter, draft, train, target.name_or_path, target_dir)
        refit = head_inputs(
            draft, verifier, train, replace(heldout, max_samples=refit_samples, anchors_per_sample=REFIT_ANCHORS)
        )
    return features, table, ecfg, heldout, refit


def main(argv: list[str]) -> int:
    from bench import lever_data
    from dspark.eval.evaluate import split_samples

    args, record, overrides = lever_data.report_args(
        argv,
        "python -m bench.confidence_probe drafter=DIR bench_data=NAME out=FILE.json [steps=N] "
        "[refit_samples=N] [eval overrides]",
        frozenset({"steps", "refit_samples"}),
    )
    store = record["stores"]["eval"]["path"]
    refit_samples = int(args.get("refit_samples", 0))
    train_store = record["stores"]["train"]["path"] if refit_samples > 0 else None
    features, table, ecfg, heldout, refit = capture(args["drafter"], overrides, train_store, refit_samples)
    fit_ids, _ = split_samples(table.sample_id, ecfg.calibration.fit_fraction, heldout.seed)
    fit = np.isin(table.sample_id, fit_ids)
    scored = ~fit
    head = cal.confidence_quality(table.conf_logits[scored], table.alpha[scored], table.slot_mask[scored], None, 10)
    figures = {
        "drafter": args["drafter"],
        "drafter_model_safetensors_sha256": file_fingerprint(f"{args['drafter']}/model.safetensors"),
        "eval_store": store,
        "eval_store_fingerprint": store_fingerprint(store),
        "fit_conversations": int(fit_ids.size),
        "scored_conversations": int(np.unique(table.sample_id[scored]).size),
        "auroc_ceiling": [p["auroc_ceiling"] for p in head["per_position"]],
        "trained_head": [p["auroc"] for p in head["per_position"]],
        "probes": probe_table(features, table.alpha, table.slot_mask, fit, int(args.get("steps", 1000))),
    }
    if refit is not None:
        train_features, train_table = refit
        weight, bias = refit_head(train_features, train_table.alpha, train_table.slot_mask)
        logits = (features["both"].double() @ weight + bias).numpy()
        figures["refit_on_train"] = {
            "train_store": train_store,
            "train_store_fingerprint": store_fingerprint(train_store),
            "samples": refit_samples,
            "anchors_per_sample": REFIT_ANCHORS,
            "blocks": int(train_table.num_blocks),
            "l2": REFIT_L2,
            "auroc": per_position_auroc(logits[scored], table.alpha[scored], table.slot_mask[scored]),
        }
    out = Path(args["out"])
    write_figures(out.parent, out.stem, figures)
    print(
        f"trained head: {[round(a, 3) for a in figures['trained_head']]} (ceiling {[round(a, 3) for a in figures['auroc_ceiling']]})"
    )
    if refit is not None:
        print(f"head refitted on the training store: {[round(a, 3) for a in figures['refit_on_train']['auroc']]}")
    for name, kinds in figures["probes"].items():
        for kind, aurocs in kinds.items():
            print(f"{name:>7} {kind:>6}: {[round(a, 3) for a in aurocs]}")
    return 0


if __name__ == "__main__":
    script_main(main)
