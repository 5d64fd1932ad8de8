"""dspark.losses against a naive per-slot loop, chunked against unchunked, and the normalizer."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dspark.config import LossConfig
from dspark.losses import LossInputs, dspark_loss, position_weights, term_names, weight_sum
from dspark.vocab_terms import TILE_ELEMENTS, term_weights, tile_rows

H, V, R, B = 12, 40, 6, 4


class DraftHeads(nn.Module):
    """Stand-in for the draft's output side: lm_head over the draft vocabulary + Markov bias + confidence."""

    def __init__(self, draft_vocab: int):
        super().__init__()
        self.lm_head = nn.Linear(H, draft_vocab, bias=False)
        self.w1 = nn.Embedding(V, R)
        self.w2 = nn.Linear(R, draft_vocab, bias=False)
        self.conf = nn.Linear(H + R, 1)

    def draft_logits(self, hidden, prev):
        return self.lm_head(hidden) + self.w2(self.w1(prev))

    def confidence_logits(self, hidden, prev):
        return self.conf(torch.cat([hidden, self.w1(prev)], dim=-1)).squeeze(-1)


class Verifier(nn.Module):
    """Stand-in for the verifier head: final RMSNorm then full-vocabulary lm_head."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(H)
        self.lm_head = nn.Linear(H, V, bias=False)

    def logits(self, h):
        return self.lm_head(self.norm(h))


def make_cfg(
    weights=None, chunk_size=4, confidence_weight=0.7, gamma=4.0, hidden_weight=0.0, hidden_slots=None
) -> LossConfig:
    return LossConfig(
        weights=weights if weights is not None else {"ce": 0.1, "tv": 0.9, "kl": 0.3},
        confidence_weight=confidence_weight,
        gamma=gamma,
        num_anchors=8,
        chunk_size=chunk_size,
        anchor_sampling="uniform",
        hidden_weight=hidden_weight,
        hidden_slots=hidden_slots,
        train_on_prompt=False,
    )


def make_case(seed: int, n: int = 7, draft_vocab: int | None = None):
    """Heads, verifier, inputs (float64 for tight comparisons) and an optional d2t."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    d2t = None
    if draft_vocab is not None:
        ids = torch.randperm(V, generator=g)[:draft_vocab].sort().values
        d2t = ids - torch.arange(draft_vocab)
    heads = DraftHeads(draft_vocab or V).double()
    verifier = Verifier().double().requires_grad_(False)
    hidden = torch.randn(n, B, H, generator=g, dtype=torch.float64, requires_grad=True)
    target_hidden = 3 * torch.randn(n, B, H, generator=g, dtype=torch.float64)
    prev = torch.randint(0, V, (n, B), generator=g)
    labels = torch.randint(0, V, (n, B), generator=g)
    # Contiguous prefixes of random length, including empty blocks and full blocks.
    lengths = torch.randint(0, B + 1, (n,), generator=g)
    lengths[0], lengths[1] = B, 0
    slot_mask = torch.arange(B) < lengths.unsqueeze(1)
    return heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t


def run_loss(
    heads,
    verifier,
    hidden,
    prev,
    target_hidden,
    labels,
    slot_mask,
    d2t,
    cfg,
    norm=None,
    confidence=True,
    keep_budget=None,
    norm_fn=None,
):
    def heads_fn(h, tok):
        return heads.draft_logits(h, tok), heads.confidence_logits(h, tok) if confidence else None

    blocks = (hidden, prev, target_hidden, labels, slot_mask)
    inputs = LossInputs(
        heads_fn, verifier.logits, *blocks, norm=norm, with_confidence=confidence, d2t=d2t, target_norm_fn=norm_fn
    )
    return dspark_loss(inputs, cfg, keep_budget=keep_budget)


