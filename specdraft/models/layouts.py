"""What a folder holds, read from its file names and config.json only (nothing is loaded or unpickled), so every
entry point that takes a folder (proposer.path, trainer.resume) can refuse the wrong kind by name.

Drafters released elsewhere, as their config.json spells them (none has `speculators_model_type`, which marks
vLLM's speculators format, the one specdraft exports and loads):
- DeepSpec (DeepSeek's DSpark reference code): the draft decoder config at the top level, `architectures` like
  `Qwen3DSparkModel`, and 0-based `target_layer_ids` (-1: the embedding output). speculators'
  `aux_hidden_state_layer_ids` index HF's `hidden_states` tuple, so they are DeepSpec's ids + 1: read without the
  shift, a drafter takes every feature from the layer below the one it was trained on and only its acceptance
  collapses.
- z-lab DFlash: `architectures` `DFlashDraftModel`, `dflash_config.target_layer_ids` (0-based as DeepSpec's),
  drafting from the mask positions after the anchor (speculators' `sample_from_anchor=false`).
- EAGLE-3 (SafeAILab, SpecForge): `architectures` `LlamaForCausalLMEagle3` beside a plain `model_type`.
Weight names do not tell these apart (all use `layers.*`, `fc`, `hidden_norm`, `norm`), so the config does.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

CONVERTER_MODULES = {"dspark": "dspark", "dflash": "dflash", "eagle3": "eagle"}  # speculators.convert.<module>
# other projects' layouts, by name
EXTERNAL = {"deepspec": "DeepSpec DSpark", "zlab_dflash": "z-lab DFlash", "eagle_repo": "EAGLE-3"}
EXPORTS = ("speculators", "causal_lm")  # what save_drafter writes (a standalone drafter is a plain causal LM)


def read_config(path: Path) -> dict:
    """config.json of a folder as a dict ({} where there is none); a clear error where it is not JSON."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not JSON ({err}); it was damaged after it was written: copy it again") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object; copy it again")
    return config


def external_layout(config: dict) -> str | None:
    """deepspec, zlab_dflash or eagle_repo (EXTERNAL) for a drafter config from those projects; None otherwise."""
    if "speculators_model_type" in config:
        return None
    architectures = [str(a) for a in config.get("architectures") or []]
    if "dflash_config" in config or any("DFlash" in a for a in architectures):
        return "zlab_dflash"
    if any(a.endswith("DSparkModel") for a in architectures) or {"target_layer_ids", "block_size"} <= set(config):
        return "deepspec"
    if any("eagle" in a.lower() for a in architectures):
        return "eagle_repo"
    return None


def folder_kind(path: str | Path) -> str | None:
    """What a folder is: speculators (our export or another), causal_lm (a plain HF model, as a standalone drafter's
    export), one of EXTERNAL, checkpoint (a training checkpoint of ours), run (a distill run folder), or None."""
    path = Path(path)
    if not path.is_dir():
        return None
    config = read_config(path)
    if "speculators_model_type" in config:
        return "speculators"
    if external_layout(config):
        return external_layout(config)
    if config.get("model_type"):
        return "causal_lm"
    if (path / "meta.json").is_file() and (path / "drafter.safetensors").is_file():
        return "checkpoint"
    if (path / "checkpoints").is_dir() or (path / "export").is_dir():
        return "run"
    return None


def _convert(path: Path, algorithm: str, verifier: str) -> str:
    """The speculators command that converts `path`, saying so where the installed speculators lacks it."""
    command = f"`speculators convert {path} --algorithm {algorithm} --verifier {verifier} --output-path OUT`"
    if importlib.util.find_spec(f"speculators.convert.{CONVERTER_MODULES[algorithm]}") is not None:
        return command
    from importlib.metadata import version

    return (f"{command} (this needs a speculators release with a {algorithm} converter; the installed "
            f"{version('speculators')} has none)")


def external_layout_error(path: Path, config: dict, verifier: str = "TARGET") -> str:
    """Why a folder in another project's layout is refused where a speculators drafter is expected, and the fix."""
    layout = external_layout(config)
    if layout == "deepspec":
        ids = [int(i) for i in config.get("target_layer_ids") or []]
        shifted = [0 if i == -1 else i + 1 for i in ids]  # -1 is the embedding output, hidden_states[0]
        return (f"{path} is a DeepSpec DSpark checkpoint (config.json: architectures {config.get('architectures')}, "
                f"0-based target_layer_ids {ids}), not the speculators format specdraft loads (config.json with "
                f"speculators_model_type, aux_hidden_state_layer_ids = DeepSpec's ids + 1 = {shifted}). "
                f"Convert it: {_convert(path, 'dspark', verifier)}, then proposer.path=OUT")
    if layout == "zlab_dflash":
        ids = (config.get("dflash_config") or {}).get("target_layer_ids", config.get("target_layer_ids"))
        return (f"{path} is a z-lab DFlash checkpoint (config.json: dflash_config, 0-based target_layer_ids {ids}), "
                "not the speculators format specdraft loads (config.json with speculators_model_type). z-lab's DFlash "
                "drafts from the mask positions after the anchor (sample_from_anchor=false), which specdraft's "
                f"decoder does not run: {_convert(path, 'dflash', verifier)} makes a speculators checkpoint to serve "
                "with vLLM; to decode here, distill a drafter with specdraft (drafter=dflash or dspark)")
    return (f"{path} is an EAGLE-3 checkpoint (config.json: architectures {config.get('architectures')}), not the "
            f"speculators format specdraft loads (config.json with speculators_model_type). Convert it: "
            f"{_convert(path, 'eagle3', verifier)}, then proposer.path=OUT")
