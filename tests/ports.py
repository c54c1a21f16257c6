"""Random reference models for the port tests, with weights large enough that a port shows its mistakes."""

from __future__ import annotations

import math

import torch


def widen(model):
    """Redraw a transformers model's random weights larger (norms in [0.5, 1.5], embeddings N(0, 0.3²),
    every matrix N(0, 1/fan_in)) and DeepSeek's expert-choice biases N(0, 0.1²), so that routing and
    greedy tokens vary and a misplaced weight moves the logits (as chapters 16, 19 and 21 do)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            elif "embed_tokens" in name:
                parameter.normal_(0, 0.3)
            else:
                parameter.normal_(0, 1 / math.sqrt(parameter.shape[-1]))
        for name, buffer in model.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.copy_(0.1 * torch.randn(buffer.shape))
    return model
