"""tfcore.diagrams: every diagram shows the sizes it was given, in the order the code computes.

The drawings are checked through their text artists and patches: each label carries a ``gid``
saying what it labels, and a drawing flows left to right or bottom to top, so the order of the
operations is the order of the labels' coordinates. The layer diagrams are compared with the
order in which tfcore's own layers call their modules.
"""

import ast
import itertools
from pathlib import Path

import pytest
import torch
from transformers import BertConfig

pytest.importorskip("matplotlib")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

import tfcore  # noqa: E402
from tfcore import diagrams  # noqa: E402
from tfcore.hybrid import FULL, LINEAR, GatedDeltaNet, Qwen35Config, RecurrentLayerCache  # noqa: E402

TFCORE = Path(tfcore.__file__).parent


def texts(fig, gid=None):
    """The non-empty text artists of a diagram (arrows are empty Annotations), optionally by gid."""
    found = [t for t in fig.axes[0].texts if t.get_text()]
    return found if gid is None else [t for t in found if t.get_gid() == gid]


def one(fig, gid):
    [text] = texts(fig, gid)
    return text


def xy(text):
    return text.get_position()


# ------------------------------------------------------------------------- attention

def test_attention_diagram_labels_every_tensor_with_its_shape():
    fig = diagrams.attention_diagram(batch=2, len_q=3, len_k=4, d_k=8, d_v=6)
    expected = {"tensor:Q": "[2, 3, 8]", "tensor:K": "[2, 4, 8]", "tensor:V": "[2, 4, 6]",
                "tensor:K^T": "[2, 8, 4]", "tensor:scores": "[2, 3, 4]", "tensor:scaled": "[2, 3, 4]",
                "tensor:weights": "[2, 3, 4]", "tensor:output": "[2, 3, 6]"}
    for gid, shape in expected.items():
        assert shape in one(fig, gid).get_text().splitlines(), (gid, one(fig, gid).get_text())
    assert "÷ √8" in one(fig, "op:scale").get_text()
    assert "softmax(dim=-1)" in one(fig, "op:softmax").get_text()
    assert "transpose" in one(fig, "op:transpose").get_text()


def test_attention_diagram_square_scores():
    fig = diagrams.attention_diagram(2, 5, 5, 16, 16)
    assert one(fig, "tensor:scores").get_text().splitlines()[-1] == "[2, 5, 5]"


def test_attention_diagram_flows_in_the_order_of_the_computation():
    fig = diagrams.attention_diagram(1, 5, 5, 384, 384)
    q, kt, scores, scaled = (xy(one(fig, g)) for g in ("tensor:Q", "tensor:K^T", "tensor:scores", "tensor:scaled"))
    weights, output = xy(one(fig, "tensor:weights")), xy(one(fig, "tensor:output"))
    assert q[0] < kt[0] < scores[0] < scaled[0]            # left to right: Kᵀ, then the scores, then ÷ √dk
    assert scaled[1] > one(fig, "op:softmax").get_position()[1] > weights[1] > output[1]  # then downwards
    assert "very negative" in one(fig, "mask").get_text()


# ------------------------------------------------------------------------- heads

@pytest.mark.parametrize("heads", [1, 3, 12])
def test_heads_diagram_cuts_the_hidden_axis_into_one_slice_per_head(heads):
    hidden, length = 8 * heads, 4
    fig = diagrams.heads_diagram(batch=2, length=length, hidden=hidden, heads=heads)
    patches = [p.get_gid() for p in fig.axes[0].patches if p.get_gid()]
    for stage in ("q", "view", "heads", "context", "back", "concat"):
        slices = [g for g in patches if g.startswith(f"{stage}:slice:")]
        assert sorted({int(g.rsplit(":", 1)[1]) for g in slices}) == list(range(heads)), stage
        assert len(slices) == heads * length, stage  # every drawn token row is cut into h slices
    assert sum(g.startswith("x:row") for g in patches) == length  # the input is not cut
    assert f"[2, 4, {heads}, 8]" in one(fig, "tensor:view").get_text()
    assert f"[2, {heads}, 4, 8]" in one(fig, "tensor:heads").get_text()
    assert f"[2, 4, {hidden}]" in one(fig, "tensor:output").get_text()
    assert f"weights [2, {heads}, 4, 4]" in one(fig, "op:attention").get_text()


