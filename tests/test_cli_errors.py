"""Every `python -m <stage>` entry point: a user error is one `error: ...` line and exit 2, a bug keeps its traceback.

Real subprocesses of the stages with bad input; no server starts (each refusal comes first).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from eval_fixtures import build_setup

from dspark.targets import tokenizer_sha256

REPO = Path(__file__).resolve().parents[1]


def tiny_target(model_dir: Path) -> list[str]:
    return [
        "target.name=tiny",
        f"target.name_or_path={model_dir}",
        "target.aux_layer_ids=[1,2]",
        "target.max_model_len=64",
        "target.dtype=float32",
    ]


def write_split(data_dir: Path, model_dir: Path | None, lines: dict[str, str]) -> Path:
    data_dir.mkdir(parents=True, exist_ok=True)
    sha = tokenizer_sha256(model_dir) if model_dir else "0" * 64
    (data_dir / "summary.json").write_text(json.dumps({"target": {"tokenizer_sha256": sha}}))
    for split, text in lines.items():
        (data_dir / f"{split}.jsonl").write_text(text)
    return data_dir


LAUNCH = [sys.executable, "-m", "train.launch", "--standalone", "--nproc_per_node"]  # what make train runs
GOOD_ROW = json.dumps({"sample_id": 0, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n"


def eval_args(setup) -> list[str]:
    """`python -m eval` on the eval fixture's verifier, store and data (as tests/eval_fixtures.compose_cfg)."""
    return [
        sys.executable,
        "-m",
        "eval",
        "target.name=tiny",
        f"target.name_or_path={setup.verifier_dir}",
        "target.aux_layer_ids=[1,2,3]",
        "target.max_model_len=512",
        f"paths.root={setup.root}",
        f"eval.data_dir={setup.data_dir}",
        f"eval.out_dir={setup.root / 'eval'}",
        "eval.online.enabled=false",
    ]


def broken_copy(src: Path, dst: Path, rel: str, edit) -> Path:
    """A copy of the directory `src` whose file `rel` is rewritten by `edit(text) -> text`."""
    shutil.copytree(src, dst)
    (dst / rel).write_text(edit((dst / rel).read_text()))
    return dst


def mask_token_past_the_vocabulary(text: str) -> str:
    return json.dumps({**json.loads(text), "mask_token_id": 10**6})


