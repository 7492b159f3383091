"""Every conf/ YAML composes; bad input gets an error that names the problem and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from specdraft.decode.config import BenchConfig, register_configs
from specdraft.decode.proposer import load_model_proposer
from specdraft.decode.sampling import Sampler
from tests.helpers import save_tiny_model
from specdraft.io.data import is_heldout, iter_sharegpt, load_prompts, read_jsonl_prompts
from specdraft.io.target import load_target

REPO = Path(__file__).resolve().parents[1]
GROUPS = {group.name: sorted(p.stem for p in group.glob("*.yaml")) for group in (REPO / "conf").iterdir() if group.is_dir()}
BENCH_GROUPS = {g: GROUPS[g] for g in ("target", "proposer", "data", "scheduler")}


def compose_bench(overrides):
    # out_dir defaults to Hydra's run folder, which exists only under @hydra.main.
    overrides = overrides + ([] if any(o.startswith("out_dir=") for o in overrides) else ["out_dir=unused"])
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose("bench", overrides=overrides)


@pytest.mark.parametrize("group,option", [(g, o) for g, options in BENCH_GROUPS.items() for o in options])
def test_every_bench_group_option_composes(group, option):
    overrides = [f"{group}={option}"] + (["data.path=x.jsonl"] if option == "jsonl" else [])
    cfg = OmegaConf.to_object(compose_bench(overrides))
    assert isinstance(cfg, BenchConfig)
    assert getattr(cfg, group).name if group != "target" else cfg.target.name_or_path


def test_unknown_key_fails():
    with pytest.raises(ConfigCompositionException, match="bogus"):
        compose_bench(["decode.bogus=1"])


@pytest.mark.parametrize("group", ["proposer", "data"])
def test_unknown_group_option_lists_choices(group):
    with pytest.raises(ConfigCompositionException) as err:
        compose_bench([f"{group}=nonesuch"])
    message = str(err.value) + str(err.value.__cause__)
    assert "nonesuch" in message and all(option in message for option in GROUPS[group])


@pytest.mark.parametrize(
    "kwargs,match",
    [({"temperature": -0.5}, "temperature.*negative"), ({"temperature": 1, "top_p": 0.0}, r"top_p.*\(0, 1\]"),
     ({"temperature": 1, "top_p": 1.5}, r"top_p.*\(0, 1\]"), ({"top_k": -1}, "top_k")],
)
def test_bad_sampling_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampler(**kwargs)


class _Target:
    def __init__(self, path):
        loaded = load_target(path, "float32")
        self.model, self.tokenizer, self.path, self.dtype = loaded.model, loaded.tokenizer, path, loaded.dtype


def test_drafter_with_other_vocabulary_size_is_refused(tiny_model_dir, tmp_path):
    other = save_tiny_model(tmp_path / "drafter", vocab_size=80)
    with pytest.raises(ValueError, match=r"vocabulary of 80 tokens.*target .* has 64"):
        load_model_proposer(other, None, _Target(tiny_model_dir))


def test_drafter_with_other_tokenizer_is_refused(tiny_model_dir, tmp_path):
    other = save_tiny_model(tmp_path / "drafter", shift=5)  # same size, different words
    with pytest.raises(ValueError, match="different tokenizer"):
        load_model_proposer(other, None, _Target(tiny_model_dir))


def test_drafter_layer_count_checked(tiny_model_dir):
    with pytest.raises(ValueError, match="num_layers=9"):
        load_model_proposer(tiny_model_dir, 9, _Target(tiny_model_dir))


def test_prompt_longer_than_context(tiny_model_dir, tmp_path):
    from specdraft.decode.bench import run_bench

    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": " ".join(["w3"] * 600), "id": "long"}) + "\n")
    cfg = OmegaConf.to_object(
        compose_bench([f"target.name_or_path={tiny_model_dir}", "target.dtype=float32", "data=jsonl",
                       f"data.path={path}", f"out_dir={tmp_path}"])
    )
    with pytest.raises(ValueError, match="'long' has 6.. tokens.*context of 512"):
        run_bench(cfg)


def test_missing_target_folder():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_target("./no/such/model")


def test_jsonl_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_jsonl_prompts(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not JSONL"):
        read_jsonl_prompts(bad)
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="no string field 'prompt'"):
        read_jsonl_prompts(bad)
    with pytest.raises(ValueError, match="choose one of"):
        load_prompts("nonesuch")


def test_heldout_split_is_the_id_hash():
    ids = [f"id{i}" for i in range(5000)]
    share = sum(map(is_heldout, ids)) / len(ids)
    assert 0.01 < share < 0.03
    assert is_heldout("id0") == (int(__import__("hashlib").sha256(b"id0").hexdigest()[:8], 16) % 100 < 2)


def test_truncated_sharegpt_recovers_complete_records(tmp_path):
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(3)]
    text = json.dumps(records, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex('"q2"')])  # cut inside the last record, as the shipped file is
    assert [r["id"] for r in iter_sharegpt(path)] == ["r0", "r1"]


def test_packaged_prompt_sources():
    mtbench = load_prompts("mtbench")
    assert len(mtbench) == 80 and mtbench[0]["id"] == "mtbench-81"
    assert len(load_prompts("mtbench", num_prompts=5)) == 5
