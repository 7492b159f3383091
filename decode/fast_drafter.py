"""The drafter's fast twin: the same module with every Linear layer run on the kernel this machine computes
fastest (decode/linear_kernels.py: oneDNN with reordered weights or MKL over a pre-transposed weight).

A drafter's step is a handful of small matmuls (its fusion projection, one or two layers over a 7-slot
block, then per drafted position the LM head over the draft vocabulary and the Markov projection). MKL's
GEMV streams those weights at a third of the memory bandwidth here: measured on the embedded target's
one-layer DSpark export, fp32, 2 threads, drafting 4 positions took 10.8 ms against a 22 ms verify step.
The twin shares every parameter and buffer of the drafter (embeddings, heads, norms) and adds packed
copies of the Linear weights only; a draft layer's q/k/v (and the context's k/v) and its MLP's gate/up
run as one matmul each, as the fast target's do; its RMSNorms run as one fused call and its rotary embedding reads a
table of positions (the eager module's five or six small ops each were about half a step's time once the
matmuls were packed). decode/proposer.py runs the same code over either module, so the twin differs from
the reference only in summation order (tests/test_fast_drafter.py holds the parity).
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn

from specdraft.decode.fast_target import fused_linear, norm_eps, rms_norm
from specdraft.decode.linear_kernels import KernelPlan, PackedLinear, candidates, plan_for
from specdraft.models.drafter import ContextAttention


# A layer of a few outputs (the confidence head's one) stays on F.linear: its weights are a few KB, and a oneDNN
# call's own cost is more than F.linear's whole.
MIN_PACKED_OUTPUTS = 16


def _packs(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.out_features >= MIN_PACKED_OUTPUTS


class PackedLinearModule(nn.Module):
    """An nn.Linear's function on (..., in) inputs through the plan's kernels, its weight packed once."""

    def __init__(self, linear: nn.Linear, plan: KernelPlan):
        super().__init__()
        weight = linear.weight
        if hasattr(linear, "folded_weight"):  # ScaledLinear: the input scale folded in (same function)
            weight = linear.folded_weight()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # shared: code that reads .weight (shapes, dtype) still finds it
        self.packed = PackedLinear(weight, linear.bias, plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (..., in) -> (..., out)
        return self.packed(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)


class FusedRMSNorm(nn.Module):
    """An RMSNorm module's function as one call (fast_target.rms_norm: the fused kernel in float32, HF's
    order of roundings elsewhere), its weight shared. A drafter step runs seven norms, and HF's module costs
    five tensor ops each: dispatch, not arithmetic, on a 7-slot block."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.eps = norm.weight, norm_eps(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class CachedRotary(nn.Module):
    """A rotary embedding module's (cos, sin) read from a table of every position so far, computed by the
    module itself over 0..N-1 and doubled when a position passes it. The module computes each position on
    its own (position x inverse frequency, elementwise), so the table's rows are its outputs bit for bit;
    a step then indexes two rows instead of running the module's six ops."""

    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.rotary, self.tables = rotary, {}

    def _table(self, like: torch.Tensor, needed: int):
        key = (like.dtype, like.device)
        table = self.tables.get(key)
        if table is None or table[0].shape[0] < needed:
            size = max(needed, 2 * (table[0].shape[0] if table is not None else 512))
            cos, sin = self.rotary(like, torch.arange(size, device=like.device)[None])  # (1, N, D) each
            table = self.tables[key] = (cos[0], sin[0])
        return table

    def forward(self, like: torch.Tensor, position_ids: torch.Tensor):
        # position_ids (B, S) -> cos, sin (B, S, D) in like's dtype, as the module returns them
        if position_ids.numel() == 0:
            return self.rotary(like, position_ids)
        cos, sin = self._table(like, int(position_ids.max()) + 1)
        return cos[position_ids], sin[position_ids]


class FusedContextAttention(ContextAttention):
    """A block drafter's attention with its query, key and value projections computed as one matmul, and the
    context features' keys and values as another (the function is the reference's: the same weights, the
    outputs split where they were concatenated). Why: right after a target step every linear call of the
    drafter starts with cold caches (on a 2-core AMX Xeon a 16 x 16 bf16 call took 0.26 ms cold, 0.03 ms
    warm); fused, a draft layer runs 5 calls instead of 8, which saved 0.15 ms of a 4.9 ms drafter step there
    (docs/results/2026-12-06-xeon-amx-export.md)."""

    @classmethod
    def adopt(cls, attn: ContextAttention, plan: KernelPlan) -> "FusedContextAttention":
        """Turn the twin's own copy of a ContextAttention into this class (its tensors stay shared with the
        reference; q/k/v stay as they are for code that reads their weights, and are no longer called)."""
        attn.__class__ = cls
        attn.qkv = fused_linear([attn.q_proj, attn.k_proj, attn.v_proj], plan)
        attn.kv = fused_linear([attn.k_proj, attn.v_proj], plan)
        attn.split = (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features)
        return attn

    def project_kv(self, x: torch.Tensor):
        # x (B, S, H) -> k, v (B, S, kv_heads * D) each
        return self.kv(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1).split(self.split[1:], dim=-1)

    def project_qkv(self, x: torch.Tensor):
        # x (B, S, H) -> q (B, S, heads * D), k, v (B, S, kv_heads * D)
        return self.qkv(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1).split(self.split, dim=-1)


