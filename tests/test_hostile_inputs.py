"""Hostile inputs to the drafter loader: each is refused with one clear error naming the file and what to do, and
nothing is unpickled. (A truncated model.safetensors used to end in a raw SafetensorError from transformers.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdraft.decode.config import ProposerConfig
from specdraft.decode.factory import make_proposer
from specdraft.io.target import load_target
from tests.helpers import save_tiny_model


@pytest.fixture()
def export(tiny_export):
    return Path(tiny_export)


def load(export_dir: Path, model_dir: str):
    target = load_target(model_dir, "float32")
    return make_proposer(ProposerConfig(name="drafter", path=str(export_dir)), target, model_dir)[0]


def edit_config(export_dir: Path, change) -> None:
    config = json.loads((export_dir / "config.json").read_text())
    change(config)
    (export_dir / "config.json").write_text(json.dumps(config))


def test_the_untouched_export_loads(export, tiny_model_dir):
    assert load(export, tiny_model_dir).feature_layers == (1, 2)


@pytest.mark.parametrize("damage", ["truncated", "header_only", "garbage", "empty"])
def test_a_damaged_safetensors_file_is_named_with_the_fix(export, tiny_model_dir, damage):
    weights = export / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[: len(data) // 2], "header_only": data[:8], "garbage": b"\x07" * 64,
                         "empty": b""}[damage])
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated or corrupt .*copy or export it again"):
        load(export, tiny_model_dir)


def test_pickle_weights_are_refused_and_never_unpickled(export, tiny_model_dir, monkeypatch):
    state = {"w": torch.zeros(2)}
    (export / "model.safetensors").unlink()
    torch.save(state, export / "pytorch_model.bin")
    unpickled = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: unpickled.append(a) or state)
    with pytest.raises(ValueError, match=r"holds pickle weights \(pytorch_model\.bin\).*never unpickles"):
        load(export, tiny_model_dir)
    assert not unpickled


def test_missing_weights_say_so(export, tiny_model_dir):
    (export / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="has no model.safetensors; export the drafter again"):
        load(export, tiny_model_dir)


def test_a_config_that_lies_about_shapes_is_refused(export, tiny_model_dir):
    edit_config(export, lambda c: c["transformer_layer_config"].update(
        intermediate_size=2 * c["transformer_layer_config"]["intermediate_size"]))
    with pytest.raises(ValueError, match="is corrupt or incomplete"):
        load(export, tiny_model_dir)


@pytest.mark.parametrize("layers, match", [([1, 7], r"layers \[7\] do not exist"),
                                           ([0, 1], r"trained on layers \[1, 2\] \(specdraft.json\)")])
def test_a_config_that_lies_about_layer_ids_is_refused(export, tiny_model_dir, layers, match):
    """Read from the wrong layers a drafter still runs and only its acceptance collapses: refuse it up front."""
    edit_config(export, lambda c: c.update(aux_hidden_state_layer_ids=layers))
    with pytest.raises(ValueError, match=match):
        load(export, tiny_model_dir)


def test_a_folder_that_is_not_an_export_is_named(tmp_path, tiny_model_dir):
    with pytest.raises(FileNotFoundError, match="is not a drafter export"):
        load(tmp_path, tiny_model_dir)


def test_a_disk_that_fills_during_a_checkpoint_keeps_the_last_one_and_resumes(tmp_path, monkeypatch):
    """A write that fails mid-checkpoint (ENOSPC from the file write, after the weights file) leaves no part of it,
    says what is kept, and the same command goes on from there once there is room."""
    import errno

    from specdraft.train.checkpoint import CheckpointWriteError, latest_checkpoint
    from tests.helpers import run, tiny_llama

    target = tiny_llama(0)
    _, reference = run(target, tmp_path / "reference")
    real = Path.write_bytes

    def full_disk(self, data):  # the disk fills while step 4's trainer state is written: half of it lands
        if self.name == "trainer_state.pt" and self.parent.name.startswith(".step-0000004-"):
            real(self, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"step-0000004 could not be written .*No space left on device.*"
                                                   r"step-0000002, is kept.*trainer.resume=auto"):
        run(target, tmp_path / "run")
    assert latest_checkpoint(tmp_path / "run").name == "step-0000002"
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-0000002"]  # nothing partial
    monkeypatch.setattr(Path, "write_bytes", real)
    _, resumed = run(target, tmp_path / "run")
    assert resumed["loss_history"] == reference["loss_history"][2:]


@pytest.mark.parametrize("kind", ["under_a_file", "read_only"])
def test_a_run_folder_that_cannot_be_written_is_refused_before_training(tmp_path, kind):
    import os

    from specdraft.train.checkpoint import CheckpointWriteError
    from tests.helpers import run, tiny_llama

    if kind == "under_a_file":  # a path through a file: no user can write there, root included
        (tmp_path / "a-file").write_text("")
        folder = tmp_path / "a-file" / "run"
    else:
        folder = tmp_path / "read-only"
        folder.mkdir()
        os.chmod(folder, 0o500)
        if os.access(folder, os.W_OK):
            os.chmod(folder, 0o700)
            pytest.skip("root writes anywhere: a read-only folder cannot be made (the under_a_file case runs)")
    try:
        with pytest.raises(CheckpointWriteError, match="cannot take checkpoints .*hydra.run.dir"):
            run(tiny_llama(0), folder)
    finally:
        if kind == "read_only":
            os.chmod(folder, 0o700)


def test_sharded_index_rules_follow_transformers(export, tiny_model_dir):
    """The single file wins over an index (transformers' order); a broken or empty index without it is named;
    trainer files beside the weights are not taken for pickle weights."""
    (export / "model.safetensors.index.json").write_text("[1, 2]")  # stale and malformed, but the single file is there
    (export / "training_args.bin").write_bytes(b"\x80\x04not read")
    assert load(export, tiny_model_dir).feature_layers == (1, 2)
    weights = (export / "model.safetensors").read_bytes()
    (export / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="is not a safetensors index"):
        load(export, tiny_model_dir)
    (export / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(ValueError, match="lists no weight files"):
        load(export, tiny_model_dir)
    (export / "shard-1.safetensors").write_bytes(weights)
    (export / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "shard-1.safetensors",
                                                                                   "y": "shard-2.safetensors"}}))
    with pytest.raises(ValueError, match="has no shard-2.safetensors"):
        load(export, tiny_model_dir)


# --- A drafter in another project's layout, and our own folders passed where another kind is expected ---

def external_layout(export: Path, folder: Path, layout: str, layers=(1, 2)) -> Path:
    """Our export's weights under the config another project writes (weight names already agree: `layers.*`, `fc`,
    `hidden_norm`, `norm`), with our feature layers in that project's 0-based ids."""
    ours = json.loads((export / "config.json").read_text())
    body = {**ours["transformer_layer_config"], "num_target_layers": 2}
    ids = [i - 1 for i in layers]
    config = {
        "deepspec": {**body, "architectures": ["Qwen3DSparkModel"], "target_layer_ids": ids, "block_size": 3,
                     "mask_token_id": 0, "num_anchors": 8, "markov_rank": 8, "markov_head_type": "vanilla",
                     "enable_confidence_head": True, "confidence_head_with_markov": True},
        "zlab_dflash": {**body, "architectures": ["DFlashDraftModel"], "block_size": 3,
                        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
                        "dflash_config": {"mask_token_id": 0, "target_layer_ids": ids}},
        "eagle_repo": {**body, "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "draft_vocab_size": 64},
    }[layout]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes((export / "model.safetensors").read_bytes())
    return folder


@pytest.mark.parametrize("layout, match", [
    ("deepspec", r"is a DeepSpec DSpark checkpoint .*0-based target_layer_ids \[0, 1\].*speculators_model_type, "
                 r"aux_hidden_state_layer_ids = DeepSpec's ids \+ 1 = \[1, 2\]\)\. Convert it: `speculators convert "
                 r"\S+ --algorithm dspark --verifier \S+ --output-path OUT`.*then proposer\.path=OUT"),
    ("zlab_dflash", r"is a z-lab DFlash checkpoint \(config\.json: dflash_config, 0-based target_layer_ids \[0, 1\]\).*"
                    r"sample_from_anchor=false.*`speculators convert \S+ --algorithm dflash --verifier \S+ "
                    r"--output-path OUT` makes a speculators checkpoint to serve with vLLM; to decode here, distill"),
    ("eagle_repo", r"is an EAGLE-3 checkpoint .*LlamaForCausalLMEagle3.*`speculators convert \S+ --algorithm eagle3 "
                   r"--verifier \S+ --output-path OUT`, then proposer\.path=OUT"),
])
def test_a_drafter_in_another_projects_layout_is_named_with_its_converter(export, tmp_path, tiny_model_dir, layout, match):
    """Loaded as speculators, a DeepSpec or z-lab drafter would read every feature one layer too low (their ids are
    0-based) and only its acceptance would collapse; it used to end in a target mismatch naming widths of None.
    Refused from proposer.path and from the library's load_drafter, whose target comes from the folder."""
    from specdraft.api import load_drafter

    folder = external_layout(export, tmp_path / layout, layout)
    with pytest.raises(ValueError, match=match):
        load(folder, tiny_model_dir)
    with pytest.raises(ValueError, match=match):
        load_drafter(str(folder))


def test_a_zlab_dflash_converted_by_speculators_is_refused_as_a_variant_not_as_damage(tmp_path, tiny_model_dir):
    """The converter the z-lab error names makes a well-formed speculators DFlash that drafts after the anchor;
    our decoder does not run that variant and says so (it used to call the checkpoint corrupt)."""
    from speculators.convert import convert_model

    from specdraft.models.drafter import BlockDrafter
    from specdraft.models.export import save_drafter

    target = load_target(tiny_model_dir, "float32")
    drafter = BlockDrafter(target.model.config, 1, 1, block_size=3, mask_token_id=0, mode="dflash")
    ours = save_drafter(tmp_path / "ours", drafter, (1,), target.model, tiny_model_dir, tiny_model_dir)
    zlab = external_layout(ours, tmp_path / "zlab", "zlab_dflash", layers=(1,))
    convert_model(model=str(zlab), verifier=tiny_model_dir, algorithm="dflash", output_path=str(tmp_path / "converted"))
    config = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert config["aux_hidden_state_layer_ids"] == [1]  # z-lab's 0 shifted to HF's hidden_states index
    with pytest.raises(ValueError, match=r"uses sample_from_anchor=false .*z-lab's DFlash.*specdraft decodes only "
                                         r"drafters that sample from the anchor.*serve this one with vLLM") as caught:
        load(tmp_path / "converted", tiny_model_dir)
    assert "corrupt" not in str(caught.value)


def fake_run(folder: Path, with_export: Path | None = None) -> Path:
    """A distill run folder with one complete checkpoint (the real checkpoint writer) and, optionally, an export."""
    import shutil

    from specdraft.train.checkpoint import checkpoint_path, write_checkpoint_files

    step = checkpoint_path(folder, 2)
    step.mkdir(parents=True)
    write_checkpoint_files(step, 2, {"fc.weight": torch.zeros(2, 2)}, {"step": 2}, {})
    if with_export is not None:
        shutil.copytree(with_export, folder / "export")
    return folder


def test_our_own_folders_passed_as_proposer_path_say_which_folder_to_pass(export, tmp_path, tiny_model_dir):
    run_dir = fake_run(tmp_path / "run", with_export=export)
    for folder, what in ((run_dir, "a distill run folder"),
                         (run_dir / "checkpoints" / "step-0000002", r"a training checkpoint \(weights \+ trainer state\)")):
        with pytest.raises(FileNotFoundError, match=rf"is not a drafter export but {what}; decode with the run's export: "
                                                    r"proposer\.path=\S+/run/export$"):
            load(folder, tiny_model_dir)
    unfinished = fake_run(tmp_path / "unfinished")
    with pytest.raises(FileNotFoundError, match=r"step-0000002 is not a drafter export but a training checkpoint .*; the "
                                                r"run has no export yet .*: the same distill command with "
                                                r"hydra\.run\.dir=\S+/unfinished goes on from the newest checkpoint and exports"):
        load(unfinished / "checkpoints" / "step-0000002", tiny_model_dir)
    standalone = Path(save_tiny_model(tmp_path / "standalone"))
    with pytest.raises(ValueError, match=r"is a standalone drafter \(a plain llama causal LM\), not a speculators drafter "
                                         r"export: decode it with proposer=model proposer\.path="):
        load(standalone, tiny_model_dir)


def test_the_reverse_a_drafter_where_a_checkpoint_or_a_causal_lm_is_expected(export, tmp_path, tiny_model_dir):
    """trainer.resume=PATH takes our training checkpoints and proposer=model a plain causal LM: an export, a run
    folder or another project's drafter there is named with what to pass instead. (proposer=model used to build a
    DeepSpec or z-lab config, which names a plain model_type, into a randomly initialised causal LM.)"""
    from specdraft.train.checkpoint import load_checkpoint

    with pytest.raises(FileNotFoundError, match=r"is not a specdraft checkpoint \(no meta\.json\) but a drafter export, which "
                                                r"keeps no optimizer, schedule or data position and so cannot be resumed: pass "
                                                r"trainer\.resume=RUN/checkpoints/step-N of the run that made it; to decode "
                                                r"with it, proposer\.path="):
        load_checkpoint(export, None)
    run_dir = fake_run(tmp_path / "run", with_export=export)
    with pytest.raises(FileNotFoundError, match=r"but a drafter export.*pass trainer\.resume=\S+/run/checkpoints/step-0000002;"):
        load_checkpoint(run_dir / "export", None)
    with pytest.raises(FileNotFoundError, match=r"is not a specdraft checkpoint \(no meta\.json\) but a distill run folder: "
                                                r"resume it with hydra\.run\.dir=\S+ trainer\.resume=auto, or pass "
                                                r"trainer\.resume=\S+/checkpoints/step-0000002$"):
        load_checkpoint(run_dir, None)
    deepspec = external_layout(export, tmp_path / "deepspec", "deepspec")
    with pytest.raises(FileNotFoundError, match="but a DeepSpec DSpark checkpoint from another project; training resumes "
                                                "only from its own checkpoints"):
        load_checkpoint(deepspec, None)

    target = load_target(tiny_model_dir, "float32")
    as_model = lambda path: make_proposer(ProposerConfig(name="model", path=str(path)), target, tiny_model_dir)  # noqa: E731
    with pytest.raises(ValueError, match=r"proposer=model takes a standalone causal LM, but \S+ is a speculators drafter "
                                         r"export: decode it with proposer=drafter proposer\.path="):
        as_model(export)
    with pytest.raises(ValueError, match="but .* is a DeepSpec DSpark drafter checkpoint: decode it with proposer=drafter"):
        as_model(deepspec)
    with pytest.raises(ValueError, match="but .* is a training run folder: pass the run's export, RUN/export"):
        as_model(run_dir)


# --- Prompts of only special tokens: a normal prompt, decoded as HF generate decodes it; an empty one is refused ---
# The tiny tokenizer's specials: 0 <unk>, 1 <|im_start|>, 2 <|im_end|> (EOS); it adds no BOS.
SPECIAL_ONLY = [[2], [1], [0], [1, 2], [2, 2, 2, 2]]


@pytest.fixture()
def decoder(tiny_model_dir, tiny_export):
    from specdraft.decode.decoder import SpecDecoder

    return SpecDecoder.from_pretrained(tiny_model_dir, drafter=str(tiny_export), dtype="float32")


def test_special_token_prompts_decode_as_hf_generate_through_the_library(decoder):
    from specdraft.decode.decoder import SamplingParams
    from tests.helpers import hf_greedy

    eos = decoder.target.tokenizer.eos_token_id
    for ids in SPECIAL_ONLY:
        [out] = decoder.generate([ids], SamplingParams(max_new_tokens=12))
        assert out.token_ids == hf_greedy(decoder.target.model, ids, 12, [eos]), ids
    with pytest.raises(ValueError, match="the prompt is empty: give a string, messages, or at least one token id"):
        decoder.generate([])
    with pytest.raises(ValueError, match=r"token ids outside the target's vocabulary \(0\.\.63\)"):
        decoder.generate([[5, 64]])  # used to end in the embedding's IndexError


def test_special_token_prompts_from_a_jsonl_file_decode_and_an_empty_one_is_named(decoder, tmp_path):
    from specdraft.io.data import chat_prompt_ids, load_prompts
    from tests.helpers import hf_greedy

    path = tmp_path / "specials.jsonl"
    path.write_text('{"prompt": "<|im_end|>"}\n{"prompt": "<|im_start|> <|im_end|> <|im_start|>"}\n')
    tokenizer, eos = decoder.target.tokenizer, decoder.target.tokenizer.eos_token_id
    for item in load_prompts("jsonl", str(path)):
        ids = chat_prompt_ids(tokenizer, item["prompt"])  # what the benchmark feeds
        assert decoder.generate(item["prompt"])[0].token_ids == hf_greedy(decoder.target.model, ids, 128, [eos])
    for blank in ('""', '"  \\n "'):
        path.write_text(f'{{"prompt": "w1"}}\n{{"prompt": {blank}}}\n')
        with pytest.raises(ValueError, match=r"specials\.jsonl:2 has an empty 'prompt'; give it the text to send, or "
                                             "delete the line"):
            load_prompts("jsonl", str(path))


def test_special_token_prompts_through_the_server(tiny_model_dir, tiny_export):
    """/v1/completions takes raw text: "<|im_end|>" is the one token 2 and decodes as HF generate of [2] does;
    an empty prompt is a clean 400 and the server keeps serving."""
    import httpx

    from tests.helpers import hf_greedy, serving

    target = load_target(tiny_model_dir, "float32")
    tokenizer, eos = target.tokenizer, target.tokenizer.eos_token_id
    with serving(tiny_model_dir, proposer=ProposerConfig(name="drafter", path=str(tiny_export))) as (base, _):
        def complete(prompt):
            return httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                                                "temperature": 0}, timeout=60)

        for prompt in ("<|im_end|>", "<|im_start|>", "<|im_start|> <|im_end|>", [2, 2, 2, 2]):
            ids = prompt if isinstance(prompt, list) else tokenizer(prompt)["input_ids"]
            expected = hf_greedy(target.model, ids, 12, [eos])
            answer = complete(prompt).json()
            assert answer["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True), prompt
            assert answer["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(expected),
                                       "total_tokens": len(ids) + len(expected)}
            assert answer["choices"][0]["finish_reason"] == ("stop" if expected[-1] == eos else "length")
        for empty in ("", [], [""]):
            answer = complete(empty)
            assert answer.status_code == 400, empty
            assert answer.json()["error"]["message"].startswith("'prompt' is required: a non-empty string, or a list of "
                                                                "token ids")
        assert complete("w1 w2").status_code == 200


# --- Empty or malformed data files: one error naming the file (and line) and the fix, and no record dropped ---

@pytest.mark.parametrize("content, match", [
    ("", r"holds no prompts \(it is empty\)"),
    ("\n  \n", r"holds no prompts \(it is empty\)"),
    ('{"prompt": "w1"}\n{"prompt": "w2"\n', r"data\.jsonl:2 is not JSONL"),
    ('{"prompt": "w1"}\n["w2"]\n', r"data\.jsonl:2 has no string field 'prompt'"),
    ('{"text": "w1"}\n', r"data\.jsonl:1 has no string field 'prompt'"),
    ('{"prompt": "w1", "response": 3}\n', r"data\.jsonl:1 has a 'response' that is not a string"),
])
def test_a_bad_jsonl_file_is_named_for_benchmark_and_training(tmp_path, content, match):
    """The benchmark's prompts and training's conversations read one way (training used to end in datasets'
    StopIteration, DatasetGenerationError or a KeyError 'prompt')."""
    from specdraft.io.data import load_prompts
    from specdraft.train.config import TrainDataConfig
    from specdraft.train.distill import conversations
    from tests.helpers import tiny_tokenizer

    path = tmp_path / "data.jsonl"
    path.write_text(content)
    if "response" not in content:
        with pytest.raises(ValueError, match=match):
            load_prompts("jsonl", str(path))
    with pytest.raises(ValueError, match=match):
        conversations(TrainDataConfig(name="jsonl", path=str(path)), tiny_tokenizer())


def test_training_jsonl_keeps_every_record_and_its_ids(tmp_path):
    from specdraft.train.config import TrainDataConfig
    from specdraft.train.distill import conversations
    from tests.helpers import tiny_tokenizer

    path = tmp_path / "chat.jsonl"
    path.write_text('{"prompt": "w1", "response": "w2"}\n\n{"id": "x", "prompt": "w3"}\n{"prompt": "w4 w5"}\n')
    assert conversations(TrainDataConfig(name="jsonl", path=str(path)), tiny_tokenizer()) == [
        {"id": "0", "prompt": "w1", "response": "w2"}, {"id": "x", "prompt": "w3", "response": ""},
        {"id": "2", "prompt": "w4 w5", "response": ""}]  # ids by record index, as the datasets reader gave them


@pytest.mark.parametrize("content, match", [
    ("", r"is not a ShareGPT file: it is empty, where a JSON array of .* records belongs \(JSONL training data: data=jsonl\)"),
    ('{"id": "a", "conversations": []}\n', r"is not a ShareGPT file: it starts with '\{\"id\": \"a\", .*data=jsonl"),
    ("[]", r"holds no training conversation \(a record whose first turn is from human and the second from gpt"),
    ('[{"id": "a", "conversations": [{"from": "gpt", "value": "w1"}]}]', r"holds no training conversation"),
    ('[{"id": "a", "conversations": []}, {"id": "b", conversations: []}, {"id": "c"}]',
     r"sharegpt\.json is not valid JSON at line 1 column 48 .*the records from there on would be lost"),
    ('["just text"]', r"the record at character 1 is not a ShareGPT record"),
])
def test_a_bad_sharegpt_file_is_named(tmp_path, content, match):
    """An empty file used to end in str.index's 'substring not found'; a JSONL file was read from its first '[' on,
    its turns taken for records; a syntax error mid-file silently ended the data there, as a cut file does."""
    from specdraft.io.data import sharegpt_training_pairs

    path = tmp_path / "sharegpt.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        list(sharegpt_training_pairs(path))

