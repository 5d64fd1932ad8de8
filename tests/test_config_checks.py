"""Config checks on the schemas: every pass refuses a bad value when its config is loaded,
with a `UserError` naming `section.field`, before any heavy work (real `python -m <stage>`
subprocesses for the data and extract passes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from dspark.config import DraftConfig, HeldoutConfig, LossConfig, TargetConfig, load_section
from dspark.errors import UserError
from dspark.eval.config import EvalConfig, PruneConfig
from dspark.eval.serve import ServeConfig
from dspark.extract.config import ExtractConfig, ServerConfig
from dspark.extract.data.config import RegenConfig, SourceConfig, TokenizeConfig
from dspark.train.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
# Every section each stage's config holds, as the stage loads it.
STAGE_SECTIONS = {
    "data": {
        "target": TargetConfig,
        "data": SourceConfig,
        "regen": RegenConfig,
        "tokenize": TokenizeConfig,
        "server": ServerConfig,
    },
    "extract": {"target": TargetConfig, "extract": ExtractConfig, "server": ServerConfig},
    "train": {
        "target": TargetConfig,
        "train": TrainConfig,
        "model": DraftConfig,
        "loss": LossConfig,
        "heldout": HeldoutConfig,
    },
    "eval": {"target": TargetConfig, "eval": EvalConfig, "heldout": HeldoutConfig, "server": ServerConfig},
    "serve": {"target": TargetConfig, "serve": ServeConfig, "server": ServerConfig},
    "prune": {"target": TargetConfig, "eval": EvalConfig, "heldout": HeldoutConfig, "prune": PruneConfig},
}


def composed(stage: str, *overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose(config_name=stage, overrides=list(overrides))


@pytest.mark.slow  # ~30 s or more on 2 cores: make test, not make test-fast
@pytest.mark.parametrize("overrides", [[], ["+experiment=qwen3-0.6b"], ["+experiment=demo"]])
def test_shipped_configs_pass_their_checks(overrides):
    for stage, sections in STAGE_SECTIONS.items():
        if "experiment=demo" in " ".join(overrides) and stage != "train":
            continue  # the demo experiment only sets train-side sections
        cfg = composed(stage, *overrides)
        for name, cls in sections.items():
            assert isinstance(load_section(cls, cfg, name), cls)


@pytest.mark.parametrize(
    "stage, override, section, message",
    [
        ("train", "train.lr=-1", "train", "train.lr must be > 0, got -1.0"),
        ("train", "train.init_layers_from_verifier=last", "train", "train.init_layers_from_verifier must be auto"),
        ("train", "train.init_fc_from_last_aux=maybe", "train", "train.init_fc_from_last_aux must be true, false"),
        ("train", "train.init_norm_from_verifier=yes", "train", "train.init_norm_from_verifier must be true, false"),
        ("train", "train.compile=always", "train", "train.compile must be true, false or auto"),
        ("train", "train.draft_vocab_from=sampled", "train", "train.draft_vocab_from must be one of"),
        ("train", "train.lr_scales={markov_embed_proj: -0.5}", "train", "train.lr_scales must map parameter-name"),
        ("train", "loss.hidden_weight=-1", "loss", "loss.hidden_weight must be >= 0"),
        ("train", "loss.hidden_slots=0", "loss", "loss.hidden_slots must be null or >= 1"),
        ("train", "train.warmup_ratio=1", "train", "train.warmup_ratio must be in [0, 1)"),
        ("train", "train.epochs=many", "train", "train.epochs: Value 'many'"),
        ("train", "model.block_size=0", "model", "model.block_size must be >= 1, got 0"),
        ("train", "model.markov_type=lstm", "model", "model.markov_type must be one of"),
        ("train", "loss.gamma=0", "loss", "loss.gamma must be > 0, got 0.0"),
        ("train", "+loss.weights.l1=1", "loss", "loss.weights: unknown term(s) ['l1']"),
        ("train", "target.max_model_len=0", "target", "target.max_model_len must be null or > 0"),
        ("data", "data.eval_fraction=1.5", "data", "data.eval_fraction must be in [0, 1]"),
        ("data", "regen.top_p=0", "regen", "regen.top_p must be in (0, 1]"),
        ("data", "tokenize.min_loss_tokens=-1", "tokenize", "tokenize.min_loss_tokens must be >= 0"),
        ("data", "target.dtype=fp64", "target", "target.dtype must be one of"),
        ("extract", "extract.connector=gpu", "extract", "extract.connector must be one of ['auto', 'cpu', 'stock']"),
        ("extract", "extract.splits=[]", "extract", "extract.splits is empty"),
        ("extract", "server.ready_timeout_s=0", "server", "server.ready_timeout_s must be > 0"),
        # the held-out protocol, one group (conf/heldout/) for train, eval and prune alike
        ("eval", "heldout.anchors_per_forward=0", "heldout", "heldout.anchors_per_forward must be >= 1, got 0"),
        ("train", "heldout.anchors_per_sample=0", "heldout", "heldout.anchors_per_sample must be null or >= 1, got 0"),
        ("eval", "heldout.anchors_per_sample=-5", "heldout", "heldout.anchors_per_sample must be null or >= 1, got -5"),
        ("train", "heldout.max_samples=0", "heldout", "heldout.max_samples must be null or >= 1, got 0"),
        ("train", "train.train_samples=0", "train", "train.train_samples must be null or >= 1, got 0"),
        ("prune", "heldout.seed=-1", "heldout", "heldout.seed must be >= 0, got -1"),
        ("train", "heldout.anchors_per_forward=-64", "heldout", "heldout.anchors_per_forward must be >= 1, got -64"),
        ("eval", "eval.calibration.fit_fraction=1", "eval", "eval.calibration.fit_fraction must be in (0, 1)"),
        ("eval", "eval.online.dtype=fp64", "eval", "eval.online.dtype must be one of"),
        ("serve", "serve.num_speculative_tokens=0", "serve", "serve.num_speculative_tokens must be null or >= 1"),
        ("prune", "prune.min_count=0", "prune", "prune.min_count must be >= 1"),
    ],
)
def test_a_bad_value_is_refused_at_load_time_naming_the_field(stage, override, section, message):
    cfg = composed(stage, override)
    with pytest.raises(UserError) as refused:
        load_section(STAGE_SECTIONS[stage][section], cfg, section)
    assert message in str(refused.value)


@pytest.mark.parametrize(
    "stage, override, section, message",
    [
        ("train", "train.lr=inf", "train", "train.lr must be a finite number, got inf"),
        ("train", "train.adam_betas=[0.9,nan]", "train", "train.adam_betas[1] must be a finite number, got nan"),
        (
            "train",
            "train.lr_scales={markov_embed_proj: -inf}",
            "train",
            "train.lr_scales.markov_embed_proj must be a finite number, got -inf",
        ),
        ("train", "loss.hidden_weight=nan", "loss", "loss.hidden_weight must be a finite number, got nan"),
        ("train", "loss.weights={tv: nan}", "loss", "loss.weights.tv must be a finite number, got nan"),
        ("train", "model.block_size=nan", "model", "model.block_size: Value 'nan' of type 'float' could not be"),
        ("eval", "eval.calibration.t_min=nan", "eval", "eval.calibration.t_min must be a finite number, got nan"),
        ("train", "heldout.anchors_per_sample=nan", "heldout", "heldout.anchors_per_sample: Value 'nan' of type"),
        ("eval", "heldout.max_samples=inf", "heldout", "heldout.max_samples: Value 'inf' of type"),
        ("eval", "heldout.seed=-inf", "heldout", "heldout.seed: Value '-inf' of type"),
        ("extract", "extract.request_timeout_s=inf", "extract", "extract.request_timeout_s must be a finite number"),
        ("data", "data.eval_fraction=nan", "data", "data.eval_fraction must be a finite number, got nan"),
        ("data", "regen.temperature=inf", "regen", "regen.temperature must be a finite number, got inf"),
    ],
)
def test_a_non_finite_number_is_refused_in_every_section(stage, override, section, message):
    """`nan < 0` is false, so a range check alone lets nan through (and a dict of weights would drop it)."""
    cfg = composed(stage, override)
    with pytest.raises(UserError) as refused:
        load_section(STAGE_SECTIONS[stage][section], cfg, section)
    assert message in str(refused.value)


def test_a_term_at_weight_zero_is_left_out():
    """A dict override merges into the default, so weight 0 is how a term is switched off."""
    cfg = composed("train", "loss.weights={ce: 0.0, tv: 0.9}", "++loss.weights.kl=0.5")
    assert load_section(LossConfig, cfg, "loss").weights == {"tv": 0.9, "kl": 0.5}


@pytest.mark.slow  # ~30 s or more on 2 cores: make test, not make test-fast
def test_stages_refuse_a_bad_value_before_any_work(tmp_path):
    runs = tmp_path / "runs"
    cases = {  # the stages start side by side: each must stop at its config (eval is covered in
        # process above: its imports alone take longer than the whole refusal)
        "error: data.eval_fraction must be in [0, 1], got 1.5": ["extract.data", "data.eval_fraction=1.5"],
        "error: extract.connector must be one of ['auto', 'cpu', 'stock'], got 'gpu'": [
            "extract",
            "extract.connector=gpu",
        ],
        "error: loss.weights.tv must be a finite number, got nan": ["train", "loss.weights={tv: nan}"],
    }
    procs = {
        message: subprocess.Popen(
            [sys.executable, "-m", *args, f"paths.root={runs}"],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for message, args in cases.items()
    }
    for message, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err[-2000:]
        assert message in err and "Traceback" not in err
        assert [line for line in err.splitlines() if line.startswith("error:")] == [message], err[-2000:]
    assert not runs.exists()  # nothing was written
