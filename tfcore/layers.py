"""The other sublayers of an encoder layer: feed-forward, layer norm, residuals (chapter 5).

Shapes: ``[B, L, hidden]`` in and out, everywhere in this module.
"""

from __future__ import annotations

from torch import nn

from .attention import MultiHeadAttention


class FeedForward(nn.Module):
    """Position-wise feed-forward: Linear -> GELU -> Linear -> dropout, applied to each token alone.

    ``hidden -> intermediate_size`` (4 x hidden in BERT) ``-> hidden``. The names match BERT's
    ``intermediate.dense`` (``linear_1``) and ``output.dense`` (``linear_2``). The activation is
    always the exact GELU: a config whose ``hidden_act`` is not ``"gelu"`` is refused (a caller
    that wants another, as ``tfcore.GPT`` does, builds with ``"gelu"`` and replaces ``.gelu``).
    """

    def __init__(self, config):
        super().__init__()
        if getattr(config, "hidden_act", "gelu") != "gelu":
            raise ValueError(f"FeedForward uses the exact GELU only, got hidden_act={config.hidden_act!r}: "
                             "set hidden_act='gelu'")
        self.linear_1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.gelu = nn.GELU()  # the exact, erf-based GELU, as BERT's hidden_act="gelu"
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x):
        return self.dropout(self.linear_2(self.gelu(self.linear_1(x))))


class TransformerEncoderLayer(nn.Module):
    """Self-attention and feed-forward, each wrapped in a residual connection and a layer norm.

    ``config.norm_first`` (default True) chooses where the layer norms sit:

    - pre-LN (``True``):  ``x = x + attn(LN1(x))``;  ``x = x + ff(LN2(x))``
    - post-LN (``False``, as BERT): ``x = LN1(x + attn(x))``;  ``x = LN2(x + ff(x))``

    ``forward(x [B, L, hidden], mask=None, output_attentions=False, cache=None)`` ->
    ``[B, L, hidden]``, or ``(hidden, weights [B, heads, L, L])`` when ``output_attentions`` is set.
    ``cache`` (a ``tfcore.LayerCache``) is handed to the self-attention: with it, a causal stack of
    these layers (the GPT of chapter 14) runs on the new positions only (chapter 15). ``x``'s last
    dimension must be ``config.hidden_size``.
    """

    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.norm_first = getattr(config, "norm_first", True)
        self.attention = MultiHeadAttention(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.layer_norm_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.feed_forward = FeedForward(config)
        self.layer_norm_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def _attend(self, x, mask, need_weights, cache):
        output, weights = self.attention(x, mask=mask, return_weights=True, cache=cache) if need_weights \
            else (self.attention(x, mask=mask, cache=cache), None)
        return self.dropout(output), weights

    def forward(self, x, mask=None, output_attentions=False, cache=None):
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"TransformerEncoderLayer takes x [B, L, hidden_size={self.hidden_size}], got shape "
                             f"{tuple(x.shape)}: project the input to hidden_size, or build the layer with a "
                             f"config whose hidden_size is {x.shape[-1]}")
        if self.norm_first:
            attended, weights = self._attend(self.layer_norm_1(x), mask, output_attentions, cache)
            x = x + attended
            x = x + self.feed_forward(self.layer_norm_2(x))
        else:
            attended, weights = self._attend(x, mask, output_attentions, cache)
            x = self.layer_norm_1(x + attended)
            x = self.layer_norm_2(x + self.feed_forward(x))
        return (x, weights) if output_attentions else x
