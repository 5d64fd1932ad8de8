"""DSpark's sequential (Markov) logit-bias head and its confidence head.

Parameter names match speculators' `MarkovHead` / `ConfidenceHead`
(`markov_w1`, `markov_w2`, `gate_proj`, `joint_proj`, `proj`), so checkpoints load in
speculators and vLLM without renaming.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.config import MARKOV_TYPES
from dspark.vocab_matmul import project_into
from dspark.workspace import Workspace


class MarkovHead(nn.Module):
    """Low-rank bias `W2(W1[prev_k])` added to slot k's draft logits.

    `W1` indexes the verifier vocabulary (the previous token: the anchor for slot 0, the token
    at p+k otherwise); `W2` projects to the draft vocabulary. `gated` scales `W1[prev]` by a
    gate on `[h_k ; W1[prev]]`; `rnn` carries a gated state across the block's slots.
    """

    def __init__(self, verifier_vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int, head_type: str):
        super().__init__()
        self.head_type = head_type
        self.rank = rank
        self.markov_w1 = nn.Embedding(verifier_vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            # One projection of [state ; W1[prev] ; h] into gate, candidate and output.
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def prev_embeddings(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    def features(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """emb [n, B, rank] = `prev_embeddings(prev)`, hidden [n, B, H] (after the final norm) -> [n, B, rank].

        The bias of slot k is `markov_w2(features[:, k])`; the draft applies `markov_w2` itself,
        fused with its lm_head GEMM (`DSparkDraft.heads`).
        """
        if self.head_type == "vanilla":
            return emb
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, emb], dim=-1))) * emb
        state = emb.new_zeros(emb.shape[0], self.rank)
        outputs = []
        for k in range(emb.shape[1]):
            gate, candidate, out = self.joint_proj(torch.cat([state, emb[:, k], hidden[:, k]], dim=-1)).chunk(3, -1)
            gate = torch.sigmoid(gate)
            state = gate * state + (1.0 - gate) * torch.tanh(candidate)
            outputs.append(torch.tanh(out))
        return torch.stack(outputs, dim=1)


class DraftLogits(torch.autograd.Function):
    """`h·lm_headᵀ + f·W2ᵀ` (W2 term optional) written into the workspace's `draft_logits` buffer.

    forward(h [m, H], lm_head [V, H], features [m, rank] | None, w2 [V, rank] | None,
    workspace) -> [m, V]. The same products as `F.linear` + `addmm_`, with the output in reused
    memory (see dspark.workspace) and tiled on CPU (dspark.vocab_matmul); backward computes
    the gradients autograd would.
    """

    @staticmethod
    def forward(ctx, h, lm_head, features, w2, workspace: Workspace):
        out = workspace.take("draft_logits", (h.shape[0], lm_head.shape[0]), h.dtype, h.device)
        if features is None:
            project_into(h, lm_head, out)
        else:
            project_into(h, lm_head, project_into(features, w2, out), accumulate=True)
        ctx.save_for_backward(h, lm_head, features, w2)
        return out

    @staticmethod
    def backward(ctx, grad):
        h, lm_head, features, w2 = ctx.saved_tensors
        need = ctx.needs_input_grad
        return (
            grad @ lm_head if need[0] else None,
            grad.t() @ h if need[1] else None,
            grad @ w2 if need[2] else None,
            grad.t() @ features if need[3] else None,
            None,
        )


class ConfidenceHead(nn.Module):
    """Logit of the probability that a slot is accepted given every earlier slot was."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


__all__ = ["MARKOV_TYPES", "ConfidenceHead", "MarkovHead"]
