"""specdraft: train draft models for speculative decoding and run them losslessly.

Layers, each importing only the ones above it in this list:
  specdraft.io       the target, prompts and training data, hardware facts
  specdraft.models   drafter models and their export/import (the `speculators` format)
  specdraft.train    distillation (train/ in the repository)
  specdraft.decode   the speculative decoding engine and its benchmark (decode/ in the repository)
  specdraft.pipeline distill → export → validate, the one place that uses both train and decode
  specdraft.api      the library API (SpecDecoder, SamplingParams, load_drafter, distill) over all of them
"""

from pathlib import Path

__version__ = "0.1.0"


def conf_dir() -> str:
    """The Hydra configs as a folder: specdraft/conf in an installed wheel, conf/ beside this folder in a checkout
    (an absolute path, so Hydra reads files and needs no importable config package)."""
    here = Path(__file__).resolve().parent
    return str(next((c for c in (here / "conf", here.parent / "conf") if (c / "distill.yaml").is_file()), here / "conf"))


# The library API (specdraft/api.py), imported on first use so `import specdraft.io...` stays light.
API = ("SpecDecoder", "SamplingParams", "Output", "load_drafter", "distill")
__all__ = [*API, "__version__", "conf_dir"]


def __getattr__(name: str):
    if name in API:
        from specdraft import api

        return getattr(api, name)
    raise AttributeError(f"module 'specdraft' has no attribute {name!r}")
