"""Target backends: what computes the target's forward for the decode engine, chosen by `target.backend`.

- `hf`: the transformers model itself, called with a DynamicCache: the reference every other backend is
  held to.
- `fast`: decode/fast_target.py, the same forward laid out for this machine's kernels (exact in float32
  within rounding; tests/test_fast_target.py).
- `auto` (the default): `fast` where it runs exactly and fast, else `hf`, with one line saying why.

Both take (B, T) token ids, a cache of their own kind, optional position ids and an additive 4D mask,
and return float32 logits and the concatenated hidden states of the layers a drafter reads, so the
sessions (decode/session.py, decode/batch_session.py) never call a model directly.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specdraft.decode.fast_target import FastTarget, Unsupported, unsupported_reason
from specdraft.decode.linear_kernels import KERNEL_CHOICES, candidates

BACKEND_NAMES = ("auto", "fast", "hf")


class HFBackend:
    """The transformers model's own forward over a DynamicCache (the reference)."""

    name = "hf"

    def __init__(self, model: torch.nn.Module):
        self.model, self.config, self.dtype, self.device = model, model.config, model.dtype, model.device

    def describe(self) -> dict:
        return {"name": self.name, "kernel": "transformers", "kernels": None}

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, cache, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, logits_to_keep: int = 0,
                 feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T) ids -> float32 logits (B, T', V) and features (B, T, n*H) or None (see FastTarget)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep,
                         output_hidden_states=bool(feature_layers))
        # hidden_states[0] is the embedding output; index i is the output of decoder layer i-1, except the
        # last index, which HF returns after the final norm.
        features = torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1) if feature_layers else None
        return out.logits.float(), features


def as_backend(model_or_backend):
    """A backend as it is, or an HF model wrapped as the reference backend (tests pass tiny models)."""
    return HFBackend(model_or_backend) if isinstance(model_or_backend, torch.nn.Module) else model_or_backend


def fast_unavailable(model: torch.nn.Module) -> str | None:
    """Why `target.backend=auto` would not pick the fast backend for `model`, or None when it would."""
    reason = unsupported_reason(model)
    if reason:
        return reason
    if model.device.type != "cpu":
        return f"the fast backend's kernels are CPU kernels; on {model.device.type} the HF model runs"
    if candidates(model.dtype, model.device) == ["torch"]:
        if model.dtype == torch.float32:
            return "this PyTorch build has neither oneDNN nor MKL (torch.backends.mkldnn / mkl .is_available())"
        return f"{str(model.dtype).replace('torch.', '')} has no native oneDNN kernels on this CPU"
    return None


def build_backend(model: torch.nn.Module, name: str = "auto", log=print, kernel: str = "auto"):
    """The backend `name` (auto | fast | hf) for a loaded HF causal LM; `log` gets auto's fallback line and
    the fast backend's kernel choice. kernel: `target.kernel` (decode/linear_kernels.py)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"target.backend={name!r}; choose one of {list(BACKEND_NAMES)}")
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"target.kernel={kernel!r}; choose one of {list(KERNEL_CHOICES)}")
    if name == "hf":
        return HFBackend(model)
    if name == "fast":
        reason = unsupported_reason(model)
        if reason:
            raise Unsupported(f"target.backend=fast cannot run this target: {reason}. "
                              "Use target.backend=hf (or auto, which falls back by itself).")
        return _fast(model, kernel)
    reason = fast_unavailable(model)
    if reason:
        log(f"target.backend=auto: running the HF reference backend, because {reason}")
        return HFBackend(model)
    return _fast(model, kernel)


def _fast(model: torch.nn.Module, kernel: str) -> FastTarget:
    backend = FastTarget(model, kernel)
    plan = backend.plan  # results.json records it (describe()); said once, when it was just measured
    if plan.source == "measured":
        one = {name: round(ms["1"], 2) for name, ms in plan.measured_ms.items()}
        print(f"fast backend kernels: {plan.label}, measured on this machine (a one-row step with each, ms: "
              f"{one}); cached in {plan.cache_file}; target.kernel=NAME fixes one")
    return backend
