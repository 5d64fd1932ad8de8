"""The DSpark draft: a parallel block drafter over the verifier's aux hidden states.

Context: the aux hidden states `[T, m·H]` → `fc` → `hidden_norm`, injected as extra keys and
values into every draft layer. Block of anchor p: `[embed(token p), embed(mask)×(B−1)]` at
positions p..p+B−1 through the verifier's frozen embedding; slot k predicts token p+k+1.
Output: the draft's final RMSNorm, then the verifier's frozen lm_head (rows of the draft
vocabulary when reduced) plus the Markov bias. Module names follow speculators'
`DSparkDraftModel`, so the state dict is its checkpoint format.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from dspark.attention import BlockLayout, DraftAttention
from dspark.config import DraftConfig
from dspark.errors import UserError
from dspark.heads import ConfidenceHead, DraftLogits, MarkovHead
from dspark.verifier import VerifierHead, check_model_type, require_field
from dspark.workspace import Workspace


def draft_layer_config(verifier_config: PretrainedConfig, cfg: DraftConfig) -> Qwen3Config:
    """Qwen3 decoder-layer config sized like the verifier (speculators' `transformer_layer_config`).

    Also accepts its own output (a reloaded checkpoint's layer config) and gives it back.
    """
    check_model_type(verifier_config)
    hidden = int(require_field(verifier_config, "hidden_size"))
    heads = int(require_field(verifier_config, "num_attention_heads"))
    kv_heads = int(getattr(verifier_config, "num_key_value_heads", None) or heads)
    # Qwen2 configs carry no head_dim (or None): it is hidden / heads there.
    head_dim = getattr(verifier_config, "head_dim", None)
    if head_dim is None:
        if hidden % heads:
            raise UserError(
                f"verifier config: `hidden_size` {hidden} is not divisible by "
                f"`num_attention_heads` {heads} and no `head_dim` is given"
            )
        head_dim = hidden // heads
    if heads % kv_heads:
        raise UserError(
            f"verifier config: `num_attention_heads` {heads} is not a multiple of `num_key_value_heads` {kv_heads}"
        )
    rope = copy.deepcopy(getattr(verifier_config, "rope_parameters", None)) or {
        "rope_type": "default",
        "rope_theta": float(getattr(verifier_config, "rope_theta", 10000.0)),
    }
    # The draft rotates full heads; a partial-rotary verifier setting does not carry over.
    rope.pop("partial_rotary_factor", None)
    sliding = cfg.sliding_window is not None
    return Qwen3Config(
        vocab_size=int(require_field(verifier_config, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(require_field(verifier_config, "intermediate_size")),
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(head_dim),
        hidden_act=getattr(verifier_config, "hidden_act", None) or "silu",
        max_position_embeddings=int(require_field(verifier_config, "max_position_embeddings")),
        initializer_range=float(getattr(verifier_config, "initializer_range", 0.02)),
        rms_norm_eps=float(getattr(verifier_config, "rms_norm_eps", None) or 1e-6),
        rope_parameters=rope,
        # Qwen2 has q/k/v biases (its config names none): the draft takes biases too, so its
        # layers can start as the verifier's (the o_proj bias Qwen2 lacks starts at zero).
        attention_bias=bool(getattr(verifier_config, "attention_bias", None) or verifier_config.model_type == "qwen2"),
        tie_word_embeddings=False,
        use_sliding_window=sliding,
        sliding_window=cfg.sliding_window,
        layer_types=["sliding_attention" if sliding else "full_attention"] * cfg.num_layers,
        # vLLM reads in-block causality per draft from this flag (before any layer-type default).
        is_causal=cfg.causal_in_block,
    )


class DraftDecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer whose attention also reads the context."""

    def __init__(self, config: Qwen3Config, attn_impl: str):
        super().__init__()
        self.self_attn = DraftAttention(config, attn_impl)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, context_kv, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), context_kv, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def _check_d2t(d2t: torch.Tensor | None, draft_vocab_size: int, vocab_size: int) -> torch.Tensor | None:
    """Validated d2t offsets (draft id i -> target id i + d2t[i]), or None for a full vocabulary."""
    reduced = draft_vocab_size < vocab_size
    if not reduced:
        if d2t is not None:
            raise UserError("`d2t` given but model.draft_vocab_size is the full verifier vocabulary")
        return None
    if d2t is None:
        raise UserError(f"model.draft_vocab_size={draft_vocab_size} < {vocab_size} needs the `d2t` mapping")
    if d2t.dim() != 1 or d2t.shape[0] != draft_vocab_size or d2t.dtype.is_floating_point:
        raise UserError(
            f"`d2t` must be an integer tensor of shape [{draft_vocab_size}] "
            f"(model.draft_vocab_size), got {d2t.dtype} {tuple(d2t.shape)}"
        )
    target = torch.arange(draft_vocab_size) + d2t.long().cpu()
    if target.min() < 0 or target.max() >= vocab_size or (target[1:] <= target[:-1]).any():
        raise UserError(f"`d2t` must map draft ids to strictly increasing target ids in [0, {vocab_size})")
    return d2t.long().cpu()


class DSparkDraft(nn.Module):
    """DSpark draft model (trainable backbone + heads around the verifier's frozen tensors)."""

    def __init__(
        self,
        cfg: DraftConfig,
        verifier_config: PretrainedConfig,
        aux_layer_ids: list[int],
        mask_token_id: int,
        d2t: torch.Tensor | None = None,
    ):
        super().__init__()
        # The values themselves were checked when `cfg` was built (DraftConfig.__post_init__).
        if cfg.attn_impl == "flex" and not torch.cuda.is_available():
            raise UserError("model.attn_impl=flex needs a CUDA device; use model.attn_impl=sdpa here")
        self.cfg = cfg
        self.layer_config = draft_layer_config(verifier_config, cfg)
        self.verifier_architectures = list(getattr(verifier_config, "architectures", None) or [])
        if not aux_layer_ids:
            raise UserError("`aux_layer_ids` is empty")
        self.aux_layer_ids = list(aux_layer_ids)
        hidden, vocab = self.layer_config.hidden_size, self.layer_config.vocab_size
        if not 0 <= mask_token_id < vocab:
            raise UserError(f"`mask_token_id` {mask_token_id} is outside the embedding [0, {vocab})")
        self.mask_token_id = int(mask_token_id)
        self.block_size = cfg.block_size
        self.verifier_vocab_size = vocab
        self.draft_vocab_size = cfg.draft_vocab_size or vocab
        if not 1 <= self.draft_vocab_size <= vocab:
            raise UserError(f"model.draft_vocab_size must be in [1, {vocab}], got {cfg.draft_vocab_size}")
        d2t = _check_d2t(d2t, self.draft_vocab_size, vocab)
        t2d = None
        if d2t is not None:
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[torch.arange(self.draft_vocab_size) + d2t] = True
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)

        eps = self.layer_config.rms_norm_eps
        # Frozen verifier tensors: placeholders (uninitialized, so no memory is touched)
        # until `load_verifier` shares the verifier's own tensors in.
        self.embed_tokens = nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden), _freeze=True)
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False, device="meta")
        self.lm_head.weight = nn.Parameter(torch.empty(self.draft_vocab_size, hidden), requires_grad=False)
        self.fc = nn.Linear(len(self.aux_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(DraftDecoderLayer(self.layer_config, cfg.attn_impl) for _ in range(cfg.num_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=eps)
        self.rotary_emb = Qwen3RotaryEmbedding(self.layer_config)
        self.markov_head = None
        if cfg.markov_rank > 0:
            self.markov_head = MarkovHead(vocab, self.draft_vocab_size, cfg.markov_rank, hidden, cfg.markov_type)
        # A training-time reparametrisation of the Markov table W1 through the verifier's token
        # embedding, shared by every token and added to the free table (the export folds it in).
        self.markov_embed_proj = None
        if cfg.markov_embed_proj:
            self.markov_embed_proj = nn.Linear(hidden, cfg.markov_rank, bias=False)
        self.confidence_head = None
        if cfg.confidence_head:
            with_markov = cfg.confidence_head_with_markov
            self.confidence_head = ConfidenceHead(hidden + (cfg.markov_rank if with_markov else 0))
        self.verifier_loaded = False
        self._init_trainable()

    def _init_trainable(self) -> None:
        std = self.layer_config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear) and module is not self.lm_head:
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        if self.markov_head is not None:
            # Small previous-token embeddings: the bias starts near zero (pure parallel draft).
            nn.init.normal_(self.markov_head.markov_w1.weight, std=0.01)
        if self.markov_embed_proj is not None:
            nn.init.zeros_(self.markov_embed_proj.weight)  # the head starts as without it

    def prev_embeddings(self, prev: torch.Tensor) -> torch.Tensor:
        """[..., rank] Markov embeddings W1[prev] of previous tokens prev [...]."""
        emb = self.markov_head.prev_embeddings(prev)
        if self.markov_embed_proj is not None:
            emb = emb + self.markov_embed_proj(self.embed_tokens(prev))
        return emb

    def folded_markov_w1(self) -> torch.Tensor:
        """[V, rank] the W1 table the draft uses (with `markov_embed_proj` folded in), as exported."""
        w1 = self.markov_head.markov_w1.weight
        if self.markov_embed_proj is None:
            return w1
        return w1 + self.embed_tokens.weight.to(w1.dtype) @ self.markov_embed_proj.weight.t()

    @property
    def target_ids(self) -> torch.Tensor:
        """Verifier token id of every draft-vocabulary id, [V_draft]."""
        ids = torch.arange(self.draft_vocab_size, device=self.lm_head.weight.device)
        return ids if self.d2t is None else ids + self.d2t.to(ids.device)

    def verifier_owned(self) -> set[str]:
        """State-dict names restored from the verifier, not stored in a drafter checkpoint.

        A full-vocabulary lm_head is the verifier's own matrix (vLLM shares it); a reduced one
        is a row subset that serving runtimes cannot derive, so checkpoints carry it.
        """
        return {"embed_tokens.weight"} | ({"lm_head.weight"} if self.d2t is None else set())

    def training_only(self) -> set[str]:
        """Names of the training-time Markov projection's parameters: the export folds them into W1."""
        return {name for name, _ in self.named_parameters() if name.split(".")[0] == "markov_embed_proj"}

    def load_verifier(self, verifier: VerifierHead) -> None:
        """Share the verifier's frozen embedding and lm_head (rows of the draft vocabulary)."""
        if (verifier.vocab_size, verifier.hidden_size) != (self.verifier_vocab_size, self.layer_config.hidden_size):
            raise UserError(
                f"verifier head is [{verifier.vocab_size}, {verifier.hidden_size}], the draft was sized "
                f"for [{self.verifier_vocab_size}, {self.layer_config.hidden_size}]"
            )
        like = self.fc.weight
        self.embed_tokens.weight = nn.Parameter(
            verifier.embed_tokens.weight.to(like.device, like.dtype), requires_grad=False
        )
        lm_head = verifier.lm_head_weight.to(like.device, like.dtype)
        if self.d2t is not None:
            lm_head = lm_head[self.target_ids.to(like.device)]
        self.lm_head.weight = nn.Parameter(lm_head, requires_grad=False)
        self.verifier_loaded = True

    def block_inputs(self, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """[b, A, B] block input ids: the anchor token, then B−1 mask tokens."""
        first = input_ids.gather(1, anchors).unsqueeze(-1)
        return torch.cat([first, first.new_full((*anchors.shape, self.block_size - 1), self.mask_token_id)], -1)

    def block_tokens(self, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """[b, A, B] token at p+k (slot k's previous token), clamped to the row's last position."""
        bsz, num_anchors = anchors.shape
        offsets = torch.arange(self.block_size, device=anchors.device)
        idx = (anchors.unsqueeze(-1) + offsets).clamp(max=input_ids.shape[1] - 1)
        return input_ids.gather(1, idx.view(bsz, -1)).view(bsz, num_anchors, self.block_size)

    def forward(
        self,
        context: torch.Tensor,
        input_ids: torch.Tensor,
        anchors: torch.Tensor,
        anchor_valid: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Block hidden states [b, A, B, H] after the final norm.

        context [b, T, m·H] aux hidden states (ascending layer id); input_ids [b, T];
        anchors [b, A] positions; anchor_valid [b, A]; document_ids / position_ids [b, T].
        """
        if not self.verifier_loaded:
            raise RuntimeError("DSparkDraft.load_verifier(...) must run before the forward pass")
        bsz, seq_len, width = context.shape
        if width != self.fc.in_features:
            raise ValueError(
                f"context has width {width}; expected {len(self.aux_layer_ids)} aux layers × "
                f"{self.layer_config.hidden_size} = {self.fc.in_features}"
            )
        # Padding anchors may hold any value; their rows are discarded by the loss.
        anchors = anchors.long().clamp(0, seq_len - 1)
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=context.device).expand(bsz, seq_len)
        offsets = torch.arange(self.block_size, device=context.device)
        block_pos = (position_ids.gather(1, anchors).unsqueeze(-1) + offsets).flatten(1)
        cos, sin = self.rope(torch.cat([position_ids, block_pos], dim=1))
        if document_ids is None:
            document_ids = torch.zeros_like(input_ids)
        layout = BlockLayout(
            anchors,
            anchor_valid.bool(),
            document_ids,
            self.block_size,
            self.cfg.sliding_window,
            self.cfg.causal_in_block,
        )
        # Only the context positions a block can see (see BlockLayout.context_needed); zeros elsewhere.
        needed = layout.context_needed()
        context_kv = [
            tuple(t.new_zeros(bsz, seq_len, *t.shape[1:]).index_put((needed,), t) for t in kv)
            for kv in self.context_kv(context[needed], cos[:, :seq_len][needed], sin[:, :seq_len][needed])
        ]
        blocks = self.block_inputs(input_ids, anchors)
        return self.block_hidden(blocks, cos[:, seq_len:], sin[:, seq_len:], context_kv, layout)

    def compile_backbone(self) -> None:
        """torch.compile the decoder layers and the context's k/v path in place (`train.compile`;
        the state-dict keys stay).

        Eager, a layer is ~100 small kernels: on a GPU a step of a few thousand tokens is bound by
        their launches, not by the GPU (docs/performance.md). One code object serves all layers, and
        dimensions that change between steps (rows, context length) become dynamic at their first change.
        """
        for layer in self.layers:
            layer.compile()
        self.context_kv = torch.compile(self.context_kv)

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE cos, sin [b, L, d] of position_ids [b, L] (in the dtype of the block's embeddings)."""
        return self.rotary_emb(self.embed_tokens.weight, position_ids)

    def context_kv(
        self, aux: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer, the keys and values [N, kv_heads, d] of N context tokens: their aux
        hidden states aux [N, m·H] through `fc` and `hidden_norm`, then the layer's k/v
        projections, k-norm and RoPE at their positions (cos/sin [N, d], from `rope`).

        Nothing else enters them (not the blocks that attend them), so a decoder can keep them
        for the tokens it has accepted and project only the new ones, as vLLM's KV cache does.
        """
        ctx = self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def block_hidden(
        self,
        blocks: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        layout: BlockLayout,
    ) -> torch.Tensor:
        """Hidden states [b, A, B, H] after the final norm of the blocks of input ids blocks
        [b, A, B] (`block_inputs`) at the positions of cos/sin [b, A·B, d], attending per
        layout the context's keys and values context_kv (per layer, [b, T, kv_heads, d]: see
        `context_kv`; zeros where no block sees them)."""
        bsz, num_anchors, _ = blocks.shape
        x = self.embed_tokens(blocks).flatten(1, 2)
        mask = layout.flex() if self.cfg.attn_impl == "flex" else layout.dense()
        for layer, kv in zip(self.layers, context_kv, strict=True):
            x = layer(x, kv, cos, sin, mask)
        return self.norm(x).view(bsz, num_anchors, self.block_size, self.layer_config.hidden_size)

    def heads(
        self,
        hidden: torch.Tensor,
        prev: torch.Tensor,
        with_confidence: bool = True,
        workspace: Workspace | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft logits [n, B, V_draft] and confidence logits [n, B] (None without that head or
        when not asked for) of hidden [n, B, H] with previous tokens prev [n, B]: one Markov
        W1 lookup serves both. With a workspace (outside autocast) the logits are written into
        its reused memory (see dspark.workspace)."""
        emb = None if self.markov_head is None else self.prev_embeddings(prev)
        features = None if emb is None else self.markov_head.features(emb, hidden).flatten(0, -2)  # [n·B, rank]
        w2 = None if emb is None else self.markov_head.markov_w2.weight
        h = hidden.flatten(0, -2)
        if workspace is not None and not torch.is_autocast_enabled(hidden.device.type):
            flat = DraftLogits.apply(h, self.lm_head.weight, features, w2, workspace)
        elif features is None:
            flat = F.linear(h, self.lm_head.weight)
        else:
            # The bias W2·f is a fresh 2-D GEMM output that no backward reads, so the lm_head
            # GEMM accumulates into it in place: no [n, B, V] add or copy. In-place ops are not
            # autocast: operands are matched to the bias's dtype by hand (bf16 under autocast).
            bias = F.linear(features, w2)
            flat = bias.addmm_(h.to(bias.dtype), self.lm_head.weight.to(bias.dtype).t())
        logits = flat.view(*hidden.shape[:-1], flat.shape[-1])
        if not with_confidence or self.confidence_head is None:
            return logits, None
        return logits, self._confidence(hidden, emb)

    def draft_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """[n, B, V_draft] logits: frozen lm_head plus the Markov bias of each slot's previous token."""
        return self.heads(hidden, prev, with_confidence=False)[0]

    def confidence_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """[n, B] logits of the probability that each slot is accepted."""
        if self.confidence_head is None:
            raise RuntimeError("this draft has no confidence head (model.confidence_head=false)")
        with_markov = self.cfg.confidence_head_with_markov
        return self._confidence(hidden, self.prev_embeddings(prev) if with_markov else None)

    def _confidence(self, hidden: torch.Tensor, emb: torch.Tensor | None) -> torch.Tensor:
        if self.cfg.confidence_head_with_markov:
            hidden = torch.cat([hidden, emb], dim=-1)
        return self.confidence_head(hidden)


__all__ = ["DSparkDraft", "DraftDecoderLayer", "draft_layer_config"]
