"""tfcore.moe: gates, experts, the Mixtral and DeepSeek-V3 ports, the auxiliary loss, each test shown
to catch a planted bug (a gate renormalised over the wrong set, a shared expert added with the routed
gates, a token's second choice skipped or a token counted twice, an expert's output scattered to the
wrong rows, an auxiliary loss off from transformers', an expert that takes one pair over its capacity),
and the ports checked in float64 on configurations whose every option differs from the default."""

import pytest
import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import tfcore
from tfcore import moe
from tfcore.moe import (DeepseekV3WithExperts, Experts, Mixtral, SparseMoeBlock, expert_capacity,
                        load_balancing_loss, moe_blocks, sigmoid_topk, softmax_topk, tokens_per_expert,
                        update_choice_bias, within_capacity)

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


@pytest.mark.parametrize("bug", ["second choice skipped", "twice", "wrong rows"])
def test_second_choice_skipped_doubled_or_scattered_are_caught(mixtral, monkeypatch, bug):
    ours = Mixtral.from_transformers(mixtral)

    def broken(self, x, indices, weights):
        out = torch.zeros_like(x)
        for e, expert in enumerate(self):
            rows, slot = torch.where(indices == e)
            if bug == "second choice skipped":  # only each token's first choice runs
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


def test_ports_equal_transformers_in_float64_with_every_option_changed():
    # Every option away from its default, every parameter random (norms included, DeepSeek's choice
    # bias too), transformers' eager experts (its grouped matmul takes no float64). rms_norm_eps
    # stays at DeepSeek's default: transformers 5.23 gives its latent norms eps 1e-6 whatever the
    # config says, where tfcore.mla reads rms_norm_eps (a chapter 19 matter).
    torch.manual_seed(2)
    mixtral = widen(transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=96, max_position_embeddings=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_local_experts=6, num_experts_per_tok=3,
        sliding_window=None, rms_norm_eps=1e-3, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        hidden_act="gelu", tie_word_embeddings=True, experts_implementation="eager", bos_token_id=None,
        eos_token_id=None, pad_token_id=None)).double().eval())  # drawn in float64
    deepseek = widen(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=96, max_position_embeddings=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, n_routed_experts=8,
        num_experts_per_tok=3, n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=1.7,
        attention_bias=True, rope_interleave=False, hidden_act="gelu", norm_topk_prob=False,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 700.0},
        experts_implementation="eager", bos_token_id=None, eos_token_id=None, pad_token_id=None)).double().eval())
    for cls, reference in ((Mixtral, mixtral), (DeepseekV3WithExperts, deepseek)):
        ours = cls.from_transformers(reference)
        assert next(ours.parameters()).dtype == torch.float64
        assert gap(ours, reference) < 1e-10
        with torch.no_grad():
            assert reference(IDS).logits.abs().max() > 1  # logits large enough that a gap would show
    wrong = Mixtral.from_transformers(mixtral)
    with torch.no_grad():
        wrong.layers[0].post_attention_layernorm.weight.fill_(1.0)  # a norm weight left at its default
    assert gap(wrong, mixtral) > 1e-3


def overflow(indices, num_experts, capacity):
    return (tokens_per_expert(indices, num_experts) - capacity).clamp(min=0)


def test_capacity_keeps_the_first_pairs_of_each_expert_and_drops_the_rest():
    assert expert_capacity(1024, 8, 2, 1.0) == 256 and expert_capacity(1024, 8, 2, 1.25) == 320
    assert expert_capacity(10, 8, 2, 1.0) == 2  # 2.5, rounded down
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 6, generator=generator) + torch.tensor([2.0, 1, 0, 0, 0, -1])  # uneven loads
    _, indices = softmax_topk(logits, 2)
    for capacity in (0, 20, 100, 1000):
        keep = within_capacity(indices, 6, capacity)
        kept = torch.bincount(indices[keep], minlength=6)
        assert torch.equal(kept, tokens_per_expert(indices, 6).clamp(max=capacity))
        assert (~keep).sum() == overflow(indices, 6, capacity).sum()
        for e in range(6):  # an expert keeps a prefix of its queue: first choices, then second, in token order
            queue = torch.cat([keep[:, 0][indices[:, 0] == e], keep[:, 1][indices[:, 1] == e]])
            assert torch.equal(queue, torch.arange(len(queue)) < capacity)
    assert overflow(indices, 6, 50).sum() > 0  # the loads are uneven enough for drops to happen


def test_capacity_equals_switch_transformers_router_for_one_expert_per_token():
    from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersTop1Router

    config = transformers.SwitchTransformersConfig(d_model=16, num_experts=4, expert_capacity=5,
                                                   router_jitter_noise=0.0)
    router = SwitchTransformersTop1Router(config).eval()
    torch.manual_seed(3)
    torch.nn.init.normal_(router.classifier.weight, std=1.0)
    x = torch.randn(3, 24, 16)
    with torch.no_grad():
        dispatch, _, logits = router(x)  # [B, L, E], over-capacity tokens masked out, per sequence
    for b in range(3):
        chosen = logits[b].argmax(-1, keepdim=True)  # [L, 1]
        keep = within_capacity(chosen, 4, 5)[:, 0]
        assert torch.equal(dispatch[b].sum(-1).bool(), keep)
        assert not keep.all()  # some token was over capacity: the comparison can see a difference


def test_block_with_capacity_runs_no_expert_on_a_dropped_pair(monkeypatch):
    torch.manual_seed(4)
    block = SparseMoeBlock(16, 4, 2, 24, capacity_factor=1.0).eval()
    torch.nn.init.normal_(block.gate.weight, std=1.0)
    x = torch.randn(2, 20, 16)
    with torch.no_grad():
        out = block(x)
        flat = x.reshape(-1, 16)
        _, weights, indices = block.route(flat)
        reference = block.experts(flat, indices, weights * ~block.dropped).view_as(x)
        assert block.dropped.sum() == overflow(indices, 4, expert_capacity(40, 4, 2, 1.0)).sum() > 0
        assert (out - reference).abs().max() < 1e-6
        block.capacity_factor = 4.0  # room for every pair: the block as without capacity
        roomy = block(x)
        assert not block.dropped.any()
        block.capacity_factor = None
        assert (block(x) - roomy).abs().max() == 0
        assert (out - roomy).abs().max() > 1e-3  # the drops did change the output
        block.capacity_factor = 1.0
        # a planted bug: each expert takes one pair over its capacity
        monkeypatch.setattr(moe, "within_capacity", lambda i, e, c: within_capacity(i, e, c + 1))
        assert (block(x) - out).abs().max() > 1e-3


def test_capacity_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(10, 4, 1, 0.0)
    with pytest.raises(ValueError, match="capacity_factor"):
        SparseMoeBlock(8, 4, 1, 8, capacity_factor=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        expert_capacity(10, 4, 5, 1.0)
    with pytest.raises(ValueError, match="capacity"):
        within_capacity(torch.zeros(3, 1, dtype=torch.long), 4, -1)
    with pytest.raises(ValueError, match="expert indices"):
        within_capacity(torch.tensor([[0], [4]]), 4, 2)
