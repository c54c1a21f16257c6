"""The book's encoder-decoder again, written with Keras 3's sub-classing API (the Keras appendix).

Import it as ``from tfcore import keras_transformer``; ``import tfcore`` alone does not import
Keras. Unless the reader chose a backend before, ``KERAS_BACKEND`` is set to ``torch`` here,
before Keras is first imported: the layers then run on PyTorch tensors, with no TensorFlow
install. Everything below goes through ``keras.ops``, never ``torch``: ``tests/test_keras.py`` runs
the same model on the JAX backend too (eagerly and compiled with ``jax.jit``) and finds the same
outputs. The TensorFlow backend is not tested here.

Shapes: ``B`` batch, ``Lq``/``Lk`` queries/keys, ``Ls``/``Lt`` source/target positions. Keras
keeps a layer's weight as ``[inputs, outputs]``, the transpose of ``nn.Linear.weight``
(``[outputs, inputs]``). The attention mask is called ``attn_mask``, not ``mask``: Keras gives
a call argument named ``mask`` a meaning of its own. It holds True where attention is allowed,
as everywhere in tfcore; a query whose keys are all blocked gets zero weights, not NaN.

Every layer can copy the weights of its tfcore counterpart (``load_tfcore``), so that the two
implementations can be compared number for number. The comparisons are float32 only: Keras
3.15.1 computes ``keras.ops.matmul`` (and so ``Dense``) in float32 even for float64 inputs on
every backend but TensorFlow, so a float64 check near 1e-10 is not possible
(``tests/test_keras.py`` pins it). ``Transformer`` has ``get_config`` and ``build_from_config``,
so that ``model.save("m.keras")`` and ``keras.saving.load_model`` round-trip it.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402  (after the backend is chosen)
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

__all__ = ["DecoderLayer", "EncoderLayer", "FeedForwardLayer", "MultiHeadAttentionLayer", "PositionalEmbedding",
           "SelfAttentionLayer", "Transformer", "WarmupLinearDecay", "attend"]


def _numpy(tensor) -> np.ndarray:
    """A torch tensor (or anything array-like) as a NumPy array."""
    return tensor.detach().cpu().numpy() if hasattr(tensor, "detach") else np.asarray(tensor)


def _check_width(name: str, x, width: int) -> None:
    shape = tuple(x.shape)
    if len(shape) != 3 or shape[-1] != width:
        raise ValueError(f"{name} must have shape [B, L, {width}], got {shape}")


def _load_linear(kernel, bias, linear) -> None:
    """Copy an ``nn.Linear`` into a Keras kernel ``[in, out]`` and bias: the weight is transposed."""
    kernel.assign(_numpy(linear.weight).T)
    bias.assign(_numpy(linear.bias))


def _load_layer_norm(norm: keras.layers.LayerNormalization, torch_norm) -> None:
    norm.gamma.assign(_numpy(torch_norm.weight))
    norm.beta.assign(_numpy(torch_norm.bias))


def attend(query, key, value, attn_mask=None):
    """softmax(query keyᵀ / √d) value.

    ``query [B, Lq, d]``, ``key [B, Lk, d]``, ``value [B, Lk, dv]``; ``attn_mask`` broadcasts to
    ``[B, Lq, Lk]``. Returns ``(output [B, Lq, dv], weights [B, Lq, Lk])``.
    """
    scores = ops.matmul(query / math.sqrt(query.shape[-1]), ops.swapaxes(key, -2, -1))
    if attn_mask is None:
        weights = ops.softmax(scores, axis=-1)
    else:
        allowed = ops.cast(attn_mask, "bool")
        weights = ops.softmax(ops.where(allowed, scores, -1e9), axis=-1)
        weights = ops.where(ops.any(allowed, axis=-1, keepdims=True), weights, 0.0)  # a fully blocked row: zeros
    return ops.matmul(weights, value), weights


class SelfAttentionLayer(keras.layers.Layer):
    """One attention head whose weights are made in ``build``: ``[B, Lq, d_in]`` -> ``[B, Lq, head_dim]``.

    ``call(query, key=query, value=key, attn_mask=None)``; ``wq``, ``wk``, ``wv`` are
    ``[d_in, head_dim]``. The counterpart of ``tfcore.AttentionHead``.
    """

    def __init__(self, head_dim: int, **kwargs):
        super().__init__(**kwargs)
        self.head_dim = head_dim

    def build(self, query_shape):
        d_in = query_shape[-1]
        self.wq = self.add_weight(shape=(d_in, self.head_dim), initializer="glorot_uniform", name="wq")
        self.wk = self.add_weight(shape=(d_in, self.head_dim), initializer="glorot_uniform", name="wk")
        self.wv = self.add_weight(shape=(d_in, self.head_dim), initializer="glorot_uniform", name="wv")
        self.bq = self.add_weight(shape=(self.head_dim,), initializer="zeros", name="bq")
        self.bk = self.add_weight(shape=(self.head_dim,), initializer="zeros", name="bk")
        self.bv = self.add_weight(shape=(self.head_dim,), initializer="zeros", name="bv")

    def call(self, query, key=None, value=None, attn_mask=None, return_weights=False):
        key = query if key is None else key
        value = key if value is None else value
        q = ops.matmul(query, self.wq) + self.bq
        k = ops.matmul(key, self.wk) + self.bk
        v = ops.matmul(value, self.wv) + self.bv
        output, weights = attend(q, k, v, attn_mask)
        return (output, weights) if return_weights else output

    def compute_output_shape(self, query_shape, *args, **kwargs):
        return (*query_shape[:-1], self.head_dim)

    def load_tfcore(self, head) -> None:
        """Copy a ``tfcore.AttentionHead``'s weights."""
        if not self.built:
            self.build((None, None, head.q.in_features))
        for name in "qkv":
            _load_linear(getattr(self, f"w{name}"), getattr(self, f"b{name}"), getattr(head, name))


