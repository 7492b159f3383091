"""The native small-row kernel (decode/smallm_linear.c): the same linear layer as F.linear at every row count and
shape (its tails included), on torch's own threads, and a clear reason wherever it cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdraft.decode import native_linear
from specdraft.decode.linear_kernels import candidates

CPU = torch.device("cpu")
REASON = native_linear.unavailable_reason(torch.float32, CPU)
NATIVE = ("native", "nativehw", "nativepack")  # the plan's entries for it: prefetch or none; the packed layout
BUILD_SKIPPED = (None if torch.backends.cpu.get_cpu_capability() in native_linear.CAPABILITIES
                 and native_linear._torch_gomp() else "the build is only tried on AVX-512 or AVX2 machines whose "
                 "torch ships libgomp")
SHAPES = [(1536, 576), (37, 19), (5, 33), (8, 16), (3, 7)]  # (out, in): tails of 4 rows, 16 and 8 floats


def assert_computes_the_linear_layer(linear, shape):
    """linear(x, weight, bias) equals F.linear at 1-18 rows: 1-8 in one pass, 9-16 in groups of 8, 17+ F.linear
    (the packed kernel: 1-6 rows in one pass, 1-3 in AVX2, more in groups of them)."""
    torch.manual_seed(0)
    out_features, in_features = shape
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    for rows in range(1, 19):
        x = torch.randn(rows, in_features)
        for b in (None, bias):
            torch.testing.assert_close(linear(x, weight, b), F.linear(x, weight, b), atol=1e-4, rtol=1e-5)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A build of its own in tmp_path: the cached library is forgotten before and after."""
    monkeypatch.setenv("SPECDRAFT_KERNEL_DIR", str(tmp_path))
    native_linear._load.cache_clear()
    yield tmp_path
    native_linear._load.cache_clear()


@pytest.mark.skipif(REASON is not None, reason=f"native kernel unavailable here: {REASON}")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ahead", [native_linear.PREFETCH_AHEAD, 0])  # `native`, `nativehw`
def test_the_native_kernel_computes_the_linear_layer_at_every_row_count(shape, ahead):
    assert_computes_the_linear_layer(lambda x, w, b: native_linear.linear(x, w, b, ahead), shape)


@pytest.mark.skipif(REASON is not None, reason=f"native kernel unavailable here: {REASON}")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ahead", [native_linear.PACKED_AHEAD, 0])  # its software prefetch, and none
def test_the_packed_kernel_computes_the_linear_layer_at_every_row_count(shape, ahead):
    assert_computes_the_linear_layer(
        lambda x, w, b: native_linear.linear_packed(x, native_linear.pack(w), b, ahead=ahead), shape)


