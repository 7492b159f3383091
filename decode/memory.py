"""Memory by part, as the server's /metrics and the bench's results.json report it: the target's weights, the
fast backend's packed copies of them, the drafter's own weights and the target's KV cache."""

from __future__ import annotations

import torch


def module_bytes(*objects) -> int:
    """Bytes of the distinct parameters and buffers of the torch modules held by `objects` (two levels of
    attributes deep: a proposer's drafter, a hybrid's parts), each tensor counted once."""
    seen, total = set(), 0

    def visit(obj, depth):
        nonlocal total
        if isinstance(obj, torch.nn.Module):
            for tensor in list(obj.parameters()) + list(obj.buffers()):
                if tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    total += tensor.numel() * tensor.element_size()
        elif depth and hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                visit(value, depth - 1)

    for obj in objects:
        visit(obj, 2)
    return total


def weights_by_part(target, backend, proposer) -> dict[str, int]:
    """target_weights, fast_backend_weights and drafter_weights in bytes. proposer=model without a path drafts
    with the target itself: its weights are not a second copy."""
    target_bytes = module_bytes(target.model)
    shares = getattr(proposer, "model", None) is target.model
    return {"target_weights": target_bytes,
            "fast_backend_weights": getattr(backend, "packed_bytes", lambda: 0)(),
            "drafter_weights": module_bytes(proposer) - (target_bytes if shares else 0)}


def kv_cache_bytes(model_config, positions: int, dtype: torch.dtype) -> int:
    """Bytes of one sequence's keys and values over `positions` positions in every layer of an HF decoder."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    per_position = 2 * model_config.num_hidden_layers * kv_heads * head_dim  # keys and values
    return per_position * positions * torch.empty((), dtype=dtype).element_size()
