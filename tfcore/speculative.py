"""Speculative decoding: a small draft model proposes, the target model verifies (chapter 22).

A draft model proposes ``k`` tokens one by one; the target runs all of them in ONE cached forward
pass, which gives its own prediction after each proposed prefix. Greedy: keep the longest prefix
of proposals that equals the target's argmax, then the target's own next token (Leviathan et al.,
2023; Chen et al., 2023). Sampling: accept proposal ``x`` with probability ``min(1, p(x)/q(x))``,
else draw from the residual ``max(0, p - q)`` renormalised; the tokens then follow the target's
distribution exactly.

Models are those of ``tfcore.generate``: ``model(input_ids [B, L], cache=None)`` -> logits
``[B, L, vocab]``, with ``new_cache()`` and ``max_positions``, whose cache can be rolled back
(``truncate_cache``): a ``KVCache`` (``tfcore.GPT``, ``tfcore.Llama``, ``Mixtral``) or a
``LatentCache`` (``tfcore.DeepseekV3``), checked equal to ``tfcore.generate`` for GPT and
DeepseekV3 targets (``tests/test_speculative.py``). Refused: Gemma's ``RollingKVCache``: a local
layer of window ``W`` keeps only its last ``W`` positions, so writing ``k`` proposals overwrites
the ``k`` oldest, and once two or more proposals are rejected the next token's window reaches
positions that are gone. Draft and target share one vocabulary. Batch size 1: each sequence
accepts a different number of tokens.

This module also holds the two book-prose GPTs of chapter 22 (``load_decoding_model``).
"""

from __future__ import annotations

import json
import numbers
from importlib.resources import files

import torch

from .cache import KVCache
from .generation import _check_sampling, next_token_probs
from .mla import LatentCache

# ---------------------------------------------------------------------------------------------
# The KV cache, rolled back


def truncate_cache(cache: KVCache | LatentCache, length: int) -> KVCache | LatentCache:
    """Forget every cached position from ``length`` on (keys ``[B, H, L, d]`` -> ``[B, H, length, d]``).

    After a rejection the positions of the rejected tokens hold keys and values computed from
    tokens that are not in the sequence: they must go. A cache with a capacity keeps its room and
    writes the next positions from ``length`` on. A ``LatentCache`` (DeepSeek-V3) is cut the same
    way along its positions (latents ``[B, S, r]`` -> ``[B, length, r]``).
    """
    _check_rollback(cache)
    if isinstance(length, bool) or not isinstance(length, numbers.Real) or not 0 <= length <= cache.length \
            or int(length) != length:
        raise ValueError(f"cannot truncate a cache of {cache.length} positions to {length!r}; "
                         f"the length must be a whole number in 0..{cache.length}")
    length = int(length)
    for layer in cache.layers:
        if isinstance(cache, LatentCache):
            if layer.latent is not None:
                layer.latent, layer.k_rope = layer.latent[:, :length], layer.k_rope[:, :length]
        elif layer.keys is not None:
            layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]
    return cache


def _check_rollback(cache) -> None:
    """A cache ``truncate_cache`` can roll back: a ``KVCache`` without cross-attention, or a ``LatentCache``."""
    if isinstance(cache, LatentCache) or (isinstance(cache, KVCache) and cache.cross is None):
        return
    kind = type(cache).__name__
    why = (" (a local layer keeps only its last W positions: after two or more rejected proposals, "
           "positions the next token's window reaches have been overwritten)" if kind == "RollingKVCache" else "")
    raise TypeError(f"speculative decoding rolls its caches back after a rejection, and only a KVCache of a "
                    f"decoder-only model (tfcore.GPT, tfcore.Llama, Mixtral) or a LatentCache (DeepseekV3) "
                    f"can be; got a {kind}{why}. Decode this model with tfcore.generate")


# ---------------------------------------------------------------------------------------------
# Greedy


def accepted_prefix_length(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> int:
    """How many leading proposals the target agrees with: ``draft_tokens [k]`` against the target's
    argmax ``target_tokens [k]`` after each prefix. Stops at the first disagreement: a later
    proposal was drafted after a wrong token and is not verified."""
    if not (isinstance(draft_tokens, torch.Tensor) and isinstance(target_tokens, torch.Tensor)
            and draft_tokens.dim() == 1 and draft_tokens.shape == target_tokens.shape):
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                  for t in (draft_tokens, target_tokens)]
        raise ValueError(f"draft_tokens and target_tokens must be two [k] tensors of the same shape, got {shapes}")
    agree = (draft_tokens == target_tokens).long()
    return int(agree.cumprod(dim=0).sum())