def naive_loss(heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t, cfg, norm=None):
    """One slot at a time, straight from the definitions (full-vocabulary TV, m·KL(p̂‖q))."""
    n, block = slot_mask.shape
    draft_ids = list(range(V)) if d2t is None else [i + int(d2t[i]) for i in range(len(d2t))]
    sums = {"ce": 0.0, "tv": 0.0, "kl": 0.0, "confidence": 0.0}
    alpha = torch.zeros(n, block, dtype=torch.float64)
    out_of_vocab, weight_total = 0, 0.0
    for i in range(n):
        for k in range(block):
            if not slot_mask[i, k]:
                continue
            w = math.exp(-k / cfg.gamma)
            weight_total += w
            h, tok = hidden[i, k].view(1, 1, H), prev[i, k].view(1, 1)
            q = torch.softmax(heads.draft_logits(h, tok)[0, 0], dim=0)
            with torch.no_grad():
                p = torch.softmax(verifier.logits(target_hidden[i, k]), dim=0)
            q_full = torch.zeros(V, dtype=q.dtype).index_put((torch.tensor(draft_ids),), q)
            sums["tv"] = sums["tv"] + w * 0.5 * (q_full - p).abs().sum()
            a = sum(min(q_full[v], p[v]) for v in range(V))
            alpha[i, k] = a.detach()
            p_in = p[draft_ids]
            mass = p_in.sum()
            p_hat = p_in / mass
            sums["kl"] = sums["kl"] + w * mass * (p_hat * (p_hat.log() - q.log())).sum()
            y = int(labels[i, k])
            if y in draft_ids:
                sums["ce"] = sums["ce"] - w * q[draft_ids.index(y)].log()
            else:
                out_of_vocab += 1
            logit = heads.confidence_logits(h, tok)[0, 0]
            c = a.detach()
            bce = -(c * F.logsigmoid(logit) + (1 - c) * F.logsigmoid(-logit))
            sums["confidence"] = sums["confidence"] + w * bce
    norm = weight_total if norm is None else norm
    terms = {name: value / norm for name, value in sums.items()}
    loss = sum(cfg.weights[t] * terms[t] for t in cfg.weights) + cfg.confidence_weight * terms["confidence"]
    return loss, terms, alpha, out_of_vocab


CASES = [pytest.param(None, id="full-vocab"), pytest.param(24, id="draft-vocab")]


