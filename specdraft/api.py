"""The library API: speculative generation with a target and (optionally) a trained drafter, and the pipeline.

    from specdraft import SamplingParams, SpecDecoder
    decoder = SpecDecoder.from_pretrained("smollm2-135m-instruct", drafter="runs/x/export", scheduler="cost")
    [out] = decoder.generate("Write a haiku about caches.", SamplingParams(max_new_tokens=64))
    print(out.text, out.stats["tau"])

The decoder itself lives in the decode layer (decode/decoder.py), where `specdraft-bench` uses it too; this module
adds what needs the layers above it: the distill pipeline.
"""

from __future__ import annotations

from specdraft.decode.decoder import DEFAULT_TARGET, Output, SamplingParams, SpecDecoder, output_stats
from specdraft.io.target import Target, load_target
from specdraft.models.export import load_drafter as _load_drafter
from specdraft.models.export import recorded_target

__all__ = ["DEFAULT_TARGET", "Output", "SamplingParams", "SpecDecoder", "distill", "load_drafter", "output_stats"]


def load_drafter(path: str, target: Target | str | None = None):
    """A trained drafter from an export folder, checked against its target (None: the one the export records,
    resolved here; a name or folder; or a loaded Target): (drafter, feature_layers)."""
    target = recorded_target(path) if target is None else target
    loaded = load_target(target, "float32") if isinstance(target, str) else target
    name = target if isinstance(target, str) else loaded.path
    return _load_drafter(path, loaded.model, name)


def distill(overrides: list[str] | None = None, run_dir: str = "runs/distill") -> dict:
    """The distill pipeline (data → train → export → validate) with Hydra overrides, as `specdraft-distill`
    runs it, into run_dir; returns results.json's content."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from specdraft import conf_dir
    from specdraft.pipeline import distill as run_pipeline

    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        config = compose("distill", overrides=[*(overrides or []), f"run_dir={run_dir}"])
    return run_pipeline(OmegaConf.to_object(config))
