"""Speculative decoding with an exported drafter is lossless: greedy outputs equal transformers' own greedy
decoding, and sampled sequences follow the verifier's distribution (chi-square against enumeration)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from decode_fixtures import decoder_for, export_small_drafter, make_small_verifier
from transformers import AutoModelForCausalLM

from dspark.eval.decode_runs import hf_generate
from dspark.eval.speculative import CostModel

PROMPTS = [[1, 5, 2], [3, 3, 0, 6, 1, 2, 7], [4], [7, 7, 1], [2, 0, 4, 4, 1], [6, 5]]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def naive_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Argmax of a full forward over the whole sequence, token by token (no cache, no EOS)."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_the_reference_decoding_does_not_stop_at_the_models_eos(tmp_path):
    """A verifier whose generation config names an EOS the greedy decoding passes through: the
    lossless check's reference (and the T=1 answers of the offline τ) still run to full length."""
    model = AutoModelForCausalLM.from_pretrained(make_small_verifier(tmp_path / "v", vocab=8, seed=3)).eval()
    prompt = PROMPTS[1]
    want = naive_greedy(model, prompt, 24)
    model.generation_config.eos_token_id = want[3]
    assert hf_generate(model, prompt, 24, 0.0) == want
    assert len(hf_generate(model, prompt, 24, 1.0, seed=0)) == 24


@pytest.fixture(scope="module")
def greedy_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_greedy")
    verifier = make_small_verifier(root / "verifier", vocab=8, seed=3)
    full = export_small_drafter(verifier, root / "full", None, block_size=4, seed=1)
    reduced = export_small_drafter(verifier, root / "reduced", [0, 2, 3, 5, 6], block_size=4, seed=1)
    return verifier, {"full": full, "reduced": reduced}


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("vocab", ["full", "reduced"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_equals_transformers_generate(greedy_setup, vocab, adaptive, device):
    verifier_dir, drafters = greedy_setup
    decoder, model = decoder_for(verifier_dir, drafters[vocab], device)
    # verifying n tokens costs more with n: the budget changes between steps
    costs = CostModel(draft_ms=1.0, verify_ms=np.array([0.0, 1.0, 1.6, 2.2, 2.8, 3.4])) if adaptive else None
    outputs = decoder.generate(PROMPTS, max_new_tokens=24, temperature=0.0, costs=costs)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.output_ids == hf_greedy(model, prompt, 24)
        produced = sum(a + 1 for a in out.accepted_per_step) + 1
        assert produced >= 24 and out.verifier_forwards == 1 + len(out.accepted_per_step)
        assert all(0 <= a <= d for a, d in zip(out.accepted_per_step, out.drafted_per_step))
    steps = [a for out in outputs for a in out.accepted_per_step]
    assert sum(steps) > 0, "no draft was ever accepted: the acceptance path went untested"
    drafted = {d for out in outputs for d in out.drafted_per_step}
    assert drafted == {4} if not adaptive else len(drafted) > 1


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of observed counts against cell probabilities, cells of expectation < 5 pooled."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@torch.no_grad()
def sequence_probs(model, prompt: list[int], length: int, vocab: int) -> np.ndarray:
    """Exact P(t_1..t_length | prompt) of every sequence, index = base-`vocab` digits, from the verifier's
    softmax at each prefix (one forward over all prefixes)."""
    prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=length - 1)))
    ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)
    logp = torch.log_softmax(model(ids).logits.double(), -1)[:, len(prompt) - 1 :]  # [n, length, V]
    step_lp = logp[:, :-1].gather(-1, prefixes[..., None])[..., 0].sum(-1)  # prefix log-prob [n]
    seq_lp = step_lp[:, None] + logp[:, -1]  # [n, V]: the last token appended
    return seq_lp.exp().flatten().numpy()


@pytest.mark.parametrize("draft_vocab", [None, [0, 1, 3, 4]], ids=["full", "reduced"])
def test_sampling_follows_the_verifier_distribution(tmp_path, draft_vocab):
    vocab, length, samples = 6, 4, 20_000
    verifier_dir = make_small_verifier(tmp_path / "verifier", vocab=vocab, seed=2, logit_scale=2.0)
    drafter = export_small_drafter(verifier_dir, tmp_path / "drafter", draft_vocab, block_size=2, seed=3)
    decoder, model = decoder_for(verifier_dir, drafter)
    prompt = [2, 5, 1]
    outputs = decoder.generate([prompt] * samples, max_new_tokens=length, temperature=1.0, seed=11)
    seqs = np.array([o.output_ids for o in outputs])
    index = (seqs * vocab ** np.arange(length - 1, -1, -1)).sum(1)
    counts = np.bincount(index, minlength=vocab**length)
    probs = sequence_probs(model, prompt, length, vocab)
    assert abs(probs.sum() - 1) < 1e-9
    accepted = np.array([a for o in outputs for a in o.accepted_per_step])
    # acceptances, rejections and the bonus token all occur
    assert (accepted == 0).any() and (accepted == 2).any()
    assert chi_square_p(counts, probs) > 0.01


def test_chi_square_detects_a_wrong_distribution():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(200))
    biased = probs * np.linspace(0.8, 1.2, 200)
    counts = np.bincount(rng.choice(200, 20_000, p=biased / biased.sum()), minlength=200)
    assert chi_square_p(counts, probs) < 0.01
    fair = np.bincount(rng.choice(200, 20_000, p=probs), minlength=200)
    assert chi_square_p(fair, probs) > 0.01
