"""Export to, and import from, vLLM's `speculators` checkpoint format (dspark / dflash / eagle3).

The checkpoint is built by the `speculators` library itself (`from_training_args`, then
`save_pretrained`), so its conventions are the library's, not re-implemented here:
- `transformer_layer_config` is the draft layers' decoder config (Qwen3-style, the verifier's
  widths, heads and rotary settings, `num_hidden_layers` = draft layers);
- `aux_hidden_state_layer_ids` index HF's `hidden_states` tuple (DeepSpec/z-lab layer id + 1),
  which is the convention of our `feature_layers` already;
- the reduced vocabulary is `t2d` (bool over the verifier's vocabulary) and `d2t` (offsets:
  target id = draft id + d2t[draft id]);
- the verifier's embeddings (and full-vocabulary LM head) are re-read at load time from
  `speculators_config.verifier.name_or_path`, which therefore must resolve: for the embedded
  target it is the converted local folder (repoint it by editing that field in config.json).
- eagle3 heads are a Llama first layer over [embedding; hidden] (speculators' `Eagle3DraftModel` with a
  `llama` layer config), their layer ids are `eagle_aux_hidden_state_layer_ids` (same indexing), and
  the number of drafted tokens is the greedy proposal's `speculative_tokens`.
Our parameter names already match theirs, so the state dict maps one to one.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from specdraft.models.drafter import BlockDrafter
from specdraft.models.eagle3 import Eagle3Drafter
from specdraft.models.registry import kind

SPECULATORS_CLASSES = {"dspark": "DSparkDraftModel", "dflash": "DFlashDraftModel", "eagle3": "Eagle3DraftModel"}


class UnsupportedCheckpoint(ValueError):
    """A well-formed speculators checkpoint of a variant our drafters do not implement: not damage, so the loader
    passes it on as it is instead of calling the export corrupt."""


def vocab_mappings(draft_to_target: torch.Tensor, target_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(t2d, d2t) in speculators' form from our absolute draft -> target id map."""
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[draft_to_target] = True
    d2t = draft_to_target.long() - torch.arange(len(draft_to_target))
    return t2d, d2t


def build_speculators_model(drafter, feature_layers, verifier_path: str, verifier_config):
    """A speculators DSpark/DFlash/Eagle-3 model with the same settings as `drafter` (weights not copied)."""
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dspark import DSparkDraftModel
    from speculators.models.eagle3 import Eagle3DraftModel

    cls = {"dspark": DSparkDraftModel, "dflash": DFlashDraftModel, "eagle3": Eagle3DraftModel}[drafter.mode]
    # The draft layers' own config (Qwen3-style, tie off, full attention), not a copy of the verifier's,
    # whose layer_types / tied embeddings / biases would not describe the trained layers.
    layer_config = copy.deepcopy(drafter.config)
    target_vocab = verifier_config.vocab_size
    t2d, d2t = (None, None) if full_vocabulary(drafter, target_vocab) else vocab_mappings(drafter.draft_to_target.cpu(), target_vocab)
    if kind(drafter.mode).unrolled:
        return cls.from_training_args(
            verifier_config=layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path=verifier_path,
            draft_vocab_size=len(drafter.draft_to_target), norm_before_residual=False, ttt_steps=drafter.block_size,
            target_layer_ids=list(feature_layers), draft_attn_impl="eager",
        )
    kwargs = dict(
        verifier_name_or_path=verifier_path, draft_vocab_size=len(drafter.draft_to_target),
        block_size=drafter.block_size, mask_token_id=drafter.mask_token_id, target_layer_ids=list(feature_layers),
        sample_from_anchor=True, draft_attn_impl="eager",
    )
    if kind(drafter.mode).markov_head:
        kwargs.update(markov_rank=drafter.markov_head.rank, markov_head_type=drafter.markov_head.head_type)
    return cls.from_training_args(verifier_config=layer_config, t2d=t2d, d2t=d2t, **kwargs)


def export_speculators(drafter, feature_layers, verifier_path: str, verifier_config, out_dir: Path) -> Path:
    """Write a speculators checkpoint of `drafter` to out_dir; returns out_dir."""
    model = build_speculators_model(drafter, feature_layers, verifier_path, verifier_config)
    ours = {k: v for k, v in drafter.state_dict().items()
            if k not in ("draft_to_target", "fc.input_scale") and not k.startswith("rotary.")}
    ours["fc.weight"] = drafter.fc.folded_weight().detach()  # speculators' fc is a plain Linear
    missing, unexpected = model.load_state_dict(ours, strict=False)
    # What speculators keeps that we do not: the verifier's own norm/LM head and the vocabulary maps.
    allowed_missing = {"verifier_norm.weight", "verifier_lm_head.weight", "t2d", "d2t"}
    if unexpected or set(missing) - allowed_missing:
        raise RuntimeError(f"state dict does not map onto speculators' model: missing {missing}, unexpected {unexpected}")
    out_dir = Path(out_dir)
    model.save_pretrained(str(out_dir))
    return out_dir