def _check_pair(target, draft, input_ids, max_new_tokens, k):
    for name, model in (("target", target), ("draft", draft)):
        if not all(hasattr(model, attribute) for attribute in ("new_cache", "max_positions")):
            raise TypeError(f"the {name} must be a decoder-only model with new_cache() and max_positions "
                            f"(tfcore.GPT, tfcore.Llama, ...), got {type(model).__name__}")
    vocabularies = [getattr(getattr(model, "config", None), "vocab_size", None) for model in (target, draft)]
    if None not in vocabularies and vocabularies[0] != vocabularies[1]:
        raise ValueError(f"the target's vocabulary has {vocabularies[0]} tokens and the draft's {vocabularies[1]}: "
                         f"the draft must propose token ids of the target's vocabulary (one tokenizer for both)")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError("input_ids must be a non-empty prompt of shape [B, L]")
    if input_ids.shape[0] != 1:
        raise ValueError(f"speculative decoding here takes one sequence (batch 1), got batch {input_ids.shape[0]}: "
                         f"each sequence accepts a different number of tokens; decode them one by one")
    if int(k) != k or k < 1:
        raise ValueError(f"k (tokens the draft proposes per round) must be a whole number ≥ 1, got {k}")
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a whole number ≥ 0, got {max_new_tokens}")
    total = input_ids.shape[1] + max_new_tokens
    for name, model in (("target", target), ("draft", draft)):
        if total > model.max_positions:
            raise ValueError(f"the prompt plus max_new_tokens is {total} positions, but the {name} has "
                             f"{model.max_positions}; ask for fewer new tokens")
    return total


@torch.no_grad()
def speculative_generate(target, draft, input_ids: torch.Tensor, max_new_tokens: int, k: int = 4,
                         temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                         generator: torch.Generator | None = None, return_stats: bool = False):
    """Continue ``input_ids [1, L]`` by ``max_new_tokens`` tokens with the draft proposing ``k`` per round.

    ``temperature=0``: greedy, the target's own greedy tokens (``tfcore.generate(target, ...)``).
    ``temperature>0``: speculative sampling; the tokens follow the target's ``next_token_probs``
    (with the same ``temperature``, ``top_k``, ``top_p``); the draft proposes from its own.
    Returns ``[1, L + max_new_tokens]``, and with ``return_stats`` also a dict: ``accepted`` (per
    round, proposals kept), ``proposed`` (per round), ``target_calls``, ``draft_calls``.

    Invariant: both caches hold every token of ``ids`` except the last ones not yet fed; the
    target's is rolled back to ``len(ids) - 1`` after each round.
    """
    total = _check_pair(target, draft, input_ids, max_new_tokens, k)
    _check_sampling(temperature, top_k, top_p)
    states = target.training, draft.training
    target.eval(), draft.eval()
    target_cache, draft_cache = target.new_cache(capacity=total), draft.new_cache(capacity=total)
    _check_rollback(target_cache), _check_rollback(draft_cache)
    ids = input_ids
    stats = {"accepted": [], "proposed": [], "target_calls": 0, "draft_calls": 0}
    while ids.shape[1] < total:
        if max(target_cache.length, draft_cache.length) >= ids.shape[1]:
            raise RuntimeError(f"a cache holds {max(target_cache.length, draft_cache.length)} positions for a sequence "
                               f"of {ids.shape[1]} tokens: roll the caches back (truncate_cache) after each round")
        k_round = min(int(k), total - ids.shape[1] - 1)  # the round adds at most k_round + 1 tokens
        proposals, draft_probs = [], []
        step_input = ids[:, draft_cache.length:]  # the tokens the draft has not seen yet (1 or 2)
        for _ in range(k_round):
            logits = draft(step_input, cache=draft_cache)[:, -1]  # [1, vocab]
            stats["draft_calls"] += 1
            draft_width = logits.shape[-1]
            if temperature == 0:
                token = logits.argmax(dim=-1, keepdim=True)
            else:
                q = next_token_probs(logits.float(), temperature, top_k, top_p)
                token = sample(q, torch.rand(1, 1, generator=generator, device=q.device))
                draft_probs.append(q[0])
            proposals.append(token)
            step_input = token
        proposed = torch.cat([ids[:, target_cache.length:]] + proposals, dim=1)  # [1, unseen + k_round]
        logits = target(proposed, cache=target_cache)[0, -(k_round + 1):]  # [k_round + 1, vocab]
        stats["target_calls"] += 1
        if proposals and draft_width != logits.shape[-1]:  # models without a config.vocab_size
            raise ValueError(f"the target scores {logits.shape[-1]} tokens and the draft {draft_width}: the "
                             f"draft must propose token ids of the target's vocabulary")
        drafted = torch.cat(proposals, dim=1)[0] if proposals else ids.new_empty(0)  # [k_round]
        if temperature == 0:
            target_tokens = logits.argmax(dim=-1)  # the target's choice after each prefix
            m = accepted_prefix_length(drafted, target_tokens[:k_round])
            new = torch.cat([drafted[:m], target_tokens[m:m + 1]])
        else:
            p = next_token_probs(logits.float(), temperature, top_k, top_p)  # [k_round + 1, vocab]
            q = torch.stack(draft_probs) if draft_probs else p[:0]
            u = torch.rand(2 * k_round + 1, generator=generator, device=p.device)
            m, last = verify_samples(p, q, drafted, u)
            new = torch.cat([drafted[:m], last.view(1)])
        ids = torch.cat([ids, new.view(1, -1)], dim=1)
        stats["accepted"].append(m)
        stats["proposed"].append(k_round)
        # roll back: keep only the positions of tokens that stay (all but the newest)
        truncate_cache(target_cache, min(target_cache.length, ids.shape[1] - 1))
        truncate_cache(draft_cache, min(draft_cache.length, ids.shape[1] - 1))
    target.train(states[0]), draft.train(states[1])
    return (ids, stats) if return_stats else ids