class MultiHeadAttentionLayer(keras.layers.Layer):
    """``num_heads`` heads side by side, their outputs concatenated, then a Dense layer.

    ``call(query [B, Lq, d_model], key [B, Lk, d_model] = query, value = key, attn_mask=None)`` ->
    ``[B, Lq, d_model]``. The counterpart of ``tfcore.MultiHeadAttention``, which computes every
    head with one fused projection: head ``i`` owns its rows ``i*head_dim .. (i+1)*head_dim - 1``.
    Unlike it, no dropout on the attention weights: the two agree at inference, or with that
    dropout at 0.
    """

    def __init__(self, d_model: int, num_heads: int, **kwargs):
        super().__init__(**kwargs)
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be a whole number >= 1, got {num_heads!r}")
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) is not divisible by num_heads ({num_heads}): every head must "
                             f"get the same width; choose a d_model that is a multiple of {num_heads}")
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.heads = [SelfAttentionLayer(self.head_dim, name=f"head_{i}") for i in range(num_heads)]
        self.output_linear = keras.layers.Dense(d_model, name="output_linear")

    def call(self, query, key=None, value=None, attn_mask=None):
        for name, x in (("query", query), ("key", key), ("value", value)):
            if x is not None:
                _check_width(name, x, self.d_model)
        heads = [head(query, key, value, attn_mask=attn_mask) for head in self.heads]
        return self.output_linear(ops.concatenate(heads, axis=-1))

    def compute_output_shape(self, input_shape, *args, **kwargs):
        return tuple(input_shape)

    def load_tfcore(self, attention) -> None:
        """Copy a ``tfcore.MultiHeadAttention``: cut its fused query/key/value rows into the heads."""
        d = self.head_dim
        for i, head in enumerate(self.heads):
            if not head.built:
                head.build((None, None, self.d_model))
            for name, linear in (("q", attention.query), ("k", attention.key), ("v", attention.value)):
                rows = slice(i * d, (i + 1) * d)
                getattr(head, f"w{name}").assign(_numpy(linear.weight[rows]).T)
                getattr(head, f"b{name}").assign(_numpy(linear.bias[rows]))
        if not self.output_linear.built:
            self.output_linear.build((None, None, self.d_model))
        _load_linear(self.output_linear.kernel, self.output_linear.bias, attention.output_linear)


