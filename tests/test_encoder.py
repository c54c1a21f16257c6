"""The encoder pieces, the pretrained encoder against transformers' BertModel, and bad input."""

import pytest
import torch
from transformers import BertConfig

import tfcore
from tfcore import (Embeddings, FeedForward, TransformerEncoder, TransformerEncoderLayer,
                    TransformerForSequenceClassification, sinusoidal_positions)
from tfcore.checkpoint import bert_to_tfcore

PAIRS = [
    ("time flies like an arrow", "fruit flies like a banana"),
    ("the bank raised its rates", "we sat on the bank of the river and watched the boats go by"),
    ("apple", "an apple a day keeps the doctor away"),
    ("she flies to Oslo on Monday morning for a short meeting with her team", "ok"),
]


def small_config(**overrides):
    values = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                  vocab_size=100, max_position_embeddings=16, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    return BertConfig(**(values | overrides))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def models():
    tfcore.setup()
    return tfcore.load_tokenizer(), tfcore.load_pretrained(), TransformerEncoder.from_pretrained()


@pytest.mark.parametrize("batch", [PAIRS[:2], PAIRS[2:], PAIRS], ids=["2 pairs", "2 more", "4 pairs"])
def test_pretrained_encoder_matches_bert_on_padded_pairs(models, batch):
    tokenizer, bert, ours = models
    inputs = tokenizer([a for a, _ in batch], [b for _, b in batch], padding=True, return_tensors="pt")
    assert (inputs.attention_mask == 0).any()  # the batch really is padded
    with torch.no_grad():
        expected = bert(**inputs, output_attentions=True)
        hidden, attentions = ours(inputs.input_ids, inputs.attention_mask, inputs.token_type_ids,
                                  output_attentions=True)
    real = inputs.attention_mask.bool()
    torch.testing.assert_close(hidden[real], expected.last_hidden_state[real], atol=1e-5, rtol=0)
    assert len(attentions) == len(expected.attentions) == 6
    for layer, (mine, theirs) in enumerate(zip(attentions, expected.attentions)):
        rows = real[:, None, :, None].expand_as(mine)  # every key, for each real query
        torch.testing.assert_close(mine[rows], theirs[rows], atol=1e-5, rtol=0, msg=f"layer {layer}")


def test_pretrained_encoder_is_configured_as_bert(models):
    _, _, ours = models
    assert not ours.training
    assert all(not layer.norm_first for layer in ours.layers)
    assert ours.layers[0].layer_norm_1.eps == 1e-12


def test_weight_mapping_places_every_weight_and_refuses_unknown_names(models):
    _, bert, _ = models
    renamed = bert_to_tfcore(bert.state_dict())
    post_ln = BertConfig(**bert.config.to_dict(), norm_first=False)
    assert set(renamed) == set(TransformerEncoder(post_ln).state_dict())
    with pytest.raises(KeyError, match="encoder.layer.0.crossattention.weight"):
        bert_to_tfcore({"encoder.layer.0.crossattention.weight": torch.zeros(1)})


def test_feed_forward_is_position_wise():
    ff = FeedForward(small_config()).eval()
    x = torch.randn(2, 7, 64)
    each = torch.stack([ff(x[:, i]) for i in range(7)], dim=1)
    torch.testing.assert_close(ff(x), each)
    assert ff.linear_1.out_features == 256


@pytest.mark.parametrize("norm_first", [True, False])
def test_encoder_layer_shapes_and_arrangement(norm_first):
    layer = TransformerEncoderLayer(small_config(norm_first=norm_first)).eval()
    x = torch.randn(2, 5, 64)
    out, weights = layer(x, output_attentions=True)
    assert out.shape == (2, 5, 64) and weights.shape == (2, 4, 5, 5)
    if not norm_first:  # post-LN: the output is layer-normalized
        torch.testing.assert_close(out.mean(-1), torch.zeros(2, 5), atol=1e-5, rtol=0)
    else:  # pre-LN: the residual stream is the input plus the sublayers' outputs
        attended = layer.attention(layer.layer_norm_1(x))
        torch.testing.assert_close(out, x + attended + layer.feed_forward(layer.layer_norm_2(x + attended)))


