"""The fast target backend: the same Llama/Qwen-style forward as transformers' model, computed for the
decode engine's shapes (1-16 new tokens over a KV cache) near this machine's limit.

Why it is faster than calling the HF model (measured on 2-core EPYCs, fp32, docs/results/):
- Linear layers run on the kernel this machine computes fastest at each of the engine's row counts, chosen
  by measurement once per machine (decode/linear_kernels.py): oneDNN with weights reordered once into its
  blocked layout, MKL's sgemm over a pre-transposed weight or over one packed for the row count, F.linear,
  or the native small-row kernel (decode/native_linear.py) where the CPU has AVX-512 or AVX2.
  MKL through `F.linear` alone (what the HF model calls) picks poor kernels at 3-16 rows on every CPU
  measured.
- QKV and gate/up are one matmul each (their weights concatenated), so each layer reads its input once
  and launches 4 GEMMs instead of 7.
- The KV cache is preallocated per layer and written in place (DynamicCache concatenates every step, which
  cost about 7 ms of a 50 ms one-token step here), and cropping a rejected draft only moves a length.
- Logits are computed only for the positions asked for, hidden states only for the layers a drafter reads.

It reuses the HF model's own weights, embedding, rotary embedding and `apply_rotary_pos_emb`; nothing of
the modeling file is copied. The reordered weights are a second copy of the linear layers (the HF model keeps
its own for the reference path, HF baselines and training): about 540 MB more for the embedded target in fp32. tests/test_fast_target.py holds it to the HF model (logits within 1e-4,
the same greedy tokens) on tiny random Llama/Qwen models and on the embedded target.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from specdraft.decode.linear_kernels import (EXTRA_LAYOUTS_MAX_MEMORY, ROWS, KernelPlan, PackedLinear, candidates,
                                             memory_bytes, plan_for, weight_bytes)

# Architectures whose decoder layer is exactly: RMSNorm -> attention (q/k/v/o, RoPE, optional per-head q/k
# RMSNorm, optional biases) -> residual -> RMSNorm -> SiLU-gated MLP -> residual, with a final RMSNorm.
SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "mistral")
class Unsupported(ValueError):
    """The fast backend cannot run this model or dtype exactly; the message says why."""


def unsupported_reason(model) -> str | None:
    """Why the fast backend cannot reproduce `model`'s forward, or None when it can."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        return f"model_type {kind!r} is not one of the supported Llama/Qwen-style types {list(SUPPORTED_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act={config.hidden_act!r} (the fast backend computes SiLU-gated MLPs only)"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return f"pretraining_tp={config.pretraining_tp} splits the linear layers differently"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention is not implemented in the fast backend"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return f"layer types {sorted(set(config.layer_types))} include attention other than full attention"
    if model.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {model.dtype} is not a floating-point dtype the fast backend runs"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return f"{type(model).__name__} has no .model.layers / .model.rotary_emb to read"
    for layer in base.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return f"decoder layer {type(layer).__name__} does not have the q/k/v/o attention layout"
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return f"MLP {type(mlp).__name__} is not gate/up/down"
    return None