class FeedForwardLayer(keras.layers.Layer):
    """Dense to ``d_ff``, the exact GELU, Dense back to ``d_model``, dropout: ``[B, L, d_model]`` -> same.

    Its weights are made in ``build``: ``w1 [d_model, d_ff]`` and ``w2 [d_ff, d_model]``. The
    counterpart of ``tfcore.FeedForward``.
    """

    def __init__(self, d_ff: int, dropout: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.d_ff = d_ff
        self.dropout = keras.layers.Dropout(dropout)

    def build(self, x_shape):
        d_model = x_shape[-1]
        self.w1 = self.add_weight(shape=(d_model, self.d_ff), initializer="glorot_uniform", name="w1")
        self.b1 = self.add_weight(shape=(self.d_ff,), initializer="zeros", name="b1")
        self.w2 = self.add_weight(shape=(self.d_ff, d_model), initializer="glorot_uniform", name="w2")
        self.b2 = self.add_weight(shape=(d_model,), initializer="zeros", name="b2")

    def call(self, x, training=None):
        hidden = keras.activations.gelu(ops.matmul(x, self.w1) + self.b1, approximate=False)
        return self.dropout(ops.matmul(hidden, self.w2) + self.b2, training=training)

    def compute_output_shape(self, x_shape):
        return tuple(x_shape)

    def load_tfcore(self, feed_forward) -> None:
        if not self.built:
            self.build((None, None, feed_forward.linear_1.in_features))
        _load_linear(self.w1, self.b1, feed_forward.linear_1)
        _load_linear(self.w2, self.b2, feed_forward.linear_2)


class EncoderLayer(keras.layers.Layer):
    """Pre-LN: ``x + attention(LN(x))``, then ``x + feed_forward(LN(x))``; ``[B, L, d_model]`` -> same.

    The counterpart of ``tfcore.TransformerEncoderLayer`` with ``norm_first=True``.
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.0, epsilon: float = 1e-5,
                 **kwargs):
        super().__init__(**kwargs)
        self.layer_norm_1 = keras.layers.LayerNormalization(epsilon=epsilon, name="layer_norm_1")
        self.attention = MultiHeadAttentionLayer(d_model, num_heads, name="attention")
        self.dropout = keras.layers.Dropout(dropout)
        self.layer_norm_2 = keras.layers.LayerNormalization(epsilon=epsilon, name="layer_norm_2")
        self.feed_forward = FeedForwardLayer(d_ff, dropout, name="feed_forward")

    def call(self, x, attn_mask=None, training=None):
        x = x + self.dropout(self.attention(self.layer_norm_1(x), attn_mask=attn_mask), training=training)
        return x + self.feed_forward(self.layer_norm_2(x), training=training)

    def compute_output_shape(self, input_shape, *args, **kwargs):
        return tuple(input_shape)

    def load_tfcore(self, layer) -> None:
        if not layer.norm_first:
            raise ValueError("this Keras layer is pre-LN; the tfcore layer is post-LN (norm_first=False)")
        shape = (None, None, layer.attention.hidden_size)
        for norm, torch_norm in ((self.layer_norm_1, layer.layer_norm_1), (self.layer_norm_2, layer.layer_norm_2)):
            if not norm.built:
                norm.build(shape)
            _load_layer_norm(norm, torch_norm)
        self.attention.load_tfcore(layer.attention)
        self.feed_forward.load_tfcore(layer.feed_forward)


class DecoderLayer(keras.layers.Layer):
    """Pre-LN: masked self-attention, cross-attention on the encoder's output, feed-forward.

    ``call(x [B, Lt, d_model], memory [B, Ls, d_model], src_mask, tgt_mask)`` -> ``[B, Lt, d_model]``.
    In the cross-attention the queries come from the decoder (``x``), the keys and the values from
    ``memory``. The counterpart of ``tfcore.TransformerDecoderLayer``.
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.0, epsilon: float = 1e-5,
                 **kwargs):
        super().__init__(**kwargs)
        self.layer_norm_1 = keras.layers.LayerNormalization(epsilon=epsilon, name="layer_norm_1")
        self.self_attention = MultiHeadAttentionLayer(d_model, num_heads, name="self_attention")
        self.layer_norm_2 = keras.layers.LayerNormalization(epsilon=epsilon, name="layer_norm_2")
        self.cross_attention = MultiHeadAttentionLayer(d_model, num_heads, name="cross_attention")
        self.layer_norm_3 = keras.layers.LayerNormalization(epsilon=epsilon, name="layer_norm_3")
        self.feed_forward = FeedForwardLayer(d_ff, dropout, name="feed_forward")
        self.dropout = keras.layers.Dropout(dropout)

    def call(self, x, memory, src_mask=None, tgt_mask=None, training=None):
        h = self.layer_norm_1(x)
        x = x + self.dropout(self.self_attention(h, attn_mask=tgt_mask), training=training)
        h = self.layer_norm_2(x)
        x = x + self.dropout(self.cross_attention(h, memory, memory, attn_mask=src_mask), training=training)
        return x + self.feed_forward(self.layer_norm_3(x), training=training)

    def compute_output_shape(self, input_shape, *args, **kwargs):
        return tuple(input_shape)

    def load_tfcore(self, layer) -> None:
        shape = (None, None, layer.self_attention.hidden_size)
        for i in (1, 2, 3):
            norm = getattr(self, f"layer_norm_{i}")
            if not norm.built:
                norm.build(shape)
            _load_layer_norm(norm, getattr(layer, f"layer_norm_{i}"))
        self.self_attention.load_tfcore(layer.self_attention)
        self.cross_attention.load_tfcore(layer.cross_attention)
        self.feed_forward.load_tfcore(layer.feed_forward)


