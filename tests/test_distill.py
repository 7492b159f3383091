"""train/distill.py: every config composes; a tiny end-to-end run regenerates, trains, exports and
validates (its export decodes losslessly); a drafter export is refused for another target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.helpers import save_tiny_model

REPO = Path(__file__).resolve().parents[1]
DISTILL_GROUPS = {"drafter": ["dflash", "dspark", "eagle3", "standalone"], "trainer": ["default"], "tracking": ["disabled", "offline"],
                  "experiment": ["smoke", "cpu_full"], "data": ["jsonl", "sharegpt"], "target": ["smollm2_135m"]}


def compose_distill(overrides):
    import specdraft.pipeline  # noqa: F401  (registers the schema)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return OmegaConf.to_object(compose("distill", overrides=overrides + ["run_dir=unused"]))


@pytest.mark.parametrize("group,option", [(g, o) for g, options in DISTILL_GROUPS.items() for o in options])
def test_every_distill_option_composes(group, option):
    cfg = compose_distill([f"{group}={option}"] + (["data.path=x"] if option == "jsonl" else []))
    assert cfg.drafter.mode in ("dspark", "dflash", "eagle3", "standalone")


def test_dflash_mode_sets_ce_only_loss():
    cfg = compose_distill(["drafter=dflash"])
    assert (cfg.drafter.mode, cfg.trainer.ce_weight, cfg.trainer.l1_weight) == ("dflash", 1.0, 0.0)


def test_eagle3_mode_sets_ttt_steps_and_step_decay():
    import math

    cfg = compose_distill(["drafter=eagle3"])
    assert (cfg.drafter.mode, cfg.drafter.block_size, cfg.trainer.confidence_weight) == ("eagle3", 7, 0.0)
    assert math.exp(-1 / cfg.trainer.position_decay) == pytest.approx(0.8, abs=1e-4)  # Eagle-3's step decay


def test_unknown_distill_key_fails():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="num_lyers"):
        compose_distill(["drafter.num_lyers=2"])


@pytest.fixture()
def chat_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"id": f"c{i}", "prompt": " ".join(f"w{(i * 7 + j) % 50}" for j in range(6)), "response": "w1 w2"} for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("drafter", ["dspark", "eagle3"])
def test_tiny_end_to_end_run(tmp_path, chat_file, tiny_model_dir, drafter):
    run_dir = tmp_path / "run"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w3 w4 w5"}) + "\n" + json.dumps({"prompt": "w9 w9"}) + "\n")
    cmd = [sys.executable, str(REPO / "train" / "distill.py"), f"drafter={drafter}", "experiment=smoke", f"target.name_or_path={tiny_model_dir}",
           "data=jsonl", f"data.path={chat_file}", "drafter.draft_vocab_size=32", "drafter.feature_layers=[0,1]",
           "validate.data=jsonl", f"validate.data_path={prompts}", "tracking.wandb_mode=offline", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["lossless"] is True and results["train_steps"] == 6
    # W&B (offline): throughput, memory, alpha by position, held-out tau, validation and the export as an artifact.
    (record,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    logged = record.read_bytes()
    for name in (b"train/tokens_per_s", b"train/max_rss_gb", b"train/alpha_1", b"eval/tau_estimate",
                 b"validate/lossless", f"drafter-{drafter}".encode(), b"model.safetensors"):
        assert name in logged, name
    assert results["eval_tau_estimate"] is not None and results["export_path"] == str(run_dir / "export")
    # dspark carries a confidence head: the export is calibrated before validation (eagle3 has none to calibrate).
    calibrated = drafter == "dspark"
    assert set(results["stage_seconds"]) == {"data", "train", "export", "validate"} | ({"calibrate"} if calibrated else set())
    assert (run_dir / "export" / "calibration.json").is_file() == calibrated
    assert (results["calibration"] is not None) == calibrated
    if calibrated:
        assert set(results["calibration"]["position_1"]) == {"greedy", "sampling"}
    chosen = results["train_target_dtype"]  # trainer.target_dtype=auto: the decision and its reason
    assert chosen["dtype"] in ("float32", "bfloat16") and "trainer.target_dtype=auto" in chosen["reason"]
    assert (run_dir / "export" / "config.json").is_file() and (run_dir / "export" / "specdraft.json").is_file()
    assert (run_dir / "checkpoints" / "step-0000006" / "meta.json").is_file()
    assert len((run_dir / "data" / "responses.jsonl").read_text().splitlines()) == 10  # 8 train + 2 eval
    exported = json.loads((run_dir / "export" / "config.json").read_text())
    assert exported["speculators_model_type"] == drafter
    record = json.loads((run_dir / "export" / "specdraft.json").read_text())["training"]  # bench.mode=check reads it
    assert record["eval_tau_greedy"] == results["eval_tau_greedy"] and record["steps"] == results["train_steps"]
    # The export used with a different target is refused, naming both.
    from specdraft.models.export import load_drafter
    from specdraft.io.target import load_target

    other = load_target(save_tiny_model(tmp_path / "other", vocab_size=80), "float32")
    with pytest.raises(ValueError, match="distilled from target .* but the target is 'other-target'"):
        load_drafter(run_dir / "export", other.model, "other-target")


def test_regenerated_slice_and_own_responses_mix(tmp_path, chat_file, tiny_model_dir):
    """data.num_regenerate=3: three conversations answered by the target, the rest keep their own responses;
    a resumed run (extend=False) regenerates nothing more."""
    from specdraft.train.distill import build_examples
    from specdraft.io.target import load_target

    target = load_target(tiny_model_dir, "float32")
    cfg = compose_distill(["data=jsonl", f"data.path={chat_file}", "data.num_regenerate=3", "data.num_samples=10",
                           "data.num_eval=2", "data.regen_max_new_tokens=4", "data.regen_batch_size=2"])
    examples = build_examples(cfg, target, tmp_path, budget_s=1e9)
    lines = (tmp_path / "data" / "responses.jsonl").read_text().splitlines()
    assert len(lines) == 3 and len(examples) == 12
    own = target.tokenizer("w1 w2", add_special_tokens=False)["input_ids"] + [target.tokenizer.eos_token_id]
    assert examples[5]["input_ids"][-len(own):] == own and sum(examples[5]["loss_mask"]) == len(own)
    cfg.data.num_regenerate = 5
    build_examples(cfg, target, tmp_path, budget_s=1e9, extend=False)
    assert len((tmp_path / "data" / "responses.jsonl").read_text().splitlines()) == 3


def test_tiny_end_to_end_two_processes(tmp_path, chat_file, tiny_model_dir):
    """`accelerate launch` with the DDP recipe runs the real entry point on 2 processes: rank 0 regenerates,
    exports, validates and writes results; both ranks train in sync."""
    run_dir = tmp_path / "run"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w3 w4 w5"}) + "\n")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "conf" / "accelerate" / "ddp.yaml"),
           "--num_processes", "2", str(REPO / "train" / "distill.py"), "experiment=smoke", f"target.name_or_path={tiny_model_dir}",
           "data=jsonl", f"data.path={chat_file}", "drafter.draft_vocab_size=32", "drafter.feature_layers=[0,1]",
           "trainer.batch_size=1", "validate.data=jsonl", f"validate.data_path={prompts}", "validate.num_prompts=1",
           f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["world_size"] == 2 and results["lossless"] is True and results["train_steps"] == 6
    assert results["train_tokens_per_s"] > 0
    assert len((run_dir / "data" / "responses.jsonl").read_text().splitlines()) == 10  # regenerated once, by rank 0
    assert proc.stdout.count("specdraft distill — summary") == 1  # printed by rank 0 only
    # One prompt cannot be split into a half that fits the confidence maps and a half that evaluates them: the
    # stage says so and the run goes on to validate the uncalibrated export.
    assert results["calibration"] is None and "calibrate: skipped, 1 prompt(s)" in proc.stdout
    assert not (run_dir / "export" / "calibration.json").exists()


def test_tiny_standalone_drafter_end_to_end(tmp_path, chat_file, tiny_model_dir):
    """drafter=standalone: LoRA on the target's first layer, merged into a plain HF model that HF assisted
    generation loads as its assistant and that decodes losslessly in our engine."""
    import torch
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w3 w4 w5"}) + "\n")
    cmd = [sys.executable, str(REPO / "train" / "distill.py"), "drafter=standalone", "drafter.standalone_layers=1",
           "drafter.lora_rank=4", "experiment=smoke", f"target.name_or_path={tiny_model_dir}", "data=jsonl",
           f"data.path={chat_file}", "drafter.feature_layers=[0,1]", "validate.data=jsonl", f"validate.data_path={prompts}",
           "validate.num_prompts=1", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["lossless"] is True and results["train_steps"] == 6
    export = run_dir / "export"
    draft = AutoModelForCausalLM.from_pretrained(export).eval()
    target = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert draft.config.num_hidden_layers == 1 and not any("lora" in k for k in draft.state_dict())
    assert (export / "tokenizer.json").is_file()
    # The adapters were trained and merged: the layer differs from the target's own first layer.
    assert not torch.equal(draft.model.layers[0].self_attn.q_proj.weight, target.model.layers[0].self_attn.q_proj.weight)
    prompt = torch.tensor([[1, 4, 9, 10, 11, 2]])
    with torch.inference_mode():
        plain = target.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assisted = target.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0, assistant_model=draft)
    assert torch.equal(plain, assisted)


def test_training_target_casts_where_bf16_is_native_and_keeps_float32_elsewhere(monkeypatch, tiny_model_dir, capsys):
    import torch
    from accelerate import Accelerator

    from specdraft import pipeline
    from specdraft.io import target as target_module

    accelerator = Accelerator(cpu=True)
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(target_module, "native_bf16", lambda native=native: native)
        loaded = target_module.load_target(tiny_model_dir, "float32")
        chosen = pipeline.training_target(loaded, "auto", accelerator)
        assert chosen.dtype == expected and chosen.model.dtype == expected
        assert chosen.dtype_reason.startswith("trainer.target_dtype=auto")
        assert f"training target {str(expected).replace('torch.', '')}" in capsys.readouterr().out
    fixed = pipeline.training_target(target_module.load_target(tiny_model_dir, "float32"), "float32", accelerator)
    assert fixed.dtype == torch.float32 and fixed.dtype_reason == "trainer.target_dtype=float32 as configured"
    with pytest.raises(ValueError, match="trainer.target_dtype='fp8' is not supported"):
        pipeline.training_target(fixed, "fp8", accelerator)
