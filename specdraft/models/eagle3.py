"""The Eagle-3 baseline: a one-layer autoregressive draft head trained with training-time test.

Input at position t is [embedding of x_{t+1}; hidden_t], where hidden_t is the fused target
features of position t (fc over the chosen layers) for positions the target has processed, and the
head's own output of the previous step for drafted positions. Its output at t predicts x_{t+2}.

Training-time test unrolls S steps over the whole sequence at once. Step s, query t stands for the
drafted position t+s of a chain that started after context x_{..t+1}: it sees step-0 keys at
positions <= t (the real context) and the keys of its own chain at steps 1..s (same t). Each step's
loss is weighted by decay**s. Inference (decode.proposer.Eagle3Proposer) runs the same layer
step by step over a cached context; a test checks the two agree.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from specdraft.models.drafter import ScaledLinear, _apply_rotary, draft_layer_config


def eagle3_layer_config(target_config) -> LlamaConfig:
    """The head's decoder config: a Llama layer (no q/k norms, as Eagle-3 heads are) with the target's widths."""
    return draft_layer_config(target_config, 1, LlamaConfig)


class Eagle3Attention(nn.Module):
    """Projections of the 2H input; a module of its own so parameter names are speculators' `self_attn.*`."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        width, self.heads, self.kv_heads, self.head_dim = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(2 * width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, width, bias=False)


class Eagle3Layer(nn.Module):
    """Decoder layer over [token embedding; hidden] (2H) with a residual on the hidden input."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        width = config.hidden_size
        self.self_attn = Eagle3Attention(config)
        self.input_layernorm = LlamaRMSNorm(width, eps=config.rms_norm_eps)  # on token embeddings
        self.hidden_norm = LlamaRMSNorm(width, eps=config.rms_norm_eps)  # on the hidden input
        self.post_attention_layernorm = LlamaRMSNorm(width, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, embeddings, hidden, cos, sin, prefix_kv=None, mask=None):
        """Returns (output (B, S, H), own keys/values). Keys are [prefix; own] under `mask` (S, P+S)."""
        attn, (batch, length, _) = self.self_attn, hidden.shape
        x = torch.cat([self.input_layernorm(embeddings), self.hidden_norm(hidden)], dim=-1)  # (B, S, 2H)
        q = _apply_rotary(attn.q_proj(x).view(batch, length, attn.heads, attn.head_dim).transpose(1, 2), cos, sin)
        k = _apply_rotary(attn.k_proj(x).view(batch, length, attn.kv_heads, attn.head_dim).transpose(1, 2), cos, sin)
        v = attn.v_proj(x).view(batch, length, attn.kv_heads, attn.head_dim).transpose(1, 2)
        keys = k if prefix_kv is None else torch.cat([prefix_kv[0], k], dim=2)
        values = v if prefix_kv is None else torch.cat([prefix_kv[1], v], dim=2)
        attended = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=attn.heads != attn.kv_heads)
        out = hidden + attn.o_proj(attended.transpose(1, 2).reshape(batch, length, -1))  # (B, S, H)
        return out + self.mlp(self.post_attention_layernorm(out)), (k, v)


class Eagle3Drafter(nn.Module):
    """Fused target features -> one Eagle-3 layer -> frozen LM head (optionally a reduced draft vocabulary)."""

    mode = "eagle3"
    markov_head = None
    confidence_head = None

    def __init__(self, target_config, num_feature_layers: int = 3, steps: int = 7, draft_vocab_ids: torch.Tensor | None = None):
        super().__init__()
        self.config = eagle3_layer_config(target_config)
        width, target_vocab = self.config.hidden_size, target_config.vocab_size
        self.block_size = steps  # drafted tokens per proposal at most, like a block drafter's block
        if draft_vocab_ids is None:
            draft_vocab_ids = torch.arange(target_vocab)
        self.register_buffer("draft_to_target", draft_vocab_ids.long().clone(), persistent=True)
        self.fc = ScaledLinear(num_feature_layers * target_config.hidden_size, width)
        self.layers = nn.ModuleList([Eagle3Layer(self.config)])  # one layer; speculators' names (layers.0.*)
        self.norm = LlamaRMSNorm(width, eps=self.config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(self.config)
        self.embed_tokens = nn.Embedding(target_vocab, width).requires_grad_(False)
        self.lm_head = nn.Linear(width, len(draft_vocab_ids), bias=False).requires_grad_(False)

    @torch.no_grad()
    def copy_target_weights(self, target_model) -> None:
        """Frozen embeddings and LM head rows (draft vocabulary) from the target."""
        self.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
        self.lm_head.weight.copy_(target_model.get_output_embeddings().weight[self.draft_to_target])

    def cos_sin(self, positions: torch.Tensor, like: torch.Tensor):
        cos, sin = self.rotary(like, positions[None])
        return cos[0], sin[0]

    def forward_ttt(self, features: torch.Tensor, tokens: torch.Tensor, steps: int, filler_token: int = 0):
        """Training-time test over one sequence: per step, logits (T, V_draft) for every position."""
        # features (T, L*H_target); tokens (T,)
        length = tokens.shape[0]
        t = torch.arange(length, device=tokens.device)
        hidden = self.fc(features)[None]  # (1, T, H)
        prefix, outputs = None, []
        causal = t[None, :] <= t[:, None]  # step 0: the real context, causally
        diagonal = t[None, :] == t[:, None]  # steps >= 1: only the query's own chain
        for step in range(steps):
            index = t + step + 1  # token fed at (t, step) is x_{t+step+1}
            token_in = torch.where(index < length, tokens[index.clamp(max=length - 1)], filler_token)
            cos, sin = self.cos_sin(t + step, hidden)
            mask = torch.cat([causal] + [diagonal] * step, dim=1)  # (T, T*(step+1))
            hidden, (k, v) = self.layers[0](self.embed_tokens(token_in)[None], hidden, cos, sin, prefix, mask)
            prefix = (k, v) if prefix is None else (torch.cat([prefix[0], k], 2), torch.cat([prefix[1], v], 2))
            outputs.append(self.lm_head(self.norm(hidden))[0])
        return outputs

    def context_step(self, features: torch.Tensor, next_tokens: torch.Tensor, start: int, prefix_kv):
        """Step-0 pass over new context positions; returns (output hidden (1, m, H), keys/values to cache)."""
        # features (m, L*H_target); next_tokens (m,): x_{t+1} for each new position t
        m = next_tokens.shape[0]
        positions = torch.arange(start, start + m, device=next_tokens.device)
        cos, sin = self.cos_sin(positions, features)
        prefix_length = 0 if prefix_kv is None else prefix_kv[0].shape[2]
        mask = torch.cat([torch.ones(m, prefix_length, dtype=torch.bool, device=features.device),
                          positions[None, :] <= positions[:, None]], dim=1)
        out, own = self.layers[0](self.embed_tokens(next_tokens)[None], self.fc(features)[None], cos, sin, prefix_kv, mask)
        return out, own

    def draft_step(self, token: torch.Tensor, hidden: torch.Tensor, position: int, prefix_kv):
        """One drafted position: input [emb(token); hidden] sees every cached key; returns (out (1,1,H), own kv)."""
        cos, sin = self.cos_sin(torch.tensor([position], device=hidden.device), hidden)
        return self.layers[0](self.embed_tokens(token.reshape(1, 1)), hidden, cos, sin, prefix_kv, None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))
