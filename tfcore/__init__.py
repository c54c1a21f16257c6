"""tfcore: the final version of each piece that Transformer Anatomy builds, chapter by chapter.

Each module holds one idea. The notebooks write the code in front of the reader; this package
keeps the version later chapters import, and a test keeps the two in agreement.

- ``runtime``: ``setup`` (seeds, quiet libraries, device)
- ``checkpoint``: the pretrained checkpoint, offline by default (chapter 1)
- ``attention``: scaled dot-product attention, masks, heads (chapters 2-4)
- ``layers``: feed-forward and the encoder layer, pre-LN or post-LN (chapter 5)
- ``encoder``: positions, embeddings and the encoder stack, loadable with BERT's weights (6-7)
- ``heads``: the sequence-classification head; ``training``: its training loop (chapter 8)
- ``viz``: bertviz's neuron, head and model views (import ``tfcore.viz``)
"""

from .attention import (AttentionHead, MultiHeadAttention, causal_mask, padding_mask,
                        scaled_dot_product_attention)
from .checkpoint import CheckpointError, load_config, load_pretrained, load_tokenizer
from .encoder import Embeddings, TransformerEncoder, sinusoidal_positions
from .heads import TransformerForSequenceClassification
from .layers import FeedForward, TransformerEncoderLayer
from .runtime import setup
from .training import accuracy, load_word_senses, train_classifier

__all__ = [
    "AttentionHead",
    "CheckpointError",
    "Embeddings",
    "FeedForward",
    "MultiHeadAttention",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "TransformerForSequenceClassification",
    "accuracy",
    "causal_mask",
    "load_config",
    "load_pretrained",
    "load_tokenizer",
    "load_word_senses",
    "padding_mask",
    "scaled_dot_product_attention",
    "setup",
    "sinusoidal_positions",
    "train_classifier",
]
