"""Roofline of the target's verify step on this machine: what the hardware allows, and what each backend does.

    python scripts/roofline.py [--target smollm2-135m-instruct] [--dtypes float32 bfloat16]
                               [--contexts 64 300 1024] [--tokens 1 2 3 4 6 8 12 16] [--out docs/results/roofline]

Measures, with torch's thread setting:
- streaming bandwidth: the fastest of several sums over a 400 MB tensor (a read-only stream, like the weights);
- GEMM throughput at the target's own shapes (fused QKV, o, fused gate/up, down, LM head) for 1-16 rows in each
  dtype, through every linear kernel the fast backend can pick here (decode/linear_kernels.py; `torch` is
  `F.linear`, what the HF model runs), and a peak from a large GEMM;
- each target backend's forward over 1-16 new tokens after a context of 64 / 300 / 1024 tokens: hf, fast (its
  kernels as target.kernel=auto picks them on this machine) and fast with each kernel fixed (fast-NAME), built
  side by side (as many as fit half the memory) and timed in interleaved rounds, so that the host's drift hits
  each backend alike.
The floor of a k-token step is max(bytes / bandwidth, flops / peak): every weight is read once (the LM head
included, the embedding only for k rows) plus the KV cache, and the flops are 2·params·k plus attention's.
Writes OUT/roofline.json and OUT/roofline.png and prints the curves side by side.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specdraft.decode.linear_kernels import KERNELS, candidates, memory_bytes  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def fastest(fn, repeats: int) -> float:
    """Fastest of `repeats` calls after one warm-up, in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bandwidth_gbs(repeats: int = 5) -> float:
    """Read bandwidth (GB/s): a sum over 400 MB, far larger than any cache."""
    data = torch.ones(100_000_000)
    return data.numel() * 4 / fastest(data.sum, repeats) / 1e9


def target_shapes(config) -> dict[str, tuple[int, int]]:
    """(out, in) of each matmul of one decoder layer (fused as the fast backend runs them) and the LM head."""
    hidden, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return {"qkv": ((heads + 2 * kv) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate_up": (2 * config.intermediate_size, hidden), "down": (hidden, config.intermediate_size),
            "lm_head": (config.vocab_size, hidden)}


def gemm_table(shapes: dict, dtype: torch.dtype, rows: list[int], repeats: int) -> dict:
    """GFLOP/s per kernel, shape and row count (weights hot in cache: the compute side of the roofline)."""
    table = {}
    for shape, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features).to(dtype)
        kernels = {}
        for name in (*candidates(dtype, torch.device("cpu")), "torch"):  # torch = F.linear, what HF runs
            kernel = KERNELS[name]
            kernels[name] = lambda x, k=kernel, p=kernel.pack(weight): k.run(x, p, None)
        for kernel, fn in kernels.items():
            for m in rows:
                x = torch.randn(m, in_features).to(dtype)
                try:
                    seconds = fastest(lambda: fn(x), repeats)
                except RuntimeError as err:  # a kernel this build or CPU does not offer for the dtype
                    table.setdefault(kernel, {}).setdefault(shape, {})[str(m)] = f"unavailable: {str(err)[:80]}"
                    continue
                table.setdefault(kernel, {}).setdefault(shape, {})[str(m)] = 2 * m * out_features * in_features / seconds / 1e9
    return table


def peak_gflops(dtype: torch.dtype, repeats: int) -> float:
    """The best of MKL and oneDNN on a large GEMM: the compute roof."""
    a, b = torch.randn(1024, 1536).to(dtype), torch.randn(3072, 1536).to(dtype)
    best = fastest(lambda: F.linear(a, b), repeats)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(b, 1024)
        best = min(best, fastest(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), repeats))
    except RuntimeError:
        pass
    return 2 * 1024 * 1536 * 3072 / best / 1e9


def floor_ms(config, dtype: torch.dtype, context: int, tokens: int, bandwidth: float, peak: float) -> float:
    """max(bytes / bandwidth, flops / peak) of a `tokens`-token step after `context` cached ones."""
    size = torch.finfo(dtype).bits // 8
    shapes = target_shapes(config)
    layer_params = sum(o * i for name, (o, i) in shapes.items() if name != "lm_head")
    head_params = shapes["lm_head"][0] * shapes["lm_head"][1]
    layers, hidden = config.num_hidden_layers, config.hidden_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    weights = (layers * layer_params + head_params + tokens * hidden) * size  # embedding: only the rows looked up
    cache = 2 * layers * kv * head_dim * (context + tokens) * size
    flops = 2 * (layers * layer_params + head_params) * tokens + 4 * layers * heads * head_dim * (context + tokens) * tokens
    return 1000 * max((weights + cache) / (bandwidth * 1e9), flops / (peak * 1e9))


def backend_curves(backends: dict, contexts: list[int], tokens: list[int], repeats: int) -> dict:
    """label -> context -> k -> milliseconds of a forward of k new tokens after the context (fastest of `repeats`).
    Rounds interleave the backends and the points of each curve, so drift in the machine's speed (shared hosts
    drift by 1.25x within minutes) hits every backend and point alike."""
    generator = torch.Generator().manual_seed(0)
    vocab = next(iter(backends.values())).config.vocab_size
    curves = {label: {} for label in backends}
    for context in contexts:
        caches = {label: backend.new_cache() for label, backend in backends.items()}
        prompt = torch.randint(0, vocab, (1, context), generator=generator)
        for label, backend in backends.items():
            backend(prompt, caches[label])
        feeds = {k: torch.randint(0, vocab, (1, k), generator=generator) for k in tokens}
        best = {(label, k): float("inf") for label in backends for k in tokens}
        for _ in range(repeats):
            for label, backend in backends.items():
                for k in tokens:
                    caches[label].crop(context)
                    start = time.perf_counter()
                    backend(feeds[k], caches[label])
                    best[label, k] = min(best[label, k], time.perf_counter() - start)
        for label in backends:
            curves[label][str(context)] = {str(k): 1000 * best[label, k] for k in tokens}
    return curves