@pytest.mark.parametrize("draft_vocab", CASES)
def test_loss_matches_naive_loop(draft_vocab):
    case = make_case(seed=1, draft_vocab=draft_vocab)
    cfg = make_cfg()
    out = run_loss(*case, cfg)
    loss, terms, alpha, out_of_vocab = naive_loss(*case, cfg)

    torch.testing.assert_close(out.loss, loss, rtol=1e-9, atol=1e-12)
    for name in ("ce", "tv", "kl", "confidence"):
        torch.testing.assert_close(out.terms[name], terms[name].detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(out.alpha, alpha, rtol=1e-9, atol=1e-12)
    assert int(out.ce_out_of_vocab) == out_of_vocab
    if draft_vocab is None:
        assert out_of_vocab == 0
    else:  # the case must exercise targets outside the draft vocabulary
        assert out_of_vocab > 0
    mask = case[6]
    torch.testing.assert_close(out.acceptance.alpha_sum, (alpha * mask).sum(0))
    torch.testing.assert_close(out.acceptance.slots, mask.sum(0).double())


@pytest.mark.parametrize("keep_budget", [None, 0], ids=["kept", "recomputed"])
@pytest.mark.parametrize("draft_vocab", CASES)
def test_gradients_match_naive_loop(draft_vocab, keep_budget):
    heads, verifier, hidden, *rest = make_case(seed=2, draft_vocab=draft_vocab)
    cfg = make_cfg(chunk_size=2 * B)  # several chunks

    def grads(loss):
        params = [hidden, *heads.parameters()]
        return torch.autograd.grad(loss, params)

    got = grads(run_loss(heads, verifier, hidden, *rest, cfg, keep_budget=keep_budget).loss)
    want = grads(naive_loss(heads, verifier, hidden, *rest, cfg)[0])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("draft_vocab", [None, 24])
def test_chunked_equals_unchunked(draft_vocab):
    heads, verifier, hidden, *rest = make_case(seed=3, n=11, draft_vocab=draft_vocab)
    params = [hidden, *heads.parameters()]
    results = []
    for chunk_size in (B, 3 * B, 1000 * B):  # 1 block per chunk, a ragged last chunk, one chunk
        out = run_loss(heads, verifier, hidden, *rest, make_cfg(chunk_size=chunk_size))
        results.append((out, torch.autograd.grad(out.loss, params)))
    (ref, ref_grads) = results[-1]
    assert any(g.abs().sum() > 0 for g in ref_grads)
    for out, grads in results[:-1]:
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-14)
        for name, value in ref.terms.items():
            torch.testing.assert_close(out.terms[name], value, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(out.alpha, ref.alpha, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(out.confidence, ref.confidence, rtol=1e-12, atol=1e-14)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-13)


def test_external_norm_splits_like_one_batch():
    """Two ranks, each normalized by the global weight sum, add up to the single-batch loss."""
    heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t = make_case(seed=4, n=8)
    cfg = make_cfg()
    params = [hidden, *heads.parameters()]
    whole = run_loss(heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t, cfg)
    whole_grads = torch.autograd.grad(whole.loss, params)

    halves = (slice(0, 3), slice(3, 8))
    norm = sum(weight_sum(slot_mask[s], cfg.gamma) for s in halves)  # what the all-reduce returns
    parts = [
        run_loss(heads, verifier, hidden[s], prev[s], target_hidden[s], labels[s], slot_mask[s], d2t, cfg, norm)
        for s in halves
    ]
    total = parts[0].loss + parts[1].loss
    torch.testing.assert_close(total, whole.loss, rtol=1e-12, atol=1e-14)
    for g, w in zip(torch.autograd.grad(total, params), whole_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13)

    doubled = run_loss(heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t, cfg, 2 * norm)
    torch.testing.assert_close(doubled.loss, whole.loss / 2, rtol=1e-12, atol=1e-14)


def test_position_weights_and_weight_sum():
    torch.testing.assert_close(position_weights(3, 2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))
    mask = torch.tensor([[True, True, False], [True, False, False]])
    torch.testing.assert_close(weight_sum(mask, 2.0), torch.tensor(2.0 + math.exp(-0.5), dtype=torch.float64))


def test_no_scored_slot_gives_zero_loss_and_a_graph():
    heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t = make_case(seed=5)
    cfg = make_cfg()
    out = run_loss(heads, verifier, hidden, prev, target_hidden, labels, torch.zeros_like(slot_mask), d2t, cfg)
    assert float(out.loss.detach()) == 0.0
    out.loss.backward()
    assert heads.lm_head.weight.grad is not None and float(heads.lm_head.weight.grad.abs().sum()) == 0.0

    empty = [t[:0] for t in (hidden, prev, target_hidden, labels, slot_mask)]
    out = run_loss(heads, verifier, *empty, d2t, cfg, norm=1.0)
    assert float(out.loss.detach()) == 0.0 and out.alpha.shape == (0, B)
    (grad,) = torch.autograd.grad(out.loss, [heads.w2.weight])  # still connected to the heads
    assert float(grad.abs().sum()) == 0.0


def test_terms_follow_config():
    case = make_case(seed=6)
    out = run_loss(*case, make_cfg(weights={"tv": 1.0}), confidence=False)
    assert set(out.terms) == {"tv"} and out.confidence is None
    torch.testing.assert_close(out.loss, out.terms["tv"])


def test_half_precision_logits_are_widened():
    heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t = make_case(seed=7)
    cfg = make_cfg()
    ref = run_loss(heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t, cfg)
    heads16, verifier16 = heads.to(torch.bfloat16), verifier.to(torch.bfloat16)
    out = run_loss(
        heads16, verifier16, hidden.detach().bfloat16(), prev, target_hidden.bfloat16(), labels, slot_mask, d2t, cfg
    )
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss.double(), ref.loss.detach(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(cfg=dict(weights={"ce": 1.0, "l1": 1.0})), r"loss.weights: unknown term\(s\) \['l1'\]"),
        (dict(cfg=dict(gamma=0.0)), "loss.gamma"),
        (dict(d2t=torch.zeros(5, dtype=torch.long)), "d2t has 5"),
        (dict(labels=torch.zeros(7, B + 1, dtype=torch.long)), "labels must be"),
        (dict(d2t=None, draft_vocab=24), "pass d2t for a reduced draft vocabulary"),
    ],
)
def test_bad_input_names_the_field(change, message):
    heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t = make_case(
        seed=8, draft_vocab=change.pop("draft_vocab", None)
    )
    args = dict(labels=labels, d2t=d2t, cfg={}) | change
    with pytest.raises(ValueError, match=message):
        cfg = make_cfg(**args["cfg"])  # a bad config value is refused when the config is built
        run_loss(heads, verifier, hidden, prev, target_hidden, args["labels"], slot_mask, args["d2t"], cfg)


def test_terms_at_weight_zero_leave_the_confidence_head_or_nothing():
    heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t = make_case(seed=9)
    cfg = make_cfg(weights={"ce": 0.0, "tv": 0.0, "kl": 0.0})
    assert cfg.weights == {}
    out = run_loss(heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t, cfg)
    assert set(out.terms) == {"confidence"}
    torch.testing.assert_close(out.loss, cfg.confidence_weight * out.terms["confidence"])
    with pytest.raises(ValueError, match="nothing to train"):
        run_loss(heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t, cfg, confidence=False)