def test_heads_diagram_draws_the_split_left_and_the_way_back_right():
    fig = diagrams.heads_diagram(1, 5, 768, 12, tokens=["time", "flies", "like", "an", "arrow"])
    left = [xy(one(fig, g)) for g in ("tensor:x", "tensor:q", "tensor:view", "tensor:heads")]
    right = [xy(one(fig, g)) for g in ("tensor:context", "tensor:back", "tensor:concat", "tensor:output")]
    assert [p[1] for p in left] == sorted((p[1] for p in left), reverse=True)  # downwards
    assert [p[1] for p in right] == sorted(p[1] for p in right)                 # upwards
    assert max(p[0] for p in left) < min(p[0] for p in right)
    assert [t.get_text() for t in texts(fig, "token")][:5] == ["time", "flies", "like", "an", "arrow"]


def test_heads_diagram_rejects_a_width_that_heads_do_not_divide():
    with pytest.raises(ValueError, match=r"hidden \(100\).*heads \(12\)"):
        diagrams.heads_diagram(1, 5, 100, 12)
    with pytest.raises(ValueError, match="tokens must name the 5 positions"):
        diagrams.heads_diagram(1, 5, 96, 4, tokens=["a", "b"])


# ------------------------------------------------------------------------- layers

def drawn_order(fig, x_range=None):
    """The module names under the boxes and the residual adds, bottom to top (one panel)."""
    items = [t for t in texts(fig) if t.get_gid() in ("name", "add", "final-norm")
             and (x_range is None or x_range[0] <= xy(t)[0] <= x_range[1])]
    return [t.get_text() if t.get_gid() != "add" else "+" for t in sorted(items, key=lambda t: xy(t)[1])]


def called_order(layer, *inputs):
    """The order in which a tfcore layer calls its named children in forward."""
    calls = []
    hooks = [module.register_forward_hook(lambda *_, name=name: calls.append(name))
             for name, module in layer.named_children() if name != "dropout"]
    with torch.no_grad():
        layer(*inputs)
    for hook in hooks:
        hook.remove()
    return calls


SMALL = dict(hidden_size=16, num_attention_heads=2, intermediate_size=32, num_hidden_layers=1)


@pytest.mark.parametrize("norm_first", [True, False])
def test_encoder_layer_diagram_draws_what_tfcores_layer_does(norm_first):
    config = BertConfig(**SMALL)
    config.norm_first = norm_first
    layer = tfcore.TransformerEncoderLayer(config).eval()
    calls = called_order(layer, torch.randn(1, 3, 16))
    drawn = [item for item in drawn_order(diagrams.layer_diagram("encoder", norm_first)) if item != "+"]
    assert drawn[:4] == calls
    assert calls == (["layer_norm_1", "attention", "layer_norm_2", "feed_forward"] if norm_first
                     else ["attention", "layer_norm_1", "feed_forward", "layer_norm_2"])


def test_pre_ln_adds_after_the_sublayer_and_post_ln_normalises_the_sum():
    pre = drawn_order(diagrams.layer_diagram("encoder", True))
    post = drawn_order(diagrams.layer_diagram("encoder", False))
    assert pre == ["layer_norm_1", "attention", "+", "layer_norm_2", "feed_forward", "+", "final LayerNorm"]
    assert post == ["attention", "+", "layer_norm_1", "feed_forward", "+", "layer_norm_2"]
    assert len(texts(diagrams.layer_diagram("encoder", False), "add-norm")) == 2  # the paper's "Add & Norm"
    assert not texts(diagrams.layer_diagram("encoder", True), "add-norm")


@pytest.mark.parametrize("norm_first", [True, False])
def test_encoder_diagram_with_embeddings_draws_tfcores_encoder(norm_first):
    config = BertConfig(**SMALL)
    config.norm_first = norm_first
    encoder = tfcore.TransformerEncoder(config)
    fig = diagrams.layer_diagram("encoder", norm_first, shape=(1, 3, 16), embeddings=True)
    drawn = drawn_order(fig)
    assert drawn[0] == "embeddings" and hasattr(encoder, "embeddings")
    assert drawn[1:] == drawn_order(diagrams.layer_diagram("encoder", norm_first))
    assert ("final LayerNorm" in drawn) == (encoder.final_layer_norm is not None)
    [embedding_text] = [t.get_text() for t in texts(fig, "embedding")]
    assert ("LayerNorm" in embedding_text) == (encoder.embeddings.layer_norm is not None)
    assert [t.get_text() for t in texts(fig, "tensor:input")] == ["input_ids [1, 3]"]
    with pytest.raises(ValueError, match="only for kind='encoder'"):
        diagrams.layer_diagram("decoder", norm_first, embeddings=True)


