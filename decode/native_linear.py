"""The native small-row linear kernel (decode/smallm_linear.c): built once per machine, loaded with ctypes.

y = x @ W.T + b in float32 for the 1-16 rows of a decode or verify step, reading W once in its own (out, in)
layout, so it holds no second copy of the weights; or (`pack`, `linear_packed`) from a copy packed so that each
thread reads its share of the weights as one sequential stream, which the hardware prefetcher follows faster
(docs/results/2026-12-08-packed-kernel.md). MKL and oneDNN are built for large matrices; at 4-8 rows they
read a layer's weights 1.5-2x slower than at one on the AMX Xeons measured, and a verify step is bandwidth-bound
(docs/results/2026-12-07-native-kernel.md). The auto kernel plan (decode/linear_kernels.py) times this kernel
beside the library ones and uses it where it is fastest.

It is compiled with the machine's C compiler (`CC`, else `cc`/`gcc`) and `-march=native`, on first use, into the
specdraft cache (keyed by the source, the compiler, the CPU and torch's OpenMP runtime; written atomically), and
linked against the OpenMP runtime torch ships, so its parallel region runs on torch's own threads. It uses AVX-512
where the CPU has it, else AVX2 with FMA. Where it cannot run (neither of them, no compiler, another OpenMP
runtime bound), `unavailable_reason` says why and the plan leaves it out. `SPECDRAFT_NATIVE=0` turns it off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("smallm_linear.c")
MAX_ROWS = 16  # wider inputs (prefill, wide batches) go to F.linear, which is built for them
PREFETCH_AHEAD = 256  # floats (1 KiB) ahead of each row of W; 0: no software prefetch (see smallm_linear.c)
# floats (4 KiB) ahead of the packed stream. Zen 4 EPYC, the target's 121 linears, 2 threads: at 1-4 rows within 4% of
# no prefetch, at 5 / 6 / 8 rows 18.8 / 20.1 / 27.2 ms against 19.7 / 22.2 / 29.8 (docs/results/2026-12-08-packed-kernel.md)
PACKED_AHEAD = 1024
CAPABILITIES = ("AVX512", "AVX2")  # torch's names for the instruction sets smallm_linear.c is written for


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _torch_gomp() -> Path | None:
    """torch's own GNU OpenMP runtime, which the kernel must share (a second runtime's threads would spin
    against torch's on the same cores)."""
    found = sorted(Path(torch.__file__).parent.joinpath("lib").glob("libgomp*.so*"))
    return found[0] if found else None


def _cpu_flags() -> str:
    """The CPU's feature flags (-march=native builds for them: a cached build is this CPU's only)."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(compiler: str, gomp: Path, out: Path, flags: tuple[str, ...] = ()) -> None:
    """Compile the kernel for this CPU into `out`; `flags` are added to the compiler's (a test builds the AVX2
    variant on an AVX-512 machine with -mno-avx512f)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        command = [compiler, "-O3", "-march=native", *flags, "-fopenmp", "-fPIC", "-shared", str(SOURCE),
                   "-o", str(built), f"-Wl,-rpath,{gomp.parent}", str(gomp)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()[-400:]}")
        os.replace(built, out)  # atomic: a concurrent process sees the old file or the whole new one


def _missing_prerequisite() -> str | None:
    """Why the kernel cannot be built here before trying, or None."""
    if os.environ.get("SPECDRAFT_NATIVE", "1") == "0":
        return "turned off by SPECDRAFT_NATIVE=0"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in CAPABILITIES:
        return f"the native kernel needs AVX-512 or AVX2 (torch detects {capability} here)"
    if torch.__config__.parallel_info().find("ATen parallel backend: OpenMP") < 0:
        return "torch here does not run its threads on OpenMP, which the native kernel shares"
    if not SOURCE.is_file():
        return f"the native kernel's source {SOURCE} is missing from this installation"
    if _compiler() is None:
        return "no C compiler (set CC, or install gcc) to build the native kernel"
    if _torch_gomp() is None:
        return "torch here ships no libgomp for the native kernel to share threads with"
    return None


def _library_path(compiler: str, gomp: Path) -> Path:
    """Where this machine's build lives: keyed by the source, the compiler, the CPU and torch's runtime."""
    from specdraft.io.hardware import cpu_model
    from specdraft.io.target import cache_root

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    key = "\n".join([SOURCE.read_text(), version, cpu_model(), _cpu_flags(), str(gomp)])
    folder = Path(os.environ.get("SPECDRAFT_KERNEL_DIR") or cache_root() / "kernels")
    return folder / f"smallm-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


@lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """(library, None), or (None, why it cannot run here)."""
    reason = _missing_prerequisite()
    if reason is not None:
        return None, reason
    compiler, gomp = _compiler(), _torch_gomp()
    try:
        path = _library_path(compiler, gomp)
    except OSError as error:
        return None, f"the C compiler {compiler!r} does not run ({error}): set CC to a working one"
    try:
        if not path.is_file():
            _build(compiler, gomp, path)
        library = _open(path)
    except (RuntimeError, OSError) as error:
        return None, f"the native kernel did not build or load: {error}"
    if not _runs_on(library, gomp):
        return None, (f"the native kernel's OpenMP calls do not resolve to torch's runtime {gomp} "
                      f"(OpenMP runtimes mapped: {', '.join(sorted(_mapped_gomp()))}): its threads would not be torch's")
    return library, None


def _runs_on(library: ctypes.CDLL, gomp: Path) -> bool:
    """Whether the library's OpenMP calls go to the runtime `gomp` (torch's). Other runtimes may be mapped beside
    it (a wheel's vendored, renamed libgomp, e.g. sentencepiece's) without mattering: only this binding does."""
    try:
        ours = library.smallm_openmp()
        torchs = ctypes.cast(ctypes.CDLL(str(gomp)).omp_get_num_threads, ctypes.c_void_p).value
    except (AttributeError, OSError):
        return False
    return ours is not None and ours == torchs


def _open(path: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))
    library.smallm_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5
    library.smallm_linear.restype = None
    library.smallm_linear_packed.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5
    library.smallm_linear_packed.restype = None
    library.smallm_lanes.restype = ctypes.c_int
    library.smallm_pack_rows.restype = ctypes.c_int
    library.smallm_openmp.restype = ctypes.c_void_p
    return library


def _mapped_gomp() -> set[str]:
    """The GNU OpenMP runtime files mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]}


def unavailable_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the native kernel cannot compute a linear layer of `dtype` on `device` here, or None."""
    if device.type != "cpu" or dtype != torch.float32:
        return "the native kernel computes float32 on the CPU only"
    return _load()[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           ahead: int = PREFETCH_AHEAD) -> torch.Tensor:
    """x (M, in) @ weight (out, in).T + bias -> (M, out); weight contiguous float32. Over MAX_ROWS rows: F.linear.
    ahead: floats to prefetch ahead of each row of W, 0 for none."""
    rows = x.shape[0]
    if rows > MAX_ROWS or rows == 0:
        return F.linear(x, weight, bias)
    return _call(_load()[0], x, weight, bias, ahead)


def _call(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          ahead: int = PREFETCH_AHEAD) -> torch.Tensor:
    rows = x.shape[0]
    x = x.contiguous()
    out = x.new_empty(rows, weight.shape[0])
    library.smallm_linear(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                          rows, weight.shape[0], weight.shape[1], torch.get_num_threads(), ahead)
    return out


def pack(weight: torch.Tensor, library: ctypes.CDLL | None = None) -> tuple[torch.Tensor, int]:
    """weight (out, in) float32 in smallm_linear_packed's layout, with `out` (the padding rows are never written):
    groups of PACK rows, each stored one vector of the kernel's LANES floats per row after another,
    (ceil(out/PACK), ceil(in/LANES), PACK, LANES), zero-padded to whole groups and vectors (both sizes are the
    build's: smallm_pack_rows, smallm_lanes)."""
    library = library or _load()[0]
    rows, lanes = library.smallm_pack_rows(), library.smallm_lanes()
    out, inp = weight.shape
    groups, vectors = -(-out // rows), -(-inp // lanes)
    padded = weight.new_zeros(groups * rows, vectors * lanes)
    padded[:out, :inp] = weight
    # (groups * rows, vectors * lanes) -> (groups, rows, vectors, lanes) -> (groups, vectors, rows, lanes)
    return padded.view(groups, rows, vectors, lanes).transpose(1, 2).contiguous(), out


def linear_packed(x: torch.Tensor, packed: tuple[torch.Tensor, int], bias: torch.Tensor | None,
                  library: ctypes.CDLL | None = None, ahead: int = PACKED_AHEAD) -> torch.Tensor:
    """x (M, in) @ W.T + bias -> (M, out) from `pack(W)`, at any M (built for a few rows: the plan runs it up to
    MAX_ROWS, decode/linear_kernels.py)."""
    weights, out_features = packed
    x = x.contiguous()
    out = x.new_empty(x.shape[0], out_features)
    if x.shape[0]:
        (library or _load()[0]).smallm_linear_packed(
            x.data_ptr(), weights.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
            x.shape[0], out_features, x.shape[1], torch.get_num_threads(), ahead)
    return out
