"""The vocabulary-sized part of the DSpark loss as one autograd Function: value and gradient in one pass.

Per slot, from the draft logits z `[Vd]` and the verifier logits t `[V]` (see dspark.losses):
q = softmax(z); p = softmax(t) read at the draft ids, not renormalized; m = Σ_D p;
α = Σ min(q, p); ce = lse(z) − z_y; tv = 1 − α; kl = Σ_D p·(log p − log q) − m·log m.
The gradient of A·ce + T·tv + K·kl (A, T, K: a slot's weights) with respect to z is closed-form:

    ∂/∂z_j = q_j·(A + T·S + K·m − T·s_j) − K·p_j − A·[j = y],   s_j = [q_j < p_j],  S = Σ_v s_v·q_v

(at an exact tie q_j = p_j the subgradient taken is 0 where autograd's `minimum` takes ½; ties
of non-zero probabilities do not occur in practice). Forward computes it and keeps only it: one
`[c, B, Vd]` buffer in the logits' dtype, written over the verifier logits' storage when the
vocabularies coincide. No softmax outlives forward, backward recomputes nothing (it scales the
kept gradient), and the elementwise work reuses three tile-sized buffers for every tile of rows.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from dspark.workspace import Workspace, scratch

VOCAB_TERMS = ("ce", "tv", "kl")
"""The vocabulary terms, in the order of `VocabTerms`' weights and sums; `loss.weights` names them."""

TILE_ELEMENTS = 1 << 24
"""Elements per row tile of the elementwise work on CPU (64 MiB per float32 work buffer).

Large on purpose: on a CPU shared with other processes, every op's thread fork/join costs
more than the memory traffic a cache-sized tile would save (measured: 1-row tiles ran 5x
slower than 100-row tiles at a 152k vocabulary on 2 busy cores)."""


def wide(x: Tensor) -> Tensor:
    """Half-precision logits to float32 (softmax over ~150k entries needs it); wider kept."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def term_weights(weights: Mapping[str, float]) -> tuple[float, ...]:
    """Each of `VOCAB_TERMS`' weight in `weights` (0 where absent); an unknown name is refused."""
    unknown = sorted(set(weights) - set(VOCAB_TERMS))
    if unknown:
        raise ValueError(f"unknown term(s) {unknown}; known: {list(VOCAB_TERMS)}")
    return tuple(float(weights.get(t, 0.0)) for t in VOCAB_TERMS)


def draft_index(target: Tensor, draft_ids: Tensor | None, draft_vocab: int) -> tuple[Tensor, Tensor]:
    """Draft index of each verifier token id `[r]`, and whether it is in the draft vocabulary."""
    if draft_ids is None:
        return target.clamp(0, draft_vocab - 1), torch.ones_like(target, dtype=torch.bool)
    # Sorted draft ids (see dspark.vocab) make the inverse map a binary search.
    pos = torch.searchsorted(draft_ids, target).clamp(max=draft_ids.shape[0] - 1)
    return pos, draft_ids[pos] == target


class _Tiles:
    """Work buffers of one row tile, taken once per call (from the workspace when given) and reused by every tile."""

    def __init__(self, rows: int, vocab: int, like: Tensor, workspace: Workspace | None):
        self.q = scratch(workspace, "vocab_q", (rows, vocab), like)
        self.tmp = scratch(workspace, "vocab_tmp", (rows, vocab), like)
        # s_j = [q_j < p_j] as 0/1 in the logits' dtype: float products are vectorized, while
        # products with a bool tensor and row-broadcast `where` were ~10x slower per pass on CPU.
        self.lower = scratch(workspace, "vocab_lower", (rows, vocab), like)


def _softmax(x: Tensor, out: Tensor) -> tuple[Tensor, Tensor]:
    """softmax(x) written into `out` (may be x itself) and log-sum-exp `[r]`.

    ATen's fused softmax kernel (about 3x faster than max/sub/exp/sum/div as separate passes on
    CPU); it reads each element before it writes the same index, so `out` may alias `x`.
    lse = max(x) − log(max(softmax(x))): the largest probability is at least 1/V, so its log
    never underflows. `max(x)` is taken first, while `x` is intact.
    """
    peak = x.amax(-1)
    torch.ops.aten._softmax.out(x, -1, False, out=out)
    return out, peak - out.amax(-1).log()


