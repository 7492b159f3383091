"""llama.cpp as a peer engine: the binaries and converter scripts/build_llama_cpp.sh builds from the source tree
that the `llama-cpp-python` sdist vendors (cached; nothing here builds it), a drafter export converted to GGUF with
that tree's own converter, and `llama-speculative-simple` runs parsed into counts."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

LLAMA_VERSION = "0.3.36"
NEEDED = ("llama-speculative-simple", "llama-bench")


def source_dir() -> Path:
    cache = Path(os.environ.get("SPECDRAFT_CACHE",
                                Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdraft"))
    return cache / f"llama.cpp-{LLAMA_VERSION}"


def cpu_key() -> str:
    """Which CPU a build is for: scripts/build_llama_cpp.sh compiles for the machine it runs on (GGML_NATIVE),
    and the cache outlives machines (a home folder moved to another CPU), so each CPU gets its own build;
    a binary built for another one dies of an illegal instruction."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
        described = f"{model}|{' '.join(sorted(_cpu_flags()))}"
    except OSError:
        described = f"{platform.machine()}|{platform.processor()}"
    return hashlib.sha256(described.encode()).hexdigest()[:12]


def cmake_flags() -> list[str]:
    """scripts/build_llama_cpp.sh's configuration. Native code for this CPU, but not ggml's AMX matmul: in this
    version its batched path dies at `ldtilecfg` (SIGSEGV, or SIGILL) on the 2-core AMX Xeons measured
    (2026-12-03), while llama-bench's one-token path ran; the AVX-512 kernels serve those CPUs."""
    off = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    amx = any(flag.startswith("amx") for flag in _cpu_flags())
    return ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DGGML_NATIVE=ON", *([f"-DCMAKE_C_FLAGS={off}", f"-DCMAKE_CXX_FLAGS={off}"] if amx else [])]


def _cpu_flags() -> list[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
    return next((line.split(":", 1)[1].split() for line in lines if line.startswith(("flags", "Features"))), [])


def build_dir() -> Path:
    """This CPU's build of this configuration (either changing builds anew)."""
    recipe = hashlib.sha256(" ".join(cmake_flags()).encode()).hexdigest()[:6]
    return source_dir() / f"build-{cpu_key()}-{recipe}"


def bin_dir() -> Path | None:
    """The folder of scripts/build_llama_cpp.sh's binaries for this CPU, or None where they were not built."""
    folder = build_dir() / "bin"
    return folder if all((folder / name).is_file() for name in NEEDED) else None


def convert_to_gguf(model_dir: str | Path, out: Path, target_dir: str | Path | None = None,
                    outtype: str = "f32") -> Path:
    """`convert_hf_to_gguf.py` of the vendored tree (its own gguf-py first on the path: the PyPI gguf that
    transformers reads GGUF with may predate the drafter architectures). A drafter needs `target_dir`, the
    target's HF folder, for the tokenizer. Reuses `out` when it is newer than the model's weights."""
    model_dir = Path(model_dir)
    newest = max(p.stat().st_mtime for p in model_dir.iterdir())
    if out.is_file() and out.stat().st_mtime > newest:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    cmd = [sys.executable, str(source_dir() / "convert_hf_to_gguf.py"), str(model_dir), "--outfile", str(partial),
           "--outtype", outtype]
    cmd += ["--target-model-dir", str(target_dir)] if target_dir else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source_dir() / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter refused {model_dir} (exit {proc.returncode}): "
                           f"{(proc.stdout + proc.stderr)[-600:]}")
    partial.replace(out)  # a killed conversion leaves only the .partial file, never a GGUF that looks whole
    return out


def exit_reason(code: int) -> str:
    """A binary's exit status in words; an illegal instruction names its likely cause and the fix."""
    if code in (-signal.SIGILL, 128 + signal.SIGILL):
        return (f"exit {code}: illegal instruction, a build for another CPU; rebuild for this one with "
                "bash scripts/build_llama_cpp.sh")
    if code < 0:
        return f"exit {code}: killed by {signal.Signals(-code).name}"
    return f"exit {code}"


@dataclass
class SpeculativeRun:
    """One `llama-speculative-simple` run's counts, as it prints them."""

    encoded: int = 0
    encode_s: float = 0.0
    decoded: int = 0
    decode_s: float = 0.0
    drafted: int = 0
    accepted: int = 0

    def __add__(self, other: "SpeculativeRun") -> "SpeculativeRun":
        return SpeculativeRun(*(a + b for a, b in zip(vars(self).values(), vars(other).values())))


def speculative_simple(binaries: Path, args: list[str], prompt: str) -> SpeculativeRun:
    """Run `llama-speculative-simple ARGS -p PROMPT` and parse its encode/decode times and draft counts."""
    proc = subprocess.run([str(binaries / "llama-speculative-simple"), *args, "-p", prompt], capture_output=True,
                          text=True, timeout=600)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"llama-speculative-simple failed ({exit_reason(proc.returncode)}): {log[-600:]}")
    run = SpeculativeRun()
    if enc := re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) s", log):
        run.encoded, run.encode_s = int(enc.group(1)), float(enc.group(2))
    if dec := re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) s", log):
        run.decoded, run.decode_s = int(dec.group(1)), float(dec.group(2))
    counts = dict(re.findall(r"(n_drafted|n_accept)\s+=\s+(\d+)", log))
    run.drafted, run.accepted = int(counts.get("n_drafted", 0)), int(counts.get("n_accept", 0))
    return run