def _sinusoids(max_len: int, d_model: int) -> np.ndarray:
    """``PE[pos, 2i] = sin(pos / 10000^(2i/d))``, ``PE[pos, 2i+1] = cos(...)``: ``[max_len, d_model]``."""
    position = np.arange(max_len, dtype=np.float32)[:, None]
    step = np.float32(-math.log(10000.0) / d_model)
    frequency = np.exp(np.arange(0, d_model, 2, dtype=np.float32) * step)
    table = np.zeros((max_len, d_model), dtype=np.float32)
    table[:, 0::2] = np.sin(position * frequency)
    table[:, 1::2] = np.cos(position * frequency)
    return table


def _values_known(x) -> bool:
    """Whether ``x``'s values exist now. They do not while a backend traces the call into a
    graph (Keras' symbolic build, ``jax.jit``, ``model.predict`` on JAX): then only the shape
    and dtype exist, and a check of the values (``int(ops.min(x))``) would fail. Such checks
    run eagerly only."""
    if isinstance(x, keras.KerasTensor):
        return False
    if keras.backend.backend() == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    return True


class PositionalEmbedding(keras.layers.Layer):
    """Token embeddings times √d_model plus the fixed sinusoids, then dropout:
    ``[B, L]`` ids -> ``[B, L, d_model]``.

    The sinusoids are a non-trainable weight (PyTorch would register a buffer). The
    counterpart of ``tfcore``'s ``ScaledEmbedding``.
    """

    def __init__(self, vocab_size: int, d_model: int, max_len: int = 512, dropout: float = 0.0,
                 **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.d_model, self.max_len = vocab_size, d_model, max_len
        self.token_embeddings = keras.layers.Embedding(
            vocab_size, d_model, embeddings_initializer="glorot_uniform", name="token_embeddings")
        self.dropout = keras.layers.Dropout(dropout)

    def build(self, ids_shape):
        self.token_embeddings.build(ids_shape)
        table = keras.initializers.Constant(_sinusoids(self.max_len, self.d_model))
        self.positions = self.add_weight(shape=(self.max_len, self.d_model), trainable=False,
                                         name="positions", initializer=table)

    def call(self, ids, training=None):
        if len(ids.shape) != 2:
            raise ValueError(f"ids must be a 2-D [B, L] tensor of token ids, got shape "
                             f"{tuple(ids.shape)}")
        dtype = keras.backend.standardize_dtype(ids.dtype)
        if "int" not in dtype:
            raise ValueError(f"ids must hold integers (token ids), got {dtype}: convert them "
                             f"with ids.astype('int32') or keras.ops.cast(ids, 'int32')")
        length = ids.shape[1]
        if length is not None and length > self.max_len:
            raise ValueError(f"a sequence of {length} tokens is longer than the {self.max_len} "
                             f"positions (max_len) this embedding has; shorten it or build "
                             f"with a larger max_len")
        if _values_known(ids) and ops.size(ids):
            low, high = int(ops.min(ids)), int(ops.max(ids))
            if low < 0 or high >= self.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.vocab_size}) (vocab_size), "
                                 f"got ids from {low} to {high}")
        x = self.token_embeddings(ids) * math.sqrt(self.d_model) + self.positions[:length]
        return self.dropout(x, training=training)

    def compute_output_shape(self, ids_shape):
        return (*ids_shape, self.d_model)

    def load_tfcore(self, embedding) -> None:
        """Copy a ``ScaledEmbedding``: its token embeddings and its first ``max_len`` sinusoids."""
        if embedding.positions.shape[0] < self.max_len:
            raise ValueError(f"the tfcore embedding has {embedding.positions.shape[0]} positions, "
                             f"fewer than this one's max_len {self.max_len}: build with a "
                             f"smaller max_len")
        if not self.built:
            self.build((None, None))
        self.token_embeddings.embeddings.assign(_numpy(embedding.token_embeddings.weight))
        self.positions.assign(_numpy(embedding.positions[: self.max_len]))


