"""The drafter export (DIR/export): a `speculators` checkpoint plus a small sidecar of ours.

`config.json` + `model.safetensors` are vLLM's speculators format (see speculators_export.py), whose
`verifier.name_or_path` is the target as a serving engine resolves it (an alias's Hugging Face id, never a
machine-local cache folder); `specdraft.json` records the target the drafter was distilled from, by the name
the user gave and a fingerprint of its weights, so decoding with another target is refused with both named,
before any weight is touched. Loading reads the verifier's embeddings from the target actually loaded, so an
export moves between machines with its target resolved there. (For the embedded alias that id names the original
checkpoint, while the drafter was trained on the GGUF's dequantized Q4_1 weights: close, not equal, so a server
verifying with it accepts slightly differently.)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdraft.io.files import write_folder_atomically
from specdraft.io.target import same_target, serving_name, target_fingerprint
from specdraft.models.drafter import BlockDrafter
from specdraft.models.eagle3 import Eagle3Drafter
from specdraft.models.layouts import external_layout, external_layout_error, folder_kind, read_config
from specdraft.models.registry import kind
from specdraft.models.speculators_export import UnsupportedCheckpoint, export_speculators, import_speculators

SIDECAR = "specdraft.json"
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "model_type")


def describe(fingerprint: dict | None) -> str:
    """A fingerprint in an error message: its config hash and the first sampled embedding values."""
    if fingerprint is None:
        return "not recorded"
    head = ", ".join(f"{v:.4f}" for v in fingerprint["embedding_sample"][1][:3])
    return f"config {fingerprint['config']}, embedding sample [{head}, ...]"


def target_signature(target_model, name_or_path: str) -> dict:
    """What identifies a target for a drafter: its name, the shapes the drafter depends on, its fingerprint."""
    config = target_model.config
    return {"name_or_path": name_or_path, **{k: getattr(config, k) for k in SHAPE_KEYS},
            "fingerprint": target_fingerprint(target_model)}


def export_config(path: str | Path) -> Path:
    """The export's config.json, or a clear error where `path` is not an export folder (one of our run folders or
    training checkpoints is named as such, with the export to pass)."""
    path = Path(path)
    config = path / "config.json"
    if config.is_file():
        return config
    found = folder_kind(path)
    run = path if found == "run" else path.parent.parent if found == "checkpoint" else None  # RUN/checkpoints/step-N
    if run is not None:
        what = "a distill run folder" if found == "run" else "a training checkpoint (weights + trainer state)"
        if (run / "export" / "config.json").is_file():
            fix = f"decode with the run's export: proposer.path={run / 'export'}"
        else:
            fix = ("the run has no export yet (it writes one when training ends): the same distill command with "
                   f"hydra.run.dir={run} goes on from the newest checkpoint and exports")
        raise FileNotFoundError(f"{path} is not a drafter export but {what}; {fix}")
    raise FileNotFoundError(f"{path} is not a drafter export (no config.json); pass the export folder of a distill run")


def speculators_config(path: str | Path, verifier: str = "TARGET") -> dict:
    """The export's config.json as a dict, refused where it is not the speculators format: another project's
    layout (specdraft.models.layouts: DeepSpec, z-lab, EAGLE-3) or a standalone drafter, each named with its fix.
    verifier: the target, for the conversion command an error suggests."""
    path = Path(path)
    export_config(path)
    config = read_config(path)
    if "speculators_model_type" in config:
        return config
    if external_layout(config):
        raise ValueError(external_layout_error(path, config, verifier))
    if config.get("model_type"):
        raise ValueError(f"{path} is a standalone drafter (a plain {config['model_type']} causal LM), not a speculators "
                         f"drafter export: decode it with proposer=model proposer.path={path}")
    raise ValueError(f"{path}/config.json has no speculators_model_type: it is not a speculators drafter export; pass "
                     "the export folder of a distill run, or convert the checkpoint with `speculators convert`")


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def check_weights(path: str | Path) -> list[Path]:
    """The export's safetensors files, each with a header that reads and covers the file; a clear error for a
    missing, truncated or corrupt one, and for pickle weights (never unpickled: a pickle can run code)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    files = [single]
    if not single.is_file() and index.is_file():  # transformers' order: the single file first, then the index
        try:
            files = sorted({path / name for name in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index} is not a safetensors index ({type(err).__name__}: {err})") from None
        if not files:
            raise ValueError(f"{index} lists no weight files; export the drafter again")
    for file in files:
        if not file.is_file():
            pickles = sorted(p.name for p in path.iterdir()  # weight files by their usual names, not trainer state
                             if p.suffix in PICKLE_SUFFIXES and p.name.startswith(("pytorch_model", "model", "drafter")))
            if pickles:
                raise ValueError(f"drafter export {path} holds pickle weights ({', '.join(pickles)}) and no {file.name}; "
                                 "specdraft loads weights only from safetensors and never unpickles them: convert them "
                                 "with safetensors.torch.save_file, or export the drafter again")
            raise ValueError(f"drafter export {path} has no {file.name}; export the drafter again "
                             "(python train/distill.py ... with the run's hydra.run.dir resumes and exports)")
        try:
            with safe_open(str(file), framework="pt") as handle:
                handle.keys()
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{file} is truncated or corrupt ({err}); exports are written whole or not at all, so "
                             "it was damaged after it was written (a cut copy, a full disk): copy or export it again"
                             ) from None
    return files


