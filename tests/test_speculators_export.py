"""Export in vLLM's speculators format: loads there with every weight used, computes the same
logits / Markov bias / confidences as ours, and a checkpoint speculators writes decodes in ours."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import hf_greedy
from specdraft.models.drafter import BlockDrafter
from specdraft.models.speculators_export import build_speculators_model, export_speculators, import_speculators, vocab_mappings
from specdraft.io.target import load_target

pytest.importorskip("speculators")


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    from tests.helpers import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp("verifier"))
    return path, load_target(path, "float32")


def our_drafter(target, mode="dspark", vocab=None):
    torch.manual_seed(0)
    drafter = BlockDrafter(target.model.config, num_layers=2, num_feature_layers=2, block_size=4, mask_token_id=1,
                           mode=mode, markov_rank=8, draft_vocab_ids=vocab)
    drafter.copy_target_weights(target.model)
    with torch.no_grad():  # non-trivial head weights so the comparison means something
        if drafter.markov_head is not None:
            drafter.markov_head.markov_w1.weight.normal_()
    return drafter.eval()


@pytest.mark.parametrize("mode,vocab", [("dspark", torch.arange(0, 64, 2)), ("dflash", None)])
def test_export_loads_in_speculators_and_round_trips(verifier, tmp_path, mode, vocab):
    from speculators import SpeculatorModel

    path, target = verifier
    drafter = our_drafter(target, mode, vocab)
    out = export_speculators(drafter, (1, 2), path, target.model.config, tmp_path / "export")
    loaded = SpeculatorModel.from_pretrained(str(out))
    assert loaded.config.speculators_model_type == mode and loaded.config.aux_hidden_state_layer_ids == [1, 2]
    assert loaded.config.transformer_layer_config.num_hidden_layers == 2
    back, layers = import_speculators(out, target.model.config)
    assert layers == (1, 2)
    for key, value in drafter.state_dict().items():
        torch.testing.assert_close(back.state_dict()[key], value, msg=key)


def test_vocab_mappings_match_speculators_convention():
    t2d, d2t = vocab_mappings(torch.tensor([0, 3, 7]), 10)
    assert t2d.tolist() == [True, False, False, True, False, False, False, True, False, False]
    assert (torch.arange(3) + d2t).tolist() == [0, 3, 7]


def test_same_logits_markov_bias_and_confidence_as_speculators(verifier):
    path, target = verifier
    drafter = our_drafter(target, "dspark", torch.arange(0, 64, 2))
    theirs = build_speculators_model(drafter, (1, 2), path, target.model.config)
    theirs.load_state_dict({k: v for k, v in drafter.state_dict().items() if k != "draft_to_target"}, strict=False)
    theirs.eval()
    torch.manual_seed(7)
    length, anchors_wanted = 20, 3
    features = torch.randn(1, length, 64)
    ids = torch.randint(0, 64, (1, length))
    loss_mask = torch.ones(1, length)
    with torch.no_grad():
        hidden, logits, _, _, block_index = theirs._backbone_forward(
            features, ids, loss_mask, torch.randn(1, length, 32), torch.zeros(1, length, dtype=torch.long),
            max_anchors=anchors_wanted,
        )
        anchors = block_index[:: drafter.block_size]
        ours = drafter.forward_packed(drafter.project_context(features)[0], anchors, ids[0, anchors])
        torch.testing.assert_close(ours.logits, logits.view(anchors_wanted, 4, -1), rtol=1e-4, atol=1e-5)
        previous = ids[0, block_index].view(anchors_wanted, 4)
        bias_theirs = theirs.markov_head.block_bias(prev_token_ids=previous, hidden_states=hidden.view(anchors_wanted, 4, -1))
        torch.testing.assert_close(drafter.markov_head.block_bias(previous, ours.hidden), bias_theirs, rtol=1e-4, atol=1e-5)
        embedding = drafter.markov_head.markov_w1(previous)
        conf_theirs = theirs.confidence_head(torch.cat([hidden.view(anchors_wanted, 4, -1), embedding], -1))
        torch.testing.assert_close(drafter.confidence_head(torch.cat([ours.hidden, embedding], -1)), conf_theirs,
                                   rtol=1e-4, atol=1e-5)


def test_checkpoint_written_by_speculators_decodes_losslessly_in_ours(verifier, tmp_path):
    from speculators.models.dspark import DSparkDraftModel

    from specdraft.decode.generate import GenerateConfig, speculative_generate
    from specdraft.decode.proposer import BlockDrafterProposer
    from specdraft.decode.sampling import Sampler
    from specdraft.decode.session import CausalSession

    path, target = verifier
    import copy

    layer_config = copy.deepcopy(target.model.config)
    layer_config.num_hidden_layers = 1
    theirs = DSparkDraftModel.from_training_args(
        verifier_config=layer_config, verifier_name_or_path=path, draft_vocab_size=64, block_size=4,
        markov_rank=8, mask_token_id=1, target_layer_ids=[1, 2], draft_attn_impl="eager",
    )
    theirs.save_pretrained(str(tmp_path / "theirs"))
    drafter, layers = import_speculators(tmp_path / "theirs", target.model.config)
    proposer = BlockDrafterProposer(drafter, layers)
    session = CausalSession(target.model, layers)
    for prompt in ([3, 1, 4, 1, 5], [8, 8, 8]):
        eos = [target.tokenizer.eos_token_id]
        got = speculative_generate(session, prompt, proposer, GenerateConfig(Sampler(), 16, 4, eos_token_ids=eos))
        assert got.output_ids == hf_greedy(target.model, prompt, 16, eos=eos)


def test_export_of_a_qwen3_verifier_loads_back(tmp_path):
    """Qwen-family configs carry layer_types; the exported layer config must describe the draft layers."""
    from speculators import SpeculatorModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True)
    verifier = Qwen3ForCausalLM(config).eval()
    verifier.save_pretrained(tmp_path / "qwen3")
    drafter = BlockDrafter(config, num_layers=1, num_feature_layers=2, block_size=4, mask_token_id=1, markov_rank=8)
    drafter.copy_target_weights(verifier)
    out = export_speculators(drafter, (1, 2), str(tmp_path / "qwen3"), config, tmp_path / "export")
    loaded = SpeculatorModel.from_pretrained(str(out))
    assert loaded.config.transformer_layer_config.num_hidden_layers == 1
    back, _ = import_speculators(out, config)
    torch.testing.assert_close(back.state_dict()["fc.weight"], drafter.state_dict()["fc.weight"])


def our_eagle3(target, vocab=None, steps=3):
    from specdraft.models.eagle3 import Eagle3Drafter

    torch.manual_seed(0)
    drafter = Eagle3Drafter(target.model.config, num_feature_layers=2, steps=steps, draft_vocab_ids=vocab)
    drafter.copy_target_weights(target.model)
    with torch.no_grad():  # norms away from 1 so a swapped norm would show
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return drafter.eval()


@pytest.mark.parametrize("vocab", [torch.arange(0, 64, 2), None])
def test_eagle3_export_loads_in_speculators_with_the_same_logits(verifier, tmp_path, vocab):
    """Every weight maps by name; speculators' own TTT forward gives our logits at every step."""
    from speculators import SpeculatorModel

    path, target = verifier
    drafter = our_eagle3(target, vocab)
    out = export_speculators(drafter, (1, 2), path, target.model.config, tmp_path / "export")
    loaded = SpeculatorModel.from_pretrained(str(out))
    config = loaded.config
    assert config.speculators_model_type == "eagle3" and config.eagle_aux_hidden_state_layer_ids == [1, 2]
    assert config.transformer_layer_config.model_type == "llama" and config.transformer_layer_config.num_hidden_layers == 1
    assert config.speculators_config.proposal_methods[0].speculative_tokens == 3
    # Loading picks flex attention, which needs torch.compile; compute with their eager twin holding the loaded weights.
    theirs = build_speculators_model(drafter, (1, 2), path, target.model.config)
    theirs.load_state_dict(loaded.state_dict(), strict=True)  # same names, same shapes, nothing left over
    theirs.eval()
    captured = []
    theirs.lm_head.register_forward_hook(lambda module, args, output: captured.append(output[0]))
    torch.manual_seed(5)
    length = 10
    features, tokens = torch.randn(length, 64), torch.randint(0, 64, (length,))
    with torch.no_grad():
        ours = drafter.forward_ttt(features, tokens, 3)
        # Their row t holds the token after t (our input at t is x_{t+1}), zero-padded at the end.
        shifted = torch.cat([tokens[1:], tokens.new_zeros(1)])[None]
        theirs(features[None], shifted, torch.zeros(1, length, dtype=torch.long), ttt_steps=3)
    assert len(captured) == 3
    for step in range(3):
        torch.testing.assert_close(ours[step], captured[step], rtol=1e-4, atol=1e-5)
    back, layers = import_speculators(out, target.model.config)
    assert layers == (1, 2) and back.mode == "eagle3" and back.block_size == 3
    for key, value in drafter.state_dict().items():
        torch.testing.assert_close(back.state_dict()[key], value, msg=key)


@pytest.mark.parametrize("mode", ["dspark", "eagle3"])
def test_feature_scale_is_folded_into_the_exported_fc(verifier, tmp_path, mode):
    """A drafter trained with per-channel feature scaling exports a plain fc with the same function."""
    path, target = verifier
    drafter = our_eagle3(target) if mode == "eagle3" else our_drafter(target, mode)
    torch.manual_seed(9)
    features = torch.randn(12, 64) * torch.linspace(0.1, 50.0, 64)  # channels of very different scales
    drafter.fc.set_input_scale(features)
    assert drafter.fc.input_scale.max() / drafter.fc.input_scale.min() > 20
    out = export_speculators(drafter, (1, 2), path, target.model.config, tmp_path / "export")
    back, _ = import_speculators(out, target.model.config)
    torch.testing.assert_close(back.fc.input_scale, torch.ones(64))
    with torch.no_grad():
        torch.testing.assert_close(back.fc(features), drafter.fc(features), rtol=1e-5, atol=1e-5)
