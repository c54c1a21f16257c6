"""The Keras appendix's model equals tfcore's, piece by piece, once the weights are copied.

Every comparison is within 1e-5, on the same inputs and masks, in float32: Keras 3.15.1 computes
``keras.ops.matmul`` (and so ``Dense``) in float32 even for float64 inputs on the torch and JAX
backends, which a test below pins, so no float64 check near 1e-10 is possible. One test plants a
single weight copied without its transpose, another a zeroed layer-norm bias in a model with
every setting off its default and every parameter random, and shows that the comparison then
fails. The save/load round trip is exact, and fails without ``build_from_config``. The last test
runs the same model on the JAX backend (a separate process), eagerly and under jax.jit, with the
same weights and the same planted weight.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig

import tfcore
from tfcore import keras_transformer as kt
from tfcore.training import BOS, PAD

keras = kt.keras
ops = kt.ops

D_MODEL, HEADS, D_FF = 32, 4, 64
CONFIG = BertConfig(hidden_size=D_MODEL, num_attention_heads=HEADS, intermediate_size=D_FF, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, layer_norm_eps=1e-5, norm_first=True)


def numpy(x):
    return ops.convert_to_numpy(x) if not isinstance(x, torch.Tensor) else x.detach().cpu().numpy()


def gap(keras_output, torch_output) -> float:
    return float(np.abs(numpy(keras_output) - numpy(torch_output)).max())


@pytest.fixture
def inputs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, D_MODEL, generator=generator)
    memory = torch.randn(3, 5, D_MODEL, generator=generator)
    src_mask = torch.ones(3, 1, 5, dtype=torch.bool)
    src_mask[1, :, 3:] = False  # the second source has 3 real tokens, then padding
    return x, memory, src_mask


def test_one_head(inputs):
    x, memory, src_mask = inputs
    torch.manual_seed(0)
    head = tfcore.AttentionHead(D_MODEL, 8)
    ours = kt.SelfAttentionLayer(8)
    ours.load_tfcore(head)
    with torch.no_grad():
        expected, expected_weights = head(x, memory, mask=src_mask, return_weights=True)
    output, weights = ours(x, memory, attn_mask=src_mask, return_weights=True)
    assert tuple(output.shape) == (3, 7, 8)
    assert gap(output, expected) < 1e-5 and gap(weights, expected_weights) < 1e-5


def test_multi_head_attention_with_masks(inputs):
    x, memory, src_mask = inputs
    torch.manual_seed(0)
    attention = tfcore.MultiHeadAttention(CONFIG).eval()
    ours = kt.MultiHeadAttentionLayer(D_MODEL, HEADS)
    ours.load_tfcore(attention)
    causal = tfcore.causal_mask(7)
    with torch.no_grad():
        assert gap(ours(x, attn_mask=causal), attention(x, mask=causal)) < 1e-5
        assert gap(ours(x, memory, memory, attn_mask=src_mask), attention(x, memory, mask=src_mask)) < 1e-5
    blocked = torch.zeros(3, 1, 5, dtype=torch.bool)  # every key blocked: zero weights, not NaN
    _, weights = ours.heads[0](x, memory, attn_mask=blocked, return_weights=True)
    assert np.all(numpy(weights) == 0)


def test_feed_forward(inputs):
    x, _, _ = inputs
    torch.manual_seed(0)
    feed_forward = tfcore.FeedForward(CONFIG).eval()
    ours = kt.FeedForwardLayer(D_FF)
    ours.load_tfcore(feed_forward)
    assert tuple(ours.w1.shape) == (D_MODEL, D_FF) and tuple(ours.w2.shape) == (D_FF, D_MODEL)
    with torch.no_grad():
        assert gap(ours(x), feed_forward(x)) < 1e-5


def test_encoder_and_decoder_layers(inputs):
    x, memory, src_mask = inputs
    torch.manual_seed(0)
    encoder_layer = tfcore.TransformerEncoderLayer(CONFIG).eval()
    decoder_layer = tfcore.TransformerDecoderLayer(CONFIG).eval()
    for parameter in [*encoder_layer.parameters(), *decoder_layer.parameters()]:
        torch.nn.init.normal_(parameter, std=0.3)  # LayerNorm weights and biases away from 1 and 0 too
    ours_encoder = kt.EncoderLayer(D_MODEL, HEADS, D_FF)
    ours_encoder.load_tfcore(encoder_layer)
    ours_decoder = kt.DecoderLayer(D_MODEL, HEADS, D_FF)
    ours_decoder.load_tfcore(decoder_layer)
    causal = tfcore.causal_mask(7)
    with torch.no_grad():
        assert gap(ours_encoder(memory, attn_mask=src_mask), encoder_layer(memory, src_mask)) < 1e-5
        expected = decoder_layer(x, memory, src_mask=src_mask, tgt_mask=causal)
        assert gap(ours_decoder(x, memory, src_mask=src_mask, tgt_mask=causal), expected) < 1e-5


def _models(N=2, seed=0):
    tfcore.setup(seed)
    theirs = tfcore.make_model(13, 13, N=N, d_model=D_MODEL, d_ff=D_FF, h=HEADS, dropout=0.0, verbose=False).eval()
    ours = kt.Transformer(13, 13, N=N, d_model=D_MODEL, d_ff=D_FF, num_heads=HEADS, dropout=0.0)
    ours.load_tfcore(theirs)
    return ours, theirs


def _log_probs(ours, theirs, src, tgt):
    with torch.no_grad():
        expected = theirs.generator(theirs(src, tgt, (src != PAD).unsqueeze(1)))
    return ops.log_softmax(ours((src, tgt)), axis=-1), expected


def test_the_whole_encoder_decoder():
    ours, theirs = _models()
    src, tgt = tfcore.digit_reversal(16, seed=5)
    assert (src == PAD).any()  # the source mask matters
    assert sum(int(np.prod(w.shape)) for w in ours.trainable_weights) == sum(p.numel() for p in theirs.parameters())
    assert gap(*_log_probs(ours, theirs, src, tgt[:, :-1])) < 1e-5
    theirs_tokens = tfcore.greedy_decode(theirs, src, (src != PAD).unsqueeze(1), max_len=12, start_symbol=BOS)
    assert np.array_equal(numpy(ours.greedy_decode(src, max_len=12, start_id=BOS)), numpy(theirs_tokens))


def test_one_weight_copied_without_its_transpose_breaks_the_equality():
    ours, theirs = _models()
    src, tgt = tfcore.digit_reversal(16, seed=5)
    assert gap(*_log_probs(ours, theirs, src, tgt[:, :-1])) < 1e-5
    kernel = ours.encoder_layers[0].attention.output_linear.kernel  # square: it loads without complaint
    kernel.assign(numpy(theirs.encoder_layers[0].attention.output_linear.weight))  # the weight, not its transpose
    assert gap(*_log_probs(ours, theirs, src, tgt[:, :-1])) > 1e-3


def _off_default_pair():
    """A tfcore model and its Keras port with every setting off its default and every
    parameter random, layer-norm weights and biases included."""
    config = BertConfig(hidden_size=24, num_hidden_layers=3, num_attention_heads=3, intermediate_size=40,
                        hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3, layer_norm_eps=1e-3)
    torch.manual_seed(0)
    theirs = tfcore.EncoderDecoder(config, 11, 17).eval()
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.normal_(0, 0.5)
    ours = kt.Transformer(11, 17, N=3, d_model=24, d_ff=40, num_heads=3, dropout=0.3, max_len=20, pad_id=2,
                          epsilon=1e-3)
    ours.load_tfcore(theirs)
    generator = torch.Generator().manual_seed(1)
    src = torch.randint(3, 11, (4, 9), generator=generator)
    src[1, 6:] = 2
    tgt = torch.randint(3, 17, (4, 7), generator=generator)
    return ours, theirs, src, tgt


def _off_default_gap(ours, theirs, src, tgt):
    with torch.no_grad():
        expected = theirs.generator(theirs(src, tgt, (src != 2).unsqueeze(1)))
    return gap(ops.log_softmax(ours((src, tgt), training=False), axis=-1), expected)


def test_every_setting_off_its_default_and_a_planted_layer_norm_bias():
    ours, theirs, src, tgt = _off_default_pair()
    norm = theirs.decoder.layers[1].layer_norm_2
    assert (norm.weight != 1).all() and (norm.bias != 0).all()  # the norm is not at its defaults
    assert _off_default_gap(ours, theirs, src, tgt) < 1e-5
    ours.decoder_layers[1].layer_norm_2.beta.assign(np.zeros(24, dtype="float32"))
    assert _off_default_gap(ours, theirs, src, tgt) > 1e-3
    ours, theirs, src, tgt = _off_default_pair()
    ours.src_embed.positions.assign(np.zeros((20, 24), dtype="float32"))  # the sinusoids are copied too
    assert _off_default_gap(ours, theirs, src, tgt) > 1e-3


def test_keras_multiplies_float64_in_float32_on_this_backend():
    x = torch.randn(4, 4, dtype=torch.float64)
    assert ops.matmul(x, x).dtype == torch.float32  # if this changes, add a float64 check near 1e-10
    assert ops.add(x, x).dtype == torch.float64


def test_keras_multi_head_attention_holds_tfcore_weights(inputs):
    x, memory, src_mask = inputs
    torch.manual_seed(0)
    attention = tfcore.MultiHeadAttention(CONFIG).eval()
    theirs = keras.layers.MultiHeadAttention(num_heads=HEADS, key_dim=D_MODEL // HEADS)
    theirs(x, memory, memory)
    shape = (D_MODEL, HEADS, D_MODEL // HEADS)
    for dense, linear in ((theirs.query_dense, attention.query), (theirs.key_dense, attention.key),
                          (theirs.value_dense, attention.value)):
        dense.kernel.assign(numpy(linear.weight).T.reshape(shape))
        dense.bias.assign(numpy(linear.bias).reshape(shape[1:]))
    theirs.output_dense.kernel.assign(numpy(attention.output_linear.weight).T.reshape(shape[1:] + shape[:1]))
    theirs.output_dense.bias.assign(numpy(attention.output_linear.bias))
    with torch.no_grad():
        assert gap(theirs(x, memory, memory, attention_mask=src_mask), attention(x, memory, mask=src_mask)) < 1e-5
        assert gap(theirs(x, x, x, use_causal_mask=True), attention(x, mask=tfcore.causal_mask(7))) < 1e-5
        theirs.output_dense.kernel.assign(numpy(attention.output_linear.weight).reshape(shape[1:] + shape[:1]))
        assert gap(theirs(x, x, x, use_causal_mask=True), attention(x, mask=tfcore.causal_mask(7))) > 1e-3


def test_save_and_load_round_trip(tmp_path):
    ours, theirs = _models()
    src, tgt = tfcore.digit_reversal(16, seed=5)
    path = tmp_path / "model.keras"
    ours.save(path)
    loaded = keras.saving.load_model(path, compile=False)
    assert isinstance(loaded, kt.Transformer) and loaded.get_config()["d_model"] == D_MODEL
    assert gap(loaded((src, tgt[:, :-1])), ours((src, tgt[:, :-1]))) == 0
    assert gap(*_log_probs(loaded, theirs, src, tgt[:, :-1])) < 1e-5


@keras.saving.register_keras_serializable(package="tests")
class _WithoutBuildFromConfig(kt.Transformer):
    build_from_config = keras.Model.build_from_config  # Keras' own: cannot build this model


def test_without_build_from_config_the_loaded_model_keeps_random_weights(tmp_path):
    ours, _ = _models()
    planted = _WithoutBuildFromConfig(13, 13, N=2, d_model=D_MODEL, d_ff=D_FF, num_heads=HEADS, dropout=0.0)
    src, tgt = tfcore.digit_reversal(16, seed=5)
    planted((src, tgt))
    planted.set_weights(ours.get_weights())
    assert gap(planted((src, tgt)), ours((src, tgt))) == 0
    planted.save(tmp_path / "planted.keras")
    with pytest.warns(UserWarning, match="build_from_config"):
        loaded = keras.saving.load_model(tmp_path / "planted.keras", compile=False)
    assert gap(loaded((src, tgt)), ours((src, tgt))) > 1e-3


def test_loss_and_schedule_match_the_torch_training():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 13, generator=generator)
    target = torch.randint(3, 13, (4, 6), generator=generator)
    target[:, 4:] = PAD
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=PAD)(target, logits)
    expected = F.nll_loss(logits.log_softmax(-1).flatten(0, 1), target.flatten(), ignore_index=PAD)
    assert abs(float(loss) - expected.item()) < 1e-6
    schedule = kt.WarmupLinearDecay(2e-3, steps=626, warmup=100)
    for step in (0, 50, 99, 100, 101, 400, 625):
        assert math.isclose(float(schedule(step)), 2e-3 * tfcore.lr_factor(step, 626, 100), rel_tol=1e-6)


@pytest.mark.parametrize("build, problem", [
    (lambda: kt.MultiHeadAttentionLayer(30, 4), "not divisible by num_heads"),
    (lambda: kt.MultiHeadAttentionLayer(32, 0), "num_heads must be a whole number >= 1"),
    (lambda: kt.MultiHeadAttentionLayer(32, 4)(torch.zeros(2, 5, 16)), "must have shape [B, L, 32]"),
    (lambda: kt.PositionalEmbedding(13, 8)(torch.tensor([[3, 13]])), "token ids must be in [0, 13)"),
    (lambda: kt.PositionalEmbedding(13, 8, max_len=4)(torch.ones(1, 5, dtype=torch.long)), "longer than the 4 positions"),
    (lambda: kt.PositionalEmbedding(13, 8)(np.array([[3.0, 4.0]])), "must hold integers"),
    (lambda: kt.Transformer(13, 13, N=1, d_model=32, d_ff=64, num_heads=4).load_tfcore(_models(N=2)[1]),
     "build both with the same N"),
    (lambda: kt.Transformer(13, 13, N=2, d_model=32, d_ff=64, num_heads=4, epsilon=1e-3).load_tfcore(_models()[1]),
     "build both with the same epsilon"),
    (lambda: kt.Transformer(13, 13, N=2, d_model=32, d_ff=64, num_heads=4, max_len=600).load_tfcore(_models()[1]),
     "fewer than this one's max_len 600"),
])
def test_bad_input_gets_a_clear_error(build, problem):
    with pytest.raises(ValueError) as error:
        build()
    assert problem in str(error.value)


# The same model on the JAX backend. Keras chooses its backend at its first import, so the run is a
# separate Python process with KERAS_BACKEND=jax. It receives the weights of the torch-backend Keras
# model (copied from tfcore) as NumPy arrays, twice: as they are, and with one square kernel planted
# without its transpose. It reports the largest gaps to tfcore's log-probabilities: eagerly, through
# `model.predict` (which Keras compiles with jax.jit on this backend) and through jax.jit of a
# stateless call. (Greedy decoding is left out: JAX compiles every operation again for each new
# length, and the loop took about 40 s here.)
JAX_RUN = r'''
import json, sys
import numpy as np
import jax
from tfcore import keras_transformer as kt

keras, ops = kt.keras, kt.ops
data = np.load(sys.argv[1])
paths = json.loads(str(data["paths"]))
src, tgt, expected = data["src"], data["tgt"], data["expected"]
report = {"backend": keras.backend.backend()}
model = kt.Transformer(13, 13, N=2, d_model=32, d_ff=64, num_heads=4, dropout=0.0)
model((src, tgt))  # builds every weight (JAX compiles each eager op per shape: the shape used below)
assert [v.path.split("/", 1)[1] for v in model.weights] == paths, "the weights are not in the same order"
traced = []


@jax.jit
def stateless(trainable, non_trainable, s, t):
    traced.append(isinstance(s, jax.core.Tracer))
    return jax.nn.log_softmax(model.stateless_call(trainable, non_trainable, (s, t))[0], axis=-1)


# One model and one compiled function for both sets of weights (the weights are arguments of
# the compiled calls): JAX compiles once, the second set runs the same compiled code.
for name in ("right", "planted"):
    for i, variable in enumerate(model.weights):
        variable.assign(data[f"{name}_{i}"])
    eager = ops.convert_to_numpy(ops.log_softmax(model((src, tgt)), axis=-1))
    predicted = np.asarray(jax.nn.log_softmax(model.predict((src, tgt), batch_size=len(src), verbose=0), axis=-1))
    jitted = np.asarray(stateless([v.value for v in model.trainable_variables],
                                  [v.value for v in model.non_trainable_variables], src, tgt))
    report[name] = {"eager": float(np.abs(eager - expected).max()),
                    "predict": float(np.abs(predicted - expected).max()),
                    "jit": float(np.abs(jitted - expected).max()),
                    "jit_traced": traced == [True], "predict_jit_compiled": bool(model.jit_compile)}
try:
    model.src_embed(np.array([[3, 13]], dtype="int32"))
    report["eager_error"] = None
except ValueError as error:
    report["eager_error"] = str(error)
bad = src.copy()
bad[0, 0] = 13  # out of range, inside jax.jit: no values to check there
report["jit_bad_id_nan"] = bool(np.isnan(model.predict((bad, tgt), batch_size=len(src), verbose=0)[0]).all())
print("REPORT" + json.dumps(report))
'''


def _run_on_jax(tmp_path):
    import json
    import os
    import subprocess
    import sys

    ours, theirs = _models()
    src, tgt = tfcore.digit_reversal(16, seed=5)
    tgt = tgt[:, :-1]
    expected = numpy(_log_probs(ours, theirs, src, tgt)[1])
    weights = {f"right_{i}": numpy(v) for i, v in enumerate(ours.weights)}
    planted = dict(weights)
    for i, v in enumerate(ours.weights):
        if v.path.endswith("encoder_layer_0/attention/output_linear/kernel"):  # square: loads without complaint
            planted[f"planted_{i}"] = weights[f"right_{i}"].T.copy()
    assert len(planted) == len(weights) + 1
    planted.update({f"planted_{i}": weights[f"right_{i}"] for i in range(len(ours.weights)) if f"planted_{i}" not in planted})
    np.savez(tmp_path / "weights.npz", src=src.numpy().astype("int32"), tgt=tgt.numpy().astype("int32"),
             expected=expected, paths=json.dumps([v.path.split("/", 1)[1] for v in ours.weights]), **planted)
    (tmp_path / "run.py").write_text(JAX_RUN)
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path / "weights.npz")], env=env,
                            capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 0, result.stderr[-3000:]
    line = [line for line in result.stdout.splitlines() if line.startswith("REPORT")][-1]
    return json.loads(line[len("REPORT"):])


def test_the_same_layers_run_on_jax_eagerly_and_under_jit(tmp_path):
    report = _run_on_jax(tmp_path)
    assert report["backend"] == "jax"
    right, planted = report["right"], report["planted"]
    for way in ("eager", "predict", "jit"):  # the same weights give tfcore's log-probabilities on JAX
        assert right[way] < 1e-5, (way, right[way])
        assert planted[way] > 1e-3, (way, planted[way])  # and one weight without its transpose breaks it
    assert right["jit_traced"] and right["predict_jit_compiled"]
    assert "token ids must be in [0, 13)" in report["eager_error"]  # eager: the clear error stays
    assert report["jit_bad_id_nan"]  # under jit no value can be checked: JAX fills an unknown row with NaN
