"""Extraction and regeneration against servers that are dead, wrong or foreign; split files that are not UTF-8.

A real HTTP server on 127.0.0.1 (python's http.server in a thread) plays the wrong
server: garbage bodies, another model, staged files outside the staging dir, states of
another shape. No vLLM needed: each refusal comes before any real extraction.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import save_file

from dspark.errors import UserError
from dspark.extract.__main__ import run as run_stage
from dspark.extract.client import UnexpectedAnswer
from dspark.extract.data.__main__ import run as run_data_stage
from dspark.extract.data.regenerate import RegenerationError
from dspark.extract.dataset import DatasetError, read_split
from dspark.extract.server import free_port
from dspark.targets import tokenizer_sha256

REPO = Path(__file__).resolve().parents[1]


class FakeServer(BaseHTTPRequestHandler):
    """Answers as `self.server.mode` says; `self.server.staging` is where it 'stages' files."""

    def log_message(self, *args) -> None:
        pass

    def _send(self, body: bytes | str | dict, status: int = 200) -> None:
        data = (
            json.dumps(body).encode() if isinstance(body, dict) else (body.encode() if isinstance(body, str) else body)
        )
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        mode, model = self.server.mode, self.server.model
        if mode == "garbage":
            self._send("<html>hello</html>")
        elif mode == "wrong-model":
            self._send({"data": [{"id": "someone/else", "root": "/models/else"}]})
        else:
            self._send({"data": [{"id": model, "root": model}]})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = self.server.mode
        if self.path == "/v1/chat/completions":
            self._send({"choices": [{"text": "no message here"}]})
            return
        if mode == "bad-completion":
            self._send({"id": "x", "object": "text_completion"})
            return
        ids = request["prompt"]
        if mode == "outside":
            path = str(self.server.victim)
        else:  # "shape": states of another hidden size; "inf"/"huge": one state not finite as bf16
            path = str(self.server.staging / f"{len(ids)}.safetensors")
            hidden = torch.zeros(len(ids), 3, 32 if mode == "shape" else 64)
            if mode != "shape":
                hidden[2, 1, 5] = float("inf") if mode == "inf" else 3.4e38  # finite in fp32, inf in bf16
            save_file({"hidden_states": hidden, "token_ids": torch.tensor(ids)}, path)
            Path(path + ".lock").touch()
        self._send({"choices": [{"prompt_token_ids": ids}], "kv_transfer_params": {"hidden_states_path": path}})


@pytest.fixture(scope="module")
def fake(tmp_path_factory, tiny_qwen3_dir):
    tmp = tmp_path_factory.mktemp("fake-server")
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    server.mode, server.model = "garbage", str(tiny_qwen3_dir)
    server.staging = tmp / "staging"
    server.staging.mkdir(mode=0o700)
    server.victim = tmp / "victim.safetensors"
    server.victim.write_text("not yours")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, tiny_qwen3_dir) -> Path:
    data = tmp_path_factory.mktemp("data")
    (data / "summary.json").write_text(json.dumps({"target": {"tokenizer_sha256": tokenizer_sha256(tiny_qwen3_dir)}}))
    for split in ("train", "eval"):
        (data / f"{split}.jsonl").write_text(
            json.dumps({"sample_id": 0, "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}) + "\n"
        )
    return data


def extract_against(url: str, staging: Path, model_dir: Path, data: Path, root: Path, *extra: str) -> dict:
    overrides = [
        "target.name=tiny",
        f"target.name_or_path={model_dir}",
        "target.aux_layer_ids=[1,2]",
        "target.max_model_len=64",
        "target.dtype=float32",
        f"paths.root={root}",
        f"extract.data_dir={data}",
        f"extract.server_url={url}",
        f"extract.staging_dir={staging}",
        "extract.request_timeout_s=20",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return run_stage(compose(config_name="extract", overrides=overrides))


@pytest.mark.parametrize(
    "mode, message",
    [
        ("garbage", r"is not a vLLM extraction server: expected HTTP 200 with JSON \{'data'.*<html>hello"),
        ("wrong-model", r"serves 'someone/else'.*not the target"),
        ("bad-completion", r"expected a JSON completion \{'choices'"),
        ("outside", r"named the staged file .*victim\.safetensors.*outside the staging dir"),
        ("shape", r"returned hidden states of shape \[4, 3, 32\], expected \[4, 3, 64\]"),
    ],
)
def test_wrong_extraction_server_is_refused_by_name(mode, message, fake, tiny_qwen3_dir, data_dir, tmp_path):
    fake.mode = mode
    with pytest.raises(UnexpectedAnswer if mode != "wrong-model" else UserError, match=message) as err:
        extract_against(fake.url, fake.staging, tiny_qwen3_dir, data_dir, tmp_path)
    assert mode == "wrong-model" or fake.url in str(err.value)
    assert fake.victim.read_text() == "not yours", "a path outside the staging dir must not be touched"


@pytest.mark.parametrize("mode", ["inf", "huge"])
def test_non_finite_states_are_refused_before_the_store(mode, fake, tiny_qwen3_dir, data_dir, tmp_path):
    fake.mode = mode
    with pytest.raises(Exception, match=r"sample 0: non-finite hidden state at token 2, stored layer 1"):
        extract_against(fake.url, fake.staging, tiny_qwen3_dir, data_dir, tmp_path)
    assert not list((tmp_path / "store").rglob("hidden")), "nothing non-finite may reach a shard"


def test_dead_server_url_and_bad_staging_dir(tiny_qwen3_dir, data_dir, tmp_path, fake):
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UserError, match=rf"no server answers at {dead} \(extract.server_url\)"):
        extract_against(dead, fake.staging, tiny_qwen3_dir, data_dir, tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UserError, match="writable by no one else"):
        extract_against(fake.url, shared, tiny_qwen3_dir, data_dir, tmp_path)
    with pytest.raises(UserError, match="needs extract.staging_dir"):
        extract_against(fake.url, fake.staging, tiny_qwen3_dir, data_dir, tmp_path, "extract.staging_dir=null")
    with pytest.raises(UserError, match="extract.deterministic needs servers started by this run"):
        extract_against(fake.url, fake.staging, tiny_qwen3_dir, data_dir, tmp_path, "extract.deterministic=true")


def regenerate_against(url: str, model_dir: Path, root: Path) -> dict:
    """The data stage on one chat, regenerated by the server at `url`."""
    root.mkdir(parents=True)
    source = root / "chats.jsonl"
    source.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "What is two plus two?"},
                    {"role": "assistant", "content": "Four."},
                ]
            }
        )
        + "\n"
    )
    overrides = [
        "target.name=tiny",
        f"target.name_or_path={model_dir}",
        "target.aux_layer_ids=[1,2]",
        "target.max_model_len=256",
        "target.dtype=float32",
        "data=jsonl",
        f"data.path={source}",
        f"regen.server_url={url}",
        "regen.max_new_tokens=8",
        "regen.request_timeout_s=20",
        f"paths.root={root}",
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return run_data_stage(compose(config_name="data", overrides=overrides))


def test_regeneration_names_the_server_and_what_it_expected(fake, tiny_qwen3_dir, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # the server is checked as extraction checks it (extract.servers)
    with pytest.raises(UserError, match=rf"no server answers at {dead} \(regen.server_url\)"):
        regenerate_against(dead, tiny_qwen3_dir, tmp_path / "dead")
    fake.mode = "garbage"
    with pytest.raises(UnexpectedAnswer, match=rf"{fake.url}.*expected HTTP 200 with JSON \{{'data'.*<html>hello"):
        regenerate_against(fake.url, tiny_qwen3_dir, tmp_path / "garbage")
    fake.mode = "wrong-model"
    with pytest.raises(UserError, match=r"serves 'someone/else'.*not the target.*point regen.server_url at"):
        regenerate_against(fake.url, tiny_qwen3_dir, tmp_path / "wrong-model")
    fake.mode = "bad-completion"
    with pytest.raises(RegenerationError, match=rf"{fake.url}: expected a chat completion .*no message here"):
        regenerate_against(fake.url, tiny_qwen3_dir, tmp_path / "bad-chat")


def test_non_utf8_split_file_names_file_and_line(tmp_path):
    good = json.dumps({"sample_id": 0, "input_ids": [1], "loss_mask": [1]}).encode()
    (tmp_path / "train.jsonl").write_bytes(good + b"\n" + b'{"sample_id": 1, "x": "\xff\xfe"}\n')
    with pytest.raises(DatasetError, match=r"train\.jsonl:2: not UTF-8 \(byte 0xff at column 24\)"):
        read_split(tmp_path, "train", max_tokens=8, vocab_size=10)
