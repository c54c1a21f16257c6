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


# ---------------------------------------------------------------------------------------------
# float64, every parameter random, every option off its default, and modules_to_save

ALL_LINEAR = ["query", "key", "value", "output_linear", "linear_1", "linear_2"]
SAVED = ["token_embeddings", "lm_head"]


def _random_double(base):
    """A float64 copy of ``base`` with every parameter drawn at random: norm weights around 1, biases and
    the tied embedding away from 0, so that a parameter copied wrong or left out shows."""
    model = copy.deepcopy(base).double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g, dtype=p.dtype))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _ours(peft_name):
    """peft's name of a parameter -> ours: no wrapper prefix, no adapter name, no saved-module dict."""
    return peft_name.removeprefix("base_model.model.").replace(".modules_to_save.default", "").replace(".default", "")


def _double_pair(base, add=lora.add_lora):
    """Ours and peft's on a float64 model with every parameter random: r = 4 and alpha = 12 (peft's
    defaults are 8 and 8), every Linear of the blocks adapted, embeddings and head in modules_to_save,
    every B drawn non-zero and each saved module moved in peft's model, and all of it copied into ours."""
    from peft import LoraConfig, get_peft_model

    model = _random_double(base)
    ours = add(copy.deepcopy(model), ALL_LINEAR, r=4, alpha=12, modules_to_save=SAVED)
    theirs = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=12, target_modules=ALL_LINEAR,
                                                             modules_to_save=list(SAVED), lora_dropout=0.0))
    g = torch.Generator().manual_seed(4)
    mine = dict(ours.named_parameters())
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if p.requires_grad:
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
                if "modules_to_save" in name:  # each saved copy moved off the original, differently
                    p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
                if _ours(name) in mine:  # a model with a tied head lists it once
                    mine[_ours(name)].copy_(p)
    return ours, theirs


def _train(model, steps=3):
    """A few AdamW steps on the trainable parameters, the same batches for every model."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        ids = torch.randint(0, 40, (4, 12), generator=g)
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return model(IDS)


def test_float64_every_parameter_random_equals_peft(base):
    ours, theirs = _double_pair(base)
    assert sorted(n for n, p in ours.named_parameters() if p.requires_grad) == \
        sorted(_ours(n) for n, p in theirs.named_parameters() if p.requires_grad)
    with torch.no_grad():
        assert (ours(IDS) - theirs(IDS)).abs().max().item() < 1e-10
        assert (ours(IDS) - _random_double(base)(IDS)).abs().max().item() > 0.1  # the adapters do act
    assert (_train(ours) - _train(theirs)).abs().max().item() < 1e-10  # the same trainable set
    a, b = lora.merge_lora(ours).state_dict(), theirs.merge_and_unload().state_dict()
    assert list(a) == list(b) and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-10


def test_modules_to_save_unties_the_embeddings_and_head_as_peft_does(base):
    """peft copies each saved module: the tied head gets a weight of its own; name only the embeddings
    and the head stays frozen. Ours does the same."""
    ours = lora.add_lora(copy.deepcopy(base), TARGETS, r=4, modules_to_save=SAVED)
    assert ours.token_embeddings.weight is not ours.lm_head.weight
    assert ours.token_embeddings.weight.requires_grad and ours.lm_head.weight.requires_grad
    only_embeddings = lora.add_lora(copy.deepcopy(base), TARGETS, r=4, modules_to_save=["token_embeddings"])
    assert not only_embeddings.lm_head.weight.requires_grad


def test_planted_bug_saved_modules_kept_tied_is_caught(base):
    def tied(model, targets, r, alpha, modules_to_save):  # trains the shared weight in place: still tied
        lora.add_lora(model, targets, r=r, alpha=alpha)
        model.token_embeddings.weight.requires_grad_(True)
        return model

    ours, theirs = _double_pair(base, add=tied)
    with torch.no_grad():
        assert (ours(IDS) - theirs(IDS)).abs().max().item() > 1e-3  # peft's head is its own copy


def test_clear_errors_for_modules_to_save(base):
    with pytest.raises(ValueError, match="which no module of the model is named"):
        lora.add_lora(copy.deepcopy(base), TARGETS, modules_to_save=["embed_tokens"])
    with pytest.raises(ValueError, match="in both target_modules and modules_to_save"):
        lora.add_lora(copy.deepcopy(base), TARGETS, modules_to_save=["query"])
    with pytest.raises(ValueError, match="inside a module trained in full"):
        lora.add_lora(copy.deepcopy(base), TARGETS, modules_to_save=["attention"])
