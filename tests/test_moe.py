"""tfcore.moe: gates, experts, the Mixtral and DeepSeek-V3 ports, the auxiliary loss, each test shown
to catch a planted bug (a gate renormalised over the wrong set, a shared expert added with the routed
gates, a token dropped or counted twice, an expert's output scattered to the wrong rows, an
auxiliary loss off from transformers')."""

import pytest
import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import tfcore
from tfcore import moe
from tfcore.moe import (DeepseekV3WithExperts, Experts, Mixtral, SparseMoeBlock, load_balancing_loss, moe_blocks,
                        sigmoid_topk, softmax_topk, tokens_per_expert, update_choice_bias)

from ports import widen

transformers.utils.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def mixtral():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=96, max_position_embeddings=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2,
        sliding_window=None, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return widen(transformers.MixtralForCausalLM(config).eval())


@pytest.fixture(scope="module")
def deepseek():
    torch.manual_seed(1)
    config = transformers.DeepseekV3Config(
        vocab_size=96, max_position_embeddings=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return widen(transformers.DeepseekV3ForCausalLM(config).eval())


IDS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))


def gap(ours, reference):
    with torch.no_grad():
        return (ours(IDS) - reference(IDS).logits).abs().max().item()


def test_ports_equal_transformers_logits_and_greedy_tokens(mixtral, deepseek):
    prompt = IDS[:, :5]
    for cls, reference in ((Mixtral, mixtral), (DeepseekV3WithExperts, deepseek)):
        ours = cls.from_transformers(reference)
        assert gap(ours, reference) < 1e-4
        theirs = reference.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert torch.equal(tfcore.generate(ours, prompt, 12), theirs)
        assert len(set(theirs[:, 5:].flatten().tolist())) >= 5  # the tokens vary: the test can see a difference


def test_gate_renormalised_over_the_wrong_set_is_caught(mixtral, deepseek, monkeypatch):
    def no_renormalisation(logits, k, bias=None):  # softmax over all experts, top k, not renormalised
        probs = logits.float().softmax(dim=-1)
        weights, indices = probs.topk(k, dim=-1)
        return weights, indices

    def softmax_of_chosen(logits, k, bias=None, n_group=1, topk_group=1, norm_topk_prob=True,
                          routed_scaling_factor=1.0):  # softmax over the chosen logits where DeepSeek normalises sigmoids
        _, indices = sigmoid_topk(logits, k, bias, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
        return logits.float().gather(1, indices).softmax(dim=-1) * routed_scaling_factor, indices

    right_mixtral, right_deepseek = Mixtral.from_transformers(mixtral), DeepseekV3WithExperts.from_transformers(deepseek)
    assert gap(right_mixtral, mixtral) < 1e-4 and gap(right_deepseek, deepseek) < 1e-4
    monkeypatch.setattr(moe, "softmax_topk", no_renormalisation)
    monkeypatch.setattr(moe, "sigmoid_topk", softmax_of_chosen)
    assert gap(right_mixtral, mixtral) > 1e-2
    assert gap(right_deepseek, deepseek) > 1e-2


def test_mixtral_order_equals_softmax_of_the_top_k_logits():
    logits = torch.randn(50, 8)
    weights, indices = softmax_topk(logits, 2)
    assert torch.allclose(weights, logits.gather(1, indices).softmax(dim=-1), atol=1e-6)
    assert torch.allclose(weights.sum(-1), torch.ones(50))


def test_group_limited_routing_stays_in_the_chosen_groups():
    logits = torch.randn(200, 16)
    _, indices = sigmoid_topk(logits, 4, n_group=4, topk_group=2)
    assert all(len(set((row // 4).tolist())) <= 2 for row in indices)
    _, free = sigmoid_topk(logits, 4, n_group=1, topk_group=1)
    assert any(len(set((row // 4).tolist())) > 2 for row in free)  # without the limit some rows use 3+ groups


def test_shared_expert_added_with_the_routed_gates_is_caught(deepseek, monkeypatch):
    ours = DeepseekV3WithExperts.from_transformers(deepseek)

    def gated_shared(self, x):  # the shared expert scaled by the routed gates' sum, as if it were routed
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        self.router_logits, weights, self.indices = self.route(flat)
        out = self.experts(flat, self.indices, weights).view(shape)
        return out + self.shared_experts(x) * weights.sum(-1).view(*shape[:-1], 1)

    assert gap(ours, deepseek) < 1e-4
    monkeypatch.setattr(SparseMoeBlock, "forward", gated_shared)
    assert gap(ours, deepseek) > 1e-2


@pytest.mark.parametrize("bug", ["dropped", "twice", "wrong rows"])
def test_tokens_dropped_doubled_or_scattered_are_caught(mixtral, monkeypatch, bug):
    ours = Mixtral.from_transformers(mixtral)

    def broken(self, x, indices, weights):
        out = torch.zeros_like(x)
        for e, expert in enumerate(self):
            rows, slot = torch.where(indices == e)
            if bug == "dropped":  # only each token's first choice runs: its second expert is dropped
                keep = slot == 0
                rows, slot = rows[keep], slot[keep]
            if len(rows):
                y = expert(x[rows]) * weights[rows, slot, None]
                if bug == "twice":  # a token's contribution added twice
                    y = torch.cat([y, y[:1]])
                    rows = torch.cat([rows, rows[:1]])
                if bug == "wrong rows":  # the outputs scattered back in the wrong order
                    rows = rows.flip(0)
                out.index_add_(0, rows, y)
        return out

    assert gap(ours, mixtral) < 1e-4
    monkeypatch.setattr(Experts, "forward", broken)
    assert gap(ours, mixtral) > 1e-2


def test_aux_loss_equals_transformers_and_a_wrong_one_is_caught(mixtral):
    ours = Mixtral.from_transformers(mixtral)
    with torch.no_grad():
        theirs = mixtral(IDS, output_router_logits=True)
        ours(IDS)
    logits = [block.router_logits for block in moe_blocks(ours)]
    reference = load_balancing_loss_func(theirs.router_logits, 6, 2)
    assert abs(load_balancing_loss(logits, 2).item() - reference.item()) < 1e-5
    assert abs(load_balancing_loss(logits, 1).item() - reference.item()) > 1e-2  # f from top-1: off
    uniform = torch.zeros(10, 6)
    assert abs(load_balancing_loss([uniform], 2).item() - 2.0) < 1e-6  # uniform routing: k


def test_bias_update_raises_the_underloaded():
    block = SparseMoeBlock(8, 4, 1, 8, "softmax", choice_bias=True)
    block(torch.randn(1, 40, 8))
    load = update_choice_bias(block, 0.1)
    assert torch.equal(load, tokens_per_expert(block.indices, 4).float())
    assert torch.equal(block.bias > 0, load < load.mean()) and torch.equal(block.bias < 0, load > load.mean())


def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match="gating"):
        SparseMoeBlock(8, 4, 1, 8, "relu")
    with pytest.raises(ValueError, match="top_k"):
        SparseMoeBlock(8, 4, 5, 8)
    with pytest.raises(ValueError, match="n_group"):
        sigmoid_topk(torch.randn(3, 6), 2, n_group=4)
    with pytest.raises(TypeError, match="MixtralForCausalLM"):
        Mixtral.from_transformers(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)))
