"""Speculative decoding with an exported DSpark drafter, the way vLLM's DSpark proposer runs it.

One step of a row whose verifier has processed positions `0..c−1` and whose last sampled
token `a` (the anchor) sits at position c:

- draft: the drafter reads the verifier's aux hidden states of positions `< c` (every
  accepted token) and the block `[a, mask×(B−1)]` at positions c..c+B−1; slot k's logits plus
  the Markov bias of the previous token (the anchor, then the token drafted at slot k−1) give
  the k-th drafted token, left to right (argmax at temperature 0, else sampled from the
  temperature-scaled draft distribution q; a reduced vocabulary is mapped through `d2t`, q is
  zero outside it);
- verify: one verifier forward over `[a, d_1..d_k]` at positions c..c+k on the KV cache;
  temperature 0 accepts drafts while they equal the verifier's argmax, otherwise d_i is
  accepted with probability min(1, p_i(d_i)/q_i(d_i)) and the first rejection is replaced by a
  sample of the normalized residual max(p − q, 0); with every draft accepted the verifier
  adds the bonus token. The cache keeps the accepted tokens' keys and values only (cropped
  on rejection, the prefix is never recomputed).

Adaptive verification (vLLM's `enable_adaptive_verification` with a confidence head) sends
only the first k drafts, k = argmax_k (1 + Σ_{j<k} S_j) / (draft_cost + verify_cost(1 + k)),
S_j the running product of the confidences of the row's previous draft (vLLM's budget reads
confidences one step stale; 1 before the first draft).

Rows of a batch run independently: each keeps its own positions, and cache columns another
row wrote are masked out of its attention.

The drafter's context keys and values depend on each context token's aux states and position
only (`DSparkDraft.context_kv`), so, as vLLM's KV cache does, each row keeps them per draft
layer (`DraftContext`) and a step projects only the tokens it accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F
from transformers import DynamicCache

from dspark.attention import BlockLayout
from dspark.model import DSparkDraft
from dspark.servable import markov_head_problem


@dataclass
class CostModel:
    """Step costs of adaptive verification (vLLM profiles them at start-up): ms per draft step and
    per verifier forward of n tokens (`verify_ms[n]`, n = 0..B+1)."""

    draft_ms: float
    verify_ms: np.ndarray

    def as_step_costs(self) -> dict:
        """These costs in the form `eval.decode.step_costs` takes (verify_ms of 1..B+1 tokens)."""
        return {"draft_ms": float(self.draft_ms), "verify_ms": [float(v) for v in self.verify_ms[1:]]}

    def budget(self, confidence: np.ndarray) -> np.ndarray:
        """Drafts sent for verification per row, from confidences [b, B] of the row's previous draft."""
        survival = np.cumprod(confidence.astype(np.float64), axis=1)
        expected = 1.0 + np.concatenate([np.zeros((len(survival), 1)), np.cumsum(survival, axis=1)], axis=1)
        cost = self.draft_ms + self.verify_ms[1 : survival.shape[1] + 2]
        return np.argmax(expected / cost, axis=1)


@dataclass
class DecodeOutput:
    """One prompt's speculative decoding."""

    output_ids: list[int]
    accepted_per_step: list[int]
    """Drafted tokens accepted in each verification step (bonus excluded)."""
    drafted_per_step: list[int]
    """Drafted tokens sent for verification in each step (the block size unless adaptive)."""
    verifier_forwards: int
    """Verifier forward passes, the prefill included."""


