"""tfcore.lora: LoRA written out equals peft's LoRA (outputs and merged weights), starts exactly at the
base model, draws A as peft does; each check shown to catch a planted bug."""

import copy
import math

import pytest
import torch
from torch import nn

import tfcore
import tfcore.lora as lora

CONFIG = dict(vocab_size=40, max_position_embeddings=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
TARGETS = ["query", "value"]


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return tfcore.GPT(tfcore.GPTConfig(**CONFIG)).eval()


IDS = torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(1))


def _peft_pair(base, r=4, alpha=8):
    """Our adapted model and peft's, with peft's A and non-zero B copied into ours."""
    from peft import LoraConfig, get_peft_model

    ours = lora.add_lora(copy.deepcopy(base), TARGETS, r=r, alpha=alpha)
    theirs = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, m in theirs.named_modules():
            if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {}):
                m.lora_B["default"].weight.copy_(torch.randn(m.lora_B["default"].weight.shape, generator=g))
                mine = ours.get_submodule(name.removeprefix("base_model.model."))
                mine.lora_A.weight.copy_(m.lora_A["default"].weight)
                mine.lora_B.weight.copy_(m.lora_B["default"].weight)
    return ours, theirs


def _output_gap(base):
    ours, theirs = _peft_pair(base)
    with torch.no_grad():
        return (ours(IDS) - theirs(IDS)).abs().max().item(), (ours(IDS) - base(IDS)).abs().max().item()


def _merge_gap(base):
    ours, theirs = _peft_pair(base)
    a, b = lora.merge_lora(ours).state_dict(), theirs.merge_and_unload().state_dict()
    assert list(a) == list(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_outputs_equal_peft(base):
    gap, moved = _output_gap(base)
    assert gap < 1e-6 and moved > 0.1  # equal, and the adapters do change the model


def test_planted_bug_wrong_scaling_is_caught(base, monkeypatch):
    monkeypatch.setattr(lora.LoRALinear, "forward",
                        lambda self, x: self.base_layer(x) + self.alpha * self.lora_B(self.lora_A(x)))  # alpha, not alpha / r
    assert _output_gap(base)[0] > 1e-3


def test_merged_weights_equal_merge_and_unload(base):
    assert _merge_gap(base) < 1e-6


def test_planted_bug_merge_without_scaling_is_caught(base, monkeypatch):
    def merged(self):
        linear = nn.Linear(self.base_layer.in_features, self.base_layer.out_features)
        with torch.no_grad():
            linear.weight.copy_(self.base_layer.weight + self.lora_B.weight @ self.lora_A.weight)  # forgets the scaling
            linear.bias.copy_(self.base_layer.bias)
        return linear

    monkeypatch.setattr(lora.LoRALinear, "merged", merged)
    assert _merge_gap(base) > 1e-3


def _starts_at_base(base):
    adapted = lora.add_lora(copy.deepcopy(base), TARGETS, r=4)
    with torch.no_grad():
        return torch.equal(adapted(IDS), base(IDS))


def test_b_zero_starts_exactly_at_the_base_model(base):
    assert _starts_at_base(base)


def test_planted_bug_b_initialised_non_zero_is_caught(base, monkeypatch):
    monkeypatch.setattr(lora.nn.init, "zeros_", lambda t: nn.init.normal_(t, std=0.02))
    assert not _starts_at_base(base)


def _same_a_as_peft(base):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    ours = lora.add_lora(copy.deepcopy(base), TARGETS, r=4)
    torch.manual_seed(5)
    theirs = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    return all(torch.equal(ours.get_submodule(n.removeprefix("base_model.model.")).lora_A.weight, m.lora_A["default"].weight)
               for n, m in theirs.named_modules() if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {}))


def test_a_is_drawn_as_peft_draws_it(base):
    assert _same_a_as_peft(base)


def test_planted_bug_gaussian_a_is_caught(base, monkeypatch):
    original = lora.LoRALinear.__init__

    def gaussian_a(self, *args, **kwargs):  # A drawn normal(0, 1/r) instead of peft's default
        original(self, *args, **kwargs)
        nn.init.normal_(self.lora_A.weight, std=1 / self.r)

    monkeypatch.setattr(lora.LoRALinear, "__init__", gaussian_a)
    assert not _same_a_as_peft(base)


def test_only_the_adapters_train_and_the_count_is_right(base):
    adapted = lora.add_lora(copy.deepcopy(base), TARGETS, r=4)
    trainable, total = lora.count_parameters(adapted)
    d = CONFIG["hidden_size"]
    assert trainable == 2 * 2 * 4 * (d + d)  # 2 blocks x (query, value) x r (d_in + d_out)
    assert total == lora.count_parameters(base)[1] + trainable
    assert all(("lora_" in n) == p.requires_grad for n, p in adapted.named_parameters())


def test_clear_errors():
    layer = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="rank r must be a whole number >= 1"):
        lora.LoRALinear(layer, r=0)
    with pytest.raises(ValueError, match="no module of the model is named"):
        lora.add_lora(tfcore.GPT(tfcore.GPTConfig(**CONFIG)), ["q_proj"])
    with pytest.raises(TypeError, match="wraps an nn.Linear"):
        lora.LoRALinear(nn.Embedding(3, 4))
    assert math.isclose(lora.LoRALinear(layer, r=2, alpha=8).scaling, 4.0)