def import_speculators(path: str | Path, target_config, verifier_path: str | None = None
                       ) -> tuple[BlockDrafter | Eagle3Drafter, tuple[int, ...]]:
    """A speculators dspark/dflash/eagle3 checkpoint as our drafter (to decode with our engine). verifier_path:
    where speculators reads the verifier's embeddings and LM head (default: the checkpoint's
    verifier.name_or_path, which a serving engine resolves; our loader passes the target it has loaded)."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(str(path))
    if verifier_path:
        config.speculators_config.verifier.name_or_path = str(verifier_path)
    model = SpeculatorModel.from_pretrained(str(path), config=config)
    config = model.config
    mode = config.speculators_model_type
    if mode not in SPECULATORS_CLASSES:
        raise UnsupportedCheckpoint(f"{path} is a speculators {mode!r} checkpoint; only {sorted(SPECULATORS_CLASSES)} "
                                    "decode here")
    state = model.state_dict()
    if getattr(model, "use_draft_vocab", False):
        draft_ids = torch.arange(config.draft_vocab_size) + state["d2t"]
    else:
        draft_ids = torch.arange(target_config.vocab_size)
    _check_layer_config(config, target_config, path)
    if kind(mode).unrolled:
        variants = {k: getattr(config, k, False) for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")}
        if any(variants.values()) or config.transformer_layer_config.num_hidden_layers != 1:
            raise UnsupportedCheckpoint(f"{path}: an Eagle-3 variant we do not implement ({variants}, "
                                        f"{config.transformer_layer_config.num_hidden_layers} layers); only the plain "
                                        "one-layer head decodes here")
        layers = tuple(config.eagle_aux_hidden_state_layer_ids)
        steps = config.speculators_config.proposal_methods[0].speculative_tokens
        drafter = Eagle3Drafter(target_config, num_feature_layers=len(layers), steps=steps, draft_vocab_ids=draft_ids)
        return _load_ours(drafter, state, path), layers
    if not config.sample_from_anchor:
        raise UnsupportedCheckpoint(
            f"{path} uses sample_from_anchor=false (the anchor is the bonus token, as in z-lab's DFlash and drafters "
            "converted from it); specdraft decodes only drafters that sample from the anchor (its own exports, "
            "DeepSpec's DSpark): serve this one with vLLM, or distill a drafter with specdraft")
    layers = tuple(config.aux_hidden_state_layer_ids)
    drafter = BlockDrafter(
        target_config, num_layers=config.transformer_layer_config.num_hidden_layers, num_feature_layers=len(layers),
        block_size=config.block_size, mask_token_id=config.mask_token_id, mode=mode,
        markov_rank=getattr(config, "markov_rank", 256), markov_head_type=getattr(config, "markov_head_type", "vanilla"),
        draft_vocab_ids=draft_ids,
    )
    return _load_ours(drafter, state, path), layers


def full_vocabulary(drafter, target_vocab: int) -> bool:
    ids = drafter.draft_to_target.cpu()
    return len(ids) == target_vocab and bool((ids == torch.arange(target_vocab)).all())


def _check_layer_config(config, target_config, path) -> None:
    """Our drafters take widths, heads and rotary settings from the target: the checkpoint must agree."""
    layer = config.transformer_layer_config
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps")
    head_dim = lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # noqa: E731
    theirs = {**{k: getattr(layer, k, None) for k in keys}, "head_dim": head_dim(layer)}
    ours = {**{k: getattr(target_config, k, None) for k in keys}, "head_dim": head_dim(target_config)}
    if theirs != ours:
        raise ValueError(f"{path}: draft layers {theirs} differ from the target's {ours}; this checkpoint is not for this target")


def _load_ours(drafter, state: dict, path):
    """Copy a speculators state dict into our drafter; every one of our weights must be found, and
    every one of theirs used (a weight we would drop means a variant we do not implement)."""
    ours = {k: v for k, v in state.items() if k in drafter.state_dict()}
    leftover = set(state) - set(ours) - {"verifier_lm_head.weight", "verifier_norm.weight", "t2d", "d2t"}
    if leftover:
        raise ValueError(f"{path}: weights our drafter has no place for: {sorted(leftover)}")
    if "lm_head.weight" not in ours:  # full vocabulary: speculators keeps the verifier's head
        ours["lm_head.weight"] = state["verifier_lm_head.weight"]
    missing, unexpected = drafter.load_state_dict(ours, strict=False)
    if [k for k in missing if k not in ("draft_to_target", "fc.input_scale")] or unexpected:  # the scale stays 1
        raise ValueError(f"{path}: weights do not map onto our drafter: missing {missing}, unexpected {unexpected}")
    return drafter.eval()