def fused_linear(linears: list[torch.nn.Linear], plan: KernelPlan) -> PackedLinear:
    """One PackedLinear computing several Linear layers on the same input, outputs concatenated."""
    weight = torch.cat([linear.weight for linear in linears], dim=0)
    biases = [linear.bias for linear in linears]
    if all(b is None for b in biases):
        bias = None
    else:
        bias = torch.cat([b if b is not None else linear.weight.new_zeros(linear.out_features)
                          for b, linear in zip(biases, linears)])
    return PackedLinear(weight, bias, plan)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama/Qwen RMSNorm. float32: the fused kernel (the same function). Other dtypes: HF's own order of
    roundings (normalize in fp32, round to the dtype, then scale by the weight in the dtype); the fused kernel
    scales in fp32 and rounds once, which moved bf16 argmaxes at about 2.5% of positions of a tiny model."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    wide = x.float()
    return weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def norm_eps(norm: torch.nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


class _Layer:
    """One decoder layer's weights, in the fast backend's form."""

    def __init__(self, layer, plan: KernelPlan):
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = (layer.input_layernorm.weight.detach(), norm_eps(layer.input_layernorm))
        self.post_norm = (layer.post_attention_layernorm.weight.detach(), norm_eps(layer.post_attention_layernorm))
        self.qkv = fused_linear([attn.q_proj, attn.k_proj, attn.v_proj], plan)
        self.o = PackedLinear(attn.o_proj.weight, attn.o_proj.bias, plan)
        self.gate_up = fused_linear([mlp.gate_proj, mlp.up_proj], plan)
        self.down = PackedLinear(mlp.down_proj.weight, mlp.down_proj.bias, plan)
        self.q_size, self.kv_size = attn.q_proj.out_features, attn.k_proj.out_features
        self.intermediate = mlp.gate_proj.out_features
        # Qwen3 normalizes each head's q and k before RoPE.
        self.q_norm = None if getattr(attn, "q_norm", None) is None else (attn.q_norm.weight.detach(), norm_eps(attn.q_norm))
        self.k_norm = None if getattr(attn, "k_norm", None) is None else (attn.k_norm.weight.detach(), norm_eps(attn.k_norm))
        self.scaling = float(attn.scaling)


class KVLayer:
    """One layer's keys and values (B, heads, capacity, D), of which the first `length` slots are in use.

    `keys`/`values` are views of the used slots; assigning them (the batched session concatenates, indexes
    and gathers rows) replaces the buffers, which grow again on the next append. Each view keeps its own
    length until the next append: the session assigns keys, then reads values to build theirs."""

    def __init__(self):
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._key_length = self._value_length = 0

    @property
    def length(self) -> int:
        return self._key_length

    @length.setter
    def length(self, value: int) -> None:
        self._key_length = self._value_length = value

    @property
    def keys(self) -> torch.Tensor:
        return self._keys[:, :, : self._key_length]

    @keys.setter
    def keys(self, tensor: torch.Tensor) -> None:
        self._keys, self._key_length = tensor, tensor.shape[2]

    @property
    def values(self) -> torch.Tensor:
        return self._values[:, :, : self._value_length]

    @values.setter
    def values(self, tensor: torch.Tensor) -> None:
        self._values, self._value_length = tensor, tensor.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, heads, T, D) new slots after the used ones; return every used slot."""
        if self._key_length != self._value_length:
            raise RuntimeError(f"keys hold {self._key_length} slots but values {self._value_length}; assign both")
        start = self.length
        end = start + keys.shape[2]
        if self._keys is None or end > self._keys.shape[2] or end > self._values.shape[2]:
            self._grow(keys, end)
        self._keys[:, :, start:end] = keys
        self._values[:, :, start:end] = values
        self.length = end
        return self.keys, self.values

    def _grow(self, like: torch.Tensor, needed: int) -> None:
        # Doubling keeps appends amortized O(1); 256 slots of headroom cover a verify step's worth of growth.
        capacity = max(needed + 256, 2 * (0 if self._keys is None else self._keys.shape[2]))
        shape = (like.shape[0], like.shape[1], capacity, like.shape[3])
        keys, values = like.new_empty(shape), like.new_empty(shape)
        if self._keys is not None and self.length:
            keys[:, :, : self.length] = self.keys
            values[:, :, : self.length] = self.values
        self._keys, self._values = keys, values


class FastCache:
    """The fast backend's KV cache: one KVLayer per decoder layer, cropped like DynamicCache."""

    def __init__(self, num_layers: int):
        self.layers = [KVLayer() for _ in range(num_layers)]

    def get_seq_length(self) -> int:
        return self.layers[0].length

    def crop(self, length: int) -> None:
        """Keep the first `length` slots; a negative `length` removes that many (DynamicCache's convention)."""
        keep = self.get_seq_length() + length if length < 0 else length
        for layer in self.layers:
            layer.length = min(layer.length, max(keep, 0))


