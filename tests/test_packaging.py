"""What installing the project puts into an environment: one top-level name, `dspark`, and the stages on PATH.

The stage folders of the checkout (extract/, train/, eval/) install as dspark.extract,
dspark.train and dspark.eval, so the project neither shadows nor is shadowed by another
package called `train`, `eval` or `extract`; `python -m <stage>` from the checkout still runs.
"""

from __future__ import annotations

import configparser
import importlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "dspark", "extract", "train", "eval", "conf")


def console_scripts(wheel: zipfile.ZipFile) -> dict[str, str]:
    entry_points = next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
    parser = configparser.ConfigParser()
    parser.read_string(wheel.read(entry_points).decode())
    return dict(parser["console_scripts"])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of its sources (a build writes egg-info beside them)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("dspark_trainer-*.whl")
    return built


def test_the_wheel_holds_one_namespace_with_every_stage_and_its_configs(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        scripts = console_scripts(whl)
    assert {n.split("/")[0] for n in names} == {"dspark", next(n.split("/")[0] for n in names if ".dist-info/" in n)}
    for stage in ("extract", "train", "eval"):
        assert {f"dspark/{p.relative_to(REPO).as_posix()}" for p in (REPO / stage).rglob("*.py")} <= names
    assert {f"dspark/conf/{p.relative_to(REPO / 'conf').as_posix()}" for p in (REPO / "conf").rglob("*.yaml")} <= names
    assert {
        "dspark-data",
        "dspark-extract",
        "dspark-train",
        "dspark-launch",
        "dspark-eval",
        "dspark-decode",
        "dspark-serve",
    } <= set(scripts)
    for target in scripts.values():  # each names a callable of the installed namespace
        module, _, attr = target.partition(":")
        assert module.startswith("dspark."), target
        assert callable(getattr(importlib.import_module(module), attr)), target


def test_installed_wheel_runs_its_stages_without_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = (
        "import importlib.util as u, dspark.train.trainer as t, dspark.entry as e; "
        "print(t.__file__); print(e.CONF_DIR); print([u.find_spec(n) for n in ('train', 'eval', 'extract')])"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    )
    trainer_file, conf_dir, others = out.stdout.splitlines()
    assert Path(trainer_file).is_relative_to(site) and Path(conf_dir) == site / "dspark" / "conf"
    assert others == "[None, None, None]"  # nothing of ours answers to the bare stage names
    # a stage from PATH, outside the checkout, on the wheel's own configs: a user error is one line
    bad = subprocess.run(
        [str(site / "bin" / "dspark-verify"), f"store={tmp_path / 'no-store'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "no-store" in bad.stderr, bad.stderr
    cfg = subprocess.run(
        [str(site / "bin" / "dspark-train"), "--cfg", "job", "train.lr=1e-4"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert cfg.returncode == 0 and "lr: 0.0001" in cfg.stdout, cfg.stderr
    # torchrun with one-line failures, as make train runs it: a bad config is refused before any rank starts
    launch = subprocess.run(
        [
            str(site / "bin" / "dspark-launch"),
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "dspark.train",
            "train.lr=nan",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert launch.returncode == 2 and launch.stderr == "error: train.lr must be a finite number, got nan\n", (
        launch.stderr
    )


def test_checkout_environment_has_no_bare_stage_names(tmp_path):
    """The editable install of `make setup` maps only dspark.* onto the checkout; `python -m train` works from it."""
    probe = (
        "import importlib.util as u, dspark.train as t; "
        "print(t.__file__); print([u.find_spec(n) for n in ('train', 'eval', 'extract')])"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    trainer_init, others = out.stdout.splitlines()
    assert Path(trainer_init) == REPO / "train" / "__init__.py"
    assert others == "[None, None, None]"
    here = subprocess.run(
        [sys.executable, "-m", "train", "--cfg", "job", "train.lr=1e-4"], cwd=REPO, capture_output=True, text=True
    )
    assert here.returncode == 0 and "lr: 0.0001" in here.stdout, here.stderr
