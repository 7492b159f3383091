"""`drafter=standalone`: a small causal LM with the target's tokenizer, distilled with LoRA adapters (peft).

The model is the target's first k decoder layers with its embeddings, final norm and LM head (the target's
own weights, frozen); peft adds LoRA adapters to every linear layer of those k layers and only they train,
on the same CE + L1 losses as the block drafters, one next-token prediction per response position. The
export merges the adapters and saves a plain Hugging Face model plus the target's tokenizer, which HF
assisted generation, vLLM's draft-model mode and our `proposer=model` load as they are.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def truncated_copy(target_model, num_layers: int):
    """The target's first `num_layers` decoder layers with its embeddings, final norm and LM head (a copy)."""
    total = target_model.config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise ValueError(f"drafter.standalone_layers={num_layers}; the target has {total} layers")
    config = copy.deepcopy(target_model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    model = type(target_model)(config)
    kept = {k: v for k, v in target_model.state_dict().items()
            if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < num_layers}
    missing, unexpected = model.load_state_dict(kept, strict=False)
    if unexpected or any("rotary" not in k for k in missing):
        raise ValueError(f"cannot cut {type(target_model).__name__} to {num_layers} layers: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return model.to(next(target_model.parameters()).dtype)


class StandaloneDrafter(nn.Module):
    """A LoRA-adapted truncated target; `logits` gives next-token logits over the target's whole vocabulary."""

    mode = "standalone"
    block_size = 1  # one prediction per position; drafting is autoregressive at decode time

    def __init__(self, target_model, num_layers: int, lora_rank: int = 16, lora_alpha: int = 32):
        super().__init__()
        from peft import LoraConfig, get_peft_model

        base = truncated_copy(target_model, num_layers).requires_grad_(False)
        self.lm = get_peft_model(base, LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules="all-linear",
                                                  lora_dropout=0.0))
        self.register_buffer("draft_to_target", torch.arange(target_model.config.vocab_size), persistent=False)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.lm.get_input_embeddings()

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, V): position t predicts token t+1."""
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def merged(self):
        """A plain transformers model with the adapters folded in (the drafter itself is left as it is)."""
        return copy.deepcopy(self.lm).merge_and_unload().eval()


def standalone_pieces(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor):
    """One sequence laid out like blocks of one slot: logits at every position followed by a response token,
    those positions (the rows of the target's predictions), the next tokens, validity."""
    # logits (T, V); ids, mask (T,) -> (N, 1, V), (N, 1), (N, 1), (N, 1)
    positions = torch.nonzero(mask[1:], as_tuple=False).squeeze(-1)
    rows = positions[:, None]
    return logits[positions][:, None], rows, ids[positions + 1][:, None], torch.ones_like(rows, dtype=torch.bool)