def test_the_packed_layout_holds_each_group_of_rows_vector_by_vector():
    """pack's layout, from its definition: element [g, v, r, l] is W[g*PACK + r, v*LANES + l], zero past W."""
    if REASON is not None:
        pytest.skip(f"native kernel unavailable here: {REASON}")
    weight = torch.arange(9 * 21, dtype=torch.float32).view(9, 21) + 1  # no zero inside W
    packed, rows = native_linear.pack(weight)
    library = native_linear._load()[0]
    group, lanes = library.smallm_pack_rows(), library.smallm_lanes()
    assert group == 4  # the groups of 4 rows below
    assert rows == 9 and packed.shape == (3, -(-21 // lanes), group, lanes)
    for g, v, r, lane in [(0, 0, 0, 0), (1, 0, 2, 3), (2, 0, 0, lanes - 1), (0, 1, 3, 4)]:
        n, k = g * group + r, v * lanes + lane
        expected = weight[n, k] if n < 9 and k < 21 else 0.0
        assert packed[g, v, r, lane] == expected
    assert (packed[2, :, 1:] == 0).all()  # rows 9-11 are padding


def test_the_avx2_variant_computes_the_linear_layer(tmp_path):
    """The AVX2 code path (CPUs without AVX-512), built here with AVX-512 turned off where the CPU has it: both
    layouts."""
    if BUILD_SKIPPED or REASON is not None:
        pytest.skip(BUILD_SKIPPED or f"native kernel unavailable here: {REASON}")
    path = tmp_path / "smallm-avx2.so"
    native_linear._build(native_linear._compiler(), native_linear._torch_gomp(), path, ("-mno-avx512f",))
    library = native_linear._open(path)
    assert library.smallm_lanes() == 8
    for shape in SHAPES:
        assert_computes_the_linear_layer(lambda x, w, b: native_linear._call(library, x, w, b), shape)
        assert_computes_the_linear_layer(
            lambda x, w, b: native_linear.linear_packed(x, native_linear.pack(w, library), b, library), shape)


@pytest.mark.skipif(REASON is not None, reason=f"native kernel unavailable here: {REASON}")
def test_the_native_kernel_reads_a_non_contiguous_input_and_follows_torchs_thread_count():
    torch.manual_seed(0)
    weight = torch.randn(64, 48)
    x = torch.randn(48, 6).t()  # (6, 48), not contiguous
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            torch.testing.assert_close(native_linear.linear(x, weight, None), F.linear(x, weight), atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(before)
    assert native_linear._runs_on(native_linear._load()[0], native_linear._torch_gomp())  # torch's thread pool


def test_another_libraries_private_openmp_runtime_does_not_turn_it_off(fresh_build, tmp_path):
    """A wheel's vendored libgomp (sentencepiece ships one) mapped beside torch's: the kernel still binds to
    torch's, and is kept; asked about the other runtime, the check says no (its negative control)."""
    if BUILD_SKIPPED or REASON is not None:
        pytest.skip(BUILD_SKIPPED or f"native kernel unavailable here: {REASON}")
    import ctypes
    import shutil

    private = tmp_path / "libgomp-private.so.1"
    shutil.copy(native_linear._torch_gomp(), private)
    ctypes.CDLL(str(private))  # loaded as an extension's dependency is: local, not interposing
    assert str(private) in native_linear._mapped_gomp()
    assert native_linear.unavailable_reason(torch.float32, CPU) is None
    library = native_linear._load()[0]
    assert native_linear._runs_on(library, native_linear._torch_gomp())
    assert not native_linear._runs_on(library, private)


@pytest.mark.skipif(REASON is not None, reason=f"native kernel unavailable here: {REASON}")
def test_the_build_is_cached_by_machine_and_reused(fresh_build):
    assert native_linear.unavailable_reason(torch.float32, CPU) is None
    built = list(fresh_build.glob("smallm-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    native_linear._load.cache_clear()
    assert native_linear.unavailable_reason(torch.float32, CPU) is None
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not built again


def test_other_dtypes_and_devices_are_refused_with_the_reason():
    assert "float32 on the CPU only" in native_linear.unavailable_reason(torch.bfloat16, CPU)
    assert not set(NATIVE) & set(candidates(torch.bfloat16, CPU))


def test_it_can_be_turned_off_and_the_plan_leaves_it_out(fresh_build, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_NATIVE", "0")
    assert native_linear.unavailable_reason(torch.float32, CPU) == "turned off by SPECDRAFT_NATIVE=0"
    assert not set(NATIVE) & set(candidates(torch.float32, CPU))


def test_a_failed_build_names_the_compiler_error_and_leaves_nothing_behind(fresh_build, monkeypatch):
    if BUILD_SKIPPED:
        pytest.skip(BUILD_SKIPPED)
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    reason = native_linear.unavailable_reason(torch.float32, CPU)
    assert reason.startswith("the native kernel did not build or load: false -O3")
    assert list(fresh_build.iterdir()) == []  # no partial library for a later run to load


def test_a_compiler_that_does_not_exist_is_named(fresh_build, monkeypatch):
    if BUILD_SKIPPED:
        pytest.skip(BUILD_SKIPPED)
    monkeypatch.setenv("CC", str(fresh_build / "no-such-cc"))
    assert "does not run" in native_linear.unavailable_reason(torch.float32, CPU)
    assert not set(NATIVE) & set(candidates(torch.float32, CPU))