class FusedGatedMLP(nn.Module):
    """A SiLU-gated MLP (transformers' Llama/Qwen MLP: down(act(gate(x)) * up(x))) with gate and up as one
    matmul, for the reason FusedContextAttention gives."""

    def __init__(self, mlp: nn.Module, plan: KernelPlan):
        super().__init__()
        self.gate_up = fused_linear([mlp.gate_proj, mlp.up_proj], plan)
        self.down = PackedLinearModule(mlp.down_proj, plan)
        self.act_fn, self.intermediate = mlp.act_fn, mlp.gate_proj.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (..., H) -> (..., 2 * I) -> (..., H)
        gate, up = self.gate_up(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1).split(self.intermediate, dim=-1)
        return self.down(self.act_fn(gate) * up)


def _is_gated_mlp(module: nn.Module) -> bool:
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return (type(module).__name__.endswith("MLP") and hasattr(module, "act_fn")
            and all(isinstance(part, nn.Linear) for part in parts))


def _is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)


# Rope types whose cos/sin for a position do not depend on the other positions of the call (dynamic NTK and
# longrope rescale by the longest one): only these are read from a table.
STATIC_ROPE_TYPES = ("default", "linear", "llama3")


def _is_rotary(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("RotaryEmbedding")
            and getattr(module, "rope_type", "default") in STATIC_ROPE_TYPES)


def fast_drafter_unavailable(drafter: nn.Module) -> str | None:
    """Why the fast twin would not run for this drafter, or None."""
    parameter = next(drafter.parameters())
    if candidates(parameter.dtype, parameter.device) == ["torch"]:
        return f"no oneDNN or MKL kernels for {str(parameter.dtype).replace('torch.', '')} on {parameter.device.type} here"
    return None


def _linear_shapes(drafter: nn.Module) -> dict[tuple[int, int], int]:
    """(out, in) -> count of the matmuls the twin runs: fused groups as one, layers it leaves alone not at all."""
    shapes: dict[tuple[int, int], int] = {}

    def add(out: int, inp: int) -> None:
        shapes[(out, inp)] = shapes.get((out, inp), 0) + 1

    fused = set()
    for module in drafter.modules():
        if isinstance(module, ContextAttention):
            q, k, v = module.q_proj, module.k_proj, module.v_proj
            add(q.out_features + k.out_features + v.out_features, q.in_features)
            add(k.out_features + v.out_features, k.in_features)
            fused |= {id(q), id(k), id(v)}
        elif _is_gated_mlp(module):  # FusedGatedMLP: gate/up as one matmul, down packed whatever its width
            gate, down = module.gate_proj, module.down_proj
            add(2 * gate.out_features, gate.in_features)
            add(down.out_features, down.in_features)
            fused |= {id(gate), id(module.up_proj), id(down)}
    for module in drafter.modules():
        if _packs(module) and id(module) not in fused:
            add(module.out_features, module.in_features)
    return shapes


@torch.no_grad()
def fast_drafter(drafter: nn.Module, kernel: str = "auto") -> nn.Module:
    """The twin: a copy of the module tree sharing every tensor, with its Linear layers packed for the
    kernels `kernel` names (auto: measured on the drafter's own shapes)."""
    parameter = next(drafter.parameters())
    plan = plan_for(kernel, _linear_shapes(drafter), parameter.dtype, parameter.device)
    shared = {id(tensor): tensor for tensor in itertools.chain(drafter.parameters(), drafter.buffers())}
    twin = copy.deepcopy(drafter, shared)
    twin.kernel_plan = plan
    replaced = set()  # modules swapped out below: their own children are not the twin's any more
    for parent in list(twin.modules()):
        if id(parent) in replaced:
            continue
        if isinstance(parent, ContextAttention):
            FusedContextAttention.adopt(parent, plan)
        fused = ("q_proj", "k_proj", "v_proj") if isinstance(parent, FusedContextAttention) else ()
        for name, child in list(parent.named_children()):
            if name in fused:
                continue  # computed by the fused matmuls; kept as they are (shared with the reference)
            if _is_gated_mlp(child):
                setattr(parent, name, FusedGatedMLP(child, plan))
                replaced.add(id(child))
            elif _packs(child):
                setattr(parent, name, PackedLinearModule(child, plan))
            elif _is_rms_norm(child):
                setattr(parent, name, FusedRMSNorm(child))
            elif _is_rotary(child):
                setattr(parent, name, CachedRotary(child))
    return twin.eval()


def drafter_for_backend(drafter: nn.Module, name: str = "auto", log=print, kernel: str = "auto") -> nn.Module:
    """The drafter as target.backend asks: hf keeps the reference module; auto and fast take the twin where
    oneDNN runs it (auto says why not where it does not; fast, asked explicitly, fails with the reason)."""
    if name == "hf":
        return drafter
    reason = fast_drafter_unavailable(drafter)
    if reason is None:
        return fast_drafter(drafter, kernel)
    if name == "fast":
        raise ValueError(f"target.backend=fast cannot run the drafter's fast twin: {reason}. Use target.backend=hf or auto.")
    log(f"target.backend=auto: the drafter runs its reference modules, because {reason}")
    return drafter