def test_pre_ln_encoder_normalises_once_at_each_end_and_post_ln_as_bert():
    pre, post = TransformerEncoder(small_config()).eval(), TransformerEncoder(small_config(norm_first=False)).eval()
    # pre-LN: no LayerNorm on the embeddings (the first layer normalises its input itself), a final one
    assert pre.embeddings.layer_norm is None and isinstance(pre.final_layer_norm, torch.nn.LayerNorm)
    # post-LN (BERT): the embeddings are normalised, and the last layer already ends with a LayerNorm
    assert isinstance(post.embeddings.layer_norm, torch.nn.LayerNorm) and post.final_layer_norm is None
    ids = torch.tensor([[5, 17, 42, 8, 99, 3]])
    with torch.no_grad():
        for encoder in (pre, post):  # either way the output of the stack is layer-normalised
            out = encoder(ids)
            torch.testing.assert_close(out.mean(-1), torch.zeros(1, 6), atol=1e-5, rtol=0)
            torch.testing.assert_close(out.var(-1, unbiased=False), torch.ones(1, 6), atol=1e-3, rtol=0)
        stream = pre.embeddings(ids)
        for layer in pre.layers:
            stream = layer(stream)
        torch.testing.assert_close(pre(ids), pre.final_layer_norm(stream))


def test_encoder_shapes_with_bert_base_defaults():
    encoder = TransformerEncoder(BertConfig(num_hidden_layers=2)).eval()
    ids = torch.tensor([[2051, 10029, 2066, 2019, 8612]])
    assert encoder(ids).shape == (1, 5, 768)
    hidden, attentions = encoder(ids, output_attentions=True)
    assert len(attentions) == 2 and attentions[0].shape == (1, 12, 5, 5)


def test_without_positions_order_does_not_matter_and_with_them_it_does():
    config = small_config()
    layer = TransformerEncoderLayer(config).eval()
    embeddings = Embeddings(config).eval()
    ids = torch.tensor([[5, 17, 42, 8, 99]])
    perm = torch.tensor([3, 0, 4, 1, 2])
    tokens = embeddings.token_embeddings(ids)
    torch.testing.assert_close(layer(tokens)[:, perm], layer(tokens[:, perm]))
    assert not torch.allclose(layer(embeddings(ids))[:, perm], layer(embeddings(ids[:, perm])), atol=1e-3)


def test_sinusoidal_positions_formula_and_shift_property():
    pe = sinusoidal_positions(50, 16).double()
    assert pe.shape == (50, 16)
    assert pe[0, 0::2].abs().max() == 0 and (pe[0, 1::2] == 1).all()
    torch.testing.assert_close(pe[7, 2].item(), torch.sin(torch.tensor(7 / 10000 ** (2 / 16))).item(),
                               atol=1e-6, rtol=0)
    k = 3  # PE(pos + k) is PE(pos) rotated, pair by pair, by an angle that depends only on k
    frequency = 1 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    sin, cos = pe[k, 0::2], pe[k, 1::2]
    shifted = torch.empty_like(pe)
    shifted[:, 0::2] = pe[:, 0::2] * cos + pe[:, 1::2] * sin
    shifted[:, 1::2] = pe[:, 1::2] * cos - pe[:, 0::2] * sin
    torch.testing.assert_close(shifted[:-k], pe[k:], atol=1e-5, rtol=0)
    assert torch.allclose(sin, torch.sin(k * frequency), atol=1e-6)


def test_classifier_head_shape():
    config = BertConfig(num_hidden_layers=1, num_labels=3)
    model = TransformerForSequenceClassification(config).eval()
    assert model(torch.tensor([[2051, 10029, 2066, 2019, 8612]])).shape == (1, 3)


@pytest.mark.parametrize("ids, error, message", [
    (torch.tensor([[1, 2, 100]]), ValueError, r"\[0, 100\) \(vocab_size\), got values from 1 to 100"),
    (torch.tensor([[-1, 2]]), ValueError, r"\[0, 100\)"),
    (torch.zeros(1, 17, dtype=torch.long), ValueError, r"17 tokens but max_position_embeddings is 16.*truncation=True"),
    (torch.tensor([[1.0, 2.0]]), TypeError, r"integer token ids.*torch.float32"),
    (torch.tensor([1, 2, 3]), ValueError, r"batch of shape \[B, L\], got shape \(3,\).*unsqueeze\(0\)"),
    ([[1, 2, 3]], TypeError, r"must be a torch.Tensor"),
])
def test_bad_input_ids_raise_a_clear_error_before_torch(ids, error, message):
    encoder = TransformerEncoder(small_config())
    with pytest.raises(error, match=message):
        encoder(ids)


def test_bad_token_types_and_mask_raise_a_clear_error():
    encoder = TransformerEncoder(small_config())
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"token_type_ids .* values in \[0, 2\)"):
        encoder(ids, token_type_ids=torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of input_ids \(1, 3\), got \(1, 4\)"):
        encoder(ids, attention_mask=torch.ones(1, 4))