class Verifier:
    """A transformers causal LM with its hidden states in vLLM's layer-id convention, captured by
    forward pre-hooks: id k < N is the residual stream entering decoder layer k (HF's
    `hidden_states[k]`), id N the last layer's output before the final norm (HF's last
    `hidden_states` entry is after it)."""

    def __init__(self, model, aux_layer_ids: list[int]):
        self.model = model.eval()
        self.num_layers = model.config.num_hidden_layers
        bad = [i for i in aux_layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"aux layer ids {bad} outside [0, {self.num_layers}) of the verifier")
        self.layer_ids = list(aux_layer_ids)
        self._captured: dict[int, torch.Tensor] = {}
        decoder = model.model
        for k in [*self.layer_ids, self.num_layers]:
            module = decoder.norm if k == self.num_layers else decoder.layers[k]
            module.register_forward_pre_hook(lambda _m, args, k=k: self._captured.__setitem__(k, args[0]))

    @torch.no_grad()
    def forward(self, input_ids, position_ids, attention_mask, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [b, n, V] (fp32) and aux states [b, n, m·H] of input_ids [b, n] at position_ids [b, n];
        attention_mask [b, cached + n] marks the cache columns (then the new tokens) each row sees."""
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
        )
        aux = torch.cat([self._captured[k] for k in self.layer_ids], dim=-1)
        return out.logits.float(), aux.float()

    @torch.no_grad()
    def states(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Aux states [T, m·H] and pre-norm final-layer states [T, H] of one sequence token_ids [T]."""
        self.model(input_ids=token_ids[None], use_cache=False)
        aux = torch.cat([self._captured[k][0] for k in self.layer_ids], dim=-1)
        return aux.float(), self._captured[self.num_layers][0].float()


class DraftContext:
    """Per draft layer, the context keys and values [b, capacity, kv_heads, d] of each row's
    accepted tokens (row r's token at position j in column j; zeros past the row's context)."""

    def __init__(self, draft: DSparkDraft, rows: int, capacity: int):
        self.draft = draft
        self.shape = (rows, capacity, draft.layer_config.num_key_value_heads, draft.layer_config.head_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def append(self, aux: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Project and store N new context tokens: aux states aux [N, m·H] of rows [N] at positions [N]."""
        cos, sin = self.draft.rope(positions[None])
        new = self.draft.context_kv(aux, cos[0], sin[0])
        if not self.layers:
            self.layers = [tuple(t.new_zeros(self.shape) for t in kv) for kv in new]
        for cached, kv in zip(self.layers, new, strict=True):
            for store, t in zip(cached, kv, strict=True):
                store[rows, positions] = t

    def columns(self, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values of positions 0..width−1."""
        return [(k[:, :width], v[:, :width]) for k, v in self.layers]


def _sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One id per row of probs [b, V]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class SpeculativeDecoder:
    """Batched speculative decoding of a verifier with a DSpark drafter (see the module doc)."""

    def __init__(self, verifier: Verifier, draft: DSparkDraft):
        head = markov_head_problem(draft.cfg.markov_rank, draft.cfg.markov_type)
        if head is not None:
            raise ValueError(f"this drafter has {head}")
        if verifier.layer_ids != draft.aux_layer_ids:
            raise ValueError(f"verifier captures layers {verifier.layer_ids}, the drafter reads {draft.aux_layer_ids}")
        self.verifier = verifier
        self.draft = draft.eval()
        self.device = draft.fc.weight.device
        self.block_size = draft.block_size
        self.vocab_size = draft.verifier_vocab_size
        self.target_ids = draft.target_ids.to(self.device)

    def block_hidden(self, context: DraftContext, n_ctx: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """[b, B, H] draft hidden states of each row's block `[anchor, mask×(B−1)]` at positions
        n_ctx..n_ctx+B−1 over its n_ctx context tokens (the drafter's forward with one anchor per row)."""
        b, B, dev = anchor.shape[0], self.block_size, self.device
        width = int(n_ctx.max()) + 1
        anchors = n_ctx[:, None]
        layout = BlockLayout(
            anchors,
            torch.ones(b, 1, dtype=torch.bool, device=dev),
            torch.zeros(b, width, dtype=torch.long, device=dev),
            B,
            self.draft.cfg.sliding_window,
            self.draft.cfg.causal_in_block,
        )
        blocks = self.draft.block_inputs(anchor[:, None], torch.zeros_like(anchors))
        cos, sin = self.draft.rope(anchors + torch.arange(B, device=dev))
        return self.draft.block_hidden(blocks, cos, sin, context.columns(width), layout)[:, 0]

    def draft_block(self, context, n_ctx, anchor, temperature, generator):
        """Drafted target ids [b, B], their draft probabilities in target vocab [b, B, V] (None at
        temperature 0) and confidences [b, B] (None without a confidence head)."""
        b, B = anchor.shape[0], self.block_size
        hidden = self.block_hidden(context, n_ctx, anchor)
        prev, tokens, probs, conf = anchor, [], [], []
        for k in range(B):
            logits, c = self.draft.heads(hidden[:, k : k + 1], prev[:, None])
            logits = logits[:, 0].float()  # [b, V_draft]
            if temperature == 0:
                drafted = self.target_ids[logits.argmax(-1)]
            else:
                q = torch.zeros(b, self.vocab_size, device=self.device)
                q[:, self.target_ids] = F.softmax(logits / temperature, dim=-1)
                drafted = _sample(q, generator)
                probs.append(q)
            if c is not None:
                conf.append(torch.sigmoid(c[:, 0].float()))
            tokens.append(drafted)
            prev = drafted
        return (
            torch.stack(tokens, 1),
            torch.stack(probs, 1) if probs else None,
            torch.stack(conf, 1) if conf else None,
        )

    def _verify(self, drafted, q, logits, budget, temperature, generator):
        """Accepted drafts per row [b] and the verifier's token after them [b].

        drafted [b, k] ids, q [b, k, V] draft probabilities (None at temperature 0), logits
        [b, k+1, V] verifier logits over [anchor, drafted]; budget [b] drafts that count per row.
        """
        b, k = drafted.shape
        in_budget = torch.arange(k, device=self.device)[None] < budget[:, None]
        rows = torch.arange(b, device=self.device)
        if temperature == 0:
            target = logits.argmax(-1)  # [b, k+1]
            ok = (drafted == target[:, :k]) & in_budget
            accepted = ok.long().cumprod(1).sum(1)
            return accepted, target[rows, accepted]
        p = F.softmax(logits / temperature, dim=-1)  # [b, k+1, V]
        p_d = p[:, :k].gather(-1, drafted[..., None])[..., 0]
        q_d = q.gather(-1, drafted[..., None])[..., 0]
        u = torch.rand(b, k, generator=generator, device=self.device)
        ok = (u * q_d < p_d) & in_budget
        accepted = ok.long().cumprod(1).sum(1)
        p_next = p[rows, accepted]  # [b, V] the verifier at the first position not accepted
        rejected = accepted < budget
        residual = p_next.clone()
        if rejected.any():
            r = (p_next[rejected] - q[rows[rejected], accepted[rejected]]).clamp_min(0)
            mass = r.sum(-1, keepdim=True)
            residual[rejected] = torch.where(mass > 0, r / mass.clamp_min(1e-30), p_next[rejected])
        return accepted, _sample(residual, generator)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        seed: int = 0,
        costs: CostModel | None = None,
    ) -> list[DecodeOutput]:
        """Speculative decoding of each prompt to exactly `max_new_tokens` tokens (EOS is not a stop).

        With `costs` (a drafter with a confidence head) the drafts sent follow adaptive verification.
        """
        if costs is not None and self.draft.confidence_head is None:
            raise ValueError("adaptive verification needs a drafter with a confidence head")
        dev, B, b = self.device, self.block_size, len(prompts)
        generator = torch.Generator(dev).manual_seed(seed)
        rows = torch.arange(b, device=dev)
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        width = int(lengths.max())
        ids = torch.zeros(b, width, dtype=torch.long, device=dev)
        mask = torch.arange(width, device=dev)[None] >= (width - lengths)[:, None]  # left padding
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.tensor(p, device=dev)
        cache = DynamicCache()
        positions = (mask.long().cumsum(1) - 1).clamp_min(0)
        logits, aux = self.verifier.forward(ids, positions, mask.long(), cache)
        context = DraftContext(self.draft, b, width + max_new_tokens + B + 1)
        context.append(aux[mask], mask.nonzero()[:, 0], positions[mask])
        seen = mask.clone()  # cache columns each row attends
        n_ctx = lengths.clone()
        last = logits[:, -1]
        anchor = last.argmax(-1) if temperature == 0 else _sample(F.softmax(last / temperature, -1), generator)
        out = torch.zeros(b, max_new_tokens + B + 1, dtype=torch.long, device=dev)
        out[:, 0] = anchor
        produced = torch.ones(b, dtype=torch.long, device=dev)
        stale_conf = np.ones((b, B))
        accepted_log, drafted_log, active_log = [], [], []
        while bool((produced < max_new_tokens).any()):
            active = produced < max_new_tokens
            drafted, q, conf = self.draft_block(context, n_ctx, anchor, temperature, generator)
            budget = torch.full((b,), B, device=dev)
            if costs is not None:
                budget = torch.from_numpy(costs.budget(stale_conf)).to(dev)
                stale_conf = conf.cpu().numpy()
            k = int(budget.max())
            step_ids = torch.cat([anchor[:, None], drafted[:, :k]], 1)  # [b, 1+k]
            step_pos = n_ctx[:, None] + torch.arange(k + 1, device=dev)
            logits, aux = self.verifier.forward(
                step_ids, step_pos, torch.cat([seen, seen.new_ones(b, k + 1)], 1).long(), cache
            )
            accepted, next_token = self._verify(
                drafted[:, :k], None if q is None else q[:, :k], logits, budget, temperature, generator
            )
            # keys/values and aux states of the anchor and the accepted drafts are kept (finished rows: none)
            keep = (torch.arange(k + 1, device=dev)[None] <= accepted[:, None]) & active[:, None]  # [b, 1+k]
            seen = torch.cat([seen, keep], 1)
            used = int(seen.any(0).nonzero().max()) + 1
            cache.crop(used - cache.get_seq_length())  # drops the rejected drafts' columns (0: none)
            seen = seen[:, :used]
            r_idx, j_idx = keep.nonzero(as_tuple=True)
            context.append(aux[r_idx, j_idx], r_idx, n_ctx[r_idx] + j_idx)
            new = torch.cat([drafted[:, :k], next_token[:, None]], 1)
            new[rows, accepted] = next_token
            out[r_idx, (produced[r_idx] + j_idx).clamp(max=out.shape[1] - 1)] = new[r_idx, j_idx]
            produced = torch.where(active, produced + accepted + 1, produced)
            n_ctx = torch.where(active, n_ctx + accepted + 1, n_ctx)
            anchor = torch.where(active, next_token, anchor)
            accepted_log.append(accepted.cpu())
            drafted_log.append(budget.cpu())
            active_log.append(active.cpu())
        return [
            DecodeOutput(
                output_ids=out[r, :max_new_tokens].tolist(),
                accepted_per_step=[int(a[r]) for a, on in zip(accepted_log, active_log) if on[r]],
                drafted_per_step=[int(d[r]) for d, on in zip(drafted_log, active_log) if on[r]],
                verifier_forwards=1 + sum(int(on[r]) for on in active_log),
            )
            for r in range(b)
        ]


__all__ = ["CostModel", "DecodeOutput", "DraftContext", "SpeculativeDecoder", "Verifier"]