def test_decoder_layer_diagram_has_three_residual_adds_and_tfcores_order():
    config = BertConfig(**SMALL)
    layer = tfcore.TransformerDecoderLayer(config).eval()
    x, memory = torch.randn(1, 3, 16), torch.randn(1, 5, 16)
    calls = called_order(layer, x, memory, None, tfcore.causal_mask(3))
    fig = diagrams.layer_diagram("decoder", True, shape=(1, 3, 16), memory_shape=(1, 5, 16))
    drawn = drawn_order(fig)
    assert drawn.count("+") == 3
    assert [item for item in drawn if item not in ("+", "final LayerNorm")] == calls
    assert drawn == ["layer_norm_1", "self_attention", "+", "layer_norm_2", "cross_attention", "+",
                     "layer_norm_3", "feed_forward", "+", "final LayerNorm"]
    memory_label, cross = one(fig, "tensor:memory"), [t for t in texts(fig, "name") if t.get_text() == "cross_attention"][0]
    assert "[1, 5, 16]" in memory_label.get_text() and "[1, 3, 16]" in one(fig, "tensor:input").get_text()
    assert abs(xy(memory_label)[1] - xy(cross)[1]) < 0.2 and xy(memory_label)[0] < xy(cross)[0]  # from the side


def test_post_ln_decoder_has_three_add_and_norms_and_no_final_norm():
    fig = diagrams.layer_diagram("decoder", False)
    assert sum(t.get_text() == "+" for t in texts(fig, "add")) == 3
    assert len(texts(fig, "add-norm")) == 3
    assert not texts(fig, "final-norm") and not texts(fig, "name")  # tfcore has no post-LN decoder layer
    labels = sorted(texts(fig, "sublayer") + texts(fig, "norm") + texts(fig, "add"), key=lambda t: xy(t)[1])
    kinds = [t.get_gid() for t in labels]
    assert kinds == ["sublayer", "add", "norm"] * 3


def test_side_by_side_panels_each_hold_one_arrangement():
    fig = diagrams.layer_diagram("encoder", (True, False))
    titles = sorted(texts(fig, "title"), key=lambda t: xy(t)[0])
    assert [t.get_text().split()[0] for t in titles] == ["pre-LN", "post-LN"]
    middle = (xy(titles[0])[0] + xy(titles[1])[0]) / 2
    assert drawn_order(fig, (0, middle)) == drawn_order(diagrams.layer_diagram("encoder", True))
    assert drawn_order(fig, (middle, 1e9)) == drawn_order(diagrams.layer_diagram("encoder", False))


def test_encoder_decoder_diagram_feeds_the_memory_to_the_cross_attention():
    fig = diagrams.encoder_decoder_diagram(list("8668436"), ["<bos>", "6", "3", "4"], list("6348"))
    assert "[B, 7, d]" in one(fig, "tensor:memory").get_text()
    assert "[B, 4, vocab]" in one(fig, "tensor:output").get_text()
    assert "next tokens: 6 3 4 8" in one(fig, "tensor:output").get_text()
    assert sum(t.get_text() == "+" for t in texts(fig, "add")) == 2 + 3
    assert len(texts(fig, "final-norm")) == 2  # encoder_norm and decoder.norm
    with pytest.raises(ValueError, match="one token per target position"):
        diagrams.encoder_decoder_diagram(["1"], ["<bos>", "1"], ["1"])