def measured_together(model, variants: list[tuple[str, str, str]], budget: int) -> list[list[tuple[str, str, str]]]:
    """The variants in groups whose extra weight layouts fit `budget` bytes together: each group is built at once
    and timed interleaved (decode/linear_kernels.py counts a layout per kernel a plan runs)."""
    from specdraft.decode.fast_target import linear_shapes
    from specdraft.decode.linear_kernels import weight_bytes

    size = weight_bytes(linear_shapes(model), model.dtype)
    groups, used = [[]], 0
    for variant in variants:
        cost = size * (2 if variant[2] == "auto" else 1) if variant[1] == "fast" else 0  # auto: up to two layouts
        if groups[-1] and used + cost > budget:
            groups.append([])
            used = 0
        groups[-1].append(variant)
        used += cost
    return groups


def measure(args) -> dict:
    from specdraft.decode.backend import build_backend, fast_unavailable
    from specdraft.io.hardware import cpu_model, native_bf16
    from specdraft.io.target import load_target

    torch.set_num_threads(args.threads or torch.get_num_threads())
    result = {"machine": {"cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                          "native_bf16": native_bf16(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "platform": platform.platform()},
              "target": args.target, "contexts": args.contexts, "tokens": args.tokens,
              "bandwidth_gbs": bandwidth_gbs(), "dtypes": {}}
    print(f"bandwidth {result['bandwidth_gbs']:.1f} GB/s, {torch.get_num_threads()} threads, {result['machine']['cpu']}")
    for name in args.dtypes:
        target = load_target(args.target, name)
        dtype, config = target.dtype, target.model.config
        peak = peak_gflops(dtype, args.repeats)
        entry = {"peak_gflops": peak, "gemm_gflops": gemm_table(target_shapes(config), dtype, args.tokens, args.repeats),
                 "floor_ms": {str(c): {str(k): floor_ms(config, dtype, c, k, result["bandwidth_gbs"], peak)
                                       for k in args.tokens} for c in args.contexts},
                 "backends": {}, "fast_unavailable": fast_unavailable(target.model)}
        variants = [("hf", "hf", "auto"), ("fast", "fast", "auto")]
        if entry["fast_unavailable"] is None:
            variants += [(f"fast-{k}", "fast", k) for k in candidates(dtype, target.model.device)]
        together = (measured_together(target.model, variants, memory_bytes() // 2)
                    if entry["fast_unavailable"] is None else [[v] for v in variants])  # no fast twin: HF alone
        for group in together:
            backends = {label: build_backend(target.model, backend_name, kernel=kernel)
                        for label, backend_name, kernel in group}
            entry["backends"].update(backend_curves(backends, args.contexts, args.tokens, args.repeats))
            if "fast" in backends:
                entry["fast_kernels"] = backends["fast"].describe()["kernels"]
            del backends
        result["dtypes"][name] = entry
        print_dtype(name, entry, args)
        del target
    return result


def print_dtype(name: str, entry: dict, args) -> None:
    print(f"\n{name}: peak {entry['peak_gflops']:.0f} GFLOP/s; forward ms (ratio to 1 token) by new tokens")
    for context in map(str, args.contexts):
        print(f"  context {context}")
        rows = {"floor": entry["floor_ms"][context], **{b: c[context] for b, c in entry["backends"].items()}}
        for label, curve in rows.items():
            one = curve[str(args.tokens[0])]
            cells = " ".join(f"{curve[str(k)]:6.1f} ({curve[str(k)] / one:.2f})" for k in args.tokens)
            print(f"    {label:<6} {cells}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One row per dtype, one column per context: every backend keeps its colour across the panels.
    contexts, dtypes = result["contexts"], list(result["dtypes"])
    fig, axes = plt.subplots(len(dtypes), len(contexts), figsize=(5 * len(contexts), 4 * len(dtypes)), squeeze=False)
    for row, dtype in zip(axes, dtypes):
        entry = result["dtypes"][dtype]
        for ax, context in zip(row, map(str, contexts)):
            tokens = [int(k) for k in entry["floor_ms"][context]]
            ax.plot(tokens, list(entry["floor_ms"][context].values()), "k--", label="floor")
            for backend, curves in entry["backends"].items():
                ax.plot(tokens, list(curves[context].values()), marker="o", label=backend)
            ax.set_title(f"{dtype}, context {context}")
            ax.set_xlabel("new tokens in the forward")
            ax.set_ylabel("ms")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
    fig.suptitle(f"{result['target']} verify step, {result['machine']['threads']} threads, {result['machine']['cpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    parser.add_argument("--contexts", nargs="+", type=int, default=[64, 300, 1024])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 3, 4, 6, 8, 12, 16])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("roofline"))
    args = parser.parse_args()
    if args.tokens[0] != 1:
        parser.error("--tokens must start at 1: ratios are to a one-token step")
    result = measure(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "roofline.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "roofline.png")
    print(f"\nwrote {args.out / 'roofline.json'} and {args.out / 'roofline.png'}")


if __name__ == "__main__":
    main()