def training_record(path: str | Path) -> dict | None:
    """What training measured on held-out data, as the export recorded it (None: exports from elsewhere or
    before the record existed)."""
    sidecar = Path(path) / SIDECAR
    return json.loads(sidecar.read_text()).get("training") if sidecar.is_file() else None


def recorded_target(path: str | Path) -> str:
    """The target an export was distilled from, by the name its user gave (specdraft.json), else the verifier
    its speculators config.json names (a checkpoint made elsewhere)."""
    path = Path(path)
    sidecar = path / SIDECAR
    if sidecar.is_file():
        return json.loads(sidecar.read_text())["target"]["name_or_path"]
    verifier = speculators_config(path).get("speculators_config", {}).get("verifier", {})
    if not verifier.get("name_or_path"):
        raise ValueError(f"{path}/config.json names no verifier (speculators_config.verifier.name_or_path); "
                         "name the target explicitly")
    return verifier["name_or_path"]


def set_serving_verifier(path: str | Path, name_or_path: str) -> str:
    """Point the export's speculators config.json at the target a serving engine should verify with (a local
    copy, another hub id); written atomically. specdraft's own loader reads specdraft.json, not this field.
    Returns the previous value."""
    config_path = export_config(path)
    config = read_config(Path(path))
    if external_layout(config):
        raise ValueError(external_layout_error(Path(path), config, serving_name(name_or_path)))
    verifier = config.get("speculators_config", {}).get("verifier")
    if verifier is None:
        raise ValueError(f"{config_path} is not a speculators config (no speculators_config.verifier): a standalone "
                         "drafter is a plain HF model that names no verifier")
    previous, verifier["name_or_path"] = verifier.get("name_or_path"), serving_name(name_or_path)
    tmp = config_path.with_name("config.json.tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(config_path)
    return previous


def save_drafter(out_dir: Path, drafter: BlockDrafter | Eagle3Drafter, feature_layers, target_model, target_name: str,
                 verifier_path: str, training: dict | None = None) -> Path:
    """Write the export atomically: speculators checkpoint + sidecar. verifier_path: the target's local folder
    (a standalone drafter copies its tokenizer from there). training: what training measured on held-out data
    (its greedy tau), kept so a serving-time check can compare (`bench.mode=check`)."""

    def write(tmp: Path) -> None:
        if not kind(drafter.mode).speculators:  # a plain HF model + the target's tokenizer
            from transformers import AutoTokenizer

            drafter.merged().save_pretrained(tmp)
            AutoTokenizer.from_pretrained(verifier_path).save_pretrained(tmp)
        else:
            # speculators reads the verifier's weights while building: from the local folder; config.json then
            # names the target as other machines and serving engines resolve it
            export_speculators(drafter, feature_layers, verifier_path, target_model.config, tmp)
            config = json.loads((tmp / "config.json").read_text())
            config["speculators_config"]["verifier"]["name_or_path"] = serving_name(target_name)
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        sidecar = {"target": target_signature(target_model, target_name), "feature_layers": list(feature_layers)}
        if training:
            sidecar["training"] = training
        (tmp / SIDECAR).write_text(json.dumps(sidecar, indent=2))

    return write_folder_atomically(out_dir, write)


def load_drafter(path: str | Path, target_model, target_name: str) -> tuple[BlockDrafter | Eagle3Drafter, tuple[int, ...]]:
    """A drafter export for this target (refused, naming both, if it was made for another)."""
    path = Path(path)
    config = speculators_config(path, target_name)
    check_weights(path)
    sidecar = path / SIDECAR
    saved = json.loads(sidecar.read_text()) if sidecar.is_file() else {}
    expected = saved.get("target")
    actual = target_signature(target_model, target_name)
    keys = SHAPE_KEYS
    if expected is None:  # a checkpoint from elsewhere: only the widths its decoder config records can be compared
        layer_config = config.get("transformer_layer_config", {})
        expected = {"name_or_path": "(recorded in config.json)", **{k: layer_config.get(k) for k in SHAPE_KEYS}}
        keys = ("vocab_size", "hidden_size")
    recorded = expected.get("fingerprint")  # exports made before fingerprints: shapes only
    if any(expected[k] != actual[k] for k in keys) or (recorded is not None and not same_target(recorded, actual["fingerprint"])):
        raise ValueError(
            f"drafter {path} was distilled from target {expected['name_or_path']!r} "
            f"({', '.join(f'{k}={expected[k]}' for k in SHAPE_KEYS)}, weights {describe(recorded)}) "
            f"but the target is {target_name!r} "
            f"({', '.join(f'{k}={actual[k]}' for k in SHAPE_KEYS)}, weights {describe(actual['fingerprint'])}); "
            "decode with the target it was distilled from (target.name_or_path=NAME, or proposer.verifier=export to "
            "take the one the export records, or proposer.verifier=PATH for a local copy of it)"
        )
    try:
        # the verifier's embeddings and head come from the target loaded here, wherever the export was made
        drafter, layers = import_speculators(path, target_model.config, target_model.config._name_or_path)
    except UnsupportedCheckpoint:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise ValueError(f"drafter export {path} is corrupt or incomplete ({type(err).__name__}: {err})") from None
    _check_feature_layers(path, tuple(int(i) for i in layers), saved.get("feature_layers"),
                          target_model.config.num_hidden_layers)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
    return drafter.to(device=target_model.device, dtype=target_model.dtype).eval(), layers


def _check_feature_layers(path: Path, layers: tuple[int, ...], recorded, num_layers: int) -> None:
    """The target layers the drafter reads must exist, and must be the ones it was trained on: read wrongly, a
    drafter still runs, only its acceptance collapses (tau near 1) with no error."""
    outside = [i for i in layers if not 0 <= i <= num_layers]
    if outside:
        raise ValueError(f"{path}/config.json has the drafter read target layers {list(layers)}, but the target has "
                         f"hidden states 0..{num_layers} (layers {outside} do not exist): this export is for another "
                         "target, or its config.json was edited; export it again")
    if recorded is not None and list(recorded) != list(layers):
        raise ValueError(f"{path}/config.json has the drafter read target layers {list(layers)}, but it was trained on "
                         f"layers {list(recorded)} ({SIDECAR}); one of the two files was edited: export it again")