def linear_shapes(model) -> dict[tuple[int, int], int]:
    """(out, in) -> count of the matmuls of one forward as the fast backend runs them (QKV and gate/up fused)."""
    shapes: dict[tuple[int, int], int] = {}
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        hidden = attn.q_proj.in_features
        for shape in ((attn.q_proj.out_features + 2 * attn.k_proj.out_features, hidden),
                      (attn.o_proj.out_features, attn.o_proj.in_features),
                      (2 * mlp.gate_proj.out_features, hidden), (mlp.down_proj.out_features, mlp.down_proj.in_features)):
            shapes[shape] = shapes.get(shape, 0) + 1
    head = model.get_output_embeddings().weight.shape
    shapes[tuple(head)] = shapes.get(tuple(head), 0) + 1
    return shapes


FORWARD_TIMING_MAX_BYTES = 1 << 30  # per copy; the timing holds one copy per candidate kernel at once


def time_forwards(model, names: list[str], rows=ROWS, context: int = 128, rounds: int = 7) -> dict[str, dict[str, float]]:
    """ms of the fast forward of k new tokens after `context` cached ones with each kernel: the fastest of
    `rounds` rounds, each round timing every kernel and row count in turn, so that drift in the machine's
    speed (shared hosts drift by 1.5x within minutes) hits every kernel alike. The twins live side by side
    for that (one copy of the weights each; FORWARD_TIMING_MAX_BYTES bounds it)."""
    window = getattr(model.config, "max_position_embeddings", None) or context + max(rows)
    context = max(1, min(context, window - max(rows)))
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=generator, device=model.device)
    feeds = {m: torch.randint(0, vocab, (1, m), generator=generator, device=model.device) for m in rows}
    twins = {name: FastTarget(model, name) for name in names}
    caches = {name: twin.new_cache() for name, twin in twins.items()}
    for name, twin in twins.items():
        twin(prompt, caches[name], logits_to_keep=1)
    best = {name: dict.fromkeys(rows, float("inf")) for name in names}
    for _ in range(rounds):
        for name, twin in twins.items():
            for m in rows:
                caches[name].crop(context)
                start = time.perf_counter()
                twin(feeds[m], caches[name], logits_to_keep=m)
                best[name][m] = min(best[name][m], time.perf_counter() - start)
    return {name: {str(m): 1000 * best[name][m] for m in rows} for name in names}


