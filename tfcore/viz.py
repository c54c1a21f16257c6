"""Attention views drawn by bertviz: neuron, head and model views (chapters 2, 4 and 7).

Each helper returns an ``IPython.display.HTML`` object, so a notebook cell that ends with it
shows the view, in Jupyter, on Colab and in the built book alike. bertviz loads require.js,
d3 and jQuery from a CDN; we inline copies of them from ``tfcore/vendor`` (fetched from npm,
with their licences, by ``tools/vendor_js.py``), so a view draws with no network at all.
"""

from __future__ import annotations

import json
import re
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
from IPython.display import HTML

from .checkpoint import load_pretrained, load_tokenizer


VENDOR = Path(__file__).parent / "vendor"
_CDN_REQUIRE = re.compile(r'<script src="https://cdnjs\.cloudflare\.com/ajax/libs/require\.js/[^"]*"></script>')
_CDN_PATHS = re.compile(r"require\.config\(\{\s*paths:\s*\{[^}]*\}\s*\}\);?")


@lru_cache(maxsize=1)
def _loader() -> str:
    """require.js, then d3 and jQuery defined as named AMD modules, as inline scripts."""
    def source(name: str) -> str:
        return re.sub(r"//[#@] sourceMappingURL=\S+", "", (VENDOR / name).read_text(encoding="utf-8"))

    def module(name: str, file: str) -> str:
        return (f'define("{name}", [], function () {{ var module = {{exports: {{}}}}, exports = module.exports;\n'
                f'{source(file)}\n;return module.exports; }});')

    return ("<script>/* require.js 2.3.6 (MIT), d3 5.7.0 (BSD-3-Clause), jQuery 2.1.0 (MIT), inlined by "
            "tfcore.viz */\n" + source("require.js") + "\n</script>\n<script>\nif (!window.__tfcore_viz_modules) {\n"
            "window.__tfcore_viz_modules = true;\n" + module("d3", "d3.min.js") + "\n"
            + module("jquery", "jquery.min.js") + "\n}\n</script>\n")


def self_contained(view: HTML) -> HTML:
    """A bertviz view with its CDN loads replaced by the inlined libraries."""
    html, loads = _CDN_REQUIRE.subn(lambda _: _loader(), view.data)
    html, configs = _CDN_PATHS.subn("", html)
    if loads != 1 or configs != 1:
        raise RuntimeError("bertviz's HTML has changed: expected one require.js tag and one require.config")
    return HTML(html)


def neuron_model(name: str | None = None):
    """bertviz's own legacy ``BertModel`` holding the weights of a checkpoint, in eval mode, on the CPU.

    The neuron view needs that class (it returns queries and keys as well as weights), and it
    reads only ``config.json`` plus a ``pytorch_model.bin`` state dict, so we write both to a
    temporary folder. It reports weights it could not place only at INFO level, so we check
    that every one of them was loaded, and raise otherwise.
    """
    from bertviz.transformers_neuron_view import BertModel as NeuronBertModel

    pretrained = load_pretrained(name).cpu()
    state = pretrained.state_dict()
    with tempfile.TemporaryDirectory() as folder:
        config = pretrained.config.to_dict() | {"output_attentions": True}
        (Path(folder) / "config.json").write_text(json.dumps(config))
        torch.save(state, Path(folder) / "pytorch_model.bin")
        loaded = NeuronBertModel.from_pretrained(folder, output_loading_info=True)
    model, info = loaded if loaded is not None else (None, {})
    if model is None or any(info.values()) or model.state_dict().keys() != state.keys():
        raise RuntimeError(f"bertviz's neuron-view model did not take every weight of the checkpoint: "
                           f"{info or 'no model returned'}")
    return model.eval()


def attention_inputs(sentence_a: str, sentence_b: str | None = None, model=None, tokenizer=None):
    """Run a model on one sentence (or a pair) and return ``(attentions, tokens, sentence_b_start)``.

    ``model`` is a transformers BERT (default: the pretrained checkpoint) or a tfcore encoder
    that returns ``(hidden_states, attentions)`` with ``output_attentions=True``. ``attentions``
    is a tuple with one ``[1, heads, L, L]`` tensor per layer, on the CPU, as bertviz takes it
    (rounded to 4 decimals).
    """
    model = load_pretrained() if model is None else model
    tokenizer = load_tokenizer() if tokenizer is None else tokenizer
    device = next(model.parameters()).device
    inputs = tokenizer(sentence_a, sentence_b, return_tensors="pt").to(device)
    with torch.no_grad():
        outputs = model(input_ids=inputs.input_ids, token_type_ids=inputs.token_type_ids,
                        attention_mask=inputs.attention_mask, output_attentions=True)
    attentions = outputs[1] if isinstance(outputs, tuple) else outputs.attentions
    tokens = tokenizer.convert_ids_to_tokens(inputs.input_ids[0])
    sentence_b_start = None
    if sentence_b is not None:
        sentence_b_start = int(inputs.token_type_ids[0].nonzero()[0])
    # Four decimals are far below what a drawing can show, and keep the stored page small.
    rounded = tuple(a.detach().cpu().double().round(decimals=4) for a in attentions)
    return rounded, tokens, sentence_b_start


def head_view(sentence_a: str, sentence_b: str | None = None, model=None, tokenizer=None,
              layer: int | None = None, heads: list[int] | None = None):
    """bertviz's head view: every head of one layer, as lines from each token to the ones it attends to."""
    from bertviz import head_view as show

    attentions, tokens, b_start = attention_inputs(sentence_a, sentence_b, model, tokenizer)
    return self_contained(show(attentions, tokens, sentence_b_start=b_start, layer=layer, heads=heads,
                               html_action="return"))


def model_view(sentence_a: str, sentence_b: str | None = None, model=None, tokenizer=None,
               include_layers: list[int] | None = None):
    """bertviz's model view: a thumbnail of every head in every layer."""
    from bertviz import model_view as show

    attentions, tokens, b_start = attention_inputs(sentence_a, sentence_b, model, tokenizer)
    return self_contained(show(attentions, tokens, sentence_b_start=b_start, include_layers=include_layers,
                               html_action="return"))


class _Rounded(torch.nn.Module):
    """Wraps a neuron-view model so that what bertviz stores is rounded to 4 decimals.

    bertviz writes every query, key and weight into the page as JSON; full float precision
    triples its size and shows nothing more.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        *outputs, per_layer = self.model(*args, **kwargs)
        rounded = [{name: t.double().round(decimals=4) for name, t in layer.items()} for layer in per_layer]
        return (*outputs, rounded)


def neuron_view(sentence_a: str, sentence_b: str | None = None, layer: int = 0, head: int = 0,
                model=None, tokenizer=None):
    """bertviz's neuron view: the query and key vectors behind one head's weights.

    ``model`` is a :func:`neuron_model` (built from the embedded checkpoint when not given).
    """
    from bertviz.neuron_view import show

    model = neuron_model() if model is None else model
    tokenizer = load_tokenizer() if tokenizer is None else tokenizer
    return self_contained(show(_Rounded(model), "bert", tokenizer, sentence_a, sentence_b, layer=layer,
                               head=head, html_action="return"))
