"""Linear-layer kernels for the fast twins (decode/fast_target.py, decode/fast_drafter.py), and the measurement
that picks them on this machine.

Why a choice at all: which kernel reads a layer's weights fastest at 1-16 rows depends on the CPU and the
library build, and the difference is most of a decode step. Measured on the embedded target, fp32, 2 threads
(docs/results/2026-12-02-kernels.md, 2026-12-03-row-kernels.md):
- 2-core AMD EPYC (Zen5-class): oneDNN with weights reordered once ran every row count from 1 to 16 near
  the time it takes to read them; MKL's sgemm through `F.linear` ran 2-3x slower at 2-16 rows.
- 2-core AMD EPYC (Zen 4): oneDNN again at every width (its one-row LM head streams at about half the
  bandwidth a sum reads); every MKL variant 1.2-2.5x slower at every row count (2026-12-03-zen4.md).
- 2-core Intel Xeon (AVX512-BF16, no AMX): MKL's sgemm over a pre-transposed (in, out) weight read the
  weights for one row near the bandwidth limit, where oneDNN's reordered weights took up to 1.5x longer;
  from 4 rows oneDNN was faster again.
- 2-core Intel Xeon with AMX: MKL's sgemm over weights packed for exactly the row count (`sgemm_pack`,
  through torch's `_mkl_linear`) beat oneDNN by 10-15% at 4 and 8 rows; at 2 rows `F.linear` itself won.
- 2-core Intel Xeon with AMX (model 167): every library kernel read the weights 1.5-2x slower at 4-8 rows than at
  one; the native kernel (decode/smallm_linear.c, built on first use where the CPU has AVX-512 or AVX2) reads them once
  in their own layout at any width up to 16 and kept the whole forward within 1.1x of a one-row step at 4 rows
  (docs/results/2026-12-07-native-kernel.md).
- 2-core AMD EPYC (Zen 4): the native kernel over a copy of the weights packed into one sequential stream per
  thread (`nativepack`) read them 1.2-1.6x faster at 1-4 rows than in their own layout, whose 4 interleaved row
  streams the hardware prefetcher follows less well (docs/results/2026-12-08-packed-kernel.md).
So the twin times each candidate on the model's own shapes once per machine (seconds; the decision is cached
under the specdraft cache, so later runs are deterministic and start at once) and keeps, for each verify
width it measures (ROWS), the kernel that was fastest there, as long as the layouts of the weights
it then holds fit in a quarter of the machine's memory and each extra layout saves at least 5% where it is
used. A width between two measured ones takes the kernel of the next wider one (a kernel packed for 4 rows
computes 3 by padding a row of zeros); wider than the widest, the best kernel that runs any width.

Rows are padded too where that is faster: oneDNN on the Zen 4 EPYC computed every linear layer of the target over
2 rows about 15% slower than over 3 or 4 (2026-12-03-zen4.md), and a step is bandwidth-bound, so rows of zeros
cost nothing but their share of the arithmetic. A measured width whose forward took at least 5% longer than a
wider measured one's runs padded to that width (`row_padding`), the extra rows' outputs dropped.

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

from specdraft.decode import native_linear
from specdraft.io.files import write_text_atomically

ROWS = (1, 2, 3, 4, 6, 8)  # a plain step, and the verify widths the schedulers use most (5 runs as 6, 7 as 8)
COLD_BYTES = 96 << 20  # weights materialized per candidate for the measurement: past the last-level cache
EXTRA_LAYOUT_MIN_GAIN = 0.05  # another layout of the weights must save at least 5% where it is used
EXTRA_LAYOUTS_MAX_MEMORY = 0.25  # ... and the extra layouts together fit in this share of the machine's memory


@dataclass(frozen=True)
class Kernel:
    """One way to compute x @ W.T + b: `pack` turns the (out, in) weight into the kernel's layout once,
    `run(x (N, in), packed, bias) -> (N, out)` computes it."""

    name: str
    pack: Callable[[torch.Tensor], torch.Tensor]
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    available: Callable[[torch.dtype, torch.device], str | None]  # why not here, or None
    rows: int | None = None  # built for up to this many rows (mklpack: packed for it, fewer padded, more F.linear)
    source: Path | None = None  # the project's own code it runs: a change to it times the kernel again


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


def _mkl_packed_available(dtype, device):
    reason = _mkl_available(dtype, device)
    if reason is None and not hasattr(torch.ops.mkl, "_mkl_linear"):
        return "this torch build has no MKL packed-sgemm linear (torch.ops.mkl._mkl_linear)"
    return reason


def _mkl_packed(rows: int) -> Kernel:
    """MKL's sgemm over the weight packed for exactly `rows` rows (sgemm_pack). torch's `_mkl_linear` runs the
    packed weight only for that many rows and F.linear on the plain weight for any other count, so fewer rows
    are padded with zeros up to `rows` (the padding costs no weight reads: the step is bandwidth-bound)."""

    def pack(weight: torch.Tensor):
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, rows), weight

    def run(x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
        # x (N, in) -> (N, out); N < rows: padded to (rows, in), the padding's outputs dropped
        weights, weight = packed
        n = x.shape[0]
        if n > rows:
            return F.linear(x, weight, bias)
        if n < rows:
            x = torch.cat([x, x.new_zeros(rows - n, x.shape[1])])
        out = torch.ops.mkl._mkl_linear(x, weights, weight, bias, rows)
        return out if n == rows else out[:n]

    return Kernel(f"mklpack{rows}", pack, run, _mkl_packed_available, rows)


KERNELS: dict[str, Kernel] = {k.name: k for k in (
    _onednn(4),
    _onednn(16),
    Kernel("mkl", lambda w: w.t().contiguous(), _mkl_run, _mkl_available),
    # F.linear on the weight as it is: what the HF model runs; the kernel where no other one does.
    Kernel("torch", lambda w: w, lambda x, w, b: F.linear(x, w, b), lambda dtype, device: None),
    *(_mkl_packed(rows) for rows in (2, 4, 8)),  # one row: `mkl` (measured as fast as one packed for it)
    # decode/smallm_linear.c: reads the weight once in its own layout at 1-16 rows (F.linear beyond), with a
    # software prefetch 1 KiB ahead (`native`) or leaving the streaming to the hardware prefetcher (`nativehw`):
    # which is faster differs between CPUs and row counts. Both run on the weight as it is (the plan's layout
    # budget counts each kernel as a layout: conservative).
    Kernel("native", lambda w: w.contiguous(), native_linear.linear, native_linear.unavailable_reason,
           source=native_linear.SOURCE),
    Kernel("nativehw", lambda w: w.contiguous(), lambda x, w, b: native_linear.linear(x, w, b, ahead=0),
           native_linear.unavailable_reason, source=native_linear.SOURCE),
    # The same kernel over a copy of the weight packed into one sequential stream per thread; a verify-width
    # kernel (rows=16): it computes any width, but the prefill and wide batches go to a library kernel.
    Kernel("nativepack", native_linear.pack, native_linear.linear_packed, native_linear.unavailable_reason,
           rows=native_linear.MAX_ROWS, source=native_linear.SOURCE),
)}
KERNEL_CHOICES = ("auto", *KERNELS)


def weight_bytes(shapes: dict[tuple[int, int], int], dtype: torch.dtype) -> int:
    """Bytes of the weights of linear layers with these (out, in) -> count shapes."""
    return sum(out * inp * count for (out, inp), count in shapes.items()) * dtype.itemsize


def candidates(dtype: torch.dtype, device: torch.device) -> list[str]:
    """The kernels that run here for `dtype`, in the order ties are broken (oneDNN first: it was measured
    best across row counts on the machines before this choice existed; kernels packed for one row count
    last, so a kernel that runs every width wins a tie). `torch` (F.linear) is among them where another
    one runs, and the only one where none does."""
    names = [name for name, kernel in KERNELS.items() if name != "torch" and kernel.available(dtype, device) is None]
    if not names:
        return ["torch"]
    general = [name for name in names if KERNELS[name].rows is None]
    return [*general, "torch", *(name for name in names if KERNELS[name].rows is not None)]


@dataclass
class KernelPlan:
    """Which kernel computes a linear layer at each number of rows, and where that came from.

    one_row: a plain step; by_rows: measured verify width (str, JSON's keys) -> kernel, a width between two
    of them taking the next wider one's; multi_row: wider than every entry of by_rows (the batched engine,
    the prefill), or every width above one where by_rows is empty."""

    one_row: str
    multi_row: str
    source: str  # "config" (target.kernel), "measured" (just now) or "cached" (an earlier measurement here)
    measured_ms: dict = field(default_factory=dict)  # kernel -> rows -> ms for all the model's linears
    cache_file: str | None = None
    by_rows: dict = field(default_factory=dict)
    pad_rows: dict = field(default_factory=dict)  # rows (str) -> the wider row count they run padded to

    def kernel_for(self, rows: int) -> str:
        if rows == 1:
            return self.one_row
        wider = [int(r) for r in self.by_rows if int(r) >= rows]
        return self.by_rows[str(min(wider))] if wider else self.multi_row

    @property
    def kernels(self) -> list[str]:
        """The distinct kernels (one layout of the weights each) the plan runs."""
        return list(dict.fromkeys([self.one_row, *self.by_rows.values(), self.multi_row]))

    @property
    def label(self) -> str:
        padding = "".join(f"; {rows} row{'s' * (int(rows) > 1)} padded to {wider}" for rows, wider in
                          sorted(self.pad_rows.items(), key=lambda item: int(item[0])))
        return self._kernels_label() + padding

    def _kernels_label(self) -> str:
        if len(self.kernels) == 1:
            return self.one_row
        if not self.by_rows:
            return f"{self.one_row} (1 row) + {self.multi_row} (2+ rows)"
        spans = [[self.one_row, 1, 1]]  # [kernel, from rows, to rows], neighbours of one kernel merged
        for rows in sorted(map(int, self.by_rows)):
            kernel = self.by_rows[str(rows)]
            if spans[-1][0] == kernel and spans[-1][1] > 1:
                spans[-1][2] = rows
            else:
                spans.append([kernel, spans[-1][2] + 1, rows])
        cells = [f"{kernel} ({low} row{'s' * (high > 1)})" if low == high else f"{kernel} ({low}-{high} rows)"
                 for kernel, low, high in spans]
        if spans[-1][0] == self.multi_row and spans[-1][1] > 1:
            cells[-1] = f"{self.multi_row} ({spans[-1][1]}+ rows)"
        else:
            cells.append(f"{self.multi_row} ({spans[-1][2] + 1}+ rows)")
        return " + ".join(cells)

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


def choose(measured: dict[str, dict[str, float]], weight_bytes: int,
           memory_bytes: int) -> tuple[str, str, dict[str, str]]:
    """(one-row kernel, kernel past the measured widths, {width: kernel}) from `measured` (kernel -> rows ->
    ms). It starts from the kernel that is best over one row and the verify widths together (one layout) and
    gives a width its own fastest kernel where that saves EXTRA_LAYOUT_MIN_GAIN there, the largest savings
    first, while the layouts beyond the first fit EXTRA_LAYOUTS_MAX_MEMORY of the memory. Past the measured
    widths it takes a kernel that runs any width (one packed for a row count falls back to F.linear there),
    the fastest at the widest measured width, on the same terms."""
    names = list(measured)
    widths = list(next(iter(measured.values())))
    multi_rows = [r for r in widths if r != "1"]
    general = [n for n in names if n not in KERNELS or KERNELS[n].rows is None] or names

    def multi(name):  # mean over the verify widths
        return sum(measured[name][r] for r in multi_rows) / max(len(multi_rows), 1)

    def overall(name):  # a step of one row and a verify step weigh alike
        return measured[name]["1"] + (multi(name) if multi_rows else 0.0)

    single = min(general, key=overall)  # min keeps the first of equals: the registry's order breaks ties
    layouts = 1 + int(EXTRA_LAYOUTS_MAX_MEMORY * memory_bytes // max(weight_bytes, 1))
    def fits(name, rows):  # a kernel packed for fewer rows only runs F.linear there: the `torch` entry's kernel
        return name not in KERNELS or KERNELS[name].rows is None or KERNELS[name].rows >= int(rows)

    # (slot, rows timed, kernels)
    slots = [(rows, rows, [n for n in names if fits(n, rows)]) for rows in widths] + [("wide", widths[-1], general)]
    picks = {slot: single for slot, _, _ in slots}
    savings = []
    for slot, rows, allowed in slots:
        best = min(allowed, key=lambda n: measured[n][rows])
        if measured[best][rows] < (1 - EXTRA_LAYOUT_MIN_GAIN) * measured[single][rows]:
            savings.append((measured[single][rows] - measured[best][rows], slot, best))
    for _, slot, best in sorted(savings, key=lambda saving: -saving[0]):
        if len(set(picks.values()) | {best}) <= layouts:
            picks[slot] = best
    wide = picks["wide"]
    by_rows = {rows: picks[rows] for rows in multi_rows}
    if all(kernel == wide for kernel in by_rows.values()):
        by_rows = {}  # one kernel above one row: the two-kernel plan of before
    return picks["1"], wide, by_rows


def row_padding(plan: KernelPlan, measured: dict[str, dict[str, float]] | None = None,
                min_gain: float = EXTRA_LAYOUT_MIN_GAIN) -> dict[str, int]:
    """{rows: wider rows} for each measured width that a wider measured width computes at least `min_gain`
    faster, each with the kernel the plan names there (the fastest such width); from `measured` (kernel ->
    rows -> ms, the plan's own measurement by default)."""
    measured = plan.measured_ms if measured is None else measured
    cost = {}
    for rows in sorted({int(r) for table in measured.values() for r in table}):
        kernel = plan.kernel_for(rows)
        if str(rows) in measured.get(kernel, {}):
            cost[rows] = measured[kernel][str(rows)]
    padding = {}
    for rows, own in cost.items():
        wider = [r for r in cost if r > rows]
        if wider:
            best = min(wider, key=lambda r: (cost[r], r))
            if cost[best] < (1 - min_gain) * own:
                padding[str(rows)] = best
    return padding


def memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0  # unknown: never hold two layouts


def _cache_file(shapes: dict[tuple[int, int], int], dtype: torch.dtype, names: list[str], method: str) -> Path:
    from specdraft.io.hardware import cpu_model
    from specdraft.io.target import cache_root

    # A change to a candidate's own source times it again (its speed is what the decision is about).
    sources = sorted({KERNELS[name].source for name in names if KERNELS[name].source is not None})
    code = {path.name: hashlib.sha256(path.read_bytes()).hexdigest()[:16] for path in sources if path.is_file()}
    key = json.dumps({"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "dtype": str(dtype), "shapes": sorted([list(s) + [c] for s, c in shapes.items()]),
                      "candidates": names, "rows": list(ROWS), "method": method, "code": code}, sort_keys=True)
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
            by_rows = saved.get("by_rows", {})
            if {saved["one_row"], saved["multi_row"], *by_rows.values()} <= set(names):
                plan = KernelPlan(saved["one_row"], saved["multi_row"], "cached", saved["measured_ms"], str(path), by_rows)
                plan.pad_rows = row_padding(plan)  # derived from the stored times: entries from before it apply
                return plan
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache entry: measure again and overwrite it
    measured = measure(shapes, dtype, names) if timer is None else timer(names)
    one, wide, by_rows = choose(measured, weight_bytes(shapes, dtype), memory_bytes())
    plan = KernelPlan(one, wide, "measured", measured, str(path), by_rows)
    plan.pad_rows = row_padding(plan)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(path, json.dumps({"one_row": one, "multi_row": wide, "by_rows": by_rows,
                                                    "measured_ms": measured}, indent=1))
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
    """y = x @ W.T + b through the plan's kernels: the one it names for the number of rows of x."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: KernelPlan):
        self.out_features = weight.shape[0]
        self.bias = None if bias is None else bias.detach().contiguous()
        weight = weight.detach().contiguous()
        packs = {name: (KERNELS[name].run, KERNELS[name].pack(weight)) for name in plan.kernels}
        self.one = packs[plan.one_row]
        self.multi = packs[plan.multi_row]
        widest = max([*map(int, plan.by_rows), *plan.pad_rows.values()], default=1)
        self.by_rows = {rows: packs[plan.kernel_for(rows)] for rows in range(2, widest + 1)}
        self.pad = {int(rows): int(wider) for rows, wider in plan.pad_rows.items()}

    def held(self) -> list[torch.Tensor]:
        """Every tensor the kernels' layouts hold (the contiguous weight some keep beside a packing included)."""
        tensors = {}
        for _, packed in [self.one, self.multi, *self.by_rows.values()]:
            for tensor in packed if isinstance(packed, tuple) else (packed,):
                if isinstance(tensor, torch.Tensor):  # nativepack's layout carries its row count beside it
                    tensors[id(tensor)] = tensor
        return list(tensors.values())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x (N, K) -> (N, out)
        rows = x.shape[0]
        wider = self.pad.get(rows)
        if wider is not None:  # computed over `wider` rows, the padding's outputs dropped (a view of the first rows)
            run, packed = self.by_rows.get(wider, self.multi)
            return run(torch.cat([x, x.new_zeros(wider - rows, x.shape[1])]), packed, self.bias)[:rows]
        run, packed = self.one if rows == 1 else self.by_rows.get(rows, self.multi)
        return run(x, packed, self.bias)
