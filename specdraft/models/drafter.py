"""The parallel block drafter: DSpark (with Markov and confidence heads) and DFlash (without).

The target's hidden states at a few layers are concatenated, projected to the draft width (`fc`)
and normalised (`hidden_norm`): these "context features" become extra keys/values in every draft
layer. A block anchored at position a holds the token x_a in its first slot and mask tokens in the
others; it attends to the context features of positions < a and to itself bidirectionally, and
slot k predicts token a+k+1 (DeepSpec's "sample from anchor"). Embeddings and the LM head are the
target's, frozen; the LM head may keep only a reduced draft vocabulary (rows of the target's).

Draft layers are Qwen3-style (q/k RMSNorm per head), built from transformers' Qwen3 MLP, norm and
rotary modules; only the attention, which takes the injected context, is written here. Names of
parameters follow vLLM's `speculators` DFlash/DSpark checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from specdraft.models.block_mask import block_attention_mask, block_positions
from specdraft.models.heads import ConfidenceHead, MarkovHead
from specdraft.models.registry import BLOCK_MODES, kind



def draft_layer_config(target_config, num_layers: int, config_class=Qwen3Config):
    """A decoder config (Qwen3 by default) with the target's widths, heads and rotary settings, `num_layers` deep."""
    head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    rope = getattr(target_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    return config_class(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=target_config.num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=target_config.rms_norm_eps,
        max_position_embeddings=target_config.max_position_embeddings,
        rope_parameters=dict(rope),
        hidden_act=getattr(target_config, "hidden_act", "silu"),
        attention_bias=False,
        tie_word_embeddings=False,
    )


class ScaledLinear(nn.Linear):
    """The fusion projection `fc` over concatenated target hidden states, with a fixed per-channel input
    scale (buffer `input_scale`, set once from data statistics). Target hidden states carry outlier
    channels (on SmolLM2, channel RMS up to 360 against a median of 12 at layer 27) and layers differ
    tenfold in scale; dividing by each channel's RMS lets every channel learn at the same pace. The
    function class is unchanged: exports fold the scale into the weight (fc.weight / input_scale)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.register_buffer("input_scale", torch.ones(in_features), persistent=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x / self.input_scale.to(x.dtype), self.weight)

    @torch.no_grad()
    def set_input_scale(self, features: torch.Tensor) -> None:
        """Per-channel RMS of sample features (N, in_features), floored so a dead channel cannot blow up."""
        rms = features.float().pow(2).mean(0).sqrt()
        self.input_scale.copy_(rms.clamp_min(1e-3 * float(rms.mean())))

    def folded_weight(self) -> torch.Tensor:
        """The plain Linear weight with the same function: W[:, c] / scale[c]."""
        return self.weight / self.input_scale.to(self.weight.dtype)[None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (B, heads, S, D); cos/sin (S, D)
    return x * cos + _rotate_half(x) * sin


class ContextAttention(nn.Module):
    """Attention whose keys/values are the context features followed by the block's own states."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        width = config.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, width, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_kv(self, x: torch.Tensor):
        """The key and value projections of x (the fast twin computes both in one matmul)."""
        # x (B, S, H) -> k, v (B, S, kv_heads * D) each
        return self.k_proj(x), self.v_proj(x)

    def project_qkv(self, x: torch.Tensor):
        """The query, key and value projections of x (the fast twin computes all three in one matmul)."""
        # x (B, S, H) -> q (B, S, heads * D), k, v (B, S, kv_heads * D)
        return self.q_proj(x), *self.project_kv(x)

    def _rotated_keys_values(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # k, v (B, S, kv_heads * D) -> (B, kv_heads, S, D) each, keys normalised per head and rotated
        batch, length, _ = k.shape
        k = self.k_norm(k.view(batch, length, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        return _apply_rotary(k, cos, sin), v

    def context_keys_values(self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys (rotated) and values of context features; cacheable, they never change."""
        # context (B, C, H) -> k, v (B, kv_heads, C, D)
        return self._rotated_keys_values(*self.project_kv(context), cos, sin)

    def forward(self, hidden, context_kv, cos, sin, mask):
        """Block states attend to [context keys; block keys]; mask (S, C+S) bool or None (all visible)."""
        # hidden (B, S, H); context_kv: (B, kv_heads, C, D) twice; cos/sin (S, D)
        batch, length, _ = hidden.shape
        q, k, v = self.project_qkv(hidden)
        q = self.q_norm(q.view(batch, length, self.heads, self.head_dim)).transpose(1, 2)
        block_k, block_v = self._rotated_keys_values(k, v, cos, sin)
        q = _apply_rotary(q, cos, sin)
        k = torch.cat([context_kv[0], block_k], dim=2)  # (B, kv_heads, C+S, D)
        v = torch.cat([context_kv[1], block_v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))  # (B, S, H)


class DraftLayer(nn.Module):
    """Pre-norm decoder layer: context attention, then the Qwen3 MLP."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = ContextAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, context_kv, cos, sin, mask):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context_kv, cos, sin, mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@dataclass
class DraftOutput:
    """Per block slot: logits over the draft vocabulary (before the Markov bias), hidden states."""

    logits: torch.Tensor | None  # (N, γ, V_draft); None when the caller applies the LM head itself
    hidden: torch.Tensor  # (N, γ, H)


class BlockDrafter(nn.Module):
    """Parallel block backbone with optional Markov and confidence heads (mode dspark | dflash)."""

    def __init__(
        self,
        target_config,
        num_layers: int = 1,
        num_feature_layers: int = 5,
        block_size: int = 7,
        mask_token_id: int = 0,
        mode: str = "dspark",
        markov_rank: int = 256,
        markov_head_type: str = "vanilla",
        draft_vocab_ids: torch.Tensor | None = None,
    ):
        super().__init__()
        if not kind(mode).block:
            raise ValueError(f"drafter mode {mode!r} is not a block drafter; choose one of {list(BLOCK_MODES)}")
        self.config = draft_layer_config(target_config, num_layers)
        width, target_vocab = self.config.hidden_size, target_config.vocab_size
        self.mode, self.block_size, self.mask_token_id = mode, block_size, mask_token_id
        if draft_vocab_ids is None:
            draft_vocab_ids = torch.arange(target_vocab)
        if not bool((draft_vocab_ids[1:] > draft_vocab_ids[:-1]).all()):
            raise ValueError("draft_vocab_ids must be sorted and unique (speculators rebuilds the head in id order)")
        # draft id -> target id (speculators' d2t, as absolute ids).
        self.register_buffer("draft_to_target", draft_vocab_ids.long().clone(), persistent=True)
        self.fc = ScaledLinear(num_feature_layers * target_config.hidden_size, width)
        self.hidden_norm = Qwen3RMSNorm(width, eps=self.config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(self.config) for _ in range(num_layers))
        self.norm = Qwen3RMSNorm(width, eps=self.config.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(self.config)
        self.embed_tokens = nn.Embedding(target_vocab, width).requires_grad_(False)
        self.lm_head = nn.Linear(width, len(draft_vocab_ids), bias=False).requires_grad_(False)
        self.markov_head = self.confidence_head = None
        if kind(mode).markov_head:  # DSpark: with it the confidence head
            self.markov_head = MarkovHead(target_vocab, len(draft_vocab_ids), markov_rank, width, markov_head_type)
            self.confidence_head = ConfidenceHead(width + markov_rank)

    @torch.no_grad()
    def copy_target_weights(self, target_model) -> None:
        """Frozen embeddings and LM head rows (draft vocabulary) from the target."""
        self.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
        self.lm_head.weight.copy_(target_model.get_output_embeddings().weight[self.draft_to_target])

    @torch.no_grad()
    def init_layers_from_target(self, target_model) -> None:
        """Start each draft layer from one of the target's last decoder layers (same widths), and the
        final norm from the target's: the frozen LM head then starts reading states on the scale it was
        trained on, instead of a random layer's. q/k norms stay at one (the target has none)."""
        target_layers = target_model.model.layers[-len(self.layers):]
        for draft, source in zip(self.layers, target_layers):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(draft.self_attn, name).weight.copy_(getattr(source.self_attn, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(draft.mlp, name).weight.copy_(getattr(source.mlp, name).weight)
            draft.input_layernorm.weight.copy_(source.input_layernorm.weight)
            draft.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)
        self.norm.weight.copy_(target_model.model.norm.weight)

    def rotary_cos_sin(self, positions: torch.Tensor, like: torch.Tensor):
        cos, sin = self.rotary(like, positions[None])  # (1, S, D)
        return cos[0], sin[0]

    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """Concatenated target hidden states -> normalised context features."""
        # (B, T, L*H_target) -> (B, T, H)
        return self.hidden_norm(self.fc(target_features))

    def block_inputs(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings of [x_a, mask, ..., mask] for each block."""
        # (N,) -> (N, γ, H)
        tokens = anchor_tokens.new_full((anchor_tokens.shape[0], self.block_size), self.mask_token_id)
        tokens[:, 0] = anchor_tokens
        return self.embed_tokens(tokens)

    def forward_packed(self, context: torch.Tensor, anchors: torch.Tensor, anchor_tokens: torch.Tensor) -> DraftOutput:
        """Training: all blocks of one sequence in one pass under the block mask."""
        # context (T, H) projected features of one sequence; anchors, anchor_tokens (N,)
        num_blocks, length = anchors.shape[0], context.shape[0]
        hidden = self.block_inputs(anchor_tokens).reshape(1, num_blocks * self.block_size, -1)  # (1, N*γ, H)
        context_cos, context_sin = self.rotary_cos_sin(torch.arange(length, device=context.device), context)
        cos, sin = self.rotary_cos_sin(block_positions(anchors, self.block_size), context)
        mask = block_attention_mask(anchors, length, self.block_size)  # (N*γ, T + N*γ)
        for layer in self.layers:
            context_kv = layer.self_attn.context_keys_values(context[None], context_cos, context_sin)
            hidden = layer(hidden, context_kv, cos, sin, mask)
        hidden = self.norm(hidden).reshape(num_blocks, self.block_size, -1)  # (N, γ, H)
        return DraftOutput(logits=self.lm_head(hidden), hidden=hidden)

    def forward_block(self, context_kv: list, context_length: int, anchor_token: torch.Tensor,
                      logits: bool = True) -> DraftOutput:
        """Inference: one block after a cached context of `context_length` positions (all visible).
        logits=False leaves the LM head to the caller (logits None): decoding needs it only for the
        positions it drafts, and a scheduler often stops after c_1, before any."""
        # context_kv: per layer (k, v), each (1, kv_heads, C, D); anchor_token (1,)
        hidden = self.block_inputs(anchor_token)  # (1, γ, H)
        positions = torch.arange(context_length, context_length + self.block_size, device=hidden.device)
        cos, sin = self.rotary_cos_sin(positions, hidden)
        for layer, layer_kv in zip(self.layers, context_kv):
            hidden = layer(hidden, layer_kv, cos, sin, None)
        hidden = self.norm(hidden)
        return DraftOutput(logits=self.lm_head(hidden) if logits else None, hidden=hidden)

    def forward_blocks(self, context_kvs: list[list], context_lengths: list[int], anchor_tokens: torch.Tensor,
                       logits: bool = True) -> DraftOutput:
        """Inference for R requests in one pass: the batched twin of `forward_block` (parity-tested).

        Each request's cached context has its own length; caches are right-padded to the longest and
        the padding is masked out, and each block's rotary positions start at its own context length."""
        # context_kvs[r]: per layer (k, v), each (1, kv_heads, C_r, D); anchor_tokens (R,)
        rows, longest, block = len(context_kvs), max(context_lengths), self.block_size
        hidden = self.block_inputs(anchor_tokens)  # (R, γ, H)
        lengths = torch.tensor(context_lengths, device=hidden.device)
        positions = lengths[:, None] + torch.arange(block, device=hidden.device)  # (R, γ)
        cos, sin = self.rotary(hidden, positions)  # (R, γ, D)
        cos, sin = cos[:, None], sin[:, None]  # (R, 1, γ, D): broadcast over heads
        visible = torch.arange(longest, device=hidden.device)[None] < lengths[:, None]  # (R, C_max)
        mask = torch.cat([visible, visible.new_ones(rows, block)], 1)[:, None, None]  # (R, 1, 1, C_max + γ)
        for index, layer in enumerate(self.layers):
            padded = []
            for part in (0, 1):  # keys, then values: (R, kv_heads, C_max, D), zeros beyond each C_r
                first = context_kvs[0][index][part]
                out = first.new_zeros(rows, first.shape[1], longest, first.shape[3])
                for r, kv in enumerate(context_kvs):
                    out[r, :, : context_lengths[r]] = kv[index][part][0]
                padded.append(out)
            hidden = layer(hidden, padded, cos, sin, mask)
        hidden = self.norm(hidden)
        return DraftOutput(logits=self.lm_head(hidden) if logits else None, hidden=hidden)

    def context_cache(self, context: torch.Tensor, start: int) -> list:
        """Per-layer keys/values of context features at positions start, start+1, ... (to append to a cache)."""
        # context (1, C_new, H)
        positions = torch.arange(start, start + context.shape[1], device=context.device)
        cos, sin = self.rotary_cos_sin(positions, context)
        return [layer.self_attn.context_keys_values(context, cos, sin) for layer in self.layers]
