"""int8 weights: per-output-channel symmetric quantisation of Linear layers, from scratch (chapter 22).

Each row ``i`` of a weight ``W [out, in]`` (one output channel) gets its own scale
``s_i = max_j |W_ij| / qmax``; the stored weight is ``round(W_ij / s_i)`` clamped to [-128, 127],
one byte each, and ``s_i * q_ij`` stands in for ``W_ij``. The activations stay in floating point
("weight-only"): ``y = (x @ q^T) * s + b``.

``qmax=127`` maps the largest weight of a row to ±127 (the symmetric range of Dettmers et al.'s
absmax quantisation); ``qmax=127.5`` is the convention of torchao and of PyTorch's observers:
half of the full int8 range (127 - (-128)) / 2, where the largest positive weight rounds to 128
and is clamped to 127.
"""

from __future__ import annotations

import numbers

import torch
from torch import nn


QMAX_LIMIT = 127.5  # the largest weight of a row then rounds to 128 and is clamped to 127: half a step


def _check_qmax(qmax) -> None:
    """``qmax`` in (0, 127.5]: above it, the largest weights of a row land past int8's 127 and the
    clamp moves them by more than half a step."""
    if isinstance(qmax, bool) or not isinstance(qmax, numbers.Real) or not 0 < qmax <= QMAX_LIMIT:
        raise ValueError(f"qmax (the integer a row's largest weight maps to) must lie in (0, {QMAX_LIMIT}], "
                         f"got {qmax!r}: int8 holds -128..127, so a larger qmax clamps the largest weights "
                         f"by more than half a step; use 127 (absmax) or 127.5 (torchao)")


def quantize_per_channel(weight: torch.Tensor, qmax: float = 127.0):
    """``weight [out, in]`` -> ``(q [out, in] int8, scale [out] float32)``, with ``weight ≈ q * scale[:, None]``.

    ``scale = max|w| per row / qmax`` (at least float32's smallest normal, so an all-zero row stays 0);
    ``q = round(w * (1/scale))``, clamped to [-128, 127]. (Multiplying by the reciprocal, as torchao
    does, rather than dividing: the two can round a weight that falls on a half to different sides.)
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        got = f"{tuple(weight.shape)} {weight.dtype}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"expected a floating-point Linear weight [out, in], got {got}")
    _check_qmax(qmax)
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / qmax).clamp(min=torch.finfo(torch.float32).smallest_normal)  # [out]
    q = torch.round(w * (1.0 / scale[:, None])).clamp(-128, 127).to(torch.int8)  # times 1/s, as torchao does
    return q, scale


def _check_quantized(q, scale) -> None:
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.dim() != 2:
        got = f"{tuple(q.shape)} {q.dtype}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be an int8 [out, in] tensor (quantize_per_channel's first output), got {got}")
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point() or scale.shape != q.shape[:1]:
        got = f"{tuple(scale.shape)} {scale.dtype}" if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"scale must be a floating-point tensor with one number per output channel, shape "
                         f"({q.shape[0]},), got {got}")


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q [out, in]`` int8, ``scale [out]`` -> the float weight it stands for, ``[out, in]``."""
    _check_quantized(q, scale)
    return q.float() * scale[:, None]


class Int8Linear(nn.Module):
    """A Linear layer whose weight is stored as int8 with one float32 scale per output channel.

    ``forward(x [..., in])`` -> ``[..., out]``: ``(x @ q^T) * scale + bias``, the activations in
    floating point (int8 weight-only). Build one with ``Int8Linear.from_linear(linear)``.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        _check_quantized(q, scale)
        if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != q.shape[:1]):
            got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"bias must be None or hold one number per output channel, shape ({q.shape[0]},), "
                             f"got {got}")
        self.register_buffer("weight_int8", q)  # [out, in] int8
        self.register_buffer("scale", scale)  # [out] float32
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = q.shape[1], q.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear, qmax: float = 127.0) -> "Int8Linear":
        q, scale = quantize_per_channel(linear.weight, qmax)
        return cls(q, scale, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self.in_features \
                or not x.is_floating_point():
            got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be a floating-point [..., {self.in_features}] tensor (in_features), got {got}")
        y = torch.mm(x.reshape(-1, self.in_features), self.weight_int8.t().to(x.dtype))
        y = (y * self.scale.to(y.dtype)).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight"


def quantize_linears(model: nn.Module, qmax: float = 127.0, skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` of ``model`` by an ``Int8Linear``, except those whose
    name ends with one of ``skip`` (by default the output layer, which a GPT ties to its token
    embeddings). Returns the model."""
    _check_qmax(qmax)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and not name.endswith(skip):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, Int8Linear.from_linear(module, qmax))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model``, each shared tensor counted once."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
