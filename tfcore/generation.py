"""Generation for decoder-only models: greedy decoding and sampling, with or without a KV cache
(chapters 14 and 15).

A model here is anything called as ``model(input_ids [B, L], cache=None)`` that returns logits
``[B, L, vocab]`` and has ``new_cache()`` and ``max_positions``: ``tfcore.GPT``, ``tfcore.Llama``,
``tfcore.Mixtral``, ``tfcore.Gemma`` and ``tfcore.DeepseekV3``. A batch of prompts of different lengths
is padded on the left and needs a model whose forward also takes ``attention_mask``
(``tfcore.gpt.positions_and_mask``); all five do (chapter 23).
"""

from __future__ import annotations

import inspect

import torch


def _check_sampling(temperature, top_k, top_p) -> None:
    if not temperature >= 0:
        raise ValueError(f"temperature must be ≥ 0 (0 means greedy), got {temperature}")
    if top_k is not None and (int(top_k) != top_k or top_k < 1):
        raise ValueError(f"top_k must be a whole number ≥ 1 (or None for no cut), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1] (or None for no cut), got {top_p}")


def next_token_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                     top_p: float | None = None) -> torch.Tensor:
    """The distribution a sampler draws the next token from: ``logits [..., vocab]`` -> probabilities.

    - ``temperature`` divides the logits: below 1 sharpens the distribution, above 1 flattens it;
      0 puts all the mass on the most probable token (greedy).
    - ``top_k`` keeps the k most probable tokens.
    - ``top_p`` (nucleus) keeps the most probable tokens until their mass reaches ``top_p``.
    What is cut gets probability 0 and the rest is renormalised.
    """
    _check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(logits.dtype)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(int(top_k), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if top_p is not None and top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above
        cut = mass_before >= top_p  # never cuts the first token: its mass_before is 0
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(cut, 0.0))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def check_left_padding(attention_mask, input_ids: torch.Tensor, model) -> torch.Tensor:
    """``generate``'s checks of a padded batch's ``attention_mask [B, L]`` (1 = real token, 0 =
    padding on the left); returns it as integers, to be extended with a 1 per new token."""
    parameters = inspect.signature(model.forward).parameters
    if "attention_mask" not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        raise TypeError(f"{type(model).__name__}.forward takes no attention_mask, so it cannot run a padded "
                        f"batch: generate each prompt alone (attention_mask=None), or use a model that takes "
                        f"one (tfcore.GPT, tfcore.Llama, tfcore.Mixtral, tfcore.Gemma, tfcore.DeepseekV3, "
                        f"tfcore.Qwen35)")
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor of 0/1 (1 = real token), got "
                        f"{type(attention_mask).__name__}; pass the tokenizer's attention_mask")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)} ([B, L]), got "
                         f"{tuple(attention_mask.shape)}; pass the attention_mask the tokenizer gave with them")
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise TypeError(f"attention_mask must hold integers or bools (1 = real token, 0 = padding), got "
                        f"{attention_mask.dtype}; use attention_mask.long()")
    if not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token); it holds other "
                         "values: pass the tokenizer's attention_mask, not the input_ids")
    real = attention_mask.long()
    if (real[:, 1:] < real[:, :-1]).any():  # a 0 after a 1: padding on the right (or in the middle)
        row = int((real[:, 1:] < real[:, :-1]).any(dim=1).nonzero()[0])
        raise ValueError(f"row {row} of attention_mask has padding after a real token; generate continues "
                         f"each row from its last column, so pad on the left: tokenizer.padding_side = 'left'")
    if not real[:, -1].all():  # left padding and a 0 in the last column: the whole row is padding
        row = int((real[:, -1] == 0).nonzero()[0])
        raise ValueError(f"row {row} of attention_mask is all padding: every prompt needs at least one real "
                         f"token; drop that row")
    return real


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, use_cache: bool = True,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None,
             attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Continue ``input_ids [B, L]`` by ``max_new_tokens`` tokens: returns ``[B, L + max_new_tokens]``.

    ``temperature=0`` is greedy decoding (``top_k`` and ``top_p`` then do not apply); otherwise
    each token is drawn from ``next_token_probs``, with ``generator`` for reproducible draws.
    ``use_cache=True`` runs the prompt once and then one position per step, reusing the keys and
    values of the earlier positions; ``use_cache=False`` runs the whole sequence at every step.
    The two give the same tokens.

    Prompts of different lengths: pad them on the left and pass the tokenizer's ``attention_mask
    [B, L]`` (1 = real token, 0 = padding). Each step extends it with a 1 for the new token, so
    no query ever sees a padded key, and the output keeps the padding on the left. The model's
    ``max_positions`` bounds the padded length ``L + max_new_tokens`` (the cache holds padding too).
    """
    if not all(hasattr(model, name) for name in ("new_cache", "max_positions")):
        raise TypeError(f"generate needs a decoder-only model with new_cache() and max_positions "
                        f"(tfcore.GPT, tfcore.Llama, ...), got {type(model).__name__}; for an "
                        f"encoder-decoder use tfcore.greedy_decode or tfcore.beam_search")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a non-empty prompt of shape [B, L], got {shape}")
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a whole number ≥ 0, got {max_new_tokens}")
    _check_sampling(temperature, top_k, top_p)
    if temperature == 0 and (top_k is not None or top_p is not None):
        raise ValueError("top_k and top_p cut the distribution a sampler draws from; with temperature=0 "
                         "(greedy) they have no effect: set temperature > 0 to sample")
    total, limit = input_ids.shape[1] + max_new_tokens, model.max_positions
    if total > limit:
        raise ValueError(f"the prompt ({input_ids.shape[1]} tokens) plus max_new_tokens ({max_new_tokens}) "
                         f"is {total} positions, but the model has {limit} (max_position_embeddings); "
                         f"ask for at most {limit - input_ids.shape[1]} new tokens")
    mask = None if attention_mask is None else check_left_padding(attention_mask, input_ids, model)
    was_training = model.training
    model.eval()
    # The final length is known: the cache reserves room for it and writes each step in place.
    # The last token is never fed back, so total - 1 positions; at least 1 (a capacity is >= 1).
    cache = model.new_cache(capacity=max(total - 1, 1)) if use_cache else None
    ids, step_input = input_ids, input_ids
    for _ in range(int(max_new_tokens)):
        if mask is None:
            logits = model(step_input, cache=cache)[:, -1]  # [B, vocab]: the next token's scores
        else:  # the mask covers every position fed so far: the cached ones and step_input
            logits = model(step_input, cache=cache, attention_mask=mask)[:, -1]
        if temperature == 0:
            token = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = next_token_probs(logits.float(), temperature, top_k, top_p)
            token = torch.multinomial(probs, 1, generator=generator)
        ids = torch.cat([ids, token], dim=1)
        step_input = token if use_cache else ids
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)  # the new token is real
    model.train(was_training)
    return ids