class FastTarget:
    """The target's forward for the decode engine, built once from a loaded HF causal LM."""

    name = "fast"

    def __init__(self, model: torch.nn.Module, kernel: "str | KernelPlan" = "auto"):
        """kernel: `target.kernel` — auto (measured on this machine, decode/linear_kernels.py), a kernel name,
        or a KernelPlan."""
        reason = unsupported_reason(model)
        if reason:
            raise Unsupported(reason)
        self.model, self.config, self.dtype, self.device = model, model.config, model.dtype, model.device
        base = model.model
        head = model.get_output_embeddings()
        shapes = linear_shapes(model)
        # auto on a model of up to 1 GiB of weights: each kernel timed on this very forward (the linears'
        # cost depends on what else streams through the caches), one twin per kernel held at once; on larger
        # ones, or where the twins would not fit beside the model, on stand-in weights.
        size = weight_bytes(shapes, model.dtype)
        twins = size * len(candidates(model.dtype, model.device))
        small = size <= FORWARD_TIMING_MAX_BYTES and twins <= EXTRA_LAYOUTS_MAX_MEMORY * memory_bytes()
        self.plan = plan_for(kernel, shapes, model.dtype, model.device,
                             timer=(lambda names: time_forwards(model, names)) if small else None)
        with torch.no_grad():
            self.layers = [_Layer(layer, self.plan) for layer in base.layers]
            self.head = PackedLinear(head.weight, getattr(head, "bias", None), self.plan)
        self.embed = model.get_input_embeddings()
        self.norm = (base.norm.weight.detach(), norm_eps(base.norm))
        self.rotary = base.rotary_emb
        # The model's own RoPE application (same function in every supported modeling file).
        self.apply_rotary = sys.modules[type(base.layers[0].self_attn).__module__].apply_rotary_pos_emb
        attn = base.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = self.layers[0].q_size // self.head_dim
        self.num_kv_heads = self.layers[0].kv_size // self.head_dim

    def describe(self) -> dict:
        """What results.json records of the backend."""
        return {"name": self.name, "kernel": self.plan.label, "kernels": self.plan.describe()}

    def packed_bytes(self) -> int:
        """Memory the linear layers hold beside the HF model's own weights (which the HF reference path, HF
        baselines and training keep): each kernel's layout, and the fused QKV and gate/up weights that the
        `torch` and packed-MKL kernels compute on or fall back to."""
        own = {p.data_ptr() for p in self.model.parameters()}
        held = {id(t): t for linear in self._linears() for t in linear.held()}.values()
        return sum(t.numel() * t.element_size() for t in held
                   if t.layout != torch.strided or t.data_ptr() not in own)

    def _linears(self) -> list[PackedLinear]:
        return [self.head, *(linear for layer in self.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down))]

    def new_cache(self) -> FastCache:
        return FastCache(len(self.layers))

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, cache: FastCache, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, logits_to_keep: int = 0,
                 feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append input_ids (B, T) to the cache; float32 logits of the last `logits_to_keep` positions (all
        when 0) (B, T', V) and the concatenated hidden states of `feature_layers` (B, T, n*H), HF's indexing:
        0 = embeddings, i = output of decoder layer i-1, num_layers = after the final norm.

        attention_mask: None (causal over the whole cache) or an additive (B, 1, T, S+T) mask."""
        batch, width = input_ids.shape
        past = cache.get_seq_length()
        if position_ids is None:
            position_ids = torch.arange(past, past + width, device=input_ids.device)[None].expand(batch, -1)
        hidden = self.embed(input_ids)  # (B, T, H)
        cos, sin = self.rotary(hidden, position_ids)  # (B, T, D) each
        mask = attention_mask
        if mask is None and width > 1:
            # Query i sees every cached slot and the new slots up to itself: additive (0 or -inf), the form SDPA
            # would convert a boolean mask to in each of the layers (about 10 µs a layer at 4-8 queries here).
            mask = torch.full((width, past + width), float("-inf"), dtype=self.dtype, device=input_ids.device)
            mask = mask.triu(past + 1)  # -inf strictly above diagonal `past`, 0 elsewhere
        wanted = set(feature_layers)
        saved = {0: hidden} if 0 in wanted else {}
        flat = hidden.reshape(batch * width, -1)  # (N, H), N = B*T
        for index, (layer, kv) in enumerate(zip(self.layers, cache.layers)):
            flat = flat + self._attention(layer, kv, rms_norm(flat, *layer.input_norm),
                                          batch, width, cos, sin, mask)
            flat = flat + self._mlp(layer, rms_norm(flat, *layer.post_norm))
            if index + 1 in wanted and index + 1 < len(self.layers):
                saved[index + 1] = flat.view(batch, width, -1)
        final = rms_norm(flat, *self.norm)  # (N, H)
        if len(self.layers) in wanted:
            saved[len(self.layers)] = final.view(batch, width, -1)
        keep = width if logits_to_keep in (0, None) else min(logits_to_keep, width)
        last = final.view(batch, width, -1)[:, width - keep :].reshape(batch * keep, -1)
        logits = self.head(last).view(batch, keep, -1).float()  # (B, T', V)
        features = torch.cat([saved[i] for i in feature_layers], dim=-1) if feature_layers else None
        return logits, features

    def _attention(self, layer: _Layer, kv: KVLayer, x: torch.Tensor, batch: int, width: int, cos, sin, mask):
        # x (N, H) -> qkv (N, q + 2kv) -> q (B, h, T, D), k/v (B, kvh, T, D)
        qkv = layer.qkv(x)
        q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        q = q.view(batch, width, -1, self.head_dim)
        k = k.view(batch, width, -1, self.head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, *layer.q_norm)
            k = rms_norm(k, *layer.k_norm)
        q, k = self.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        v = v.view(batch, width, -1, self.head_dim).transpose(1, 2)
        keys, values = kv.append(k, v)  # (B, kvh, S+T, D)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=layer.scaling,
                                             enable_gqa=self.num_heads != self.num_kv_heads)  # (B, h, T, D)
        return layer.o(out.transpose(1, 2).reshape(batch * width, -1))  # (N, H)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        # x (N, H) -> (N, 2I) -> (N, I) -> (N, H)
        gate, up = layer.gate_up(x).split(layer.intermediate, dim=-1)
        return layer.down(F.silu(gate) * up)
