"""What produced a `make ablate` result: the commit, the stores' fingerprints, the resolved
config, and the keys a stored result is reused by.

A run's *train key* hashes what its drafter depends on: the resolved training config (every
override, the recipe, steps and seed, as composed by Hydra) and the fingerprints of the data it
reads (train and held-out stores, token counts, vocabulary mapping); the `heldout` section is left
out (it decides how a drafter is scored, not what it learns). Its *score key* adds that held-out
protocol. A stored result is reused only under the same score key; a drafter
under the same train key is re-scored, not retrained; anything else is retrained from step 0.
The commit is recorded, not keyed: a result stays reusable across commits of the code, and says
which commit (and whether the tree was dirty) it was trained and scored at.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

from dspark.errors import UserError
from dspark.target_dirs import file_sha256

REPO = Path(__file__).resolve().parents[1]
# Names that become path parts under runs_dir (variants) or conf/ (recipes).
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,99}")
# Keys of the resolved config that place a run, not what it trains.
PLACEMENT_KEYS = ("run_dir", "run_name", "resume")
# Keys that change how fast a run goes, not what it computes (`train.compile`: compiled kernels, the same
# step to float rounding; tests/test_model.py): runs that differ only in them score alike.
SPEED_KEYS = ("compile",)
# Keys that set how often a run logs and saves, not what it computes: a run resumed from its checkpoint trains as
# an unbroken one does (tests/test_train.py's kill loop), so runs that differ only in them score alike. They enter
# the key at these values, the ones every run of the shipped variant files was keyed with before checkpoints were
# saved during lever runs, so runs stored before keep their keys.
RECORDING_KEYS = {"save_every": 1000000, "keep_last": 3, "log_every": 1}


def check_name(kind: str, name: object) -> str:
    """`name` when safe as one path part (letters, digits, `_ . + -`, no `..`); else a UserError."""
    if not isinstance(name, str) or not SAFE_NAME.fullmatch(name) or ".." in name:
        raise UserError(
            f"{kind} name {name!r} is not allowed: use letters, digits and _ . + - "
            "(starting with a letter or digit, no '..', at most 100 characters); it becomes a folder name"
        )
    return name


def digest(value: object) -> str:
    """sha256 of a JSON value (keys sorted)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


# What a result's record does not count as a dirty tree: the results themselves, and prose (no code reads a
# `.md` file), so a result written while its docs or dev/LOG.md entry is being edited says clean.
NOT_CODE = (":(exclude)bench/results", ":(exclude,glob)**/*.md")


def git_state(repo: Path = REPO) -> dict:
    """{commit, dirty} of the working tree (dirty: tracked or new files differ, `NOT_CODE` aside); commit None
    outside git.

    `DSPARK_COMMIT` names the commit instead (dirty unknown), for a tree copied to another machine
    without its git folder or with a stale one.
    """
    if os.environ.get("DSPARK_COMMIT"):
        return {"commit": os.environ["DSPARK_COMMIT"], "dirty": None}
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--", ".", *NOT_CODE],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(status.strip())}


def store_fingerprint(url: str) -> str:
    """sha256 of a store's identity: its target, tokenizer and every committed shard's size and checksums."""
    from dspark.store import ShardStore

    store = ShardStore.open(url)
    shards = sorted((s["name"], s["n_samples"], s["n_tokens"], s["checksums"]) for s in store.manifest["shards"])
    return digest({"target": store.target, "tokenizer": store.attrs.get("tokenizer_sha256"), "shards": shards})


def file_fingerprint(path: str) -> str:
    """sha256 of a file's bytes."""
    return file_sha256(Path(path))


def data_fingerprints(train_cfg) -> dict:
    """Fingerprints of everything a run reads besides its config: stores, token counts, vocabulary mapping."""
    out = {}
    for key in ("train_store", "eval_store"):
        try:
            out[key] = store_fingerprint(str(train_cfg[key]))
        except (OSError, ValueError) as e:
            raise UserError(f"train.{key}: {e} (make the stores first: make data extract)") from e
    for key in ("token_freqs", "vocab_mapping"):
        path = train_cfg.get(key)
        if path is not None and Path(path).is_file():
            out[key] = file_fingerprint(str(path))
    return out


def resolved_config(full_cfg) -> tuple[dict, dict]:
    """The composed config as plain values, without the keys that only place the run or set its speed, its
    recording keys at fixed values, without its `heldout` section; and that section (the held-out protocol the
    run is scored by)."""
    from omegaconf import OmegaConf

    resolved = OmegaConf.to_container(full_cfg, resolve=True)
    for key in PLACEMENT_KEYS + SPEED_KEYS:
        resolved["train"].pop(key, None)
    resolved["train"].update(RECORDING_KEYS)
    return resolved, resolved.pop("heldout")


def provenance(full_cfg) -> dict:
    """{config_sha256, heldout, data, train_key, score_key} of one run's composed config."""
    config, heldout = resolved_config(full_cfg)
    config_sha = digest(config)
    data = data_fingerprints(full_cfg.train)
    train_key = digest({"config": config_sha, "data": data})
    return {
        "config_sha256": config_sha,
        "heldout": heldout,
        "data": data,
        "train_key": train_key,
        "score_key": digest({"train": train_key, "heldout": heldout}),
    }


def weights_digest(*modules) -> str:
    """sha256 of every tensor (name, dtype, shape, bytes) of the `modules`' state dicts, in order."""
    import torch

    h = hashlib.sha256()
    for module in modules:
        for name, tensor in sorted(module.state_dict().items()):
            h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            h.update(tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy())
    return h.hexdigest()


def read_json(path: Path) -> dict | None:
    """The JSON object at `path`; None when missing, torn or not an object (the result is redone)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