def test_decoder_only_diagram_draws_what_tfcores_models_do():
    fig = diagrams.decoder_only_diagram(("gpt2", "llama"))
    titles = sorted(texts(fig, "title"), key=lambda t: xy(t)[0])
    assert [t.get_text() for t in titles] == ["GPT-2 (tfcore.GPT)", "Llama (tfcore.Llama)"]
    middle = (xy(titles[0])[0] + xy(titles[1])[0]) / 2
    panels = {"gpt2": (0, middle), "llama": (middle, 1e9)}

    def names(kind):
        low, high = panels[kind]
        return [t.get_text() for t in sorted(texts(fig, "name"), key=lambda t: xy(t)[1])
                if low <= xy(t)[0] <= high]

    gpt = tfcore.GPT(tfcore.GPTConfig(vocab_size=11, max_position_embeddings=8, hidden_size=16,
                                      num_hidden_layers=1, num_attention_heads=2)).eval()
    llama = tfcore.Llama(tfcore.LlamaConfig(vocab_size=11, max_position_embeddings=8, hidden_size=16,
                                            num_hidden_layers=1, num_attention_heads=4,
                                            num_key_value_heads=2, intermediate_size=24)).eval()
    cos, sin = tfcore.rotary_cos_sin(torch.arange(3), tfcore.rotary_frequencies(4))
    x = torch.randn(1, 3, 16)
    gpt_names, llama_names = names("gpt2"), names("llama")
    assert gpt_names[1:5] == called_order(gpt.blocks[0], x, tfcore.causal_mask(3))
    assert llama_names[1:5] == called_order(llama.layers[0], x, cos, sin, tfcore.causal_mask(3))
    assert gpt_names[0].split() == ["token_embeddings", "position_embeddings"]
    assert llama_names[0] == "embed_tokens"
    for model, drawn in ((gpt, gpt_names), (llama, llama_names)):
        children = dict(model.named_children())
        stack, final, head = drawn[5:]
        assert stack.removesuffix("[i]") in children and final in children and head == "lm_head"
        assert all(name in children for name in drawn[0].split())
    assert len(texts(fig, "add")) == 4 and len(texts(fig, "final-norm")) == 2
    assert [t.get_text() for t in texts(fig, "norm")].count("RMSNorm") == 2
    assert any("RoPE" in t.get_text() for t in texts(fig, "sublayer"))
    assert gpt.lm_head.weight is gpt.token_embeddings.weight and "tied" in texts(fig, "head")[0].get_text()
    assert llama.lm_head.weight is not llama.embed_tokens.weight


def test_decoder_only_diagram_numbers_llamas_four_changes_only_when_asked():
    assert texts(diagrams.decoder_only_diagram(), "key") == []
    assert not any(t.get_gid().startswith("change:") for t in texts(diagrams.decoder_only_diagram()))
    fig = diagrams.decoder_only_diagram(("gpt2", "llama"), changes=True)
    titles = sorted(texts(fig, "title"), key=lambda t: xy(t)[0])
    middle = (xy(titles[0])[0] + xy(titles[1])[0]) / 2
    marks = [t for t in texts(fig) if t.get_gid().startswith("change:")]
    assert all(xy(t)[0] > middle for t in marks)  # on the Llama panel only
    assert sorted(t.get_text() for t in marks) == ["1", "1", "1", "2", "2", "3", "4"]

    def boxes_marked(number):  # the boxes' texts at the height of each badge
        return sorted(b.get_text().split()[0] for t in marks if t.get_text() == number
                      for b in texts(fig) if b.get_gid() in ("norm", "final-norm", "sublayer", "embedding")
                      and xy(b)[0] > middle and abs(xy(b)[1] - xy(t)[1]) < 0.5)

    assert boxes_marked("1") == ["RMSNorm", "RMSNorm", "final"]
    assert boxes_marked("2") == ["masked", "token"] and boxes_marked("4") == ["masked"]
    assert boxes_marked("3") == ["SwiGLU:"]
    assert "1 RMSNorm, 2 RoPE (no position table), 3 SwiGLU, 4 GQA" in one(fig, "key").get_text()
    assert smallest_text_px(fig) >= 9


def test_decoder_only_diagram_draws_one_kind_and_refuses_others():
    assert len(texts(diagrams.decoder_only_diagram("llama"), "title")) == 1
    for bad in ("bert", (), ("gpt2", "t5")):
        with pytest.raises(ValueError, match="kinds must be 'gpt2', 'llama'"):
            diagrams.decoder_only_diagram(bad)


@pytest.mark.parametrize("kind, norm_first, message", [
    ("middle", True, "kind must be 'encoder' or 'decoder'"),
    ("encoder", "yes", "norm_first must be True"),
    ("decoder", (), "non-empty"),
])
def test_layer_diagram_rejects_bad_arguments(kind, norm_first, message):
    with pytest.raises(ValueError, match=message):
        diagrams.layer_diagram(kind, norm_first)


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "5"])
def test_sizes_must_be_positive_integers(value):
    with pytest.raises(ValueError, match=r"len_q must be a positive integer"):
        diagrams.attention_diagram(1, value, 5, 8, 8)


