"""tfcore.static_decoding: the static-cache decoder gives tfcore.generate's tokens (float32 and float64,
fixed shapes or not, oneDNN-packed weights or not), its recording bookkeeping works with a stand-in
recorder on the CPU, and planted bugs are caught. torch.compile and CUDA graphs are not run here."""

import pytest
import torch

import tfcore
from tfcore.static_decoding import PackedLinear, StaticDecoder, cuda_graph_step, decode, static_generate

ONEDNN = PackedLinear(torch.zeros(2, 2)).packed  # float32 on a CPU with oneDNN


def small_gpt(dtype=torch.float64, seed=0, **overrides):
    """A GPT with options off GPT-2's defaults and every parameter drawn at random (norms and biases
    too), weights large enough that greedy decoding does not repeat one token."""
    torch.manual_seed(seed)
    config = dict(vocab_size=97, max_position_embeddings=48, hidden_size=24, num_hidden_layers=3,
                  num_attention_heads=4, intermediate_size=40, layer_norm_eps=1e-4, hidden_dropout_prob=0.3,
                  attention_probs_dropout_prob=0.2)
    model = tfcore.GPT(tfcore.GPTConfig(**(config | overrides))).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embeddings.weight"):  # large positions: the output varies (checked below)
                p.normal_(0, 3.0 if name.startswith("position") else 0.3)
            elif p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
            else:
                p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.3)
    return model.eval()


def prompt(batch=2, length=5, vocab=97, seed=1):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fixed_shape", [False, True])
def test_tokens_equal_tfcore_generate(dtype, fixed_shape):
    model, ids = small_gpt(dtype), prompt()
    expected = tfcore.generate(model, ids, 40)
    assert len(set(expected[:, 5:].flatten().tolist())) >= 10  # a varied output gives equality its teeth
    assert torch.equal(static_generate(model, ids, 40, fixed_shape=fixed_shape), expected)


@pytest.mark.skipif(not ONEDNN, reason="oneDNN's reordered weights need float32 on a CPU with oneDNN")
def test_packed_and_plain_weights_give_the_same_tokens():
    model, ids = small_gpt(torch.float32), prompt()
    expected = tfcore.generate(model, ids, 40)
    for pack in (True, False):
        decoder = StaticDecoder(model, 2, 44, pack=pack)
        assert decoder.lm_head.packed is pack and decoder.blocks[0].qkv.weight.is_mkldnn is pack
        assert torch.equal(decode(decoder, decoder, ids, 40), expected)


def test_other_activation_and_untied_output_layer():
    model = small_gpt(torch.float64, hidden_act="relu", tie_word_embeddings=False)
    ids = prompt(batch=1, length=3)
    assert torch.equal(static_generate(model, ids, 30), tfcore.generate(model, ids, 30))


@pytest.mark.parametrize("fixed_shape", [False, True])
def test_logits_equal_the_model_s_in_float64(fixed_shape):
    """Stronger than tokens: the prompt's logits and each step's logits equal a full forward pass."""
    model, ids = small_gpt(), prompt(length=9)
    decoder = StaticDecoder(model, 2, 9, fixed_shape=fixed_shape)
    with torch.no_grad():
        full = model(ids)
        first = decoder(ids[:, :6], torch.arange(6))
        steps = [decoder(ids[:, i:i + 1], torch.tensor([i])) for i in range(6, 9)]
    assert (first - full[:, :6]).abs().max() < 1e-10
    assert (torch.cat(steps, dim=1) - full[:, 6:]).abs().max() < 1e-10


def test_unfilled_slots_are_masked():
    """Fixed shapes read every slot: whatever the empty ones hold must not matter."""
    model, ids = small_gpt(), prompt()
    decoder = StaticDecoder(model, 2, 44, fixed_shape=True)
    for block in decoder.blocks:
        block.keys.fill_(1e3)
        block.values.normal_(0, 1e3)
    assert torch.equal(decode(decoder, decoder, ids, 40), tfcore.generate(model, ids, 40))


def test_planted_bug_unmasked_slots_are_caught(monkeypatch):
    """A step that forgets the mask of the filled slots attends to the empty (zero) ones."""
    model, ids = small_gpt(), prompt()
    expected = tfcore.generate(model, ids, 40)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, attn_mask=None: sdpa(q, k, v))
    assert not torch.equal(static_generate(model, ids, 40, fixed_shape=True), expected)