@keras.saving.register_keras_serializable(package="tfcore")
class Transformer(keras.Model):
    """The encoder-decoder of chapters 9-10 (pre-LN), as a Keras model.

    ``call((src [B, Ls], tgt [B, Lt]))`` -> logits ``[B, Lt, tgt_vocab]``. The source mask
    (``src != pad_id``, ``[B, 1, Ls]``) and the causal target mask ``[1, Lt, Lt]`` are made
    inside. ``load_tfcore`` copies a ``tfcore.EncoderDecoder`` (pre-LN, exact GELU, the same
    sizes and layer-norm epsilon), which gives log-probabilities: ``log_softmax`` of these
    logits. ``get_config`` and ``build_from_config`` let ``model.save("m.keras")`` and
    ``keras.saving.load_model`` round-trip it.
    """

    def __init__(self, src_vocab: int, tgt_vocab: int, N: int = 2, d_model: int = 512,
                 d_ff: int = 2048, num_heads: int = 8, dropout: float = 0.1, max_len: int = 512,
                 pad_id: int = 0, epsilon: float = 1e-5, **kwargs):
        super().__init__(**kwargs)
        self.settings = dict(src_vocab=src_vocab, tgt_vocab=tgt_vocab, N=N, d_model=d_model,
                             d_ff=d_ff, num_heads=num_heads, dropout=dropout, max_len=max_len,
                             pad_id=pad_id, epsilon=epsilon)
        self.pad_id, self.d_model = pad_id, d_model
        self.src_embed = PositionalEmbedding(src_vocab, d_model, max_len, dropout, name="src_embed")
        self.tgt_embed = PositionalEmbedding(tgt_vocab, d_model, max_len, dropout, name="tgt_embed")
        sizes = (d_model, num_heads, d_ff, dropout, epsilon)
        self.encoder_layers = [EncoderLayer(*sizes, name=f"encoder_layer_{i}") for i in range(N)]
        self.encoder_norm = keras.layers.LayerNormalization(epsilon=epsilon, name="encoder_norm")
        self.decoder_layers = [DecoderLayer(*sizes, name=f"decoder_layer_{i}") for i in range(N)]
        self.decoder_norm = keras.layers.LayerNormalization(epsilon=epsilon, name="decoder_norm")
        self.generator = keras.layers.Dense(tgt_vocab, name="generator")

    def get_config(self):
        """What ``__init__`` needs to build this model again (``model.save`` stores it)."""
        return {**super().get_config(), **self.settings}

    def build_from_config(self, config):
        """Make every weight by one call, so that ``keras.saving.load_model`` can fill them."""
        one = np.full((1, 1), self.pad_id + 1, dtype="int32")
        self((one, one))

    def source_mask(self, src):
        """``[B, 1, Ls]``: True for the real tokens, False for padding."""
        return ops.expand_dims(ops.not_equal(src, self.pad_id), 1)

    def encode(self, src, src_mask, training=None):
        x = self.src_embed(src, training=training)
        for layer in self.encoder_layers:
            x = layer(x, attn_mask=src_mask, training=training)
        return self.encoder_norm(x)

    def decode(self, memory, src_mask, tgt, training=None):
        length = tgt.shape[1]
        tgt_mask = ops.expand_dims(ops.tril(ops.ones((length, length), dtype="bool")), 0)
        x = self.tgt_embed(tgt, training=training)
        for layer in self.decoder_layers:
            x = layer(x, memory, src_mask=src_mask, tgt_mask=tgt_mask, training=training)
        return self.decoder_norm(x)

    def call(self, inputs, training=None):
        src, tgt = inputs
        src_mask = self.source_mask(src)
        memory = self.encode(src, src_mask, training)
        return self.generator(self.decode(memory, src_mask, tgt, training))

    def greedy_decode(self, src, max_len: int, start_id: int):
        """The most probable next token, step by step: ``[B, max_len]`` ids from ``start_id``."""
        src_mask = self.source_mask(src)
        memory = self.encode(src, src_mask, training=False)
        ys = ops.full((src.shape[0], 1), start_id, dtype="int32")
        for _ in range(max_len - 1):
            logits = self.generator(self.decode(memory, src_mask, ys, training=False)[:, -1])
            next_ids = ops.cast(ops.argmax(logits, axis=-1), "int32")[:, None]
            ys = ops.concatenate([ys, next_ids], axis=1)
        return ys

    def load_tfcore(self, model) -> None:
        """Copy every weight of a ``tfcore.EncoderDecoder`` built with the same settings."""
        if len(model.encoder_layers) != len(self.encoder_layers):
            raise ValueError(f"the tfcore model has {len(model.encoder_layers)} layers per side, "
                             f"this one {len(self.encoder_layers)}: build both with the same N")
        if model.encoder_norm.eps != self.encoder_norm.epsilon:
            raise ValueError(f"the tfcore model's layer norms use eps {model.encoder_norm.eps:g}, "
                             f"this one {self.encoder_norm.epsilon:g}: build both with the "
                             f"same epsilon")
        if not self.built:
            self.build_from_config({})
        self.src_embed.load_tfcore(model.src_embed)
        self.tgt_embed.load_tfcore(model.tgt_embed)
        for ours, theirs in zip(self.encoder_layers, model.encoder_layers):
            ours.load_tfcore(theirs)
        for ours, theirs in zip(self.decoder_layers, model.decoder.layers):
            ours.load_tfcore(theirs)
        _load_layer_norm(self.encoder_norm, model.encoder_norm)
        _load_layer_norm(self.decoder_norm, model.decoder.norm)
        _load_linear(self.generator.kernel, self.generator.bias, model.generator.proj)


class WarmupLinearDecay(keras.optimizers.schedules.LearningRateSchedule):
    """``tfcore.train_seq2seq``'s rate: a linear warm-up to ``lr`` over ``warmup`` steps, then a
    straight line down to a tenth of ``lr`` at the last step (``step`` counts from 0)."""

    def __init__(self, lr: float, steps: int, warmup: int = 100):
        self.lr, self.steps, self.warmup = lr, steps, warmup

    def __call__(self, step):
        step = ops.cast(step, "float32")
        rise = (step + 1.0) / self.warmup
        fall = 1.0 - 0.9 * ops.maximum(step - self.warmup, 0.0) / max(1, self.steps - self.warmup)
        return self.lr * ops.minimum(rise, fall)

    def get_config(self):
        return {"lr": self.lr, "steps": self.steps, "warmup": self.warmup}
