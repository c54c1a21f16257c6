"""Task heads on top of the encoder (chapter 8)."""

from __future__ import annotations

from torch import nn

from .encoder import TransformerEncoder


class TransformerForSequenceClassification(nn.Module):
    """The encoder, then the ``[CLS]`` hidden state -> dropout -> Linear(hidden, num_labels).

    Not quite BERT's head: transformers' ``BertForSequenceClassification`` (like Google's
    ``run_classifier.py``) classifies the *pooler's* output, ``tanh(Linear(hidden, hidden)([CLS]))``.
    This head leaves the pooler out on purpose; chapter 7 (§7.2) recomputes transformers' logits
    from the encoder, the pooler's weights and the linear layer, and chapter 8 shows what the
    pooler changes.

    ``forward(input_ids [B, L], attention_mask [B, L] = None, token_type_ids = None)`` -> logits
    ``[B, num_labels]`` (``config.num_labels``).
    """

    def __init__(self, config, encoder: TransformerEncoder | None = None):
        super().__init__()
        self.encoder = TransformerEncoder(config) if encoder is None else encoder
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        hidden = self.encoder(input_ids, attention_mask, token_type_ids)
        # .contiguous(): laid out like a stored [B, hidden] feature matrix. CUDA's dropout draws
        # another mask for a strided slice than for its copy under the same seed (the CPU's does
        # not; observed by hand on an NVIDIA H100 with torch 2.11, not re-run on the pinned
        # version), and chapter 8 trains a head on stored features to the same weights as this
        # model with its encoder frozen, on either device.
        return self.classifier(self.dropout(hidden[:, 0].contiguous()))

    @classmethod
    def from_pretrained(cls, num_labels: int, name: str | None = None):
        """A fresh head of ``num_labels`` outputs on the pretrained encoder of ``name``."""
        encoder = TransformerEncoder.from_pretrained(name)
        encoder.config.num_labels = num_labels
        return cls(encoder.config, encoder)
