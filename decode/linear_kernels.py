"""Linear-layer kernels for the fast twins (decode/fast_target.py, decode/fast_drafter.py), and the measurement
that picks them on this machine.

Why a choice at all: which kernel reads a layer's weights fastest at 1-16 rows depends on the CPU and the
library build, and the difference is most of a decode step. Measured on the embedded target, fp32, 2 threads
(docs/results/2026-12-02-kernels.md):
- 2-core AMD EPYC (Zen5-class): oneDNN with weights reordered once ran every row count from 1 to 16 near
  the time it takes to read them; MKL's sgemm through `F.linear` ran 2-3x slower at 2-16 rows.
- 2-core Intel Xeon (AVX512-BF16, no AMX): MKL's sgemm over a pre-transposed (in, out) weight read the
  weights for one row near the bandwidth limit, where oneDNN's reordered weights took up to 1.5x longer;
  from 4 rows oneDNN was faster again.
So the twin times each candidate on the model's own shapes once per machine (a second or two; the decision
is cached under the specdraft cache, so later runs are deterministic and start at once) and keeps the best
kernel for one row (a plain step) and the best for several (a verify step). It holds two layouts of the
weights only when the two differ and the extra copy fits in a quarter of the machine's memory.

Every kernel computes y = x @ W.T + b; they differ only in summation order (tests/test_fast_target.py holds
each to the HF model).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from specdraft.io.files import write_text_atomically

ROWS = (1, 2, 4, 8)  # a plain step, and the verify widths the schedulers use most
COLD_BYTES = 96 << 20  # weights materialized per candidate for the measurement: past the last-level cache
TWO_LAYOUTS_MIN_GAIN = 0.05  # a second layout of the weights must save at least 5% where it is used
TWO_LAYOUTS_MAX_MEMORY = 0.25  # ... and fit in this share of the machine's memory


@dataclass(frozen=True)
class Kernel:
    """One way to compute x @ W.T + b: `pack` turns the (out, in) weight into the kernel's layout once,
    `run(x (N, in), packed, bias) -> (N, out)` computes it."""

    name: str
    pack: Callable[[torch.Tensor], torch.Tensor]
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    available: Callable[[torch.dtype, torch.device], str | None]  # why not here, or None


def onednn_ok(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN's reordered-weight linear runs here for `dtype` (CPU; bf16 only where it is native)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False
    return False


def _onednn(rows: int) -> Kernel:
    # oneDNN packs the weight for a row count; every row count runs on any packing, at a speed that varies.
    def available(dtype, device):
        return None if onednn_ok(dtype, device) else f"no oneDNN kernel for {dtype} on {device.type} here"

    return Kernel(f"onednn{rows}", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, rows),
                  lambda x, p, b: torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], ""), available)


def _mkl_available(dtype, device):
    if device.type != "cpu" or not torch.backends.mkl.is_available():
        return "MKL's sgemm is a CPU kernel of torch builds with MKL"
    return None if dtype == torch.float32 else "MKL's sgemm layout is float32 only"


def _mkl_run(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # x (N, in) @ W.T stored contiguous as (in, out): MKL's non-transposed sgemm
    return x @ weight_t if bias is None else torch.addmm(bias, x, weight_t)


KERNELS: dict[str, Kernel] = {k.name: k for k in (
    _onednn(4),
    _onednn(16),
    Kernel("mkl", lambda w: w.t().contiguous(), _mkl_run, _mkl_available),
    # F.linear on the weight as it is: what the HF model runs; the kernel where no other one does.
    Kernel("torch", lambda w: w, lambda x, w, b: F.linear(x, w, b), lambda dtype, device: None),
)}
KERNEL_CHOICES = ("auto", *KERNELS)


def weight_bytes(shapes: dict[tuple[int, int], int], dtype: torch.dtype) -> int:
    """Bytes of the weights of linear layers with these (out, in) -> count shapes."""
    return sum(out * inp * count for (out, inp), count in shapes.items()) * dtype.itemsize


def candidates(dtype: torch.dtype, device: torch.device) -> list[str]:
    """The kernels that run here for `dtype`, in the order ties are broken (oneDNN first: it was measured
    best across row counts on the machines before this choice existed)."""
    names = [name for name, kernel in KERNELS.items() if name != "torch" and kernel.available(dtype, device) is None]
    return names or ["torch"]


@dataclass
class KernelPlan:
    """Which kernel computes a linear layer for one row and which for several, and where that came from."""

    one_row: str
    multi_row: str
    source: str  # "config" (target.kernel), "measured" (just now) or "cached" (an earlier measurement here)
    measured_ms: dict = field(default_factory=dict)  # kernel -> rows -> ms for all the model's linears
    cache_file: str | None = None

    @property
    def label(self) -> str:
        return self.one_row if self.one_row == self.multi_row else f"{self.one_row} (1 row) + {self.multi_row} (2+ rows)"

    def describe(self) -> dict:
        return asdict(self)


def fixed_plan(name: str, dtype: torch.dtype, device: torch.device) -> KernelPlan:
    """One kernel for every row count, as `target.kernel=NAME` asks; refused with the reason where it cannot run."""
    if name not in KERNELS:
        raise ValueError(f"target.kernel={name!r}; choose one of {list(KERNEL_CHOICES)}")
    reason = KERNELS[name].available(dtype, device)
    if reason:
        raise ValueError(f"target.kernel={name} cannot run here: {reason}. Use target.kernel=auto "
                         f"(it measures {candidates(dtype, device)} and keeps the fastest).")
    return KernelPlan(name, name, "config")


def measure(shapes: dict[tuple[int, int], int], dtype: torch.dtype, names: list[str], rows=ROWS,
            repeats: int = 5, cold_bytes: int = COLD_BYTES) -> dict[str, dict[str, float]]:
    """ms that all the linear layers of one forward take per kernel and row count.

    shapes: (out, in) -> how many layers of that shape the model has. Random weights stand in for the
    model's: up to `cold_bytes` of each kernel's layout (fewer layers than the model has, or a slice of a
    matrix larger than that), so they stream from memory as a forward's do, and times scale back up to
    the model's counts. Rounds interleave kernels and row counts, so drift in the machine's speed hits each
    alike."""
    size = dtype.itemsize
    share = min(1.0, cold_bytes / max(weight_bytes(shapes, dtype), 1))
    plan = []  # (rows of the matrix materialized, in, copies, factor back to the model's count and rows)
    for (out, inp), count in shapes.items():
        copies = max(1, round(count * share))
        kept = min(out, max(1, cold_bytes // (inp * size)))  # a matrix larger than cold_bytes: a slice of its rows
        plan.append((kept, inp, copies, count / copies * out / kept))
    generator = torch.Generator().manual_seed(0)
    weights = [[(torch.rand(o, i, generator=generator) - 0.5).to(dtype) for _ in range(c)] for o, i, c, _ in plan]
    packed = {name: [[KERNELS[name].pack(w) for w in group] for group in weights] for name in names}
    inputs = {m: [torch.rand(m, i, generator=generator).to(dtype) for _, i, _, _ in plan] for m in rows}
    best = {name: {m: [math.inf] * len(plan) for m in rows} for name in names}
    with torch.inference_mode():
        for _ in range(repeats):
            for name in names:
                run = KERNELS[name].run
                for m in rows:
                    for index, (group, x) in enumerate(zip(packed[name], inputs[m])):
                        def one_pass(group=group, x=x):
                            for p in group:
                                run(x, p, None)
                        best[name][m][index] = min(best[name][m][index], _time(one_pass))
    return {name: {str(m): 1000 * sum(t * scale for t, (_, _, _, scale) in zip(best[name][m], plan)) for m in rows}
            for name in names}


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def choose(measured: dict[str, dict[str, float]], weight_bytes: int, memory_bytes: int) -> tuple[str, str]:
    """(one-row kernel, multi-row kernel) from `measured` (kernel -> rows -> ms); one kernel for both unless
    a second layout saves TWO_LAYOUTS_MIN_GAIN where it is used and fits TWO_LAYOUTS_MAX_MEMORY."""
    names = list(measured)
    multi_rows = [r for r in next(iter(measured.values())) if r != "1"]

    def multi(name):  # mean over the verify widths
        return sum(measured[name][r] for r in multi_rows) / max(len(multi_rows), 1)

    def overall(name):  # a step of one row and a verify step weigh alike
        return measured[name]["1"] + (multi(name) if multi_rows else 0.0)

    single = min(names, key=overall)  # min keeps the first of equals: the registry's order breaks ties
    one, wide = min(names, key=lambda n: measured[n]["1"]), min(names, key=multi) if multi_rows else single
    if one == wide or weight_bytes > TWO_LAYOUTS_MAX_MEMORY * memory_bytes:
        return single, single
    saves_one = measured[one]["1"] < (1 - TWO_LAYOUTS_MIN_GAIN) * measured[single]["1"]
    saves_wide = multi(wide) < (1 - TWO_LAYOUTS_MIN_GAIN) * multi(single)
    if not (saves_one or saves_wide):
        return single, single
    return (one if saves_one else single), (wide if saves_wide else single)


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0  # unknown: never hold two layouts


def _cache_file(shapes: dict[tuple[int, int], int], dtype: torch.dtype, names: list[str], method: str) -> Path:
    from specdraft.io.hardware import cpu_model
    from specdraft.io.target import cache_root

    key = json.dumps({"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "dtype": str(dtype), "shapes": sorted([list(s) + [c] for s, c in shapes.items()]),
                      "candidates": names, "rows": list(ROWS), "method": method}, sort_keys=True)
    folder = Path(os.environ.get("SPECDRAFT_KERNEL_DIR") or cache_root() / "kernels")  # tests point it elsewhere
    return folder / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


Timer = Callable[[list[str]], dict[str, dict[str, float]]]  # kernels -> kernel -> rows -> ms


def auto_plan(shapes: dict[tuple[int, int], int], dtype: torch.dtype, device: torch.device,
              use_cache: bool = True, timer: Timer | None = None) -> KernelPlan:
    """The kernels this machine runs fastest for a model with these linear shapes: measured once, then
    read from the cache (keyed by CPU, torch, threads, dtype, shapes and how it was measured).

    timer: how to measure (the fast target times its whole forward with each kernel); None: `measure`,
    the model's linear layers on stand-in weights."""
    names = candidates(dtype, device)
    if len(names) == 1:
        return KernelPlan(names[0], names[0], "only candidate")
    path = _cache_file(shapes, dtype, names, "linears" if timer is None else "forward")
    if use_cache and path.is_file():
        try:
            saved = json.loads(path.read_text())
            if saved["one_row"] in names and saved["multi_row"] in names:
                return KernelPlan(saved["one_row"], saved["multi_row"], "cached", saved["measured_ms"], str(path))
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache entry: measure again and overwrite it
    measured = measure(shapes, dtype, names) if timer is None else timer(names)
    one, wide = choose(measured, weight_bytes(shapes, dtype), _memory_bytes())
    plan = KernelPlan(one, wide, "measured", measured, str(path))
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(path, json.dumps({"one_row": one, "multi_row": wide, "measured_ms": measured}, indent=1))
        except OSError:
            plan.cache_file = None  # a read-only cache: the decision still holds for this run
    return plan


def plan_for(kernel: "str | KernelPlan", shapes: dict[tuple[int, int], int], dtype: torch.dtype,
             device: torch.device, timer: Timer | None = None) -> KernelPlan:
    """`target.kernel`: auto measures (or reads the cached measurement); a kernel name fixes it; a plan is
    taken as it is (tests build mixed ones)."""
    if isinstance(kernel, KernelPlan):
        return kernel
    if kernel == "auto":
        return auto_plan(shapes, dtype, device, timer=timer)
    return fixed_plan(kernel, dtype, device)


class PackedLinear:
    """y = x @ W.T + b through the plan's kernels: its one-row kernel for a single row, the other for more."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: KernelPlan):
        self.out_features = weight.shape[0]
        self.bias = None if bias is None else bias.detach().contiguous()
        weight = weight.detach().contiguous()
        packs = {name: KERNELS[name].pack(weight) for name in dict.fromkeys((plan.one_row, plan.multi_row))}
        self.one = (KERNELS[plan.one_row].run, packs[plan.one_row])
        self.multi = (KERNELS[plan.multi_row].run, packs[plan.multi_row])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x (N, K) -> (N, out)
        run, packed = self.one if x.shape[0] == 1 else self.multi
        return run(x, packed, self.bias)