def test_unknown_vocabulary_term_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown term\(s\) \['l1'\]; known: \['ce', 'tv', 'kl'\]"):
        term_weights({"ce": 1.0, "l1": 1.0})
    assert term_weights({"kl": 0.5, "ce": 2}) == (2.0, 0.0, 0.5)  # in VOCAB_TERMS order, 0 where absent


def test_terms_at_weight_zero_are_not_computed():
    """confidence_weight 0 (with a confidence head) and hidden_weight 0: neither term runs, and the
    loss is the vocabulary terms' alone, to the bit."""
    heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t = make_case(seed=11)
    calls = []

    def norm_fn(h):
        calls.append(h.shape)
        return verifier.norm(h)

    cfg = make_cfg(confidence_weight=0.0, hidden_weight=0.0)
    assert term_names(cfg, with_confidence=True) == ["ce", "tv", "kl"]
    out = run_loss(heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t, cfg, norm_fn=norm_fn)
    assert list(out.terms) == ["ce", "tv", "kl"] and calls == []
    assert out.confidence is not None  # the head's probabilities are still reported
    vocab_only = run_loss(heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t, cfg, confidence=False)
    assert torch.equal(out.loss, vocab_only.loss)
    with_hidden = make_cfg(confidence_weight=0.0, hidden_weight=0.5)
    out = run_loss(heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t, with_hidden, norm_fn=norm_fn)
    assert list(out.terms) == term_names(with_hidden, with_confidence=True) == ["ce", "tv", "kl", "hidden"]
    assert len(calls) == 1


def saved_bytes_for_backward(n: int, keep_budget: int | None) -> int:
    """Bytes of the distinct storages autograd keeps from forward to backward for the loss of n
    blocks (one block per chunk; the heads' weights, saved by every chunk, count once)."""
    heads, verifier, hidden, *rest = make_case(seed=9, n=n)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_loss(heads, verifier, hidden, *rest, make_cfg(chunk_size=B), keep_budget=keep_budget)
    del out
    return sum(storages.values())


def test_memory_kept_for_backward_is_one_gradient_buffer_or_none():
    """Kept chunks keep one [chunk, B, V] gradient and nothing else vocabulary-sized; chunks past
    the budget keep only their inputs."""
    vocab_buffer = 8 * B * V * 8  # one float64 [n=8, B, V] tensor
    kept = [saved_bytes_for_backward(n, keep_budget=None) for n in (8, 16)]
    recomputed = [saved_bytes_for_backward(n, keep_budget=0) for n in (8, 16)]
    assert recomputed[1] - recomputed[0] < vocab_buffer  # the 8 more blocks' small inputs only
    # ... and kept chunks add exactly their gradients (plus per-slot scalars).
    assert vocab_buffer <= (kept[1] - kept[0]) - (recomputed[1] - recomputed[0]) < 1.5 * vocab_buffer
    # A budget of 8 blocks' gradients keeps 8 chunks of 16 and recomputes the others.
    assert recomputed[1] < saved_bytes_for_backward(16, keep_budget=vocab_buffer) < kept[1]


def reference_loss(heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t, cfg):
    """The previous implementation (plain autograd over softmaxes, one chunk), kept as the reference."""
    logq = torch.log_softmax(heads.draft_logits(hidden, prev).double(), dim=-1)
    q = logq.exp()
    with torch.no_grad():
        logp_full = torch.log_softmax(verifier.logits(target_hidden).double(), dim=-1)
        ids = torch.arange(V) if d2t is None else torch.arange(len(d2t)) + d2t
        p, logp = logp_full.exp()[..., ids], logp_full[..., ids]
        pos = torch.searchsorted(ids, labels).clamp(max=len(ids) - 1)
        in_vocab = ids[pos] == labels
    wm = slot_mask.double() * position_weights(B, cfg.gamma, dtype=torch.float64)
    alpha = torch.minimum(q, p).sum(-1)
    mass = p.sum(-1)
    sums = {
        "ce": (-logq.gather(-1, pos.unsqueeze(-1)).squeeze(-1) * wm * in_vocab).sum(),
        "tv": ((1.0 - alpha) * wm).sum(),
        "kl": (((p * logp).sum(-1) - torch.xlogy(mass, mass) - (p * logq).sum(-1)) * wm).sum(),
    }
    logit = heads.confidence_logits(hidden, prev).double()
    sums["confidence"] = (F.binary_cross_entropy_with_logits(logit, alpha.detach(), reduction="none") * wm).sum()
    norm = wm.sum()
    loss = sum(cfg.weights[t] * sums[t] for t in cfg.weights) / norm + cfg.confidence_weight * sums["confidence"] / norm
    return loss, alpha.detach() * slot_mask


