"""A hybrid model's decoding step against the same model made all-attention (chapter 20). Key ``hybrid``.

Two ``tfcore.hybrid.Qwen35`` models, random weights, the same sizes: one with Qwen3.5's pattern of three
Gated DeltaNet layers to one attention layer, one with every layer attention. For each position P,
each model reads a prompt of P tokens into its cache (in blocks, so that the attention layers never hold
a P x P matrix), then takes ``steps`` one-token cached steps; a row holds the median step time and the
bytes its cache holds at P (``HybridCache.nbytes()``, keys and values, convolution and recurrent states).
The models take turns at each position, so a change in the machine's load hits both alike. With
``--threads 1`` on the CPU the times are the thread's CPU time (each row records its ``clock``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .common import _sync

# The sizes of a full run: a model large enough that a step's attention over the cache, not the
# Python around it, is what grows with the position.
FULL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
            linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=16384)
SMOKE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
             linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=128)


def _models(sizes: dict, device) -> dict:
    from tfcore.hybrid import Qwen35, Qwen35Config

    layers = sizes["num_hidden_layers"]
    hybrid = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    models = {}
    for name, types in (("hybrid", hybrid), ("all attention", ["full_attention"] * layers)):
        torch.manual_seed(0)
        models[name] = Qwen35(Qwen35Config(**sizes, layer_types=types)).to(device).eval()
    return models


def step_times(sizes: dict, positions, steps: int, block: int, device) -> list[dict]:
    """Median seconds of one cached step after P positions, for the hybrid and its all-attention twin."""
    clock = {"name": "thread_time", "timer": time.thread_time} if device == "cpu" and torch.get_num_threads() == 1 \
        else {"name": "perf_counter", "timer": time.perf_counter}
    models = _models(sizes, device)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for position in positions:
        ids = torch.randint(sizes["vocab_size"], (1, position + steps), generator=generator).to(device)
        for name, model in models.items():
            cache = model.new_cache(capacity=position + steps)
            with torch.no_grad():
                for start in range(0, position, block):  # the prompt, a block at a time
                    model(ids[:, start:min(start + block, position)], cache=cache)
                held = cache.nbytes()
                times = []
                for s in range(steps):
                    _sync(device)
                    begin = clock["timer"]()
                    model(ids[:, position + s:position + s + 1], cache=cache)
                    _sync(device)
                    times.append(clock["timer"]() - begin)
            layer_types = model.config.layer_types
            rows.append({"model": name, "position": position, "seconds": statistics.median(times[1:] or times),
                         "steps": steps, "cache_bytes": held, "clock": clock["name"], "batch": 1,
                         "linear_layers": layer_types.count("linear_attention"),
                         "attention_layers": layer_types.count("full_attention"),
                         "dtype": "float32", **{k: v for k, v in sizes.items() if k != "max_position_embeddings"}})
    return rows


def measures(args: argparse.Namespace) -> dict:
    if args.smoke:
        return {"hybrid": lambda device: step_times(SMOKE, [8, 24], 3, 16, device)}
    return {"hybrid": lambda device: step_times(FULL, [128, 512, 2048, 8192], 33, 1024, device)}
