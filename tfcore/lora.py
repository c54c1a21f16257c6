"""LoRA: a low-rank adapter beside a frozen linear layer (Hu et al., 2021), written out (chapter 25).

``LoRALinear`` computes ``W x + b + (alpha / r) * B(A(x))`` with ``W, b`` frozen, ``A [r, in]`` drawn
as ``peft`` draws it by default (Kaiming-uniform with ``a = sqrt(5)``, nn.Linear's own draw) and
``B [out, r]`` zeros, so that the adapted model starts exactly at the base model. The names follow
``peft``'s LoRA layer: ``base_layer``, ``lora_A``, ``lora_B``, ``scaling`` (peft keeps one of each per
adapter, in a dict under the adapter's name, ``"default"``).

Scope, checked equal to peft 0.21.2 (``tests/test_lora.py``, in float32 and float64): ``LoraConfig``'s
``r``, ``lora_alpha``, ``target_modules`` and ``modules_to_save``, with ``lora_dropout=0``,
``bias="none"`` and the default initialisation. Not covered: dropout on the adapter's input, trained
biases, rsLoRA's ``alpha / sqrt(r)``, DoRA and the other initialisations; ``add_lora`` has no argument
for them. Names are matched by their last dotted part (peft matches a suffix of the whole name).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

__all__ = ["LoRALinear", "add_lora", "merge_lora", "count_parameters"]


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus ``scaling * lora_B(lora_A(x))``: ``x [..., in]`` -> ``[..., out]``.

    ``lora_A``: Linear(in -> r, no bias), ``lora_B``: Linear(r -> out, no bias), ``scaling = alpha / r``.
    """

    def __init__(self, base_layer: nn.Linear, r: int = 8, alpha: float = 8.0):
        super().__init__()
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"LoRALinear wraps an nn.Linear, got {type(base_layer).__name__}")
        if int(r) != r or r < 1:
            raise ValueError(f"the rank r must be a whole number >= 1, got {r}")
        self.base_layer = base_layer.requires_grad_(False)
        self.r, self.alpha, self.scaling = int(r), alpha, alpha / r
        device, dtype = base_layer.weight.device, base_layer.weight.dtype
        self.lora_A = nn.Linear(base_layer.in_features, self.r, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(self.r, base_layer.out_features, bias=False, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # peft's default draw for A
        nn.init.zeros_(self.lora_B.weight)  # B = 0: the adapter adds nothing at the start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.scaling * self.lora_B(self.lora_A(x))

    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` with weight ``W + scaling * B A`` ``[out, in]`` and the same bias."""
        base = self.base_layer
        linear = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                           device=base.weight.device, dtype=base.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(base.weight + self.scaling * self.lora_B.weight @ self.lora_A.weight)
            if base.bias is not None:
                linear.bias.copy_(base.bias)
        return linear


def add_lora(model: nn.Module, target_modules, r: int = 8, alpha: float = 8.0,
             modules_to_save=()) -> nn.Module:
    """Freeze every parameter of ``model`` and replace each ``nn.Linear`` whose name (the last part of
    its dotted name, as in peft's ``target_modules``) is in ``target_modules`` by a ``LoRALinear``, in
    place. Returns the model. A clear error when no layer matches or a match is not a Linear.

    ``modules_to_save``: names of modules trained in full beside the adapters, as peft's
    ``modules_to_save``: each is replaced by a trainable copy of itself. Like peft's copy, it has
    parameters of its own: a weight it shared with another module (tied embeddings and output layer)
    is no longer shared, and the module not named stays frozen.
    """
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    if isinstance(modules_to_save, str):
        modules_to_save = [modules_to_save]
    model.requires_grad_(False)
    both = set(target_modules) & set(modules_to_save)
    if both:
        raise ValueError(f"{sorted(both)} is in both target_modules and modules_to_save: a module is either "
                         f"adapted or trained in full")
    to_save = [name for name, _ in model.named_modules() if name.split(".")[-1] in modules_to_save]
    if len({name.split(".")[-1] for name in to_save}) != len(set(modules_to_save)):
        missing = sorted(set(modules_to_save) - {name.split(".")[-1] for name in to_save})
        raise ValueError(f"modules_to_save names {missing}, which no module of the model is named "
                         f"(peft would ignore it silently)")
    matches = [(name, module) for name, module in model.named_modules()
               if name.split(".")[-1] in target_modules and not isinstance(module, LoRALinear)]
    if not matches:
        names = sorted({name.split(".")[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"no module of the model is named {list(target_modules)}; its Linear layers are "
                         f"named {names}")
    inside = [name for name, _ in matches if any(name.startswith(saved + ".") for saved in to_save)]
    if inside:
        raise ValueError(f"{inside} would be adapted inside a module trained in full; name one or the other")
    for name, module in matches:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"{name} is a {type(module).__name__}; LoRA here adapts nn.Linear layers only")
        _replace(model, name, LoRALinear(module, r, alpha))
    for name in to_save:
        _replace(model, name, copy.deepcopy(model.get_submodule(name)).requires_grad_(True))
    return model


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    setattr(parent, name.split(".")[-1], module)


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every ``LoRALinear`` by its ``merged()`` Linear, in place; returns the model."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            _replace(model, name, module.merged())
    return model


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameters, each shared tensor counted once."""
    seen, trainable, total = set(), 0, 0
    for p in model.parameters():  # parameters() yields a shared tensor once
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return trainable, total
