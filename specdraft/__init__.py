"""specdraft: train draft models for speculative decoding and run them losslessly.

Layers, each importing only the ones above it in this list:
  specdraft.io       the target, prompts and training data, hardware facts
  specdraft.models   drafter models and their export/import (the `speculators` format)
  specdraft.train    distillation (train/ in the repository)
  specdraft.decode   the speculative decoding engine and its benchmark (decode/ in the repository)
  specdraft.pipeline distill → export → validate, the one place that uses both train and decode
"""

__version__ = "0.1.0"
