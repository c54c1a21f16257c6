"""Decoding faster: speculative greedy decoding and int8 weights, on chapter 22's target and draft.

Key ``speculative``: the target's cached greedy decoding against speculative decoding with k = 1..6
proposals per round (same tokens asserted) and the draft alone; the target's cached pass over 1 to
7 new tokens; the target's forward pass with float32, tfcore int8 and ``quantize_dynamic`` weights.
With ``--threads 1`` on the CPU the times are the thread's CPU time (each row records its ``clock``).
"""

from __future__ import annotations

import argparse
import time

import torch

from .common import _take_turns


def speculative(ks, new_tokens: int, repeats: int, pass_repeats: int, device) -> list[dict]:
    """Chapter 22: the book-prose target's cached greedy decoding, against speculative greedy decoding
    with the draft proposing k tokens per round (same tokens asserted); the target's cached pass
    over 1..7 new tokens (``pass_repeats`` turns, median); and the target's forward pass with
    float32 and with int8 weights."""
    import copy
    import warnings

    import tfcore
    from tfcore.quantization import quantize_linears
    from tfcore.speculative import decoding_data, load_decoding_model, speculative_generate, truncate_cache

    # On the CPU, this thread's CPU time (run with --threads 1): a busy, shared machine does not
    # count the moments the thread waits (as chapter 22's int8 deep dive times its layers)
    clock = {"timer": time.thread_time} if device == "cpu" and torch.get_num_threads() == 1 else {}
    target, draft = (load_decoding_model(name)[0].to(device) for name in ("target", "draft"))
    data = decoding_data()
    ids = data["test"][0][:1, :16].to(device)  # the first 16 tokens of the held-out chapter
    reference = tfcore.generate(target, ids, new_tokens)
    env = {"tfcore": tfcore, "target": target, "draft": draft, "ids": ids, "n": new_tokens,
           "speculative_generate": speculative_generate}
    statements = {"target greedy (cached)": "tfcore.generate(target, ids, n)",
                  "draft greedy (cached)": "tfcore.generate(draft, ids, n)"}
    details = {}
    for k in ks:
        tokens, stats = speculative_generate(target, draft, ids, new_tokens, k=k, return_stats=True)
        assert torch.equal(tokens, reference), f"speculative greedy with k={k} differs from the target's greedy tokens"
        statements[f"speculative, k={k}"] = f"speculative_generate(target, draft, ids, n, k={k})"
        checked = sum(m + (m < p) for m, p in zip(stats["accepted"], stats["proposed"]))
        details[f"speculative, k={k}"] = {"k": k, "same_tokens": True, "accepted": sum(stats["accepted"]),
                                          "proposed": sum(stats["proposed"]), "checked": checked,
                                          "rounds": len(stats["accepted"]), "target_calls": stats["target_calls"],
                                          "draft_calls": stats["draft_calls"]}
    seconds = _take_turns(statements, repeats, env, **clock)
    rows = [{"what": what, "part": "decoding", "new_tokens": new_tokens, "prompt": ids.shape[1], "seconds": t,
             "tokens_per_second": new_tokens / t, **details.get(what, {})} for what, t in seconds.items()]
    # The target's cached pass over 1..7 new tokens after 40 cached positions: what a round of k
    # proposals costs the target (k + 1 tokens) against one plain cached step (1 token).
    context = data["test"][0][:1, :47].to(device)
    cache = target.new_cache(capacity=128)
    with torch.no_grad():
        target(context[:, :40], cache=cache)

    def cached_pass(n):
        with torch.no_grad():
            target(context[:, 40:40 + n], cache=cache)
        truncate_cache(cache, 40)  # back to the 40 cached positions

    passes = {f"target cached pass, {n} new tokens": n for n in range(1, 8)}
    seconds = _take_turns({what: f"cached_pass({n})" for what, n in passes.items()}, pass_repeats,
                          {"cached_pass": cached_pass}, **clock)
    rows += [{"what": what, "part": "pass", "new_tokens": passes[what], "cached": 40, "seconds": t}
             for what, t in seconds.items()]
    batch = data["test"][0][:8].to(device)  # [8, 128]: a forward pass over 8 blocks of the held-out chapter
    small = quantize_linears(copy.deepcopy(target))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated in torch 2.13, still present
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        dynamic = copy.deepcopy(target)
        dynamic.blocks = quantize_dynamic(dynamic.blocks, {torch.nn.Linear: per_channel_dynamic_qconfig},
                                          dtype=torch.qint8)
    forward = {"target forward, float32": target, "target forward, int8 weights (tfcore)": small}
    if device == "cpu":  # quantize_dynamic runs on the CPU only
        forward["target forward, int8 dynamic (torch quantize_dynamic)"] = dynamic
    seconds = _take_turns({what: f"models[{what!r}](batch)" for what in forward}, repeats,
                          {"models": forward, "batch": batch}, **clock)
    rows += [{"what": what, "part": "forward", "batch": list(batch.shape), "seconds": t} for what, t in seconds.items()]
    return [row | {"clock": "thread CPU time" if clock else "wall"} for row in rows]


def measures(args: argparse.Namespace) -> dict:
    """This module's key: key -> function(device) -> rows, with the sizes of a full or a smoke run."""
    return {"speculative": lambda device: speculative([1, 3] if args.smoke else [1, 2, 3, 4, 5, 6], 16 if args.smoke else 96,
                                                      1 if args.smoke else 9, 1 if args.smoke else 201, device)}
