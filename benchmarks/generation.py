"""Generation with the KV cache, on random GPT-2 weights (chapter 15).

Timed with ``_take_turns`` (``torch.utils.benchmark.Timer``, the implementations taking turns).
Keys:

- ``generation``: greedy generation of 256 tokens after a 16-token prompt, batch 1, by
  ``tfcore.generate`` and by transformers' ``generate`` on the same weights, for a model of about
  1M parameters and one of about 20M (same tokens recorded);
- ``cache``: the 1M model generating up to 512 tokens, with and without the cache;
- ``per_token``: one new token at a given position: one cached step against one full forward pass.
"""

from __future__ import annotations

import argparse

import torch

from .common import _take_turns


GENERATION_MODELS = {  # name -> GPT-2 sizes: about 1.1M and 21M parameters
    "1M": dict(n_embd=128, n_layer=4, n_head=4, vocab_size=2048),
    "20M": dict(n_embd=384, n_layer=10, n_head=6, vocab_size=8192),
}
SMOKE_MODELS = {"tiny": dict(n_embd=32, n_layer=2, n_head=2, vocab_size=128)}


def _gpt2_pair(sizes: dict, positions: int, device):
    """A random transformers GPT-2 and tfcore's port of it (same weights), in eval mode."""
    import tfcore
    from transformers import GPT2Config, GPT2LMHeadModel

    reference = GPT2LMHeadModel(GPT2Config(n_positions=positions, bos_token_id=None, eos_token_id=None,
                                           **sizes)).to(device).eval()
    with torch.no_grad():  # weights large enough that greedy decoding does not repeat one token
        for name, parameter in reference.named_parameters():
            if parameter.dim() == 2:
                std = {"transformer.wte.weight": 0.3, "transformer.wpe.weight": 1.0}.get(name, parameter.shape[0] ** -0.5)
                parameter.normal_(0, std)  # Conv1D weights are [in, out]: std 1/sqrt(fan-in)
    return reference, tfcore.GPT.from_transformers(reference).to(device)


def generation(models: dict, prompt: int, new_tokens: int, repeats: int, device) -> list[dict]:
    import tfcore

    rows = []
    for name, sizes in models.items():
        reference, ours = _gpt2_pair(sizes, 512, device)
        ids = torch.randint(0, sizes["vocab_size"], (1, prompt), device=device)
        mask = torch.ones_like(ids)  # every prompt token is real (else generate masks those equal to pad_token_id)
        env = {"tfcore": tfcore, "ours": ours, "reference": reference, "ids": ids, "mask": mask, "n": new_tokens}
        tokens = tfcore.generate(ours, ids, new_tokens)
        same = torch.equal(tokens, reference.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0))
        seconds = _take_turns({"tfcore.generate": "tfcore.generate(ours, ids, n)",
                               "transformers generate": "reference.generate(ids, attention_mask=mask, max_new_tokens=n, "
                                                        "min_new_tokens=n, do_sample=False, pad_token_id=0)"},
                              repeats, env)
        parameters = sum(p.numel() for p in ours.parameters())
        distinct = len(set(tokens[0, prompt:].tolist()))  # a varied output gives same_tokens its teeth
        rows += [{"what": what, "model": name, "parameters": parameters, "prompt": prompt, "new_tokens": new_tokens,
                  "seconds": t, "same_tokens": same, "distinct_new_tokens": distinct} for what, t in seconds.items()]
    return rows


def cache_speedup(sizes: dict, name: str, prompt: int, total: int, repeats: int, device) -> list[dict]:
    import tfcore

    _, ours = _gpt2_pair(sizes, total, device)
    ids = torch.randint(0, sizes["vocab_size"], (1, prompt), device=device)
    env = {"tfcore": tfcore, "ours": ours, "ids": ids, "n": total - prompt}
    seconds = _take_turns({"with cache": "tfcore.generate(ours, ids, n)",
                           "without cache": "tfcore.generate(ours, ids, n, use_cache=False)"}, repeats, env)
    return [{"what": what, "model": name, "prompt": prompt, "total_tokens": total, "seconds": t}
            for what, t in seconds.items()]


def per_token(models: dict, positions, repeats: int, device) -> list[dict]:
    """One new token after ``position`` earlier ones: a cached step against a full forward pass."""
    rows = []
    for name, sizes in models.items():
        _, ours = _gpt2_pair(sizes, max(positions) + 1, device)
        for position in positions:
            ids = torch.randint(0, sizes["vocab_size"], (1, position + 1), device=device)
            cache = ours.new_cache()
            with torch.no_grad():
                ours(ids[:, :position], cache=cache)
            saved = [(layer.keys, layer.values) for layer in cache.layers]

            def cached_step(ours=ours, ids=ids, cache=cache, saved=saved):
                with torch.no_grad():
                    ours(ids[:, -1:], cache=cache)
                for layer, (keys, values) in zip(cache.layers, saved):  # back to `position` entries
                    layer.keys, layer.values = keys, values

            def full_pass(ours=ours, ids=ids):
                with torch.no_grad():
                    ours(ids)

            seconds = _take_turns({"with cache": "cached_step()", "without cache": "full_pass()"}, repeats,
                                  {"cached_step": cached_step, "full_pass": full_pass})
            rows += [{"what": what, "model": name, "position": position, "seconds": t}
                     for what, t in seconds.items()]
    return rows


def measures(args: argparse.Namespace) -> dict:
    """This module's keys: key -> function(device) -> rows, with the sizes of a full or a smoke run."""
    models = SMOKE_MODELS if args.smoke else GENERATION_MODELS
    prompt, new_tokens, total = (4, 8, 16) if args.smoke else (16, 256, 512)
    token_positions = [4, 12] if args.smoke else [16, 64, 128, 256, 384, 511]
    smallest = next(iter(models))
    return {
        "generation": lambda device: generation(models, prompt, new_tokens, 1 if args.smoke else 7, device),
        "cache": lambda device: cache_speedup(models[smallest], smallest, prompt, total, 1 if args.smoke else 3, device),
        "per_token": lambda device: per_token(models, token_positions, 1 if args.smoke else 15, device),
    }
