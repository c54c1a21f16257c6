"""Chapter 14's GPT in a page of the book: the files the page loads, and what it must compute.

The page ``book/gpt_in_your_browser.md`` runs the shipped GPT (``tfcore.load_book_gpt``: 168,192
parameters, 64 positions) in the reader's browser, in plain JavaScript (``book/_ext/book_gpt/``).
The book's build writes the page's data from tfcore's shipped files (``page_data_script``):

- the weights rounded to 16-bit floats, as a safetensors file (``weights_file``), in base64;
- the tokenizer: chapter 14's byte-level BPE, as its vocabulary (id -> token string) and its
  merges by rank (``tokenizer_tables``).

Both go into one script, ``book_gpt_data.js``: a page opened from disk (``file://``) may run a
script beside it, where the browser refuses ``fetch``.

The rest is the reference the browser test compares the page with (``tests/test_gpt_page.py``):
``rounded_book_gpt`` (the model with the page's 16-bit weights), ``forward_with_attention``
(logits ``[L, V]``, and each head's attention for one token, the last by default, over itself and
the tokens before it: ``[layers, heads, q + 1]`` for the token at position ``q``),
``Mulberry32`` (a 32-bit generator written in Python and in the page, so both draw the same
uniforms) and ``sample`` (tokens drawn from ``next_token_probs`` by inverse CDF with them).
"""

from __future__ import annotations

import base64
import json
from functools import lru_cache

import torch

from .generation import next_token_probs
from .gpt import GPT, positions_and_mask
from .instruct import load_book_gpt

__all__ = ["DATA_SCRIPT", "page_tokenizer", "tokenizer_tables", "weights_file", "page_data_script",
           "rounded_book_gpt", "context_window", "forward_with_attention", "Mulberry32", "sample"]

DATA_SCRIPT = "book_gpt_data.js"  # the global it sets: window.BOOK_GPT_DATA


@lru_cache(maxsize=1)
def page_tokenizer():
    """Chapter 14's byte-level BPE (the ``tokenizers`` library's, 1,000 tokens), trained on the
    book prose's training documents: the tokenizer the shipped GPT was trained with."""
    from .speculative import decoding_tokenizer_and_texts

    return decoding_tokenizer_and_texts()[0]


def tokenizer_tables(tokenizer=None) -> dict:
    """``{"vocab": [token string of id 0, 1, ...], "merges": [[left, right] by rank]}``: all a
    byte-level BPE needs to encode (chapter 24). Refuses a tokenizer this page cannot run: one with
    special tokens, a normalizer, or a pre-tokenizer other than GPT-2's byte-level pattern."""
    tokenizer = tokenizer or page_tokenizer()
    spec = json.loads(tokenizer._tokenizer.to_str())
    model, pre = spec["model"], spec.get("pre_tokenizer") or {}
    if (model.get("type") != "BPE" or spec.get("normalizer") or spec.get("added_tokens")
            or pre.get("type") != "ByteLevel" or pre.get("add_prefix_space") or not pre.get("use_regex")
            or model.get("ignore_merges") or model.get("byte_fallback")):
        raise ValueError("the page runs a plain byte-level BPE (GPT-2's pattern, no prefix space, no "
                         "normalizer, no special tokens): train one with tokenizers.ByteLevelBPETokenizer()")
    vocab = [None] * len(model["vocab"])
    for token, index in model["vocab"].items():
        vocab[index] = token
    if None in vocab:
        raise ValueError("the tokenizer's ids are not 0 .. V-1 without gaps")
    merges = [pair.split(" ") if isinstance(pair, str) else list(pair) for pair in model["merges"]]
    return {"vocab": vocab, "merges": merges}


def weights_file(model: GPT | None = None) -> bytes:
    """The model's weights in 16-bit floats, as a safetensors file (the tied output layer stored
    once, as the token embeddings); its metadata holds the config. 340,048 bytes for the book's GPT:
    336,384 of 16-bit numbers and the header."""
    from safetensors.torch import save

    if model is None:
        model, _ = load_book_gpt()
    config = {key: getattr(model.config, key) for key in (
        "vocab_size", "max_position_embeddings", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "intermediate_size", "hidden_act", "layer_norm_eps", "tie_word_embeddings")}
    if config["hidden_act"] not in ("gelu_new", "gelu_pytorch_tanh") or not config["tie_word_embeddings"]:
        raise ValueError("the page runs GPT-2's wiring: the tanh GELU and a tied output layer")
    state = {key: value.detach().to(torch.float16).contiguous()
             for key, value in model.state_dict().items() if key != "lm_head.weight"}
    return save(state, metadata={"config": json.dumps(config)})


