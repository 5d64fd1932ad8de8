"""The evaluation stage end to end: offline acceptance, calibration, speculative decoding, online speed,
report, card."""

from __future__ import annotations

import gc
import json
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from dspark.config import HeldoutConfig, TargetConfig
from dspark.eval import calibration as cal
from dspark.eval.card import write_card
from dspark.eval.config import CalibrationConfig, EvalConfig
from dspark.eval.decode import run_decode
from dspark.eval.offline import (
    BlockTable,
    check_compatible,
    evaluate_store,
    open_heldout_store,
    pick_device,
    read_sources,
    summarize,
)
from dspark.eval.online import load_prompts, run_online
from dspark.eval.report import read_report, write_plots, write_report
from dspark.eval.run_info import data_info, drafter_info, training_info
from dspark.export import load_drafter
from dspark.extract.config import ServerConfig
from dspark.model import DSparkDraft
from dspark.servable import WEIGHTS_FILE
from dspark.store import ShardStore
from dspark.target_dirs import file_sha256
from dspark.targets import check_store_name, dataset_target, resolve_target
from dspark.verifier import VerifierHead

CALIBRATION_FILE = "calibration.json"
CALIBRATION_LABEL = "analytic prefix acceptance Π_{j≤k} α_j (no Bernoulli sampling)"


def load_checked(
    drafter_dir: str | Path, target: TargetConfig, store_url: str
) -> tuple[DSparkDraft, VerifierHead, ShardStore, Path]:
    """Drafter, verifier head and held-out store, refused with a clear error when they do not belong together."""
    store = open_heldout_store(store_url)
    target_dir = verifier_dir_for(store, target, f"eval.store={store.url}")
    draft = load_drafter(drafter_dir)
    check_compatible(drafter_dir, draft, store, target.name_or_path, target_dir)
    verifier = VerifierHead.from_pretrained(target_dir)
    draft.load_verifier(verifier)
    return draft, verifier, store, target_dir


def verifier_dir_for(store: ShardStore, target: TargetConfig, where: str) -> Path:
    """The verifier's model dir, once the store is known to hold its states (the drafter's aux layers are
    checked by `check_compatible`)."""
    check_store_name(store.attrs, target.name_or_path, where)  # before resolving: the clearest error
    verifier_target = resolve_target(target)
    verifier_target.check_store(store.attrs, where, layers=False)
    return verifier_target.model_dir


def benchmark_section(
    drafter_dir: Path,
    draft: DSparkDraft,
    verifier: VerifierHead,
    target: TargetConfig,
    cfg: EvalConfig,
    heldout: HeldoutConfig,
) -> dict | None:
    """τ per standard eval set on the store of `data=benchmarks` (every sample of it, the `heldout`
    protocol's anchors); None without that store."""
    if cfg.bench_store is None:
        return None
    try:
        store = open_heldout_store(cfg.bench_store)
    except FileNotFoundError:
        return None
    check_compatible(
        drafter_dir, draft, store, target.name_or_path, verifier_dir_for(store, target, f"eval.bench_store={store.url}")
    )
    table = evaluate_store(draft, verifier, store, heldout, pick_device(cfg.offline.device), None)
    summary = summarize(table, cfg.offline, read_sources(cfg.bench_data_dir))
    return {
        "store": store.url,
        "samples": summary["samples"],
        "overall": summary["overall"],
        "by_benchmark": summary.get("by_source", {}),
    }


