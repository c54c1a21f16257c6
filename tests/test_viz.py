"""tfcore.viz: bertviz's neuron-view model holds exactly the checkpoint, and each view carries the
model's real attention. (Whether the views draw is the built book's and the browser's test.)"""

import re

import pytest
import torch

import tfcore
import tfcore.viz as viz
from views import views

A, B = "time flies like an arrow", "fruit flies like a banana"


@pytest.fixture(scope="module")
def pretrained():
    tfcore.setup()
    return tfcore.load_pretrained(), tfcore.load_tokenizer()


@pytest.fixture(scope="module")
def neuron_model():
    return viz.neuron_model()


def test_neuron_model_holds_every_weight_of_the_checkpoint(pretrained, neuron_model):
    expected = pretrained[0].state_dict()
    loaded = neuron_model.state_dict()
    assert loaded.keys() == expected.keys() and len(loaded) == 103
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_neuron_model_attention_matches_transformers(pretrained, neuron_model):
    model, tokenizer = pretrained
    inputs = tokenizer(A, B, return_tensors="pt")
    with torch.no_grad():
        expected = model(**inputs, output_attentions=True).attentions
        legacy = neuron_model(inputs.input_ids, token_type_ids=inputs.token_type_ids)[-1]
    assert len(legacy) == len(expected) == 6
    for layer, (ours, theirs) in enumerate(zip(legacy, expected)):
        torch.testing.assert_close(ours["attn"], theirs, atol=1e-5, rtol=0, msg=f"layer {layer}")


def test_neuron_model_refuses_a_checkpoint_with_a_missing_weight(monkeypatch):
    real_save = torch.save

    def save_without_one_weight(state, path):
        state = dict(state)
        state.pop("encoder.layer.3.attention.self.key.weight")
        real_save(state, path)

    monkeypatch.setattr(viz.torch, "save", save_without_one_weight)
    with pytest.raises(RuntimeError, match="encoder.layer.3.attention.self.key.weight"):
        viz.neuron_model()


def test_attention_inputs_for_a_sentence_pair(pretrained):
    model, tokenizer = pretrained
    attentions, tokens, b_start = viz.attention_inputs(A, B, model, tokenizer)
    assert tokens[b_start - 1] == "[SEP]" and tokens[b_start:] == ["fruit", "flies", "like", "a", "banana", "[SEP]"]
    with torch.no_grad():
        expected = model(**tokenizer(A, B, return_tensors="pt"), output_attentions=True).attentions
    for ours, theirs in zip(attentions, expected):
        torch.testing.assert_close(ours.float(), theirs, atol=1e-4, rtol=0)


def test_attention_inputs_accept_a_model_returning_a_tuple(pretrained):
    """tfcore's own encoder returns (hidden_states, attentions); the views take it too."""
    model, tokenizer = pretrained

    class TupleModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = model

        def forward(self, input_ids, token_type_ids, attention_mask, output_attentions):
            out = self.bert(input_ids=input_ids, token_type_ids=token_type_ids,
                            attention_mask=attention_mask, output_attentions=output_attentions)
            return out.last_hidden_state, out.attentions

    attentions, tokens, b_start = viz.attention_inputs(A, None, TupleModel(), tokenizer)
    assert len(attentions) == 6 and attentions[0].shape == (1, 12, 7, 7) and b_start is None


@pytest.mark.parametrize("kind", ["head", "model"])
def test_head_and_model_views_carry_the_model_attention(pretrained, kind):
    model, tokenizer = pretrained
    html = getattr(viz, f"{kind}_view")(A, B, model=model, tokenizer=tokenizer).data
    [params] = views(html)
    assert params["kind"] == kind
    attentions, tokens, _ = viz.attention_inputs(A, B, model, tokenizer)
    everything = params["attention"][0]
    assert everything["left_text"] == tokens
    # bertviz stores [layers, heads, L, L] for batch item 0
    assert torch.tensor(everything["attn"], dtype=torch.float64).allclose(torch.stack([a[0] for a in attentions]), atol=1e-6)


