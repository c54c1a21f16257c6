"""tfcore: the final version of each piece that Transformer Anatomy builds, chapter by chapter.

Each module holds one idea. The notebooks write the code in front of the reader; this package
keeps the version later chapters import, and a test keeps the two in agreement.

- ``runtime``: ``setup`` (seeds, quiet libraries, device)
- ``checkpoint``: the pretrained checkpoint, offline by default (chapter 1)
- ``attention``: scaled dot-product attention, masks, heads (chapters 2-4)
- ``viz``: bertviz's neuron, head and model views (import ``tfcore.viz``)
"""

from .attention import (AttentionHead, MultiHeadAttention, causal_mask, padding_mask,
                        scaled_dot_product_attention)
from .checkpoint import CheckpointError, load_config, load_pretrained, load_tokenizer
from .runtime import setup

__all__ = [
    "AttentionHead",
    "CheckpointError",
    "MultiHeadAttention",
    "causal_mask",
    "load_config",
    "load_pretrained",
    "load_tokenizer",
    "padding_mask",
    "scaled_dot_product_attention",
    "setup",
]