def split_samples(sample_ids: np.ndarray, fit_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint (fit, scored) sample-id sets; with a single sample both are that sample."""
    ids = np.unique(sample_ids)
    if ids.size < 2:
        return ids, ids
    if not 0.0 < fit_fraction < 1.0:
        raise ValueError(f"eval.calibration.fit_fraction must be in (0, 1), got {fit_fraction}")
    ids = np.random.default_rng(seed).permutation(ids)
    n_fit = min(max(1, round(fit_fraction * ids.size)), ids.size - 1)
    return np.sort(ids[:n_fit]), np.sort(ids[n_fit:])


def calibration_section(table: BlockTable, cfg: CalibrationConfig, seed: int) -> dict | None:
    """STS temperatures fitted on part of the held-out samples; raw vs scaled scores on the rest; the
    map vLLM is served (`served`): one slope and intercept, with `cfg.refit` and the head's inputs in
    `table` a cross-validated refit of the head around them (`calibration.refit_served_head`)."""
    if table.conf_logits is None:
        return None
    fit_ids, scored_ids = split_samples(table.sample_id, cfg.fit_fraction, seed)
    fit, scored = table.select(np.isin(table.sample_id, fit_ids)), table.select(np.isin(table.sample_id, scored_ids))
    temps = cal.fit_sequential_temperatures(fit.conf_logits, fit.alpha, fit.slot_mask, cfg.t_min, cfg.t_max)
    refit = None
    if cfg.refit and table.head_inputs is not None:
        refit = cal.refit_served_head(fit.conf_logits, fit.alpha, fit.slot_mask, fit.head_inputs, fit.sample_id, seed)
        slope, intercept = refit["slope"], refit["intercept"]
    else:
        slope, intercept = cal.fit_served_scaling(fit.conf_logits, fit.alpha, fit.slot_mask)

    def served(split: BlockTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if refit is not None:
            return cal.head_logits(split.conf_logits, split.head_inputs, refit), split.alpha, split.slot_mask
        return slope * np.asarray(split.conf_logits, np.float64) + intercept, split.alpha, split.slot_mask

    out_of_fold = refit is not None and refit["out_of_fold"] is not None
    fit_served = (cal.threshold_logits(refit, served(fit)[0]), fit.alpha, fit.slot_mask)

    def budget(fit_split: tuple, scored_split: tuple, temperatures: list[float] | None) -> dict:
        return cal.verification_budget(
            fit_split, scored_split, temperatures, cfg.max_tau_loss, scored_conversations=scored.sample_id, seed=seed
        )

    return {
        "label": CALIBRATION_LABEL,
        "objective": "nll",
        "temperatures": temps,
        "fit_samples": int(fit_ids.size),
        "scored_samples": int(scored_ids.size),
        "scored_on_fit_samples": bool(np.array_equal(fit_ids, scored_ids)),
        "before": cal.confidence_quality(scored.conf_logits, scored.alpha, scored.slot_mask, None, cfg.n_bins),
        "after": cal.confidence_quality(scored.conf_logits, scored.alpha, scored.slot_mask, temps, cfg.n_bins),
        # the one map vLLM serves, folded into the head by `save`, and what scheduling on it spares
        "served": {
            "slope": slope,
            "intercept": intercept,
            **({} if refit is None else {"refit": refit_record(refit)}),
            **cal.confidence_quality(*served(scored), None, cfg.n_bins),
            "budget": {
                **budget(fit_served, served(scored), None),
                "threshold_on": "fit samples, out of fold" if out_of_fold else "fit samples",
            },
        },
        "budget": budget(
            (fit.conf_logits, fit.alpha, fit.slot_mask), (scored.conf_logits, scored.alpha, scored.slot_mask), temps
        ),
    }


def refit_record(refit: dict) -> dict:
    """The report's record of a refit: the chosen ridge strength (None: the plain map won the
    cross-validation, or too few conversations), each candidate's cross-validated NLL, and the
    correction folded into the head, δ [F] and d."""
    return {
        "l2": refit["l2"],
        "cv_nll": refit["cv_nll"],
        "weight_delta": [float(v) for v in refit["weight_delta"]],
        "bias_delta": refit["bias_delta"],
    }


def earlier_folds(path: Path, weights: Path) -> list:
    """The maps an earlier `make eval` folded into this head: `calibration.json`'s `folds` where it was
    written for these very weights (`head_sha256`), none otherwise (no record, an unreadable one, a
    drafter exported again since, or a fold whose record a kill cut off)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict) or data.get("head_sha256") != file_sha256(weights):
        return []
    folds = data.get("folds")
    return folds if isinstance(folds, list) else []


def save_calibration(drafter_dir: Path, draft: DSparkDraft, calibration: dict) -> None:
    """Fold the served map into the drafter's confidence head (its file, then the loaded draft, so the
    decode and the online benchmark that follow serve it as vLLM will), then write `calibration.json`:
    the STS temperatures, every map `make eval` has folded into this head, oldest first, and the
    weights' sha256 they lead to."""
    served = {k: calibration["served"][k] for k in ("slope", "intercept")}
    refit = calibration["served"].get("refit")
    correction = {} if refit is None else {"weight_delta": refit["weight_delta"], "bias_delta": refit["bias_delta"]}
    path = drafter_dir / CALIBRATION_FILE
    weights = drafter_dir / WEIGHTS_FILE
    folds = earlier_folds(path, weights)
    cal.fold_into_head(weights, served["slope"], served["intercept"], **correction)
    proj = draft.confidence_head.proj
    with torch.no_grad():
        weight, bias = cal.scaled_head(proj.weight, proj.bias, served["slope"], served["intercept"], **correction)
        proj.weight.copy_(weight)
        proj.bias.copy_(bias)
    if refit is not None:
        served["refit"] = {
            "l2": refit["l2"],
            "weight_delta_norm": float(np.linalg.norm(refit["weight_delta"])),
            "bias_delta": refit["bias_delta"],
        }
    cal.save_calibration(
        path,
        calibration["temperatures"],
        {
            "objective": "nll",
            "label": CALIBRATION_LABEL,
            "fit_samples": calibration["fit_samples"],
            "ece_before": calibration["before"]["pooled"]["ece"],
            "ece_after": calibration["after"]["pooled"]["ece"],
            "ece_served": calibration["served"]["pooled"]["ece"],
            "folds": [*folds, served],
            "head_sha256": file_sha256(weights),
        },
    )