# ---------------------------------------------------------------------------------------------
# Sampling: the acceptance rule


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the token whose cumulative probability first exceeds ``u``.

    ``probs [..., vocab]`` (each row summing to 1), ``u [..., 1]`` uniform in [0, 1) -> ``[..., 1]``.
    Taking the uniforms as an argument lets one stream of random numbers drive every draw.
    """
    cdf = probs.cumsum(dim=-1)
    return (cdf <= u).sum(dim=-1, keepdim=True).clamp(max=probs.shape[-1] - 1)


def acceptance_probability(p: torch.Tensor, q: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)) for the drafted ``token [...]``; ``p, q [..., vocab]`` (q(x) > 0: x was drawn from q)."""
    px = p.gather(-1, token.unsqueeze(-1)).squeeze(-1)
    qx = q.gather(-1, token.unsqueeze(-1)).squeeze(-1)
    return torch.clamp(px / qx, max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) ``[..., vocab]``: where to draw from after a rejection.

    The mass that p has above q, renormalised. If p equals q nothing is ever rejected and the
    residual is undefined; we then return p.
    """
    if not isinstance(p, torch.Tensor) or not isinstance(q, torch.Tensor) or p.shape != q.shape:
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (p, q)]
        raise ValueError(f"p and q must be distributions of the same shape [..., vocab], got {shapes[0]} "
                         f"and {shapes[1]}: target and draft must share one vocabulary")
    residual = torch.clamp(p - q, min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(p.dtype).tiny), p)


def verify_samples(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, u: torch.Tensor):
    """One round of speculative sampling's check, for one sequence.

    ``p [k + 1, vocab]``: the target's distributions after each prefix; ``q [k, vocab]``: the
    draft's, from which ``drafted [k]`` was drawn; ``u [2k + 1]`` uniforms. Returns
    ``(m, token)``: the first ``m`` proposals are kept, then ``token`` (a residual draw at the
    first rejection, or a draw from ``p[k]`` when all ``k`` are kept).
    """
    k = drafted.shape[0] if isinstance(drafted, torch.Tensor) and drafted.dim() == 1 else None
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (p, q, drafted, u)]
    if k is None or p.dim() != 2 or p.shape[0] != k + 1 or q.shape != (k, p.shape[1]) or u.shape != (2 * k + 1,):
        raise ValueError(f"verify_samples takes p [k + 1, vocab], q [k, vocab], drafted [k] and u [2k + 1]; got "
                         f"{', '.join(map(str, shapes))}")
    for j in range(k):
        if u[j] < acceptance_probability(p[j], q[j], drafted[j]):
            continue
        return j, sample(residual_distribution(p[j], q[j]), u[k + j].view(1))[0]
    return k, sample(p[k], u[2 * k].view(1))[0]


# ---------------------------------------------------------------------------------------------
# Chapter 22's two models, trained on the book prose (tools/train_decoding_models.py)

DECODING_TOKENIZER = {"vocab_size": 1000, "min_frequency": 2, "validation": "12_transformer_family",
                      "test": "09_the_decoder", "context": 128}
_COMMON = dict(vocab_size=1000, max_position_embeddings=128, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)
DECODING_MODELS = {
    # the target first; the draft is then distilled from it (trained on the target's probabilities)
    "target": {"config": _COMMON | dict(hidden_size=64, num_hidden_layers=12, num_attention_heads=4),
               "steps": 900, "batch_size": 16, "warmup": 40, "lr": 3e-3, "dropout": 0.1, "distilled_from": None},
    "draft": {"config": _COMMON | dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2),
              "steps": 800, "batch_size": 16, "warmup": 40, "lr": 3e-3, "dropout": 0.0, "distilled_from": "target"},
}


def decoding_tokenizer_and_texts():
    """Chapter 14's byte-level BPE (1,000 tokens), trained on the book prose's training documents;
    returns ``(tokenizer, {"train": [texts], "validation": text, "test": text})``."""
    from tokenizers import ByteLevelBPETokenizer

    from .training import load_book_prose

    def unwrap(text):  # chapter 14: join the lines of each paragraph
        return "\n\n".join(" ".join(paragraph.split("\n")) for paragraph in text.split("\n\n"))

    documents = {name: unwrap(text) for name, text in load_book_prose().items()}
    held_out = (DECODING_TOKENIZER["validation"], DECODING_TOKENIZER["test"])
    texts = {"train": [t for name, t in documents.items() if name not in held_out],
             "validation": documents[held_out[0]], "test": documents[held_out[1]]}
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(texts["train"], vocab_size=DECODING_TOKENIZER["vocab_size"],
                                  min_frequency=DECODING_TOKENIZER["min_frequency"], show_progress=False)
    return tokenizer, texts


def decoding_data(context: int | None = None):
    """The blocks chapter 14 trains on, of ``context`` tokens (default 128): ``{"train" | "validation" |
    "test": (inputs [n, context], targets [n, context])}``, plus ``"tokenizer"``."""
    context = context or DECODING_TOKENIZER["context"]
    tokenizer, texts = decoding_tokenizer_and_texts()

    def blocks(document_texts):
        ids = torch.tensor([i for text in document_texts for i in tokenizer.encode(text).ids])
        n = (len(ids) - 1) // context
        return ids[:n * context].view(n, context), ids[1:n * context + 1].view(n, context)

    return {"train": blocks(texts["train"]), "validation": blocks([texts["validation"]]),
            "test": blocks([texts["test"]]), "tokenizer": tokenizer}


def load_decoding_model(name: str):
    """Chapter 22's ``"draft"`` or ``"target"`` GPT, in float32, eval mode; also returns the file's
    metadata (config, tokenizer settings, recipe, the losses measured when it was trained)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from .gpt import GPT, GPTConfig

    if name not in DECODING_MODELS:
        raise ValueError(f"unknown decoding model {name!r}; choose 'draft' or 'target'")
    path = files("tfcore") / "data" / f"decoding_{name}.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = {key: json.loads(value) for key, value in f.metadata().items()}
    model = GPT(GPTConfig(**metadata["config"]))
    state = {key: value.float() for key, value in load_file(str(path)).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing != ["lm_head.weight"] or unexpected:  # the head is tied to the token embeddings
        raise ValueError(f"{path.name} does not match the model: missing {missing}, unexpected {unexpected}")
    return model.eval(), metadata