def test_planted_bug_query_not_seeing_itself_is_caught():
    """``slot < position`` instead of ``<=``: shifting the slot numbers by one plants it."""
    model, ids = small_gpt(), prompt()
    decoder = StaticDecoder(model, 2, 44, fixed_shape=True)
    decoder.slots += 1
    assert not torch.equal(decode(decoder, decoder, ids, 40), tfcore.generate(model, ids, 40))


def test_planted_bug_positions_off_by_one_are_caught():
    model, ids = small_gpt(), prompt()
    decoder = StaticDecoder(model, 2, 45)
    shifted = decoder.position_embeddings.weight.detach().roll(-1, dims=0)  # row p holds position p + 1
    decoder.position_embeddings = torch.nn.Embedding.from_pretrained(shifted)
    assert not torch.equal(decode(decoder, decoder, ids, 40), tfcore.generate(model, ids, 40))


def test_planted_bug_missing_bias_is_caught():
    model, ids = small_gpt(), prompt()
    decoder = StaticDecoder(model, 2, 44)
    decoder.blocks[1].qkv.bias = None
    assert not torch.equal(decode(decoder, decoder, ids, 40), tfcore.generate(model, ids, 40))


def _stand_in_recorder(calls):
    """What ``record_cuda_graph`` returns, on the CPU: a replay that runs the step again into the
    recorded output tensor (the same tensor every time, as a CUDA graph's output is)."""
    def record(fn):
        for _ in range(3):  # the warm-up, as record_cuda_graph runs it
            fn()
        output = fn()
        calls.append("recorded")

        def replay():
            calls.append("replay")
            output.copy_(fn())
        return replay, output
    return record


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_recorded_step_bookkeeping_on_the_cpu(dtype):
    """Inputs copied into the recording's tensors, one output tensor reused, recorded before the
    prompt (the recording writes position 0): the tokens equal tfcore.generate's."""
    model, ids = small_gpt(dtype), prompt()
    decoder = StaticDecoder(model, 2, 44, fixed_shape=True)
    calls = []
    step = cuda_graph_step(decoder, record=_stand_in_recorder(calls))
    assert torch.equal(decode(decoder, step, ids, 40), tfcore.generate(model, ids, 40))
    assert calls == ["recorded"] + ["replay"] * 39


def test_planted_bug_recording_after_the_prompt_is_caught():
    """Recording after the prompt: the recording's warm-up and dummy step overwrite position 0."""
    model, ids = small_gpt(), prompt()
    decoder = StaticDecoder(model, 2, 44, fixed_shape=True)
    recorded = []

    def late_step(tokens, position):  # records at the first step, after decode has run the prompt
        if not recorded:
            recorded.append(cuda_graph_step(decoder, record=_stand_in_recorder([])))
        return recorded[0](tokens, position)

    assert not torch.equal(decode(decoder, late_step, ids, 40), tfcore.generate(model, ids, 40))


def test_zero_and_one_new_tokens():
    model, ids = small_gpt(), prompt(length=1)
    assert torch.equal(static_generate(model, ids, 0), ids)
    assert torch.equal(static_generate(model, ids, 1), tfcore.generate(model, ids, 1))


def test_bad_input_names_the_fix():
    model, ids = small_gpt(), prompt()
    with pytest.raises(TypeError, match="tfcore.GPT"):
        StaticDecoder(tfcore.Llama(tfcore.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
                                                      num_hidden_layers=1, num_attention_heads=2)), 1, 4)
    with pytest.raises(ValueError, match="exceeds the model's 48 positions"):
        StaticDecoder(model, 1, 49)
    with pytest.raises(ValueError, match="batch must be a whole number"):
        StaticDecoder(model, 0, 4)
    with pytest.raises(ValueError, match="ask for at most 43 new tokens"):
        static_generate(model, ids, 44)
    with pytest.raises(ValueError, match="records CUDA graphs: move the model"):
        static_generate(model, ids, 4, graph="cuda-graph")
    with pytest.raises(ValueError, match="graph must be None"):
        static_generate(model, ids, 4, graph="cudagraph")
    with pytest.raises(ValueError, match=r"\[B, L\] tensor of token ids"):
        static_generate(model, ids.float(), 4)
    with pytest.raises(ValueError, match=r"lie in \[0, 97\)"):
        static_generate(model, ids + 97, 4)
    with pytest.raises(ValueError, match="max_new_tokens must be a whole number"):
        static_generate(model, ids, -1)
    with pytest.raises(ValueError, match="fixed_shape=True"):
        cuda_graph_step(StaticDecoder(model, 2, 8, fixed_shape=False))