def tile_rows(rows: int, v: int, device: torch.device) -> int:
    """Rows per tile: all of them on CUDA (one pass), else as many as keep a tile of the verifier's
    logits near `TILE_ELEMENTS` (cache-sized on CPU); at least 1, also for a chunk of no rows."""
    return max(1, rows if device.type == "cuda" else TILE_ELEMENTS // max(v, 1))


class VocabTerms(torch.autograd.Function):
    """Weighted sums of ce, tv, kl over a chunk of slots; differentiable in the draft logits only.

    forward(logits [c, B, Vd], target_logits [c, B, V] (consumed: overwritten), labels [c, B],
    slot_weight [c, B] (w_k on scored slots, 0 elsewhere), term_weights (`term_weights`),
    draft_ids [Vd] ascending verifier ids or None, need_grad, workspace (reused
    buffers, see dspark.workspace) or None) ->
    objective (Σ_t term_weights[t]·sums[t], scalar), sums [3] (ce, tv, kl, each Σ w·term),
    alpha [c, B], out_of_vocab (scored slots whose CE label is not a draft id).
    """

    @staticmethod
    def forward(ctx, logits, target_logits, labels, slot_weight, term_weights, draft_ids, need_grad, workspace):
        w_ce, w_tv, w_kl = term_weights
        vd, v = logits.shape[-1], target_logits.shape[-1]
        z = wide(logits).reshape(-1, vd)
        t = wide(target_logits).reshape(-1, v)
        weight = slot_weight.reshape(-1).to(z.dtype)
        labels = labels.reshape(-1).long()
        rows = z.shape[0]
        grad = None
        if need_grad:  # over the verifier logits, tile by tile once read, when shapes and dtypes allow
            reuse = draft_ids is None and t.dtype == logits.dtype and t.is_contiguous()
            grad = t if reuse else scratch(workspace, "vocab_grad", (rows, vd), logits)
        sums = torch.zeros(3, dtype=z.dtype, device=z.device)
        alpha = torch.empty(rows, dtype=z.dtype, device=z.device)
        out_of_vocab = torch.zeros((), dtype=torch.long, device=z.device)
        tile = tile_rows(rows, v, z.device)
        work = _Tiles(min(tile, rows), vd, z, workspace)
        for start in range(0, rows, tile):
            r = slice(start, start + tile)
            zt, tt, w = z[r], t[r], weight[r]
            n = zt.shape[0]
            idx, in_vocab = draft_index(labels[r], draft_ids, vd)
            diff = None
            if w_kl:  # log p − log q = (t − z) + (lse_q − lse_p), read before t is overwritten
                diff = (tt if draft_ids is None else tt.index_select(-1, draft_ids)) - zt
            q, lse_q = _softmax(zt, work.q[:n])
            nll = lse_q - zt.gather(-1, idx[:, None])[:, 0]
            p, lse_p = _softmax(tt, tt)  # in place: the verifier logits become p
            if draft_ids is not None:
                p = p.index_select(-1, draft_ids)
            lower = torch.lt(q, p, out=work.lower[:n])  # s as 0/1
            a = torch.minimum(q, p, out=work.tmp[:n]).sum(-1)
            alpha[r] = a
            ce_w = w * in_vocab
            sums[0] += (ce_w * nll).sum()
            sums[1] += (w * (1.0 - a)).sum()
            out_of_vocab += ((w > 0) & ~in_vocab).sum()
            mass = p.sum(-1) if w_kl else None
            if diff is not None:
                kl = torch.linalg.vecdot(p, diff) + mass * (lse_q - lse_p) - torch.xlogy(mass, mass)
                sums[2] += (w * kl).sum()
            if grad is None:
                continue
            q_lower = torch.mul(q, lower, out=work.tmp[:n])  # s_j·q_j
            big_s = q_lower.sum(-1)
            A, T, K = w_ce * ce_w, w_tv * w, w_kl * w
            coef = A + T * big_s + (K * mass if w_kl else 0.0)
            # ∂/∂z = q·coef − T·s·q − K·p (− A at y, below)
            g = grad[r]  # may share storage with p (full vocabulary): p is read before g is written
            if w_kl:
                torch.mul(p, K[:, None], out=lower)  # K·p into the spent s buffer: g may overwrite p
            out = g if g.dtype == q.dtype else q
            torch.mul(q, coef[:, None], out=out).addcmul_(q_lower, T[:, None], value=-1.0)
            if w_kl:
                out.sub_(lower)
            if out is not g:
                g.copy_(out)
            g.scatter_add_(-1, idx[:, None], -A[:, None].to(g.dtype))
        objective = w_ce * sums[0] + w_tv * sums[1] + w_kl * sums[2]
        if grad is not None:
            ctx.save_for_backward(grad.view(logits.shape))
        ctx.mark_non_differentiable(sums, alpha, out_of_vocab)
        return objective, sums, alpha.view(logits.shape[:-1]), out_of_vocab

    @staticmethod
    def backward(ctx, grad_objective, *_):
        if getattr(ctx, "used", False):
            raise RuntimeError("dspark_loss: backward runs once per graph (its kept gradient is scaled in place)")
        ctx.used = True
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_objective.to(grad.dtype)), None, None, None, None, None, None, None


__all__ = ["TILE_ELEMENTS", "VOCAB_TERMS", "VocabTerms", "draft_index", "term_weights", "wide"]