@pytest.mark.parametrize("draft_vocab", [None, 17])
def test_fused_loss_equals_previous_implementation_in_float32(draft_vocab):
    """Random float32 inputs, masked slots, several chunks kept and recomputed: value and every
    gradient equal the previous implementation's (evaluated in float64) within float32 tolerance."""
    heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t = make_case(
        seed=10, n=13, draft_vocab=draft_vocab
    )
    cfg = make_cfg(chunk_size=3 * B)
    params = [hidden, *heads.parameters()]
    ref_loss, ref_alpha = reference_loss(heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t, cfg)
    ref_grads = torch.autograd.grad(ref_loss, params)
    heads32, verifier32 = copy.deepcopy(heads).float(), copy.deepcopy(verifier).float()
    hidden32 = hidden.detach().float().requires_grad_()
    for keep_budget in (None, 2 * 3 * B * V * 4):  # all chunks kept; two kept, the rest recomputed
        out = run_loss(
            heads32,
            verifier32,
            hidden32,
            prev,
            target_hidden.float(),
            labels,
            slot_mask,
            d2t,
            cfg,
            keep_budget=keep_budget,
        )
        assert out.loss.dtype == torch.float32
        grads = torch.autograd.grad(out.loss, [hidden32, *heads32.parameters()])
        torch.testing.assert_close(out.loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.alpha.double(), ref_alpha, rtol=1e-5, atol=1e-6)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-6)


def test_hidden_term_matches_naive_loop_and_needs_the_verifier_norm():
    """`loss.hidden_weight`: + w·Σ_k w_k‖h − norm_v(h̄)‖²/‖norm_v(h̄)‖² / Σ w_k, slot by slot; its
    gradient on h is the loop's; without the verifier's norm the call is refused."""
    heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t = make_case(5)
    verifier.norm.weight.data.uniform_(0.5, 1.5)  # a norm gain that is not all ones
    base_cfg, cfg = make_cfg(), make_cfg(hidden_weight=0.7)
    base = run_loss(heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t, base_cfg)

    def with_hidden(cfg):
        return run_loss(
            heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t, cfg, norm_fn=verifier.norm
        )

    out = with_hidden(cfg)
    total, weights = 0.0, 0.0
    for i, k in slot_mask.nonzero().tolist():
        w = math.exp(-k / cfg.gamma)
        t = verifier.norm(target_hidden[i, k])
        total = total + w * ((hidden[i, k] - t) ** 2).sum() / (t**2).sum()
        weights += w
    expected = total / weights
    assert float(out.terms["hidden"]) == pytest.approx(float(expected.detach()), rel=1e-10)
    assert float(out.loss - base.loss) == pytest.approx(0.7 * float(expected.detach()), rel=1e-9)
    (got,) = torch.autograd.grad(out.loss - base.loss, hidden)
    (want,) = torch.autograd.grad(0.7 * expected, hidden)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="target_norm_fn"):
        run_loss(heads, verifier, hidden, prev, target_hidden, labels, slot_mask, d2t, cfg)
    # loss.hidden_slots=1: only each block's first slot is matched (the normalizer stays every slot's)
    first = with_hidden(make_cfg(hidden_weight=0.7, hidden_slots=1))
    total = 0.0
    for i in slot_mask[:, 0].nonzero().flatten().tolist():
        t = verifier.norm(target_hidden[i, 0])
        total = total + ((hidden[i, 0] - t) ** 2).sum() / (t**2).sum()
    assert float(first.terms["hidden"]) == pytest.approx(float(total.detach()) / weights, rel=1e-10)


def test_vocab_tiles_are_never_empty():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # devices by name: no GPU needed
    # a chunk of no scored slots (a micro-batch with no trainable anchor) still tiles: range(0, 0, 0) raised on CUDA
    assert tile_rows(0, 49_152, cuda) == 1 and tile_rows(0, 49_152, cpu) == TILE_ELEMENTS // 49_152
    assert tile_rows(300, 49_152, cuda) == 300  # one pass on a GPU
    assert tile_rows(300, TILE_ELEMENTS * 4, cpu) == 1
