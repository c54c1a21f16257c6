"""tfcore: the final version of each piece that Transformer Anatomy builds, chapter by chapter.

Each module holds one idea. The notebooks write the code in front of the reader; this package
keeps the version later chapters import, and a test keeps the two in agreement.
"""

from .checkpoint import CheckpointError, load_config, load_pretrained, load_tokenizer
from .runtime import setup

__all__ = [
    "CheckpointError",
    "load_config",
    "load_pretrained",
    "load_tokenizer",
    "setup",
]
