"""Generation for decoder-only models: greedy decoding and sampling, with or without a KV cache
(chapters 14 and 15).

A model here is anything called as ``model(input_ids [B, L], cache=None)`` that returns logits
``[B, L, vocab]`` and has ``new_cache()`` and ``max_positions``: ``tfcore.GPT`` and ``tfcore.Llama``.
"""

from __future__ import annotations

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


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, use_cache: bool = True,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Continue ``input_ids [B, L]`` by ``max_new_tokens`` tokens: returns ``[B, L + max_new_tokens]``.

    ``temperature=0`` is greedy decoding (``top_k`` and ``top_p`` then do not apply); otherwise
    each token is drawn from ``next_token_probs``, with ``generator`` for reproducible draws.
    ``use_cache=True`` runs the prompt once and then one position per step, reusing the keys and
    values of the earlier positions; ``use_cache=False`` runs the whole sequence at every step.
    The two give the same tokens.
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
    was_training = model.training
    model.eval()
    # The final length is known: the cache reserves room for it and writes each step in place.
    # The last token is never fed back, so total - 1 positions; at least 1 (a capacity is >= 1).
    cache = model.new_cache(capacity=max(total - 1, 1)) if use_cache else None
    ids, step_input = input_ids, input_ids
    for _ in range(int(max_new_tokens)):
        logits = model(step_input, cache=cache)[:, -1]  # [B, vocab]: the next token's scores
        if temperature == 0:
            token = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = next_token_probs(logits.float(), temperature, top_k, top_p)
            token = torch.multinomial(probs, 1, generator=generator)
        ids = torch.cat([ids, token], dim=1)
        step_input = token if use_cache else ids
    model.train(was_training)
    return ids
