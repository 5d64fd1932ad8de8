"""Small shard stores for the training tests, extracted from a tiny verifier with HF transformers.

The verifier is a tiny Qwen3 (real Qwen3 tokenizer) whose next-token distributions are as
peaked as a trained model's, so a draft can learn them, which is what the training tests
measure. As in the real pipeline, responses are sampled from the verifier itself; hidden
states are captured with forward pre-hooks (id k = the residual entering layer k; id N =
the input of the final norm: vLLM's layer-id convention) and written through `ShardStore`
as extraction does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from conftest import qwen_tokenizer_files
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from dspark.store import Sample, ShardStore, StoreWriter, bf16_to_bits
from dspark.targets import tokenizer_sha256
from dspark.verifier import resolve_aux_layer_ids
from dspark.vocab import count_tokens

# The verifier's "language": every data token has a few likely successors (bigram-like, as
# peaked as a trained LM's next-token distributions); the rest of the vocabulary shares a
# little probability mass, which a reduced draft vocabulary can never cover.
DATA_TOKENS = np.arange(1000, 1000 + 96)
SUCCESSOR_LOGITS = (10.0, 9.0, 8.0)
# The verifier keeps only the first VOCAB rows of Qwen3's vocabulary: every full-vocabulary
# target softmax is then ~75x cheaper, which keeps a few hundred CPU steps within a minute.
VOCAB = 2048
MASK_TOKEN_ID = VOCAB - 1


def make_bigram_verifier(out: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3 (4 layers, hidden 64) whose lm_head is built so that its next-token
    distribution after data token u peaks on u's successors (`SUCCESSOR_LOGITS`).

    Its embeddings are large next to the random layers' updates, so the final hidden state
    is close to the current token's embedding and `lm_head(norm(h))` reads the successor
    logits from it (plus noise from the other tokens' rows).
    """
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed.normal_(std=1.0)
        unit = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()  # what the final RMSNorm gives
        lm_head = model.get_output_embeddings().weight
        lm_head.zero_()
        for u in DATA_TOKENS:
            successors = rng.choice(DATA_TOKENS, len(SUCCESSOR_LOGITS), replace=False)
            for v, logit in zip(successors, SUCCESSOR_LOGITS, strict=True):
                lm_head[v] += logit * unit[u] / config.hidden_size
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(qwen_tokenizer_files()).save_pretrained(out)
    return out


def store_target(verifier_dir: Path, name_or_path: str | None = None, aux_layer_ids=None) -> dict:
    model_cfg = AutoConfig.from_pretrained(verifier_dir)
    aux = resolve_aux_layer_ids(model_cfg, aux_layer_ids)
    n = model_cfg.num_hidden_layers
    return {
        "name_or_path": name_or_path or str(verifier_dir),
        "hidden_size": model_cfg.hidden_size,
        "num_hidden_layers": n,
        "layer_ids": [*aux, n],
        "dtype": "bfloat16",
    }


@torch.no_grad()
def generate(verifier_dir: Path, prompts: np.ndarray, max_len: int, seed: int) -> np.ndarray:
    """Continue the prompts `[n, P]` by sampling from the verifier at temperature 1 (as `make
    data` regenerates responses with the verifier): `[n, max_len]` token ids."""
    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    out = model.generate(
        torch.from_numpy(prompts),
        attention_mask=torch.ones(prompts.shape, dtype=torch.long),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_len - prompts.shape[1],
        min_new_tokens=max_len - prompts.shape[1],
        pad_token_id=0,
    )
    return out.numpy().astype(np.int64)


@torch.no_grad()
def extract(verifier_dir: Path, layer_ids: list[int], token_ids: list[np.ndarray]) -> list[np.ndarray]:
    """Hidden states [T, L, H] (bf16 bits) at `layer_ids` for each token sequence."""
    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    captured: dict[int, torch.Tensor] = {}
    hooks = [model.model.norm.register_forward_pre_hook(lambda m, args: captured.__setitem__(n, args[0]))]
    for k in layer_ids[:-1]:
        hooks.append(
            model.model.layers[k].register_forward_pre_hook(lambda m, args, k=k: captured.__setitem__(k, args[0]))
        )
    out = []
    for ids in token_ids:
        model(torch.from_numpy(ids)[None])
        out.append(bf16_to_bits(torch.stack([captured[k][0] for k in layer_ids], dim=1)))
    for h in hooks:
        h.remove()
    return out


def write_store(
    url: Path,
    verifier_dir: Path,
    samples: list[tuple[np.ndarray, np.ndarray]],
    *,
    first_id: int = 0,
    target: dict | None = None,
    shard_size: int = 16,
    extra_attrs: dict | None = None,
) -> ShardStore:
    """A store holding `(token_ids, loss_mask)` samples with the verifier's hidden states."""
    target = target or store_target(verifier_dir)
    store = StoreWriter.create_or_open(url, target, tokenizer_sha256(verifier_dir), extra_attrs)
    hidden = extract(verifier_dir, target["layer_ids"], [ids for ids, _ in samples])
    rows = [
        Sample(first_id + i, ids.astype(np.int32), mask.astype(np.uint8), h)
        for i, ((ids, mask), h) in enumerate(zip(samples, hidden, strict=True))
    ]
    for start in range(0, len(rows), shard_size):
        store.write_shard(rows[start : start + shard_size])
    return store


def make_samples(
    verifier_dir: Path,
    n: int,
    seed: int,
    min_len: int = 24,
    max_len: int = 64,
    prompt_len: int = 6,
    empty_masks: int = 0,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`n` samples: a random prompt (not trained) and the verifier's sampled response
    (trained); the first `empty_masks` of them have no trained token at all."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=n)
    tokens = generate(verifier_dir, rng.choice(DATA_TOKENS, (n, prompt_len)), max_len, seed)
    out = []
    for i, length in enumerate(lengths):
        ids = tokens[i, :length]
        mask = np.ones(len(ids), dtype=np.uint8)
        mask[: 0 if i >= empty_masks else len(ids)] = 0
        mask[:prompt_len] = 0
        out.append((ids, mask))
    return out


def write_token_freqs(path: Path, samples: list[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> Path:
    counts = count_tokens([ids for ids, _ in samples], [mask for _, mask in samples], vocab_size)
    np.save(path, counts)
    return path


def tiny_run_settings(verifier: Path, train_store: Path, eval_store: Path, token_freqs: Path, **extra) -> dict:
    """Hydra overrides (key -> value) of a 1-layer draft trained on the tiny stores above; `extra` adds or replaces."""
    return {
        "target.name": "tiny",
        "target.name_or_path": str(verifier),
        "target.aux_layer_ids": "null",
        "target.mask_token_id": MASK_TOKEN_ID,
        "model.num_layers": 1,
        "model.draft_vocab_size": 128,
        "model.markov_rank": 32,
        "loss.num_anchors": 8,
        "loss.chunk_size": 256,
        "train.train_store": str(train_store),
        "train.eval_store": str(eval_store),
        "train.token_freqs": str(token_freqs),
        "train.lr": 1e-2,
        **extra,
    }