def offline_sections(
    drafter_dir: Path, target: TargetConfig, cfg: EvalConfig, heldout: HeldoutConfig
) -> tuple[dict, dict | None, dict | None, ShardStore]:
    """The offline, calibration and benchmarks report sections (and the store, for the data section).

    The offline τ is the trainer's held-out τ: the same scorer under the same `heldout` protocol.
    """
    draft, verifier, store, _ = load_checked(drafter_dir, target, cfg.store)
    refit = cfg.calibration.enabled and cfg.calibration.refit
    table = evaluate_store(
        draft, verifier, store, heldout, pick_device(cfg.offline.device), heldout.max_samples, head_inputs=refit
    )
    offline = {**summarize(table, cfg.offline, read_sources(cfg.data_dir)), "heldout": asdict(heldout)}
    calibration = calibration_section(table, cfg.calibration, heldout.seed) if cfg.calibration.enabled else None
    if calibration is not None and cfg.calibration.save:
        save_calibration(drafter_dir, draft, calibration)
    benchmarks = benchmark_section(drafter_dir, draft, verifier, target, cfg, heldout)
    del draft, verifier
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the servers of the online benchmark need the memory
    return offline, calibration, benchmarks, store


def publish(report: dict, out_dir: Path) -> dict:
    """Write the plots and report.json; returns the report as written (JSON-normalized)."""
    report["plots"] = write_plots(report, out_dir)
    return read_report(write_report(report, out_dir))


def evaluate_drafter(
    drafter_dir: str | Path, target: TargetConfig, cfg: EvalConfig, heldout: HeldoutConfig, server: ServerConfig
) -> dict:
    """Run every enabled part; write report.json, plots and (optionally) the model card. Returns the report.

    The report is written once the offline part is done too, so a failing online benchmark
    does not lose it.
    """
    drafter_dir = Path(drafter_dir)
    info = drafter_info(drafter_dir)
    out_dir = Path(cfg.out_dir)
    report: dict = {
        "drafter": info,
        "target": {"name": target.name, "name_or_path": target.name_or_path},
        "training": training_info(Path(cfg.train_run_dir or drafter_dir.parent), drafter_dir),
    }
    store = None
    if cfg.offline.enabled:
        report["offline"], report["calibration"], report["benchmarks"], store = offline_sections(
            drafter_dir, target, cfg, heldout
        )
    report["data"] = data_info(cfg.data_dir, store)
    report = publish(report, out_dir)
    if cfg.decode.enabled:
        report["decode"] = run_decode(drafter_dir, target, cfg, heldout)
        report = publish(report, out_dir)
    if cfg.online.enabled:
        verifier = resolve_target(target, dataset_target(cfg.data_dir))
        online = replace(
            cfg.online,
            max_model_len=cfg.online.max_model_len or verifier.config.max_model_len,
            dtype=cfg.online.dtype or verifier.config.dtype,
        )
        prompts = load_prompts(
            online.prompts_file, cfg.data_dir, online.num_prompts, online.max_model_len - online.max_tokens
        )
        report["online"] = run_online(
            verifier.model_dir,
            drafter_dir,
            info["block_size"],
            prompts,
            online,
            server,
            out_dir / "servers",
            cuda=torch.cuda.is_available(),
        )
        report = publish(report, out_dir)
    if cfg.write_card:
        # rendered from the report as written, so the card shows exactly the report's figures
        write_card(report, drafter_dir)
    return report


__all__ = [
    "CALIBRATION_FILE",
    "benchmark_section",
    "calibration_section",
    "evaluate_drafter",
    "load_checked",
    "offline_sections",
    "publish",
    "split_samples",
    "verifier_dir_for",
]
