"""Attention views drawn by bertviz: neuron, head and model views (chapters 2, 4 and 7).

Each helper returns an ``IPython.display.HTML`` object, so a notebook cell that ends with it
shows the view, in Jupyter, on Colab and in the built book alike. bertviz loads require.js,
d3 and jQuery from a CDN; we put copies of them from ``tfcore/vendor`` (fetched from npm, with
their licences, by ``tools/vendor_js.py``) into each view, deflated, so a view draws with no
network at all. The built book serves them once per site instead (``book/_ext``).
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
# bertviz writes each view's data twice: as the params object, and again in a comment after it.
_PARAMS = re.compile(r"(const params = |window\.bertviz_params = )(\{.*?\})(;? *// HACK[^\n]*|;?\s*\n</script>)", re.DOTALL)
# The marker that starts the loader script in every view; the book swaps that script for one file.
LOADER_MARK = "/* tfcore.viz loader:"
_LICENCES = "require.js 2.3.6 (MIT), d3 5.7.0 (BSD-3-Clause), jQuery 2.1.0 (MIT), tiny-inflate 1.0.3 (MIT)"


def _source(name: str) -> str:
    return re.sub(r"//[#@] sourceMappingURL=\S+", "", (VENDOR / name).read_text(encoding="utf-8"))


@lru_cache(maxsize=1)
def _inflater() -> str:
    """JavaScript that defines ``window.tfcoreViz``: ``text(base64, n)`` and ``json(base64, n)``
    inflate what :func:`_deflate` wrote (``n`` is the length in bytes once inflated)."""
    return ("if (!window.tfcoreViz) { window.tfcoreViz = (function () {\n"
            "var module = {exports: {}}, exports = module.exports;\n" + _source("tiny-inflate.js") + "\n"
            "var inflate = module.exports;\n"
            "function text(b64, n) { var s = atob(b64), input = new Uint8Array(s.length), output = new Uint8Array(n);\n"
            "  for (var i = 0; i < s.length; i++) input[i] = s.charCodeAt(i);\n"
            "  inflate(input, output); return new TextDecoder().decode(output); }\n"
            "return {text: text, json: function (b64, n) { return JSON.parse(text(b64, n)); }};\n"
            "})(); }\n")


@lru_cache(maxsize=1)
def _libraries() -> str:
    """require.js, then d3 and jQuery defined as named AMD modules, once per page."""
    def module(name: str, file: str) -> str:
        return (f'define("{name}", [], function () {{ var module = {{exports: {{}}}}, exports = module.exports;\n'
                f'{_source(file)}\n;return module.exports; }});')

    return ("if (!window.__tfcore_viz_modules) {\nwindow.__tfcore_viz_modules = true;\n" + _source("require.js")
            + "\n" + module("d3", "d3.min.js") + "\n" + module("jquery", "jquery.min.js") + "\n}\n")


def _deflate(text: str) -> tuple[str, int]:
    """``text`` as UTF-8, raw-deflated (what tiny-inflate reads), in base64; and its length in bytes."""
    import base64
    import zlib

    data = text.encode("utf-8")
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    return base64.b64encode(packer.compress(data) + packer.flush()).decode("ascii"), len(data)


def _inflate(b64: str) -> str:
    """The inverse of :func:`_deflate` (the tests read the views' data with it)."""
    import base64
    import zlib

    return zlib.decompress(base64.b64decode(b64), -15).decode("utf-8")


@lru_cache(maxsize=1)
def _loader() -> str:
    """The script every view starts with: the inflater, then the libraries, deflated (about a
    third of their size), run once per page. A notebook's outputs may each be shown alone (on
    Colab every output is a page of its own), so each view carries them; the book serves them
    once (``site_script``)."""
    libraries, size = _deflate(_libraries())
    return (f"<script>{LOADER_MARK} {_LICENCES}, deflated; the built book serves them once */\n"
            + _inflater() + f'if (!window.__tfcore_viz_modules) {{ (0, eval)(tfcoreViz.text("{libraries}", {size})); }}\n'
            + "</script>\n")


def site_script() -> str:
    """What the book serves once per site in place of every view's loader: the same code, not deflated."""
    return f"/* tfcore.viz: {_LICENCES} */\n" + _inflater() + _libraries()


def self_contained(view: HTML) -> HTML:
    """A bertviz view that needs no network: its CDN loads replaced by the loader, and its data
    (bertviz writes it twice) written once, deflated."""
    html, loads = _CDN_REQUIRE.subn(lambda _: _loader(), view.data)
    html, configs = _CDN_PATHS.subn("", html)

    def deflated(match) -> str:
        data, size = _deflate(match.group(2))
        end = "\n</script>" if match.group(3).rstrip().endswith("</script>") else ""
        return f'{match.group(1)}tfcoreViz.json("{data}", {size});{end}'

    html, params = _PARAMS.subn(deflated, html, count=1)
    if loads != 1 or configs != 1 or params != 1:
        raise RuntimeError("bertviz's HTML has changed: expected one require.js tag, one require.config "
                           "and one params object")
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


def _check_sentences(sentence_a, sentence_b) -> None:
    if not isinstance(sentence_a, str) or not (sentence_b is None or isinstance(sentence_b, str)):
        raise TypeError(f"sentence_a must be a string and sentence_b a string or None, got "
                        f"{type(sentence_a).__name__} and {type(sentence_b).__name__}")


def _check_indices(name: str, values, count: int, what: str) -> None:
    """Each of ``values`` (an int or a list of ints, or None) must lie in ``0 .. count - 1``."""
    if values is None:
        return
    items = [values] if isinstance(values, int) else values
    if isinstance(values, bool) or not isinstance(items, (list, tuple, range)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count for i in items):
        raise ValueError(f"{name} must name {what} in 0..{count - 1} (this model has {count}), got {values!r}")


def attention_inputs(sentence_a: str, sentence_b: str | None = None, model=None, tokenizer=None):
    """Run a model on one sentence (or a pair) and return ``(attentions, tokens, sentence_b_start)``.

    ``model`` is a transformers BERT (default: the pretrained checkpoint) or a tfcore encoder
    that returns ``(hidden_states, attentions)`` with ``output_attentions=True``. ``attentions``
    is a tuple with one ``[1, heads, L, L]`` tensor per layer, on the CPU, as bertviz takes it
    (rounded to 4 decimals).
    """
    _check_sentences(sentence_a, sentence_b)
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
    _check_indices("layer", layer, len(attentions), "a layer")
    _check_indices("heads", heads, attentions[0].shape[1], "heads")
    return self_contained(show(attentions, tokens, sentence_b_start=b_start, layer=layer, heads=heads,
                               html_action="return"))


def model_view(sentence_a: str, sentence_b: str | None = None, model=None, tokenizer=None,
               include_layers: list[int] | None = None):
    """bertviz's model view: a thumbnail of every head in every layer."""
    from bertviz import model_view as show

    attentions, tokens, b_start = attention_inputs(sentence_a, sentence_b, model, tokenizer)
    _check_indices("include_layers", include_layers, len(attentions), "layers")
    return self_contained(show(attentions, tokens, sentence_b_start=b_start, include_layers=include_layers,
                               html_action="return"))


class _Rounded(torch.nn.Module):
    """Wraps a neuron-view model so that what bertviz stores is rounded: weights to 4 decimals,
    queries and keys (drawn as coloured cells) to 3.

    bertviz writes every query, key and weight into the page as JSON; full float precision
    triples its size and shows nothing more.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        *outputs, per_layer = self.model(*args, **kwargs)
        rounded = [{name: t.double().round(decimals=4 if name == "attn" else 3) for name, t in layer.items()}
                   for layer in per_layer]
        return (*outputs, rounded)


def neuron_view(sentence_a: str, sentence_b: str | None = None, layer: int = 0, head: int = 0,
                model=None, tokenizer=None):
    """bertviz's neuron view: the query and key vectors behind one head's weights.

    ``model`` is a :func:`neuron_model` (built from the embedded checkpoint when not given);
    ``layer`` and ``head`` must exist in it.
    """
    from bertviz.neuron_view import show

    _check_sentences(sentence_a, sentence_b)
    model = neuron_model() if model is None else model
    _check_indices("layer", layer, model.config.num_hidden_layers, "a layer")
    _check_indices("head", head, model.config.num_attention_heads, "a head")
    tokenizer = load_tokenizer() if tokenizer is None else tokenizer
    return self_contained(show(_Rounded(model), "bert", tokenizer, sentence_a, sentence_b, layer=layer,
                               head=head, html_action="return"))