def page_data_script(model: GPT | None = None, tokenizer=None) -> str:
    """The JavaScript file the page loads for its data: ``window.BOOK_GPT_DATA = {weights:
    <the 16-bit safetensors file in base64>, tokenizer: tokenizer_tables()}``."""
    data = {"weights": base64.b64encode(weights_file(model)).decode("ascii"),
            "tokenizer": tokenizer_tables(tokenizer)}
    return ("// Written by the book's build (tfcore.browser.page_data_script) from tfcore's shipped "
            "files.\nwindow.BOOK_GPT_DATA = " + json.dumps(data, ensure_ascii=True, separators=(",", ":")) + ";\n")


def rounded_book_gpt(dtype: torch.dtype = torch.float32) -> GPT:
    """The shipped GPT with every weight rounded to float16, as the page holds it, then held in
    ``dtype`` (float32 or float64), in eval mode."""
    model, _ = load_book_gpt()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.float16).to(parameter.dtype))
    return model.to(dtype).eval()


def context_window(ids: list[int], max_positions: int) -> list[int]:
    """What the page feeds the model: the last ``max_positions`` ids of a longer prompt (the
    earliest are dropped, from the left). Refuses an empty prompt: there is nothing to continue."""
    if len(ids) == 0:
        raise ValueError("an empty prompt has no token to predict from: type at least one character")
    return list(ids)[-max_positions:]


@torch.no_grad()
def forward_with_attention(model: GPT, ids: list[int], query: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` (at most ``model.max_positions``) -> ``(logits [L, V], attention [layers, heads, q + 1])``:
    the logits at every position, and each head's attention weights for the token at ``query`` (the
    last by default; its position ``q`` from 0) over itself and the tokens before it, in every layer.
    The same steps as ``GPT.forward``, keeping the weights."""
    if not -len(ids) <= query < len(ids):
        raise ValueError(f"query {query} is not a position of the {len(ids)} tokens")
    q = query % len(ids)
    input_ids = torch.tensor([ids])
    positions, mask = positions_and_mask(input_ids, None, model.config.vocab_size, model.max_positions)
    x = model.token_embeddings(input_ids) + model.position_embeddings(positions)
    rows = []
    for block in model.blocks:
        x, weights = block(x, mask, output_attentions=True)  # weights [1, heads, L, L]
        rows.append(weights[0, :, q, :q + 1])  # the later keys are masked: weight 0
    return model.lm_head(model.final_layer_norm(x))[0], torch.stack(rows)


class Mulberry32:
    """A 32-bit pseudo-random generator small enough to write twice, here and in the page's
    JavaScript (``mulberry32``): the same seed gives both the same uniforms in [0, 1), each a
    multiple of 2**-32. Not torch's generator, which the page cannot reproduce."""

    def __init__(self, seed: int):
        if int(seed) != seed or not 0 <= seed < 2**32:
            raise ValueError(f"the seed is a whole number in 0 .. 2**32 - 1, got {seed}")
        self.state = int(seed)

    def uniform(self) -> float:
        self.state = (self.state + 0x6D2B79F5) & 0xFFFFFFFF
        t = self.state
        t = ((t ^ (t >> 15)) * (t | 1)) & 0xFFFFFFFF
        t ^= (t + (((t ^ (t >> 7)) * (t | 61)) & 0xFFFFFFFF)) & 0xFFFFFFFF
        return ((t ^ (t >> 14)) & 0xFFFFFFFF) / 2**32


@torch.no_grad()
def sample(model: GPT, ids: list[int], max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, seed: int = 0) -> list[int]:
    """Draw ``max_new_tokens`` tokens after ``ids`` as the page does: each from ``next_token_probs``
    of the last position's logits (computed in the model's dtype, the distribution in float64), by
    inverse CDF (``tfcore.speculative.sample``) with one ``Mulberry32(seed)`` uniform per token,
    the context cut to the model's last ``max_positions`` ids. Temperature 0 takes the argmax."""
    from .speculative import sample as inverse_cdf

    generator, ids = Mulberry32(seed), list(ids)
    for _ in range(int(max_new_tokens)):
        window = context_window(ids, model.max_positions)
        logits = model(torch.tensor([window]))[0, -1].double()
        probs = next_token_probs(logits, temperature, top_k, top_p)
        ids.append(int(inverse_cdf(probs, torch.tensor([generator.uniform()], dtype=torch.float64))))
    return ids
