"""scripts/roofline.py's floor: bytes over bandwidth until the matmuls take longer than reading the weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_llama

spec = importlib.util.spec_from_file_location("roofline", Path(__file__).resolve().parents[1] / "scripts" / "roofline.py")
roofline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(roofline)


def test_shapes_are_the_fused_matmuls_of_a_layer_and_the_head():
    config = tiny_llama(0).config  # hidden 32, 4 heads of 8, 2 kv heads, intermediate 64, vocab 64
    assert roofline.target_shapes(config) == {"qkv": (64, 32), "o": (32, 32), "gate_up": (128, 32), "down": (32, 64),
                                              "lm_head": (64, 32)}


def test_floor_is_the_weight_stream_then_the_flops():
    config = tiny_llama(0).config
    params = 2 * (64 * 32 + 32 * 32 + 128 * 32 + 32 * 64) + 64 * 32  # two layers and the head
    bandwidth, peak = 1.0, 1e-3  # GB/s and GFLOP/s chosen so both regimes show
    one = roofline.floor_ms(config, torch.float32, 0, 1, bandwidth, peak)
    weights = (params + 32) * 4 + 2 * 2 * 2 * 8 * 1 * 4  # fp32 weights, one embedding row, one cached k/v slot
    flops = 2 * params + 4 * 2 * 4 * 8 * 1
    assert one == pytest.approx(1000 * max(weights / 1e9, flops / 1e6))
    # A fast machine: bandwidth-bound, so more tokens barely change the floor; bf16 halves it.
    fast = [roofline.floor_ms(config, torch.float32, 300, k, 10.0, 1e6) for k in (1, 8)]
    assert fast[1] / fast[0] < 1.1
    assert roofline.floor_ms(config, torch.bfloat16, 300, 1, 10.0, 1e6) == pytest.approx(fast[0] / 2)


def test_gemm_table_is_keyed_by_kernel_then_shape_then_rows():
    """Every kernel's throughput is recorded under each shape's own name (the plot and later issues read it)."""
    shapes = {"o": (32, 32), "down": (32, 64)}
    table = roofline.gemm_table(shapes, torch.float32, [1, 2], repeats=1)
    assert "torch" in table
    for kernel, by_shape in table.items():
        assert set(by_shape) == set(shapes), kernel
        for rows in by_shape.values():
            assert set(rows) == {"1", "2"}
            assert all(isinstance(v, str) or v > 0 for v in rows.values())


def test_backends_are_timed_side_by_side_in_groups_that_fit():
    """Every backend gets a curve for every context and width; the fast twins are grouped under the memory budget
    (the auto plan counted as two layouts), HF costing none."""
    from specdraft.decode.backend import build_backend
    from specdraft.decode.fast_target import linear_shapes
    from specdraft.decode.linear_kernels import weight_bytes

    model = tiny_llama(0)
    size = weight_bytes(linear_shapes(model), model.dtype)
    variants = [("hf", "hf", "auto"), ("fast", "fast", "auto"), ("fast-torch", "fast", "torch"),
                ("fast-mkl", "fast", "mkl")]
    assert roofline.measured_together(model, variants, 3 * size) == [variants[:3], variants[3:]]
    assert roofline.measured_together(model, variants, 0) == [[v] for v in variants]  # each alone, at worst
    backends = {label: build_backend(model, name, kernel="torch") for label, name, _ in variants[:3]}
    curves = roofline.backend_curves(backends, [5, 9], [1, 3], repeats=2)
    assert set(curves) == set(backends)
    for curve in curves.values():
        assert set(curve) == {"5", "9"} and all(set(c) == {"1", "3"} and min(c.values()) > 0 for c in curve.values())