def test_neuron_view_carries_queries_keys_and_attention(pretrained, neuron_model):
    html = viz.neuron_view(A, layer=2, head=5, model=neuron_model).data
    [params] = views(html)
    assert params["kind"] == "neuron" and (params["layer"], params["head"]) == (2, 5)
    data = params["attention"]["all"]
    assert data["left_text"] == ["[CLS]", "time", "flies", "like", "an", "arrow", "[SEP]"]
    assert len(data["attn"]) == 6 and len(data["queries"]) == 6 and len(data["keys"]) == 6
    assert torch.tensor(data["queries"][2]).shape == (12, 7, 32)


def test_views_finder_ignores_a_view_without_its_container(pretrained):
    model, tokenizer = pretrained
    html = viz.head_view(A, model=model, tokenizer=tokenizer).data
    without_div = html.replace("<div id=", "<div data-id=", 1)
    assert len(views(html)) == 1 and views(without_div) == []


@pytest.mark.parametrize("kind", ["head", "model", "neuron"])
def test_views_need_no_network(pretrained, neuron_model, kind):
    model, tokenizer = pretrained
    if kind == "neuron":
        html = viz.neuron_view(A, model=neuron_model, tokenizer=tokenizer).data
    else:
        html = getattr(viz, f"{kind}_view")(A, B, model=model, tokenizer=tokenizer).data
    assert "cdnjs" not in html and "http" not in html.split(viz.LOADER_MARK)[0]
    assert html.count(viz.LOADER_MARK) == 1
    assert viz._CDN_PATHS.search(html) is None  # bertviz's CDN paths for d3 and jQuery are gone
    # the libraries travel deflated: the loader inflates exactly the site script's libraries
    libraries = re.search(r'tfcoreViz\.text\("([A-Za-z0-9+/=]+)", (\d+)\)', html)
    assert viz._inflate(libraries.group(1)) == viz._libraries()
    inflated = viz._inflate(libraries.group(1))
    assert inflated.count("RequireJS 2.3.6") == 1 and 'define("d3"' in inflated and 'define("jquery"' in inflated
    assert len(libraries.group(2)) and int(libraries.group(2)) == len(inflated.encode())


def test_a_view_is_a_fraction_of_what_bertviz_writes(pretrained):
    """bertviz writes the data twice and its libraries come from a CDN; ours carry the libraries
    and the data once, deflated: a view with a sentence pair is under 300 KB."""
    model, tokenizer = pretrained
    html = viz.head_view(A, B, model=model, tokenizer=tokenizer).data
    assert len(html) < 300_000, len(html)
    assert "// HACK" not in html  # the second copy of the data is gone
    site = viz.site_script()
    assert viz._inflater() in site and viz._libraries() in site and viz.LOADER_MARK not in site


def test_views_finder_reads_bertviz_own_and_deflated_data(pretrained):
    model, tokenizer = pretrained
    from bertviz import head_view

    attentions, tokens, _ = viz.attention_inputs(A, model=model, tokenizer=tokenizer)
    raw = head_view(attentions, tokens, html_action="return").data
    [plain] = views(raw)
    [deflated] = views(viz.self_contained(viz.HTML(raw)).data)
    assert plain == deflated


def test_self_contained_refuses_unknown_bertviz_html():
    with pytest.raises(RuntimeError, match="bertviz's HTML has changed"):
        viz.self_contained(viz.HTML("<div>no loader here</div>"))
    cdn = '<script src="https://cdnjs.cloudflare.com/ajax/libs/require.js/2.3.6/require.min.js"></script>'
    with pytest.raises(RuntimeError, match="one params object"):  # the data where we do not expect it
        viz.self_contained(viz.HTML(cdn + "require.config({paths: {d3: 'x'}});\nvar data = {};"))