# ------------------------------------------------------------------------- Qwen3.5's hybrid

# chapter 20's toy (§20.4): every size of the Gated DeltaNet off its default
TOY = {"vocab_size": 101, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "gelu_pytorch_tanh",
       "partial_rotary_factor": 0.5, "linear_conv_kernel_dim": 3, "linear_key_head_dim": 12,
       "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4}
# the labels each config must show, written out by hand: conv_dim = 2 H_k d_k + H_v d_v (80; 8192)
EXPECTED = {
    "toy": {"op:in_proj_qkv": "Linear(64, 80)", "tensor:qkv": "[80]", "op:conv1d": "kernel 3",
            "tensor:conv_state": "[80, 2]", "op:act": "gelu_pytorch_tanh", "op:split": "q, k [2, 12]; v [4, 8]",
            "op:repeat": "× 2 → [4, 12]", "op:l2norm": "1/√12", "op:beta": "[4]", "op:g": "[4]",
            "tensor:state": "[4, 12, 8]", "op:rule": "chunks of 64", "tensor:o": "[4, 8]", "op:z": "[4, 8]",
            "op:out_proj": "Linear(32, 64)", "tensor:x": "[64]", "tensor:output": "[64]",
            "layer:full_attention": "4 q, 2 kv heads of 16", "head": "[B, L, 101]",
            "pattern": "4 layers: 3 Gated DeltaNet + 1 attention\nlayer_types: L L L F\n"
                       "hidden_act: gelu_pytorch_tanh"},
    "default": {"op:in_proj_qkv": "Linear(4096, 8192)", "tensor:qkv": "[8192]", "op:conv1d": "kernel 4",
                "tensor:conv_state": "[8192, 3]", "op:act": "silu", "op:split": "q, k [16, 128]; v [32, 128]",
                "op:repeat": "× 2 → [32, 128]", "op:l2norm": "1/√128", "op:beta": "[32]", "op:g": "[32]",
                "tensor:state": "[32, 128, 128]", "op:rule": "chunks of 64", "tensor:o": "[32, 128]",
                "op:z": "[32, 128]", "op:out_proj": "Linear(4096, 4096)", "tensor:x": "[4096]",
                "tensor:output": "[4096]", "layer:full_attention": "16 q, 4 kv heads of 256",
                "head": "[B, L, 248320]", "stack": "× 8",
                "pattern": "32 layers: 24 Gated DeltaNet + 8 attention\nlayer_types: L L L F, × 8"},
}
# the main path, bottom to top, in the order GatedDeltaNet.forward computes it
MAIN_PATH = ["tensor:x", "op:in_proj_qkv", "tensor:qkv", "op:conv1d", "op:act", "op:split", "op:repeat", "op:l2norm",
             "op:rule", "tensor:o", "op:gated_norm", "op:out_proj", "tensor:output"]
# the GatedDeltaNet child each drawn label stands for (conv1d's weight is used by hand, not called)
MODULE_LABELS = {"in_proj_qkv": "op:in_proj_qkv", "act_fn": "op:act", "in_proj_b": "op:beta", "in_proj_a": "op:g",
                 "in_proj_z": "op:z", "norm": "op:gated_norm", "out_proj": "op:out_proj"}


def hybrid_config(name):
    return Qwen35Config(**TOY) if name == "toy" else Qwen35Config()


def check_hybrid_labels(fig, expected):
    """Each label (by gid) holds its expected text; the error lists every one that does not."""
    wrong = {gid: (label, one(fig, gid).get_text()) for gid, label in expected.items()
             if label not in one(fig, gid).get_text()}
    assert not wrong, f"labels that differ from the expected ones (gid: expected, drawn): {wrong}"


def check_labels_match_the_module(fig, module, cache):
    """The labels give the shapes of tfcore's GatedDeltaNet and of the cache it filled."""
    hidden = module.in_proj_qkv.in_features
    conv_dim, kernel = module.conv1d.weight.shape[0], module.conv1d.weight.shape[-1]
    _, h_v, d_k, d_v = cache.recurrent_state.shape
    check_hybrid_labels(fig, {
        "op:in_proj_qkv": f"Linear({hidden}, {module.in_proj_qkv.out_features})",
        "op:conv1d": f"kernel {kernel}",
        "tensor:conv_state": str(list(cache.conv_state.shape[1:])),
        "tensor:state": str([h_v, d_k, d_v]),
        "op:beta": str([module.in_proj_b.out_features]), "op:g": str([module.in_proj_a.out_features]),
        "op:z": str([h_v, module.in_proj_z.out_features // h_v]),
        "op:split": f"q, k {[module.num_k_heads, d_k]}; v {[h_v, d_v]}",
        "op:out_proj": f"Linear({module.out_proj.in_features}, {module.out_proj.out_features})",
    })
    assert module.in_proj_qkv.out_features == conv_dim and module.out_proj.in_features == h_v * d_v


@pytest.fixture(scope="module")
def toy_layer():
    """The toy's GatedDeltaNet after one token through it, and its cache."""
    torch.manual_seed(0)
    module, cache = GatedDeltaNet(Qwen35Config(**TOY)), RecurrentLayerCache()
    with torch.no_grad():
        module(torch.randn(1, 1, TOY["hidden_size"]), cache)
    return module, cache


@pytest.mark.parametrize("name", ["toy", "default"])
def test_hybrid_diagram_labels_carry_the_configs_sizes(name):
    fig = diagrams.hybrid_diagram(hybrid_config(name))
    check_hybrid_labels(fig, EXPECTED[name])
    size = "64 → 96 → 64" if name == "toy" else "4096 → 12288 → 4096"
    assert len(texts(fig, "mlp")) == 4 and all(size in t.get_text() for t in texts(fig, "mlp"))
    state = EXPECTED[name]["tensor:state"]
    assert [t.get_text() for t in texts(fig, "layer:linear_attention")] == [f"Gated DeltaNet\nstate {state}"] * 3
    assert ("SwiGLU" in texts(fig, "mlp")[0].get_text()) == (name == "default")  # silu: SwiGLU


def test_hybrid_diagram_labels_are_the_shapes_of_tfcores_layer_and_cache(toy_layer):
    check_labels_match_the_module(diagrams.hybrid_diagram(Qwen35Config(**TOY)), *toy_layer)


def test_a_label_drifting_from_the_code_is_caught(toy_layer, monkeypatch):
    """Planted drifts: the drawing reads d_k where d_v belongs; conv_dim forgets that k has heads of its own."""
    drifted = Qwen35Config(**TOY)
    monkeypatch.setattr(drifted, "linear_value_head_dim", drifted.linear_key_head_dim)
    with pytest.raises(AssertionError) as caught:
        check_labels_match_the_module(diagrams.hybrid_diagram(drifted), *toy_layer)
    assert all(gid in str(caught.value) for gid in ("tensor:state", "op:z", "op:split", "op:out_proj"))
    monkeypatch.setattr(Qwen35Config, "conv_dim", property(
        lambda c: c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim))
    with pytest.raises(AssertionError) as caught:
        check_hybrid_labels(diagrams.hybrid_diagram(Qwen35Config(**TOY)), EXPECTED["toy"])
    assert all(gid in str(caught.value) for gid in ("op:in_proj_qkv", "tensor:qkv", "tensor:conv_state"))


def test_hybrid_diagram_flows_in_the_order_gated_delta_net_computes(toy_layer):
    fig = diagrams.hybrid_diagram(Qwen35Config(**TOY))
    main = [xy(one(fig, gid))[1] for gid in MAIN_PATH]
    assert main == sorted(main), MAIN_PATH
    module, _ = toy_layer
    calls = called_order(module, torch.randn(1, 5, TOY["hidden_size"]))
    drawn = sorted(MODULE_LABELS, key=lambda child: xy(one(fig, MODULE_LABELS[child]))[1])
    assert drawn == calls == ["in_proj_qkv", "act_fn", "in_proj_b", "in_proj_a", "in_proj_z", "norm", "out_proj"]
    rule, state = one(fig, "op:rule"), one(fig, "tensor:state")
    assert abs(xy(rule)[1] - xy(state)[1]) < 0.01 and xy(state)[0] > xy(rule)[0]  # the state beside the rule
    conv, conv_state = one(fig, "op:conv1d"), one(fig, "tensor:conv_state")
    assert abs(xy(conv)[1] - xy(conv_state)[1]) < 0.01 and xy(conv_state)[0] > xy(conv)[0]


def memory_boxes(fig):
    return sorted(p.get_gid() for p in fig.axes[0].patches
                  if isinstance(p, FancyBboxPatch) and p.get_facecolor()[:3] == to_rgb(diagrams.COLOURS["memory"]))


@pytest.mark.parametrize("name", ["toy", "default"])
def test_hybrid_diagram_draws_the_stack_layer_by_layer_and_the_cache_in_the_memory_colour(name):
    config = hybrid_config(name)
    fig = diagrams.hybrid_diagram(config)
    titles = sorted(texts(fig, "title"), key=lambda t: xy(t)[0])
    middle = (xy(titles[0])[0] + xy(titles[1])[0]) / 2
    stack = sorted((t for t in texts(fig) if xy(t)[0] < middle and t.get_gid() in
                    ("norm", "layer:linear_attention", "layer:full_attention", "mlp", "add")), key=lambda t: xy(t)[1])
    kinds = [t.get_gid().removeprefix("layer:") for t in stack if t.get_gid().startswith("layer:")]
    assert kinds == config.layer_types[:4] == [LINEAR, LINEAR, LINEAR, FULL]
    block = ["norm", "mixer", "add", "norm", "mlp", "add"]
    assert [t.get_gid() if not t.get_gid().startswith("layer:") else "mixer" for t in stack] == block * 4
    assert [t.get_text() for t in sorted(texts(fig, "layer-index"), key=lambda t: xy(t)[1])] == \
        [f"layer {i}" for i in range(4)]
    assert memory_boxes(fig) == ["tensor:conv_state", "tensor:state"]
    assert "cached" in one(fig, "tensor:state").get_text() and "cached" in one(fig, "tensor:conv_state").get_text()
    assert bool(texts(fig, "stack")) == (name == "default")  # "× 8" only where the pattern repeats


def test_hybrid_diagram_draws_one_layer_of_each_kind_when_the_pattern_does_not_repeat():
    kinds = [LINEAR] * 5 + [FULL] + [LINEAR] * 2 + [FULL] * 3
    fig = diagrams.hybrid_diagram(Qwen35Config(num_hidden_layers=11, layer_types=kinds, linear_num_key_heads=4,
                                               linear_num_value_heads=4))
    assert [t.get_text() for t in sorted(texts(fig, "layer-index"), key=lambda t: xy(t)[1])] == ["layer 0", "layer 5"]
    assert one(fig, "stack").get_text() == "one layer of each kind"
    assert one(fig, "pattern").get_text() == "11 layers: 7 Gated DeltaNet + 4 attention\nlayer_types: L×5 F L×2 F×3"
    assert "none" in one(fig, "op:repeat").get_text()  # H_v = H_k: nothing repeated


def test_hybrid_diagram_gives_every_label_a_gid_and_overlaps_none():
    for config in (Qwen35Config(**TOY), Qwen35Config()):
        fig = diagrams.hybrid_diagram(config)
        gids = {t.get_gid() for t in texts(fig)}
        assert None not in gids
        assert set(MAIN_PATH) | {"op:beta", "op:g", "op:z", "tensor:state", "tensor:conv_state", "title", "norm",
                                 "layer:linear_attention", "layer:full_attention", "mlp", "add", "pattern",
                                 "final-norm", "head", "tensor:input", "layer-index"} <= gids
        assert label_collisions(fig) == []


def test_the_collision_check_sees_a_label_on_another_and_one_spilling_from_its_box():
    fig = diagrams.hybrid_diagram(Qwen35Config(**TOY))
    state = one(fig, "tensor:state")
    state.set_position(xy(one(fig, "op:rule")))  # planted: the state's label on the rule's
    assert any(kind == "overlap" for kind, *_ in label_collisions(fig))
    fig = diagrams.hybrid_diagram(Qwen35Config(**TOY))
    one(fig, "op:split").set_text("split into heads: q, k [2, 12] and v [4, 8]")  # planted: too long for its box
    assert ("spills", "split into heads: q, k [2, 12] and v [4, 8]") in label_collisions(fig)


@pytest.mark.parametrize("bad", [None, {"hidden_size": 64}, "qwen3_5", BertConfig(**SMALL)])
def test_hybrid_diagram_wants_a_qwen35_config(bad):
    with pytest.raises(TypeError, match=r"config must be a tfcore.hybrid.Qwen35Config, got "):
        diagrams.hybrid_diagram(bad)


def label_collisions(fig):
    """Pairs of labels whose rendered extents overlap, and labels that spill out of the box they sit in."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    extents = [(t, t.get_window_extent(renderer)) for t in texts(fig)]
    found = [("overlap", a.get_text(), b.get_text())
             for (a, ea), (b, eb) in itertools.combinations(extents, 2) if ea.overlaps(eb)]
    boxes = [p.get_window_extent(renderer) for p in fig.axes[0].patches if isinstance(p, FancyBboxPatch)]
    for text, e in extents:
        for b in boxes:
            inside = b.x0 + 2 <= e.x0 and e.x1 <= b.x1 - 2 and b.y0 + 1 <= e.y0 and e.y1 <= b.y1 - 1
            if b.contains((e.x0 + e.x1) / 2, (e.y0 + e.y1) / 2) and not inside:
                found.append(("spills", text.get_text()))
    return found


# ------------------------------------------------------------------------- all of them

def every_diagram():
    return [diagrams.attention_diagram(1, 5, 5, 384, 384),
            diagrams.heads_diagram(1, 5, 768, 12),
            diagrams.layer_diagram("encoder", (True, False)),
            diagrams.layer_diagram("decoder", (True, False)),
            diagrams.encoder_decoder_diagram(list("8668436"), ["<bos>", "6", "3", "4"]),
            diagrams.decoder_only_diagram(),
            diagrams.hybrid_diagram(Qwen35Config(**TOY))]


COLUMN_PX = 760  # the book's text column: a wider PNG is shown scaled down to this width


def smallest_text_px(fig):
    """The smallest text's font size in pixels once the diagram's PNG is scaled to the column."""
    png = fig._repr_png_()
    width_px = int.from_bytes(png[16:20], "big")  # the PNG header's IHDR width
    return min(t.get_fontsize() for t in texts(fig)) * fig.dpi / 72 * min(1.0, COLUMN_PX / width_px)


def test_sizes_fonts_and_determinism():
    first, second = every_diagram(), every_diagram()
    for fig, again in zip(first, second):
        width, height = fig.get_size_inches()
        assert width <= 11 and height <= 9, (width, height)
        assert min(t.get_fontsize() for t in texts(fig)) >= 8
        assert [(t.get_text(), xy(t)) for t in texts(fig)] == [(t.get_text(), xy(t)) for t in texts(again)]


@pytest.mark.parametrize("draw", [
    pytest.param(lambda: diagrams.attention_diagram(1, 5, 5, 384, 384), id="attention"),
    pytest.param(lambda: diagrams.heads_diagram(1, 5, 768, 12), id="heads"),
    pytest.param(lambda: diagrams.layer_diagram("encoder", (True, False)), id="encoder-layers"),
    pytest.param(lambda: diagrams.layer_diagram("decoder", (True, False)), id="decoder-layers"),
    pytest.param(lambda: diagrams.layer_diagram("encoder", (True, False), embeddings=True), id="encoder"),
    pytest.param(lambda: diagrams.encoder_decoder_diagram(list("8668436"), ["<bos>", "6", "3", "4"]),
                 id="encoder-decoder"),
    pytest.param(lambda: diagrams.decoder_only_diagram(), id="decoder-only"),
    pytest.param(lambda: diagrams.hybrid_diagram(Qwen35Config(**TOY)), id="hybrid"),
    pytest.param(lambda: diagrams.hybrid_diagram(Qwen35Config()), id="hybrid-default"),
])
def test_every_diagram_is_legible_at_the_book_column_width(draw):
    """The smallest text is at least 9 px high once the PNG is scaled down to the text column."""
    assert smallest_text_px(draw()) >= 9


def test_a_diagram_shows_itself_as_a_png_in_jupyter():
    png = diagrams.heads_diagram(1, 5, 768, 12)._repr_png_()
    assert png.startswith(b"\x89PNG") and len(png) < 150_000, len(png)


def test_matplotlib_stays_optional_for_tfcore():
    """No tfcore module but diagrams imports matplotlib, and the package does not import diagrams."""
    for path in TFCORE.glob("*.py"):
        if path.name == "diagrams.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] + [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("matplotlib") or n == "diagrams" or n.endswith(".diagrams") for n in names), \
                (path.name, names)
