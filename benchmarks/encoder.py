"""The pretrained encoder, tfcore against transformers' ``BertModel`` (eager, sdpa), same weights (chapter 13).

Key ``encoder``: time per forward pass (``median_time``) of the embedded checkpoint, batch 8 x 128
tokens and 1 x 512, with the largest difference of its output to ``BertModel``'s (sdpa).
"""

from __future__ import annotations

import argparse

import torch

from .common import REPEATS, SMOKE_REPEATS, median_time


def encoder(shapes, repeats, device) -> list[dict]:
    """The pretrained encoder: tfcore against transformers' BertModel, eager and sdpa, same weights."""
    import tfcore
    from transformers import AutoModel

    from tfcore.checkpoint import resolve

    ours = tfcore.TransformerEncoder.from_pretrained().to(device)
    path, _ = resolve(None)
    theirs = {impl: AutoModel.from_pretrained(path, attn_implementation=impl, local_files_only=True).to(device).eval()
              for impl in ("eager", "sdpa")}
    rows = []
    for batch, length in shapes:
        torch.manual_seed(0)
        ids = torch.randint(1000, 30000, (batch, length), device=device)
        mask = torch.ones_like(ids)
        with torch.no_grad():  # same weights, same outputs
            difference = (ours(ids, mask) - theirs["sdpa"](input_ids=ids, attention_mask=mask).last_hidden_state).abs().max()
        cases = {"tfcore encoder": lambda: ours(ids, mask)}
        for impl, model in theirs.items():
            cases[f"BertModel ({impl})"] = lambda model=model: model(input_ids=ids, attention_mask=mask)
        for name, fn in cases.items():
            rows.append({"what": name, "batch": batch, "length": length, "seconds": median_time(fn, repeats),
                         "max_abs_difference_to_sdpa": float(difference)})
    return rows


def measures(args: argparse.Namespace) -> dict:
    """This module's key: key -> function(device) -> rows, with the sizes of a full or a smoke run."""
    shapes = [(1, 16)] if args.smoke else [(8, 128), (1, 512)]
    return {"encoder": lambda device: encoder(shapes, SMOKE_REPEATS if args.smoke else REPEATS, device)}