@pytest.fixture(scope="module")
def cases(tmp_path_factory, tiny_qwen3_dir) -> dict[str, list[str]]:
    """name -> command line of a stage run that must be refused."""
    tmp = tmp_path_factory.mktemp("cli")
    model = tiny_qwen3_dir
    setup = build_setup(tmp / "eval-setup")
    (tmp / "not-a-model").mkdir()
    not_json = broken_copy(setup.store, tmp / "bad-manifest", "manifest.json", lambda text: text[: len(text) // 2])
    bad_mask = broken_copy(setup.drafter, tmp / "bad-mask", "config.json", mask_token_past_the_vocabulary)
    (tmp / "empty.jsonl").write_text("")
    extract = [
        sys.executable,
        "-m",
        "extract",
        *tiny_target(model),
        f"paths.root={tmp / 'run'}",
        "server.ready_timeout_s=1",
    ]
    return {
        "extract: missing dataset": [*extract, f"extract.data_dir={tmp / 'missing'}"],
        "extract: empty split file": [
            *extract,
            "extract.data_dir=" + str(write_split(tmp / "empty", model, {"train": GOOD_ROW, "eval": ""})),
        ],
        "extract: dataset made for another target": [
            *extract,
            "extract.data_dir=" + str(write_split(tmp / "other", None, {"train": GOOD_ROW, "eval": GOOD_ROW})),
        ],
        "extract: misspelt key": [*extract, "extract.sever_url=http://127.0.0.1:1"],
        "extract.data: missing source file": [
            sys.executable,
            "-m",
            "extract.data",
            *tiny_target(model),
            "data=jsonl",
            f"data.path={tmp / 'missing.jsonl'}",
            "regen.enabled=false",
            f"paths.root={tmp / 'data-run'}",
        ],
        "extract.verify: no store": [sys.executable, "-m", "extract.verify", f"store={tmp / 'no-store'}"],
        "eval: no drafter": [sys.executable, "-m", "eval", f"drafter={tmp / 'no-drafter'}", *tiny_target(model)],
        "eval.decode: no drafter": [
            sys.executable,
            "-m",
            "eval.decode",
            f"drafter={tmp / 'no-drafter'}",
            *tiny_target(model),
        ],
        "eval.decode: bad temperatures": [
            sys.executable,
            "-m",
            "eval.decode",
            "eval.decode.temperatures=[1.0,1.0]",
            *tiny_target(model),
        ],
        "train: unknown config group option": [sys.executable, "-m", "train", "loss=no-such-loss"],
        "train: no train store": [
            sys.executable,
            "-m",
            "train",
            *tiny_target(model),
            f"paths.root={tmp / 'train-run'}",
            f"train.train_store={tmp / 'no-store'}",
        ],
        # make train GPUS=2: the launcher checks the config once, before any rank starts (one line, not two)
        "train.launch: non-finite lr": [*LAUNCH, "2", "-m", "train", "train.lr=inf"],
        "train.launch: misspelt key": [*LAUNCH, "2", "-m", "train", "train.lrr=0.001"],
        # a rank's own user error (the store is only opened there): its line, then the launcher's `train:` line
        "train.launch: no train store": [
            *LAUNCH,
            "1",
            "-m",
            "train",
            *tiny_target(model),
            f"paths.root={tmp / 'launch-run'}",
            f"train.train_store={tmp / 'no-store'}",
        ],
        "eval.serve: no drafter": [sys.executable, "-m", "eval.serve", "drafter=/nope", *tiny_target(model)],
        "eval.serve: target dir that is no model": [
            sys.executable,
            "-m",
            "eval.serve",
            "drafter=/nope",
            *tiny_target(model),
            f"target.name_or_path={tmp / 'not-a-model'}",
        ],
        "extract.verify: manifest not JSON": [sys.executable, "-m", "extract.verify", f"store={not_json}"],
        "extract.verify: store path through a file": [
            sys.executable,
            "-m",
            "extract.verify",
            f"store={not_json / 'manifest.json' / 'store'}",
        ],
        "eval: no held-out store": [*eval_args(setup), f"drafter={setup.drafter}", f"eval.store={tmp / 'no-store'}"],
        "eval: drafter mask token past the verifier vocabulary": [
            *eval_args(setup),
            f"drafter={bad_mask}",
            f"eval.store={setup.store}",
        ],
    }


EXPECTED = {
    "extract: missing dataset": "summary.json not found",
    "extract: empty split file": "eval.jsonl has no samples",
    "extract: dataset made for another target": "tokenized with another tokenizer",
    "extract: misspelt key": "Could not override 'extract.sever_url'",
    "extract.data: missing source file": "missing.jsonl",
    "extract.verify: no store": "no shard store",
    "eval: no drafter": "not an exported drafter dir",
    "eval.decode: no drafter": "not an exported drafter dir",
    "eval.decode: bad temperatures": "eval.decode.temperatures must be a non-empty list of distinct values",
    "train: unknown config group option": "no-such-loss",
    "train: no train store": "no shard store at",  # train/build.py
    "train.launch: non-finite lr": "train.lr must be a finite number, got inf",
    "train.launch: misspelt key": "Could not override 'train.lrr'",
    "train.launch: no train store": "no shard store at",
    "eval.serve: no drafter": "/nope: not an exported drafter dir",
    "eval.serve: target dir that is no model": "directory has no config.json",  # dspark/target_dirs.py
    "extract.verify: manifest not JSON": "manifest.json is malformed",
    "extract.verify: store path through a file": "Not a directory",  # an OSError at the entry
    "eval: no held-out store": "no held-out shard store there",  # eval/offline.py
    "eval: drafter mask token past the verifier vocabulary": "is outside the embedding",  # dspark/model.py
}


@pytest.fixture(scope="module")
def results(cases) -> dict[str, subprocess.CompletedProcess]:
    """All stage runs, four at a time (each mostly imports; two cores overlap them)."""

    def run(cmd: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(cases, pool.map(run, cases.values()), strict=True))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_user_error_is_one_line_and_exit_2(name, results):
    res = results[name]
    assert res.returncode == 2, f"exit {res.returncode}; stderr:\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr and "Error executing job" not in res.stderr, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, res.stderr[-3000:]
    assert EXPECTED[name] in errors[0], errors[0]


def test_launch_refuses_a_bad_config_before_any_rank_and_names_a_failed_rank(results):
    """With two ranks a config error would print twice: the launcher checks it first and starts no rank. An
    error only a rank can see (its store) is that rank's line, then the launcher's line naming the rank."""
    for name in ("train.launch: non-finite lr", "train.launch: misspelt key"):
        assert "train: rank" not in results[name].stderr, results[name].stderr[-3000:]
    last = results["train.launch: no train store"].stderr.rstrip().splitlines()[-1]
    assert last.startswith("train: rank 0 exited with status 2"), last


@pytest.mark.slow  # ~30 s or more on 2 cores: make test, not make test-fast
def test_unexpected_exception_keeps_its_traceback(tmp_path):
    script = tmp_path / "stage.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        from dspark.entry import stage_main
        from dspark.errors import UserError

        @stage_main("verify")
        def main(cfg):
            if cfg.store == "user":
                raise UserError("bad store")
            raise KeyError("a bug")

        main()
    """)
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    bug = subprocess.run([sys.executable, str(script), "store=bug"], env=env, capture_output=True, text=True)
    assert bug.returncode == 1 and "Traceback" in bug.stderr and "KeyError: 'a bug'" in bug.stderr, bug.stderr
    user = subprocess.run([sys.executable, str(script), "store=user"], env=env, capture_output=True, text=True)
    assert (user.returncode, user.stderr) == (2, "error: bad store\n")


@pytest.mark.slow  # three torchrun launches, ~30 s on 2 cores
def test_launch_names_the_failed_rank_and_exits_with_its_status(tmp_path):
    """`make train`'s launcher: torchrun's ChildFailedError traceback gives way to one line naming the rank
    that failed first; a rank's own traceback (a bug) stays; a signal becomes status 128 + its number."""
    ok, bug, killed = tmp_path / "ok.py", tmp_path / "bug.py", tmp_path / "killed.py"
    ok.write_text("print('ranks done')\n")
    bug.write_text("import os\nif os.environ['RANK'] == '1':\n    raise KeyError('a bug')\n")
    killed.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")

    def launch(script: Path, nproc: int) -> subprocess.CompletedProcess:
        return subprocess.run([*LAUNCH, str(nproc), str(script)], cwd=REPO, capture_output=True, text=True, timeout=300)

    res = launch(ok, 2)
    assert res.returncode == 0 and res.stdout.count("ranks done") == 2 and "train:" not in res.stderr, res.stderr
    res = launch(bug, 2)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "KeyError: 'a bug'" in res.stderr and "ChildFailedError" not in res.stderr, res.stderr[-3000:]
    assert res.stderr.rstrip().splitlines()[-1].startswith("train: rank 1 exited with status 1"), res.stderr[-3000:]
    res = launch(killed, 1)
    assert res.returncode == 128 + 9 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.stderr.rstrip().splitlines()[-1].startswith("train: rank 0 was killed by SIGKILL"), res.stderr[-3000:]
