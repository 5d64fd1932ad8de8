"""The variant file of `make ablate` (`bench/ablate.yaml`): variants as deltas from named recipes.

A variant is a list of Hydra overrides of `python -m train` on the file's `recipe`, where an
entry `@other` stands for variant `other` (its recipe and overrides), or a mapping
`{recipe: NAME, overrides: [...], against: VARIANT}`. `against` is the reference the variant's
decision is measured against; it defaults to the first variant it builds on with `@`.

A file may `extends: OTHER.yaml` (a path relative to it): its keys replace the other file's and its
variants are added to the other file's (one of the same name replaced), so a second table shares the
first one's settings and lever definitions instead of repeating them; `only: [names]` then picks the
variants the file runs, in that order (the others stay available to `@`).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import yaml

from bench.ablate_record import REPO, check_name
from dspark.config import HeldoutConfig
from dspark.errors import UserError

RECIPES = REPO / "conf" / "recipe"
VARIANT_KEYS = {"recipe", "overrides", "against"}
FILE_KEYS = {
    "launcher",
    "runs_dir",
    "keep_checkpoints",
    "common",
    "recipe",
    "steps",
    "budgets",
    "seeds",
    "heldout",
    "reference",
    "variants",
}
# Keys a variant file may leave out, with their defaults.
OPTIONAL_KEYS = {"bench_data": None, "only": None}


def read_variant_file(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """The variant file at `path` as written, merged over the file it `extends`."""
    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"cannot read the variant file {path}: {e}") from e
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: a variant file is a mapping of keys, got {type(cfg).__name__}")
    base = cfg.pop("extends", None)
    if base is None:
        return cfg
    seen = (*seen, path.resolve())
    base_path = path.parent / str(base)
    if base_path.resolve() in seen:
        raise UserError(f"{path}: extends {base!r}, which extends it back")
    parent = read_variant_file(base_path, seen)
    return {**parent, **cfg, "variants": {**(parent.get("variants") or {}), **(cfg.get("variants") or {})}}


def load_config(path: Path) -> dict:
    """The variant file at `path` (with the file it extends), each variant it runs expanded to
    {recipe, overrides, against}."""
    cfg = read_variant_file(path)
    missing = sorted(FILE_KEYS - set(cfg or {}))
    if missing:
        raise UserError(f"{path}: missing keys {missing}")
    for key, value in OPTIONAL_KEYS.items():
        cfg.setdefault(key, value)
    if cfg["bench_data"] is not None:
        check_name("benchmark", cfg["bench_data"])
    check_recipe(path, cfg["recipe"])
    check_heldout(path, cfg["heldout"])
    specs = {check_name("variant", name): variant_spec(path, name, spec) for name, spec in cfg["variants"].items()}
    if cfg["reference"] not in specs:
        raise UserError(f"{path}: reference {cfg['reference']!r} is not one of the variants {list(specs)}")
    run = cfg.pop("only") or list(specs)
    if not isinstance(run, list) or set(run) - set(specs) or cfg["reference"] not in run:
        raise UserError(
            f"{path}: only must list variants of {list(specs)}, the reference {cfg['reference']!r} among them"
        )
    cfg["variants"] = {name: expand_variant(path, specs, name, cfg["recipe"]) for name in run}
    cfg["left_out"] = [name for name in specs if name not in run]  # defined, not named by `only:`
    return cfg


def check_variants(cfg: dict, names: list[str]) -> None:
    """Refuse names that are not variants the loaded file (`load_config`) runs, saying which of them
    it defines but leaves out of its `only:` list."""
    unknown = sorted(set(names) - set(cfg["variants"]))
    if unknown:
        left_out = [name for name in unknown if name in cfg.get("left_out", ())]
        hint = f" ({left_out} are defined but not in the file's `only:` list)" if left_out else ""
        raise UserError(
            f"unknown variant(s) {unknown}: not a variant the file runs; it runs {list(cfg['variants'])}{hint}"
        )


def check_heldout(path: Path, heldout: object) -> dict:
    """The file's `heldout` mapping: keys of the shared held-out protocol (`conf/heldout/`) to override."""
    known = {f.name for f in fields(HeldoutConfig)}
    if not isinstance(heldout, dict) or set(heldout) - known:
        raise UserError(f"{path}: heldout must map keys of {sorted(known)} (conf/heldout/) to values, got {heldout!r}")
    return heldout


def check_recipe(path: Path, recipe: object) -> str:
    name = check_name("recipe", recipe)
    if not (RECIPES / f"{name}.yaml").is_file():
        have = sorted(p.stem for p in RECIPES.glob("*.yaml"))
        raise UserError(f"{path}: recipe {name!r} is not in {RECIPES} (have {have})")
    return name


def variant_spec(path: Path, name: str, spec: object) -> dict:
    """{recipe, overrides, against} of a variant written as a list of overrides or as a mapping."""
    if isinstance(spec, list):
        spec = {"overrides": spec}
    if not isinstance(spec, dict) or set(spec) - VARIANT_KEYS:
        raise UserError(f"{path}: variant {name!r} must be a list of overrides or a mapping of {sorted(VARIANT_KEYS)}")
    out = {"recipe": spec.get("recipe"), "overrides": spec.get("overrides") or [], "against": spec.get("against")}
    if out["recipe"] is not None:
        check_recipe(path, out["recipe"])
    if not isinstance(out["overrides"], list):
        raise UserError(f"{path}: variant {name!r}: overrides must be a list")
    return out


def expand_variant(path: Path, specs: dict, name: str, base: str, seen: tuple[str, ...] = ()) -> dict:
    """{recipe, overrides, against} of a variant, each `@other` replaced by variant `other` (expanded)."""
    if name in seen:
        raise UserError(f"{path}: variants refer to each other in a cycle: {' -> '.join([*seen, name])}")
    spec = specs[name]
    recipe, overrides, refs = spec["recipe"], [], []
    for item in spec["overrides"]:
        if not (isinstance(item, str) and item.startswith("@")):
            overrides.append(item)
            continue
        if item[1:] not in specs:
            raise UserError(f"{path}: variant {name!r} refers to {item!r}, which is not a variant")
        other = expand_variant(path, specs, item[1:], base, (*seen, name))
        if recipe is not None and other["recipe"] != recipe:
            raise UserError(
                f"{path}: variant {name!r} (recipe {recipe!r}) refers to {item!r} (recipe {other['recipe']!r})"
            )
        recipe = other["recipe"]
        overrides += other["overrides"]
        refs.append(item[1:])
    against = spec["against"] if spec["against"] is not None else (refs[0] if refs else None)
    if against is not None and against not in specs:
        raise UserError(f"{path}: variant {name!r} is measured against {against!r}, which is not a variant")
    return {"recipe": recipe or base, "overrides": overrides, "against": against}
