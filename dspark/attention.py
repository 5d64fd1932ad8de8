"""Block attention of the DSpark draft: which keys a block sees, and how it attends.

The key sequence of a draft layer is `[context (T positions) ; all blocks (A·B slots)]`;
queries are the block slots only. One predicate (`BlockLayout.mask_mod`) defines the mask;
the SDPA path evaluates it densely, the flex path hands it to flex attention as is, so the
two cannot disagree on what a block may see.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from dspark.config import ATTN_IMPLS


@dataclass
class BlockLayout:
    """Mask of A anchored blocks of B slots over a packed row of T context positions.

    Block j (anchor p_j) sees context keys `< p_j` of the same document (and `>= p_j - window`
    with a sliding window), every slot of its own block (only slots `<= own` when causal in
    block), and nothing of other blocks. Invalid (padding) anchors see their own block only.
    """

    anchors: torch.Tensor  # [b, A] long, already clamped into [0, T)
    anchor_valid: torch.Tensor  # [b, A] bool
    document_ids: torch.Tensor  # [b, T]
    block_size: int
    sliding_window: int | None
    causal_in_block: bool

    @property
    def context_len(self) -> int:
        return self.document_ids.shape[1]

    @property
    def q_len(self) -> int:
        return self.anchors.shape[1] * self.block_size

    @property
    def kv_len(self) -> int:
        return self.context_len + self.q_len

    def mask_mod(self, b, h, q, kv):
        """True where query slot `q` of row `b` may attend key `kv` (flex `mask_mod` signature)."""
        T, B = self.context_len, self.block_size
        block = q // B
        anchor = self.anchors[b, block]
        # Block keys index past the context; clamp so the (discarded) lookup stays in range.
        kv_pos = kv.clamp(max=T - 1)
        sees_context = (
            (kv < T)
            & (kv < anchor)
            & (self.document_ids[b, kv_pos] == self.document_ids[b, anchor])
            & self.anchor_valid[b, block]
        )
        if self.sliding_window is not None:
            sees_context = sees_context & (kv >= anchor - self.sliding_window)
        slot = kv - T
        sees_block = (kv >= T) & (slot // B == block)
        if self.causal_in_block:
            sees_block = sees_block & (slot <= q)
        return sees_context | sees_block

    def context_needed(self) -> torch.Tensor:
        """[b, T] bool: context positions some valid block of the row may see (`< ` its last anchor).

        Only these go through `fc` and the context k/v projections: row padding and the tail
        after a row's last anchor cost no FLOPs (every other position is masked out anyway).
        """
        seen = torch.where(self.anchor_valid, self.anchors, 0)
        last = seen.amax(1, keepdim=True) if seen.shape[1] else seen.new_zeros(seen.shape[0], 1)
        return torch.arange(self.context_len, device=self.anchors.device)[None] < last

    def dense(self) -> torch.Tensor:
        """Boolean mask [b, 1, A·B, T + A·B] for SDPA."""
        device = self.anchors.device
        b = torch.arange(self.anchors.shape[0], device=device)[:, None, None]
        q = torch.arange(self.q_len, device=device)[None, :, None]
        kv = torch.arange(self.kv_len, device=device)[None, None, :]
        return self.mask_mod(b, None, q, kv).unsqueeze(1)

    def flex(self):
        """Block-sparse mask for flex attention (CUDA)."""
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q, kv):  # a plain function: flex reads a bound method's `self` as a fifth argument
            return self.mask_mod(b, h, q, kv)

        return create_block_mask(
            mask_mod,
            B=self.anchors.shape[0],
            H=None,
            Q_LEN=self.q_len,
            KV_LEN=self.kv_len,
            device=self.anchors.device,
        )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [..., L, heads, d] with cos/sin [..., L, d]."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


FLEX_KERNEL = {"FORCE_USE_FLEX_ATTENTION": True}


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_attention_fn():
    """flex_attention as is inside a compiled region (`train.compile`), else compiled once per
    process (uncompiled, it materializes every score)."""
    if torch.compiler.is_compiling():
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention
    return _compiled_flex_attention()


class DraftAttention(nn.Module):
    """Qwen3 attention (q/k RMSNorm, GQA, RoPE) with the context injected as extra keys/values.

    Context and block go through the same k/v projections, k-norm and RoPE (each at its
    own positions); queries come from the block slots only.
    """

    def __init__(self, config: Qwen3Config, attn_impl: str):
        super().__init__()
        self.attn_impl = attn_impl
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def keys_values(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k-norm, then RoPE) and values [..., kv_heads, d] of states hidden [..., H] at the
        positions of cos/sin [..., d]. A context position's pair depends on its own state and
        position only, never on the block that reads it (see `DSparkDraft.context_kv`)."""
        shape = (*hidden.shape[:-1], self.num_kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(hidden).view(shape))
        return apply_rope(k, cos, sin), self.v_proj(hidden).view(shape)

    def forward(
        self,
        x: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask,
    ) -> torch.Tensor:
        """x [b, Q, H] block slots at the positions of cos/sin [b, Q, d]; context_kv the context's
        keys and values [b, T, kv_heads, d] (`keys_values` of its states, zeros where the mask
        hides them); mask over [context ; block] from `BlockLayout.dense()` (sdpa) or
        `BlockLayout.flex()` (flex)."""
        bsz, q_len, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(bsz, q_len, self.num_heads, self.head_dim)), cos, sin)
        k, v = self.keys_values(x, cos, sin)
        q = q.transpose(1, 2)
        k = torch.cat([context_kv[0], k], dim=1).transpose(1, 2)
        v = torch.cat([context_kv[1], v], dim=1).transpose(1, 2)
        gqa = self.num_heads != self.num_kv_heads
        if self.attn_impl == "flex":
            # The main kernel always: below 128 query rows inductor picks its decoding kernel,
            # which found no valid config for a training step of few anchors (seen on an H200).
            out = flex_attention_fn()(
                q, k, v, block_mask=mask, scale=self.head_dim**-0.5, enable_gqa=gqa, kernel_options=FLEX_KERNEL
            )
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim))


__all__ = ["ATTN_IMPLS", "BlockLayout", "DraftAttention", "apply_rope", "rotate_half"]
